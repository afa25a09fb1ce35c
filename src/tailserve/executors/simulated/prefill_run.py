"""Exact fast path: a prompt chunked alone, one full chunk per iteration, in one step.

SGLang (without ``enable_mixed_chunk``) runs a prefill batch whenever one can be built, and a
prompt longer than ``chunked_prefill_size`` is *the* chunked request: each iteration continues it
with a full chunk, the chunk leaves no budget for anybody else, and every running decode waits.
While no arrival intervenes and the KV budget keeps granting the full chunk, that sequence is
determined. The policy says how many such iterations follow (``FastPaths.lone_chunk_run``: the
conditions are its own rules); this module prices each one from the same ``BatchShape``
``SimExecutor`` builds, adds them to the clock in the step loop's order, allocates each chunk as
the step would (one allocation per iteration, so the same slots), records the iteration log, and
hands the policy its state back (``FastPaths.on_lone_chunk_run``). The prompt's last chunk, which
leaves budget for admissions, runs step by step. ``tests/test_speed_paths.py`` checks results
identical to plain stepping.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from tailserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.fast_paths import FastPaths

if TYPE_CHECKING:
    from tailserve.core.engine import Engine

MAX_RUN = 4096  # iterations per call


def advance_lone_chunk_run(engine: Engine) -> int:
    """Advance through the policy's lone-chunk iterations; returns how many (0 when none)."""
    sched = engine.scheduler
    if sched.swapped:
        return 0
    policy = cast(FastPaths, sched.policy)  # the driver checked
    run = policy.lone_chunk_run(sched)
    if run is None or run.max_steps < 1 or run.chunk < 2:
        return 0
    now = engine.clock.now
    wake = engine.next_wake(now)
    if wake is not None and wake <= now:
        return 0
    request, q = run.request, run.chunk
    shape_time = cast(SimExecutor, engine.executor).cost_model.shape_time  # the driver checked
    q_pairs = q * (q + 1) // 2
    context = request.num_computed_tokens
    t = now
    starts: list[float] = []
    ends: list[float] = []
    for _ in range(min(run.max_steps, MAX_RUN)):
        if wake is not None and t >= wake:
            break  # this iteration would add the arrival first
        starts.append(t)
        t = t + shape_time(q, 0, q * context + q_pairs, q + context, 0, 1, 0)  # a BatchShape's fields
        ends.append(t)
        context += q
    k = len(ends)
    if k == 0:
        return 0
    kv = sched.kv_cache
    log = engine.log
    for start, end in zip(starts, ends):
        computed = request.num_computed_tokens
        if not sched.allocate(request, computed + q):
            raise AssertionError(f"lone chunk run: no KV room for {request.request_id}'s chunk")
        if engine.options.keep_iteration_log:
            log.record(start, end - start, q, 0, 1, kv.used_block_count(), 0)
        request.num_computed_tokens = computed + q  # a partial chunk: nothing sampled
    last = SchedulerOutput()
    last.scheduled.append(ScheduledRequest(request, q, request.num_computed_tokens - q))
    sched.last_output = last
    policy.on_lone_chunk_run(sched, k)
    engine.end_run([], t)
    return k
