"""The token exchange of an MoE layer when attention runs data-parallel (``--dp``: vLLM's
``--data-parallel-size`` for an MoE model, SGLang's ``--enable-dp-attention``).

Each DP rank holds its own requests' tokens; the routed experts live on the EP group of
``dp x tp`` ranks, so every MoE layer sends each token to its experts and the results back.
vLLM's ``--all2all-backend`` picks how (vllm/config/parallel.py):

- ``allgather_reducescatter``, the default: every rank all-gathers the DP group's hidden states
  (each rank's batch padded to the largest, as vLLM's DP padding does under CUDA graphs:
  vllm/v1/worker/dp_utils.py), runs its experts on all of them and reduce-scatters the results:
  two NCCL collectives over a buffer of ``dp x tokens x hidden`` bf16 elements, each moving
  ``(n - 1) / n`` of it through every rank.
- ``deepep_high_throughput`` (DeepEP's normal kernels): dispatch sends each token once to every
  other rank holding one of its ``k`` experts; combine sends it back; bf16 both ways.
- ``deepep_low_latency``: one copy per (token, expert) on another rank, dispatched in FP8 with
  a 4-byte scale per 128 values and combined in bf16 (DeepEP's README; AISimulate's wire dtypes,
  aisimulate_core/sdk/operations/moe_comm.py).
- ``deepep_auto``: SGLang's ``--moe-a2a-backend deepep --deepep-mode auto`` (its default):
  low-latency kernels for a step of decodes only, normal ones when any rank of the group extends
  a prompt (``DeepEPMode.resolve`` on the group's ``is_extend_in_batch``); the cost model picks
  per step (``CostModel.exchange_time`` and ``_prefill_exchange``).

Routing is uniform, as in ``moe.py``, unless ``expert_load.py`` says otherwise: DeepEP's phases
then move the busiest rank's share. Each phase costs ``max(floor, latency + tokens x
per_token + bytes / (link x efficiency))`` (``tokens``: the rank's, DeepEP's phases only) with
the GPU's fit (``hardware.MoeExchange``, fitted to AISimulate's measured tables by
benchmarks/fidelity_aisim.py); a GPU without one prices every phase at its all-reduce latency
and link efficiency (the ``fallback`` the cost model hands in).
"""

from __future__ import annotations

import math

from tailserve.executors.simulated.hardware import Hardware, LinkFit

BACKENDS = ("allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency", "deepep_auto")
AUTO = "deepep_auto"
FP8_WITH_SCALES = 1.0 + 4.0 / 128  # bytes per value: FP8 plus a float32 scale per 128 values


def resolve_backend(name: str) -> str:
    key = name.strip().lower().replace("-", "_")
    if key not in BACKENDS:
        raise ValueError(f"--all2all-backend {name!r}: expected one of {', '.join(BACKENDS)}")
    return key


def remote_ranks(k: int, num_experts: int, ep: int) -> float:
    """Other EP ranks a token's ``k`` experts live on: each of the ``ep - 1`` others holds one
    of them unless all ``k`` fall among the ``E - E/ep`` experts it lacks (hypergeometric)."""
    local = num_experts / ep
    missing = 1.0
    for i in range(k):
        missing *= (num_experts - local - i) / (num_experts - i)
    return (ep - 1) * (1.0 - missing)


def _phase(fit: LinkFit, num_bytes: float, link: float, tokens: float = 0.0) -> float:
    return max(fit.floor, fit.latency + tokens * fit.per_token + num_bytes / (link * fit.efficiency))


def _by_group(fits: tuple[tuple[int, LinkFit], ...], n: int) -> tuple[LinkFit, ...]:
    """The fits of the largest measured group not above ``n`` (the smallest when all are): one
    per NCCL protocol fitted (empty: none)."""
    if not fits:
        return ()
    groups = {g for g, _ in fits}
    below = [g for g in groups if g <= n]
    group = max(below) if below else min(groups)
    return tuple(f for g, f in fits if g == group)


def _collective(fits: tuple[LinkFit, ...], fallback: LinkFit, num_bytes: float, link: float) -> float:
    """An NCCL collective at the faster of its fitted protocols (NCCL's tuner picks the protocol
    it predicts fastest for the size: LL's low latency for small buffers, Simple's bandwidth for
    large ones)."""
    return min(_phase(f, num_bytes, link) for f in fits) if fits else _phase(fallback, num_bytes, link)


def exchange_time(
    backend: str,
    hardware: Hardware,
    fallback: LinkFit,
    *,
    tokens: int,
    dp: int,
    tp: int,
    hidden: int,
    k: int,
    num_experts: int,
    act_bytes: float,
    receive_factor: float = 1.0,
) -> float:
    """Seconds one MoE layer's exchange takes, both directions, when every one of ``dp`` ranks
    holds ``tokens`` tokens (the group's largest batch: the others are padded to it).
    ``receive_factor``: with uneven routing, how much more than the mean the busiest rank
    receives (``expert_load.py``); DeepEP's phases wait for it (an all-gather moves every
    rank's tokens to every rank, whatever the routing)."""
    if tokens <= 0 or dp <= 1:
        return 0.0
    link = hardware.interconnect_bandwidth
    fits = hardware.moe_exchange
    if backend == "allgather_reducescatter":
        # A buffer of every DP rank's tokens; each rank moves (n-1)/n of it in a ring.
        moved = (dp - 1) / dp * dp * tokens * hidden * act_bytes
        gather = _by_group(fits.all_gather, dp) if fits else ()
        scatter = _by_group(fits.reduce_scatter, dp) if fits else ()
        return _collective(gather, fallback, moved, link) + _collective(scatter, fallback, moved, link)
    ep = dp * tp
    per_rank = math.ceil(tokens / tp)  # the TP ranks of a DP rank split its tokens (sequence parallel)
    if backend == "deepep_high_throughput":
        moved = per_rank * remote_ranks(k, num_experts, ep) * hidden * act_bytes * receive_factor
        dispatch = fits.ht_dispatch if fits else fallback
        combine = fits.ht_combine if fits else fallback
        return _phase(dispatch, moved, link, per_rank) + _phase(combine, moved, link, per_rank)
    copies = per_rank * k * (ep - 1) / ep * receive_factor  # one per (token, expert) on another rank
    dispatch = fits.ll_dispatch if fits else fallback
    combine = fits.ll_combine if fits else fallback
    return _phase(dispatch, copies * hidden * FP8_WITH_SCALES, link, per_rank) + _phase(
        combine, copies * hidden * act_bytes, link, per_rank
    )
