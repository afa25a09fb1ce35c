"""Run a differential workload through tailserve's own scheduler, one step at a time.

The policy, the ``Scheduler`` and the KV cache manager are the ones every tailserve run uses
(built by ``assemble.scheduler.make_scheduler`` from the policy's KV spec, as every engine is); only the model is
fake. The step loop is the one the engine drivers in ``drivers/`` run, line for line: aborts,
arrivals, ``schedule``, one sampled token per request whose computed tokens caught up, update.

With vLLM's async scheduling or speculative decoding (``run_advanced``) the loop is vLLM's
engine core with a batch queue (``EngineCore.step_with_batch_queue``; depth 2 with async
scheduling, 1 without; under pipeline parallelism ``pp``, ``pp + 1`` with async scheduling): a step is scheduled and "executed" (the fake model decides its tokens and
accepted drafts then), and the oldest step in the queue is applied once the queue is full.

With a ``NixlConnector`` (``nixl_role``) the fake NIXL worker's report of step s (its output,
read by the engine before its next pass) is the transfer done at s + 0.5 on tailserve's clock:
a consumer's read ``transfer_steps`` after the step that admitted its request to load (the
``pull`` the policy calls then), a producer's send ``transfer_steps`` after the step following
its request's finish (``release_sent``); after each step's update the harness frees the held KV
due by then (``Scheduler.free_sent``), where vLLM's ``update_from_output`` frees it (under async
scheduling that update applies the step before, so what was due a step earlier). The step being
the clock, an idle engine's empty steps read their reports a step late too, as vLLM's do
(``Scheduler.idle_reports_at_once`` off; the simulator takes them as instant).
"""

from __future__ import annotations

from collections import deque

from tailserve.assemble.scheduler import make_scheduler
from tailserve.core.executor import StepResult
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import SchedulerOutput
from tailserve.kv.host_tier import PAGE_BYTES
from tailserve.policies.vllm import VllmConfig, VllmPolicy
from tailserve.policies.vllm_dp_prefill import PrefillCadence, PrefillThrottle
from tailserve.policies.vllm_v0 import VllmV0Config, VllmV0Policy
from tailserve.validate.trace import StepRecord
from tailserve.validate.workload import RequestSpec, SchedulerSpec, Workload

FILLER_TOKEN = 3  # what the fake model samples past a request's planned outputs (never kept)


def build_vllm_scheduler(spec: SchedulerSpec) -> Scheduler:
    rates = spec.synthetic_acceptance_rates
    config = VllmConfig(
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_num_seqs=spec.max_num_seqs,
        long_prefill_token_threshold=spec.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=spec.long_prefill_token_threshold_adaptive,
        max_num_active_seqs=spec.max_num_active_seqs,
        enable_chunked_prefill=spec.enable_chunked_prefill,
        scheduling_policy=spec.scheduling_policy,
        enable_prefix_caching=spec.enable_prefix_caching,
        async_scheduling=spec.async_scheduling,
        speculative_method=spec.speculative_method,
        num_speculative_tokens=spec.num_speculative_tokens,
        synthetic_acceptance_rates=tuple(rates) if rates is not None else None,
        kv_offloading_size=_offload_gib(spec) if spec.num_host_blocks else None,
        pipeline_parallel_size=spec.pipeline_parallel_size,
    )
    policy = VllmPolicy(config)
    sched = make_scheduler(
        policy, spec.num_blocks, spec.block_size, 0, spec.max_model_len, True, spec.num_host_blocks
    )
    if spec.nixl_role == "kv_producer":
        sched.hold_kv_until_sent()
    # The step is the clock here: an idle engine's empty steps take one too, and under async
    # scheduling their transfer reports are read a step later, as vLLM's are.
    sched.idle_reports_at_once = False
    if policy._offload is not None:
        # The driver's fake offloading worker reports every load done by the step that carries
        # it: a load costs no time, so the next pass (one step later) promotes it.
        policy._offload.seconds_per_token = 0.0
    return sched


def _offload_gib(spec: SchedulerSpec) -> float:
    """The tier's GiB as the driver sizes vLLM's (a chunk is the fake KV's page: 2 x block_size
    tokens x 16 float32 values, rounded up to 4 KiB); only reported, the chunk count is exact."""
    chunk = -(-(2 * spec.block_size * 16 * 4) // PAGE_BYTES) * PAGE_BYTES
    return spec.num_host_blocks * chunk / (1 << 30)


def build_vllm_v0_scheduler(spec: SchedulerSpec) -> Scheduler:
    config = VllmV0Config(
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_num_seqs=spec.max_num_seqs,
        enable_chunked_prefill=spec.enable_chunked_prefill,
        long_prefill_token_threshold=spec.long_prefill_token_threshold,
        preemption_mode=spec.preemption_mode,
        scheduling_policy=spec.scheduling_policy,
        enable_prefix_caching=spec.enable_prefix_caching,
    )
    policy = VllmV0Policy(config)
    return make_scheduler(
        policy, spec.num_blocks, spec.block_size, spec.num_cpu_blocks, spec.max_model_len, True
    )


def run_tailserve_v0(workload: Workload) -> list[StepRecord]:
    """V0's trace, with each step's grants by request id (V0 lists a batch prefills first: its
    layout, not its decision order)."""
    steps = run_tailserve(workload, build_vllm_v0_scheduler(workload.scheduler))
    for step in steps:
        step.scheduled.sort()
    return steps


def _prefill_cadence(workload: Workload, sched: Scheduler) -> tuple[PrefillCadence, PrefillThrottle]:
    """DP prefill balancing's cadence, as drivers/vllm_v1.py's ``Cadence`` runs it, and the policy's
    throttle it marks (a stand-in for a policy without one)."""
    cadence = PrefillCadence(workload.scheduler.prefill_schedule_interval)
    throttle = getattr(sched.policy, "prefill_throttle", None) or PrefillThrottle()
    throttle.tracking = cadence.interval > 1
    return cadence, throttle


def run_tailserve(workload: Workload, scheduler: Scheduler | None = None) -> list[StepRecord]:
    """The trace of tailserve's ``vllm`` policy on ``workload`` (or of ``scheduler``, built for
    it by the caller, for other policies). Checks KV integrity after every step."""
    sched = scheduler if scheduler is not None else build_vllm_scheduler(workload.scheduler)
    spec = workload.scheduler
    if spec.async_scheduling or spec.num_speculative_tokens or spec.pipeline_parallel_size > 1:
        return run_advanced(workload, sched)
    kv = sched.kv_cache
    stop = workload.stop_token_id
    outputs = {r.request_id: r.output_token_ids for r in workload.requests}
    pending = sorted(workload.requests, key=lambda r: r.arrival_step)  # stable on ties
    live: dict[str, Request] = {}
    steps: list[StepRecord] = []
    sends = _Sends(workload)
    cadence, throttle = _prefill_cadence(workload, sched)
    for step in range(workload.max_steps):
        now = float(step)
        aborted = _aborts_and_arrivals(sched, workload, step, pending, live)
        if not live and not pending:
            break
        running_before = {r.request_id for r in sched.running}
        num_left = len(sched.finished)
        throttle.throttled = cadence.throttles()
        out = sched.schedule(now)
        sends.start(sched, step)
        # Requests the policy ended while scheduling (vLLM V0 aborts a prompt that can never fit).
        for request in sched.finished[num_left:]:
            aborted.append(request.request_id)
            live.pop(request.request_id, None)
        token_ids: dict[str, int] = {}
        stopped: set[str] = set()
        for item in out.scheduled:
            r = item.request
            if item.num_context_tokens + item.num_new_tokens >= r.num_tokens:
                token = outputs[r.request_id][r.num_output_tokens]
                token_ids[r.request_id] = token
                if token == stop:
                    stopped.add(r.request_id)
        done = sched.update(out, StepResult(0.0, token_ids, stopped), now)
        sends.finished(done)
        finished = sorted(r.request_id for r in done)
        for request_id in finished:
            del live[request_id]
        sched.free_sent(now + 0.5)
        kv.check_integrity()
        steps.append(
            StepRecord(
                step=step,
                scheduled=[
                    (s.request.request_id, s.num_new_tokens, s.num_context_tokens) for s in out.scheduled
                ],
                admitted=[
                    s.request.request_id for s in out.scheduled if s.request.request_id not in running_before
                ],
                preempted=sorted(r.request_id for r in out.preempted),
                finished=finished,
                aborted=sorted(aborted),
                num_used_blocks=kv.num_used_blocks,
            )
        )
        cadence.stepped(not live)
    return steps


def fake_model(
    out: SchedulerOutput, specs: dict[str, RequestSpec], produced: dict[str, int], stop: int
) -> StepResult:
    """What the fake model runner returns for an ``advanced`` step, decided when the step runs:
    each request that samples gets 1 + its accepted drafts (``RequestSpec.num_accepted``; none
    for padding drafts) of its planned outputs, from the ``produced`` count on (tokens of steps
    still in flight included), a stop token ending them where it falls."""
    result = StepResult(0.0, num_accepted={})
    accepted = result.num_accepted
    assert accepted is not None
    for item in out.scheduled:
        if item.partial:
            continue
        rid = item.request.request_id
        spec = specs[rid]
        num_accepted = 0
        if item.num_spec_tokens:
            if not item.spec_padding:
                num_accepted = spec.num_accepted(item.num_context_tokens, item.num_spec_tokens)
            accepted[rid] = num_accepted
        start = produced.get(rid, 0)
        produced[rid] = start + 1 + num_accepted
        planned = spec.output_token_ids
        tokens = [
            planned[j] if j < len(planned) else FILLER_TOKEN for j in range(start, start + 1 + num_accepted)
        ]
        if stop in tokens:
            result.stopped.add(rid)
            result.stop_index[rid] = tokens.index(stop)
    return result


def run_advanced(workload: Workload, sched: Scheduler) -> list[StepRecord]:
    """The trace of the ``vllm`` policy with async scheduling or speculative decoding: vLLM's
    engine loop with a batch queue (see the module docstring), as ``drivers/vllm_v1.py`` runs it."""
    kv = sched.kv_cache
    stop = workload.stop_token_id
    specs = {r.request_id: r for r in workload.requests}
    depth = sched.max_concurrent_batches
    pending = sorted(workload.requests, key=lambda r: r.arrival_step)  # stable on ties
    live: dict[str, Request] = {}
    produced: dict[str, int] = {}
    queue: deque[tuple[SchedulerOutput, StepResult]] = deque()
    steps: list[StepRecord] = []
    sends = _Sends(workload)
    cadence, throttle = _prefill_cadence(workload, sched)
    for step in range(workload.max_steps):
        now = float(step)
        aborted = _aborts_and_arrivals(sched, workload, step, pending, live)
        if not live and not pending:
            break
        running_before = {r.request_id for r in sched.running}
        throttle.throttled = cadence.throttles()
        out = sched.schedule(now)
        sends.start(sched, step)
        queue.appendleft((out, fake_model(out, specs, produced, stop)))
        finished: list[str] = []
        if not (len(queue) < depth and (out.scheduled or live)):
            done = sched.update(*queue.pop(), now)
            sends.finished(done)
            finished = sorted(r.request_id for r in done)
            for request_id in finished:
                del live[request_id]
        # The step applied now is depth - 1 before this one (the batch queue's oldest).
        sched.free_sent(now + 0.5 - (depth - 1))
        kv.check_integrity()
        steps.append(
            StepRecord(
                step=step,
                scheduled=[
                    (s.request.request_id, s.num_new_tokens, s.num_context_tokens) for s in out.scheduled
                ],
                admitted=[
                    s.request.request_id for s in out.scheduled if s.request.request_id not in running_before
                ],
                preempted=sorted(r.request_id for r in out.preempted),
                finished=finished,
                aborted=sorted(aborted),
                num_used_blocks=kv.num_used_blocks,
            )
        )
        cadence.stepped(not live)
    return steps


class _Sends:
    """A producer's sends (module docstring): each finished request's KV is released
    ``transfer_steps`` after the step following its finish."""

    def __init__(self, workload: Workload) -> None:
        self.on = workload.scheduler.nixl_role == "kv_producer"
        self.steps = {r.request_id: r.transfer_steps for r in workload.requests}
        self._new: list[Request] = []

    def start(self, sched: Scheduler, step: int) -> None:
        for request in self._new:
            sched.release_sent(request.request_id, step + self.steps[request.request_id] + 0.5)
        self._new = []

    def finished(self, done: list[Request]) -> None:
        if self.on:
            self._new.extend(r for r in done if r.status is not RequestStatus.FINISHED_ABORTED)


def _aborts_and_arrivals(sched, workload, step: int, pending: list, live: dict[str, Request]) -> list[str]:
    """The workload's events at ``step``, before the scheduling pass: aborts of live requests,
    then the arrivals (``pending`` is sorted by arrival step; both are updated in place).
    Returns the aborted requests' ids."""
    now = float(step)
    aborted = [r.request_id for r in workload.requests if r.abort_step == step and r.request_id in live]
    for request_id in aborted:
        sched.abort_request(request_id, "aborted by the workload", now)
        del live[request_id]
    while pending and pending[0].arrival_step <= step:
        spec = pending.pop(0)
        request = Request(
            request_id=spec.request_id,
            prompt_len=len(spec.prompt_token_ids),
            max_tokens=spec.max_tokens,
            arrival_time=float(spec.arrival_step),
            priority=spec.priority,
            prompt_token_ids=list(spec.prompt_token_ids),
            planned_output_token_ids=list(spec.output_token_ids),
        )
        if workload.scheduler.nixl_role == "kv_consumer":
            # The fake NIXL worker reads it in ``transfer_steps`` from the step that admits it.
            delay = spec.transfer_steps + 0.5
            sched.policy.expect_remote_kv(spec.request_id, request.prompt_len, lambda r, n, t, d=delay: t + d)
        if not sched.add_request(request, now):
            raise ValueError(f"tailserve rejected {spec.request_id}: {request.status_reason}")
        live[spec.request_id] = request
    return aborted
