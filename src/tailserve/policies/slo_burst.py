"""An experiment for the ``slo`` policy (off by default, ``tbt_late_fraction``): spend the share
of late TBT gaps a p99 target allows on bursts.

Rule 2 keeps *every* decode gap within its TBT target, but an SLO on p99 TBT allows 1% of them to
be late. ``BurstBudget`` counts the decode gaps the policy scheduled and the ones it let run
late; while the late ones stay under ``fraction`` of all, an iteration in which the waiting
queue cannot be cleared before its tightest TTFT deadline (predicted prefills, stretched as rule 3
stretches them) drops rule 2's TBT limit, so the chunks fill the token budget: one long
iteration instead of many short ones each carrying every decode. Its decodes' gaps count as late.
"""

from __future__ import annotations

from dataclasses import dataclass

from tailserve.core.scheduler import Scheduler
from tailserve.policies.slo_state import SloState


@dataclass(slots=True)
class BurstBudget:
    fraction: float
    gaps: int = 0  # decode gaps scheduled
    late: int = 0  # of which in an iteration that dropped the TBT limit

    def allows(self, num_decodes: int) -> bool:
        """Whether an iteration with ``num_decodes`` decodes may drop the TBT limit."""
        return self.fraction > 0 and self.late + num_decodes <= self.fraction * (self.gaps + num_decodes)

    def count(self, num_decodes: int, spent: bool, num_steps: int = 1) -> None:
        self.gaps += num_decodes * num_steps
        if spent:
            self.late += num_decodes

    def spends(self, state: SloState, sched: Scheduler, now: float, num_decodes: int) -> bool:
        """Whether this iteration (``num_decodes`` decodes scheduled) drops the TBT limit: the
        budget allows it and the waiting queue's predicted prefills (``state.info``, stretched by
        ``state.stretch``) end past its tightest deadline. Counts the iteration's gaps either way."""
        spent = bool(sched.waiting) and self.allows(num_decodes) and _queue_overdue(state, sched, now)
        self.count(num_decodes, spent)
        return spent


def _queue_overdue(state: SloState, sched: Scheduler, now: float) -> bool:
    info = state.info
    need = sum(info[r.request_id].prefill_s for r in sched.waiting) * state.stretch
    return now + need > min(info[r.request_id].deadline for r in sched.waiting)
