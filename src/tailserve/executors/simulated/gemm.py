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
    # ``max`` and ``min`` spelled out (the same values): the builtins parse their arguments as
    # keywords, ~750 instructions a call, and this runs for every GEMM of a stepped iteration.
    hi = memory_s if memory_s > compute_s else compute_s
    if p == math.inf or compute_s == 0.0 or memory_s == 0.0:
        return hi
    lo = memory_s if memory_s < compute_s else compute_s
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


def shape_tiles(rows: Any, n: Any, m_tiles: tuple, tile_m: int, tile_n: int) -> tuple[Any, Any]:
    """Each GEMM's (tile M, tile N): the first ``m_tiles`` entry (rows at most, N at most, tile M,
    tile N; a bound of 0 matches any) it falls in, else ``tile_m x tile_n``."""
    rows, n = np.asarray(rows, dtype=float), np.asarray(n, dtype=float)
    if not m_tiles:
        return np.full(rows.shape, float(tile_m)), np.full(rows.shape, float(tile_n))
    conds = [((rows <= r) if r else True) & ((n <= c) if c else True) for r, c, _, _ in m_tiles]
    conds = [np.broadcast_to(cond, np.broadcast(rows, n).shape) for cond in conds]
    tm = np.select(conds, [float(e[2]) for e in m_tiles], float(tile_m))
    tn = np.select(conds, [float(e[3]) for e in m_tiles], float(tile_n))
    return tm, tn


def curve_gemm_time(
    rows: Any,
    n: Any,
    k: Any,
    curve: Any,
    peak: float,
    bandwidth: float,
    sms: int,
    weight_bytes: float,
    act_bytes: float,
    extra_bytes: Any = 0.0,
) -> Any:
    """One GEMM on a ``hardware.GemmCurve`` of its own format: ``rows`` x K times a K x N weight
    of ``weight_bytes`` per element, activations of ``act_bytes`` in and out, plus
    ``extra_bytes``; output tiles in waves over ``sms`` SMs (none when the curve's tile_n is 0),
    the p-norm join at the curve's efficiencies of ``peak`` and ``bandwidth``, its launch
    latency. Scalars or numpy arrays (the cost model and the fit, fidelity_aisim.py)."""
    rows = np.asarray(rows, dtype=float)
    tm, tn = shape_tiles(rows, n, curve.m_tiles, curve.tile_m, curve.tile_n)
    padded = padded_rows(rows, tm) * (rows > 0)
    if curve.tile_n or curve.m_tiles:
        flops = wave_flops(padded, n, k, tm, tn, sms, curve.wave_alpha)
    else:
        flops = 2.0 * padded * n * k
    moved = n * k * weight_bytes + rows * (k + n) * act_bytes + extra_bytes
    t = join_array(flops / (peak * curve.compute), moved / (bandwidth * curve.memory), curve.sharpness)
    t = t + curve.gemm_latency
    return float(t) if t.ndim == 0 else t


def gemm_shapes(
    hidden: int, q: float, kv: float, inter: float, gated: bool
) -> tuple[tuple[float, float], ...]:
    """(N, K) of one decoder layer's four GEMMs on one shard: QKV, attention output, gate+up, down.
    ``q``/``kv``: query / key-value widths of the shard; ``inter``: the shard's MLP width."""
    up = (2 if gated else 1) * inter
    return ((q + 2 * kv, hidden), (hidden, q), (up, hidden), (hidden, inter))
