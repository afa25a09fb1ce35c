"""Small helpers the policy tests share: one scheduling step, and what it granted."""

from __future__ import annotations

from collections.abc import Iterable

from tailserve.core.executor import StepResult
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import SchedulerOutput
from tailserve.kv.factory import make_kv_cache


def step(sched: Scheduler, now: float = 0.0) -> SchedulerOutput:
    """Schedule at ``now`` and apply the iteration as if it took 10 ms."""
    out = sched.schedule(now)
    sched.update(out, StepResult(duration=0.01), now + 0.01)
    return out


def grants(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    """(request id, new tokens, context tokens) of every scheduled request, in batch order."""
    return [(s.request.request_id, s.num_new_tokens, s.num_context_tokens) for s in out.scheduled]


def ids(requests: Iterable[Request]) -> list[str]:
    return [r.request_id for r in requests]


def token_request(rid: str, tokens: list[int], max_tokens: int = 3, t: float = 0.0, **kw) -> Request:
    """A request whose prompt is ``tokens`` (token identities, so prefix caches can share it)."""
    return Request(rid, len(tokens), max_tokens, t, prompt_token_ids=list(tokens), **kw)


def add(sched: Scheduler, request: Request, now: float = 0.0) -> Request:
    assert sched.add_request(request, now)
    return request


def drain(sched: Scheduler, now: float = 0.0, limit: int = 1000) -> float:
    """Step until nothing is left (at most ``limit`` iterations), checking KV integrity each time;
    returns the time reached."""
    while sched.has_unfinished and limit:
        step(sched, now)
        sched.kv_cache.check_integrity()
        now += 0.01
        limit -= 1
    return now


def scheduler_for(
    policy, num_blocks: int, block_size: int, max_model_len: int, num_cpu_blocks: int = 0
) -> Scheduler:
    """A scheduler over the KV manager kind the policy declares (``kv_spec``), as the engine
    builders make it for a workload with token identities."""
    kv = make_kv_cache(policy.kv_spec(), num_blocks, block_size, num_cpu_blocks, shares_prefixes=True)
    return Scheduler(policy, kv, max_model_len)


def write_recording(requests: Iterable[Request], path) -> None:
    """Simulated requests written as a client's recording (send time, TTFT, every gap), the
    ground truth of the recorded-traffic tests."""
    import json

    import numpy as np

    from tailserve.workloads.recorded import Measured, trace_line

    lines = []
    for r in requests:
        times = r.token_times
        m = Measured(
            times[0] - r.arrival_time, np.diff(times).tolist(), len(times), times[-1] - r.arrival_time
        )
        lines.append(trace_line(r.arrival_time, r.prompt_len, r.max_tokens, m))
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def running_request(
    sched: Scheduler, rid: str, prompt: int, outputs: int, max_tokens: int, priority: int = 0
) -> Request:
    """A request mid-decode: ``outputs`` tokens generated, one token behind, its KV held."""
    request = Request(rid, prompt, max_tokens, 0.0, priority=priority)
    request.num_output_tokens = outputs
    request.num_computed_tokens = prompt + outputs - 1
    request.status = RequestStatus.RUNNING
    request.enqueue_time = 0.0
    assert sched.allocate(request, request.num_computed_tokens)
    sched.running.append(request)
    return request


def sim_run(
    sched: Scheduler, requests: list[Request], fast: bool, block_size: int = 1, check_integrity: bool = True
):
    """Run ``requests`` through ``sched`` on the simulated executor (Llama-3-8B, one H100), the
    fast paths on or off; the engine, its requests finished."""
    from tailserve.core.engine import Engine, EngineOptions
    from tailserve.core.source import ListSource
    from tailserve.executors.simulated.cost_model import CostModel
    from tailserve.executors.simulated.driver import SimDriver
    from tailserve.executors.simulated.executor import SimExecutor
    from tailserve.executors.simulated.hardware import get_hardware
    from tailserve.executors.simulated.models import get_model

    executor = SimExecutor(
        CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1), block_size=block_size
    )
    options = EngineOptions(fast_forward=fast, check_integrity=check_integrity)
    engine = Engine(sched, executor, ListSource(requests), options=options)
    SimDriver(engine).run()
    return engine


def trtllm_line_read_back(spec, deployment, device, tmp_path, monkeypatch, max_model_len: int = 8192):
    """tune's printed ``trtllm-serve`` line (its options YAML written as the echo would), read back
    by lint and translate (the model's experts from the catalog, as ``--engine-cmd`` reads them):
    the translation."""
    import shlex

    from tailserve.engines.lint import lint
    from tailserve.engines.translate import translate
    from tailserve.tune.commands import command_line

    echo, _, launch = command_line(spec, deployment, None, device, max_model_len).partition(" && ")
    words = shlex.split(echo)
    monkeypatch.chdir(tmp_path)
    (tmp_path / words[3]).write_text(words[1])
    from tailserve.executors.simulated.models import get_model

    return translate(lint(launch), device, experts=lambda model: get_model(model).num_experts)


def dp_run(deployment, policy, workload):
    """A data-parallel engine's stage (``build_dp_stage``) run over ``workload``'s requests: the
    stage and the run."""
    from tailserve.cluster.build import workload_requests
    from tailserve.cluster.cluster import run_aggregated
    from tailserve.cluster.dp_group import build_dp_stage
    from tailserve.cluster.replica import ReplicaSpec
    from tailserve.sim.workload_builder import WorkloadBuilder

    stage = build_dp_stage(deployment, policy, shares_prefixes=False)
    requests = workload_requests(WorkloadBuilder(workload), [ReplicaSpec(deployment, policy)])
    return stage, run_aggregated(stage, requests)


class Stages:
    """An executor whose every step takes ``host`` seconds, then ``stages`` (one time per pipeline
    stage) with ``send`` between two of them: the pipelined engines' timing, by hand."""

    needs_block_ids = False

    def __init__(self, host: float, stages: tuple[float, ...], send: float) -> None:
        self.host, self.stages, self.send = host, stages, send

    def execute(self, out: SchedulerOutput) -> StepResult:
        return StepResult(
            self.host + sum(self.stages), host_time=self.host, stages=self.stages, stage_send=self.send
        )
