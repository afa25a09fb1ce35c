"""Exact fast path: a decode run that goes on past the iterations that finish requests.

A decode run (``decode_run.py``) ends with the iteration that produces some request's last
token; with nobody waiting the driver then starts the next run at once (``steady_after_run``),
so about two runs in three only shrink the batch by a finish. Each run touched every request
(its context, held slots, outputs, token times, blocks): per run O(batch) Python work, repeated
for requests that merely go on decoding. Here the run continues in the same call, segment by
segment, each segment the iterations up to the next finish: a request that finishes is brought
up to date and finished at its segment's end exactly as the run that ended there would have
done (its outputs, token times, blocks; ``Scheduler.finish``, the source's ``on_finish``, the
policy's hooks, in stepping's order), while the requests that go on are brought up to date once,
when the whole run ends. Between segments the driver's own test (``steady_after_run``) decides
whether to go on, with the clock, arrivals and wake-ups as they are after the finish.

Only where nothing can observe the requests that go on before the run ends: nobody waits (so
no policy reads them to decide an admission), the KV manager shares no prefixes (no prefix cache
or radix tree indexes their blocks; only its free count is read, and each segment's budget is
that count less the blocks still owed), no per-iteration records or checks.
The blocks owed are taken when the run ends, so their ids differ from a run-per-finish's (after
the finish's blocks came back); no result reads block ids. ``tests/test_decode_run.py`` and
``tests/test_speed_paths.py`` check that results are identical to plain stepping.
"""

from __future__ import annotations

from operator import itemgetter
from typing import TYPE_CHECKING

from tailserve.executors.simulated import driver  # the driver imports this module through decode_run
from tailserve.executors.simulated.decode_run import MAX_RUN, SHORT_RUN, walk_iterations
from tailserve.executors.simulated.fast_paths import FastPaths

if TYPE_CHECKING:
    from tailserve.core.engine import Engine
    from tailserve.core.request import Request
    from tailserve.executors.simulated.decode_run import DecodeRunExecutor


def applies(engine: Engine) -> bool:
    """Whether a run that ends with a finish may go on here (see the module docstring)."""
    return (
        not engine.scheduler.waiting
        and not engine.scheduler.kv_cache.shares_prefixes
        and engine.batches is None
        and not engine.options.check_integrity
    )


def run_past_finishes(
    engine: Engine,
    executor: DecodeRunExecutor,
    running: list[Request],
    ctx_list: list[int],
    held_tokens: list[int],
    times: list[float],
    durations: list[float],
    need: list[int],
) -> int:
    """Apply a first segment that ends with finishes (``times``, ``durations``, cumulative
    blocks ``need``, computed by ``decode_run`` for ``running``, whose computed tokens and held
    slots were ``ctx_list`` and ``held_tokens``) and go on while the driver would; returns the
    iterations advanced in all."""
    sched = engine.scheduler
    kv = sched.kv_cache
    log = engine.log
    policy = sched.policy
    assert isinstance(policy, FastPaths)
    block_size = kv.block_size
    reserve = policy.decode_reserve_blocks
    n = len(running)
    remaining = [r.max_tokens - r.num_output_tokens for r in running]
    order = sorted(range(n), key=remaining.__getitem__)  # finishing order
    p = 0  # next in ``order`` still running
    acc: list[float] = []  # token times since the run began: every iteration's end
    steps = 0  # iterations done
    owed = 0  # blocks the requests that go on took in the iterations done, not yet allocated
    num_ctx = sum(ctx_list)  # computed tokens of the requests left, at the run's start
    n_left = n
    due: dict[int, int] | None = None  # built at the first continuation
    while True:
        k = len(durations)
        used0 = kv.used_block_count() + owed
        log.extend_decode_run(times[:-1], durations, n_left, [used0 + x for x in need])
        acc.extend(times[1:])
        steps += k
        owed += need[-1]
        # The requests whose last token this segment's last iteration produced.
        first = p
        while p < n and remaining[order[p]] == steps:
            i = order[p]
            num_ctx -= ctx_list[i]
            if due is not None:
                _drop_due(due, held_tokens[i] - ctx_list[i], steps, block_size)
            p += 1
        end = acc[-1]
        if p == first:  # cut short by a wake-up, the KV budget or the segment cap
            _catch_up(sched, running, held_tokens, order, p, acc)
            policy.on_decode_run(sched, k)
            engine.end_run([], end)
            return steps
        fin = sorted(order[first:p])  # running order, the order stepping finishes them in
        free_before = kv.free_block_count()
        done = sched.update_run([running[i] for i in fin], [held_tokens[i] for i in fin], acc)
        owed -= free_before - kv.free_block_count()
        policy.on_decode_run(sched, k)
        engine.end_run(done, end)
        n_left -= len(fin)
        if not (n_left and not sched.waiting and _steady_after_run(engine)):
            if n_left:
                _catch_up(sched, running, held_tokens, order, p, acc)
            return steps
        # The next segment: the requests left, up to the next finish.
        if due is None:
            due = _due_after(running, ctx_list, held_tokens, order, p, steps, block_size)
        now = end
        # ``min`` spelled out (the builtin parses its arguments as keywords): once per segment.
        k_max = remaining[order[p]] - steps
        if k_max > MAX_RUN:
            k_max = MAX_RUN
        num_context = num_ctx + n_left * (steps + 1)
        wake = engine.next_wake(now)
        if wake is not None and k_max > SHORT_RUN:  # as ``decode_run`` bounds a long run only
            bound = int((wake - now) / executor.decode_step_duration(n_left, num_context)) + 1
            if bound < k_max:
                k_max = bound
        free = kv.free_block_count() - owed - reserve
        seg = _segment(executor, n_left, num_context, now, wake, k_max, due, steps, block_size, free)
        if seg is None:
            _catch_up(sched, running, held_tokens, order, p, acc)
            return steps
        times, durations, need = seg


def _steady_after_run(engine: Engine) -> bool:
    # Looked up per call: the driver's own test (a test may wrap it).
    return driver.steady_after_run(engine)


def _catch_up(sched, running, held_tokens, order, p, acc) -> None:
    """Bring the requests still running up to date with every iteration of the run (none of
    them finished: each has more tokens to produce than the run's iterations)."""
    left = sorted(order[p:])  # running order, as ``update_run`` allocates
    if len(left) > 1:
        # Picked in C (an ``itemgetter`` of the indices, tuples): once per request left per run.
        pick = itemgetter(*left)
        done = sched.update_run(pick(running), pick(held_tokens), acc)
    else:
        done = sched.update_run([running[i] for i in left], [held_tokens[i] for i in left], acc)
    assert not done


def _due_after(running, ctx_list, held_tokens, order, p, steps, block_size) -> dict[int, int]:
    """For the requests left after ``steps`` iterations: how many need a new block in each
    coming iteration (numbered from the run's start), the first of each request's crossings.
    In iteration j a request computes token ``ctx + j`` and needs a block at ``held - ctx + m *
    block_size``."""
    if block_size == 1 and held_tokens == ctx_list:  # one-token slots, none held ahead (SGLang)
        left = len(order) - p
        return {steps: left} if left else {}  # the loop below's answer: each crossing at ``steps``
    due: dict[int, int] = {}
    for i in order[p:]:
        j = held_tokens[i] - ctx_list[i]
        if j < steps:  # ``_next_crossing``, inlined: once per request left
            j += -(-(steps - j) // block_size) * block_size
        due[j] = due.get(j, 0) + 1
    return due


def _next_crossing(first: int, steps: int, block_size: int) -> int:
    if first >= steps:
        return first
    return first + -(-(steps - first) // block_size) * block_size


def _drop_due(due: dict[int, int], first: int, steps: int, block_size: int) -> None:
    j = _next_crossing(first, steps, block_size)
    count = due[j] - 1
    if count:
        due[j] = count
    else:
        del due[j]


def _segment(executor, n, num_context, now, wake, k_max, due, start, block_size, free):
    """``decode_run``'s walk from iteration ``start`` of the run on, with the crossings kept in
    ``due``; None if no iteration fits."""
    if free < 0 or k_max < 1:
        return None
    if k_max <= SHORT_RUN:
        step_durations = executor.decode_step_durations(n, num_context, k_max)
    else:
        step_durations = executor.decode_run_durations(n, num_context, k_max).tolist()
    return walk_iterations(step_durations, now, wake, due, start, block_size, free)
