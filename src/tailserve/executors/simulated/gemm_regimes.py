"""Each GEMM's own series in Vidur's profiles, its kernel-choice jumps, and whether another
model's series of the same GPU predicts them.

``profiles.load_linear_profile`` sums a decoder layer's four linear layers; the fits price that
sum. The largest held-out errors sit where one GEMM's measured time jumps between neighbouring
token counts by far more than any tile or wave step (the GEMM library switches kernel): on the
H100, Llama-2-70B's down projection takes 269 us at 512 tokens and 690 us at 520. This module
reads each GEMM on its own — ``(model, op, TP)`` with its ``(N, K)`` on the shard and its time
per token count — so the jumps can be located, compared across models, and tried as a
correction:

- ``jumps``: token counts where a series' time moves between neighbouring counts by more than
  the curve says (``|log(measured ratio / curve ratio)| > log(1 + threshold)``).
- ``transfer_times``: a held-out GEMM priced as the curve times the measured / curve ratio of a
  training GEMM at the same token count — the training GEMM of the same ``(N, K)`` (``exact``),
  the nearest in ``(log N, log K)`` (``nearest``), or the median ratio of every training GEMM at
  that count (``by-tokens``: a per-GPU rule in the token count alone).

The curve is the per-GEMM wave form (``gemm.py``, ``Efficiency.tile_n > 0``) with a fitted
efficiency; a layer's time is the sum of its four GEMMs (``tile_choice.py`` is a further form
priced on the same series).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tailserve.executors.simulated.cost_model import CostModel, Efficiency
from tailserve.executors.simulated.gemm import join_array, padded_rows, wave_flops
from tailserve.executors.simulated.hardware import Hardware
from tailserve.executors.simulated.profiles import LINEAR_OPS, _number, _rows, load_linear_profile

OPS = ("qkv", "o", "up", "down")  # LINEAR_OPS in order, short names
MODES = ("exact", "nearest", "by-tokens")


@dataclass(frozen=True)
class GemmSeries:
    """One GEMM of one model at one TP degree: median time per token count."""

    model: str
    op: str  # one of OPS
    tp: int
    n: int  # output width on the shard
    k: int  # input width on the shard
    tokens: np.ndarray  # ascending token counts (M)
    seconds: np.ndarray
    extra_bytes_per_token: float = 0.0  # KV written with the QKV projection (as the wave form counts it)
    dtype_bytes: float = 2.0  # the model's weight and activation width

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def label(self) -> str:
        return f"{self.model} {self.op} TP{self.tp} ({self.n}x{self.k})"


def load_gemm_series(path: str | Path) -> list[GemmSeries]:
    """Every (op, TP) series of an ``mlp.csv`` (rows checked as ``load_linear_profile`` does)."""
    p = Path(path)
    profile = load_linear_profile(p)  # validates the file and gives the layer's shape
    times: dict[tuple[int, int, int], list[float]] = defaultdict(list)
    for line, row in _rows(p, tuple(f"time_stats.{op}.median" for op in LINEAR_OPS)):
        n = int(_number(p, line, row, "num_tokens", int))
        tp = int(_number(p, line, row, "num_tensor_parallel_workers", int))
        for i, op in enumerate(LINEAR_OPS):
            times[(tp, i, n)].append(_number(p, line, row, f"time_stats.{op}.median") * 1e-3)
    model = profile.model
    out = []
    for tp in sorted({key[0] for key in times}):
        cm = CostModel(model, _ANY_GPU, tp)
        for i, (n, k) in enumerate(cm._gemm_shapes):
            counts = sorted(m for (t, j, m) in times if t == tp and j == i)
            secs = [float(np.median(times[(tp, i, m)])) for m in counts]
            extra = cm._kv_bytes_per_token if i == 0 else 0.0
            out.append(
                GemmSeries(
                    model.name,
                    OPS[i],
                    tp,
                    int(n),
                    int(k),
                    np.array(counts),
                    np.array(secs),
                    extra,
                    model.dtype_bytes,
                )
            )
    return out


# The shard shapes do not depend on the GPU; CostModel only needs some hardware to build.
_ANY_GPU = Hardware("any", 1e12, 1e12, 80.0, 1e11, 1e10, sms=1)


def gemm_parts(
    series: GemmSeries, hardware: Hardware, tile_m: int, tile_n: int, alpha: float
) -> tuple[np.ndarray, np.ndarray]:
    """(seconds at peak FLOP/s, seconds at full bandwidth) per token count, one tile shape."""
    rows = series.tokens.astype(float)
    flops = wave_flops(padded_rows(rows, tile_m), series.n, series.k, tile_m, tile_n, hardware.sms, alpha)
    moved = (series.n * series.k + rows * (series.k + series.n)) * series.dtype_bytes
    moved = moved + rows * series.extra_bytes_per_token
    return flops / hardware.peak_flops, moved / hardware.memory_bandwidth


def curve_times(series: GemmSeries, hardware: Hardware, eff: Efficiency) -> np.ndarray:
    """The wave form's time for each of the series' token counts (== ``CostModel._gemm``)."""
    if not eff.tile_n:
        raise ValueError("the per-GEMM curve needs the wave form (Efficiency.tile_n > 0)")
    c, m = gemm_parts(series, hardware, eff.tile_m, eff.tile_n, eff.wave_alpha)
    return join_array(c / eff.compute, m / eff.memory, eff.sharpness) + eff.gemm_latency


def ratios(series: GemmSeries, hardware: Hardware, eff: Efficiency) -> np.ndarray:
    """measured / curve per token count."""
    return series.seconds / curve_times(series, hardware, eff)


def jumps(series: GemmSeries, hardware: Hardware, eff: Efficiency, threshold: float = 0.15) -> list[int]:
    """Token counts whose time moved from the previous count's by more than ``threshold``
    beyond what the curve moved (a kernel switch, not a tile or a wave)."""
    r = ratios(series, hardware, eff)
    step = np.abs(np.diff(np.log(r)))
    return [int(series.tokens[i + 1]) for i in np.nonzero(step > math.log1p(threshold))[0]]


def shape_distance(a: tuple[int, int], b: tuple[int, int]) -> float:
    return math.hypot(math.log(a[0] / b[0]), math.log(a[1] / b[1]))


def reference(series: GemmSeries, train: list[GemmSeries], mode: str) -> GemmSeries | None:
    """The training series whose ratios price ``series``: the same (N, K) (``exact``) or the
    nearest in (log N, log K) (``nearest``); None when ``exact`` finds none."""
    if mode not in ("exact", "nearest"):
        raise ValueError(f"unknown transfer mode {mode!r}; known: {', '.join(MODES)}")
    if not train:
        return None
    best = min(train, key=lambda t: shape_distance(series.shape, t.shape))
    if mode == "exact" and best.shape != series.shape:
        return None
    return best


def _ratio_at(ref: GemmSeries, ref_ratio: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """The reference's ratio at each token count; a count it did not measure takes the ratio of
    the next measured count above (the kernel of a padded row count), the last beyond its range."""
    idx = np.minimum(np.searchsorted(ref.tokens, tokens), len(ref.tokens) - 1)
    return ref_ratio[idx]


def transfer_times(
    series: GemmSeries, train: list[GemmSeries], hardware: Hardware, eff: Efficiency, mode: str
) -> np.ndarray:
    """The curve times a training series' measured / curve ratio at the same token count."""
    base = curve_times(series, hardware, eff)
    if not train:
        return base
    if mode == "by-tokens":
        grid = np.unique(np.concatenate([t.tokens for t in train]))
        table = np.full((len(train), len(grid)), np.nan)
        for i, t in enumerate(train):
            table[i, np.searchsorted(grid, t.tokens)] = ratios(t, hardware, eff)
        median = np.nanmedian(table, axis=0)
        idx = np.minimum(np.searchsorted(grid, series.tokens), len(grid) - 1)
        return base * median[idx]
    ref = reference(series, train, mode)
    if ref is None:
        return base
    return base * _ratio_at(ref, ratios(ref, hardware, eff), series.tokens)


def layer_times(
    layer: list[GemmSeries],
    hardware: Hardware,
    eff: Efficiency,
    train: list[GemmSeries] | None,
    mode: str,
    price: Callable[[GemmSeries], np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(predicted, measured) seconds of one (model, TP)'s four GEMMs summed per token count
    (the counts all four series share); ``train`` None prices the curve alone; ``price``, if
    given, prices each GEMM instead (another form, e.g. ``tile_choice.tile_choice_times``)."""
    common = set(layer[0].tokens.tolist())
    for s in layer[1:]:
        common &= set(s.tokens.tolist())
    tokens = np.array(sorted(common))
    pred = np.zeros(len(tokens))
    meas = np.zeros(len(tokens))
    for s in layer:
        keep = np.isin(s.tokens, tokens)
        if price is not None:
            t = price(s)
        elif train is None:
            t = curve_times(s, hardware, eff)
        else:
            t = transfer_times(s, train, hardware, eff, mode)
        pred += t[keep]
        meas += s.seconds[keep]
    return pred, meas


def by_layer(series: list[GemmSeries]) -> dict[tuple[str, int], list[GemmSeries]]:
    """Series grouped per (model, TP), in OPS order."""
    out: dict[tuple[str, int], list[GemmSeries]] = defaultdict(list)
    for s in series:
        out[(s.model, s.tp)].append(s)
    return {k: sorted(v, key=lambda s: OPS.index(s.op)) for k, v in out.items()}


def same_shape_pairs(series: list[GemmSeries]) -> list[tuple[GemmSeries, GemmSeries]]:
    """Pairs of series of different models with the same (N, K) (the same GEMM measured twice)."""
    groups: dict[tuple[int, int], list[GemmSeries]] = defaultdict(list)
    for s in series:
        groups[s.shape].append(s)
    pairs = []
    for group in groups.values():
        for i, a in enumerate(group):
            pairs += [(a, b) for b in group[i + 1 :] if b.model != a.model]
    return pairs


def pair_agreement(a: GemmSeries, b: GemmSeries) -> np.ndarray:
    """|time_b / time_a - 1| at the token counts both measured."""
    _, ia, ib = np.intersect1d(a.tokens, b.tokens, return_indices=True)
    return np.abs(b.seconds[ib] / a.seconds[ia] - 1.0)
