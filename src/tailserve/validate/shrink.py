"""Shrink a divergent workload to a small one that still diverges (greedy delta debugging).

``diverges(workload)`` is the oracle (both schedulers run, the traces compared). Each pass tries
simpler variants — fewer requests, shorter prompts and outputs, no aborts, equal priorities,
earlier arrivals, plainer flags — and keeps any that still diverges, until a pass changes
nothing or the oracle budget is spent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

from tailserve.validate.workload import RequestSpec, Workload


def _valid(make: Callable[[], Workload]) -> Workload | None:
    try:
        return make()
    except ValueError:  # a variant the workload rules forbid (e.g. no longer fits the KV)
        return None


def _with_requests(w: Workload, requests: list[RequestSpec]) -> Workload | None:
    return _valid(lambda: replace(w, requests=requests)) if requests else None


def _variants(w: Workload) -> Iterator[Workload]:
    reqs = w.requests
    # Fewer requests: halves first, then one at a time.
    if len(reqs) > 1:
        half = len(reqs) // 2
        for part in (reqs[:half], reqs[half:]):
            v = _with_requests(w, part)
            if v is not None:
                yield v
        for i in range(len(reqs)):
            v = _with_requests(w, reqs[:i] + reqs[i + 1 :])
            if v is not None:
                yield v
    for i, r in enumerate(reqs):
        changes: list[RequestSpec] = []
        n = len(r.prompt_token_ids)
        for cut in (n // 2, n // 4, 8, 1):  # drop the prompt's tail: keeps shared prefixes shared
            if 0 < cut < n:
                changes.append(replace(r, prompt_token_ids=r.prompt_token_ids[: n - cut]))
        m = len(r.output_token_ids)
        for keep in (1, m // 2, m - 1):
            if 0 < keep < m:
                changes.append(replace(r, output_token_ids=r.output_token_ids[:keep]))
        if r.abort_step is not None:
            changes.append(replace(r, abort_step=None))
        if r.priority:
            changes.append(replace(r, priority=0))
        if r.arrival_step and (i == 0 or reqs[i - 1].arrival_step < r.arrival_step):
            prev = reqs[i - 1].arrival_step if i else 0
            if r.abort_step is None or r.abort_step > prev:
                changes.append(replace(r, arrival_step=prev))
        for c in changes:
            v = _with_requests(w, [*reqs[:i], c, *reqs[i + 1 :]])
            if v is not None:
                yield v
    s = w.scheduler
    flags = [
        dict(long_prefill_token_threshold=0),
        dict(scheduling_policy="fcfs"),
        dict(enable_prefix_caching=False),
        dict(num_blocks=s.num_blocks * 2),
        dict(max_num_seqs=min(s.max_num_batched_tokens, 64)),
        dict(max_num_batched_tokens=8192),
    ]
    if s.num_host_blocks > 1:  # a smaller CPU offloading tier
        flags.append(dict(num_host_blocks=s.num_host_blocks // 2))
    for changes in flags:
        f = _valid(lambda changes=changes: replace(s, **changes))  # type: ignore[arg-type]
        if f is not None and f != s:
            v = _valid(lambda f=f: replace(w, scheduler=f))
            if v is not None:
                yield v


def size(w: Workload) -> tuple[int, int]:
    """How big a workload is: requests, then tokens."""
    tokens = sum(len(r.prompt_token_ids) + len(r.output_token_ids) for r in w.requests)
    return len(w.requests), tokens


def shrink(w: Workload, diverges: Callable[[Workload], bool], max_tries: int = 2000) -> Workload:
    """A workload no bigger than ``w`` that still diverges (``w`` itself must diverge)."""
    tries = 0
    changed = True
    while changed and tries < max_tries:
        changed = False
        for v in _variants(w):
            tries += 1
            if diverges(v):
                w = v
                changed = True
                break
            if tries >= max_tries:
                break
    return w
