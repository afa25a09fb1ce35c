"""Sarathi-Serve's pipelined engine (``policies/sarathi_pipeline.py``, ``Engine._step_paused``):
sarathi, orca and vllm-v0 under ``--pipeline-parallel-size``. At most ``pp`` micro-batches in
flight, only paused requests scheduled (a prompt's next chunk after its previous one has left the
last stage), the schedule loop's 10 ms timer and stage-1 signal, and a preempted request's
outputs dropped when its batch returns."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tests.helpers import Stages

from tailserve.assemble.build import BuildOptions, build_engine
from tailserve.core.engine import Engine, EngineOptions, next_tick
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tailserve.core.source import ListSource
from tailserve.executors.simulated.deployment import Deployment
from tailserve.kv.paged import KVCacheManager
from tailserve.policies.orca import OrcaConfig, OrcaPolicy
from tailserve.policies.sarathi import SarathiConfig, SarathiPolicy
from tailserve.policies.vllm import VllmConfig, VllmPolicy
from tailserve.policies.vllm_v0 import VllmV0Config, VllmV0Policy

HOST, STAGE, SEND = 0.001, 0.010, 0.0005
TRIP = HOST + STAGE + SEND + STAGE  # one batch's way through two stages


class _Stages(Stages):
    """``Stages`` at these tests' host part, stage time and send by default."""

    def __init__(
        self, host: float = HOST, stages: tuple[float, ...] = (STAGE, STAGE), send: float = SEND
    ) -> None:
        super().__init__(host, stages, send)


def _policy(name: str, pp: int, **kw):
    if name == "sarathi":
        return SarathiPolicy(SarathiConfig(pipeline_parallel_size=pp, **kw))
    if name == "orca":
        return OrcaPolicy(OrcaConfig(pipeline_parallel_size=pp, **kw))
    if name == "vllm-v0-chunked":
        return VllmV0Policy(
            VllmV0Config(512, 64, enable_chunked_prefill=True, pipeline_parallel_size=pp, **kw)
        )
    assert name == "vllm-v0"
    return VllmV0Policy(VllmV0Config(4096, 64, pipeline_parallel_size=pp, **kw))


def _engine(policy, requests: list[Request], executor=None, blocks: int = 512) -> Engine:
    sched = Scheduler(policy, KVCacheManager(blocks, 16), 4096)
    return Engine(
        sched, executor or _Stages(), ListSource(requests), options=EngineOptions(check_integrity=True)
    )


def test_the_policies_say_sarathis_engine_and_its_queue_depth():
    for name in ("sarathi", "orca", "vllm-v0"):
        policy = _policy(name, 3)
        sched = Scheduler(policy, KVCacheManager(64, 16), 4096)
        assert policy.pipeline_engine == "sarathi" and policy.schedule_tick == 0.01
        assert sched.max_concurrent_batches == 3
        engine = Engine(sched, _Stages(stages=(STAGE,) * 3), ListSource([]))
        assert engine._pipelined == engine._step_paused
        alone = Scheduler(_policy(name, 1), KVCacheManager(64, 16), 4096)
        assert alone.pipeline_parallel_size == 1 and alone.max_concurrent_batches == 1
    vllm = VllmPolicy(VllmConfig(4096, 64, pipeline_parallel_size=2))
    assert vllm.pipeline_engine == "vllm"  # vLLM V1's batch queue advances computed tokens instead


def test_a_prompts_next_chunk_waits_for_the_previous_one_to_leave_the_last_stage():
    """Sarathi's scheduler skips a request that is not paused, its prompt's chunks included: a
    1,500-token prompt in chunks of 512 makes three full trips before its first token. vLLM V1
    schedules the next chunk at once (its computed tokens advanced), so its chunks overlap."""
    r = Request("a", 1500, 2, 0.0)
    engine = _engine(_policy("sarathi", 2), [r])
    engine.run()
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert r.token_times[0] == pytest.approx(3 * TRIP)
    starts, durations = list(engine.log.start), list(engine.log.duration)
    for k in range(1, 3):  # each chunk's stage 1 begins after the chunk before has come out
        assert starts[k] >= starts[k - 1] + durations[k - 1]

    v = Request("a", 1500, 2, 0.0)
    sched = Scheduler(
        VllmPolicy(VllmConfig(512, 64, pipeline_parallel_size=2)), KVCacheManager(512, 16), 4096
    )
    Engine(sched, _Stages(), ListSource([v])).run()
    assert v.token_times[0] < 2.5 * TRIP


def test_decodes_alternate_in_disjoint_micro_batches():
    """Two requests, two stages: each micro-batch holds the one that is paused, so the two decode
    one stage apart, every trip, never in the same batch."""
    a, b = Request("a", 64, 6, 0.0), Request("b", 64, 6, 0.0005)
    engine = _engine(_policy("sarathi", 2), [a, b])
    batches: list[list[str]] = []
    launch = engine._launch

    def logged(out, start):
        batches.append([s.request.request_id for s in out.scheduled])
        return launch(out, start)

    engine._launch = logged  # type: ignore[method-assign]
    engine.run()
    assert all(len(ids) == 1 for ids in batches) and len(batches) == 12
    order = [rid for _, rid in sorted([(t, "a") for t in a.token_times] + [(t, "b") for t in b.token_times])]
    assert order == ["a", "b"] * 6
    gaps = [y - x for x, y in zip(a.token_times, a.token_times[1:])]
    assert gaps == pytest.approx([TRIP] * 5)  # a's batch leaves stage 1 free for b's: no wait


def test_an_arrival_at_an_idle_engine_waits_for_the_timer():
    """The schedule loop wakes every 10 ms (SCHEDULER_LOOP_DELAY): a request arriving at 12.3 ms
    is scheduled at 20 ms."""
    r = Request("a", 64, 1, 0.0123)
    _engine(_policy("orca", 2), [r]).run()
    assert r.first_scheduled_time == pytest.approx(0.02)
    assert r.token_times[0] == pytest.approx(0.02 + TRIP)
    assert next_tick(0.02, 0.01) == 0.02 and next_tick(0.0, 0.01) == 0.0


def test_stage_one_done_with_a_batch_wakes_the_schedule_loop():
    """With a slot free, an arrival is seen when stage 1 signals a finished micro-batch, if that
    comes before the timer: a's batch leaves stage 1 at 5 ms, b (4.2 ms) is scheduled then."""
    a, b = Request("a", 64, 1, 0.0), Request("b", 64, 1, 0.0042)
    _engine(_policy("sarathi", 2), [a, b], _Stages(0.001, (0.004, 0.030), 0.0)).run()
    assert b.first_scheduled_time == pytest.approx(0.005)


def test_a_victim_in_flight_leaves_its_batch():
    """Preemption takes the tail of the running list, which may be in flight: its outputs are
    dropped when the batch returns (Sarathi's on_step_completed skips a waiting sequence)."""
    sched = Scheduler(_policy("sarathi", 2), KVCacheManager(64, 16), 4096)
    r, s = Request("r", 32, 4, 0.0), Request("s", 32, 4, 0.0)
    out = SchedulerOutput()
    for request in (r, s):
        sched.waiting.add_request(request)
        sched.waiting.pop_request()
        sched.allocate(request, 33)
        sched.admit(request, 0.0)
        request.num_computed_tokens = 32
        out.scheduled.append(ScheduledRequest(request, 1, 32))
        sched.batch_of[request] = out  # type: ignore[index]
    out.decode_head = (2, 64)
    sched.preempt_by_recompute(s)
    assert [i.request for i in out.scheduled] == [r] and out.decode_head is None
    assert sched.batch_of == {r: out}
    assert sched.kv_cache.num_held("s") == 0


@pytest.mark.parametrize("name", ["sarathi", "orca", "vllm-v0", "vllm-v0-chunked"])
@pytest.mark.parametrize("pp", [2, 3])
def test_every_request_finishes_no_request_is_in_two_batches_and_kv_is_conserved(name, pp, monkeypatch):
    """Under KV pressure (preemptions, victims in flight among them) every request ends with
    exactly its tokens, at most ``pp`` batches are in flight, and no request is scheduled while
    its batch is (the integrity check runs after every applied batch)."""
    requests = [Request(f"r{i}", 40 + (97 * i) % 600, 8 + (31 * i) % 90, 0.004 * i) for i in range(60)]
    stages = _Stages(stages=(STAGE,) * pp)
    engine = _engine(_policy(name, pp), requests, stages, blocks=96 if name != "orca" else 400)
    schedule = Scheduler.schedule
    seen = {"batches": 0, "preempted_in_flight": 0}

    def checked(self, now):
        assert len(engine._queue) < pp
        busy = set(self.batch_of)
        out = schedule(self, now)
        # (A victim taken from its batch in flight may be admitted again in the same pass.)
        assert not (busy - set(out.preempted)) & {s.request for s in out.scheduled}
        seen["preempted_in_flight"] += len(busy & set(out.preempted))
        seen["batches"] += not out.is_empty
        return out

    monkeypatch.setattr(Scheduler, "schedule", checked)
    engine.run()
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)
    assert all(r.num_output_tokens == r.max_tokens == len(r.token_times) for r in requests)
    kv = engine.scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and engine.scheduler.batch_of == {}
    if name != "orca":  # orca reserves every request's whole length: it never preempts
        assert engine.scheduler.num_preemptions > 0
    if name == "sarathi":
        assert seen["preempted_in_flight"] > 0


def _deployment(pp: int) -> Deployment:
    return Deployment("Llama-3-70B", "H100-SXM", 4, "none", pp=pp)


@pytest.mark.parametrize("policy", ["sarathi", "orca", "vllm-v0"])
def test_a_built_engine_runs_sarathis_pipelined_engine_on_the_stages(policy):
    built = build_engine(
        _deployment(2), policy, options=BuildOptions(engine=EngineOptions(check_integrity=True))
    )
    assert built.policy_config.pipeline_parallel_size == 2
    assert built.scheduler.batch_of == {} and built.scheduler.max_concurrent_batches == 2
    requests = [Request(f"r{i}", 200 + 37 * i, 20 + i, 0.01 * i) for i in range(40)]
    engine = built.make_engine(ListSource(requests), options=EngineOptions(check_integrity=True))
    engine.run()
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)


def test_other_policies_under_pipeline_stages_are_refused_in_one_line():
    with pytest.raises(
        ValueError, match=r"sarathi, orca and vllm-v0 \(Sarathi-Serve's pipelined engine\), not sglang"
    ):
        build_engine(_deployment(2), "sglang")


def test_stages_and_no_stages_agree_where_nothing_overlaps():
    """One request at a time with a single stage's worth of layers: the pipelined engine's trip is
    the step (host + stages + send), and a lone decoding request gets a token per trip."""
    r = Request("a", 64, 4, 0.0)
    engine = _engine(_policy("vllm-v0", 2), [r])
    engine.run()
    assert r.token_times == pytest.approx([TRIP * (k + 1) for k in range(4)])


def test_the_run_file_names_the_stages_only_when_set():
    from tailserve.sim.run import recorded_flags

    assert "pipeline_parallel_size" not in recorded_flags(SarathiConfig())
    assert recorded_flags(replace(SarathiConfig(), pipeline_parallel_size=2))["pipeline_parallel_size"] == 2


def test_explain_names_sarathis_chunk_wait_under_stages(capsys):
    from tailserve.cli.app import main

    argv = ["simulate", "--model", "Llama-3-70B", "--hardware", "H100-SXM", "--tp", "4", "--pp", "2"]
    argv += [
        "--policy",
        "sarathi",
        "--workload",
        "chat",
        "--rate",
        "8",
        "--num-requests",
        "60",
        "--seed",
        "1",
    ]
    assert main([*argv, "--explain"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "The engine ran 2 pipeline stages (40/40 layers" in out
    assert "next chunk waits for its previous one to leave the last stage" in out


def test_tune_under_stages_prints_sarathis_flat_config_with_its_stages():
    from tailserve.executors.simulated.hardware import get_hardware
    from tailserve.policies.registry import PolicySpec
    from tailserve.tune.commands import command_line

    line = command_line(PolicySpec("sarathi", {}, {}), _deployment(2), None, get_hardware("H100-SXM"), 8192)
    assert line is not None
    assert "--sarathi_scheduler_config_chunk_size 512" in line
    assert "--parallel_config_tensor_parallel_size 4 --parallel_config_pipeline_parallel_size 2" in line


def test_swap_preemption_and_layers_the_stages_do_not_divide_are_refused():
    """Sarathi-Serve's schedulers preempt by recompute only, and its ModelConfig refuses a layer
    count the stages do not divide."""
    with pytest.raises(ValueError, match="preempts by recompute only"):
        VllmV0Config(4096, 64, preemption_mode="swap", pipeline_parallel_size=2)
    with pytest.raises(
        ValueError, match=r"layers \(80 in Llama-3-70B\) divisible by the pipeline stages \(3\)"
    ):
        build_engine(_deployment(3), "sarathi")
    assert build_engine(_deployment(3), "vllm").scheduler.pipeline_parallel_size == 3  # vLLM splits unevenly


def test_a_request_aborted_in_flight_leaves_its_batch():
    sched = Scheduler(_policy("vllm-v0", 2), KVCacheManager(64, 16), 4096)
    r = Request("r", 32, 4, 0.0)
    sched.waiting.add_request(r)
    sched.waiting.pop_request()
    sched.allocate(r, 32)
    sched.admit(r, 0.0)
    out = SchedulerOutput()
    out.scheduled.append(ScheduledRequest(r, 32, 0))
    sched.batch_of[r] = out  # type: ignore[index]
    sched.running.remove(r)
    sched.abort(r, "no room", 0.0)
    assert out.scheduled == [] and sched.batch_of == {} and r.is_finished


def test_outputs_are_stamped_when_their_batch_leaves_the_last_stage():
    """The output thread does not wait for the schedule loop: with a 5 ms host part and 1 ms
    stages, a's batch is out at 8 ms while the loop is busy with b's (scheduled at 6 ms, stage 1
    at 11 ms); a's token is stamped at 8 ms, and a joins c in the batch the loop schedules at once
    after b's, at 11 ms."""
    a, b, c = Request("a", 16, 3, 0.0), Request("b", 16, 3, 0.0055), Request("c", 16, 3, 0.0105)
    engine = _engine(_policy("sarathi", 3), [a, b, c], _Stages(0.005, (0.001,) * 3, 0.0))
    batches: list[tuple[float, list[str]]] = []
    launch = engine._launch

    def logged(out, start):
        batches.append((start, [s.request.request_id for s in out.scheduled]))
        return launch(out, start)

    engine._launch = logged  # type: ignore[method-assign]
    engine.run()
    assert a.token_times[0] == pytest.approx(0.008)
    assert batches[1] == (pytest.approx(0.006), ["b"]) and batches[2] == (pytest.approx(0.011), ["a", "c"])


def test_after_a_launch_the_schedule_loop_waits_for_its_next_event():
    """Two 400-token prompts under a 512-token budget: the first fills the batch; the loop runs
    again at its next event — stage 1 done with that batch at 5 ms (host 1 ms, stages 4 ms) — not
    right after its own launch."""
    a, b = Request("a", 400, 2, 0.0), Request("b", 400, 2, 0.0)
    policy = VllmV0Policy(VllmV0Config(512, 64, pipeline_parallel_size=2))
    _engine(policy, [a, b], _Stages(0.001, (0.004, 0.004), 0.0)).run()
    assert a.first_scheduled_time == 0.0 and b.first_scheduled_time == pytest.approx(0.005)


def test_a_plan_leaves_out_pp_sizes_sarathis_engine_cannot_run(capsys):
    """tune --plan-pp with a policy of Sarathi-Serve's engine: a PP size the layers (32) do not
    divide is left out with a note; only such sizes is one line."""
    from tailserve.cli.app import main

    argv = ["tune", "--gpus", "6", "--model", "Llama-3-8B", "--hardware", "H100-SXM", "--plan-tps", "1"]
    argv += ["--plan-policy", "sarathi", "--workload", "chat", "--num-requests", "40", "--rate", "5"]
    assert main([*argv, "--plan-pp", "1,3"]) == 0
    captured = capsys.readouterr()
    assert (
        "tailserve: --plan-pp: PP 3 left out: sarathi runs in Sarathi-Serve's pipelined engine"
        in captured.err
    )
    assert "x PP 3" not in captured.out
    assert main([*argv, "--plan-pp", "3"]) == 2
    assert "none of 3 does" in capsys.readouterr().err


def test_compare_under_stages_runs_the_policies_simulated_there(capsys):
    """compare's default list under --pp: the policies simulated under stages, those of
    Sarathi-Serve's engine only where the stages divide the layers (32 at PP 3: left out)."""
    from tailserve.cli.app import main

    argv = ["compare", "--model", "Llama-3-8B", "--hardware", "H100-SXM", "--tp", "1", "--pp", "3"]
    assert main([*argv, "--workload", "chat", "--rate", "5", "--num-requests", "20", "--seed", "1"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "comparing vllm, vllm:max_num_batched_tokens=2048, trtllm" in err
    assert "needs the layers (32) divisible by the stages" in err
