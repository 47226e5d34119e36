"""The paged KV cache on the CPU: the block layout, the host mirror of the block-zeroing
kernel (seed 001's regression scenario, guard regions, neighbouring segments), the library's
block allocator through its host-only test entry points, and the Engine's sequences on the
CPU path. The kernel and the engine on the GPU: tests/test_paged_gpu.py."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

from gpu_support import build_library_or_skip, load_build_module, synthetic
from onegraph import capi
from onegraph.engine import Engine, EngineError
from onegraph.kvpool import PoolLayout, zero_blocks
from onegraph.synth import preset_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPT = [3, 17, 99, 250, 4, 61, 200, 8]


# ---- layout ---------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-tied", "qwen3-0.6b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("page", [1, 16, 64, 1000])
def test_layout_packs_every_layer_into_a_block(preset, kv, page):
    c = preset_config(preset)
    layout = PoolLayout.for_config(c, kv, max_seq_len=4096, page_size=page)
    elem = {"fp32": 4, "bf16": 2, "int8": 1}[kv]
    per_layer = 4 if kv == "int8" else 2
    assert len(layout.segments) == c.num_hidden_layers * per_layer
    end = 0
    for s in layout.segments:
        assert s.offset % 16 == 0 and s.offset >= end  # aligned, address order, no overlap
        want = c.num_key_value_heads * page * (c.head_dim * elem if s.kind in ("k", "v") else 4)
        assert s.page_bytes == want
        end = s.offset + s.page_bytes
    assert layout.block_stride % 256 == 0 and end <= layout.block_stride < end + 256
    # Packed: the stride from block to block is larger than any one page.
    assert all(layout.block_stride > s.page_bytes for s in layout.segments)
    assert layout.max_blocks_per_seq == -(-4096 // page) == layout.n_blocks
    # A block holds page rows of every layer: the contiguous cache's bytes, up to padding.
    row_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.head_dim * elem + (4 if kv == "int8" else 0))
    assert sum(s.page_bytes for s in layout.segments) == page * row_bytes


def test_layout_defaults_follow_the_library():
    c = preset_config("tiny-dense")
    layout = PoolLayout.for_config(c, "int8", max_seq_len=1000)
    assert (layout.page_size, layout.n_blocks, layout.max_sequences) == (64, 16, 16)
    layout = PoolLayout.for_config(c, "int8", max_seq_len=1000, page_size=1000, n_blocks=3, max_sequences=2)
    assert (layout.page_size, layout.n_blocks, layout.max_blocks_per_seq, layout.max_sequences) == (1000, 3, 1, 2)


@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
def test_gather_inverts_scatter_through_scrambled_blocks(kv):
    c = preset_config("tiny-dense")
    layout = PoolLayout.for_config(c, kv, max_seq_len=100, page_size=16, n_blocks=12)
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 256, layout.pool_bytes, dtype=np.uint8)
    blocks = [7, 2, 11, 0, 5, 9, 3]
    length = 100
    dtype = {"fp32": np.float32, "bf16": np.float32, "int8": np.int8}[kv]
    rows = {"k": rng.standard_normal((length, c.num_key_value_heads, c.head_dim)).astype(dtype),
            "v": rng.standard_normal((length, c.num_key_value_heads, c.head_dim)).astype(dtype)}
    if kv == "bf16":
        import ml_dtypes
        rows = {k: v.astype(ml_dtypes.bfloat16) for k, v in rows.items()}
    if kv == "int8":
        rows.update(k_scales=rng.random((length, c.num_key_value_heads), dtype=np.float32),
                    v_scales=rng.random((length, c.num_key_value_heads), dtype=np.float32))
    before = pool.copy()
    layout.scatter(pool, blocks, 1, rows)
    back = layout.gather(pool, blocks, length, 1)
    for kind, values in rows.items():
        assert np.array_equal(back[kind].view(np.uint8), values.view(np.uint8)), kind
    # Only layer 1's pages of the listed blocks changed.
    changed = np.flatnonzero(pool != before)
    allowed = np.zeros(pool.size, bool)
    for b in blocks:
        for s in layout.segments:
            if s.layer == 1:
                allowed[b * layout.block_stride + s.offset:b * layout.block_stride + s.offset + s.page_bytes] = True
    assert allowed[changed].all()


# ---- the zeroing kernel's host mirror ---------------------------------------------------------

def seed_scenario():
    """Seed 001's regression test: 4 blocks of 12 int32 elements; a segment's page of 4
    elements at element offset 3 (bytes: stride 48, page 16 at offset 12)."""
    backing = np.ones((4, 12), dtype=np.int32)
    return backing, 48, [(12, 16)]


def test_zeroing_the_last_block_clears_only_its_page():
    backing, stride, segments = seed_scenario()
    zero_blocks(backing, 0, stride, segments, [3])
    expected = np.ones_like(backing)
    expected[-1, 3:7] = 0
    assert np.array_equal(backing, expected)
    # Stepping by the page instead of the stride would have hit row 1, columns 3..6.
    wrong = np.ones_like(backing)
    wrong.reshape(-1)[3 + 3 * 4:3 + 4 * 4] = 0
    assert not np.array_equal(backing, wrong)


def guarded_pool(n_blocks=5, stride=96, guard=64, seed=0):
    """A uint8 buffer: guard | pool of n_blocks * stride | guard, random bytes (no zeros) so a
    stray zero shows; three segments of awkward sizes and offsets in each block."""
    rng = np.random.default_rng(seed)
    backing = rng.integers(1, 256, guard + n_blocks * stride + guard, dtype=np.uint8)
    segments = [(0, 20), (20, 13), (40, 56)]  # a 3-byte gap 33..39; 56 + 40 = stride
    return backing, guard, stride, n_blocks, segments


def expected_after(backing, pool_offset, stride, segments, ids):
    out = backing.copy()
    for b in ids:
        for offset, page in segments:
            start = pool_offset + b * stride + offset
            out[start:start + page] = 0
    return out


@pytest.mark.parametrize("ids", [[], [0], [4], [4, 0], [1, 3], [0, 1, 2, 3, 4], [2, 2]])
def test_zeroing_keeps_guards_gaps_and_other_blocks(ids):
    backing, guard, stride, n_blocks, segments = guarded_pool()
    before = backing.copy()
    zero_blocks(backing, guard, stride, segments, ids)
    assert np.array_equal(backing[:guard], before[:guard])
    assert np.array_equal(backing[guard + n_blocks * stride:], before[guard + n_blocks * stride:])
    assert np.array_equal(backing, expected_after(before, guard, stride, segments, ids))


def test_zeroing_one_segment_leaves_its_neighbours():
    backing, guard, stride, n_blocks, segments = guarded_pool()
    before = backing.copy()
    zero_blocks(backing, guard, stride, [segments[1]], [2, 4])
    changed = np.flatnonzero(backing != before)
    for b in (2, 4):
        lo = guard + b * stride + segments[1][0]
        assert (backing[lo:lo + segments[1][1]] == 0).all()
    assert all(any(guard + b * stride + 20 <= i < guard + b * stride + 33 for b in (2, 4)) for i in changed)


# ---- the library's allocator, on the host ---------------------------------------------------------

@pytest.fixture(scope="module")
def allocator_type():
    build_library_or_skip()
    try:
        import capi_testing
        capi_testing.load()
    except capi.LibraryUnavailable as e:
        pytest.skip(f"library unavailable: {e}")
    return capi_testing.BlockAllocator


def test_allocator_hands_out_blocks_in_order_then_lifo(allocator_type):
    a = allocator_type(4)
    assert [a.allocate() for _ in range(3)] == [0, 1, 2] and a.free_count == 1
    assert a.release(1) is True and a.release(0) is True
    assert a.allocate() == 0 and a.allocate() == 1 and a.allocate() == 3
    assert a.free_count == 0


def test_allocator_reference_counts(allocator_type):
    a = allocator_type(2)
    b = a.allocate()
    a.retain(b)
    a.retain(b)
    assert a.refcount(b) == 3
    assert a.release(b) is False and a.release(b) is False and a.refcount(b) == 1
    assert a.release(b) is True and a.refcount(b) == 0 and a.free_count == 2
    assert a.refcount(-1) == -1 and a.refcount(2) == -1


def test_allocator_errors_change_nothing(allocator_type):
    a = allocator_type(2)
    x, y = a.allocate(), a.allocate()
    with pytest.raises(capi.LibraryError) as err:
        a.allocate()
    assert err.value.status == capi.OG_E_POOL_EXHAUSTED and "all 2 blocks are in use" in str(err.value)
    assert a.free_count == 0 and a.refcount(x) == a.refcount(y) == 1
    a.release(x)
    with pytest.raises(capi.LibraryError) as err:
        a.release(x)
    assert err.value.status == capi.OG_E_INVALID_ARGUMENT and "double free" in str(err.value)
    with pytest.raises(capi.LibraryError) as err:
        a.retain(x)
    assert err.value.status == capi.OG_E_INVALID_ARGUMENT and "is free" in str(err.value)
    for bad in (-1, 2, 1 << 30):
        for call in (a.retain, a.release):
            with pytest.raises(capi.LibraryError) as err:
                call(bad)
            assert err.value.status == capi.OG_E_INVALID_ARGUMENT and "outside the pool [0, 2)" in str(err.value)
    assert a.free_count == 1 and a.refcount(y) == 1 and a.refcount(x) == 0


def test_allocator_free_order_hook(allocator_type):
    a = allocator_type(6)
    held = a.allocate()
    a.set_free_order([5, 2, 4, 1, 3])
    assert [a.allocate() for _ in range(5)] == [5, 2, 4, 1, 3]
    a.release(2)
    for bad in ([0], [2, 2], [1], []):  # held, duplicate, held, missing
        with pytest.raises(capi.LibraryError):
            a.set_free_order(bad)
    assert held == 0 and a.allocate() == 2


def test_zero_blocks_kernel_entry_point_without_gpu(allocator_type):
    import capi_testing
    from onegraph.engine import library_status
    if library_status()[0]:
        pytest.skip("a GPU is present: tests/test_paged_gpu.py runs the kernel")
    backing, stride, segments = seed_scenario()
    with pytest.raises(capi.LibraryError) as err:
        capi_testing.zero_blocks(backing, 0, stride, 4, segments, [3])
    assert err.value.status == capi.OG_E_NO_DEVICE
    with pytest.raises(capi.LibraryError) as err:  # arguments are checked before the device
        capi_testing.zero_blocks(backing, 0, stride, 4, [(40, 16)], [3])
    assert err.value.status == capi.OG_E_INVALID_ARGUMENT and "outside a block" in str(err.value)


def test_sequences_on_the_host(tmp_path):
    """cuda/kv_pool.cu's sequence logic (forks, copy-on-write, reserve, set_length, zeroing on
    release, refusals that change nothing) on host memory: tests/native/kv_pool_host.cu, with
    the CUDA runtime stubbed (tests/native/cuda_stubs.cpp). About 5 s to compile."""
    import shutil
    import subprocess
    build = load_build_module()
    nvcc, cxx = build.find_nvcc(), shutil.which("g++") or shutil.which("c++")
    if nvcc is None or cxx is None:
        pytest.skip("nvcc and a host C++ compiler are needed")
    native, cuda = ROOT / "tests" / "native", ROOT / "cuda"
    objects = []  # nvcc compiles the .cpp with the host compiler and the CUDA include path
    for source in (native / "kv_pool_host.cu", cuda / "kv_pool.cu", native / "cuda_stubs.cpp"):
        obj = tmp_path / (source.stem + ".o")
        compiled = subprocess.run([nvcc, "-std=c++17", "-I", str(cuda), "-c", str(source), "-o", str(obj)],
                                  capture_output=True, text=True)
        assert compiled.returncode == 0, compiled.stderr
        objects.append(str(obj))
    exe = tmp_path / "kv_pool_host"
    link = subprocess.run([cxx, *objects, "-o", str(exe)], capture_output=True, text=True)
    if link.returncode != 0 and "__cuda" in link.stderr:
        pytest.skip(f"this CUDA toolkit's host stubs need more entry points: {link.stderr[-300:]}")
    assert link.returncode == 0, link.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "kv_pool host checks passed" in run.stdout


# ---- the Engine's sequences on the CPU path ----------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return synthetic("tiny-dense")


def _cpu_engine(tiny, **kw):
    config, tensors = tiny
    return Engine.from_tensors(config, tensors, kv="int8", max_seq_len=64, device="cpu", **kw)


def _greedy(engine, prompt, n):
    logits = engine.prefill(prompt)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = engine.step(out[-1])
    return out


def test_cpu_sequences_interleaved_equal_each_alone(tiny):
    other = [9, 9, 1, 300, 42]
    with _cpu_engine(tiny) as engine:
        alone_a = _greedy(engine, PROMPT, 8)
        engine.reset()
        alone_b = _greedy(engine, other, 8)
        engine.reset()
        a, b = engine.sequence, engine.new_sequence()
        la = engine.prefill(PROMPT)
        engine.use(b)
        lb = engine.prefill(other)
        got = {a: [], b: []}
        for _ in range(8):
            for seq, logits in ((a, la), (b, lb)):
                engine.use(seq)
                got[seq].append(int(np.argmax(logits)))
                new = engine.step(got[seq][-1])
                la, lb = (new, lb) if seq == a else (la, new)
        assert got[a] == alone_a and got[b] == alone_b
        assert engine.position == len(other) + 8


def test_cpu_fork_equals_a_fresh_sequence(tiny):
    with _cpu_engine(tiny) as engine:
        expected = _greedy(engine, PROMPT, 6)
        engine.reset()
        engine.prefill(PROMPT[:5])
        forked = engine.fork(length=3)             # shares 3 of the 5 tokens
        engine.use(forked)
        assert engine.position == 3
        logits = engine.prefill(PROMPT[3:])
        got = []
        for _ in range(6):
            got.append(int(np.argmax(logits)))
            logits = engine.step(got[-1])
        assert got == expected


def test_cpu_sequence_errors(tiny):
    with _cpu_engine(tiny) as engine:
        s = engine.new_sequence()
        engine.free_sequence(s)
        with pytest.raises(EngineError, match="does not exist"):
            engine.use(s)
        with pytest.raises(EngineError, match="does not exist"):
            engine.free_sequence(s)
        with pytest.raises(EngineError, match="outside 0..0"):
            engine.fork(0, length=1)
        engine.free_sequence(0)
        assert engine.sequence is None
        with pytest.raises(EngineError, match="no sequence is selected"):
            engine.step(1)
        t = engine.new_sequence()
        engine.use(t)
        assert engine.fork() != t and engine.position == 0
