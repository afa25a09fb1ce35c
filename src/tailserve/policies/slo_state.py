"""What the ``slo`` policy's parts share: ``SloState``, handed to each part explicitly.

The policy (``slo.py``) is cut into parts with public interfaces — admission and ordering
(``slo_admit.Admission``, rules 3-6), the late-gap experiment (``slo_burst.BurstBudget``), rule 9's
isolation (``slo_fair.FairShare``), rules 10-11 (``slo_yield.YieldRules``), the predictor
(``slo_predictor.Predictor``) and the recent service per tenant (``tenant_share.RecentService``,
inside the ``backlog``). None of them sees the policy: each is handed this state object, whose
fields are public and say which part writes them, and the queries every rule asks of it
(deadlines, tiers, chunk limits, a victim's SLO loss) are its methods.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.policies.fairness import TenantBacklog
from tailserve.policies.slo_classes import SloClasses
from tailserve.policies.slo_config import SloConfig, WaitingInfo
from tailserve.policies.slo_predictor import BatchLoad, Predictor
from tailserve.policies.vtc import tenant_of


@dataclass(slots=True)
class SloState:
    config: SloConfig
    classes: SloClasses
    backlog: TenantBacklog | None  # fairness=vtc's counters and recent service; None without
    predictor: Predictor  # replaced by ``SloPolicy.bind_cost_model``
    # Per waiting request, what ordering needs (``enter`` when it (re-)enters the queue,
    # ``forget`` when it leaves).
    info: dict[str, WaitingInfo] = field(default_factory=dict)
    # Rule 3: iteration time with chunks / the chunks alone, a moving average (the policy
    # updates it after each iteration).
    stretch: float = 1.0
    # Rule 9 (``FairShare.decide``, each iteration under fairness): the protected tenants and
    # (rule 10) those over their share.
    protected: frozenset[str] = frozenset()
    over: frozenset[str] = frozenset()
    # Rule 11 (``YieldRules.quantum_s``, each iteration under fairness): the most seconds an
    # iteration with an over-share tenant's chunk may take.
    quantum: float = math.inf

    # ---- deadlines and tiers ---------------------------------------------------------------
    def deadline(self, request: Request) -> float:
        """When the request's next token is due: ``arrival + ttft`` before the first token,
        ``last token + tbt`` after."""
        slo = self.classes.of(request)
        if request.token_times:
            return request.token_times[-1] + slo.tbt
        return request.arrival_time + slo.ttft

    def tier(self, request: Request) -> int:
        """0 for a request of a protected tenant (rule 9), else 1; 1 without fairness."""
        return 0 if tenant_of(request.tenant_id) in self.protected else 1

    # ---- the waiting requests --------------------------------------------------------------
    def enter(self, sched: Scheduler, request: Request) -> None:
        """``request`` (re-)entered the waiting queue: its class, deadline and predicted prefill
        (prefix-cache hits counted: only the uncached tokens are priced), and VTC's backlog."""
        slo = self.classes.of(request)
        hit = 0
        if not request.num_computed_tokens:
            match = sched.cached_prefix(request)
            hit = match.num_tokens if match is not None else 0
        todo = request.num_tokens - request.num_computed_tokens - hit
        self.info[request.request_id] = WaitingInfo(
            slo, self.deadline(request), self.predictor.prefill_time(todo, request.num_computed_tokens + hit)
        )
        if self.backlog is not None:
            self.backlog.enqueue(request)

    def forget(self, request: Request) -> None:
        """``request`` left the waiting queue (admitted, rejected or finished)."""
        self.info.pop(request.request_id, None)
        if self.backlog is not None:
            self.backlog.dequeue(request)

    # ---- rule 2's budget, rules 9 and 11's limits ------------------------------------------
    def limit(self, slacks: list[tuple[float, float]], request: Request) -> float:
        """Seconds this iteration may take with a chunk of ``request``: the least TBT slack of
        the decodes (``slacks``: (tier, slack) per decode) — for a protected tenant's request, of
        protected tenants' decodes only (rule 9: a tenant using more than its share does not slow
        down one using little); for an over-share tenant's, at most rule 11's quantum."""
        own = self.tier(request)
        limit = min((s for tier, s in slacks if tier <= own), default=math.inf)
        if self.over and tenant_of(request.tenant_id) in self.over:
            limit = min(limit, self.quantum)
        return limit

    def chunk(self, load: BatchLoad, computed: int, wanted: int, limit: float, floor_left: int) -> int:
        """Prefill tokens for one chunk: the most the time limit allows, at least the floor."""
        chunk = self.predictor.max_chunk(load, computed, wanted, limit, samples_last=True)
        return max(chunk, min(wanted, floor_left))

    # ---- rule 7 ----------------------------------------------------------------------------
    def slo_loss(self, request: Request, now: float, position: int = 0) -> tuple[float, float, int]:
        """Sort key of a preemption victim: (extra lateness of its next deadline if it had to
        recompute everything it holds, relative to its target; that recompute; -position)."""
        slo = self.classes.of(request)
        target = slo.tbt if request.token_times else slo.ttft
        recompute = self.predictor.prefill_time(max(request.num_computed_tokens, 1))
        deadline = self.deadline(request)
        extra = max(0.0, now + recompute - deadline) - max(0.0, now - deadline)
        return (extra / target, recompute, -position)
