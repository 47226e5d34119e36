"""The MoE kernels of cuda/moe.cu, one at a time, against float64 references written here.

Each kernel runs through its test entry point (cuda/moe_testing.h), which uploads the inputs,
launches, synchronizes and downloads. Weights are passed in the device layout, rows padded with
zeros to a multiple of 8 elements by this module. Outputs are poisoned (NaN, or -7 for expert
ids) before each call, so an element the kernel never writes fails the comparison.

Skips cleanly unless the library ($ONEGRAPH_LIB, else runtime/_lib/libonegraph_testing.so) loads and
og_device_count reports a usable device.
"""
from __future__ import annotations

import ctypes
import os
import pathlib

import numpy as np
import pytest

from gpu_support import skip_or_fail

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[1]
OG_OK = 0
OG_E_INVALID_ARGUMENT = -1

# Tolerances. The kernels accumulate in fp32 (unit roundoff U = 2^-24); the references below
# are float64 on the same (bf16-rounded) inputs. A sum evaluated as a tree of depth d is off by
# at most d * U * sum|terms| (the classical bound for recursive/pairwise summation). The kernels
# sum a dot of n products as per-lane fma chains over 16-byte chunks (at most 8 * ceil(n / 256)
# terms per lane) followed by a 5-level warp butterfly, so d = 8 * ceil(n / 256) + 5 (see
# dot_depth); a weighted sum over top_k experts has d = top_k. Elementwise fp32 steps (expf: 2
# ulp, add, divide, multiply) add SLACK_ULPS * U relative. A real bug (a wrong row, a dropped
# chunk or element, a pad read as data) moves results by more than these bounds.
U = 2.0 ** -24
SLACK_ULPS = 16

F32P = np.ctypeslib.ndpointer(dtype=np.float32, flags="C_CONTIGUOUS")
I32P = np.ctypeslib.ndpointer(dtype=np.int32, flags="C_CONTIGUOUS")
U16P = np.ctypeslib.ndpointer(dtype=np.uint16, flags="C_CONTIGUOUS")
c_int = ctypes.c_int


def _library_path() -> pathlib.Path:
    env = os.environ.get("ONEGRAPH_LIB")
    return pathlib.Path(env) if env else ROOT / "runtime" / "_lib" / "libonegraph_testing.so"


@pytest.fixture(scope="module")
def lib():
    path = _library_path()
    if not path.is_file():
        skip_or_fail(f"library not built: {path}")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        skip_or_fail(f"library does not load: {e}")
    lib.og_device_count.argtypes = [ctypes.POINTER(ctypes.c_int32)]
    lib.og_device_count.restype = ctypes.c_int32
    count = ctypes.c_int32(0)
    status = lib.og_device_count(ctypes.byref(count))
    if status != OG_OK or count.value <= 0:
        skip_or_fail(f"no usable CUDA device (og_device_count status {status}, count {count.value})")
    # A library that loads on a GPU machine must have the entry points: missing ones fail here.
    lib.og_test_moe_topk.argtypes = [F32P, c_int, c_int, c_int, I32P, F32P]
    lib.og_test_moe_topk.restype = ctypes.c_int32
    lib.og_test_moe_gate_up_swiglu.argtypes = [U16P, c_int, c_int, c_int, F32P, I32P, c_int, F32P]
    lib.og_test_moe_gate_up_swiglu.restype = ctypes.c_int32
    lib.og_test_moe_down.argtypes = [U16P, c_int, c_int, c_int, F32P, I32P, F32P, c_int, F32P]
    lib.og_test_moe_down.restype = ctypes.c_int32
    return lib


# ---- helpers --------------------------------------------------------------------------------

def dot_depth(n: int) -> int:
    """Depth of the kernels' fp32 summation tree for a dot of n products (see Tolerances)."""
    return 8 * ((n + 255) // 256) + 5 + SLACK_ULPS


def round_up8(n: int) -> int:
    return (n + 7) // 8 * 8


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns, round to nearest even (inputs here are finite)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_bits_to_f64(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def padded_bf16(rng, shape_rows: tuple[int, ...], cols: int, scale: float) -> np.ndarray:
    """Random bf16 bits [..., round_up8(cols)] with zero pad columns (the device layout)."""
    w = np.zeros(shape_rows + (round_up8(cols),), dtype=np.uint16)
    values = rng.standard_normal(shape_rows + (cols,), dtype=np.float32) * np.float32(scale)
    w[..., :cols] = to_bf16_bits(values)
    return w


def nonzero_normal(rng, n: int) -> np.ndarray:
    """Random fp32 values bounded away from zero (a kernel that writes zeros cannot pass)."""
    v = rng.standard_normal(n, dtype=np.float32)
    v += np.where(v >= 0, np.float32(0.1), np.float32(-0.1))
    return v


def assert_within(actual: np.ndarray, expected: np.ndarray, bound: np.ndarray, what: str):
    actual = np.asarray(actual, dtype=np.float64)
    assert np.all(np.isfinite(actual)), f"{what}: non-finite output (unwritten element?)"
    err = np.abs(actual - expected)
    worst = int(np.argmax(err - bound))
    assert np.all(err <= bound), (
        f"{what}: element {worst}: got {actual.flat[worst]!r}, expected {expected.flat[worst]!r}, "
        f"error {err.flat[worst]:.3g} > bound {bound.flat[worst]:.3g}")


# ---- top-k ----------------------------------------------------------------------------------

def ref_topk(logits: np.ndarray, top_k: int, norm: bool):
    """float64 softmax; top_k by probability descending, ties to the lower index."""
    l = logits.astype(np.float64)
    p = np.exp(l - l.max())
    p /= p.sum()
    order = np.lexsort((np.arange(len(p)), -p))[:top_k]   # primary: -p; then the index
    w = p[order]
    if norm:
        w = w / w.sum()
    return order.astype(np.int32), w


def run_topk(lib, logits: np.ndarray, top_k: int, norm: bool):
    sel = np.full(top_k, -7, dtype=np.int32)
    w = np.full(top_k, np.nan, dtype=np.float32)
    status = lib.og_test_moe_topk(np.ascontiguousarray(logits, dtype=np.float32), len(logits),
                                  top_k, int(norm), sel, w)
    assert status == OG_OK, f"og_test_moe_topk status {status}"
    return sel, w


def check_topk(lib, logits: np.ndarray, top_k: int, norm: bool):
    sel, w = run_topk(lib, logits, top_k, norm)
    ref_sel, ref_w = ref_topk(logits, top_k, norm)
    np.testing.assert_array_equal(sel, ref_sel, err_msg=f"E={len(logits)} top_k={top_k}")
    # Softmax: sum of E fp32 terms; normalisation: sum of top_k terms and a division.
    rel = (len(logits) + top_k + SLACK_ULPS) * U
    assert_within(w, ref_w, rel * np.abs(ref_w), f"weights E={len(logits)} top_k={top_k}")


def grid_logits(rng, n: int) -> np.ndarray:
    """Random logits on a 1/64 grid: exact duplicates happen often (ties identical in fp32 and
    float64), and distinct values differ by >= 1/64, far beyond fp32 rounding of the softmax."""
    return (np.round(rng.standard_normal(n) * 2.0 * 64.0) / 64.0).astype(np.float32)


# Every (E, top_k) with top_k <= E; top_k > E is rejected (test_topk_rejects).
TOPK_SHAPES = [(E, top_k) for E in (1, 2, 7, 31, 32, 33, 64, 100, 128, 129, 200)
               for top_k in (1, 2, 3, 8) if top_k <= E]


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("E,top_k", TOPK_SHAPES)
def test_topk_random(lib, E, top_k, norm):
    rng = np.random.default_rng(1000 * E + 10 * top_k + norm)
    for _ in range(4):
        check_topk(lib, grid_logits(rng, E), top_k, norm)


@pytest.mark.parametrize("norm", [False, True])
def test_topk_exact_ties(lib, norm):
    rng = np.random.default_rng(7)
    # Everything equal: experts 0..k-1, weights 1/E (or 1/k).
    check_topk(lib, np.full(40, 0.375, dtype=np.float32), 8, norm)
    # Duplicated maximum spread over lanes and slots: picked in index order.
    logits = grid_logits(rng, 200) - np.float32(20.0)
    for i in (150, 5, 97, 33):
        logits[i] = 3.0
    check_topk(lib, logits, 6, norm)
    sel, _ = run_topk(lib, logits, 6, norm)
    assert list(sel[:4]) == [5, 33, 97, 150]
    # Ties straddling the top-k boundary: the lower indices win the last places.
    logits = np.arange(64, dtype=np.float32) * np.float32(-0.25)   # strictly decreasing
    logits[[40, 10, 63]] = logits[2]                                  # three more at rank 2
    check_topk(lib, logits, 4, norm)
    sel, _ = run_topk(lib, logits, 4, norm)
    assert list(sel) == [0, 1, 2, 10]
    # Negative, large and spread-out logits (tiny probabilities stay exact relative).
    check_topk(lib, np.linspace(-30, 30, 129).astype(np.float32)[::-1].copy(), 8, norm)


@pytest.mark.parametrize("E,top_k", [(512, 32), (300, 17), (32, 32), (128, 8)])
def test_topk_limits(lib, E, top_k):
    rng = np.random.default_rng(E + top_k)
    check_topk(lib, grid_logits(rng, E), top_k, True)
    check_topk(lib, grid_logits(rng, E), top_k, False)


@pytest.mark.parametrize("E,top_k", [(0, 1), (513, 8), (64, 33), (4, 5), (16, 0)])
def test_topk_rejects(lib, E, top_k):
    logits = np.ones(max(E, 1), dtype=np.float32)
    sel = np.zeros(max(top_k, 1), dtype=np.int32)
    w = np.zeros(max(top_k, 1), dtype=np.float32)
    assert lib.og_test_moe_topk(logits, E, top_k, 1, sel, w) == OG_E_INVALID_ARGUMENT


# ---- gate/up + SwiGLU ---------------------------------------------------------------------

def make_gate_up_case(seed: int, H: int, I: int, top_k: int, E: int):
    rng = np.random.default_rng(seed)
    w = padded_bf16(rng, (E, 2 * I), H, 1.5 / np.sqrt(H))
    x = nonzero_normal(rng, H)
    sel = rng.permutation(E)[:top_k].astype(np.int32)
    return w, x, sel


def ref_gate_up(w: np.ndarray, x: np.ndarray, sel: np.ndarray, H: int, I: int):
    """act [top_k, I] float64, and the error bound the fp32 kernel must meet."""
    xs = x.astype(np.float64)
    rows = bf16_bits_to_f64(w[sel][..., :H])                 # [top_k, 2I, H]
    dots = rows @ xs                                          # [top_k, 2I]
    sum_abs = np.abs(rows) @ np.abs(xs)
    dot_err = dot_depth(H) * U * sum_abs
    g, u = dots[:, :I], dots[:, I:]
    g_err, u_err = dot_err[:, :I], dot_err[:, I:]
    silu = g / (1.0 + np.exp(-g))
    act = silu * u
    # |d silu/dg| <= 1.1 everywhere; elementwise steps add SLACK_ULPS relative.
    bound = 1.1 * g_err * np.abs(u) + np.abs(silu) * u_err + SLACK_ULPS * U * np.abs(act)
    return act, bound + 1e-30


def run_gate_up(lib, w, x, sel, H, I):
    top_k = len(sel)
    act = np.full((top_k, I), np.nan, dtype=np.float32)
    status = lib.og_test_moe_gate_up_swiglu(w, w.shape[0], H, I, x, sel, top_k, act)
    assert status == OG_OK, f"og_test_moe_gate_up_swiglu status {status}"
    return act


@pytest.mark.parametrize("H", [1, 7, 100, 2048])
@pytest.mark.parametrize("I", [1, 13, 768])
def test_gate_up_swiglu(lib, H, I):
    top_k = 8 if H * I >= 2048 * 768 else 1 + (H + I) % 8   # 1..8
    E = top_k + 1
    w, x, sel = make_gate_up_case(H * 7919 + I, H, I, top_k, E)
    act = run_gate_up(lib, w, x, sel, H, I)
    ref, bound = ref_gate_up(w, x, sel, H, I)
    assert_within(act, ref, bound, f"act H={H} I={I} top_k={top_k}")


def test_gate_up_many_experts_and_max_top_k(lib):
    H, I, top_k, E = 96, 40, 32, 40
    w, x, sel = make_gate_up_case(5, H, I, top_k, E)
    act = run_gate_up(lib, w, x, sel, H, I)
    ref, bound = ref_gate_up(w, x, sel, H, I)
    assert_within(act, ref, bound, "act top_k=32")


def test_gate_up_rejects(lib):
    w, x, sel = make_gate_up_case(1, 16, 8, 2, 3)
    act = np.zeros((2, 8), dtype=np.float32)
    bad = sel.copy()
    bad[1] = 3                                                  # expert id == E
    assert lib.og_test_moe_gate_up_swiglu(w, 3, 16, 8, x, bad, 2, act) == OG_E_INVALID_ARGUMENT
    assert lib.og_test_moe_gate_up_swiglu(w, 3, 0, 8, x, sel, 2, act) == OG_E_INVALID_ARGUMENT
    assert lib.og_test_moe_gate_up_swiglu(w, 3, 16, 8, x, sel, 0, act) == OG_E_INVALID_ARGUMENT


# ---- down + weighted residual ---------------------------------------------------------------

def make_down_case(seed: int, H: int, I: int, top_k: int, E: int):
    rng = np.random.default_rng(seed)
    w = padded_bf16(rng, (E, H), I, 1.5 / np.sqrt(I))
    act = nonzero_normal(rng, top_k * I).reshape(top_k, I)
    sel = rng.permutation(E)[:top_k].astype(np.int32)
    sw = rng.uniform(0.05, 1.0, top_k).astype(np.float32)
    x = nonzero_normal(rng, H)
    return w, act, sel, sw, x


def ref_down(w, act, sel, sw, x, H, I):
    """x + sum_j w_j (down_j . act_j) in float64, and the fp32 error bound."""
    rows = bf16_bits_to_f64(w[sel][..., :I])                 # [top_k, H, I]
    a = act.astype(np.float64)
    dots = np.einsum("jhi,ji->jh", rows, a)                    # [top_k, H]
    sum_abs = np.einsum("jhi,ji->jh", np.abs(rows), np.abs(a))
    swd = sw.astype(np.float64)[:, None]
    y = np.sum(swd * dots, axis=0)
    top_k = len(sel)
    bound = (np.sum(swd * dot_depth(I) * U * sum_abs, axis=0)              # the dots
             + (top_k + SLACK_ULPS) * U * np.sum(np.abs(swd * dots), axis=0)  # weighted sum
             + 2 * U * (np.abs(x) + np.abs(y)))                             # the residual add
    return x.astype(np.float64) + y, bound


def run_down(lib, w, act, sel, sw, x, H, I):
    out = x.copy()
    status = lib.og_test_moe_down(w, w.shape[0], H, I, np.ascontiguousarray(act), sel, sw,
                                  len(sel), out)
    assert status == OG_OK, f"og_test_moe_down status {status}"
    return out


@pytest.mark.parametrize("H", [1, 7, 100, 2048])
@pytest.mark.parametrize("I", [1, 13, 768])
def test_down_weighted_residual(lib, H, I):
    top_k = 8 if H * I >= 2048 * 768 else 1 + (3 * H + I) % 8
    E = top_k + 2
    w, act, sel, sw, x = make_down_case(H * 104729 + I, H, I, top_k, E)
    out = run_down(lib, w, act, sel, sw, x, H, I)
    ref, bound = ref_down(w, act, sel, sw, x, H, I)
    assert_within(out, ref, bound, f"x H={H} I={I} top_k={top_k}")
    # Every row moved: x alone would not be within the bound of x + y for these inputs.
    assert np.all(out != x)


@pytest.mark.parametrize("I", [40, 300])
def test_down_max_top_k(lib, I):
    H, top_k, E = 64, 32, 33   # 32 experts spanning several loads per lane batch
    w, act, sel, sw, x = make_down_case(11 + I, H, I, top_k, E)
    out = run_down(lib, w, act, sel, sw, x, H, I)
    ref, bound = ref_down(w, act, sel, sw, x, H, I)
    assert_within(out, ref, bound, f"x top_k=32 I={I}")


def test_down_rejects(lib):
    w, act, sel, sw, x = make_down_case(2, 16, 8, 2, 3)
    bad = sel.copy()
    bad[0] = -1
    assert lib.og_test_moe_down(w, 3, 16, 8, act, bad, sw, 2, x) == OG_E_INVALID_ARGUMENT
    assert lib.og_test_moe_down(w, 3, 16, 8, act, sel, sw, 33, x) == OG_E_INVALID_ARGUMENT
    assert lib.og_test_moe_down(w, 3, 16, 0, act, sel, sw, 2, x) == OG_E_INVALID_ARGUMENT


# ---- determinism ------------------------------------------------------------------------------

def test_bit_identical_reruns(lib):
    """Same inputs twice -> the same bits (no atomics, fixed summation order), at the
    Qwen3-30B-A3B expert shape where the persistent grid gives warps several items."""
    H, I, top_k = 2048, 768, 8
    rng = np.random.default_rng(99)
    logits = rng.standard_normal(128).astype(np.float32)
    s1, w1 = run_topk(lib, logits, top_k, True)
    s2, w2 = run_topk(lib, logits, top_k, True)
    np.testing.assert_array_equal(s1, s2)
    assert w1.tobytes() == w2.tobytes()

    w, x, sel = make_gate_up_case(3, H, I, top_k, top_k + 1)
    a1 = run_gate_up(lib, w, x, sel, H, I)
    a2 = run_gate_up(lib, w, x, sel, H, I)
    assert a1.tobytes() == a2.tobytes()

    w, act, sel, sw, x = make_down_case(4, H, I, top_k, top_k + 1)
    o1 = run_down(lib, w, act, sel, sw, x, H, I)
    o2 = run_down(lib, w, act, sel, sw, x, H, I)
    assert o1.tobytes() == o2.tobytes()
