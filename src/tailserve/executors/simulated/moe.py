"""One MoE layer's routed experts on one GPU: two grouped GEMMs (gate+up, down) over the experts
the batch's tokens were routed to.

Routing is taken as uniform: ``T`` tokens, each sent to ``k`` of ``E`` experts, touch
``E (1 - (1 - k/E)^T)`` experts on average, each with ``T k / touched`` rows; rows are padded to
the GEMM's row tile, per expert (a batch of 8 decodes over 256 experts runs ~64 experts of one row
each, every one a whole tile: MoE decode is cheap in bytes, not in tiles). Every touched expert's
weights are read once, so a small batch reads few experts and a large one all of them.

Expert parallelism (``ep`` > 1) keeps ``E / ep`` whole experts per GPU; the layer takes as long
as its busiest GPU, which gets more than ``T k / ep`` of the routed rows (a binomial spread: a
small batch is the most uneven; hot experts add to it, ``expert_load.py``). Tensor parallelism inside the experts (``moe_tp``) splits each
expert's intermediate size. The all-to-all that moves the rows is priced elsewhere (with TP
attention there is none: every rank holds every token and the layer ends in the all-reduce).
"""

from __future__ import annotations

import math

from tailserve.executors.simulated.expert_load import ExpertLoad, busiest_rank_rows
from tailserve.executors.simulated.gemm import padded_tokens


def touched_experts(num_tokens: int, num_experts: int, k: int) -> float:
    """Experts a batch of ``num_tokens`` tokens touches, each routed to ``k`` of them (uniform)."""
    if num_tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - k / num_experts) ** num_tokens)


def grouped_gemm_parts(
    num_tokens: int,
    num_experts: int,
    k: int,
    hidden: int,
    inter: int,
    *,
    weight_bytes: float,
    act_bytes: float,
    tile_m: int,
    moe_tp: int = 1,
    ep: int = 1,
    load: ExpertLoad | None = None,
) -> tuple[float, float]:
    """(FLOPs, bytes) of one MoE layer's routed experts on one GPU: the two grouped GEMMs over
    the touched experts' padded rows, and the touched experts' weights plus the routed rows."""
    if num_tokens <= 0:
        return 0.0, 0.0
    if ep > 1:
        # The layer waits for its busiest rank: of the T k routed rows each rank gets a binomial
        # share (mean T k / ep); the largest of ep such shares is about sqrt(2 ln ep) standard
        # deviations above the mean. Each row lands on one of the rank's E / ep experts (with
        # uneven routing, expert_load.py: around each rank's own share).
        n = num_tokens * k
        local = num_experts / ep
        if load is None or (load.is_uniform and not load.eplb):
            mean = n / ep
            spread = math.sqrt(n * (1.0 / ep) * (1.0 - 1.0 / ep))
            routed = min(float(n), mean + spread * math.sqrt(2.0 * math.log(ep)))
        else:
            routed = busiest_rank_rows(n, load, num_experts, ep)
        touched = local * (1.0 - (1.0 - 1.0 / local) ** routed) if local > 1 else 1.0
    else:
        routed = float(num_tokens * k)
        touched = touched_experts(num_tokens, num_experts, k)
    rows = padded_tokens(max(1, math.ceil(routed / touched - 1e-9)), tile_m)
    params = 3.0 * hidden * inter / moe_tp
    flops = 2.0 * touched * rows * params
    weights = touched * params * weight_bytes
    if ep > 1 and load is not None and load.redundant:
        # EPLB's replicas split their experts' rows (the padded row groups stay about as many)
        # but are weights of their own to read: (E + R) / E of them
        weights *= (num_experts + load.redundant) / num_experts
    moved = weights + routed * act_bytes * (2.0 * hidden + 3.0 * inter / moe_tp)
    return flops, moved
