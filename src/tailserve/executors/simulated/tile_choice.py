"""The GEMM library's tile choice as a cost-model form: each GEMM at the fastest of several
output-tile shapes.

A GEMM library holds kernels of several output-tile shapes and picks one per (M, N, K): a big
tile reaches a higher fraction of peak but pads more rows and leaves more of the last wave
idle. The per-GEMM wave form (``gemm.py``) prices one fixed tile, so it steps wherever that
tile pads a new row block; real kernels switch to a smaller tile there. This form prices each
GEMM as the fastest of ``tiles`` (waves over the SMs as in the wave form), each at its own
fraction (``scales``) of the curve's compute efficiency, fitted to measured profiles
(``fit_tile_choice``). A candidate, not a default: docs/fidelity.md has its held-out errors;
``TileChoiceCostModel`` prices whole iterations with it (``python -m benchmarks.fidelity_profiles --parts published
--variant tiles``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np

from tailserve.executors.simulated.cost_model import CostModel, Efficiency
from tailserve.executors.simulated.gemm import join, join_array, padded_tokens, wave_flops
from tailserve.executors.simulated.gemm_regimes import OPS, GemmSeries, gemm_parts
from tailserve.executors.simulated.hardware import TILE_CHOICE_TILES, Hardware
from tailserve.executors.simulated.models import ModelSpec

TILE_CHOICES = TILE_CHOICE_TILES  # the candidate's tiles (hardware.py holds its fitted factors)
TILE_SCALE_GRID = (0.6, 0.7, 0.8, 0.9, 1.0)


@dataclass(frozen=True)
class TileChoice:
    """The fitted tile-choice form: the curve (``eff``: efficiencies, sharpness, wave cost,
    launch latency) and one compute-efficiency factor per tile shape."""

    eff: Efficiency
    tiles: tuple[tuple[int, int], ...]
    scales: tuple[float, ...]


def tile_choice_times(series: GemmSeries, hardware: Hardware, form: TileChoice) -> np.ndarray:
    """Each token count at the fastest tile shape, plus the launch latency."""
    eff = form.eff
    parts = [gemm_parts(series, hardware, tm, tn, eff.wave_alpha) for tm, tn in form.tiles]
    return _fastest(parts, eff, form.scales) + eff.gemm_latency


def _fastest(
    parts: list[tuple[np.ndarray, np.ndarray]], eff: Efficiency, scales: tuple[float, ...]
) -> np.ndarray:
    """Per token count, the fastest tile's joined time (no launch latency); ``parts``: each
    tile's ``gemm_parts``, in the order of ``scales``."""
    return np.min(
        [
            join_array(c / (eff.compute * sc), m / eff.memory, eff.sharpness)
            for (c, m), sc in zip(parts, scales)
        ],
        axis=0,
    )


def fit_tile_choice(
    layers: list[list[GemmSeries]],
    hardware: Hardware,
    eff: Efficiency,
    tiles: tuple[tuple[int, int], ...] = TILE_CHOICES,
    grid: tuple[float, ...] = TILE_SCALE_GRID,
) -> TileChoice:
    """Per-tile factors (the best tile at 1) and the launch latency (x0.5, x1, x1.5 of the
    curve's) with the smallest mean |error| over the training layers (four GEMMs summed)."""
    if not layers:
        raise ValueError("no training layers to fit the tile choice on")
    parts = [
        [[gemm_parts(s, hardware, tm, tn, eff.wave_alpha) for tm, tn in tiles] for s in lay] for lay in layers
    ]
    measured = [sum(s.seconds for s in lay) for lay in layers]
    best: tuple[float, TileChoice] | None = None
    for scales in itertools.product(grid, repeat=len(tiles)):
        if max(scales) < 1.0:
            continue  # the factors are relative: one tile runs at the curve's own efficiency
        # The fastest tile of a GEMM does not depend on the latency (the same for every tile).
        bodies = [sum(_fastest(g, eff, scales) for g in lay) for lay in parts]
        for factor in (0.5, 1.0, 1.5):
            lat = len(OPS) * eff.gemm_latency * factor
            score = float(
                np.mean(np.concatenate([np.abs((b + lat) / y - 1.0) for b, y in zip(bodies, measured)]))
            )
            if best is None or score < best[0]:
                best = (
                    score,
                    TileChoice(replace(eff, gemm_latency=eff.gemm_latency * factor), tiles, scales),
                )
    assert best is not None
    return best[1]


class TileChoiceCostModel(CostModel):
    """``CostModel`` in the wave form (``efficiency.tile_n > 0``) with each GEMM, the LM head
    included, at the fastest of ``tiles``. The default cost model is untouched."""

    def __init__(
        self,
        model: ModelSpec,
        hardware: Hardware,
        tp: int,
        efficiency: Efficiency,
        tiles: tuple[tuple[int, int], ...],
        scales: tuple[float, ...],
    ) -> None:
        if not efficiency.tile_n:
            raise ValueError("the tile choice builds on the wave form (Efficiency.tile_n > 0)")
        if len(tiles) != len(scales) or not tiles or min(scales) <= 0:
            raise ValueError("one compute-efficiency factor > 0 per tile shape")
        super().__init__(model, hardware, tp, efficiency)
        self.tiles = tuple(tiles)
        self.scales = tuple(scales)

    def with_efficiency(self, efficiency: Efficiency) -> TileChoiceCostModel:
        return TileChoiceCostModel(self.model, self.hardware, self.tp, efficiency, self.tiles, self.scales)

    def _gemm(self, rows: int, n: float, k: float, extra_bytes: float) -> float:
        eff, hw = self.efficiency, self.hardware
        moved = (n * k + rows * (k + n)) * self.model.dtype_bytes + extra_bytes
        best = math.inf
        for (tm, tn), scale in zip(self.tiles, self.scales):
            flops = float(wave_flops(padded_tokens(rows, tm), n, k, tm, tn, hw.sms, eff.wave_alpha))
            best = min(best, join(flops / (self._flops_rate * scale), moved / self._byte_rate, eff.sharpness))
        return best + eff.gemm_latency
