"""Exact fast path: a run of identical decode-only steps under vLLM's async scheduling.

``decode_run.py``'s run, with the rules of ``Engine._step_async`` (a batch queue of two) and the
``vllm`` policy's async accounting (``policies/vllm_async.py``) in closed form. The engines whose
overlap schedulers take the same path (``Scheduler.async_scheduling``) sign it where their decode
turns are these steps: ``trtllm`` (the guard is ``GENERATION_TO_COMPLETE``) and ``sglang``, its
default (the guard is ``_reqs_finishing_inflight``; ``SglangPolicy.can_fast_forward``).

Between events a steady async engine repeats one step: step m+1 is scheduled while step m runs,
every running request granted one token on its output placeholder (its previous token not known
yet), and then step m's outputs are applied, one token each, stamped at step m's end. The run
starts with step n in flight and schedules steps n+1..n+k; it applies the outputs of steps
n..n+k-1 and leaves step n+k in flight, as k engine steps would (the skipping step below is step
n+k+1). What makes it differ from the synchronous run:

- Time. A step's host part (``StepResult.host_time``: the per-step overhead) starts when it is
  scheduled, at the end of the step before the one running; its forward pass starts when that
  is done and the device is free: ``begin = max(end[m-1], end[m-2] + host)``,
  ``end[m] = begin + (duration[m] - host)``, the engine's float operations in its order. While
  forward passes (``duration - host``) are at least ``host`` long the maximum is always the
  device (rounding is monotone), so the ends are a running sum (``np.cumsum`` adds in the step
  loop's order) of forward passes; otherwise the recurrence is followed step by step.
- Tokens: step m's tokens are stamped at ``end[m]``, applied one step later; the clock ends at
  the end of step n+k-1, step n+k still running.
- The ``max_tokens`` guard: a request whose step in flight yields its last token is skipped, so
  the batch shrinks one step before the token is known. With nobody waiting that skipping step
  ends the run (it schedules the others and admits nobody; it applies the skipped requests'
  last tokens, and they finish there, their slots and blocks freed a step late); with someone
  waiting the run stops before it (the step, and the next one that may admit, are stepped).
- Arrivals: step m is scheduled at ``end[m-2]``; the run stops before the first step scheduled at
  or after the next arrival (or the policy's wake-up), which then steps and adds it. Where the
  policy says an arrival cannot change its decisions while requests wait behind a head it
  cannot admit (``FastPaths.arrivals_wait_in_async_runs``: TensorRT-LLM's GUARANTEED_NO_EVICT
  without chunked prefill) the run goes on instead, adding each arrival at the first step
  scheduled at or after it, as that step would (``takes_arrivals``).
- KV: each step allocates the slot its token needs, as in the synchronous run (it stops before a
  step that would preempt); blocks are registered with prefix caching only up to the tokens
  known (``Scheduler.update_async_run``).

Two shortcuts for SGLang's overlap loop, each a ``FastPaths`` declaration only it signs:

- A prefill batch in flight (``async_run_after_prefill``). After an arrival's prefill batch is
  launched and the decode step before it applied, the running batch is the old requests, nothing
  in flight (their last token known, uncomputed), then the new ones, their first tokens on
  placeholders; with nobody waiting SGLang's next turn decodes all of them. The run starts there:
  the same steps, except that the old requests get no output from the step in flight (the
  prefill's) and so reach the guard one step later (``behind``).
- A chain (``async_runs_chain``: one-token slots, each request holding exactly its computed
  tokens', and a KV manager that shares no prefixes: ids taken and returned, nothing
  cached). A run that ends with its skipping step goes on into the
  run ``steady_after_run`` would take next, in the same call (``_chain``), as long as each ends
  so: the requests that stay running are updated once, at the end (every one got the same
  outputs, in the same steps), while the ones each skipping step leaves finish at its time.

The iteration log gets each step at its forward pass (``begin``, ``end - begin``), recorded when it
is scheduled, as the engine does. Results are identical to stepping;
``tests/test_speed_paths.py``, ``tests/test_decode_run.py`` and (SGLang's overlap scheduler)
``tests/test_sglang_overlap_run.py`` and ``tests/test_sglang_overlap_chain.py`` check that. ``driver.py`` calls it
under async scheduling (and only then: ``decode_run.py`` is the synchronous run).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import accumulate
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

import numpy as np

from tailserve.core.engine import InFlight
from tailserve.core.executor import StepResult
from tailserve.core.scheduler_output import SchedulerOutput, scheduled_decode
from tailserve.executors.simulated.decode_run import DecodeRunExecutor, blocks_needed
from tailserve.executors.simulated.fast_paths import FastPaths

if TYPE_CHECKING:
    from tailserve.core.engine import Engine


@runtime_checkable
class AsyncDecodeRunExecutor(DecodeRunExecutor, Protocol):
    """A ``DecodeRunExecutor`` that also says how much of a decode step is host time, the part
    async scheduling overlaps with the previous step (``SimExecutor``)."""

    def decode_host_time(self, num_decodes: int) -> float:
        """``StepResult.host_time`` of an async decode-only step of ``num_decodes`` requests;
        its ``duration`` is ``decode_step_duration``'s, bit for bit."""
        ...


MAX_RUN = 512  # steps per call; bounds the (requests x steps) block arithmetic
SHORT_RUN = 32  # up to this many steps a plain loop beats numpy's per-call overhead


def steady(engine: Engine) -> bool:
    """The next steps repeat one decode-only step exactly: a step is in flight, every running
    request is in it (in running order) and samples there — its one output placeholder, and
    nothing else uncomputed (``num_computed_tokens == num_tokens``) — so the next step grants
    each one token; and no waiting request can be admitted: none waits, or the step in flight
    was that decode batch and admitted and preempted nobody, and applying the one before it
    finished nobody (free blocks only shrink while decoding, so a blocked head stays blocked).
    Where the policy signs ``async_run_after_prefill`` and nobody waits, the step in flight may
    hold only the newest running requests (a prefill batch), the ones before them having
    nothing in flight and their last token uncomputed."""
    flight = engine.in_flight
    sched = engine.scheduler
    running = sched.running
    if flight is None or not running or sched.swapped:
        return False
    out = flight.out
    waiting = sched.waiting
    policy = sched.policy
    assert isinstance(policy, FastPaths)  # the driver takes decode runs only for these
    behind = len(running) - len(out.scheduled)
    if behind and (behind < 0 or waiting or not policy.async_run_after_prefill):
        return False
    if waiting and (engine.last_step_finished or out.num_admitted or out.preempted):
        return False
    # The policy's answer (a question) before the walks over the batch: SGLang's overlap
    # scheduler, whose answer is always no, paid them after every step (~2 us an iteration of
    # ~50 on long prompts, r47).
    if not policy.can_fast_forward(sched):
        return False
    for item, request in zip(out.scheduled, running[behind:] if behind else running):
        if (
            item.request is not request
            or request.num_output_placeholders != 1
            or request.num_computed_tokens != request.prompt_len + request.num_output_tokens
        ):
            return False
    if behind:
        # A prefill batch in flight (``async_run_after_prefill``): the requests before its
        # own have nothing in flight, their last token known and not yet computed.
        for request in running[:behind]:
            if (
                request.num_output_placeholders
                or request.num_computed_tokens != request.prompt_len + request.num_output_tokens - 1
            ):
                return False
    if waiting:
        for item in out.scheduled:
            if item.num_new_tokens != 1:
                return False
    nxt = engine.source.next_arrival_time()
    return nxt is None or nxt > engine.clock.now or (bool(waiting) and takes_arrivals(engine))


def takes_arrivals(engine: Engine) -> bool:
    """With requests waiting (and ``steady``'s state: the step in flight admitted nobody, nobody
    finished), whether a run may add arrivals inside it rather than stop at the next one: the
    policy says an arrival now changes none of its decisions before a finish
    (``arrivals_wait_in_async_runs``); the source's next arrival is a request's (not a cluster
    replica's horizon, where the router acts next); and no batch record, whose entries name the
    queue's length after each step."""
    policy = engine.scheduler.policy
    assert isinstance(policy, FastPaths)
    return (
        engine.batches is None
        and engine.source.horizon is None
        and policy.arrivals_wait_in_async_runs(engine.scheduler)
    )


def steady_after_run(engine: Engine) -> bool:
    """``steady`` after a run: the run left every running request on one placeholder in the
    step it left in flight, in running order, a step that admitted and preempted nobody; it
    added no arrival, so a request waits only if one waited before, and then nobody finished
    (the skipping step runs only with nobody waiting). What is left to ask is what the run did
    not decide: an arrival (a closed-loop client's, released by a finish), the policy."""
    nxt = engine.source.next_arrival_time()
    if (
        nxt is not None
        and nxt <= engine.clock.now
        and not (engine.scheduler.waiting and takes_arrivals(engine))
    ):
        return False
    policy = engine.scheduler.policy
    assert isinstance(policy, FastPaths)
    return policy.can_fast_forward(engine.scheduler)


def advance_async_decode_run(engine: Engine) -> int:
    """Advance the engine through as many uneventful async decode steps as possible, and the
    step after them that skips the requests whose last token is in flight (when nobody waits).

    Precondition: ``steady(engine)``, the executor is an ``AsyncDecodeRunExecutor`` and the
    policy a ``FastPaths``. Returns the number of steps scheduled (0 if the very next one is
    eventful and must be stepped normally)."""
    sched = engine.scheduler
    kv = sched.kv_cache
    running = sched.running
    n = len(running)
    now = engine.clock.now  # step n+1 is scheduled now
    flight = cast(InFlight, engine.in_flight)  # ``steady`` checked
    executor = cast(AsyncDecodeRunExecutor, engine.executor)  # the driver checked
    policy = cast(FastPaths, sched.policy)
    block_size = kv.block_size
    tables = kv.block_tables

    # Step n+j is scheduled with num_output_tokens + j - 1 outputs known; the guard skips a
    # request there once j reaches max_tokens - num_output_tokens (its step in flight yields
    # its last token): the batch is the same for the first ``k_guard`` steps.
    # One pass of ``append``s (3.11 specialises them; list comprehensions, a frame each, cost
    # more here: trtllm-default +0.6% loop instructions), the sums and minimum in C after it
    # rather than a Python add and test per request per run (r48).
    remaining_list = []
    ctx_list = []
    first_new_block = []
    held_tokens = []  # KV slots each request holds
    for r in running:
        remaining_list.append(r.max_tokens - r.num_output_tokens - 1)
        c = r.num_computed_tokens
        ctx_list.append(c)
        slots = len(tables[r.request_id]) * block_size
        held_tokens.append(slots)
        first_new_block.append(slots - c)
    # A prefill batch in flight (``steady``): the requests before its own have no token in
    # flight, so one more step before the guard would skip them.
    behind = n - len(flight.out.scheduled)
    if behind:
        for i in range(behind):
            remaining_list[i] += 1
    k_guard = min(min(remaining_list), MAX_RUN + 1)
    num_context = n + sum(ctx_list)
    k_max = min(k_guard, MAX_RUN)
    host = executor.decode_host_time(n)
    # Arrivals bound the run unless they join a queue that cannot move (``takes_arrivals``):
    # then only the policy's own wake-up does, and the run adds them below.
    arrivals_inside = bool(sched.waiting) and takes_arrivals(engine)
    wake = sched.next_wakeup(now) if arrivals_inside else engine.next_wake(now)
    if wake is not None and k_max > 3:
        k_max = _bound_by_wake(executor, n, num_context, host, now, wake, k_max)
    free = kv.free_block_count() - policy.decode_reserve_blocks
    if free < 0:
        return 0  # the policy's reserve is already broken: the next step preempts
    begins: list[float] = []
    ends: list[float] = []
    need: list[int] = []
    last_duration = 0.0
    # One-token slots, each request holding exactly its computed tokens' (SGLang's overlap
    # scheduler takes the slot of the token it schedules): every request needs a slot in every
    # step; ``any`` tests that in C, and the walks per request below are then counts.
    exact_slots = block_size == 1 and not any(first_new_block)
    if k_max >= 1:
        if k_max <= SHORT_RUN:
            need = _short_need(first_new_block, block_size, free, k_max, exact_slots)
        else:
            need = _long_need(ctx_list, first_new_block, block_size, free, k_max)
        if need:
            begins, ends, last_duration = _timing(
                executor, n, num_context, len(need), host, now, flight.end, wake
            )
    k = len(ends)
    need = need[:k]
    skip = None
    if k == k_guard and not sched.waiting:
        # With nobody waiting the step that skips them schedules the others' decodes and
        # admits nobody; it applies their last tokens, and they finish.
        spare = free - (need[-1] if need else 0)
        skip = _skip_step(
            executor,
            remaining_list,
            ctx_list,
            held_tokens,
            k,
            block_size,
            spare,
            now,
            flight.end,
            ends,
            wake,
            exact_slots,
        )
    if not k and skip is None:
        return 0
    if arrivals_inside and k:
        _add_arrivals(engine, [now, flight.end, *ends[: k - 2]][:k])
    if (
        skip is not None
        and exact_slots
        and policy.async_runs_chain
        and not kv.shares_prefixes  # the plain manager: ids taken and returned, nothing cached
        and engine.batches is None
    ):
        return _chain(engine, flight, behind, remaining_list, ctx_list, k, begins, ends, need, skip, free)

    used0 = kv.used_block_count()
    # The outputs of the step in flight and of the run's steps but the last, which stays in
    # flight, each applied at the end of its step.
    token_times = [flight.end, *ends] if skip is not None else [flight.end, *ends[:-1]]
    if k:
        # The run's k steps scheduled every running request, those its outputs finish too:
        # the policy hears of them while they are still running (fairness=vtc charges them).
        policy.on_decode_run(sched, k)
    done = sched.update_async_run(running, held_tokens, token_times, behind)
    keep_log = engine.options.keep_iteration_log
    batches = engine.batches
    if k:
        used = [used0 + x for x in need]
        durations = [e - b for b, e in zip(begins, ends)]
        if keep_log:
            engine.log.extend_decode_run(begins, durations, n, used)
        if batches is not None:
            if policy.batch_entry_per_async_run:
                batches.record_decode_run(begins, durations, running, ctx_list, used, sched)
            else:
                # One entry per step, as stepping records them (the policy's saved runs were
                # recorded so: ``SglangPolicy.batch_entry_per_async_run``).
                for j, (begin, duration, num_used) in enumerate(zip(begins, durations, used)):
                    contexts = [c + j for c in ctx_list]
                    batches.record_decode_run([begin], [duration], running, contexts, [num_used], sched)
    # The step left in flight: the batch ``schedule`` made. The step in flight before the run
    # listed the same requests in the same order (``steady``); its entries become this step's
    # (nothing else holds them: the log and the batch record copied them).
    items = flight.out.scheduled
    if behind:
        # Items of their own for the requests the prefill batch did not hold (their contexts
        # set below, as every item's).
        items = [scheduled_decode(r, 0) for r in running[:behind]] + items
    if skip is not None:
        m, begin, end, last_duration, host, needed = skip
        used_skip = used0 + (need[-1] if need else 0) + needed
        if keep_log:
            engine.log.record(begin, end - begin, 0, m, m, used_skip, 0)
        # The requests it skipped (``remaining == k``) are the ones the run finished: their
        # items leave the step, every other one's is set (as below).
        kept = []
        for item, c, left in zip(items, ctx_list, remaining_list):
            if left != k:
                item.num_new_tokens = 1
                item.num_context_tokens = c + k
                kept.append(item)
        items = kept
        if batches is not None:
            staying = [item.request for item in items]
            contexts = [r.num_computed_tokens - 1 for r in staying]
            batches.record_decode_run([begin], [end - begin], staying, contexts, [used_skip], sched)
    else:
        begin, end = begins[-1], ends[-1]
        # Each one's context: its computed tokens less the one in flight, ``c + k - 1`` after
        # the run's k applied outputs (``update_async_run``; ``c + k`` after the skipping
        # step's k + 1, above), from the contexts before it rather than read back per request.
        for item, c in zip(items, ctx_list):
            item.num_new_tokens = 1
            item.num_context_tokens = c + k - 1
    out = SchedulerOutput(items, advanced=True)
    sched.last_output = out
    engine.end_async_run(
        InFlight(out, StepResult(last_duration, host_time=host), begin, end), token_times[-1], done
    )
    if skip is not None:
        policy.on_decode_run(sched, 1)  # the skipping step, for the requests it scheduled
    return k + (skip is not None)


def _chain(engine, flight, behind, remaining, ctx, k, begins, ends, need, skip, free) -> int:
    """A run that ends with its skipping step, and the runs after it while each does, in one
    call: one-token slots, each request holding exactly its computed tokens' (every request
    needs one slot per step), the plain KV manager (its ids taken and returned, nothing else)
    and a policy that signed ``async_runs_chain``. Each run of the chain is the one
    ``advance_async_decode_run`` would take next (``steady_after_run`` asked between them):
    the same steps, prices, iteration log, policy calls and finishes, in the same order. What
    differs is when the requests that stay running are updated: once, at the end, rather than
    after every run (each got the same outputs, and was scheduled in the same steps, as all the
    others still running); the requests a skipping step leaves finish there, their outputs
    applied and their slots taken and freed. Their slots' ids differ from stepping's (the
    survivors take theirs after the finished ones returned theirs), which nothing reads.

    ``remaining``, ``ctx``: the first run's per-request lists (``behind`` adjusted); ``k``,
    ``begins``, ``ends``, ``need``, ``skip``: its steps; ``free``: its free blocks less the
    policy's reserve. Returns the steps scheduled."""
    sched = engine.scheduler
    kv = sched.kv_cache
    executor = engine.executor
    policy = sched.policy
    source = engine.source
    log = engine.log if engine.options.keep_iteration_log else None
    running = sched.running
    # The requests in the order their guards skip them, the fewest steps left first: each
    # run's skipping step leaves the next of them (all steps are everyone's).
    order = sorted(range(len(running)), key=remaining.__getitem__)
    p = 0  # order[p:] still running
    n = len(running)
    ctx_left = sum(ctx)  # of order[p:], before the chain
    # The outputs applied, one per step scheduled (each run's: the step in flight before it, then
    # its own but the one it leaves in flight): a request gets them from its first on
    # (``behind``: its second), and ``len(times)`` steps scheduled it if it is still running.
    times: list[float] = []
    used = kv.used_block_count()  # as stepping counts them (the survivors' slots come at the end)
    flight_end = flight.end
    ends_with_skip = True
    while True:
        m, skip_begin, skip_end, skip_duration, skip_host, needed = skip
        times.append(flight_end)
        times.extend(ends)
        if k:
            policy.on_decode_run(sched, k)
            if log is not None:
                log.extend_decode_run(
                    begins, [e - b for b, e in zip(begins, ends)], n, [used + x for x in need]
                )
        taken = (need[-1] if need else 0) + needed
        used += taken
        if log is not None:
            log.record(skip_begin, skip_end - skip_begin, 0, m, m, used, 0)
        steps = len(times)
        now = times[-1]
        # The requests the skipping step left: their last tokens applied, they finish now.
        q = p + n - m
        group = sorted(order[p:q])  # running order, as the update finishes them
        held = list(map(ctx.__getitem__, group))  # exact slots: each holds its computed tokens'
        done = sched.update_async_run(
            list(map(running.__getitem__, group)), held, times, bisect_left(group, behind)
        )
        left_context = sum(held)
        ctx_left -= left_context
        freed = left_context + len(done) * (steps - 1)  # each leaves with c + steps - 1 computed
        engine.end_run(done, now)
        policy.on_decode_run(sched, 1)  # the skipping step, for the requests it scheduled
        used -= freed
        free += freed - taken
        p, n = q, m
        flight_end = skip_end
        last = (skip_begin, skip_end, skip_duration, skip_host)
        # ``steady_after_run``; then the next run, as ``advance_async_decode_run`` takes it.
        nxt = source.next_arrival_time()
        if (nxt is not None and nxt <= now) or sched.waiting or not policy.can_fast_forward(sched):
            break
        k_guard = min(remaining[order[p]] - steps, MAX_RUN + 1)
        k_max = min(k_guard, MAX_RUN)
        context = ctx_left + n * steps  # the survivors' computed tokens
        host = executor.decode_host_time(n)
        wake = engine.next_wake(now)
        if wake is not None and k_max > 3:
            k_max = _bound_by_wake(executor, n, n + context, host, now, wake, k_max)
        need = list(range(n, n * min(k_max, free // n) + 1, n)) if k_max >= 1 else []
        begins, ends, last_duration = [], [], 0.0
        if need:
            begins, ends, last_duration = _timing(
                executor, n, n + context, len(need), host, now, flight_end, wake
            )
        k = len(ends)
        need = need[:k]
        skip = None
        if k == k_guard:
            scheduled_at = now if k == 0 else flight_end if k == 1 else ends[-2]
            if wake is None or scheduled_at < wake:
                # The ones it skips: ``remaining - steps == k``, the next of ``order``.
                j = p
                skipped_context = 0
                while j < p + n and remaining[order[j]] - steps == k:
                    skipped_context += ctx[order[j]] + steps
                    j += 1
                kept = n - (j - p)
                spare = free - (need[-1] if need else 0)
                skip = _price_skip(
                    executor,
                    kept,
                    context - skipped_context + kept * (k + 1),
                    kept,
                    spare,
                    k,
                    scheduled_at,
                    flight_end,
                    ends,
                )
        if skip is not None:
            continue
        if k:
            # The chain's last run stops before an event: its last step stays in flight.
            times.append(flight_end)
            times.extend(ends[:-1])
            policy.on_decode_run(sched, k)
            if log is not None:
                log.extend_decode_run(
                    begins, [e - b for b, e in zip(begins, ends)], n, [used + x for x in need]
                )
            steps = len(times)
            last = (begins[-1], ends[-1], last_duration, host)
            ends_with_skip = False
        break
    # The requests still running: every output applied since the chain began, every step.
    alive = sorted(order[p:])
    done = sched.update_async_run(
        list(map(running.__getitem__, alive)),
        list(map(ctx.__getitem__, alive)),
        times,
        bisect_left(alive, behind),
    )
    assert not done, "a request the chain keeps running reached max_tokens"
    # The step left in flight: the batch ``schedule`` made, the items of the step in flight
    # before the chain (``behind``: items of their own), each one's context its computed
    # tokens less the one in flight.
    first = flight.out.scheduled
    items = []
    for i in alive:
        item = scheduled_decode(running[i], 0) if i < behind else first[i - behind]
        item.num_new_tokens = 1
        item.num_context_tokens = ctx[i] + steps - 1
        items.append(item)
    out = SchedulerOutput(items, advanced=True)
    sched.last_output = out
    begin, end, duration, host = last
    launched = InFlight(out, StepResult(duration, host_time=host), begin, end)
    if ends_with_skip:
        engine.keep_in_flight(launched)  # its finishes moved the clock there
    else:
        engine.end_async_run(launched, times[-1], [])
    return steps


def _bound_by_wake(executor, n, num_context, host, now, wake, k_max):
    """``k_max`` cut to the steps that can be scheduled before ``wake``: step n+1+j (j >= 1) is
    scheduled at the end of step n+j-1, at least j-1 forward passes after now (they only get
    longer as contexts grow); the margin absorbs rounding (``_timing`` cuts exactly)."""
    forward = executor.decode_step_duration(n, num_context) - host
    if forward > 0 and wake - now < forward * (k_max - 3):
        return int((wake - now) / forward) + 3
    return k_max


def _add_arrivals(engine: Engine, scheduled_at: list[float]) -> None:
    """Add each arrival at the first of the run's steps scheduled at or after it (``scheduled_at``:
    their times, ascending), as that step's ``add_arrivals`` would. One released while a step adds
    its arrivals (a closed-loop client's, when a request is rejected) waits for the next step."""
    source = engine.source
    i = 0
    nxt = source.next_arrival_time()
    while nxt is not None:
        i = bisect_left(scheduled_at, nxt, i)
        if i == len(scheduled_at):
            return  # after the run: the next step adds it
        engine.add_arrivals(scheduled_at[i])
        i += 1
        nxt = source.next_arrival_time()


def _skip_step(
    executor,
    remaining,
    ctx_list,
    held_tokens,
    k,
    block_size,
    free,
    now,
    device_free_at,
    ends,
    wake,
    exact_slots=False,
):
    """The step after the run's ``k`` when it skips the requests whose last token its
    predecessor yields (``remaining == k``: ``max_tokens - num_output_tokens - 1`` before the
    run) and grants every other one token: (how many it schedules, its forward pass's begin
    and end, its duration and host time, the new KV blocks it takes); None when it would see
    the wake-up, schedule nobody (the engine then idles) or preempt. ``exact_slots``: one-token
    slots, each request holding exactly its ``ctx_list`` tokens' before the run."""
    scheduled_at = now if k == 0 else device_free_at if k == 1 else ends[-2]
    if wake is not None and scheduled_at >= wake:
        return None
    if exact_slots:
        # Each one it schedules needs the slot of its token (``c + k >= c`` below): the loop's
        # counts from the skipped ones alone, found by C scans (``index``), few in a batch.
        num_context = sum(ctx_list)
        skipped = remaining.count(k)
        i = -1
        for _ in range(skipped):
            i = remaining.index(k, i + 1)
            num_context -= ctx_list[i]
        m = needed = len(remaining) - skipped
    else:
        m = num_context = needed = 0
        for left, c, slots in zip(remaining, ctx_list, held_tokens):
            if left == k:
                continue
            m += 1
            num_context += c
            computed = c + k  # when the step is scheduled
            if computed >= slots and not computed % block_size:
                needed += 1  # its blocks, full, hold exactly the computed tokens
    # Each one's context is computed + 1 = c + k + 1: the k + 1 added once, not per request.
    return _price_skip(
        executor, m, num_context + m * (k + 1), needed, free, k, scheduled_at, device_free_at, ends
    )


def _price_skip(executor, m, num_context, needed, free, k, scheduled_at, device_free_at, ends):
    """``_skip_step``'s step of ``m`` requests (``num_context`` context tokens, ``needed`` new
    blocks of ``free``) scheduled at ``scheduled_at`` after a run of ``k`` steps (``ends``);
    None when it schedules nobody or preempts."""
    if not m or needed > free:
        return None
    host = executor.decode_host_time(m)
    duration = executor.decode_step_duration(m, num_context)
    begin = max(ends[-1] if k else device_free_at, scheduled_at + host)
    return m, begin, begin + (duration - host), duration, host, needed


def _short_need(first_new_block, block_size, free, k_max, exact_slots=False):
    """New blocks all requests need by step j of the run, for the steps before the first that
    would have to preempt (at most ``k_max``), in Python: a request with ``f`` free slots needs
    a new block in step f, then every ``block_size`` steps. ``exact_slots``: one-token slots
    and every ``f`` 0."""
    if exact_slots:
        # Every one needs a slot in every step: ``n * j`` by step j, where the count below
        # walks the requests.
        n = len(first_new_block)
        need = list(range(n, n * k_max + 1, n))
        return need if need[-1] <= free else need[: free // n]
    crossings = [0] * k_max
    if block_size == 1:
        # One-token slots (SGLang's): a request needs one in every step from its ``f`` on, so the
        # requests needing one by step j are a running count of where each starts, not a walk
        # of every request's every step (once per request per step of each run).
        for f in first_new_block:
            if f < k_max:
                crossings[f] += 1
        crossings = list(accumulate(crossings))
    else:
        for f in first_new_block:
            while f < k_max:
                crossings[f] += 1
                f += block_size
    need = list(accumulate(crossings))
    return need if need[-1] <= free else need[: bisect_right(need, free)]


def _long_need(ctx_list, first_new_block, block_size, free, k_max):
    """The same with numpy, for runs long enough to amortise it."""
    ctx = np.array(ctx_list, dtype=np.int64)
    held = (np.array(first_new_block, dtype=np.int64) + ctx) // block_size
    need = blocks_needed(ctx, held, block_size, k_max)
    k = k_max if need[-1] <= free else int(np.searchsorted(need, free, side="right"))
    return need[:k].tolist()


def _timing(executor, n, num_context, k, host, now, device_free_at, wake):
    """(begins, ends, the last one's duration) of up to ``k`` steps' forward passes, cut before
    the first step scheduled at or after ``wake``."""
    if k <= SHORT_RUN:
        durations = executor.decode_step_durations(n, num_context, k)
        begins, ends = _overlap(durations, host, now, device_free_at, wake)
        return begins, ends, durations[len(ends) - 1] if ends else 0.0
    array = executor.decode_run_durations(n, num_context, k)
    forward = array - host
    if not (forward[:-1] >= host).all():
        # A forward pass shorter than the host part: the next step's forward pass waits for
        # its host part, not for the device; follow the recurrence.
        durations = array.tolist()
        begins, ends = _overlap(durations, host, now, device_free_at, wake)
        return begins, ends, durations[len(ends) - 1] if ends else 0.0
    first = max(device_free_at, now + host)
    end = np.cumsum(np.concatenate(([first], forward)))[1:]
    if wake is not None:
        # Step n+1+j is scheduled at now, then at the end of step n, then at the run's ends.
        scheduled_at = np.concatenate(([now, device_free_at], end[: k - 2]))
        k = min(k, int(np.searchsorted(scheduled_at[:k], wake, side="left")))
        if not k:
            return [], [], 0.0
    ends = end[:k].tolist()
    return [first, *ends[:-1]], ends, float(array[k - 1])


def _overlap(durations, host, now, device_free_at, wake):
    """Each step's forward pass (begins, ends), the engine's float operations in its order:
    step m, scheduled at the end of step m-2 (the first at ``now``, the second at
    ``device_free_at``, the end of the step in flight), up to the first step scheduled at or
    after ``wake``."""
    begins: list[float] = []
    ends: list[float] = []
    scheduled_at, free_at = now, device_free_at
    for duration in durations:
        if wake is not None and scheduled_at >= wake:
            break  # this step would add the arrival first
        begin = max(free_at, scheduled_at + host)
        end = begin + (duration - host)
        begins.append(begin)
        ends.append(end)
        scheduled_at, free_at = free_at, end
    return begins, ends
