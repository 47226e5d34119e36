"""The paged KV cache on the GPU: the block-zeroing kernel against its host mirror (seed 001's
scenario, guards, neighbours), the paged attention and KV write against the contiguous
kernels (bit-identical), and the engine: greedy decode equal to the reference with scrambled
block tables, sequences interleaved, prefix sharing with copy-on-write, errors before any
state change, long context (4k; 32k marked slow). Skipped without a usable GPU."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from bounds import assert_below
from gpu_support import rel_l2, require_gpu, synthetic
from gpu_support import greedy_decode as decode
from onegraph import capi
import capi_testing as ct
from onegraph.engine import Engine, EngineError
from onegraph.kvpool import KV_STORAGE, PoolLayout, zero_blocks
from onegraph.reference import ReferenceDecoder, rope_inv_freq
from onegraph.synth import iter_tensors, preset_config

pytestmark = pytest.mark.gpu

# Logits relative L2 error, GPU vs reference: bounds.py (as tests/test_engine_gpu.py states it:
# fp32 KV differs only in the order of fp32 sums; bf16 / int8 add rare one-step rounding flips).
PROMPT = [3, 17, 99, 250, 4, 61, 200, 8, 45, 123, 7, 300, 11, 90, 150, 33]
KV_CODES = {"fp32": ct.OG_KV_F32, "bf16": ct.OG_KV_BF16, "int8": ct.OG_KV_INT8}


@pytest.fixture(scope="module", autouse=True)
def _gpu():
    require_gpu()


def same_bits(a, b) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.tobytes() == b.tobytes()


# ---- the zeroing kernel against its host mirror ----------------------------------------------

def test_kernel_zeroes_only_the_last_blocks_page():
    backing = np.ones((4, 12), dtype=np.int32)
    got = ct.zero_blocks(backing, 0, 48, 4, [(12, 16)], [3])
    expected = np.ones_like(backing)
    expected[-1, 3:7] = 0
    assert np.array_equal(got, expected)
    assert np.array_equal(got, zero_blocks(backing.copy(), 0, 48, [(12, 16)], [3]))


POOLS = [  # (n_blocks, block_stride, segments): awkward byte offsets, and large aligned pages
    (5, 96, [(0, 20), (20, 13), (40, 56)]),
    (3, 8192, [(16, 2000), (2048, 4096), (6144 + 3, 2045)]),
    (7, 48, [(12, 16)]),
]


@pytest.mark.parametrize("pool", POOLS, ids=["bytes", "large", "seed"])
def test_kernel_matches_the_mirror_and_keeps_the_guards(pool):
    n_blocks, stride, segments = pool
    rng = np.random.default_rng(n_blocks)
    guard = 256 + 5  # an unaligned pool start as well
    backing = rng.integers(1, 256, guard + n_blocks * stride + guard, dtype=np.uint8)
    cases = [[n_blocks - 1], [0], list(range(n_blocks)), [n_blocks - 1, 0], []]
    cases += [sorted(rng.choice(n_blocks, size=rng.integers(1, n_blocks + 1), replace=False).tolist())
              for _ in range(4)]
    for ids in cases:
        got = ct.zero_blocks(backing, guard, stride, n_blocks, segments, ids)
        want = zero_blocks(backing.copy(), guard, stride, segments, ids)
        assert same_bits(got, want), f"blocks {ids}"
        assert same_bits(got[:guard], backing[:guard]) and same_bits(got[-guard:], backing[-guard:])
        # one segment at a time: its neighbours in the same block stay
        got_one = ct.zero_blocks(backing, guard, stride, n_blocks, segments[-1:], ids)
        assert same_bits(got_one, zero_blocks(backing.copy(), guard, stride, segments[-1:], ids))


def test_kernel_entry_point_rejects_a_page_past_its_block():
    backing = np.ones((4, 12), dtype=np.int32)
    with pytest.raises(capi.LibraryError) as err:
        ct.zero_blocks(backing, 0, 48, 4, [(40, 16)], [3])
    assert err.value.status == capi.OG_E_INVALID_ARGUMENT
    with pytest.raises(capi.LibraryError):
        ct.zero_blocks(backing, 0, 48, 4, [(12, 16)], [4])  # block id outside the pool


# ---- paged attention and KV write against the contiguous kernels ------------------------------

def random_rows(rng, kv, length, n_kv, hd):
    """Rows in the reference's axes: k, v [length, n_kv, hd] in the storage dtype (+ scales)."""
    if kv == "int8":
        rows = {"k": rng.integers(-127, 128, (length, n_kv, hd), dtype=np.int8),
                "v": rng.integers(-127, 128, (length, n_kv, hd), dtype=np.int8),
                "k_scales": rng.uniform(0.005, 0.02, (length, n_kv)).astype(np.float32),
                "v_scales": rng.uniform(0.004, 0.016, (length, n_kv)).astype(np.float32)}
    else:
        dtype = KV_STORAGE[kv]
        rows = {"k": rng.standard_normal((length, n_kv, hd)).astype(np.float32).astype(dtype),
                "v": rng.standard_normal((length, n_kv, hd)).astype(np.float32).astype(dtype)}
    return rows


POISON = {"fp32": (np.float32, np.nan), "bf16": (np.uint16, 0x7FC1), "int8": (np.int8, -1)}


def contiguous(rows, kv, max_seq):
    """The contiguous kernels' (k, v, k_scales, v_scales): [n_kv, max_seq, hd] (bf16 as bits)
    and [n_kv, max_seq] (int8 only, else None), poisoned past the rows."""
    length, n_kv, hd = rows["k"].shape
    bits, fill = POISON[kv]
    caches = []
    for kind in ("k", "v"):
        c = np.full((n_kv, max_seq, hd), fill, bits)
        c[:, :length] = np.swapaxes(rows[kind].view(bits), 0, 1)
        caches.append(c)
    for kind in ("k_scales", "v_scales"):
        if kv != "int8":
            caches.append(None)
            continue
        c = np.full((n_kv, max_seq), np.nan, np.float32)
        c[:, :length] = rows[kind].T
        caches.append(c)
    return tuple(caches)


def paged(rows, kv, page, n_blocks, table, n_kv, hd, max_seq):
    """A one-layer pool of 0xFF bytes (NaN / -1) holding the rows through `table`."""
    layout = PoolLayout.plan(1, n_kv, hd, kv, max_seq_len=max_seq, page_size=page, n_blocks=n_blocks)
    pool = np.full(layout.pool_bytes, 0xFF, np.uint8)
    layout.scatter(pool, table, 0, rows)
    return layout, pool


# The plans of the long band (capi_testing BAND_*): by default, and on the tensor cores wherever
# that fold is compiled (int8 rows of 128 dims, a group of 2 query heads a KV head included).
TC = ct.BAND_LONG_TC


def case_id(case):
    """h{heads}kv{kv heads}d{head dim}p{page}, with -tc for a case on the tensor cores' band."""
    n_heads, n_kv, hd, page = case[:4]
    return f"h{n_heads}kv{n_kv}d{hd}p{page}" + "-tc" * (case[5:] == (TC,))


ATTN_CASES = [  # (n_heads, n_kv, hd, page, visible lengths[, band])
    (8, 4, 128, 16, (1, 16, 17, 100, 200)),
    (8, 4, 128, 16, (1, 16, 17, 100, 200), TC),  # int8: a group of 2 on the tensor cores
    (8, 4, 128, 7, (1, 7, 8, 100, 200), TC),     # and tiles across pages
    (16, 8, 128, 64, (1, 63, 64, 65, 200)),
    (16, 4, 128, 16, (1, 16, 17, 100, 200)),  # int8: the tensor-core fold, a tile in one page
    (16, 4, 128, 7, (1, 7, 8, 100, 200)),     # and tiles across pages
    (32, 4, 128, 7, (1, 7, 8, 100, 200)),     # int8: the fold of a group of 8, across pages
    (6, 2, 16, 16, (5, 33, 200)),
    (6, 3, 20, 7, (1, 7, 8, 199)),
    (4, 2, 64, 200, (1, 200)),  # one block: the contiguous special case
]


@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("case", ATTN_CASES, ids=case_id)
def test_paged_attention_is_bit_identical_to_contiguous(case, kv):
    n_heads, n_kv, hd, page, lengths, *rest = case
    band = rest[0] if rest else ct.BAND_LONG
    max_seq, split = 200, 32
    rng = np.random.default_rng(page * 31 + hd)
    n_table = -(-max_seq // page)
    n_blocks = 3 * n_table
    table = rng.permutation(n_blocks)[:n_table].tolist()  # scattered, out of order
    rows = random_rows(rng, kv, max_seq, n_kv, hd)
    for visible in lengths:
        # rows past `visible` poisoned in both forms
        vis = {k: v[:visible] for k, v in rows.items()}
        layout, pool_v = paged(vis, kv, page, n_blocks, table, n_kv, hd, max_seq)
        k, v, ks, vs = contiguous(vis, kv, max_seq)
        q = rng.standard_normal(n_heads * hd).astype(np.float32)
        want, _, _ = ct.attention(q, k, v, ks, vs, n_heads, visible, split, KV_CODES[kv], band=band)
        got = ct.attention_paged(q, pool_v, layout.block_stride, page, layout.offsets(0), table, n_heads,
                                 n_kv, hd, max_seq, visible, split, KV_CODES[kv], band=band)
        assert np.isfinite(got).all() and same_bits(got, want), f"visible {visible}"


@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
def test_paged_kv_write_matches_contiguous_and_sets_the_table(kv):
    n_heads, n_kv, hd, page, max_seq = 6, 2, 16, 16, 64
    rng = np.random.default_rng(7)
    inv_freq = rope_inv_freq(hd, 1e6)
    q_norm = (1 + 0.2 * rng.standard_normal(hd)).astype(np.float32)
    k_norm = (1 + 0.2 * rng.standard_normal(hd)).astype(np.float32)
    layout = PoolLayout.plan(1, n_kv, hd, kv, max_seq_len=max_seq, page_size=page, n_blocks=6)
    pool0 = rng.integers(0, 256, layout.pool_bytes, dtype=np.uint8)
    tables0 = np.full((3, layout.max_blocks_per_seq), 5, np.int32)
    for position, block in ((0, 3), (17, 0), (63, 5)):
        qkv = rng.standard_normal((n_heads + 2 * n_kv) * hd).astype(np.float32)
        bits = {"fp32": np.float32, "bf16": np.uint16, "int8": np.int8}[kv]
        k0 = np.zeros((n_kv, max_seq, hd), bits)
        ks0 = np.zeros((n_kv, max_seq), np.float32) if kv == "int8" else None
        q_want, k, v, ks, vs = ct.qk_norm_rope_kv(qkv, n_heads, n_kv, hd, q_norm, k_norm, 1e-6, inv_freq,
                                                  position, k0, k0, ks0, ks0, KV_CODES[kv])
        q_got, pool, tables = ct.qk_norm_rope_kv_paged(
            qkv, n_heads, n_kv, hd, q_norm, k_norm, 1e-6, inv_freq, position, max_seq, pool0, layout.block_stride,
            page, layout.offsets(0), 2, block, tables0, KV_CODES[kv])
        assert same_bits(q_got, q_want)
        expected_tables = tables0.copy()
        expected_tables[2, position // page] = block
        assert np.array_equal(tables, expected_tables)
        # The written row, read back from the block, equals the contiguous kernel's row.
        r = position % page
        written = [("k", k), ("v", v)] + ([("k_scales", ks), ("v_scales", vs)] if kv == "int8" else [])
        for kind, contiguous_rows in written:
            row = layout._page(pool, block, 0, kind)[:, r]    # [n_kv, hd] or [n_kv]
            assert same_bits(row, contiguous_rows[:, position]), kind
        # Nothing else of the pool changed.
        mask = np.ones(layout.pool_bytes, bool)
        for s in layout.segments:
            elem = s.page_bytes // (n_kv * page)
            for h in range(n_kv):
                start = block * layout.block_stride + s.offset + (h * page + r) * elem
                mask[start:start + elem] = False
        assert same_bits(pool[mask], pool0[mask])
    # A block outside the pool stores nothing, table entry included.
    _, pool, tables = ct.qk_norm_rope_kv_paged(qkv, n_heads, n_kv, hd, None, None, 1e-6, inv_freq, 3, max_seq,
                                               pool0, layout.block_stride, page, layout.offsets(0), 0, 6, tables0,
                                               KV_CODES[kv])
    assert same_bits(pool, pool0) and np.array_equal(tables, tables0)


FUSED_CASES = [  # (n_heads, n_kv, hd, page, positions[, band]): single block, several, owner mid-grid
    (16, 8, 128, 64, (0, 5, 127, 128, 300, 1000)),
    (16, 8, 128, 24, (0, 23, 24, 500), TC),  # int8: a group of 2 on the tensor cores, across pages
    (32, 8, 128, 16, (0, 63, 64, 200)),
    (16, 4, 128, 24, (0, 23, 24, 500)),  # int8: the tensor-core fold, tiles across pages
    (32, 4, 128, 16, (0, 15, 16, 300)),  # int8: the fold of a group of 8, a tile in one page
    (8, 1, 128, 16, (3, 129)),
    (6, 2, 16, 16, (0, 17, 130)),
    (6, 3, 20, 7, (1, 8, 199)),
    (4, 4, 64, 32, (33, 250)),
    (4, 2, 256, 16, (40,)),
]


@pytest.mark.parametrize("split", [0, 32])
@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("case", FUSED_CASES, ids=case_id)
def test_fused_attention_is_rope_then_attention(case, kv, split):
    # The body's kernel (QK-norm + RoPE + the new row's write + attention, the new row taken
    # from shared memory) gives bit for bit what the attention-only kernel gives over the q and
    # the pool it leaves behind; and it stores what the KV-write entry point stores.
    n_heads, n_kv, hd, page, positions, *rest = case
    band = rest[0] if rest else ct.BAND_LONG
    max_seq = 1024 + 8
    rng = np.random.default_rng(hd * 7 + page + n_heads)
    inv_freq = rope_inv_freq(hd, 1e6)
    q_norm = (1 + 0.2 * rng.standard_normal(hd)).astype(np.float32)
    k_norm = (1 + 0.2 * rng.standard_normal(hd)).astype(np.float32)
    n_table = -(-max_seq // page)
    n_blocks = n_table + 5
    layout = PoolLayout.plan(1, n_kv, hd, kv, max_seq_len=max_seq, page_size=page, n_blocks=n_blocks)
    table = rng.permutation(n_blocks)[:n_table].astype(np.int32)
    rows = random_rows(rng, kv, max_seq, n_kv, hd)
    for position in positions:
        pool = np.full(layout.pool_bytes, 0xFF, np.uint8)
        layout.scatter(pool, table.tolist(), 0, {k: v[:position] for k, v in rows.items()})
        tables = np.full((2, layout.max_blocks_per_seq), -1, np.int32)
        tables[1, :n_table] = table
        if position % page == 0:
            tables[1, position // page] = -1  # a fresh block: the kernel stores its id
        row_block = int(table[position // page])
        qkv = rng.standard_normal((n_heads + 2 * n_kv) * hd).astype(np.float32)
        out, q_qkv, pool_after, tables_after = ct.attention_fused(
            qkv, n_heads, n_kv, hd, q_norm, k_norm, 1e-6, inv_freq, position, max_seq, pool,
            layout.block_stride, page, layout.offsets(0), 1, row_block, tables, split, KV_CODES[kv], band=band)
        assert np.isfinite(out).all(), f"position {position}"
        assert tables_after[1, position // page] == row_block
        q_want, pool_want, tables_want = ct.qk_norm_rope_kv_paged(
            qkv, n_heads, n_kv, hd, q_norm, k_norm, 1e-6, inv_freq, position, max_seq, pool,
            layout.block_stride, page, layout.offsets(0), 1, row_block, tables, KV_CODES[kv])
        assert same_bits(q_qkv, q_want) and same_bits(pool_after, pool_want)
        assert np.array_equal(tables_after, tables_want)
        q = q_qkv[:n_heads * hd]
        want = ct.attention_paged(q, pool_after, layout.block_stride, page, layout.offsets(0),
                                  tables_after[1, :n_table], n_heads, n_kv, hd, max_seq, position + 1,
                                  split, KV_CODES[kv], band=band)
        assert same_bits(out, want), f"position {position}"


# ---- the engine -------------------------------------------------------------------------------

def make_engine(config, tensors, kv="int8", max_seq_len=128, **kw):
    # These tests compare the decode body's paged reads and writes with themselves and with
    # the reference, step by step; the batched prefill (tests/test_prefill_gpu.py) rounds its
    # GEMM inputs to bf16 and so is compared within bounds there, not bit for bit here.
    kw.setdefault("prefill", "token")
    return Engine.from_tensors(config, tensors, kv=kv, max_seq_len=max_seq_len, device="gpu", **kw)




def pool_bytes(engine) -> np.ndarray:
    return np.frombuffer(ct.kv_cache_bytes(engine._gpu), np.uint8)


def test_layout_matches_the_python_mirror():
    config, tensors = synthetic("tiny-dense")
    for kv, page, blocks in (("int8", 16, 0), ("bf16", 64, 9), ("fp32", 200, 2)):
        with make_engine(config, tensors, kv=kv, kv_page_size=page, kv_pool_blocks=blocks,
                         kv_max_sequences=3) as engine:
            mirror = PoolLayout.for_config(config, kv, 128, page, blocks, 3)
            info = engine._gpu.pool.info()
            assert engine._gpu.pool.segments() == [(s.offset, s.page_bytes) for s in mirror.segments]
            assert info["block_stride_bytes"] == mirror.block_stride and info["page_size"] == page
            assert info["n_blocks"] == mirror.n_blocks == info["free_blocks"]
            assert info["pool_bytes"] == mirror.pool_bytes == engine.stats()["library"]["kv_cache_bytes"]
            assert info["max_sequences"] == 3 and info["live_sequences"] == 1 and info["current_sequence"] == 0


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("preset,kv", [("tiny-dense", "int8"), ("tiny-llama", "bf16"), ("tiny-dense", "fp32")])
def test_greedy_matches_reference_with_scrambled_blocks(preset, kv, page):
    config, tensors = synthetic(preset)
    ref = ReferenceDecoder(config, tensors, kv_dtype=kv, max_seq_len=128)
    ref_tokens, ref_logits = decode(ref.step, PROMPT, 64)
    with make_engine(config, tensors, kv=kv, kv_page_size=page, kv_pool_blocks=24) as engine:
        order = np.random.default_rng(page).permutation(24).tolist()
        ct.kv_set_free_order(engine._gpu.handle, order)
        tokens, logits = decode(engine.step, PROMPT, 64)
        seq_blocks = engine._gpu.pool.blocks(engine._seqs[0].lib_id)
        assert seq_blocks == order[:len(seq_blocks)]
        assert seq_blocks != sorted(seq_blocks) and any(abs(a - b) != 1 for a, b in zip(seq_blocks, seq_blocks[1:]))
        assert engine.stats()["graph_steps"] == len(PROMPT) + 64
        if kv == "fp32":  # the rows in the pool are the reference's, up to fp32 sum order
            layout = PoolLayout.for_config(config, kv, 128, page, 24)
            got = layout.gather(pool_bytes(engine), seq_blocks, engine.position, 1)
            want_k, want_v = ref.kv_cache.read(1, engine.position)
            assert rel_l2(got["k"], want_k) < 1e-4 and rel_l2(got["v"], want_v) < 1e-4
    assert_below(f"paged/{preset}/kv={kv}/page={page}", max(rel_l2(g, r) for g, r in zip(logits, ref_logits)))
    assert tokens == ref_tokens


def test_interleaved_sequences_equal_each_alone():
    config, tensors = synthetic("tiny-dense")
    other = [5, 400, 12, 77, 301, 2, 9, 88, 150, 42, 17]
    with make_engine(config, tensors, kv_page_size=16, kv_pool_blocks=32) as engine:
        alone = {}
        for name, prompt in (("a", PROMPT), ("b", other)):
            engine.reset()
            alone[name] = decode(engine.step, prompt, 40)
        engine.reset()
        a, b = engine.sequence, engine.new_sequence()
        logits = {a: engine.prefill(PROMPT)}
        engine.use(b)
        logits[b] = engine.prefill(other)
        got = {a: ([], []), b: ([], [])}
        for _ in range(40):
            for seq in (a, b):
                engine.use(seq)
                token = int(np.argmax(logits[seq]))
                got[seq][0].append(token)
                got[seq][1].append(logits[seq])
                logits[seq] = engine.step(token)
        graph = engine._gpu.graph
        assert graph is not None and engine.stats()["graph_steps"] == engine.stats()["tokens"]
        assert engine.stats()["h2d_per_token"] == 1.0 and engine.stats()["d2h_per_token"] == 1.0
    for seq, name in ((a, "a"), (b, "b")):
        assert got[seq][0] == alone[name][0]
        assert all(same_bits(x, y) for x, y in zip(got[seq][1], alone[name][1])), name


def test_seq_calls_act_on_the_named_sequence_and_leave_the_selection():
    """og_prefill_seq / og_begin_step_seq on an unselected sequence give the bits og_prefill /
    og_begin_step give on the selected one, and the selection stays where it was."""
    config, tensors = synthetic("tiny-dense")
    with make_engine(config, tensors, kv_page_size=16, kv_pool_blocks=32) as engine:
        gpu = engine._gpu
        lib, handle, pool = gpu.lib, gpu.handle, gpu.pool
        a = pool.current()
        b = pool.create()
        tokens = (ctypes.c_int32 * len(PROMPT))(*PROMPT)
        out = {a: np.full(config.vocab_size, np.nan, np.float32), b: np.full(config.vocab_size, np.nan, np.float32)}
        as_ptr = lambda array: array.ctypes.data_as(ctypes.POINTER(ctypes.c_float))  # noqa: E731
        capi.check(lib.og_prefill(handle, tokens, len(PROMPT), as_ptr(out[a])), "og_prefill")
        capi.check(lib.og_prefill_seq(handle, b, tokens, len(PROMPT), as_ptr(out[b])), "og_prefill_seq")
        assert pool.current() == a and same_bits(out[a], out[b])
        for _ in range(3):
            token = int(np.argmax(out[a]))
            for seq in (a, b):
                begin = (lib.og_begin_step(handle, token) if seq == a else
                         lib.og_begin_step_seq(handle, seq, token))
                capi.check(begin, "og_begin_step")
                capi.check(lib.og_run(handle), "og_run")
                capi.check(lib.og_end_step(handle), "og_end_step")
                out[seq] = gpu.logits_view.copy()
            assert pool.current() == a and same_bits(out[a], out[b])
        assert pool.length(a) == pool.length(b) == len(PROMPT) + 3
        assert lib.og_begin_step_seq(handle, 999, 1) == capi.OG_E_INVALID_ARGUMENT
        assert lib.og_prefill_seq(handle, 999, tokens, 1, None) == capi.OG_E_INVALID_ARGUMENT
        assert pool.length(b) == len(PROMPT) + 3


@pytest.mark.parametrize("prefix", [16, 21, 32])  # a whole number of blocks, and a partial one
def test_prefix_sharing_equals_no_sharing(prefix):
    config, tensors = synthetic("tiny-dense")
    prompt = (PROMPT * 3)[:prefix]
    tails = {"a": [11, 22, 33], "b": [44, 55, 66, 77]}
    with make_engine(config, tensors, kv_page_size=16, kv_pool_blocks=40) as engine:
        pool = engine._gpu.pool
        alone = {}
        for name, tail in tails.items():
            engine.reset()
            alone[name] = decode(engine.step, prompt + tail, 24)
        engine.reset()
        a = engine.sequence
        engine.prefill(prompt)
        free_before = pool.info()["free_blocks"]
        b = engine.fork(a)
        shared = pool.blocks(engine._seqs[a].lib_id)
        assert pool.blocks(engine._seqs[b].lib_id) == shared[:-(-prefix // 16)]
        assert all(pool.refcount(x) == 2 for x in shared) and pool.info()["free_blocks"] == free_before
        got = {}
        for name, seq in (("b", b), ("a", a)):  # the fork writes first
            engine.use(seq)
            got[name] = decode(engine.step, tails[name], 24)
        full = prefix // 16
        blocks_a = pool.blocks(engine._seqs[a].lib_id)
        blocks_b = pool.blocks(engine._seqs[b].lib_id)
        assert blocks_a[:full] == blocks_b[:full] == shared[:full]          # full blocks stay shared
        assert all(pool.refcount(x) == 2 for x in shared[:full])
        if prefix % 16:                                                    # the partial one was copied
            assert blocks_b[full] != shared[full] and blocks_a[full] == shared[full]
            assert pool.refcount(shared[full]) == 1
        engine.free_sequence(b)
        assert all(pool.refcount(x) == 1 for x in blocks_a)
        # the fork's private blocks went back, zeroed
        layout = PoolLayout.for_config(config, "int8", 128, 16, 40)
        raw = pool_bytes(engine)
        for x in set(blocks_b) - set(blocks_a):
            assert pool.refcount(x) == 0
            for s in layout.segments:
                start = x * layout.block_stride + s.offset
                assert not raw[start:start + s.page_bytes].any()
    for name in tails:
        assert got[name][0] == alone[name][0]
        assert all(same_bits(x, y) for x, y in zip(got[name][1], alone[name][1])), name


def test_fork_of_a_prefix_shares_it():
    config, tensors = synthetic("tiny-dense")
    with make_engine(config, tensors, kv_page_size=16, kv_pool_blocks=16) as engine:
        expected = decode(engine.step, PROMPT[:10] + [1, 2, 3], 8)
        engine.reset()
        engine.prefill(PROMPT + [9, 9, 9, 9])   # 20 rows: the prefix, then more
        b = engine.fork(length=10)
        engine.use(b)
        assert engine.position == 10
        got = decode(engine.step, [1, 2, 3], 8)
        assert got[0] == expected[0]
        assert all(same_bits(x, y) for x, y in zip(got[1], expected[1]))


def test_errors_come_before_any_state_change():
    config, tensors = synthetic("tiny-dense")
    with make_engine(config, tensors, max_seq_len=64, kv_page_size=16, kv_pool_blocks=5,
                     kv_max_sequences=3) as engine:
        pool = engine._gpu.pool
        engine.prefill(PROMPT * 4)           # 64 rows = 4 blocks
        a = engine.sequence
        b = engine.new_sequence()
        snapshot = (pool_bytes(engine).copy(), pool.info()["free_blocks"],
                    pool.blocks(engine._seqs[a].lib_id), pool.length(engine._seqs[a].lib_id))

        def unchanged():
            assert same_bits(pool_bytes(engine), snapshot[0]) and pool.info()["free_blocks"] == snapshot[1]
            assert pool.blocks(engine._seqs[a].lib_id) == snapshot[2]
            assert pool.length(engine._seqs[a].lib_id) == snapshot[3] == 64
            assert pool.blocks(engine._seqs[b].lib_id) == [] and pool.length(engine._seqs[b].lib_id) == 0

        with pytest.raises(EngineError, match="full|max_seq_len"):
            engine.step(1)                   # the sequence is at max_seq_len
        with pytest.raises(capi.LibraryError) as err:
            engine._gpu.begin(1)             # the library refuses as well
        assert err.value.status == capi.OG_E_CONTEXT_FULL
        unchanged()
        engine.use(b)
        with pytest.raises(EngineError, match="free KV blocks"):
            engine.prefill(PROMPT + PROMPT)  # needs 2 blocks, 1 is free: refused up front
        with pytest.raises(EngineError, match="free KV blocks"):
            engine.generate(PROMPT, 20)
        engine.use(a)
        unchanged()
        c = engine.new_sequence()
        with pytest.raises(EngineError, match="sequence slots"):
            engine.new_sequence()
        with pytest.raises(EngineError, match="sequence slots"):
            engine.fork(a)
        unchanged()
        for call in (lambda: pool.select(12345), lambda: pool.reset(-1), lambda: pool.set_length(engine._seqs[a].lib_id, 65)):
            with pytest.raises(capi.LibraryError) as err:
                call()
            assert err.value.status == capi.OG_E_INVALID_ARGUMENT
        unchanged()
        lib_c = engine._seqs[c].lib_id
        engine.free_sequence(c)
        with pytest.raises(capi.LibraryError) as err:
            pool.free(lib_c)                 # a second free of the same sequence
        assert err.value.status == capi.OG_E_INVALID_ARGUMENT and "not live" in str(err.value)
        with pytest.raises(capi.LibraryError) as err:
            ct.kv_zero_blocks(engine._gpu.handle, [5])
        assert err.value.status == capi.OG_E_INVALID_ARGUMENT
        unchanged()
        # Still working: the last block decodes b, and a after a reset matches a fresh run.
        engine.use(b)
        engine.prefill(PROMPT)
        engine.use(a)
        engine.reset()
        assert pool.info()["free_blocks"] == 4
        tokens = engine.generate(PROMPT, 16, stop_token_ids=())
    with make_engine(config, tensors, max_seq_len=64) as fresh:
        assert fresh.generate(PROMPT, 16, stop_token_ids=()) == tokens


def test_released_blocks_are_zero_and_zero_blocks_clears_pages():
    config, tensors = synthetic("tiny-dense")
    with make_engine(config, tensors, kv_page_size=16, kv_pool_blocks=8) as engine:
        pool = engine._gpu.pool
        layout = PoolLayout.for_config(config, "int8", 128, 16, 8)
        engine.prefill(PROMPT * 2)       # 32 rows: blocks 0, 1
        held = pool.blocks(engine._seqs[0].lib_id)
        raw = pool_bytes(engine)
        assert raw[:2 * layout.block_stride].any()
        other = engine.new_sequence()
        engine.use(other)
        engine.prefill(PROMPT)           # blocks 2
        before = pool_bytes(engine).copy()
        ct.kv_zero_blocks(engine._gpu.handle, [held[1]])   # a held block: only its pages change
        after = pool_bytes(engine)
        lo, hi = held[1] * layout.block_stride, (held[1] + 1) * layout.block_stride
        assert not after[lo:hi].any() and same_bits(after[:lo], before[:lo]) and same_bits(after[hi:], before[hi:])
        engine.use(0)
        engine.reset()                   # release: both blocks come back zero
        raw = pool_bytes(engine)
        assert not raw[held[0] * layout.block_stride:(held[0] + 1) * layout.block_stride].any()
        assert pool.info()["free_blocks"] == 8 - 1


def test_seek_reaches_a_context_without_a_prompt():
    config, tensors = synthetic("tiny-dense")
    with make_engine(config, tensors, max_seq_len=5000, kv_page_size=64) as engine:
        gpu = engine._gpu
        gpu.seek(4095)
        assert gpu.position == 4095 and len(gpu.pool.blocks(gpu.pool.current())) == 64
        logits = engine.step(1)
        assert np.isfinite(logits).all() and gpu.position == 4096
        gpu.seek(100)
        assert gpu.position == 100 and len(gpu.pool.blocks(gpu.pool.current())) == 2
        assert gpu.pool.info()["free_blocks"] == gpu.pool.info()["n_blocks"] - 2


# ---- long context ----------------------------------------------------------------------------

def long_context_check(context: int, kv: str, page: int, checks):
    """Teacher-forced decode of `context` random tokens on a 1-layer model, on the GPU (graph)
    and on the reference; logits compared at the positions in `checks`."""
    config = preset_config("tiny-dense", num_hidden_layers=1, max_position_embeddings=context + 64)
    tensors = dict(iter_tensors(config, seed=3))
    tokens = [int(t) for t in np.random.default_rng(context).integers(0, config.vocab_size, context)]
    ref = ReferenceDecoder(config, tensors, kv_dtype=kv, max_seq_len=context)
    want = {}
    done = 0
    for p in sorted(checks):
        if p > done:
            ref.prefill(tokens[done:p])
        want[p] = ref.step(tokens[p])
        done = p + 1
    got = {}
    with make_engine(config, tensors, kv=kv, max_seq_len=context, kv_page_size=page) as engine:
        for p, t in enumerate(tokens[:max(checks) + 1]):
            logits = engine.step(t)
            if p in want:
                got[p] = logits
        # One graph for each attention band the positions cross, each captured once.
        bands = {key[2] for key in engine._gpu._graphs}
        assert engine._gpu.captures == len(engine._gpu._graphs) == len(bands)
        assert engine.stats()["graph_steps"] == max(checks) + 1
    assert_below(f"paged/long-{context}/kv={kv}", max(rel_l2(got[p], want[p]) for p in checks),
                 f"worst logits rel. L2 at positions {checks}")
    for p in checks:
        assert int(np.argmax(got[p])) == int(np.argmax(want[p])) or \
            np.sort(want[p])[-1] - np.sort(want[p])[-2] < 1e-3 * np.abs(want[p]).max(), f"position {p}"


def test_long_context_4k():
    long_context_check(4096, "fp32", 64, [63, 64, 1000, 4095])


@pytest.mark.slow
def test_long_context_32k():
    long_context_check(32768, "fp32", 64, [4095, 16383, 32767])
