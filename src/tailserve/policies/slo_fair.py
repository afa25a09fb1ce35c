"""The ``slo`` policy's rule 9 preemption: room in the KV cache for the tenant furthest under its
share (tailserve's rule, beside VTC's ordering; ranks from ``tenant_share.RecentService``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from tailserve.policies.slo import SloPolicy


def make_room_for_fair_share(policy: SloPolicy, sched: Scheduler, now: float, out: SchedulerOutput) -> None:
    """When the first waiting request (in service order) of the tenant with the least recent
    service does not fit the free KV blocks, running requests of tenants with more recent
    service are preempted — the most served tenant first, its least SLO loss first — until it
    fits. Only when their blocks would make room; a tenant never preempts itself or one served
    less recently. (VTC's cumulative counters cannot decide this: a tenant that just became
    active is lifted to a backlogged one's counter and ties with it.)"""
    backlog = policy.backlog
    assert backlog is not None
    ordered, _ = policy.order_waiting(sched, now)
    if not ordered or policy._tier(ordered[0]):
        return
    head = ordered[0]  # protected tenants come first in the order
    rank = backlog.rank
    kv = sched.kv_cache
    needed = kv.num_blocks_needed(head.request_id, head.num_tokens)
    if needed <= kv.num_free_blocks:
        return
    victims = [r for r in sched.running if policy._tier(r)]
    if kv.num_free_blocks + sum(kv.num_held(r.request_id) for r in victims) < needed:
        return
    positions = {id(r): i for i, r in enumerate(sched.running)}
    victims.sort(key=lambda r: (-rank(r.tenant_id), policy.slo_loss(r, now, positions[id(r)])))
    for victim in victims:
        if kv.num_free_blocks >= needed:
            break
        sched.preempt_by_recompute(victim)
        sched.waiting.add_request(victim)
        policy._enter(sched, victim)
        out.preempted.append(victim)
