"""Exact fast path: the iterations a chunked prefill makes next to running decodes, in one step.

With Sarathi-Serve's rule (decodes first, then the prompt in progress up to the chunk size) a
long prompt P chunked beside decodes D repeats one iteration shape: every decode computes one
token, P computes ``chunk - |D|`` tokens, and the budget is full, so no waiting request can
start — nor can one that arrives meanwhile: it joins the waiting queue inside the run (below).
Until a decode's last token, P's last chunk or a KV shortage, the sequence is determined: this
module prices each iteration from integer aggregates (the same ``BatchShape`` ``SimExecutor``
builds, so the same durations), adds them to the clock in the same order as the step loop,
records the iteration log, and applies the run's tokens once. It stops *before* any iteration
where something could change, which then runs step by step (conservatively: the policy's
``decode_reserve_blocks`` of slack, so Sarathi's phase 1 "a block is free" test always holds).
The iteration in which a decode samples its last token is still one of the run's shape; a
policy that signs ``FastPaths.chunk_run_ends_at_finish`` (Sarathi) has the run end with it,
its finishes applied at its end as the step applies them, instead of stepping it.

TGI's chunking mode makes the same iterations: with no admission the router's forward feeds
every decode one token and the prompt the chunk the shard planned after the previous forward,
``max_batch_prefill_tokens - |D|``, which leaves the router's next prefill budget at 0. The
policy confirms its plan (``FastPaths.chunk_run_grants``: after a finish the planned chunk is
one token short of that, and the spare token can admit a request) and takes back its counters
(``FastPaths.on_chunk_run``). Since a request arriving then can only wait or be rejected
(``FastPaths.chunk_run_takes_arrivals``; Sarathi signs it too), a run adds arrivals at the start
of the full-chunk iteration the step would add them to, instead of stopping there; once someone
waits, the last chunk (which leaves budget over) stays out of the run. The prompt is found from
the end of the running batch and its own bound on the run checked before the decodes are
scanned, so a refused run costs little. ``tests/test_speed_paths.py`` checks results identical
to plain stepping for both.
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING

from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.fast_paths import FastPaths

if TYPE_CHECKING:
    from tailserve.core.engine import Engine

MAX_RUN = 4096  # iterations per call
_arrival = attrgetter("arrival_time")


def applies_to(executor: object) -> bool:
    """Only ``SimExecutor`` itself (a subclass or wrapper may price iterations differently),
    pricing batch shapes alone (no sliding-window model)."""
    return type(executor) is SimExecutor and executor.prices_shapes_alone


def advance_chunk_run(engine: Engine) -> int:
    """Advance through the determined chunk-beside-decodes iterations; returns how many (0
    when the next iteration must be stepped normally)."""
    sched = engine.scheduler
    # Annotated, not ``typing.cast``: that is a Python call (~450 instructions) per run.
    policy: FastPaths = sched.policy  # type: ignore[assignment]  # the driver checked
    budget = policy.chunk_run_budget()
    kv = sched.kv_cache
    running = sched.running
    if budget is None or kv.prefix_caching or sched.swapped or len(running) < 2:
        return 0
    if not policy.chunk_run_ready(sched):
        return 0
    # The O(1) refusals before the scan of the running batch: after most steps that end a run
    # an arrival is due (a policy that takes arrivals inside a run decides once it knows the
    # prompt, below) or the policy wants to act now.
    now = engine.clock.now
    source = engine.source
    arrival = source.next_arrival_time()
    arrival_due = arrival is not None and arrival <= now
    if arrival_due and not policy.chunk_run_takes_arrivals:
        return 0
    policy_wake = sched.next_wakeup(now)
    if policy_wake is not None and policy_wake <= now:
        return 0
    # The run's shape: one prompt in progress, every other running request one token behind.
    # The prompt is found from the end (the newest request, as a rule) and its own bound on
    # the run checked before the decodes are scanned: a run that its prompt alone refuses
    # costs no pass over the batch.
    prompt = None
    back = 0  # the prompt's place from the end
    for r in reversed(running):
        back += 1
        missing = r.prompt_len + r.num_output_tokens - r.num_computed_tokens
        if missing > 1:
            prompt = r
            break
        if missing != 1:
            return 0
    if prompt is None:
        return 0
    n = len(running) - 1  # the decodes, if the scan below confirms them
    q = budget - n  # the prompt's chunk in every iteration of the run
    block_size = kv.block_size
    tables = kv.block_tables
    p_table = tables.get(prompt.request_id)
    # The prompt's tokens still to compute: ``missing`` from the scan (``Request.num_tokens``, a
    # property, costs a call through C, ~900 instructions, each time it is read).
    remaining = missing
    if q < 2 or p_table is None or len(p_table) * block_size < prompt.num_computed_tokens + remaining:
        return 0  # (q == 1 would count as a decode; the prompt's blocks are allocated whole)
    # ``min`` spelled out here and below (the builtin parses its arguments as keywords, ~1,000
    # instructions a call): a few per call, ahead of the run's refusals.
    if not policy.chunk_run_grants(sched, prompt, q if q < remaining else remaining):
        return 0  # e.g. TGI's chunk planned before a request finished: this one steps
    # Iteration j is in the run while the prompt still has more than one chunk left after it
    # starts, and no decode produces its last token in it. The last chunk leaves budget over,
    # so it is in the run only when no request waits (none can then be admitted beside it) and
    # the token it samples is not the prompt's last.
    k_full = (remaining - q - 1) // q + 1 if remaining > q else 0
    last = remaining - k_full * q
    with_last = not sched.waiting and last >= 2 and prompt.max_tokens - prompt.num_output_tokens > 1
    k_max = k_full + with_last
    if k_max > MAX_RUN:
        k_max = MAX_RUN
    if k_max < 1:
        return 0
    # A policy whose full-chunk iterations leave no room for anyone else (TGI: no prefill budget)
    # takes arrivals inside the run, at the start of the iteration the step would add them to;
    # with an arrival due and no full chunk left the run would stop at once: refused before
    # the scan (a quarter of the scans Sarathi's runs made ended in a refusal).
    takes_arrivals = policy.chunk_run_takes_arrivals and k_full > 0
    if arrival_due and not takes_arrivals:
        return 0
    # One pass over the decodes (nothing below changes a table before the run is applied):
    # their bound on the run, the slots each holds, and when each crosses into a new block,
    # decode d computing token ctx + j in iteration j, so crossing at j = slots - ctx, then
    # every block_size iterations.
    decodes = running.copy()  # the batch less the prompt, cut in C
    del decodes[len(running) - back]
    held = []  # KV slots each decode holds
    due: dict[int, int] = {}
    decode_kv = n  # sum of (context + 1) over decodes
    # A decode produces its last token in iteration ``left - 1``: with ``chunk_run_ends_at_finish``
    # the run ends with that iteration (it is decided as the step would: the same shape, the
    # finish applied at its end), else stops before it. The scan keeps the bound on ``left``
    # (``k_max + at_finish``), so the per-decode test is one comparison either way.
    at_finish = 0 if policy.chunk_run_ends_at_finish else 1
    bound = k_max + at_finish
    for r in decodes:
        outputs = r.num_output_tokens
        c = r.num_computed_tokens
        if r.prompt_len + outputs - c != 1:
            return 0  # a second prompt in progress
        left = r.max_tokens - outputs
        if left < bound:
            bound = left
            if bound <= at_finish:
                return 0  # no iteration before a decode's last (``at_finish``): no need to scan the rest
        decode_kv += c
        slots = len(tables[r.request_id]) * block_size
        held.append(slots)
        first = slots - c
        # Only crossings inside the run are walked (the bound only shrinks from here; one
        # past the run's end is kept when the run stops before a finish, and never read): a
        # run is a few iterations as a rule, so most decodes cross no block in it.
        if first < bound:
            due[first] = due.get(first, 0) + 1
    k_max = bound - at_finish
    # A cluster replica's source reports the cluster's next event (``horizon``) as its next
    # arrival: the run must stop there, before the router acts, exactly as the step loop does.
    horizon = source.horizon
    # Sarathi keeps one free (phase 1 preempts when none is); TGI reserved every block up front.
    free = kv.free_block_count() - policy.decode_reserve_blocks
    if free < 0:
        return 0
    executor: SimExecutor = engine.executor  # type: ignore[assignment]  # the driver checked ``applies_to``
    shape_time = executor.cost_model.shape_time
    c_p = prompt.num_computed_tokens
    q_pairs = q * (q + 1) // 2
    num_tokens = n + q
    needed = 0
    used0 = kv.used_block_count()
    t = now
    times: list[float] = []  # end of each iteration
    starts: list[float] = []
    used: list[int] = []
    j = 0
    while j < k_max:
        if policy_wake is not None and t >= policy_wake:
            break
        crossing = due.get(j, 0)
        if crossing and needed + crossing > free:
            break
        if arrival is not None and t >= arrival:
            if not takes_arrivals or j >= k_full or (horizon is not None and t >= horizon):
                break  # iteration j would add the arrival first
            engine.add_arrivals(t)
            arrival = source.next_arrival_time()
            if sched.waiting:
                k_max = min(k_max, k_full)  # the last chunk leaves budget: one could join it
        if crossing:
            del due[j]
            needed += crossing
            due[j + block_size] = due.get(j + block_size, 0) + crossing
        # ``BatchShape``'s fields, priced without building one (``CostModel.shape_time``).
        if j == k_full:  # the prompt's last chunk: it samples its first token
            duration = shape_time(
                n + last, n + 1, last * c_p + last * (last + 1) // 2, last + c_p, decode_kv, 1, n
            )
        else:
            duration = shape_time(num_tokens, n, q * c_p + q_pairs, q + c_p, decode_kv, 1, n)
        starts.append(t)
        used.append(used0 + needed)
        t = t + duration
        times.append(t)
        c_p += q
        decode_kv += n
        j += 1
    k = len(times)
    if k == 0:
        return 0
    log = engine.log
    for i, (start, end, blocks) in enumerate(zip(starts, times, used)):
        log.record(start, end - start, q if i < k_full else last, n, n + 1, blocks, 0)
    chunk = k_full * q + last if k > k_full else k * q  # the last chunk samples the first token
    done = sched.update_run(decodes, held, times, prompt, chunk)
    if done:
        # Only decodes, only in the run's last iteration (``chunk_run_ends_at_finish``; the
        # prompt's last chunk is in the run only when its first token is not its last). The
        # step applies its decodes in arrival order (Sarathi sorts the batch each iteration;
        # the sort is stable, as this one): the finishes, and what hangs on them, keep it.
        assert at_finish == 0 and prompt not in done, "the run ends at a decode's finish only"
        if len(done) > 1:
            done.sort(key=_arrival)
    policy.on_chunk_run(sched, prompt, k)
    engine.end_run(done, t)
    if k > k_full:
        # The prompt's last chunk ran: it sampled its first token (not its last: ``with_last``),
        # every decode one token, so each request left is one token behind at ``t``, as
        # ``Scheduler.update`` notes after a step (the driver's ``steady`` then skips its scan).
        sched.one_behind_at = t
    return k
