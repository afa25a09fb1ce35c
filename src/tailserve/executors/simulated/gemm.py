"""One GEMM's time on a GPU: row tiles, output tiles in waves over the SMs, a p-norm join of
compute and memory time, and a launch latency.

A GEMM of ``M`` token rows against an ``N x K`` weight shard is cut into output tiles of
``tile_m x tile_n``; each tile runs on one SM (streaming multiprocessor), so ``tiles / SMs``
waves run one after another and a partial last wave leaves SMs idle. Kernel libraries recover
part of that idle time (split-K, stream-K, a smaller tile for the shape), so a partial wave
costs ``alpha`` of a whole one: ``waves = x + alpha * (ceil(x) - x)`` with ``x = tiles / SMs``
(``alpha`` 1 is the hard wave count, 0 no wave quantization at all). Rows are padded to the row
tile (below one tile, to the smallest power of two >= 16: kernels with smaller row tiles exist).

Written with numpy operations only, so the same function prices one GEMM (the cost model) and
thousands of profile rows at once (the fit, ``profile_fit.py``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# The smallest row tile a GEMM kernel runs: the tensor-core MMA instruction is 16 rows high
# (m16n8k16), so fewer tokens than that still cost a 16-row tile.
MIN_TILE = 16


def padded_tokens(num_tokens: int, tile_m: int) -> int:
    """Rows a GEMM over ``num_tokens`` rows computes: up to one tile, the smallest power of two
    >= the count (kernels with smaller tiles exist down to ``MIN_TILE``); beyond, whole tiles."""
    if tile_m <= 1 or num_tokens <= 0:
        return num_tokens
    if num_tokens <= tile_m:
        return min(tile_m, max(MIN_TILE, 1 << (num_tokens - 1).bit_length()))
    return -(-num_tokens // tile_m) * tile_m


def padded_rows(rows: np.ndarray, tile_m: int) -> np.ndarray:
    """``padded_tokens`` over an array of row counts (>= 1)."""
    pow2 = np.maximum(MIN_TILE, 2.0 ** np.ceil(np.log2(np.maximum(rows, 1))))
    return np.where(rows <= tile_m, np.minimum(tile_m, pow2), np.ceil(rows / tile_m) * tile_m)


def join(compute_s: float, memory_s: float, p: float) -> float:
    """Time of a kernel that needs ``compute_s`` at its compute rate and ``memory_s`` at its
    bandwidth: ``max`` when p is infinite, the p-norm (>= max, <= sum) otherwise."""
    if p == math.inf or compute_s == 0.0 or memory_s == 0.0:
        return max(compute_s, memory_s)
    hi = max(compute_s, memory_s)
    lo = min(compute_s, memory_s)
    return hi * (1.0 + (lo / hi) ** p) ** (1.0 / p)


def join_array(compute_s: np.ndarray, memory_s: np.ndarray, p: float) -> np.ndarray:
    """``join`` element-wise."""
    hi, lo = np.maximum(compute_s, memory_s), np.minimum(compute_s, memory_s)
    if p == math.inf:
        return hi
    return hi * (1.0 + (lo / hi) ** p) ** (1.0 / p)


def wave_flops(padded_m: Any, n: Any, k: Any, tile_m: int, tile_n: int, sms: int, alpha: float) -> Any:
    """FLOPs the SMs spend on a GEMM whose rows are padded to ``padded_m``, counting a partial
    last wave as ``alpha`` of a full one (all SMs busy for ``waves`` tile times)."""
    row_tile = np.minimum(padded_m, tile_m)
    tiles = (padded_m / row_tile) * np.ceil(n / tile_n)
    x = tiles / sms
    waves = x + alpha * (np.ceil(x) - x)
    return waves * sms * 2.0 * row_tile * tile_n * k


def gemm_shapes(
    hidden: int, q: float, kv: float, inter: float, gated: bool
) -> tuple[tuple[float, float], ...]:
    """(N, K) of one decoder layer's four GEMMs on one shard: QKV, attention output, gate+up, down.
    ``q``/``kv``: query / key-value widths of the shard; ``inter``: the shard's MLP width."""
    up = (2 if gated else 1) * inter
    return ((q + 2 * kv, hidden), (hidden, q), (up, hidden), (hidden, inter))
