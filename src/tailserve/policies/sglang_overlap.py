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
  (``scheduler_components/batch_result_processor.py:1022-1027``) and the over-allocated slot is
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
- **Speculative decoding** (EAGLE / EAGLE3 / NEXTN) runs overlapped by default ("spec v2":
  ``speculative_hook.py:1098-1101`` warns only when overlap is off, and then runs the same v2
  worker synchronously; 0.5.23 has no other worker and no flag or variable for it, so
  ``--disable-overlap-schedule`` is the one switch). What the lag changes for the scheduler:

  - *The late commit.* A verify's accepted tokens are committed (``kv_committed_len +=
    accept_len``, ``batch_result_processor.py:819-831``) and appended to ``output_ids``
    (``:1046``) when its result is processed, after the next decode batch was launched; that
    batch verifies the bonus token and the drafts the worker left on the GPU (the future map,
    ``scheduler.py:4656-4757``), so nothing waits for the host. tailserve: the scheduler's advanced
    accounting counts the s + 1 verified positions at launch and rolls back the rejected drafts
    when the result is applied (``Scheduler.update_advanced``), 1 + the accepted drafts become
    outputs then.
  - *The reserve* (``eagle_utils.py:857-870``, ``allocation_sizing.py:64-93``): slots grow to
    ``committed + 2 x (steps + 1)`` from the committed length *before* the verify in flight —
    the 2x is there for this lag — and ``check_decode_mem`` asks for the same
    (``schedule_batch.py:3421-3430``): ``committed_lag`` below.
  - *Finishes*: ``_reqs_finishing_inflight`` foresees only a verify whose *first* token is the
    last (``len(output_ids) + 1 >= max_new_tokens``); one whose accepted run crosses
    ``max_new_tokens`` is in the next batch too, its output dropped (the request finished:
    ``batch_result_processor.py:1022-1027``) and its slots freed with the rest.
  - *Retraction*: a retracted request's in-flight verify commits nothing (``req.is_retracted``,
    ``:819``), as ``drop_in_flight`` has it.
  - ``max_running_requests`` (48 unless given) and the reserve's size are the same in both
    modes: ``_handle_eagle_family`` sets them before it looks at the overlap flag
    (``speculative_hook.py:1086-1101``).
"""

from __future__ import annotations

from tailserve.core.device import DeviceInfo
from tailserve.core.request import Request
from tailserve.core.scheduler_output import SchedulerOutput

_DEFAULT_RULE = "sglang/srt/arg_groups/fields/schedule.py:193-198@v0.5.23"
_SPEC_V2_RULE = "speculative_hook.py:1098-1101@v0.5.23"


def overlap_default(device: DeviceInfo, speculative: bool) -> tuple[bool, str]:
    """Whether tailserve runs SGLang's overlap scheduler when ``disable_overlap_schedule`` is not
    given: (on, a one-line note saying why)."""
    if device.vendor == "cpu":
        return False, (
            "sglang overlap scheduler off: tailserve's real executor runs steps synchronously "
            "(SGLang 0.5.23 overlaps by default on a GPU)"
        )
    if speculative:
        return True, (
            f"sglang overlap scheduler on with speculative decoding (spec v2): SGLang 0.5.23's default "
            f"({_DEFAULT_RULE}, {_SPEC_V2_RULE}); sglang:disable_overlap_schedule=true simulates the "
            "synchronous v2 worker"
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
    (``batch_result_processor.py:1022-1027``: ``req.is_retracted``): its item samples nothing."""
    if in_flight is None:
        return
    for item in in_flight.scheduled:
        if item.request is request:
            item.partial = True


def committed_lag(in_flight: SchedulerOutput | None) -> dict[str, int]:
    """Per request, the verified positions of its verify in flight: SGLang's committed KV
    (``kv_committed_len``) trails tailserve's computed tokens by them until the result is
    processed, and the decode reserve and ``check_decode_mem`` count from the committed length
    (empty without an in-flight verify; a prefill's tokens are committed at launch,
    ``allocation.py:484-485``)."""
    if in_flight is None:
        return {}
    return {
        item.request.request_id: item.num_new_tokens
        for item in in_flight.scheduled
        if item.num_spec_tokens and not item.partial
    }
