"""TensorRT-LLM's micro-batch scheduler: which fitting requests run this step, with how many tokens.

Source: ``cpp/tensorrt_llm/batch_manager/microBatchScheduler.cpp`` (the default, through
``BindMicroBatchScheduler(max_batch_size, max_num_tokens, ctx_chunk_config)``) and its Python
mirror ``PyMicroBatchScheduler`` in ``tensorrt_llm/_torch/pyexecutor/scheduler/scheduler.py``
(stored commit 5f480b7a): ``schedule``, ``_set_ctx_requests_chunk_size``,
``_chunk_equal_progress``, ``_chunk_fcfs``, ``_sort_requests``. ``max_context_length`` is
``max_num_tokens`` there (the C++ constructor's second argument). The chunk unit is
``tokens_per_block`` (``py_executor_creator.py``: ``chunk_unit_size = tokens_per_block``, 256 only
with sliding-window attention, which tailserve does not model).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tailserve.core.request import Request
from tailserve.policies import trtllm_prefix_aware as prefix_aware
from tailserve.policies.trtllm_capacity import Fitting, IsGeneration
from tailserve.policies.trtllm_config import EQUAL_PROGRESS


@dataclass(slots=True)
class MicroBatch:
    contexts: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk) in order
    generations: list[Request] = field(default_factory=list)
    # Contexts longer than max_num_tokens without chunking: the engine's assertion
    # "Context tokens (N) exceeds limit (M)" (only a paused request's grown prompt can be).
    too_long: list[Request] = field(default_factory=list)


def micro_batch(
    fitting: Iterable[Request],
    is_generation: IsGeneration,
    max_batch_size: int,
    max_num_tokens: int,
    chunking_policy: str | None,
    chunk_unit: int,
    generation_tokens: int = 1,
    skips: Callable[[Request], bool] | None = None,
    reusable: prefix_aware.Reusable | None = None,
) -> MicroBatch:
    """The rules, in the source's order:

    1. Walk the fitting requests in the capacity scheduler's order (an iterator: GUARANTEED_NO_EVICT
       computes only what this walk asks for). A generation request costs
       ``generation_tokens`` (``beam_width + num_draft_tokens``: 1 + its drafts); if it would
       pass ``max_num_tokens`` the walk ends. A context without chunking
       costs its whole remaining context (a first chunk: all its tokens, cached ones included —
       the prefix match comes after scheduling); if it would pass the budget the walk ends.
       With chunking a context is set aside with its remaining length (capped at
       ``max_num_tokens``, which marks "not all fit") and costs nothing yet. Every request
       walked counts toward ``max_batch_size``; reaching it ends the walk. A request ``skips``
       says yes to is passed over uncounted (the overlap scheduler's ``GENERATION_TO_COMPLETE``:
       ``no_schedule_after_state``, which only this scheduler has).
    2. If the contexts set aside need more than the budget left, they are chunked
       (``chunking_policy``) into what is left; a context whose chunk is 0 does not run.
    3. When contexts were chunked, those not on their last chunk go first (``sortRequests``).

    ``reusable`` (``enable_prefix_aware_scheduling``, TensorRT-LLM 1.3: ``trtllm_prefix_aware.py``):
    a context at its first chunk is charged only the tokens its estimated reusable prefix does
    not cover, in step 1 and in the chunkers. None: every scheduled token is charged (1.2.1).

    GUARANTEED_NO_EVICT's generation requests come first, as a list (``Fitting``): step 1 over
    them is arithmetic. From an empty batch each costs ``generation_tokens`` and counts one, so
    the walk takes the first ``min(len, max_num_tokens // generation_tokens, max_batch_size)`` of
    those ``skips`` passes, and it has ended if that leaves one out or reaches
    ``max_batch_size``; otherwise it goes on to the contexts.
    """
    out = MicroBatch()
    batch_tokens = 0
    walked = 0
    if isinstance(fitting, Fitting):
        generations = fitting.generations
        if skips is not None:
            generations = [request for request in generations if not skips(request)]
        walked = min(len(generations), max_num_tokens // generation_tokens, max_batch_size)
        out.generations = generations[:walked]
        batch_tokens = walked * generation_tokens
        if walked < len(generations) or walked >= max_batch_size:
            return out  # the walk ended among them: no context walked, none to chunk
        fitting = fitting.contexts
    if reusable is not None:
        return _micro_batch_reusing(
            out, fitting, is_generation, max_batch_size, max_num_tokens, chunking_policy, chunk_unit,
            generation_tokens, skips, reusable, batch_tokens, walked,
        )  # fmt: skip
    to_chunk: list[Request] = []
    chunked_tokens = 0
    all_fit = True
    for request in fitting:
        if skips is not None and skips(request):
            continue
        if is_generation(request):
            if batch_tokens + generation_tokens > max_num_tokens:
                break
            out.generations.append(request)
            batch_tokens += generation_tokens
        else:
            remaining = request.num_tokens - request.num_computed_tokens
            if chunking_policy is None:
                if remaining > max_num_tokens:
                    out.too_long.append(request)
                    continue
                if batch_tokens + remaining > max_num_tokens:
                    break
                out.contexts.append((request, remaining))
                batch_tokens += remaining
            else:
                if remaining > max_num_tokens:
                    remaining = max_num_tokens
                    all_fit = False
                to_chunk.append(request)
                chunked_tokens += remaining
        walked += 1
        if walked >= max_batch_size:
            break
    if chunked_tokens > max_num_tokens - batch_tokens:
        all_fit = False
    if not to_chunk:
        return out
    remaining_of = [r.num_tokens - r.num_computed_tokens for r in to_chunk]
    if all_fit:
        chunks = remaining_of
    else:
        capacity = max_num_tokens - batch_tokens
        chunker = equal_progress if chunking_policy == EQUAL_PROGRESS else first_come_first_served
        chunks = chunker(remaining_of, capacity, chunk_unit, max_num_tokens)
    out.contexts = _chunked_contexts(to_chunk, chunks, all_fit)
    return out


def _chunked_contexts(to_chunk: list[Request], chunks: list[int], all_fit: bool) -> list[tuple[Request, int]]:
    """The chunked contexts with their chunks (none of 0 tokens); when not all fit, those that
    will not finish their prompt this step first, then the last chunks."""
    contexts = [(r, c) for r, c in zip(to_chunk, chunks) if c > 0]
    if not all_fit:
        last = {id(r) for r, c in contexts if c == r.num_tokens - r.num_computed_tokens}
        contexts = [x for x in contexts if id(x[0]) not in last] + [x for x in contexts if id(x[0]) in last]
    return contexts


def _micro_batch_reusing(
    out: MicroBatch,
    fitting: Iterable[Request],
    is_generation: IsGeneration,
    max_batch_size: int,
    max_num_tokens: int,
    chunking_policy: str | None,
    chunk_unit: int,
    generation_tokens: int,
    skips: Callable[[Request], bool] | None,
    reusable: prefix_aware.Reusable,
    batch_tokens: int,
    walked: int,
) -> MicroBatch:
    """``micro_batch``'s walk from its contexts on, compute-aware (``microBatchScheduler.cpp``
    with ``getEstimatedReusableTokens``): a context's cost is ``compute_tokens``, its first
    chunk credited its estimate; the chunkers share the budget by compute
    (``trtllm_prefix_aware.py``). Kept apart so the walk without the credit stays as it was."""
    chunked = chunking_policy is not None
    to_chunk: list[Request] = []
    credit: list[int] = []
    chunked_tokens = 0
    all_fit = True
    for request in fitting:
        if skips is not None and skips(request):
            continue
        if is_generation(request):
            if batch_tokens + generation_tokens > max_num_tokens:
                break
            out.generations.append(request)
            batch_tokens += generation_tokens
        else:
            remaining = request.num_tokens - request.num_computed_tokens
            reuse = reusable(request)
            cost = prefix_aware.compute_tokens(remaining, reuse, chunked)
            if not chunked:
                if cost > max_num_tokens:
                    out.too_long.append(request)
                    continue
                if batch_tokens + cost > max_num_tokens:
                    break
                out.contexts.append((request, remaining))
                batch_tokens += cost
            else:
                if cost > max_num_tokens:
                    cost = max_num_tokens
                    all_fit = False
                to_chunk.append(request)
                credit.append(reuse)
                chunked_tokens += cost
        walked += 1
        if walked >= max_batch_size:
            break
    if chunked_tokens > max_num_tokens - batch_tokens:
        all_fit = False
    if not to_chunk:
        return out
    remaining_of = [r.num_tokens - r.num_computed_tokens for r in to_chunk]
    if all_fit:
        chunks = remaining_of
    else:
        capacity = max_num_tokens - batch_tokens
        chunker = (
            prefix_aware.equal_progress
            if chunking_policy == EQUAL_PROGRESS
            else prefix_aware.first_come_first_served
        )
        chunks = chunker(remaining_of, credit, capacity, chunk_unit, max_num_tokens)
    out.contexts = _chunked_contexts(to_chunk, chunks, all_fit)
    return out


def first_come_first_served(remaining: list[int], capacity: int, unit: int, max_context: int) -> list[int]:
    """``setCtxRequestsChunkSize<FIRST_COME_FIRST_SERVED>``: in order, each context takes all it
    has left, or what the budget (and ``max_context``) leaves rounded down to ``unit``."""
    chunks = []
    for left in remaining:
        size = min(left, capacity, max_context)
        if size < left:
            size = size // unit * unit
        chunks.append(size)
        capacity -= size
    return chunks


def equal_progress(remaining: list[int], capacity: int, unit: int, max_context: int) -> list[int]:
    """``setCtxRequestsChunkSize<EQUAL_PROGRESS>``: round after round, every context grows its
    chunk by ``unit`` (or to all it has left) while the total stays within the budget and the
    chunk within ``max_context``; a round that adds nothing ends it."""
    chunks = [0] * len(remaining)
    total = 0
    added = 1
    while total < capacity and added:
        added = 0
        for i, left in enumerate(remaining):
            size = min(chunks[i] + unit, left)
            step = size - chunks[i]
            if total + step > capacity or size > max_context:
                continue
            chunks[i] = size
            total += step
            added += step
    return chunks
