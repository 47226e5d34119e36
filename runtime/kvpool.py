"""The paged KV cache, host side.

The library owns the pool, the block allocator and the sequences (cuda/kv_pool.h: a C
allocator, so every language using the C ABI gets sequences, forks and the checks before any
state change). This module holds the Python side of it:

- ``PoolLayout``: where every layer's pages sit inside a packed block — the computation of
  plan_kv_layout in cuda/kv_pool.cu, repeated (tests hold the two equal through
  og_kv_segments) — with ``gather`` / ``scatter`` between a copy of the pool and the
  reference's contiguous rows.
- ``zero_blocks``: the host mirror of the block-zeroing kernel (cuda/kv_blocks.cu).
- ``DevicePool``: an engine's sequences and pool through the C ABI (what Engine uses).

A block packs, per layer: the K page [n_kv, page_size, head_dim] and the V page of the KV
element type, and for int8 the K and V scale pages [n_kv, page_size] fp32; each page starts
16-byte aligned and the block stride is rounded up to 256 bytes. So a page is smaller than
the block: block b's page of a segment starts at b * block_stride + offset, never at
b * page_bytes.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import ml_dtypes
import numpy as np

from . import capi

DEFAULT_PAGE_SIZE = 64       # og_config.kv_page_size = 0
DEFAULT_MAX_SEQUENCES = 16   # og_config.kv_max_sequences = 0
PAGE_ALIGN = 16              # bytes
BLOCK_ALIGN = 256            # bytes
KV_STORAGE = {"fp32": np.float32, "bf16": ml_dtypes.bfloat16, "int8": np.int8}
KINDS = ("k", "v", "k_scales", "v_scales")


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Segment:
    """One page of a packed block: bytes [offset, offset + page_bytes) of every block."""
    offset: int
    page_bytes: int
    layer: int
    kind: str  # "k", "v", "k_scales" or "v_scales"


@dataclass
class PoolLayout:
    layers: int
    n_kv_heads: int
    head_dim: int
    kv: str
    page_size: int
    n_blocks: int
    max_blocks_per_seq: int
    max_sequences: int
    block_stride: int
    segments: list[Segment] = field(default_factory=list)

    @classmethod
    def plan(cls, layers: int, n_kv_heads: int, head_dim: int, kv: str, max_seq_len: int,
             page_size: int = 0, n_blocks: int = 0, max_sequences: int = 0) -> "PoolLayout":
        """The library's layout for these og_config values (0 = the library's default)."""
        page = page_size or DEFAULT_PAGE_SIZE
        elem = np.dtype(KV_STORAGE[kv]).itemsize
        sizes = {"k": n_kv_heads * page * head_dim * elem, "v": n_kv_heads * page * head_dim * elem,
                 "k_scales": n_kv_heads * page * 4, "v_scales": n_kv_heads * page * 4}
        kinds = KINDS if kv == "int8" else KINDS[:2]
        segments, cursor = [], 0
        for layer in range(layers):
            for kind in kinds:
                cursor = _round_up(cursor, PAGE_ALIGN)
                segments.append(Segment(cursor, sizes[kind], layer, kind))
                cursor += sizes[kind]
        return cls(layers, n_kv_heads, head_dim, kv, page, n_blocks or -(-max_seq_len // page),
                   -(-max_seq_len // page), max_sequences or DEFAULT_MAX_SEQUENCES,
                   _round_up(cursor, BLOCK_ALIGN), segments)

    @classmethod
    def for_config(cls, config, kv: str, max_seq_len: int, page_size: int = 0, n_blocks: int = 0,
                   max_sequences: int = 0) -> "PoolLayout":
        return cls.plan(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, kv,
                        max_seq_len, page_size, n_blocks, max_sequences)

    @property
    def pool_bytes(self) -> int:
        return self.block_stride * self.n_blocks

    def segment(self, layer: int, kind: str) -> Segment:
        per_layer = 4 if self.kv == "int8" else 2
        s = self.segments[layer * per_layer + KINDS.index(kind)]
        assert s.layer == layer and s.kind == kind
        return s

    def offsets(self, layer: int) -> dict[str, int]:
        """Byte offsets of a layer's pages inside a block, by kind."""
        return {s.kind: s.offset for s in self.segments if s.layer == layer}

    def _page(self, pool: np.ndarray, block: int, layer: int, kind: str) -> np.ndarray:
        """A view of one page: [n_kv, page_size, head_dim] values or [n_kv, page_size] scales."""
        s = self.segment(layer, kind)
        start = block * self.block_stride + s.offset
        raw = pool[start:start + s.page_bytes]
        if kind in ("k", "v"):
            return raw.view(KV_STORAGE[self.kv]).reshape(self.n_kv_heads, self.page_size, self.head_dim)
        return raw.view(np.float32).reshape(self.n_kv_heads, self.page_size)

    def gather(self, pool: np.ndarray, blocks: Sequence[int], length: int, layer: int) -> dict[str, np.ndarray]:
        """Rows [0, length) of a sequence from a copy of the pool (uint8 [pool_bytes]), in
        the reference's axes: k, v [length, n_kv, head_dim]; k_scales, v_scales [length, n_kv]."""
        pool = np.asarray(pool).view(np.uint8).reshape(-1)
        kinds = KINDS if self.kv == "int8" else KINDS[:2]
        out = {kind: [] for kind in kinds}
        for start in range(0, length, self.page_size):
            rows = min(self.page_size, length - start)
            block = blocks[start // self.page_size]
            for kind in kinds:
                page = self._page(pool, block, layer, kind)          # [n_kv, page, ...]
                out[kind].append(np.swapaxes(page[:, :rows], 0, 1))  # [rows, n_kv, ...]
        empty = {"k": (0, self.n_kv_heads, self.head_dim), "v": (0, self.n_kv_heads, self.head_dim),
                 "k_scales": (0, self.n_kv_heads), "v_scales": (0, self.n_kv_heads)}
        return {kind: (np.ascontiguousarray(np.concatenate(parts)) if parts else
                       np.zeros(empty[kind], KV_STORAGE[self.kv] if kind in ("k", "v") else np.float32))
                for kind, parts in out.items()}

    def scatter(self, pool: np.ndarray, blocks: Sequence[int], layer: int, rows: dict[str, np.ndarray]) -> None:
        """The inverse of gather, in place: rows[kind] [length, n_kv, ...] into the blocks."""
        pool = pool.view(np.uint8).reshape(-1)
        length = len(rows["k"])
        for start in range(0, length, self.page_size):
            n = min(self.page_size, length - start)
            block = blocks[start // self.page_size]
            for kind, values in rows.items():
                page = self._page(pool, block, layer, kind)
                page[:, :n] = np.swapaxes(values[start:start + n], 0, 1)


def zero_blocks(backing: np.ndarray, pool_offset: int, block_stride: int,
                segments: Iterable[tuple[int, int]], block_ids: Iterable[int]) -> np.ndarray:
    """Host mirror of the zeroing kernel, in place on `backing` (any dtype, addressed in bytes):
    for every block b and segment (offset, page_bytes), zero the bytes
    [pool_offset + b * block_stride + offset, ... + page_bytes). Returns backing."""
    raw = backing.view(np.uint8).reshape(-1)
    segments = list(segments)
    for block in block_ids:
        for offset, page_bytes in segments:
            start = pool_offset + int(block) * block_stride + offset
            raw[start:start + page_bytes] = 0
    return backing


class DevicePool:
    """One engine's KV pool and sequences, through the C ABI (og_seq_*, og_kv_*). Every error
    is a capi.LibraryError carrying the library's message; a failed call changed nothing."""

    def __init__(self, lib, handle):
        self.lib = lib
        self.handle = handle

    def _int(self, fn: str, *args) -> int:
        out = ctypes.c_int32(-1)
        capi.check(getattr(self.lib, fn)(self.handle, *args, ctypes.byref(out)), fn)
        return out.value

    def _call(self, fn: str, *args) -> None:
        capi.check(getattr(self.lib, fn)(self.handle, *args), fn)

    # sequences
    def create(self) -> int:
        return self._int("og_seq_create")

    def fork(self, seq: int) -> int:
        return self._int("og_seq_fork", seq)

    def select(self, seq: int) -> None:
        self._call("og_seq_select", seq)

    def current(self) -> int:
        return self._int("og_seq_current")

    def reset(self, seq: int) -> None:
        self._call("og_seq_reset", seq)

    def free(self, seq: int) -> None:
        self._call("og_seq_free", seq)

    def length(self, seq: int) -> int:
        return self._int("og_seq_length", seq)

    def set_length(self, seq: int, length: int) -> None:
        self._call("og_seq_set_length", seq, length)

    def reserve(self, seq: int, n_tokens: int) -> None:
        self._call("og_seq_reserve", seq, n_tokens)

    def blocks(self, seq: int) -> list[int]:
        count = ctypes.c_int32(0)
        capi.check(self.lib.og_seq_blocks(self.handle, seq, None, 0, ctypes.byref(count)), "og_seq_blocks")
        ids = (ctypes.c_int32 * max(1, count.value))()
        capi.check(self.lib.og_seq_blocks(self.handle, seq, ids, count.value, ctypes.byref(count)),
                   "og_seq_blocks")
        return list(ids[:count.value])

    # the pool
    def info(self) -> dict:
        info = capi.OgKvPoolInfo()
        capi.check(self.lib.og_get_kv_pool_info(self.handle, ctypes.byref(info)), "og_get_kv_pool_info")
        return info.as_dict()

    def segments(self) -> list[tuple[int, int]]:
        """(offset, page_bytes) of every segment of a block, in address order."""
        count = ctypes.c_int32(0)
        capi.check(self.lib.og_kv_segments(self.handle, None, None, 0, ctypes.byref(count)), "og_kv_segments")
        offsets = (ctypes.c_int64 * max(1, count.value))()
        pages = (ctypes.c_int64 * max(1, count.value))()
        capi.check(self.lib.og_kv_segments(self.handle, offsets, pages, count.value, ctypes.byref(count)),
                   "og_kv_segments")
        return [(offsets[i], pages[i]) for i in range(count.value)]

    def refcount(self, block: int) -> int:
        return self._int("og_kv_block_refcount", block)
