"""TensorRT-LLM 1.2 under pipeline parallelism (``policies/trtllm_pipeline.py``,
``Engine._step_ring``): ``pp_size`` micro-batch slots in turn, generations and last context
chunks in flight skipped by the micro-batch scheduler (``inflight_req_ids``), a context's next
chunk scheduled while its previous one is in flight, each launch followed by a wait for the next
slot's batch, ``max_batch_size x pp_size`` active requests, no overlap scheduler."""

from __future__ import annotations

import pytest
from tests.helpers import Stages

from tailserve.assemble.build import BuildOptions, build_engine
from tailserve.core.engine import Engine, EngineOptions
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


class _Stages(Stages):
    """``Stages`` at these tests' host part, stage time and send by default."""

    def __init__(
        self, host: float = HOST, stages: tuple[float, ...] = (STAGE, STAGE), send: float = SEND
    ) -> None:
        super().__init__(host, stages, send)


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
    assert sched.batch_of == {} and sched.max_concurrent_batches == 3
    assert _policy(1).max_concurrent_batches() == 2  # the overlap scheduler's, without stages
    notes = TrtllmPolicy.default_notes(DEVICE, policy.config, {"pipeline_parallel_size": 3})
    assert any("_executor_loop_pp" in note for note in notes)


def test_a_lone_request_gets_a_token_per_trip():
    r = Request("a", 64, 4, 0.0)
    _engine([r]).run()
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert r.token_times == pytest.approx([TRIP * (k + 1) for k in range(4)])


def test_a_contexts_next_chunk_follows_its_previous_one_into_the_next_micro_batch():
    """Chunked prefill at a 512-token budget: a non-final chunk is not added to the in-flight set
    (``_add_inflight_ids``), so the 1,500-token context's second chunk goes into the next slot at
    once and its three chunks take two trips, not three; its last chunk is in flight until it
    returns."""
    r = Request("a", 1500, 2, 0.0)
    engine = _engine([r], enable_chunked_prefill=True, max_num_tokens=512)
    engine.run()
    assert r.token_times[0] == pytest.approx(2 * TRIP)
    assert list(engine.log.start)[:3] == pytest.approx([HOST, HOST + STAGE, TRIP + HOST])


def test_max_batch_size_bounds_each_micro_batch_and_the_stages_multiply_the_active_requests():
    """max_num_sequences = max_batch_size x pp_size: with max_batch_size 8 at PP 2, 16 requests
    are active and both slots carry 8, the second micro-batch entering stage 1 as soon as the
    first leaves it."""
    requests = [Request(f"r{i}", 64, 50, 0.0) for i in range(32)]
    engine = _engine(requests, max_batch_size=8)
    engine.run()
    starts, sizes = list(engine.log.start), list(engine.log.batch_size)
    assert sizes[:4] == [8, 8, 8, 8]
    assert starts[:2] == pytest.approx([HOST, HOST + STAGE])
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)


def test_an_arrival_waits_while_the_loop_waits_on_the_oldest_batch():
    """Two slots: a's batch launched in slot 0, slot 1's schedule is empty, so the loop waits for
    slot 0's batch (the next slot's). b, arriving meanwhile at 5 ms, is fetched only when a's batch
    returns at one trip — not when it came, as in Sarathi-Serve's timer-driven loop."""
    a, b = Request("a", 64, 2, 0.0), Request("b", 64, 1, 0.005)
    _engine([a, b]).run()
    assert b.first_scheduled_time == pytest.approx(TRIP)


def test_micro_batches_in_flight_hold_disjoint_requests_and_everything_finishes(monkeypatch):
    """Under KV pressure with chunked prefill: every request ends with its tokens, no generation
    or last chunk is scheduled while in flight, a context's chunks do follow each other into
    consecutive micro-batches, and KV is conserved (the integrity check after every batch)."""
    schedule = Scheduler.schedule
    seen = {"chunk_behind_chunk": 0}

    def checked(self, now):
        busy = set(self.batch_of)
        partial = {s.request for q in engine._slots if q is not None for s in q.out.scheduled if s.partial}
        out = schedule(self, now)
        scheduled = {s.request for s in out.scheduled}
        assert not busy & scheduled
        seen["chunk_behind_chunk"] += len(partial & scheduled)
        return out

    monkeypatch.setattr(Scheduler, "schedule", checked)
    for policy in ("GUARANTEED_NO_EVICT", "STATIC_BATCH"):
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
            assert engine.scheduler.batch_of == {} and kv.num_used_blocks == 0
    assert seen["chunk_behind_chunk"] > 0


def test_drafting_and_the_fetch_wait_under_stages_are_refused_in_one_line():
    with pytest.raises(ValueError, match="Drafting is not supported for selected executor loop"):
        _policy(2, decoding_type="MTP", num_nextn_predict_layers=1, synthetic_acceptance_length=1.5)
    with pytest.raises(ValueError, match="batch_wait_timeout_ms under pipeline parallelism"):
        _policy(2, batch_wait_timeout_ms=5.0)
    with pytest.raises(ValueError, match="never pauses the requests it picks to pause"):
        _policy(2, capacity_scheduler_policy="MAX_UTILIZATION")


def test_a_built_engine_and_the_command_line_carry_the_stages():
    from tailserve.policies.registry import PolicySpec
    from tailserve.tune.commands import command_line

    deployment = Deployment("Llama-3-70B", "H100-SXM", 4, "none", pp=2)
    built = build_engine(
        deployment, "trtllm", options=BuildOptions(engine=EngineOptions(check_integrity=True))
    )
    assert built.policy_config.pipeline_parallel_size == 2 and built.scheduler.batch_of == {}
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


def test_explain_names_tensorrt_llms_lever_under_stages(capsys):
    from tailserve.cli.app import main

    argv = ["simulate", "--model", "Llama-3-70B", "--hardware", "H100-SXM", "--tp", "4", "--pp", "2"]
    argv += ["--policy", "trtllm", "--workload", "chat", "--rate", "8", "--num-requests", "60", "--seed", "1"]
    assert main([*argv, "--explain"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "The engine ran 2 pipeline stages (40/40 layers" in out
    assert "a lower `max_num_tokens` with it evens the micro-batches out" in out


def test_lint_says_what_the_pp_loop_refuses_and_what_is_not_simulated(tmp_path):
    from tailserve.engines.flag_spec import NOT_MODELLED
    from tailserve.engines.lint import lint

    options = tmp_path / "pp.yaml"
    options.write_text(
        "speculative_config:\n  decoding_type: MTP\n  num_nextn_predict_layers: 1\n"
        "scheduler_config:\n  capacity_scheduler_policy: MAX_UTILIZATION\nbatch_wait_timeout_ms: 5\n"
    )
    line = f"trtllm-serve deepseek-ai/DeepSeek-V3 --tp_size 8 --pp_size 2 --extra_llm_api_options {options}"
    report = lint(line)
    assert report.refused
    assert [tuple(f.flags) for f in report.conflicts] == [("speculative_config", "pp_size")]
    rows = {r.name: r for r in report.rows}
    assert rows["scheduler_config.capacity_scheduler_policy"].verdict == NOT_MODELLED
    assert "never carries out its pauses" in rows["scheduler_config.capacity_scheduler_policy"].what
    assert rows["batch_wait_timeout_ms"].verdict == NOT_MODELLED
    single = {r.name: r for r in lint(line.replace("--pp_size 2", "--pp_size 1")).rows}
    assert "never carries out its pauses" not in single["scheduler_config.capacity_scheduler_policy"].what
