"""The C library from the outside, on any machine: it builds (or is already built), loads
through ctypes, reports its ABI version, fills default configs, validates configs before
touching a device, and fails cleanly without a GPU (OG_E_NO_DEVICE, NULL handle, a clear
message) and on NULL handles (OG_E_INVALID_HANDLE, never a crash).

Skips with the reason when the library cannot be built here (no nvcc).
"""
from __future__ import annotations

import ctypes
import os
import pathlib
import shutil
import subprocess
import threading

import numpy as np
import pytest

from gpu_support import build_library_or_skip
from onegraph import capi

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEADER = ROOT / "cuda" / "onegraph.h"


@pytest.fixture(scope="module")
def lib():
    path = build_library_or_skip()  # incremental: returns at once when up to date
    assert path is None or pathlib.Path(path).is_file()
    try:
        return capi.load_library()
    except capi.LibraryUnavailable as e:
        pytest.fail(f"the library was built but does not load: {e}")


@pytest.fixture(scope="module")
def has_gpu(lib) -> bool:
    count = ctypes.c_int32(-1)
    return lib.og_device_count(ctypes.byref(count)) == capi.OG_OK and count.value > 0


def small_config(lib, **changes) -> capi.OgConfig:
    """A tiny valid Qwen3-shaped config; `changes` override fields."""
    cfg = capi.OgConfig()
    lib.og_config_default(ctypes.byref(cfg))
    cfg.vocab_size = 64
    cfg.hidden_size = 32
    cfg.intermediate_size = 48
    cfg.num_hidden_layers = 2
    cfg.num_attention_heads = 4
    cfg.num_key_value_heads = 2
    cfg.head_dim = 16
    cfg.qk_norm = 1
    cfg.max_seq_len = 64
    for key, value in changes.items():
        setattr(cfg, key, value)
    return cfg


def init(lib, cfg) -> tuple[int, capi.Handle]:
    handle = capi.Handle(12345)  # og_init must overwrite it (NULL on failure)
    status = lib.og_init(ctypes.byref(cfg), ctypes.byref(handle))
    return status, handle


def test_abi_version_matches_header(lib):
    assert lib.og_abi_version() == capi.header_abi_version(str(HEADER))
    assert lib.og_abi_version() == capi.ABI_VERSION
    major, minor = ctypes.c_int32(-1), ctypes.c_int32(-1)
    lib.og_abi_version_numbers(ctypes.byref(major), ctypes.byref(minor))
    assert (major.value, minor.value) == capi.header_abi_version_numbers(str(HEADER))
    assert major.value == capi.ABI_VERSION and minor.value >= capi.ABI_MINOR_REQUIRED
    lib.og_abi_version_numbers(None, None)  # either pointer may be NULL


def test_status_string_names_every_status_of_the_header(lib):
    import re
    codes = re.findall(r"#define\s+(OG_(?:OK|E_\w+))\s+(-?\d+)", HEADER.read_text())
    assert len(codes) >= 16
    for name, value in codes:
        assert lib.og_status_string(int(value)) == name.encode()
    assert lib.og_status_string(-999) == b"unknown og_status"
    assert lib.og_status_string(1) == b"unknown og_status"


def test_config_default(lib):
    cfg = capi.OgConfig()
    ctypes.memset(ctypes.byref(cfg), 0x5A, ctypes.sizeof(cfg))
    lib.og_config_default(ctypes.byref(cfg))
    assert cfg.abi_version == capi.ABI_VERSION
    assert cfg.rms_norm_eps == np.float32(1e-6)
    assert cfg.rope_theta == 1e6
    assert cfg.rope_linear_factor == 1.0
    assert cfg.kv_dtype == capi.OG_KV_INT8
    assert cfg.max_seq_len == 4096
    assert cfg.device_ordinal == 0
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "qk_norm",
                 "tie_word_embeddings", "num_experts", "num_experts_per_tok",
                 "moe_intermediate_size", "norm_topk_prob"):
        assert getattr(cfg, name) == 0, name
    assert not cfg.layer_is_moe  # NULL


def test_device_count_without_gpu(lib, has_gpu):
    if has_gpu:
        pytest.skip("a GPU is present: the no-device answer cannot be observed")
    count = ctypes.c_int32(7)
    assert lib.og_device_count(ctypes.byref(count)) == capi.OG_E_NO_DEVICE
    assert count.value == 0
    assert capi.last_error().startswith("no CUDA device: ")
    assert len(capi.last_error()) > len("no CUDA device: ")  # the driver's reason follows


def test_device_count_null_pointer(lib):
    assert lib.og_device_count(None) == capi.OG_E_INVALID_ARGUMENT
    assert "count" in capi.last_error()


def test_init_without_gpu_returns_no_device_and_null(lib, has_gpu):
    if has_gpu:
        pytest.skip("a GPU is present")
    status, handle = init(lib, small_config(lib))
    assert status == capi.OG_E_NO_DEVICE
    assert not handle.value
    assert "no CUDA device" in capi.last_error()


def test_init_null_arguments(lib):
    cfg = small_config(lib)
    handle = capi.Handle()
    assert lib.og_init(None, ctypes.byref(handle)) == capi.OG_E_INVALID_ARGUMENT
    assert "cfg" in capi.last_error()
    assert lib.og_init(ctypes.byref(cfg), None) == capi.OG_E_INVALID_ARGUMENT
    assert "out" in capi.last_error()


INVALID_CONFIGS = [
    # (changes, expected status, text the message must contain)
    (dict(num_key_value_heads=3), capi.OG_E_INVALID_ARGUMENT, "num_key_value_heads=3"),
    (dict(kv_dtype=7), capi.OG_E_INVALID_ARGUMENT, "kv_dtype=7"),
    (dict(head_dim=512), capi.OG_E_UNSUPPORTED, "head_dim=512"),
    (dict(head_dim=15), capi.OG_E_INVALID_ARGUMENT, "head_dim=15"),
    (dict(hidden_size=0), capi.OG_E_INVALID_ARGUMENT, "hidden_size=0"),
    (dict(vocab_size=-5), capi.OG_E_INVALID_ARGUMENT, "vocab_size=-5"),
    (dict(num_hidden_layers=0), capi.OG_E_INVALID_ARGUMENT, "num_hidden_layers=0"),
    (dict(max_seq_len=0), capi.OG_E_INVALID_ARGUMENT, "max_seq_len=0"),
    (dict(abi_version=99), capi.OG_E_INVALID_ARGUMENT, "abi_version=99"),
    (dict(rms_norm_eps=0.0), capi.OG_E_INVALID_ARGUMENT, "rms_norm_eps"),
    (dict(rope_theta=-1.0), capi.OG_E_INVALID_ARGUMENT, "rope_theta"),
    (dict(rope_linear_factor=0.0), capi.OG_E_INVALID_ARGUMENT, "rope_linear_factor"),
    (dict(qk_norm=2), capi.OG_E_INVALID_ARGUMENT, "qk_norm=2"),
    (dict(intermediate_size=0), capi.OG_E_INVALID_ARGUMENT, "intermediate_size=0"),
    (dict(device_ordinal=-1), capi.OG_E_INVALID_ARGUMENT, "device_ordinal=-1"),
    (dict(num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8),
     capi.OG_E_INVALID_ARGUMENT, "num_experts_per_tok=5"),
    (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=0),
     capi.OG_E_INVALID_ARGUMENT, "moe_intermediate_size=0"),
    (dict(num_experts=1024, num_experts_per_tok=8, moe_intermediate_size=8),
     capi.OG_E_UNSUPPORTED, "num_experts=1024"),
]


@pytest.mark.parametrize("changes,status,text", INVALID_CONFIGS,
                         ids=[next(iter(c)) + "=" + str(next(iter(c.values()))) for c, _, _ in INVALID_CONFIGS])
def test_invalid_config_names_the_field(lib, changes, status, text):
    got, handle = init(lib, small_config(lib, **changes))
    assert got == status, capi.last_error()
    assert not handle.value
    message = capi.last_error()
    assert text in message, message
    assert message.startswith("og_config.")


def test_layer_is_moe_without_experts_is_rejected(lib):
    flags = (ctypes.c_uint8 * 2)(0, 1)
    cfg = small_config(lib)
    cfg.layer_is_moe = ctypes.cast(flags, ctypes.POINTER(ctypes.c_uint8))
    status, handle = init(lib, cfg)
    assert status == capi.OG_E_INVALID_ARGUMENT
    assert "layer_is_moe[1]=1" in capi.last_error()
    assert not handle.value


HANDLE_CALLS = {
    "og_set_weight": lambda lib, h: lib.og_set_weight(h, b"model.norm.weight", capi.OG_DTYPE_F32, 0, None, None),
    "og_set_rope_frequencies": lambda lib, h: lib.og_set_rope_frequencies(h, (ctypes.c_float * 4)(1, 1, 1, 1), 4),
    "og_precheck": lambda lib, h: lib.og_precheck(h),
    "og_begin_step": lambda lib, h: lib.og_begin_step(h, 0),
    "og_begin_chained_step": lambda lib, h: lib.og_begin_chained_step(h, ctypes.byref(ctypes.c_int32())),
    "og_cancel_step": lambda lib, h: lib.og_cancel_step(h),
    "og_step_slot": lambda lib, h: lib.og_step_slot(h, ctypes.byref(ctypes.c_int32())),
    "og_step_bands": lambda lib, h: lib.og_step_bands(h, ctypes.byref(ctypes.c_int32()),
                                                      ctypes.byref(ctypes.c_int32())),
    "og_enqueue": lambda lib, h: lib.og_enqueue(h, None),
    "og_run": lambda lib, h: lib.og_run(h),
    "og_end_step": lambda lib, h: lib.og_end_step(h),
    "og_step": lambda lib, h: lib.og_step(h, 0, None),
    "og_reset": lambda lib, h: lib.og_reset(h),
    "og_get_position": lambda lib, h: lib.og_get_position(h, ctypes.byref(ctypes.c_int32())),
    "og_logits": lambda lib, h: lib.og_logits(h, ctypes.byref(ctypes.POINTER(ctypes.c_float)()),
                                              ctypes.byref(ctypes.c_int32())),
    "og_stream": lambda lib, h: lib.og_stream(h, ctypes.byref(ctypes.c_void_p())),
    "og_set_output": lambda lib, h: lib.og_set_output(h, capi.OG_OUTPUT_NEXT_TOKEN),
    "og_next_token": lambda lib, h: lib.og_next_token(h, ctypes.byref(ctypes.c_int32()), None),
    "og_get_stats": lambda lib, h: lib.og_get_stats(h, ctypes.byref(capi.OgStats())),
    "og_free": lambda lib, h: lib.og_free(h),
}


@pytest.mark.parametrize("name", sorted(HANDLE_CALLS))
def test_null_handle_is_invalid_handle(lib, name):
    assert HANDLE_CALLS[name](lib, None) == capi.OG_E_INVALID_HANDLE
    assert "NULL engine handle" in capi.last_error()


@pytest.mark.parametrize("name", ["og_precheck", "og_reset", "og_free", "og_begin_step"])
def test_bogus_handle_is_invalid_handle(lib, name):
    # A pointer that was never returned by og_init: looked up, never dereferenced.
    bogus = ctypes.c_void_p(0xDEADBEEF0)
    assert HANDLE_CALLS[name](lib, bogus) == capi.OG_E_INVALID_HANDLE
    assert "not a live engine handle" in capi.last_error()


def test_last_error_is_per_thread_and_never_null(lib):
    lib.og_free(None)  # sets this thread's message
    assert capi.last_error() != ""
    seen = {}

    def fresh_thread():
        raw = lib.og_last_error()
        seen["message"] = raw

    t = threading.Thread(target=fresh_thread)
    t.start()
    t.join()
    assert seen["message"] == b""  # a thread that made no failing call: "" (not NULL)


def test_rope_table_matches_reference_bit_for_bit(lib):
    # The table is computed on the host, so this runs without a GPU.
    import capi_testing
    from onegraph.reference import rope_inv_freq
    for head_dim, theta, factor in [(128, 1e6, 1.0), (64, 1e4, 1.0), (16, 5e5, 8.0), (80, 1e6, 4.0),
                                    (2, 1e4, 1.0)]:
        got = capi_testing.rope_inv_freq(head_dim, theta, factor)
        want = rope_inv_freq(head_dim, theta, factor)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_kernel_entry_points_without_gpu(lib, has_gpu):
    if has_gpu:
        pytest.skip("a GPU is present")
    import capi_testing
    w = capi_testing.bf16_bits(np.ones((3, 5), np.float32))
    with pytest.raises(capi.LibraryError) as err:
        capi_testing.gemv(w, np.ones(5, np.float32))
    assert err.value.status == capi.OG_E_NO_DEVICE
    assert "no CUDA device" in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("source, reader", [("gemv_q4.cu", "og_q4_trace_read"),
                                            ("gemv_bf16.cu", "og_bf16_trace_read"),
                                            ("attention.cu", "og_attn_trace_read"),
                                            ("moe.cu", "og_moe_trace_read")])
def test_trace_build_compiles(tmp_path, source, reader):
    """build.py --trace (-DOG_Q4_TRACE, scripts/q4_trace.py) is a diagnostic build that nothing
    else compiles: the q4 and bf16 GEMVs, the attention and the MoE kernels with the define must
    still compile, and export their trace readers (the normal build exports none)."""
    import subprocess
    import sys

    sys.path.insert(0, str(ROOT))
    import build

    nvcc = build.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not installed")
    flags = build.compile_flags("sm_90", False, trace=True)
    assert "-DOG_Q4_TRACE" in flags and "-DOG_Q4_TRACE" not in build.compile_flags("sm_90", False)
    src = ROOT / "cuda" / source
    obj = tmp_path / "trace.o"
    done = subprocess.run([nvcc, *flags, "-c", str(src), "-o", str(obj)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    symbols = subprocess.run(["nm", str(obj)], capture_output=True, text=True)
    if symbols.returncode == 0:
        assert reader in symbols.stdout


def test_product_library_exports_no_test_entry_points():
    """libonegraph.so carries the public ABI only: the og_test_* entry points, the guard check
    and the trace hooks are in libonegraph_testing.so (build.py --testing)."""
    product = ROOT / "runtime" / "_lib" / capi.LIB_NAME
    nm = shutil.which("nm")
    if nm is None or not product.is_file():
        pytest.skip(f"nm or {product} missing: build it with 'python build.py'")
    out = subprocess.run([nm, "-D", "--defined-only", str(product)], capture_output=True, text=True,
                         check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.split()[-2:-1] == ["T"]}
    leaked = sorted(name for name in exported
                    if name.startswith("og_test_") or name in ("og_check_guards",) or "trace" in name)
    assert leaked == [], f"{product} exports test entry points: {leaked}"
    assert {"og_init", "og_enqueue", "og_abi_version"} <= exported
