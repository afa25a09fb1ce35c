"""SGLang's waiting-queue orders by prefill work (0.5.23, ``managers/schedule_policy.py``):
``hrrn`` (highest response ratio next, aged in prefill tokens) and ``shortest-prefill-first``
(with its cap on the continuing chunk), and the scheduler's counter that HRRN ages by.

Apart from ``sglang_priority.py`` (the dispatch of ``calc_priority`` and the older orders) to keep
both small. Both orders are cache-aware: ``calc_priority`` hands them each waiting request's
radix match of this pass (``num_matched_prefix_tokens``: the whole prompt + outputs so far
matched, capped one token short) and the requests its in-batch dedup sends to the back
(``temporary_deprioritized``). Checked against SGLang's own sorters by ``validate/sglang_order.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tailserve.core.request import Request
from tailserve.policies.sglang_adder import queued_at

INF = float("inf")


class ProcessedTokens:
    """SGLang's ``processed_tokens_counter`` and each waiting request's snapshot of it.

    The counter grows by every batch's ``extend_num_tokens`` when the batch is launched
    (``Scheduler.run_batch``): a prefill batch's new tokens, plus one per decode riding along in
    a mixed batch; a decode batch adds nothing. A request snapshots it
    (``arrival_processed_tokens``) each time it enters the waiting queue
    (``_add_request_to_queue``: on arrival, after a retraction, after a priority preemption); a
    request never stamped counts from 0, as SGLang's ``Req`` does."""

    def __init__(self) -> None:
        self.count = 0
        self.snapshot: dict[str, int] = {}

    def add(self, num_tokens: int) -> None:
        self.count += num_tokens

    def stamp(self, request: Request) -> None:
        self.snapshot[request.request_id] = self.count

    def forget(self, request: Request) -> None:
        self.snapshot.pop(request.request_id, None)

    def waited(self, request: Request) -> int:
        """Prefill tokens processed since the request (last) entered the queue."""
        return max(0, self.count - self.snapshot.get(request.request_id, 0))


def hrrn_order(
    waiting: Iterable[Request],
    matched: Mapping[str, int],
    deprioritized: set[str],
    processed: ProcessedTokens,
) -> list[Request]:
    """``_sort_by_hrrn``: descending (tokens waited) / (uncached prompt tokens), ties by request
    id (a total order: queue position never matters). Uncached counts the prompt only, not the
    outputs of a retracted request, so one whose match covers its prompt has nothing to prefill
    in SGLang's eyes and goes first; the in-batch deprioritized go last."""

    def key(request: Request) -> tuple[float, str]:
        rid = request.request_id
        if rid in deprioritized:
            return (INF, rid)
        uncached = max(0, request.prompt_len - matched.get(rid, 0))
        if uncached <= 0:
            return (-INF, rid)
        return (-(processed.waited(request) / uncached), rid)

    return sorted(waiting, key=key)


def prefill_work(request: Request, matched: Mapping[str, int]) -> int:
    """``_shortest_prefill_work``: tokens still to prefill (prompt + outputs - match), at least 1."""
    return max(1, request.num_tokens - matched.get(request.request_id, 0))


def shortest_prefill_order(
    waiting: Iterable[Request], matched: Mapping[str, int], deprioritized: set[str]
) -> list[Request]:
    """``_sort_by_shortest_prefill``: the in-batch deprioritized last, then least prefill work,
    then earliest (re)queueing; a stable sort, so full ties keep queue order."""
    return sorted(
        waiting,
        key=lambda r: (r.request_id in deprioritized, prefill_work(r, matched), queued_at(r)),
    )


def shortest_prefill_chunk_limit(
    remaining: int, waiting: Iterable[Request], matched: Mapping[str, int], budget: int, page_size: int
) -> int | None:
    """``SchedulePolicy.shortest_prefill_chunk_limit``: cap the continuing chunk (``remaining``
    tokens still to prefill) so the chunk budget keeps room for the waiting requests, in queue
    order, that are shorter than its rest, each charged its work in whole pages, one page always
    left over. None (no cap) when the budget is under two pages or nobody fits."""
    if budget < 2 * page_size:
        return None
    reserved = 0
    for request in waiting:
        work = prefill_work(request, matched)
        charge = -(-work // page_size) * page_size
        if work >= remaining or reserved + charge > budget - page_size:
            break
        reserved += charge
    if not reserved:
        return None
    return (budget - reserved) // page_size * page_size  # page-aligned: the chunk ends on a page
