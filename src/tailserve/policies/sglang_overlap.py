"""SGLang 0.5.23's overlap scheduler in the ``sglang`` policy: what changes with it on, where
it differs from vLLM's async scheduling (``vllm_async.py``), and SGLang's default
(``docs/policies.md``, "`sglang` — SGLang 0.5.23", under "Overlap scheduler").

Read in SGLang 0.5.23 (``sglang/srt/``):

- **The loop** (``managers/scheduler.py:2061-2134``, ``event_loop_overlap``): receive requests,
  build the next batch (``get_next_batch_to_run``), launch it (``run_batch``), *then* process
  the previous batch's results (``pop_and_process``). Step N+1 is decided while step N runs,
  from state that lacks step N's tokens (``output_ids`` lag one step; ``seq_lens`` and the KV
  slots advance when a batch is prepared, ``prepare_for_decode``) — tailserve's engine-side
  ``Engine._step_async`` with the scheduler's ``advance_scheduled`` / ``update_advanced``.
- **Finishes by length are foreseen** (``scheduler.py:4445-4467``,
  ``_reqs_finishing_inflight``, ``Req.next_output_finishes_by_length``:
  ``schedule_batch.py:1661-1663``): a request whose in-flight result commits its last output
  (``len(output_ids) + 1 >= max_new_tokens``) is left out of the next decode batch, which then
  counts as shrunk (``batch_is_full`` cleared, ``scheduler.py:4543-4544``). If the rest then
  does not fit (``check_decode_mem``), no decode runs this turn and nothing is retracted
  (``scheduler.py:4469-4474``): the queued result frees the finishing requests' KV first.
- **Other finishes are one step late** (stop tokens; tailserve's simulated executor samples
  none): the request is in the next batch; that step's output is dropped
  (``scheduler_components/batch_result_processor.py:1013-1019``) and the over-allocated slot is
  freed with the rest of its KV (``release_kv_cache``) when the finish is processed — after the
  next step was launched. ``update_advanced`` drops outputs of finished requests the same way.
- **Retracted requests drop their in-flight output** (the same lines: ``req.is_retracted``):
  unlike vLLM, whose outputs of a preempted request come back stale and are kept. The policy
  marks the retracted request's item of the step in flight as sampling nothing
  (``drop_in_flight``).
- **Admission sees the lag**: requests that finish in step N free their KV (and leave the
  running batch, ``batch_is_full``) when step N's result is processed, after step N+1 was
  built, so a waiting request is admitted one step later than without overlap; a prefill
  batch's requests are merged into the running batch before their first token is known and
  decode in the very next step (``scheduler.py:3934-3968``). When no batch is built the loop
  processes the in-flight result and tries again (``scheduler.py:2117-2120``).
- **Host time hidden**: scheduling and input preparation of step N+1 run during step N's
  forward pass (the simulated executor's per-step overhead, ``StepResult.host_time``).
- **Turned off**: ``--disable-overlap-schedule`` (``arg_groups/fields/schedule.py:193-198``,
  default False: on), or by SGLang for pipeline parallelism (``arg_groups/overrides.py:1620``),
  diffusion LLMs, Mamba models without the extra buffer, the MPS backend, speculative
  decoding on CPU (``arg_groups/speculative_hook.py:66-78``), embeddings with a sparse head.
  Two consecutive prefill batches are overlapped too unless
  ``SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP`` is set (``scheduler.py:2136-2156``, ``environ.py:693``,
  default False).
- **Speculative decoding** (EAGLE / EAGLE3 / NEXTN) runs with overlap by default in SGLang 0.5.23
  ("spec v2": ``speculative_hook.py:1098-1101`` warns only when overlap is off, when it uses the
  synchronous v2 worker). Its KV reserve is the overlapped one in both modes: 2 x the slots a
  decode may take, "a double-buffer that absorbs the kv_committed_len lag in overlap mode"
  (``mem_cache/allocation_sizing.py:64-70``), which ``sglang_spec.py``'s ``decode_reserve``
  holds. Not modelled: the one-step lag itself (a verify's accepted tokens committed when the
  next decode is already launched): tailserve simulates SGLang's speculative decoding
  synchronously (``overlap_default`` says so in the run's notes).
"""

from __future__ import annotations

from tailserve.core.device import DeviceInfo
from tailserve.core.request import Request
from tailserve.core.scheduler_output import SchedulerOutput

_DEFAULT_RULE = "sglang/srt/arg_groups/fields/schedule.py:193-198@v0.5.23"


def overlap_default(device: DeviceInfo, speculative: bool) -> tuple[bool, str]:
    """Whether tailserve runs SGLang's overlap scheduler when ``disable_overlap_schedule`` is not
    given: (on, a one-line note saying why)."""
    if device.vendor == "cpu":
        return False, (
            "sglang overlap scheduler off: tailserve's real executor runs steps synchronously "
            "(SGLang 0.5.23 overlaps by default on a GPU)"
        )
    if speculative:
        return False, (
            "sglang overlap scheduler off: tailserve simulates SGLang's speculative decoding synchronously "
            "(SGLang 0.5.23 overlaps it by default, spec v2: speculative_hook.py:1098-1101@v0.5.23)"
        )
    return True, (
        f"sglang overlap scheduler on: SGLang 0.5.23's default ({_DEFAULT_RULE}); "
        "sglang:disable_overlap_schedule=true simulates the synchronous scheduler"
    )


def finishes_in_flight(request: Request) -> bool:
    """``_reqs_finishing_inflight``: the request's step in flight samples (one output
    placeholder) and that output is its last by length (``next_output_finishes_by_length``)."""
    return request.num_output_placeholders > 0 and request.num_output_tokens + 1 >= request.max_tokens


def drop_in_flight(in_flight: SchedulerOutput | None, request: Request) -> None:
    """A retracted request's output of the step in flight is dropped when it comes back
    (``batch_result_processor.py:1013-1019``: ``req.is_retracted``): its item samples nothing."""
    if in_flight is None:
        return
    for item in in_flight.scheduled:
        if item.request is request:
            item.partial = True
