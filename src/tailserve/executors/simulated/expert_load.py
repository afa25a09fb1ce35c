"""Uneven expert routing under expert parallelism, and what EPLB's redundant experts do to it.

Real routers do not spread tokens evenly: some experts are hot, the hot ones stay hot for
hundreds of steps, and which ones are hot differs by layer and by dataset (TensorRT-LLM's
tech blog 4, DeepSeek-R1 on 32 GB200). Under expert parallelism a MoE layer waits for its
busiest rank, so what matters is how much more than the mean that rank receives. The engines
report it: TensorRT-LLM's ``report_load_statistics.py`` prints the per-rank *imbalance ratio*
``(max - mean) / mean`` (1.564 averaged over DeepSeek-R1's layers at EP 32 on a translation
dataset), vLLM's EPLB logs *balancedness* ``mean / max`` (imbalance ``1 / b - 1``).

``ExpertLoad`` turns one such number into per-layer expert popularities: log-normal weights
(the experts at evenly spaced normal quantiles, ``exp(sigma z)``), placed on the ranks in a
seeded random order per layer as a checkpoint's expert ids fall (contiguous blocks of
``E / ep``), with ``sigma`` chosen so that the mean over layers of the steady-state imbalance at
the deployment's EP size is the number given. EPLB (vLLM's ``--enable-eplb``, SGLang's
``--enable-eplb``, TensorRT-LLM's ``moe_config.load_balancer``) then knows those popularities
(they are stable: the balancer's window sees them) and places ``E + R`` physical experts: the
``R`` redundant slots go one by one to the expert with the most load per replica, and the
replicas, heaviest first, each to the least loaded rank with a free slot (DeepSeek's EPLB,
``replicate`` and ``balanced_packing`` of its global policy); a replicated expert's tokens split
evenly over its replicas.

A step of ``n`` routed rows then gives each rank a binomial share around its popularity; the
layer's busiest rank is taken as the largest of ``mean_r + sqrt(2 ln ep) sd_r`` (with every
popularity equal: the uniform spread ``moe.py`` always priced), averaged over the layers.
Within a rank the rows are taken as spread evenly over its experts (``moe.py``'s touched
experts), and tensor-parallel experts (no EP) see no imbalance: every rank runs every expert's
slice.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import numpy as np
from scipy.special import ndtri

LAYERS = 32  # sampled layer placements the imbalance is averaged over
SEED = 20250704  # the placements' seed: one deployment, one set of layers
# How far EPLB's picture of each expert's load is from the steps it then serves (the log-normal
# spread of the error): fitted to TensorRT-LLM's offline EPLB on DeepSeek-R1, EP 32 with 288
# slots, imbalance 0.109 (blog 4, Table 1); its EP 36 row and both standard deviations are the
# check (benchmarks/expert_imbalance.py)
EPLB_ESTIMATE_ERROR = 0.093


@dataclass(frozen=True, slots=True)
class ExpertLoad:
    """How routing concentrates on experts: ``imbalance`` the per-rank imbalance ratio
    ``(max - mean) / mean`` the deployment's EP size shows without EPLB (0: uniform routing);
    ``redundant`` the EPLB redundant experts (None: no EPLB; 0: EPLB rearranges only)."""

    imbalance: float = 0.0
    redundant: int | None = None
    # the EP size ``imbalance`` was measured at (0: the one it prices): a capacity plan reads one
    # routing at every layout's EP size
    measured_ep: int = 0

    def __post_init__(self) -> None:
        if not math.isfinite(self.imbalance) or self.imbalance < 0:
            raise ValueError(
                f"--expert-imbalance must be a finite ratio >= 0 ((max - mean) / mean of the tokens "
                f"per EP rank), got {self.imbalance}"
            )
        if self.redundant is not None and self.redundant < 0:
            raise ValueError(f"--num-redundant-experts must be >= 0, got {self.redundant}")

    @property
    def is_uniform(self) -> bool:
        return self.imbalance == 0.0

    @property
    def eplb(self) -> bool:
        return self.redundant is not None

    def describe(self) -> str:
        parts = [f"expert imbalance {self.imbalance:g}"] if self.imbalance else ["uniform routing"]
        if self.imbalance and self.measured_ep:
            parts[0] += f" (measured at EP {self.measured_ep})"
        if self.eplb:
            parts.append(f"EPLB with {self.redundant} redundant experts")
        return ", ".join(parts)


def lognormal_weights(num_experts: int, sigma: float) -> np.ndarray:
    """The experts' popularities, heaviest last: ``exp(sigma z)`` at evenly spaced quantiles."""
    z = ndtri((np.arange(num_experts) + 0.5) / num_experts)
    return np.exp(sigma * z)


def _placements(num_experts: int, layers: int = LAYERS) -> np.ndarray:
    """Each layer's order of expert ids (a seeded permutation): which popularity lands where."""
    rng = np.random.default_rng(SEED)
    return np.stack([rng.permutation(num_experts) for _ in range(layers)])


def rank_shares(weights: np.ndarray, ep: int, order: np.ndarray) -> np.ndarray:
    """Each rank's share of the routed rows when the experts sit in ``order`` in contiguous
    blocks of ``E / ep`` (the default placement)."""
    w = weights[order]
    return w.reshape(ep, -1).sum(axis=1) / w.sum()


def eplb_shares(
    weights: np.ndarray, ep: int, redundant: int, believed: np.ndarray | None = None
) -> np.ndarray:
    """Each rank's share after EPLB places the experts by the popularities it ``believed``
    (default: the true ``weights``): ``redundant`` replicas to the most loaded expert per replica
    in turn, then the replicas, heaviest first, each to the least loaded rank with a free slot; a
    replicated expert's true load splits evenly over its replicas."""
    num_experts = weights.size
    slots = num_experts + redundant
    if slots % ep:
        raise ValueError(
            f"EPLB: {num_experts} experts + {redundant} redundant = {slots} slots do not split over "
            f"{ep} EP ranks (the engines require a multiple)"
        )
    seen = weights if believed is None else believed
    replicas = np.ones(num_experts, dtype=np.int64)
    for _ in range(redundant):
        replicas[np.argmax(seen / replicas)] += 1
    experts = np.repeat(np.arange(num_experts), replicas)
    order = np.argsort(-(seen / replicas)[experts], kind="stable")
    per_rank = slots // ep
    believed_load = np.zeros(ep)
    true_load = np.zeros(ep)
    free = np.full(ep, per_rank)
    for e in experts[order]:
        open_ranks = np.flatnonzero(free)
        r = open_ranks[np.argmin(believed_load[open_ranks])]
        believed_load[r] += seen[e] / replicas[e]
        true_load[r] += weights[e] / replicas[e]
        free[r] -= 1
    return true_load / true_load.sum()


@functools.lru_cache(maxsize=64)
def _sigma_for(imbalance: float, num_experts: int, ep: int) -> float:
    """The log-normal spread whose mean steady-state rank imbalance over the layers is
    ``imbalance`` at ``ep`` ranks (bisection: the imbalance grows with sigma)."""
    orders = _placements(num_experts)

    def mean_imbalance(sigma: float) -> float:
        w = lognormal_weights(num_experts, sigma)
        return float(np.mean([ep * rank_shares(w, ep, o).max() - 1.0 for o in orders]))

    hi = 1.0
    while mean_imbalance(hi) < imbalance:
        hi *= 2.0
        if hi > 64:  # every row on one rank is imbalance ep - 1: nothing above it
            raise ValueError(
                f"--expert-imbalance {imbalance:g} is beyond what {ep} EP ranks can show (at most "
                f"{ep - 1}: every token on one rank)"
            )
    lo = 0.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if mean_imbalance(mid) < imbalance:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@functools.lru_cache(maxsize=64)
def layer_shares(load: ExpertLoad, num_experts: int, ep: int) -> np.ndarray:
    """Each sampled layer's rank shares, ``(LAYERS, ep)``: uniform, skewed by ``load``'s
    imbalance, and rebalanced by EPLB when it is on."""
    if ep <= 1:
        return np.ones((1, 1))
    if load.is_uniform and not load.redundant:
        return np.full((1, ep), 1.0 / ep)
    sigma = _sigma_for(load.imbalance, num_experts, load.measured_ep or ep) if not load.is_uniform else 0.0
    w = lognormal_weights(num_experts, sigma)
    if load.eplb:
        return eplb_layers(w, ep, load.redundant or 0)
    return default_layers(w, ep)


def default_layers(weights: np.ndarray, ep: int) -> np.ndarray:
    """Each sampled layer's rank shares under the default placement, ``(LAYERS, ep)``."""
    return np.stack([rank_shares(weights, ep, o) for o in _placements(weights.size)])


def eplb_layers(
    weights: np.ndarray, ep: int, redundant: int, error: float | None = None, layers: int = LAYERS
) -> np.ndarray:
    """Each sampled layer's rank shares after EPLB, ``(layers, ep)``. EPLB places by what its
    window measured, which is not quite what the next steps route: each layer's picture off by
    ``error`` (log-normal, per expert; default ``EPLB_ESTIMATE_ERROR``)."""
    spread = EPLB_ESTIMATE_ERROR if error is None else error
    rng = np.random.default_rng(SEED + 1)
    return np.stack(
        [
            eplb_shares(weights, ep, redundant, weights * np.exp(spread * rng.standard_normal(weights.size)))
            for _ in range(layers)
        ]
    )


def busiest_rank_rows(rows: float, load: ExpertLoad, num_experts: int, ep: int) -> float:
    """The routed rows the busiest of ``ep`` ranks gets when a layer routes ``rows`` of them,
    averaged over the layers: each rank's binomial share around its popularity, the largest of
    ``mean + sqrt(2 ln ep) sd`` (with uniform routing exactly ``moe.py``'s spread)."""
    if ep <= 1:
        return float(rows)
    shares = layer_shares(load, num_experts, ep)
    z = math.sqrt(2.0 * math.log(ep))
    top = rows * shares + z * np.sqrt(rows * shares * (1.0 - shares))
    return float(min(rows, np.mean(top.max(axis=1))))


def steady_imbalance(load: ExpertLoad, num_experts: int, ep: int) -> float:
    """The per-rank imbalance ratio without step noise (a large batch), averaged over layers:
    what the engines' statistics converge to."""
    shares = layer_shares(load, num_experts, ep)
    return float(np.mean(ep * shares.max(axis=1) - 1.0))


def load_statistics(
    shares: np.ndarray, rows_per_bin: int, steps: int = 20, seed: int = 0
) -> tuple[float, float]:
    """The statistic TensorRT-LLM's ``report_load_statistics.py`` prints, simulated: per layer
    (a row of ``shares``: ranks', or experts' popularities) and step, the routed rows drawn
    (multinomial, ``rows_per_bin`` per rank or expert on average), then ``(max - mean) / mean``
    and the standard deviation, averaged over layers and steps. Returns (imbalance, std / mean)."""
    rng = np.random.default_rng(seed)
    total = rows_per_bin * shares.shape[1]
    ratios, stds = [], []
    for layer in shares:
        for _ in range(steps):
            counts = rng.multinomial(total, layer / layer.sum())
            ratios.append(counts.max() / counts.mean() - 1.0)
            stds.append(counts.std() / counts.mean())
    return float(np.mean(ratios)), float(np.mean(stds))


def busiest_shares(load: ExpertLoad, num_experts: int, ep: int) -> tuple[float, float]:
    """The busiest rank's share over the mean at a large batch: as priced (after EPLB, when on)
    and without EPLB."""
    return (
        1 + steady_imbalance(load, num_experts, ep),
        1 + steady_imbalance(replace(load, redundant=None), num_experts, ep),
    )


def measured_imbalance(
    load: ExpertLoad, num_experts: int, ep: int, rows_per_rank: int, steps: int = 20, seed: int = 0
) -> tuple[float, float]:
    """``load_statistics`` per rank for ``load`` at ``ep`` ranks."""
    return load_statistics(layer_shares(load, num_experts, ep), rows_per_rank, steps, seed)
