"""Rules 3-6 of the ``slo`` policy (``slo.py``): the waiting requests' service order (least
TTFT slack, feasibility, best-effort, aging, rejection, the tenant order of rules 8-9) and their
admission under the iteration's token, time and KV limits. ``Admission`` is handed the policy's
shared state (``slo_state.SloState``) and keeps rule 5's aging credit itself."""

from __future__ import annotations

from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tailserve.policies.slo_predictor import BatchLoad
from tailserve.policies.slo_state import SloState
from tailserve.policies.vtc import tenant_of


class Admission:
    """Rules 3-6 over ``state``; owns rule 5's credit (``aging_credit``: prefill tokens aged
    requests may still take ahead of feasible ones) and the requests aged at the last ordering
    (``aged``)."""

    def __init__(self, state: SloState) -> None:
        self.state = state
        self.aging_credit = float(state.config.max_num_batched_tokens)
        self.aged: frozenset[str] = frozenset()

    def aged_go_first(self) -> bool:
        """Rule 5: whether aged requests go ahead of the feasible ones in this ordering."""
        return self.state.config.aging_share >= 1 or self.aging_credit > 0

    def earn_aging_credit(self, chunks: list[ScheduledRequest]) -> None:
        """Rule 5: aged requests earn ``aging_share`` of every prefill token scheduled, up to one
        token budget (so an idle stretch does not bank a burst of late work ahead of on-time
        work); admitting one spends its whole remaining prefill (``admit``)."""
        cfg = self.state.config
        prefill = sum(s.num_new_tokens for s in chunks)
        budget = cfg.max_num_batched_tokens
        self.aging_credit = min(self.aging_credit + cfg.aging_share * prefill, budget)

    def order_waiting(self, sched: Scheduler, now: float) -> tuple[list[Request], list[Request]]:
        """(requests in service order, never-admitted infeasible ones); rules 3-5."""
        state = self.state
        cfg = state.config
        info = state.info
        # Least slack first: a stable sort of the positions by slack is ``sorted(waiting,
        # key=slack)``'s order, each request's info looked up once (this runs every iteration
        # someone waits, over everyone waiting).
        waiting = list(sched.waiting)
        infos = [info[r.request_id] for r in waiting]
        slacks = [w.deadline - w.prefill_s for w in infos]
        feasible: list[Request] = []
        late: list[Request] = []
        # Predicted prefill time of the feasible requests ahead: [protected tenants', everyone's].
        # A protected tenant's requests are served before the others' (rule 9), so only the
        # protected ones ahead are its queue; without fairness the tier is 1 for all (no call).
        queued = [0.0, 0.0]
        stretch = state.stretch
        tier_of = state.tier if state.protected else None
        for i in sorted(range(len(waiting)), key=slacks.__getitem__):
            r = waiting[i]
            w = infos[i]
            need = w.prefill_s * stretch
            tier = tier_of(r) if tier_of is not None else 1
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
        if state.backlog is not None and state.protected and cfg.protected_order == "arrival":
            feasible = self._protected_by_arrival(feasible)
        self.aged = frozenset(r.request_id for r in aged)
        # Rule 5: aged requests first while they are within their share of the prefill work.
        ordered = aged + feasible + rest if self.aged_go_first() else feasible + aged + rest
        if state.backlog is not None:
            ordered = state.backlog.order(ordered)
            ordered.sort(key=state.tier)  # stable: protected tenants first, VTC order within
        return ordered, rejected

    def _protected_by_arrival(self, requests: list[Request]) -> list[Request]:
        """Rule 9: protected tenants' requests in arrival order, in the places theirs held (the
        others' untouched). Alone, each would have been admitted in the first iteration after it
        arrived; beside an over-share tenant, requests that arrive during its iteration in flight
        meet in the queue, and least slack puts a long prompt that came later ahead of a short one
        that came first (its extra predicted prefill outweighs the few ms between their arrivals)."""
        tier = self.state.tier
        mine = iter(sorted((r for r in requests if tier(r) == 0), key=lambda r: r.arrival_time))
        return [next(mine) if tier(r) == 0 else r for r in requests]

    def admit(
        self,
        sched: Scheduler,
        now: float,
        out: SchedulerOutput,
        load: BatchLoad,
        tokens_left: int,
        slacks: list[tuple[float, float]],
        floor_left: int,
        skip: frozenset[str] = frozenset(),
    ) -> tuple[int, int]:
        """Rules 3-6; (tokens left, floor left). Tenants in ``skip`` sit this iteration out
        (rule 10)."""
        state = self.state
        cfg = state.config
        kv = sched.kv_cache
        ordered, rejected = self.order_waiting(sched, now)
        for r in rejected:
            w = state.info[r.request_id]
            sched.waiting.remove_request(r)
            state.forget(r)
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
            want = state.chunk(load, computed, wanted, state.limit(slacks, request), floor_left)
            if want == 0:
                if state.backlog is None:
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
            if request.request_id in self.aged:
                self.aging_credit -= request.num_tokens - computed  # its whole prefill follows (rule 2)
            sched.waiting.remove_request(request)
            state.forget(request)
            sched.admit(request, now)
            out.num_admitted += 1
            out.scheduled.append(ScheduledRequest(request, want, computed))
            load.add_chunk(want, computed, computed + want == request.num_tokens)
            tokens_left -= want
            floor_left = max(0, floor_left - want)
        return tokens_left, floor_left
