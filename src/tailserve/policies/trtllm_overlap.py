"""TensorRT-LLM 1.2's overlap scheduler (PyTorch backend): the ``trtllm`` policy's own accounting
for it, as ``vllm_async.py`` is vLLM's (``docs/policies.md``, "`trtllm`", "Overlap scheduler").

Read in ``tensorrt_llm/_torch/pyexecutor/py_executor.py`` at commit 5f480b7a (the 1.2 line the
rest of the policy follows; ``PY_EXECUTOR`` below), ``scheduler/scheduler.py`` at the same commit,
``cpp/include/tensorrt_llm/batch_manager/llmRequest.h`` and ``_torch/speculative/interface.py``.
``_executor_loop_overlap`` runs, per iteration: ``_prepare_and_schedule_batch`` (fetch, capacity
and micro-batch schedulers), ``prepare_resources``, ``_forward_step`` (launched, not waited for),
then ``_update_requests(previous_batch)`` — which waits for the *previous* step's sampling — then
``_sample_async`` and ``_update_request_states`` for this step, then ``_process_previous_batch``
(``_handle_responses``: finished requests answered, dropped from the active list and their
resources freed by ``_terminate_request``; ``update_resources``: the previous step's context
blocks stored for reuse). So step n+1 is scheduled while step n runs, on the outputs of step
n-1 — the generic engine loop ``Engine._step_async`` (a queue of two), which this policy opts
into through ``Policy.async_scheduling``, with the scheduler's placeholder accounting
(``Scheduler.advance_scheduled``: computed tokens advance at scheduling, a step's outputs are
placeholders until it returns; ``update_advanced`` applies them a step late). What is the
engine's own:

- ``max_tokens`` finishes are foreseen. ``_update_request_states_tp`` moves a request whose
  step just launched yields its last token (``willCompleteNextIteration``: generated tokens
  known + ``mNumTokensPerIteration`` (1) >= ``mMaxNewTokens``; a context at its last chunk too)
  to ``GENERATION_TO_COMPLETE``. The micro-batch scheduler skips that state
  (``PyMicroBatchScheduler``: ``no_schedule_after_state=GENERATION_TO_COMPLETE``) but the
  capacity scheduler does not (``BindCapacityScheduler``: ``no_schedule_after_state=
  GENERATION_COMPLETE``): the request still counts against ``max_batch_size`` and keeps its
  reservation (GUARANTEED_NO_EVICT) or its one-step blocks (MAX_UTILIZATION) in the step it sits
  out. ``to_complete`` is that test.
- Its KV and its active slot come back when its last step's outputs are processed
  (``_handle_responses`` -> ``_terminate_request``), after the next step was scheduled: a waiting
  request is admitted a step later. A stop token (EOS, stop words) is not foreseen: the request
  runs one more step, whose output is dropped.
- A context's blocks become reusable when its step's outputs are processed
  (``update_resources`` -> ``store_context_blocks`` in ``_process_previous_batch``), i.e. a step
  later than without overlap: for a context's last chunk the scheduler registers them then
  (``update_advanced``); a partial chunk's are registered when scheduled (a step early: a
  deviation, with chunked prefill only).
- A finished context decodes in the very next step (``_update_request_states`` sets
  ``GENERATION_IN_PROGRESS`` right after the launch; the step's input token is read on device).
- **With MTP / Eagle3 one-model drafts** (which keep overlap on: ``support_overlap_scheduler``
  in ``_torch/speculative/interface.py``): a generation step verifies 1 + ``max_draft_len``
  tokens whose accepted count is sampled on device and read by ``_update_requests`` a step late,
  so step n+1 is scheduled as if step n committed all its drafts (``advance_scheduled``: computed
  tokens and placeholders advance by 1 + drafts; the rejected ones roll back at
  ``update_advanced``). ``prepare_resources`` for step n+1 adds its 1 + drafts slots on top of
  step n's, whose rejected drafts ``update_resources`` rewinds only in
  ``_process_previous_batch``; the reservation to completion counts those in-flight slots too
  (``DraftSlots.in_flight``, a deviation like the drafts' own). ``willCompleteNextIteration``
  keeps ``mNumTokensPerIteration`` at 1 in 1.2's one-model samplers (later versions set it from
  the tokens a step commits), so ``to_complete`` foresees only a finish by one token: a request
  that a step's accepted drafts finish runs one more step, whose output is dropped.

When the engine turns it off: ``disable_overlap_scheduler`` (``TorchLlmArgs``, default False:
on); ``create_py_executor`` turns it off for a speculative mode without
``support_overlap_scheduler()`` (1.2: MTP and EAGLE-3 one-model keep it, so do two-model draft
models; NGram and the others lose it), for ``mm_encoder_only`` and for
``SaveHiddenStatesDecodingConfig``. tailserve: on by default on a simulated GPU, drafts or not;
off where the executor steps only synchronously (real, real-time, lockstep data-parallel ranks:
``assemble/scheduler.py``).
"""

from __future__ import annotations

from tailserve.core.device import DeviceInfo
from tailserve.core.request import Request

PY_EXECUTOR = "tensorrt_llm/_torch/pyexecutor/py_executor.py@5f480b7a"
_FLAG = "trtllm:disable_overlap_scheduler=true simulates the scheduler without overlap"


def overlap_default(device: DeviceInfo, num_draft_tokens: int) -> tuple[bool, str]:
    """TensorRT-LLM 1.2's overlap scheduler when ``disable_overlap_scheduler`` is not given:
    (on, a one-line note saying why)."""
    if device.vendor == "cpu":
        return (
            False,
            "overlap scheduler off: TensorRT-LLM runs on NVIDIA GPUs; a CPU host steps synchronously",
        )
    if num_draft_tokens:
        return True, (
            f"overlap scheduler on: TensorRT-LLM 1.2's default, kept with MTP/Eagle3 one-model drafts "
            f"(speculative/interface.py support_overlap_scheduler; {PY_EXECUTOR} "
            f"_executor_loop_overlap): a step's accepted drafts are known a step late; {_FLAG}"
        )
    return True, (
        f"overlap scheduler on: TensorRT-LLM 1.2's default (disable_overlap_scheduler=False, "
        f"{PY_EXECUTOR} _executor_loop_overlap); {_FLAG}"
    )


def to_complete(request: Request) -> bool:
    """``GENERATION_TO_COMPLETE``: the step in flight yields the request's last token
    (``willCompleteNextIteration``: tokens known + ``mNumTokensPerIteration`` >= max new tokens),
    so the micro-batch scheduler skips it. Only under overlap can a request have an output in
    flight when it is scheduled. ``mNumTokensPerIteration`` is 1: with drafts too, as 1.2's
    one-model samplers leave it (a step that accepts drafts can finish a request this test did not
    foresee: it is scheduled once more and that step's output is dropped; later versions set it
    from the tokens a step commits)."""
    return request.num_output_placeholders > 0 and request.num_output_tokens + 1 >= request.max_tokens
