"""The ``trtllm`` policy's per-step shortcuts against a fresh walk at every step (r48, issue 35).

``TrtllmPolicy`` keeps each generation request's blocks to completion and their sum
(``_generating``, ``_generating_blocks``: GUARANTEED_NO_EVICT's bound on the reservations), and
``guaranteed_no_evict`` is lazy and sums the exact reservations only when a context passes that
bound. Checked at every capacity pass of whole simulated runs: the kept state equals a fresh
computation over the active list, and the lazy pass yields, walked to its end, exactly the list the
eager pass (``_eager``, the pass as it was before, summing every reservation first) returns; and a
run equals one whose capacity scheduler is the eager pass, token for token. Workloads: long
prompts, tight memory, a small ``max_batch_size`` (the first pass cut), chunked contexts, shared
prefixes (the reuse rule), MAX_UTILIZATION (pauses: the state left by them), STATIC_BATCH,
overlap on and off."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tailserve.core.engine import EngineOptions
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.policies import trtllm as trtllm_module
from tailserve.policies.registry import PolicySpec
from tailserve.policies.trtllm import TrtllmPolicy
from tailserve.policies.trtllm_capacity import (
    NO_DRAFTS,
    DraftSlots,
    IsGeneration,
    SkipRule,
    blocks_one_step,
    guaranteed_no_evict,
    remaining_blocks,
)
from tailserve.sim.run import run_policy
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.workloads.lengths import LogNormal


def _eager(
    sched: Scheduler,
    active: list[Request],
    is_generation: IsGeneration,
    max_num_requests: int,
    static_batch: bool,
    block_reuse: bool,
    slots: DraftSlots = NO_DRAFTS,
) -> list[Request]:
    """GUARANTEED_NO_EVICT as the policy ran it before r48: both passes whole, every
    generation request's reservation summed first, the reuse rule's set collected up front."""
    scheduled: list[Request] = []
    pending: list[Request] = []
    for request in active:
        if len(scheduled) >= max_num_requests:
            break
        if is_generation(request):
            scheduled.append(request)
        else:
            pending.append(request)
    if not pending or (static_batch and scheduled):
        return scheduled
    available = sched.kv_cache.num_free_blocks
    for request in scheduled:
        available -= remaining_blocks(sched, request, slots)
    skip = SkipRule(sched, active, is_generation) if block_reuse and not static_batch else None
    for request in pending:
        if skip is not None and skip.skips(request):
            continue
        if len(scheduled) >= max_num_requests:
            break
        need = remaining_blocks(sched, request, slots)
        if need > available:
            break
        scheduled.append(request)
        available -= need
    return scheduled


def _eager_max_utilization(
    sched: Scheduler,
    active: list[Request],
    is_generation: IsGeneration,
    max_num_requests: int,
    block_reuse: bool,
    pause,
    slots: DraftSlots = NO_DRAFTS,
) -> tuple[list[Request], list[Request]]:
    """MAX_UTILIZATION as the policy ran it before r48: the reuse rule's set collected up front,
    ``blocks_one_step`` and the free blocks asked for each request."""
    kv = sched.kv_cache
    skip = SkipRule(sched, active, is_generation) if block_reuse else None
    scheduled: list[Request] = []
    paused: list[Request] = []
    scheduled_blocks = 0
    end = len(active)
    i = 0
    while i < end:
        request = active[i]
        if skip is not None and skip.skips(request):
            i += 1
            continue
        if len(scheduled) < max_num_requests:
            need = blocks_one_step(sched, request, is_generation(request), slots)
            if scheduled_blocks + need <= kv.num_free_blocks:
                scheduled.append(request)
                scheduled_blocks += need
                i += 1
                continue
        victim = next((j for j in range(end - 1, i - 1, -1) if kv.num_held(active[j].request_id)), None)
        if victim is None:
            break
        pause(active[victim])
        paused.append(active[victim])
        end = victim
    return scheduled, paused


def _fresh_state(policy: TrtllmPolicy, sched: Scheduler) -> dict[str, int]:
    """Each active generation request's blocks to completion, from scratch."""
    kv = sched.kv_cache
    slots = policy._slots
    extra = slots.extra + slots.drafts + slots.in_flight
    return {
        r.request_id: kv.blocks_for(r.prompt_len + r.max_tokens + extra)
        for r in policy._active
        if policy._is_generation(r)
    }


class _Checks:
    """Wraps the policy's ``guaranteed_no_evict``: checks the kept state and the lazy pass at each
    call, then hands the policy the real (lazy) pass."""

    def __init__(self) -> None:
        self.calls = 0
        self.bound_passed = 0  # passes where a context went past the bound: the exact sum ran
        self.contexts_kept = 0

    def __call__(self, sched, active, is_generation, max_num_requests, static, reuse, slots, bound):
        policy = sched.policy
        self.calls += 1
        fresh = _fresh_state(policy, sched)
        assert policy._generating == fresh  # every generation request is active, none missing
        assert bound == policy._generating_blocks == sum(fresh.values())
        want = _eager(sched, active, is_generation, max_num_requests, static, reuse, slots)
        got = list(
            guaranteed_no_evict(sched, active, is_generation, max_num_requests, static, reuse, slots, bound)
        )
        assert [r.request_id for r in got] == [r.request_id for r in want]
        # A kept context past what the bound leaves: admitted on the exact sum.
        loose = sched.kv_cache.num_free_blocks - bound
        for request in got:
            if not is_generation(request):
                self.contexts_kept += 1
                need = remaining_blocks(sched, request, slots)
                if need > loose:
                    self.bound_passed += 1
                    break
                loose -= need
        return guaranteed_no_evict(
            sched, active, is_generation, max_num_requests, static, reuse, slots, bound
        )


def _eager_pass(
    sched, active, is_generation, max_num_requests, static, reuse, slots, bound
) -> Iterator[Request]:
    return iter(_eager(sched, active, is_generation, max_num_requests, static, reuse, slots))


LONG = WorkloadSpec(
    "random", num_requests=120, rate=6.0, seed=3,
    input_len=LogNormal(1400.0, 0.8, 8192), output_len=LogNormal(140.0, 0.8, 1024),
)  # fmt: skip
SHARED = WorkloadSpec("shared-prefix", num_requests=120, rate=30.0, seed=4, num_prefixes=2, prefix_len=2048)

CASES = [
    ("long prompts, overlap", {}, LONG),
    ("long prompts, no overlap", {"disable_overlap_scheduler": True}, LONG),
    ("tight memory", {"gpu_memory_utilization": 0.04}, LONG),
    ("tight memory, no overlap", {"gpu_memory_utilization": 0.04, "disable_overlap_scheduler": True}, LONG),
    ("max_batch_size 6", {"max_batch_size": 6}, LONG),
    (
        "chunked contexts",
        {"enable_chunked_prefill": True, "max_num_tokens": 1024, "gpu_memory_utilization": 0.06},
        LONG,
    ),
    ("shared prefixes", {"gpu_memory_utilization": 0.05}, SHARED),
    ("shared prefixes, chunked", {"enable_chunked_prefill": True, "max_num_tokens": 512}, SHARED),
    ("STATIC_BATCH", {"capacity_scheduler_policy": "STATIC_BATCH"}, LONG),
    (
        "MAX_UTILIZATION",
        {"capacity_scheduler_policy": "MAX_UTILIZATION", "gpu_memory_utilization": 0.04},
        LONG,
    ),
]


def _run(flags: dict, workload: WorkloadSpec, fast: bool = True, check_integrity: bool = True):
    """``trtllm`` with ``flags`` on ``workload`` (Llama-3-8B, one A100); also
    ``test_trtllm_stepped_step.py``'s."""
    built = build_cost_model(Deployment("Llama-3-8B", "A100-80GB", 1, "none"))
    return run_policy(
        built,
        PolicySpec.make("trtllm", flags),
        WorkloadBuilder(workload),
        options=EngineOptions(fast_forward=fast, check_integrity=check_integrity),
    )


@pytest.mark.parametrize(("label", "flags", "workload"), CASES, ids=[c[0] for c in CASES])
def test_the_kept_state_and_the_lazy_pass_equal_a_fresh_walk_at_every_step(
    monkeypatch, label, flags, workload
):
    checks = _Checks()
    monkeypatch.setattr(trtllm_module, "guaranteed_no_evict", checks)
    state_checks = []
    original = TrtllmPolicy.schedule

    def schedule(self, sched, now):
        out = original(self, sched, now)
        # After the step's own changes (contexts done, pauses): still a fresh walk's.
        fresh = _fresh_state(self, sched)
        assert self._generating == fresh
        assert self._generating_blocks == sum(fresh.values())
        state_checks.append(len(fresh))
        return out

    monkeypatch.setattr(TrtllmPolicy, "schedule", schedule)
    run = _run(flags, workload)
    assert all(r.is_finished for r in run.requests)
    assert state_checks and max(state_checks) > 1
    if flags.get("capacity_scheduler_policy") != "MAX_UTILIZATION":
        assert checks.calls and checks.contexts_kept
    if label.startswith("tight memory"):
        assert checks.bound_passed  # the exact sum was needed, and ran


@pytest.mark.parametrize(("label", "flags", "workload"), CASES[:8], ids=[c[0] for c in CASES[:8]])
def test_a_run_equals_one_with_the_eager_capacity_pass(monkeypatch, label, flags, workload):
    lazy = _run(flags, workload)
    monkeypatch.setattr(trtllm_module, "guaranteed_no_evict", _eager_pass)
    eager = _run(flags, workload)
    assert [r.token_times for r in lazy.requests] == [r.token_times for r in eager.requests]
    assert [r.first_scheduled_time for r in lazy.requests] == [r.first_scheduled_time for r in eager.requests]


def test_the_checks_fail_on_a_state_left_stale(monkeypatch):
    """A finished request left in the kept state (its blocks still summed): caught."""
    monkeypatch.setattr(trtllm_module, "guaranteed_no_evict", _Checks())
    monkeypatch.setattr(TrtllmPolicy, "_leave_generation", lambda self, request_id: None)
    with pytest.raises(AssertionError):
        _run({}, LONG)


def test_a_bound_short_of_the_reservations_changes_decisions_and_the_checks_say_so(monkeypatch):
    """The bound must not fall short of the reservations: each generation request counted with
    none of its blocks admits contexts that do not fit — the lazy pass then differs from the
    eager one (checked with the state check off), and the state check fails too."""

    def enter(self, sched, request):
        self._generating[request.request_id] = 0

    monkeypatch.setattr(TrtllmPolicy, "_enter_generation", enter)
    checks = _Checks()

    def decisions_only(sched, active, is_generation, max_num_requests, static, reuse, slots, bound):
        want = _eager(sched, active, is_generation, max_num_requests, static, reuse, slots)
        got = list(
            guaranteed_no_evict(sched, active, is_generation, max_num_requests, static, reuse, slots, bound)
        )
        assert [r.request_id for r in got] == [r.request_id for r in want]
        return iter(got)

    monkeypatch.setattr(trtllm_module, "guaranteed_no_evict", decisions_only)
    with pytest.raises(AssertionError):
        _run({"gpu_memory_utilization": 0.04}, LONG)
    monkeypatch.setattr(trtllm_module, "guaranteed_no_evict", checks)
    with pytest.raises(AssertionError):
        _run({"gpu_memory_utilization": 0.04}, LONG)


MAX_UTILIZATION = [
    ("tight memory", {"capacity_scheduler_policy": "MAX_UTILIZATION", "gpu_memory_utilization": 0.03}, LONG),
    (
        "tight memory, no overlap",
        {
            "capacity_scheduler_policy": "MAX_UTILIZATION",
            "gpu_memory_utilization": 0.03,
            "disable_overlap_scheduler": True,
        },
        LONG,
    ),
    (
        "chunked contexts",
        {
            "capacity_scheduler_policy": "MAX_UTILIZATION",
            "gpu_memory_utilization": 0.03,
            "enable_chunked_prefill": True,
            "max_num_tokens": 1024,
        },
        LONG,
    ),
    (
        "shared prefixes",
        {"capacity_scheduler_policy": "MAX_UTILIZATION", "gpu_memory_utilization": 0.02},
        SHARED,
    ),
]


@pytest.mark.parametrize(("label", "flags", "workload"), MAX_UTILIZATION, ids=[c[0] for c in MAX_UTILIZATION])
def test_max_utilization_equals_its_pass_before_r48(monkeypatch, label, flags, workload):
    """MAX_UTILIZATION's pass with the free blocks read once (and
    after each pause) and the reuse rule's set collected lazily (before any pause) pauses and
    schedules as it did, in runs that pause."""
    fast = _run(flags, workload)
    monkeypatch.setattr(trtllm_module, "max_utilization", _eager_max_utilization)
    eager = _run(flags, workload)
    assert sum(r.num_preemptions for r in eager.requests) > 0
    assert [r.token_times for r in fast.requests] == [r.token_times for r in eager.requests]
    assert [r.num_preemptions for r in fast.requests] == [r.num_preemptions for r in eager.requests]
