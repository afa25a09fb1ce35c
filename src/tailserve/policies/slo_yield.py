"""Rule 10 of the ``slo`` policy (tailserve's, beside rule 9's isolation): an over-share tenant
yields the iterations a protected tenant's prefill runs in.

Rule 9 lets a protected tenant's chunks ignore an over-share tenant's TBT slack, but the
over-share tenant's running decodes still ride in the same iteration: beside a backlogged tenant
with ~200 decodes, they take ~20 of a 50 ms TBT budget, so the protected tenant's long prompts
need more chunk iterations than they would alone. VTC's premise is that it is the tenant over its
share whose service is cut, so in an iteration where a protected tenant has a prefill to run,
the tenants over their fair share (``RecentService.shares``) are left out: their decodes, their
partial prefills and their admissions. Bounded per request: a decode sits out only while the gap
since its last token is under ``yield_tbts`` x its class's TBT target, so its next token comes
at most one iteration after that. When, after all, no protected chunk got into the iteration (its
request did not fit the KV blocks), the decodes left out are put back; the over-share tenant's
chunks and admissions wait that one iteration.

Tenants between half and all of their share are neither protected nor cut.

Rule 11 (short quanta): an iteration cannot be interrupted, so a protected tenant's request that
arrives while an over-share tenant's long chunk runs waits for it (beside a backlogged tenant,
iterations filled to a 50 ms TBT slack: ~25 ms on average, up to 50, against a few ms alone).
While a protected tenant has running requests, an over-share tenant's chunk may take the
iteration to at most ``quantum_tbts`` x the smallest TBT target of the protected tenant's running
requests. A smaller quantum leaves the over-share tenant's chunks less of each iteration beside
its decodes, so its throughput falls and, with it, its recent service: before rule 9 held a
protected tenant's protection until it has its share, that cost the protected tenant its
protection in its own bursts. The measured trade-off is in docs/experiments.md §8.
"""

from __future__ import annotations

import math

from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.policies.slo_state import SloState
from tailserve.policies.vtc import tenant_of


class YieldRules:
    """Rules 10 and 11 over ``state`` (its ``protected`` and ``over``, decided by rule 9)."""

    def __init__(self, state: SloState) -> None:
        self.state = state

    def yielding_tenants(self, sched: Scheduler) -> frozenset[str]:
        """The over-share tenants that sit this iteration out: those of rule 9's decision, when a
        protected tenant has a partial prefill running or a waiting request with a batch slot
        free; empty otherwise (always without fairness, with one tenant, or with
        ``yield_tbts=0``)."""
        state = self.state
        over = state.over
        protected = state.protected
        if not over or not protected or not state.config.yield_tbts > 0:
            return frozenset()
        for r in sched.running:
            if r.num_tokens - r.num_computed_tokens > 1 and tenant_of(r.tenant_id) in protected:
                return over
        if len(sched.running) < state.config.max_num_seqs:
            for r in sched.waiting:
                if tenant_of(r.tenant_id) in protected:
                    return over
        return frozenset()

    def sits_out(self, request: Request, now: float, over: frozenset[str]) -> bool:
        """Whether the decode ``request`` is left out of this iteration (rule 10)."""
        if not over or not request.token_times or tenant_of(request.tenant_id) not in over:
            return False
        tbt = self.state.classes.of(request).tbt
        return now - request.token_times[-1] < self.state.config.yield_tbts * tbt

    def quantum_s(self, sched: Scheduler) -> float:
        """Rule 11: the most seconds an iteration may take with an over-share tenant's chunk
        (inf when no protected tenant has a running request, or with ``quantum_tbts=0``)."""
        state = self.state
        protected = state.protected
        q = state.config.quantum_tbts
        if not protected or not state.over or not q > 0:
            return math.inf
        classes = state.classes
        tbt = min(
            (classes.of(r).tbt for r in sched.running if tenant_of(r.tenant_id) in protected),
            default=math.inf,
        )
        return q * tbt
