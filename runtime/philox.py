"""Philox4x32-10, the counter-based generator of Random123 and curand, in numpy.

The GPU sampling stage (cuda/sample.cu) draws from the same function, so a (seed, position,
token id) triple gives the same uniform number on the device and here:

    key     = (seed & 0xffffffff, seed >> 32)          seed: uint64
    counter = (id >> 2, position, 0, 0)                id: token id, position: the step's row
    word    = philox4x32_10(counter, key)[id & 3]
    u       = (word + 0.5) / 2**32                     in (0, 1), exact in float64
"""
from __future__ import annotations

import numpy as np

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_LO = np.uint64(0xFFFFFFFF)
_32 = np.uint64(32)


def philox4x32_10(counter, key) -> np.ndarray:
    """counter [..., 4] uint32, key [..., 2] uint32 (broadcast) -> [..., 4] uint32."""
    c = np.asarray(counter, dtype=np.uint64)
    k = np.asarray(key, dtype=np.uint64)
    c0, c1, c2, c3 = (c[..., j] for j in range(4))
    k0, k1 = k[..., 0], k[..., 1]
    for r in range(10):
        if r > 0:
            k0 = (k0 + _W0) & _LO
            k1 = (k1 + _W1) & _LO
        p0 = _M0 * c0                                    # < 2**64: exact in uint64
        p1 = _M1 * c2
        c0, c1, c2, c3 = (p1 >> _32) ^ c1 ^ k0, p1 & _LO, (p0 >> _32) ^ c3 ^ k1, p0 & _LO
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def uniforms(seed: int, position, ids: np.ndarray) -> np.ndarray:
    """The uniform numbers in (0, 1) of token ids [n] at `position` under `seed` (float64 [n]);
    position may be a vector [m] (then [m, n]: one row per position)."""
    ids = np.asarray(ids, dtype=np.int64)
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    positions = np.asarray(position, dtype=np.int64)
    blocks, where = np.unique(ids >> 2, return_inverse=True)
    counter = np.zeros(positions.shape + (blocks.size, 4), dtype=np.uint64)
    counter[..., 0] = blocks
    counter[..., 1] = (positions & 0xFFFFFFFF)[..., None]
    words = philox4x32_10(counter, np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint64))
    word = words[..., where.reshape(ids.shape), ids & 3]
    return (word.astype(np.float64) + 0.5) / 4294967296.0
