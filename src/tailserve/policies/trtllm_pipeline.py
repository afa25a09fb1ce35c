"""TensorRT-LLM 1.2 under pipeline parallelism (``pp_size`` > 1): ``PyExecutor._executor_loop_pp``.

Read in ``tensorrt_llm/_torch/pyexecutor/py_executor.py`` (the 1.2 line: the version with
``TLLM_PP_SCHEDULER_MAX_RETRY_COUNT``). With ``pp_size`` > 1 the executor runs
``_executor_loop_pp`` whatever ``disable_overlap_scheduler`` says, and ``Engine._step_ring``
follows it:

- **``num_micro_batches = pp_size`` slots, in turn.** Each iteration fetches new requests, has the
  first rank schedule into the current slot, launches that micro-batch through the stages, then
  waits for the micro-batch of the *next* slot (the oldest in flight), finalizes it
  (``_update_requests``, ``_handle_responses``, ``update_resources``) and removes its requests
  from ``inflight_req_ids``; the slot turn moves on. A slot whose schedule is empty
  (``_can_queue``) stays empty, and an iteration whose next slot is empty waits for nothing.
- **The requests in flight are skipped**: ``schedule_request(active_requests,
  inflight_req_ids)``; the capacity scheduler sees every active request (their blocks count),
  the micro-batch scheduler passes over the ones in ``inflight_req_ids`` uncounted
  (``MicroBatchScheduler``: "Skip requests already in flight"). A context's next chunk waits
  for its previous chunk's micro-batch, as in Sarathi-Serve's engine.
- **No overlap scheduler**: each micro-batch is scheduled on its requests' known tokens.
- **Blocks stored at the return**: ``update_resources`` (``storeContextBlocks``) runs when a
  micro-batch is finalized, so the blocks it computed become reusable then, not when it is
  scheduled (``StoredAtReturn``).
- **No drafting**: "Drafting is not supported for selected executor loop. Please disable
  disagg/pipeline parallelism scheduler." (``PyExecutor.__init__``).

Newer versions (past 1.2) broadcast the sampled state asynchronously and keep
``max(pp_size, MIN_ASYNC_MICRO_BATCH_NUM)`` slots; not simulated.
"""

from __future__ import annotations

from typing import Any

from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import SchedulerOutput

PP_NO_OVERLAP = (
    "pipeline_parallel_size > 1: TensorRT-LLM runs _executor_loop_pp, micro-batches in turn without "
    "the overlap scheduler (disable_overlap_scheduler has no effect)"
)


def check_pipelined(config: Any) -> None:
    """What TensorRT-LLM's PP loop refuses, and what tailserve does not simulate under it."""
    if config.pipeline_parallel_size == 1:
        return
    if config.decoding_type is not None:
        raise ValueError(
            'speculative decoding with pipeline_parallel_size > 1: TensorRT-LLM refuses it ("Drafting is '
            'not supported for selected executor loop. Please disable disagg/pipeline parallelism scheduler.")'
        )
    if config.batch_wait_timeout_ms:
        raise ValueError("batch_wait_timeout_ms under pipeline parallelism is not simulated")


class StoredAtReturn:
    """``update_resources`` in the PP loop: a micro-batch's computed blocks are stored for reuse
    when it is finalized. Kept per batch from its schedule; stored for the requests that still
    hold KV (a finished one's were stored when it was freed, a paused one's are gone)."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending: dict[int, list[tuple[Request, int]]] = {}

    def keep(self, out: SchedulerOutput, computed: list[tuple[Request, int]]) -> None:
        if computed:
            self._pending[id(out)] = computed

    def returned(self, sched: Scheduler, out: SchedulerOutput) -> None:
        computed = self._pending.pop(id(out), None)
        if not computed:
            return
        kv = sched.kv_cache
        for request, tokens in computed:
            if kv.num_held(request.request_id) and request.num_computed_tokens >= tokens:
                sched.cache_computed(request, tokens)
