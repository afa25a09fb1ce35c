"""The ``slo`` policy's rule 8 preemption: room in the KV cache for the tenant VTC admits next."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import SchedulerOutput
from tailserve.policies.vtc import tenant_of

if TYPE_CHECKING:
    from tailserve.policies.slo import SloPolicy


def make_room_for_fair_share(policy: SloPolicy, sched: Scheduler, now: float, out: SchedulerOutput) -> None:
    """Rule 8's preemption: when the request VTC admits next does not fit the free KV blocks,
    running requests of tenants served more than its own (a larger counter) are preempted —
    the most-served tenant first, its least SLO loss first — until it fits. Only when their
    blocks would make room; a tenant never preempts itself or one served less."""
    backlog = policy.backlog
    assert backlog is not None
    ordered, _ = policy.order_waiting(sched, now)
    if not ordered:
        return
    head = ordered[0]
    kv = sched.kv_cache
    vtc = backlog.vtc
    own = vtc.counter(tenant_of(head.tenant_id))
    needed = kv.num_blocks_needed(head.request_id, head.num_tokens)
    if needed <= kv.num_free_blocks:
        return
    victims = [r for r in sched.running if vtc.counter(tenant_of(r.tenant_id)) > own]
    if kv.num_free_blocks + sum(kv.num_held(r.request_id) for r in victims) < needed:
        return
    positions = {id(r): i for i, r in enumerate(sched.running)}
    victims.sort(
        key=lambda r: (-vtc.counter(tenant_of(r.tenant_id)), policy.slo_loss(r, now, positions[id(r)]))
    )
    for victim in victims:
        if kv.num_free_blocks >= needed:
            break
        sched.preempt_by_recompute(victim)
        sched.waiting.add_request(victim)
        policy._enter(sched, victim)
        out.preempted.append(victim)
