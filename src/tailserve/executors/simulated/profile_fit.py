"""Fit the cost model's GEMM curve and all-reduce terms to measured profiles; error tables.

The linear-layer fit searches the curve's parameters (``Efficiency``: compute and memory
efficiency, the p-norm sharpness, the row tile, the per-GEMM launch latency) for the smallest
mean |relative error| over the training profiles, evaluating the cost model's own linear-layer
formula (``CostModel.linear_time``) vectorised over the samples: a coarse grid, then a finer one
around the best point; the launch latency for each candidate is the least-squares value.

The all-reduce fit is the cost model's ring formula ``latency + 2 (n-1)/n * bytes / (link * eff)``
with one latency and one efficiency per GPU, least squares in relative error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from tailserve.executors.simulated.cost_model import GEMMS_PER_LAYER, CostModel, Efficiency
from tailserve.executors.simulated.gemm import join_array, padded_rows, padded_tokens, wave_flops
from tailserve.executors.simulated.hardware import AllReduceBand, Hardware
from tailserve.executors.simulated.profiles import AllReduceSample, LinearProfile

SHARPNESS_GRID = (1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0, 3.5, 4.0, 6.0, math.inf)
TILE_GRID = (64, 128, 256)


@dataclass(frozen=True, slots=True)
class ErrorStats:
    name: str
    num_points: int
    mean_abs: float  # mean |predicted / measured - 1|
    max_abs: float
    bias: float  # mean signed error (> 0: the model is too slow)

    @staticmethod
    def of(name: str, predicted: np.ndarray, measured: np.ndarray) -> ErrorStats:
        e = predicted / measured - 1.0
        return ErrorStats(
            name, len(e), float(np.mean(np.abs(e))), float(np.max(np.abs(e))), float(np.mean(e))
        )


class _LinearTerms:
    """The per-sample pieces of ``CostModel.linear_time`` for one profile (one layer, LM head
    off), so a candidate efficiency is priced with array arithmetic."""

    def __init__(self, profile: LinearProfile, hardware: Hardware) -> None:
        self.profile = profile
        self.hardware = hardware
        self.tokens = np.array([s.num_tokens for s in profile.samples])
        self.measured = np.array([s.seconds for s in profile.samples])
        flops, weights, per_token = [], [], []
        for s in profile.samples:
            cm = CostModel(profile.model, hardware, s.tp, Efficiency(tile_m=2))
            flops.append(cm._linear_flops_per_token)
            weights.append(cm._layer_weight_bytes)
            per_token.append(cm._act_bytes_per_token + cm._kv_bytes_per_token)
        self.flops = np.array(flops)
        self.bytes = np.array(weights) + self.tokens * np.array(per_token)
        self._padded: dict[int, np.ndarray] = {}
        # The wave form's per-GEMM pieces: (N, K) per sample and GEMM, KV writes with the QKV.
        shapes = [CostModel(profile.model, hardware, s.tp)._gemm_shapes for s in profile.samples]
        self.n = np.array([[nk[0] for nk in sh] for sh in shapes])
        self.k = np.array([[nk[1] for nk in sh] for sh in shapes])
        kv = np.array([CostModel(profile.model, hardware, s.tp)._kv_bytes_per_token for s in profile.samples])
        self.extra = np.zeros_like(self.n)
        self.extra[:, 0] = self.tokens * kv
        self._waves: dict[tuple[int, int, float], tuple[np.ndarray, np.ndarray]] = {}

    def padded(self, tile: int) -> np.ndarray:
        if tile not in self._padded:
            self._padded[tile] = np.array([padded_tokens(int(n), tile) for n in self.tokens])
        return self._padded[tile]

    def wave_parts(self, tile_m: int, tile_n: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
        """(compute s at peak, memory s at full bandwidth) per sample and GEMM, the wave form."""
        key = (tile_m, tile_n, alpha)
        if key not in self._waves:
            hw = self.hardware
            rows = self.tokens[:, None].astype(float)
            flops = wave_flops(padded_rows(rows, tile_m), self.n, self.k, tile_m, tile_n, hw.sms, alpha)
            moved = (self.n * self.k + rows * (self.k + self.n)) * self.profile.model.dtype_bytes + self.extra
            self._waves[key] = (flops / hw.peak_flops, moved / hw.memory_bandwidth)
        return self._waves[key]

    def times(self, eff: Efficiency) -> np.ndarray:
        """Seconds per sample with ``eff`` (== CostModel.linear_time(n) per sample)."""
        hw = self.hardware
        if eff.tile_n:
            c, m = self.wave_parts(eff.tile_m, eff.tile_n, eff.wave_alpha)
            per_gemm = join_array(c / eff.compute, m / eff.memory, eff.sharpness)
            return per_gemm.sum(axis=1) + GEMMS_PER_LAYER * eff.gemm_latency
        c = self.padded(eff.tile_m) * self.flops / (hw.peak_flops * eff.compute)
        m = self.bytes / (hw.memory_bandwidth * eff.memory)
        return _join(c, m, eff.sharpness) + GEMMS_PER_LAYER * eff.gemm_latency


def _join(c: np.ndarray, m: np.ndarray, p: float) -> np.ndarray:
    hi, lo = np.maximum(c, m), np.minimum(c, m)
    if p == math.inf:
        return hi
    return hi * (1.0 + (lo / hi) ** p) ** (1.0 / p)


def _best_latency(base: np.ndarray, y: np.ndarray) -> float:
    """The launch latency L >= 0 minimising sum(((base + 4L) / y - 1)^2)."""
    w = GEMMS_PER_LAYER / y
    return max(0.0, float(np.sum(w * (1.0 - base / y)) / np.sum(w * w)))


def _score(terms: list[_LinearTerms], eff: Efficiency) -> tuple[float, Efficiency]:
    base = [t.times(replace(eff, gemm_latency=0.0)) for t in terms]
    y = np.concatenate([t.measured for t in terms])
    lat = _best_latency(np.concatenate(base), y)
    pred = np.concatenate(base) + GEMMS_PER_LAYER * lat
    return float(np.mean(np.abs(pred / y - 1.0))), replace(eff, gemm_latency=lat)


# The wave form's search: (row tile, column tile, partial-wave cost). Tiles are the CUTLASS /
# cuBLAS tensor-core tile shapes of bf16 GEMMs on Ampere and Hopper.
WAVE_GRID = tuple(
    (tm, tn, alpha)
    for tm, tn in ((128, 128), (128, 256), (256, 128))
    for alpha in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)
)
LAYER_GRID = tuple((tile, 0, 1.0) for tile in TILE_GRID)


def fit_linear(
    profiles: list[LinearProfile], hardware: Hardware, shapes: tuple[tuple[int, int, float], ...] = LAYER_GRID
) -> Efficiency:
    """The GEMM curve that best fits these profiles (all measured on ``hardware``), searching the
    (tile_m, tile_n, wave_alpha) ``shapes``: tile_n 0 is the one-join-per-layer form, else the
    per-GEMM wave form (which needs ``hardware.sms``)."""
    if not profiles:
        raise ValueError("no linear-layer profiles to fit")
    if any(tn for _, tn, _ in shapes) and hardware.sms < 1:
        raise ValueError(f"hardware {hardware.name}: the per-GEMM wave form needs its SM count")
    terms = [_LinearTerms(p, hardware) for p in profiles]
    best: tuple[float, Efficiency] | None = None

    def consider(eff: Efficiency) -> None:
        nonlocal best
        scored = _score(terms, eff)
        if best is None or scored[0] < best[0]:
            best = scored

    coarse = np.arange(0.30, 1.001, 0.05)
    for tile, tile_n, alpha in shapes:
        for p in SHARPNESS_GRID:
            for ce in coarse:
                for me in coarse:
                    consider(
                        Efficiency(
                            compute=float(ce),
                            memory=float(me),
                            sharpness=p,
                            tile_m=tile,
                            tile_n=tile_n,
                            wave_alpha=alpha,
                        )
                    )
    assert best is not None
    for step, span in ((0.01, 0.05), (0.002, 0.01)):
        centre = best[1]
        ps = sorted({centre.sharpness, *[q for q in SHARPNESS_GRID if _near(q, centre.sharpness)]})
        for p in ps:
            for ce in np.arange(centre.compute - span, centre.compute + span + 1e-9, step):
                for me in np.arange(centre.memory - span, centre.memory + span + 1e-9, step):
                    if 0 < ce <= 1.0 and 0 < me <= 1.0:
                        consider(replace(centre, compute=float(ce), memory=float(me), sharpness=p))
    return best[1]


def _near(q: float, p: float) -> bool:
    grid = list(SHARPNESS_GRID)
    i = grid.index(p) if p in grid else 0
    return q in grid[max(0, i - 1) : i + 2]


def linear_errors(profile: LinearProfile, hardware: Hardware, eff: Efficiency) -> ErrorStats:
    terms = _LinearTerms(profile, hardware)
    return ErrorStats.of(profile.model.name, terms.times(eff), terms.measured)


def linear_errors_by_tp(profile: LinearProfile, hardware: Hardware, eff: Efficiency) -> list[ErrorStats]:
    terms = _LinearTerms(profile, hardware)
    pred = terms.times(eff)
    tps = np.array([s.tp for s in profile.samples])
    return [
        ErrorStats.of(f"{profile.model.name} TP{tp}", pred[tps == tp], terms.measured[tps == tp])
        for tp in sorted(set(tps.tolist()))
    ]


# ---- all-reduce --------------------------------------------------------------------------------
def all_reduce_time(hardware: Hardware, comm_eff: float, num_gpus: int, num_bytes: np.ndarray) -> np.ndarray:
    """The cost model's ring all-reduce for one message (``CostModel._comm`` per collective)."""
    ring = 2.0 * (num_gpus - 1) / num_gpus
    latency = hardware.allreduce_latency_at(num_gpus)
    return latency + ring * num_bytes / (hardware.interconnect_bandwidth * comm_eff)


def fit_all_reduce(samples: list[AllReduceSample], hardware: Hardware) -> tuple[dict[int, float], float]:
    """({TP: latency seconds}, link efficiency) minimising the relative squared error over the
    samples: ``t = L_tp + x * ring * bytes / link`` is linear in (L_2, L_4, ..., x = 1/eff)."""
    tps = sorted({s.num_gpus for s in samples})
    y = np.array([s.seconds for s in samples])
    cols = [np.array([1.0 if s.num_gpus == tp else 0.0 for s in samples]) for tp in tps]
    ring = np.array([2.0 * (s.num_gpus - 1) / s.num_gpus * s.num_bytes for s in samples])
    a = np.column_stack([*cols, ring / hardware.interconnect_bandwidth]) / y[:, None]
    solution, *_ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
    *lats, inv_eff = (float(v) for v in solution)
    if min(lats) < 0 or inv_eff <= 0:
        raise ValueError("the all-reduce profile does not fit latency + bytes / bandwidth")
    return dict(zip(tps, lats)), 1.0 / inv_eff


# Band edges (bytes) for the banded all-reduce fit: near NCCL's protocol changes on one NVLink
# node (LL below ~512 KB, LL128 to a few MB, Simple above), in whole powers of two.
ALL_REDUCE_EDGES = (512 * 1024, 8 * 2**20)


def _fit_line(ring_bytes: np.ndarray, y: np.ndarray, link: float) -> tuple[float, float]:
    """(latency >= 0, efficiency) of ``t = L + ring_bytes / (link * eff)`` in relative least squares."""
    a = np.column_stack([np.ones_like(y), ring_bytes / link]) / y[:, None]
    (lat, inv), *_ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
    if lat < 0:  # no room for a latency: the line through the origin
        lat, inv = 0.0, float(np.sum(ring_bytes / link / y) / np.sum((ring_bytes / link / y) ** 2))
    if inv <= 0:  # flat band (latency-bound): the bandwidth term is not resolved; keep the link's own
        inv = 1.0
        lat = float(np.mean(y - ring_bytes / link))
    return float(lat), float(1.0 / inv)


def fit_all_reduce_bands(
    samples: list[AllReduceSample], hardware: Hardware, edges: tuple[float, ...] = ALL_REDUCE_EDGES
) -> tuple[AllReduceBand, ...]:
    """One (latency, efficiency) line per TP degree and message-size band, relative least squares."""
    bands = []
    for tp in sorted({s.num_gpus for s in samples}):
        these = [s for s in samples if s.num_gpus == tp]
        b = np.array([s.num_bytes for s in these], dtype=float)
        y = np.array([s.seconds for s in these])
        ring = 2.0 * (tp - 1) / tp * b
        lows = (0.0, *edges)
        highs = (*edges, math.inf)
        for lo, hi in zip(lows, highs):
            m = (b > lo) & (b <= hi)
            if m.sum() < 2:
                continue
            lat, eff = _fit_line(ring[m], y[m], hardware.interconnect_bandwidth)
            bands.append(AllReduceBand(tp, hi if hi != math.inf else float(b.max()), lat, eff))
    return tuple(bands)


def all_reduce_band_time(bands: tuple[AllReduceBand, ...], link: float, num_bytes: np.ndarray) -> np.ndarray:
    """The banded all-reduce (one TP degree's bands, ascending) for each message size."""
    out = np.empty(len(num_bytes))
    lower = 0.0
    for i, band in enumerate(bands):
        m = num_bytes > lower if i == len(bands) - 1 else (num_bytes > lower) & (num_bytes <= band.max_bytes)
        ring = 2.0 * (band.tp - 1) / band.tp
        out[m] = band.latency + ring * num_bytes[m] / (link * band.efficiency)
        lower = band.max_bytes
    return out


def all_reduce_band_errors(samples: list[AllReduceSample], hardware: Hardware) -> list[ErrorStats]:
    out = []
    for n in sorted({s.num_gpus for s in samples}):
        these = [s for s in samples if s.num_gpus == n]
        b = np.array([s.num_bytes for s in these], dtype=float)
        y = np.array([s.seconds for s in these])
        pred = all_reduce_band_time(hardware.allreduce_bands_at(n), hardware.interconnect_bandwidth, b)
        out.append(ErrorStats.of(f"TP{n}", pred, y))
    return out


def all_reduce_errors(
    samples: list[AllReduceSample], hardware: Hardware, comm_eff: float
) -> list[ErrorStats]:
    out = []
    for n in sorted({s.num_gpus for s in samples}):
        these = [s for s in samples if s.num_gpus == n]
        b = np.array([s.num_bytes for s in these], dtype=float)
        y = np.array([s.seconds for s in these])
        out.append(ErrorStats.of(f"TP{n}", all_reduce_time(hardware, comm_eff, n, b), y))
    return out


def tp_message_sizes(
    samples: list[AllReduceSample], lo: int = 8 * 1024, hi: int = 128 * 2**20
) -> list[AllReduceSample]:
    """The messages tensor parallelism sends: one token of a 4,096-wide model (8 KB) to 8,192
    tokens of an 8,192-wide one (128 MB), at TP 2, 4 and 8."""
    return [s for s in samples if lo <= s.num_bytes <= hi and s.num_gpus in (2, 4, 8)]


def describe(path: str | Path) -> str:
    p = Path(path)
    return f"{p.parent.parent.name}/{p.parent.name}" if p.name == "mlp.csv" else p.name
