"""TensorRT-LLM 1.2 under pipeline parallelism (``policies/trtllm_pipeline.py``,
``Engine._step_ring``): ``pp_size`` micro-batch slots in turn, the requests in flight skipped by
the micro-batch scheduler (``inflight_req_ids``), each launch followed by a wait for the next
slot's batch, no overlap scheduler, computed blocks stored for reuse when a batch returns."""

from __future__ import annotations

import pytest

from tailserve.assemble.build import BuildOptions, build_engine
from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.executor import StepResult
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.core.source import ListSource
from tailserve.executors.simulated.deployment import Deployment
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.kv.paged import KVCacheManager
from tailserve.policies.trtllm import TrtllmPolicy

HOST, STAGE, SEND = 0.001, 0.010, 0.0005
TRIP = HOST + STAGE + SEND + STAGE
DEVICE = get_hardware("H100-SXM").device_info


class _Stages:
    needs_block_ids = False

    def __init__(
        self, host: float = HOST, stages: tuple[float, ...] = (STAGE, STAGE), send: float = SEND
    ) -> None:
        self.host, self.stages, self.send = host, stages, send

    def execute(self, out) -> StepResult:
        return StepResult(
            self.host + sum(self.stages), host_time=self.host, stages=self.stages, stage_send=self.send
        )


def _policy(pp: int = 2, **flags) -> TrtllmPolicy:
    return TrtllmPolicy(TrtllmPolicy.default_config(DEVICE, 4096, pipeline_parallel_size=pp, **flags))


def _engine(requests: list[Request], pp: int = 2, blocks: int = 256, **flags) -> Engine:
    sched = Scheduler(_policy(pp, **flags), KVCacheManager(blocks, 32), 4096)
    executor = _Stages(stages=(STAGE,) * pp)
    return Engine(sched, executor, ListSource(requests), options=EngineOptions(check_integrity=True))


def test_pp_size_slots_no_overlap_and_the_in_flight_skip():
    policy = _policy(3)
    assert policy.pipeline_engine == "trtllm" and not policy.async_scheduling()
    sched = Scheduler(policy, KVCacheManager(64, 32), 4096)
    assert sched.in_flight == {} and sched.max_concurrent_batches == 3
    assert _policy(1).max_concurrent_batches() == 2  # the overlap scheduler's, without stages
    notes = TrtllmPolicy.default_notes(DEVICE, policy.config, {"pipeline_parallel_size": 3})
    assert any("_executor_loop_pp" in note for note in notes)


def test_a_lone_request_gets_a_token_per_trip():
    r = Request("a", 64, 4, 0.0)
    _engine([r]).run()
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert r.token_times == pytest.approx([TRIP * (k + 1) for k in range(4)])


def test_a_contexts_next_chunk_waits_for_its_previous_micro_batch():
    """Chunked prefill at a 512-token budget: a 1,500-token context is skipped while its chunk is
    in flight, so its three chunks make three trips."""
    r = Request("a", 1500, 2, 0.0)
    _engine([r], enable_chunked_prefill=True, max_num_tokens=512).run()
    assert r.token_times[0] == pytest.approx(3 * TRIP)


def test_an_arrival_waits_while_the_loop_waits_on_the_oldest_batch():
    """Two slots: a's batch launched in slot 0, slot 1's schedule is empty, so the loop waits for
    slot 0's batch (the next slot's). b, arriving meanwhile at 5 ms, is fetched only when a's batch
    returns at one trip — not when it came, as in Sarathi-Serve's timer-driven loop."""
    a, b = Request("a", 64, 2, 0.0), Request("b", 64, 1, 0.005)
    _engine([a, b]).run()
    assert b.first_scheduled_time == pytest.approx(TRIP)


def test_micro_batches_in_flight_hold_disjoint_requests_and_everything_finishes(monkeypatch):
    """Under KV pressure with MAX_UTILIZATION (pauses, victims in flight among them) and with
    GUARANTEED_NO_EVICT: every request ends with its tokens, no request is scheduled while its
    batch is in flight, and KV is conserved (the integrity check after every applied batch)."""
    schedule = Scheduler.schedule
    seen = {"paused_in_flight": 0}

    def checked(self, now):
        busy = set(self.in_flight)
        out = schedule(self, now)
        assert not (busy - set(out.preempted)) & {s.request for s in out.scheduled}
        seen["paused_in_flight"] += len(busy & set(out.preempted))
        return out

    monkeypatch.setattr(Scheduler, "schedule", checked)
    for policy in ("MAX_UTILIZATION", "GUARANTEED_NO_EVICT"):
        for pp in (2, 3):
            requests = [
                Request(f"r{i}", 40 + (97 * i) % 600, 8 + (31 * i) % 90, 0.004 * i) for i in range(60)
            ]
            flags = {
                "capacity_scheduler_policy": policy,
                "enable_chunked_prefill": True,
                "max_num_tokens": 512,
            }
            engine = _engine(requests, pp, blocks=48, **flags)
            engine.run()
            assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests), (policy, pp)
            assert all(r.num_output_tokens == r.max_tokens == len(r.token_times) for r in requests)
            kv = engine.scheduler.kv_cache
            assert engine.scheduler.in_flight == {} and kv.num_used_blocks == 0
    assert seen["paused_in_flight"] > 0


def test_drafting_and_the_fetch_wait_under_stages_are_refused_in_one_line():
    with pytest.raises(ValueError, match="Drafting is not supported for selected executor loop"):
        _policy(2, decoding_type="MTP", num_nextn_predict_layers=1, synthetic_acceptance_length=1.5)
    with pytest.raises(ValueError, match="batch_wait_timeout_ms under pipeline parallelism"):
        _policy(2, batch_wait_timeout_ms=5.0)


def test_a_built_engine_and_the_command_line_carry_the_stages():
    from tailserve.policies.registry import PolicySpec
    from tailserve.tune.commands import command_line

    deployment = Deployment("Llama-3-70B", "H100-SXM", 4, "none", pp=2)
    built = build_engine(
        deployment, "trtllm", options=BuildOptions(engine=EngineOptions(check_integrity=True))
    )
    assert built.policy_config.pipeline_parallel_size == 2 and built.scheduler.in_flight == {}
    requests = [Request(f"r{i}", 200 + 37 * i, 20 + i, 0.01 * i) for i in range(40)]
    engine = built.make_engine(ListSource(requests), options=EngineOptions(check_integrity=True))
    engine.run()
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)
    line = command_line(PolicySpec("trtllm", {}, {}), deployment, None, DEVICE, 8192)
    assert line is not None and "--tp_size 4 --pp_size 2" in line


def test_lint_reads_pp_size_into_the_deployment():
    from tailserve.engines.flag_spec import DEPLOYMENT
    from tailserve.engines.lint import lint

    rows = {
        r.flag: r for r in lint("trtllm-serve meta-llama/Llama-3.1-70B-Instruct --tp_size 4 --pp_size 2").rows
    }
    assert rows["--pp_size"].verdict == DEPLOYMENT and rows["--pp_size"].feeds == "deployment.pp"
