"""SGLang 0.5.23's load and cadence knobs beside its batch rules (``managers/scheduler.py``).

``max_queued_requests`` (``_abort_on_queued_limit``, in ``_add_request_to_queue``): a request
that would make the waiting queue longer than the limit is refused with HTTP 503 ("The request
queue is full."). That holds for every request entering the queue: an arrival, and a request
retracted by a decode or evicted by a priority preemption going back to the queue's tail (which
has been served, so it ends aborted). Under priority scheduling the least preferred waiting
request, the latest queued among equals, leaves instead ("aborted by a higher priority
request") when the entering one is strictly more urgent. Only a server outside a P/D pair
applies it ("ignored when using disaggregation-mode").

``prefill_decode_interval`` (``_should_defer_prefill`` / ``_arm_prefill_decode_interval``): a
prefill batch (an extend, mixed or not) arms a countdown; each scheduler turn while it is above
0 skips the prefill pass and decrements it, unless the running batch holds fewer than
``prefill_decode_interval_min_bs`` requests, which ends the countdown. The running batch is the
decoding requests (the unfinished chunk is kept out of the merge). A turn that then has nothing
to run is an idle loop turn: SGLang spins through the rest of the countdown at once, so here it
runs out at no simulated cost and the prefill pass runs in that turn.

``prefill_max_requests`` lives in the adder (``sglang_adder.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.policies.sglang_adder import queued_at
from tailserve.policies.sglang_config import SglangConfig

QUEUE_FULL = "The request queue is full."
PUSHED_OUT = "The request is aborted by a higher priority request."


def _status(reason: str, limit: int) -> str:
    return f"HTTP 503: {reason} (max_queued_requests={limit})"


def _unserved(request: Request) -> bool:
    return request.first_scheduled_time is None and not request.num_preemptions


def admit_to_queue(config: SglangConfig, sched: Scheduler, request: Request, now: float) -> bool:
    """``_abort_on_queued_limit`` for a request about to join the waiting queue (not in any
    queue yet): True if it may join; False if it was turned away (rejected when never served,
    else aborted). A less urgent waiting request it pushes out is aborted here."""
    limit = config.max_queued_requests
    if limit is None or config.disaggregation_mode != "null" or len(sched.waiting) + 1 <= limit:
        return True
    # (max_queued_requests 0 with priority scheduling: SGLang 0.5.23 takes the max of an empty queue
    # and raises ValueError; here the arrival is refused.)
    if config.enable_priority_scheduling and len(sched.waiting):
        # SGLang's max over (direction x priority, queue entry time): the least preferred, the
        # newest among equals; it leaves only for a strictly more urgent request.
        direction = 1 if config.schedule_low_priority_values_first else -1
        candidate = max(sched.waiting, key=lambda r: (direction * r.priority, queued_at(r)))
        if direction * request.priority < direction * candidate.priority:
            status = (
                RequestStatus.FINISHED_REJECTED if _unserved(candidate) else RequestStatus.FINISHED_ABORTED
            )
            sched.abort_request(candidate.request_id, _status(PUSHED_OUT, limit), now, status)
            return True
    reason = _status(QUEUE_FULL, limit)
    if _unserved(request):
        sched.reject(request, reason, now)
    else:
        sched.abort(request, reason, now)  # retracted or evicted: its KV was freed already
        sched.policy.on_finished(sched, [request])  # (``abort`` leaves the policy's own state)
    return False


@dataclass(slots=True)
class PrefillDecodeInterval:
    """The countdown of ``prefill_decode_interval``: scheduler turns left in which no prefill
    is tried."""

    interval: int = 0
    min_bs: int = 0
    remaining: int = 0

    def defer(self, running_bs: int) -> bool:
        """``_should_defer_prefill`` at the start of a turn with ``running_bs`` decoding requests."""
        if self.remaining == 0:
            return False
        if running_bs < self.min_bs:
            self.remaining = 0
            return False
        self.remaining -= 1
        return True

    def arm(self) -> None:
        """``_arm_prefill_decode_interval`` after a turn that built a prefill batch."""
        self.remaining = self.interval
