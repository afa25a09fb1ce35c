"""Exact fast path: a run of identical decode-only iterations simulated in one step.

Between events (an arrival, a finish, a KV shortage) a continuous-batching engine repeats the
same decode iteration: the same requests, one token each, their contexts growing by one. The
iteration times come from the cost model vectorised over the run, the clock is their running
sum (``np.cumsum`` adds in the same order as the step loop), and the run stops *before* the
first iteration in which anything could change, which then runs step by step. Results are
identical to plain stepping; ``tests/test_decode_run.py`` checks that.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tailserve.core.engine import Engine

MAX_RUN = 512  # iterations per call; bounds the (requests x iterations) block arithmetic


def _blocks_needed(
    ctx: np.ndarray, held: np.ndarray, block_size: int, steps: np.ndarray
) -> np.ndarray:
    """New blocks all requests need in iteration j of the run (for each j in ``steps``).

    In iteration j a request with ``ctx`` computed tokens computes token ``ctx + j`` and must
    hold blocks for ``ctx + j + 1`` tokens.
    """
    total = (ctx[:, None] + steps[None, :] + block_size) // block_size - held[:, None]
    return np.maximum(total, 0).sum(axis=0)


def advance_decode_run(engine: Engine) -> int:
    """Advance the engine through as many uneventful decode iterations as possible.

    Precondition: ``engine._steady()``. Returns the number of iterations advanced (0 if the
    very next iteration is eventful and must be stepped normally).
    """
    sched = engine.scheduler
    kv = sched.kv_cache
    running = sched.running
    n = len(running)

    # The iteration that produces some request's last token runs normally (it finishes it).
    k_max = min(r.max_tokens - r.num_output_tokens for r in running) - 1
    if k_max < 1:
        return 0
    k_max = min(k_max, MAX_RUN)

    ctx = np.fromiter((r.num_computed_tokens for r in running), dtype=np.int64, count=n)
    held = np.fromiter((kv.num_held(r.request_id) for r in running), dtype=np.int64, count=n)
    steps = np.arange(k_max, dtype=np.int64)
    need = _blocks_needed(ctx, held, kv.block_size, steps)
    # Iteration j runs without preemption only if its blocks fit what is free now.
    k = int(np.searchsorted(need, kv.num_free_blocks, side="right"))
    if k < 1:
        return 0

    durations = engine.executor.decode_run_durations(n, int(ctx.sum()) + n, k)  # type: ignore[attr-defined]
    times = np.cumsum(np.concatenate(([engine.clock.now], durations)))
    wake = [
        t
        for t in (
            engine.source.next_arrival_time(),
            sched.policy.next_wakeup(sched, engine.clock.now),
        )
        if t is not None
    ]
    if wake:
        # Iteration j sees an arrival at time t if t <= its start time.
        k = min(k, int(np.searchsorted(times[:k], min(wake), side="left")))
        if k < 1:
            return 0

    token_times = times[1 : k + 1].tolist()
    for request in running:
        request.num_computed_tokens += k
        request.num_output_tokens += k
        request.token_times.extend(token_times)
        kv.allocate(request.request_id, request.num_computed_tokens)
    engine.log.extend_decode_run(
        times[:k].tolist(),
        (times[1 : k + 1] - times[:k]).tolist(),
        n,
        (need[:k] + (kv.num_used_blocks - int(need[k - 1]))).tolist(),
    )
    engine.clock.now = token_times[-1]
    return k
