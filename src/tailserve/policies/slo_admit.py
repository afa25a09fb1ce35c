"""Rules 3-6 of the ``slo`` policy (``slo.py``): the waiting requests' service order (least
TTFT slack, feasibility, best-effort, aging, rejection, the tenant order of rules 8-9) and their
admission under the iteration's token, time and KV limits."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tailserve.policies.slo_config import SloConfig
from tailserve.policies.slo_predictor import BatchLoad
from tailserve.policies.vtc import tenant_of

if TYPE_CHECKING:
    from tailserve.policies.slo import SloPolicy


def order_waiting(policy: SloPolicy, sched: Scheduler, now: float) -> tuple[list[Request], list[Request]]:
    """(requests in service order, never-admitted infeasible ones); rules 3-5."""
    cfg: SloConfig = policy.config
    info = policy._info
    by_slack = sorted(sched.waiting, key=lambda r: info[r.request_id].deadline - info[r.request_id].prefill_s)
    feasible: list[Request] = []
    late: list[Request] = []
    # Predicted prefill time of the feasible requests ahead: [protected tenants', everyone's].
    # A protected tenant's requests are served before the others' (rule 9), so only the
    # protected ones ahead are its queue; without fairness _tier is 1 for all.
    queued = [0.0, 0.0]
    stretch = policy._stretch
    for r in by_slack:
        w = info[r.request_id]
        need = w.prefill_s * stretch
        tier = policy._tier(r)
        if w.deadline - now - queued[tier] - need >= 0:
            feasible.append(r)
            queued[1] += need
            if tier == 0:
                queued[0] += need
        else:
            late.append(r)
    late.sort(key=lambda r: r.arrival_time)
    aged = [r for r in late if now - (r.enqueue_time or r.arrival_time) >= cfg.aging_s]
    rest = [r for r in late if now - (r.enqueue_time or r.arrival_time) < cfg.aging_s]
    if cfg.slo_admission == "reject":
        rejected = [r for r in rest if r.first_scheduled_time is None]
        rest = [r for r in rest if r.first_scheduled_time is not None]
    else:
        rejected = []
    if policy.backlog is not None and policy._protected and cfg.protected_order == "arrival":
        feasible = _protected_by_arrival(policy, feasible)
    policy._aged = frozenset(r.request_id for r in aged)
    # Rule 5: aged requests first while they are within their share of the prefill work.
    ordered = aged + feasible + rest if policy.aged_go_first() else feasible + aged + rest
    if policy.backlog is not None:
        ordered = policy.backlog.order(ordered)
        ordered.sort(key=policy._tier)  # stable: protected tenants first, VTC order within
    return ordered, rejected


def _protected_by_arrival(policy: SloPolicy, requests: list[Request]) -> list[Request]:
    """Rule 9: protected tenants' requests in arrival order, in the places theirs held (the
    others' untouched). Alone, each would have been admitted in the first iteration after it
    arrived; beside an over-share tenant, requests that arrive during its iteration in flight
    meet in the queue, and least slack puts a long prompt that came later ahead of a short one
    that came first (its extra predicted prefill outweighs the few ms between their arrivals)."""
    tier = policy._tier
    mine = iter(sorted((r for r in requests if tier(r) == 0), key=lambda r: r.arrival_time))
    return [next(mine) if tier(r) == 0 else r for r in requests]


def admit(
    policy: SloPolicy,
    sched: Scheduler,
    now: float,
    out: SchedulerOutput,
    load: BatchLoad,
    tokens_left: int,
    slacks: list[tuple[float, float]],
    floor_left: int,
    skip: frozenset[str] = frozenset(),
) -> tuple[int, int]:
    """Rules 3-6; (tokens left, floor left). Tenants in ``skip`` sit this iteration out (rule 10)."""
    cfg: SloConfig = policy.config
    kv = sched.kv_cache
    ordered, rejected = order_waiting(policy, sched, now)
    for r in rejected:
        w = policy._info[r.request_id]
        sched.waiting.remove_request(r)
        policy.on_finished(sched, [r])
        sched.reject(
            r,
            f"SLO class {w.slo.name}: its TTFT target ({w.slo.ttft:g} s) cannot be met; predicted "
            f"prefill {w.prefill_s:.3f} s with {w.deadline - now:.3f} s left behind the queue",
            now,
        )
    out_of_room: set[str | None] = set()  # tenants whose limit left no chunk (rule 9)
    for request in ordered:
        if tokens_left <= 0 or len(sched.running) >= cfg.max_num_seqs:
            break
        if request.tenant_id in out_of_room or (skip and tenant_of(request.tenant_id) in skip):
            continue
        match = sched.cached_prefix(request) if not request.num_computed_tokens else None
        hit = match.num_tokens if match is not None else 0
        computed = request.num_computed_tokens + hit
        wanted = min(request.num_tokens - computed, tokens_left)
        want = policy._chunk(load, computed, wanted, policy._limit(slacks, request), floor_left)
        if want == 0:
            if policy.backlog is None:
                break
            out_of_room.add(request.tenant_id)  # one under its share may still have room
            continue
        if hit:
            if kv.num_blocks_needed_after_hit(match, request.num_tokens) > kv.num_free_blocks:
                break
            sched.allocate_with_cached_prefix(request, match, hit + want)
        else:
            if not kv.can_allocate(request.request_id, request.num_tokens):
                break
            if not sched.allocate(request, computed + want):
                break
        if request.first_scheduled_time is None:
            request.num_cached_tokens = hit
        if request.request_id in policy._aged:
            policy._aging_credit -= request.num_tokens - computed  # its whole prefill follows (rule 2)
        sched.waiting.remove_request(request)
        policy._info.pop(request.request_id, None)
        if policy.backlog is not None:
            policy.backlog.dequeue(request)
        sched.admit(request, now)
        out.num_admitted += 1
        out.scheduled.append(ScheduledRequest(request, want, computed))
        load.add_chunk(want, computed, computed + want == request.num_tokens)
        tokens_left -= want
        floor_left = max(0, floor_left - want)
    return tokens_left, floor_left
