"""vLLM 0.32's DP prefill balancing (``--prefill-schedule-interval N``): new prefills admitted only
on every N-th step of a data-parallel group, aligned across its ranks, so that the ranks' forward
passes (which meet at every MoE layer) carry their prompts together.

The cadence (``vllm/v1/engine/core.py:2162, 2318-2326@v0.32.0``, ``DPEngineCoreProc``: an MoE
model's DP ranks): a step is *throttled* when ``interval > 1`` and the group's step counter is not a
multiple of it; the counter counts the group's steps since its last idle moment (a *wave*: it is 0
at a wave's first step, so a prefill arriving at an idle group is admitted at once) and is the same
on every rank. ``PrefillCadence`` keeps it for ``cluster/dp_group.py``'s lockstep group.

The scheduler's side (``vllm/v1/core/sched/scheduler.py:634-638, 684-689, 1113-1116,
1397-1401@v0.32.0``), ``PrefillThrottle``: a throttled step *defers* prefills unless the last
step that admitted them was capacity-bound, and only while some running request decodes.
Capacity-bound: after its waiting pass more requests wait (the waiting queue and those holding KV
while they wait: a connector's loads) than vLLM's ``deferred_waiting`` holds — the requests a
connector's load made a pass skip (or that wait for it), from that pass until they are admitted
or leave. A deferring step skips the running requests that are mid-prefill (``is_prefill_chunk``)
and stops admitting at the first waiting request with prompt tokens to compute (more than its last
one after the prefix-cache hit); a request whose KV comes from a connector is still admitted to
load. A step that does not defer and reaches the waiting queue records whether it was
capacity-bound. One engine (no DP group) is never throttled: its engine core is not
``DPEngineCoreProc``.

Deviation: vLLM ends a wave only when it syncs the ranks' state (the first step, then every
``dp_sync_interval`` steps, 16: ``core.py:2411-2413``), running dummy batches and counting on until
then; ``PrefillCadence`` restarts at the first step after which no rank has work.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PrefillThrottle:
    """One rank's side: whether this step is throttled (set by the group before each step),
    whether the last admitting step was capacity-bound, and (``tracking``: an interval above 1)
    the requests vLLM counts as deferred."""

    throttled: bool = False
    capacity_bound: bool = False
    tracking: bool = False
    deferred: set = field(default_factory=set)  # of Request, by identity

    def defers(self, any_decoding: bool) -> bool:
        """``defer_prefills`` for this step, given whether a running request decodes."""
        return self.throttled and not self.capacity_bound and any_decoding

    def released(self, num_waiting: int) -> None:
        """A step that did not defer reached the waiting queue and left this many requests
        waiting (its skipped ones back in the queue, loads among them)."""
        self.capacity_bound = num_waiting > len(self.deferred)


@dataclass(slots=True)
class PrefillCadence:
    """The group's step counter (``step_counter``) against ``prefill_schedule_interval``."""

    interval: int
    counter: int = 0

    def throttles(self) -> bool:
        return self.interval > 1 and self.counter % self.interval != 0

    def stepped(self, group_idle: bool) -> None:
        """After a group step: count it, or start a new wave when no rank has work left."""
        self.counter = 0 if group_idle else self.counter + 1
