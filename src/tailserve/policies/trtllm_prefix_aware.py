"""TensorRT-LLM 1.3's prefix-aware token budget (``scheduler_config.enable_prefix_aware_scheduling``):
the micro-batch scheduler charges a context at its first chunk only the prompt tokens its cached
prefix does not cover. Opt-in here: tailserve follows TensorRT-LLM 1.2.1 (which has no such
option and charges every scheduled token); the engine's default is True from 1.3 on.

Where it comes from, in the stored NVIDIA/TensorRT-LLM repository:

- The option: ``tensorrt_llm/llmapi/llm_args.py@0004396`` ``SchedulerConfig.
  enable_prefix_aware_scheduling`` (default True: "Use KV prefix-reuse estimates for scheduler
  admission, duplicate-request deferral, and token-budget decisions"); ``_util.py@0004396``
  ``create_py_executor_instance`` hands it to ``BindCapacityScheduler`` on the default path (C++
  ``SimpleScheduler``; also to the Python ``SimpleUnifiedScheduler`` and ``KVCacheV2Scheduler``).
  ``docs/source/features/kvcache.md``: when False "reusable-token estimates remain zero".
- The estimate: set on each context the capacity scheduler looks at (``LlmRequest::
  setEstimatedReusableTokens`` from ``kvCacheManager.cpp`` ``getNeededBlocksOneStep`` /
  ``getRemainingBlocksToCompletion``, TensorRT-LLM PR #11637, commit 313e274e): the tokens of the
  cached blocks of its prompt found in the reuse tree (``cpp/tests/unit_tests/batch_manager/
  microBatchSchedulerTest.cpp`` ``CapacitySchedulerSetsReusableTokensForMicroBatch``: two stored
  blocks of 10, an estimate of 20). Here: ``KVCacheManager.num_reusable_tokens`` — the GPU
  blocks, then the host pool's, capped as the match at ``addSequence`` is (one token left to
  compute, whole blocks), so the credit equals what the step then skips.
- The charge: ``cpp/tensorrt_llm/batch_manager/microBatchScheduler.cpp`` (a stored version with
  ``getEstimatedReusableTokens``; the store names no commit for it), ``operator()`` and
  ``setCtxRequestsChunkSize``. Only a first chunk is credited (``isFirstContextChunk``): without
  chunking a context costs ``max(1, tokens - reusable)``, and that is what must stay within
  ``max_num_tokens`` (the engine's ``Context compute tokens exceeds the limit`` check); with
  chunking its remaining length less the reusable ones (at least 0) is set aside, and the
  chunkers below share the budget left by compute, not by chunk size.

Not modelled (not established from the stored source): what the flag changes in the capacity
scheduler's admission (C++ ``CapacityScheduler`` with the flag is not in the store) and whether
False turns off the duplicate-context deferral (``beneficialToSkip``, which 1.2.1 applies
always; it stays on here either way).
"""

from __future__ import annotations

from collections.abc import Callable

from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler

Reusable = Callable[[Request], int]


def reusable_tokens(sched: Scheduler) -> Reusable:
    """The estimate of each context the micro-batch scheduler walks: its reusable prompt tokens
    at its first chunk (it holds no KV yet), 0 past it."""
    kv = sched.kv_cache

    def reusable(request: Request) -> int:
        if kv.num_held(request.request_id):
            return 0  # not the first chunk: its prefix was matched when that chunk ran
        return kv.num_reusable_tokens(request.request_id, request.num_tokens)

    return reusable


def compute_tokens(remaining: int, reusable: int, chunked: bool) -> int:
    """``operator()``'s cost of a context set to run whole: ``max(1, tokens - reusable)``
    without chunking ("at least 1 to make progress"), ``max(0, chunk - reusable)`` with it."""
    return max(1 if not chunked else 0, remaining - reusable)


def first_come_first_served(
    remaining: list[int], reusable: list[int], capacity: int, unit: int, max_context: int
) -> list[int]:
    """``setCtxRequestsChunkSize<FIRST_COME_FIRST_SERVED>``, compute-aware: in order, a context
    whose uncached tokens pass what the budget leaves gets a chunk of that budget (not reusable +
    budget: the model computes the chunk from past the prefix, ``setPrepopulatedPromptLen``);
    one whose uncached tokens pass ``max_context`` gets ``reusable + max_context`` (never here:
    ``max_context`` is ``max_num_tokens``, the budget no more); a trimmed chunk is rounded down
    to ``unit``; the budget loses ``min(chunk, uncached tokens)``."""
    chunks = []
    for left, reuse in zip(remaining, reusable):
        reuse = min(reuse, left)
        size = left
        if left - reuse > capacity:
            size = capacity
        if max(size - reuse, 0) > max_context:
            size = min(reuse + max_context, left)
        if size != left:
            size = size // unit * unit
        chunks.append(size)
        capacity -= min(size, max(left - reuse, 0))
    return chunks


def equal_progress(
    remaining: list[int], reusable: list[int], capacity: int, unit: int, max_context: int
) -> list[int]:
    """``setCtxRequestsChunkSize<EQUAL_PROGRESS>``, compute-aware: round after round each chunk
    grows by ``unit`` (or to all it has left); the budget counts only the growth past the
    reusable tokens, the chunk itself stays within ``max_context``; a round that grows no chunk
    ends it (counted in raw tokens, so a chunk growing inside the prefix is progress). The
    engine's code counts a chunk from the prompt's start here, unlike FIRST_COME_FIRST_SERVED's:
    a chunk within the reusable tokens is charged nothing, though the model computes it past
    the prefix; followed as written."""
    chunks = [0] * len(remaining)
    reuse = [min(r, left) for r, left in zip(reusable, remaining)]
    total = 0
    added = 1
    while total < capacity and added:
        added = 0
        for i, left in enumerate(remaining):
            past = chunks[i]
            size = min(past + unit, left)
            compute = max(size - reuse[i], 0) - max(past - reuse[i], 0)
            if total + compute > capacity or size > max_context:
                continue
            chunks[i] = size
            total += compute
            added += size - past
    return chunks
