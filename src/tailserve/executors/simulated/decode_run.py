"""Exact fast path: a run of identical decode-only iterations simulated in one step.

Between events (an arrival, a finish, a KV shortage) a continuous-batching engine repeats the
same decode iteration: the same requests, one token each, their contexts growing by one. The
iteration times come from the cost model vectorised over the run, the clock is their running
sum (``np.cumsum`` adds in the same order as the step loop), and the run stops *before* the
first iteration in which anything could change (an arrival, a shortage of KV blocks), which
then runs step by step; its last iteration may finish requests, exactly as a normal step does
(with nobody waiting, ``finish_run.py`` goes on past that iteration in the same call). Results are
identical to plain stepping; ``tests/test_decode_run.py`` checks that. ``driver.py`` calls it when
the run is steady and the policy signed ``FastPaths.can_fast_forward`` (under vLLM's async
scheduling, where outputs are applied a step late, it calls ``async_decode_run.py`` instead).
"""

from __future__ import annotations

from math import inf
from operator import sub
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from tailserve.executors.simulated.fast_paths import FastPaths

if TYPE_CHECKING:
    from tailserve.core.engine import Engine


@runtime_checkable
class DecodeRunExecutor(Protocol):
    """An executor whose iteration time depends only on the batch shape can predict a whole run
    of identical decode-only iterations at once. The driver takes the decode fast path exactly
    for executors that implement this protocol (``isinstance``; ``SimExecutor`` does), never for
    a wrapper that hides it."""

    def decode_step_duration(self, num_decodes: int, num_context_tokens: int) -> float:
        """One such iteration; equal bit for bit to ``execute`` of that batch."""
        ...

    def decode_step_durations(self, num_decodes: int, num_context_tokens: int, num_steps: int) -> list[float]:
        """``decode_run_durations`` as a list (cheaper for a few steps); the same floats."""
        ...

    def decode_run_durations(self, num_decodes: int, num_context_tokens: int, num_steps: int) -> np.ndarray:
        """Durations (seconds) of ``num_steps`` decode iterations of ``num_decodes`` requests whose
        summed attention context is ``num_context_tokens`` in the first step and grows by
        ``num_decodes`` each step. Must equal step-by-step ``execute`` bit for bit."""
        ...


MAX_RUN = 512  # iterations per call; bounds the (requests x iterations) block arithmetic


def blocks_needed(ctx: np.ndarray, held: np.ndarray, block_size: int, num_steps: int) -> np.ndarray:
    """New blocks all requests need by iteration j of the run, for j < ``num_steps``.

    In iteration j a request with ``ctx`` computed tokens computes token ``ctx + j`` and must
    hold blocks for ``ctx + j + 1`` tokens.
    """
    steps = np.arange(num_steps, dtype=np.int64)
    total = (ctx[:, None] + steps[None, :] + block_size) // block_size - held[:, None]
    return np.maximum(total, 0).sum(axis=0)


def advance_decode_run(engine: Engine) -> int:
    """Advance the engine through as many uneventful decode iterations as possible.

    Precondition: ``driver.steady(engine)``, the executor is a ``DecodeRunExecutor`` and the
    policy a ``FastPaths``. Returns the number of iterations advanced (0 if the
    very next iteration is eventful and must be stepped normally).
    """
    sched = engine.scheduler
    kv = sched.kv_cache
    running = sched.running
    n = len(running)
    now = engine.clock.now
    # The driver checked both once (an ``isinstance`` of a protocol per run would cost).
    # Annotated, not ``typing.cast``: that is a Python call (~450 instructions) each.
    executor: DecodeRunExecutor = engine.executor  # type: ignore[assignment]
    policy: FastPaths = sched.policy  # type: ignore[assignment]
    block_size = kv.block_size
    tables = kv.block_tables

    # The run may end with the iteration that produces some request's last token. Iteration j
    # of the run needs a new block for a request at ``held - ctx + m * block_size``.
    k_max = MAX_RUN
    ctx_list = []
    held_tokens = []  # KV slots each request holds
    # (``list.append`` called as a method, not bound: Python 3.11 appends such a call inline,
    # while a bound method is called through C, ~55 instructions more a call.)
    if block_size == 1:
        # One-token slots (SGLang): the length itself; the product allocates an int object
        # (lengths past 256 are not cached), per request per run: a loop without it.
        for r in running:
            remaining = r.max_tokens - r.num_output_tokens
            if remaining < k_max:
                k_max = remaining
            ctx_list.append(r.num_computed_tokens)
            held_tokens.append(len(tables[r.request_id]))
    else:
        for r in running:
            remaining = r.max_tokens - r.num_output_tokens
            if remaining < k_max:
                k_max = remaining
            ctx_list.append(r.num_computed_tokens)
            held_tokens.append(len(tables[r.request_id]) * block_size)
    num_context = n + sum(ctx_list)  # integers: the loop's sum, added in C
    k_finish = k_max  # the first finish, if within MAX_RUN
    wake = engine.next_wake(now)
    if wake is not None and k_max > SHORT_RUN:
        # Iterations only get longer as contexts grow, so the first one bounds how many start
        # before the wake-up. Only to bound a long run: a short run's walk stops at the wake
        # itself, and pricing its few iterations past it costs less than this cost-model call
        # did in most runs and every segment of ``finish_run`` (``vllm`` at 2,000 requests: 2,695
        # calls, 127 left; 2.2% of the loop's instructions).
        first = executor.decode_step_duration(n, num_context)
        bound = int((wake - now) / first) + 1  # ``min`` spelled out: once per run
        if bound < k_max:
            k_max = bound
    free = kv.free_block_count() - policy.decode_reserve_blocks
    if k_max <= SHORT_RUN:
        run = _short_run(executor, n, num_context, now, wake, k_max, ctx_list, held_tokens, block_size, free)
    else:
        run = _long_run(executor, n, num_context, now, wake, k_max, ctx_list, held_tokens, block_size, free)
    if run is None:
        return 0
    times, durations, need = run
    k = len(durations)
    if k == k_finish and finish_run.applies(engine):
        # The run ends with a finish and nobody waits: go on past it in this call.
        return finish_run.run_past_finishes(
            engine, executor, running, ctx_list, held_tokens, times, durations, need
        )

    token_times = times[1:]
    done = sched.update_run(running, held_tokens, token_times)
    base = kv.used_block_count() - need[-1]
    used = [base + x for x in need]
    engine.log.extend_decode_run(times[:-1], durations, n, used)
    if engine.batches is not None:
        engine.batches.record_decode_run(times[:-1], durations, running, ctx_list, used, sched)
    policy.on_decode_run(sched, k)
    engine.end_run(done, token_times[-1])
    return k


SHORT_RUN = 32  # up to this many iterations a plain loop beats numpy's per-call overhead


def _short_run(executor, n, num_context, now, wake, k_max, ctx_list, held_tokens, block_size, free):
    """(times, durations, blocks needed per iteration) iterating in Python; None if empty."""
    if free < 0:
        return None  # the policy's reserve is already broken: the next iteration preempts
    # Iteration j needs a new block for a request at ``held - ctx + m * block_size``.
    if block_size == 1 and held_tokens == ctx_list:
        due = {0: n}  # one-token slots, none held ahead: each request takes one in every iteration
    else:
        due = {}
        for f in map(sub, held_tokens, ctx_list):
            due[f] = due.get(f, 0) + 1
    return walk_iterations(
        executor.decode_step_durations(n, num_context, k_max), now, wake, due, 0, block_size, free
    )


def walk_iterations(step_durations, now, wake, due, start, block_size, free):
    """(times, durations, blocks needed per iteration) of the iterations numbered from ``start``
    that take ``step_durations``, stopping before one that would see ``wake`` or need more than
    ``free`` new blocks; ``due`` (iteration -> requests crossing into a new block in it) is
    consumed and renewed as they go, so a caller may walk on from where this stopped
    (``finish_run.py``). None if no iteration fits."""
    if block_size == 1 and len(due) == 1 and start in due:
        return _walk_slots(step_durations, now, wake, due, start, free)
    return _walk_blocks(step_durations, now, wake, due, start, block_size, free)


def _walk_blocks(step_durations, now, wake, due, start, block_size, free):
    """``walk_iterations`` in general: the crossings moved from key to key as they come."""
    times = [now]
    durations = []
    need = []
    needed = 0
    t = now
    j = start
    if wake is None:
        wake = inf  # no finite clock reaches it: one test per iteration, not two
    for duration in step_durations:
        if t >= wake:
            break  # iteration j would see the arrival
        crossing = due.get(j, 0)
        if crossing:
            if needed + crossing > free:
                break  # iteration j would have to preempt
            del due[j]
            needed += crossing
            due[j + block_size] = due.get(j + block_size, 0) + crossing
        t_next = t + duration
        times.append(t_next)
        durations.append(t_next - t)
        need.append(needed)
        t = t_next
        j += 1
    return (times, durations, need) if durations else None


def _walk_slots(step_durations, now, wake, due, start, free):
    """``walk_iterations`` where every request takes one slot in every iteration (one-token
    slots, SGLang's, with ``due == {start: count}``: what the general walk moves from key to
    key each iteration, ~20 bytecodes an iteration, is the same count every time). The same
    stops, the same floats, and ``due`` left as the general walk leaves it."""
    count = due.pop(start)
    times = [now]
    durations = []
    need = []
    needed = 0
    t = now
    if wake is None:
        wake = inf
    for duration in step_durations:
        if t >= wake:
            break  # the next iteration would see the arrival
        if needed + count > free:
            break  # the next iteration would have to preempt
        needed += count
        t_next = t + duration
        times.append(t_next)
        durations.append(t_next - t)
        need.append(needed)
        t = t_next
    due[start + len(durations)] = count
    return (times, durations, need) if durations else None


def _long_run(executor, n, num_context, now, wake, k_max, ctx_list, held_tokens, block_size, free):
    """The same with numpy, for runs long enough to amortise it."""
    ctx = np.array(ctx_list, dtype=np.int64)
    held = np.array(held_tokens, dtype=np.int64) // block_size
    need = blocks_needed(ctx, held, block_size, k_max)
    k = k_max if need[-1] <= free else int(np.searchsorted(need, free, side="right"))
    if k < 1:
        return None
    durations = executor.decode_run_durations(n, num_context, k)
    times = np.cumsum(np.concatenate(([now], durations)))
    if wake is not None:
        k = min(k, int(np.searchsorted(times[:k], wake, side="left")))
        if k < 1:
            return None
    times = times[: k + 1]
    return times.tolist(), (times[1:] - times[:-1]).tolist(), need[:k].tolist()


# Last: ``finish_run`` walks on with this module's helpers (it imports them from here). Bound once:
# an import statement in ``advance_decode_run`` (and ``finish_run``'s of the driver) ran the
# package's ``_handle_fromlist`` in Python, ~8,500 instructions each time (1,980 times at 2,000
# Sarathi requests). Called as a module attribute, so a test may wrap it.
from tailserve.executors.simulated import finish_run  # noqa: E402
