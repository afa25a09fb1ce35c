"""The ``slo`` policy's rule 9 (tailserve's, beside VTC's ordering; ranks from
``tenant_share.RecentService``): which tenants are protected or over their share each iteration
(``FairShare.decide``), and room in the KV cache for the tenant furthest under its share
(``FairShare.make_room``). Handed the shared state (``slo_state.SloState``) and the admission
order (``slo_admit.Admission``)."""

from __future__ import annotations

from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import SchedulerOutput
from tailserve.policies.fairness import TenantBacklog
from tailserve.policies.slo_admit import Admission
from tailserve.policies.slo_state import SloState
from tailserve.policies.vtc import tenant_of


class FairShare:
    """Rule 9 over ``state`` (which must have a backlog: fairness=vtc)."""

    def __init__(self, state: SloState, admission: Admission) -> None:
        self.state = state
        self.admission = admission

    @property
    def backlog(self) -> TenantBacklog:
        backlog = self.state.backlog
        assert backlog is not None
        return backlog

    def decide(self, sched: Scheduler) -> None:
        """Rule 9: which active tenants are protected (under half their share, or held until
        ``protect_until`` of it) this iteration, and (rule 10) which are over their share; into
        ``state.protected`` and ``state.over``."""
        state = self.state
        backlog = self.backlog
        active = {tenant_of(r.tenant_id) for r in sched.running}
        active.update(t for t, n in backlog.num_waiting.items() if n > 0)
        state.protected, state.over = backlog.recent.shares(
            active, backlog.vtc.weight, state.protected, state.config.protect_until
        )

    def make_room(self, sched: Scheduler, now: float, out: SchedulerOutput) -> None:
        """When the first waiting request (in service order) of the tenant with the least recent
        service does not fit the free KV blocks, running requests of tenants with more recent
        service are preempted — the most served tenant first, its least SLO loss first — until it
        fits. Only when their blocks would make room; a tenant never preempts itself or one served
        less recently. (VTC's cumulative counters cannot decide this: a tenant that just became
        active is lifted to a backlogged one's counter and ties with it.)"""
        state = self.state
        rank = self.backlog.rank
        ordered, _ = self.admission.order_waiting(sched, now)
        if not ordered or state.tier(ordered[0]):
            return
        head = ordered[0]  # protected tenants come first in the order
        kv = sched.kv_cache
        needed = kv.num_blocks_needed(head.request_id, head.num_tokens)
        if needed <= kv.num_free_blocks:
            return
        victims = [r for r in sched.running if state.tier(r)]
        if kv.num_free_blocks + sum(kv.num_held(r.request_id) for r in victims) < needed:
            return
        positions = {id(r): i for i, r in enumerate(sched.running)}
        victims.sort(key=lambda r: (-rank(r.tenant_id), state.slo_loss(r, now, positions[id(r)])))
        for victim in victims:
            if kv.num_free_blocks >= needed:
                break
            sched.preempt_by_recompute(victim)
            sched.waiting.add_request(victim)
            state.enter(sched, victim)
            out.preempted.append(victim)
