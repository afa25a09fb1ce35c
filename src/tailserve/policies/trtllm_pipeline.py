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
- **``max_num_sequences = max_batch_size x pp_size``** (``_util.py``): the capacity scheduler's
  limit and the active requests' (``get_max_num_sequences``); ``max_batch_size`` bounds each
  micro-batch (the micro-batch scheduler's).
- **Generations and last context chunks in flight are skipped**: ``schedule_request(
  active_requests, inflight_req_ids)``; the capacity scheduler sees every active request, the
  micro-batch scheduler passes over the ones in ``inflight_req_ids`` uncounted. A context's
  non-final chunk is not added there (``_add_inflight_ids``: "so the scheduler can keep
  scheduling further context chunks while earlier ones are in the PP pipeline") and its state
  moves to the next chunk at launch (``_update_request_states``): the next chunk goes into the
  next micro-batch, as in vLLM. Hence the scheduler's own accounting (computed tokens advance at
  scheduling, ``Scheduler.advance_scheduled``), without placeholders: no overlap scheduler.
- **Blocks stored at the return, of generations and last chunks**: ``update_resources`` runs on
  the finalized micro-batch with its context requests replaced by ``finished_ctx_reqs``
  (``Scheduler.update_advanced`` stores the known tokens' blocks then).
- **No pause**: ``_executor_loop_pp`` never calls ``_pause_requests`` / ``_terminate_requests``
  for the capacity scheduler's paused requests, so MAX_UTILIZATION's pauses would keep their
  blocks; refused here (and with it ``two_step_lookahead``, which only MAX_UTILIZATION reads).
- **No drafting**: "Drafting is not supported for selected executor loop. Please disable
  disagg/pipeline parallelism scheduler." (``PyExecutor.__init__``).

Newer versions (past 1.2) broadcast the sampled state asynchronously and keep
``max(pp_size, MIN_ASYNC_MICRO_BATCH_NUM)`` slots; not simulated.
"""

from __future__ import annotations

from typing import Any

from tailserve.policies.trtllm_config import MAX_UTILIZATION

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
    if config.capacity_scheduler_policy == MAX_UTILIZATION:
        raise ValueError(
            "capacity_scheduler_policy MAX_UTILIZATION under pipeline parallelism: TensorRT-LLM 1.2's PP "
            "loop never pauses the requests it picks to pause (no _pause_requests in _executor_loop_pp); "
            "not simulated — use GUARANTEED_NO_EVICT"
        )
