"""The TP all-reduce priced per kernel regime: one ``latency + 2(TP-1)/TP x bytes / (link x eff)``
line per kernel vLLM picks for (GPU, TP, bytes) (``allreduce_regimes.py``: the boundaries are
vLLM's, not fitted), each fitted on the training message sizes that fall in it.

A regime with two or more training sizes gets its own latency and efficiency (least squares on
the relative error); one with a single training size its own latency at the GPU's one-line
efficiency; one with none (the largest sizes, where NCCL takes over) the line of the regime below
it, extended."""

from __future__ import annotations

import numpy as np

from tailserve.executors.simulated.allreduce_regimes import GPU_CAPABILITY, vllm_allreduce
from tailserve.executors.simulated.hardware import AllReduceBand

MIN_K = 1e-3  # seconds-at-full-link multiplier floor: efficiency at most 1,000 (a flat regime)


def _line(ring: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(latency, k) minimising sum(((lat + k ring) / y - 1)^2), latency >= 0, k >= MIN_K."""
    a = np.stack([1.0 / y, ring / y], axis=1)
    (lat, k), *_ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
    if lat < 0:  # through the origin
        lat, k = 0.0, float(np.sum(ring / y) / np.sum((ring / y) ** 2))
    if k < MIN_K:  # flat: latency only
        k = MIN_K
        lat = max(0.0, float(np.sum((1 - k * ring / y) / y) / np.sum(1 / y**2)))
    return float(lat), float(k)


def regime_fit(
    gpu: str, version: str, tp: int, n: np.ndarray, y: np.ndarray, ring: np.ndarray, test: np.ndarray,
    line_latency: float, line_eff: float,
) -> dict:  # fmt: skip
    """Fit one TP degree's regimes on ``~test`` and price every size. ``n`` elements (bf16),
    ``ring`` the seconds each size takes at the full link with the ring factor."""
    rules = vllm_allreduce(version)
    cap = GPU_CAPABILITY[gpu]
    regimes = np.array([rules.regime(cap, tp, int(2 * x)) for x in n])
    pred = np.empty_like(y)
    fits: dict = {}
    bands: list[AllReduceBand] = []
    prev = (line_latency, 1.0 / line_eff)
    for name, top in rules.edges(cap, tp):
        sel = regimes == name
        train = sel & ~test
        if train.sum() >= 2:
            lat, k = _line(ring[train], y[train])
            how = "own line"
        elif train.sum() == 1:
            k = 1.0 / line_eff
            lat = float(y[train][0] - k * ring[train][0])
            if lat < 0:
                lat, k = 0.0, float(y[train][0] / ring[train][0])
            how = "own latency, the GPU's efficiency"
        else:  # the line of the kernel below it, extended (the first: the one-line fit)
            lat, k = prev
            how = "no training size: the line below" if fits else "no training size: the one-line fit"
        prev = (lat, k)
        pred[sel] = lat + k * ring[sel]
        fits[name] = {"max_bytes": top, "latency_s": lat, "efficiency": 1.0 / k, "train": int(train.sum()),
                      "test": int((sel & test).sum()), "how": how}  # fmt: skip
        bands.append(AllReduceBand(tp, float(top), lat, 1.0 / k))
    return {"pred": pred, "regimes": fits, "bands": bands}
