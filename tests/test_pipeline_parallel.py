"""Pipeline parallelism: vLLM 0.32's scheduler under ``--pipeline-parallel-size`` (step for step
against vLLM's own, ``--engine vllm-pp``), the engine's batch queue through the stages in
virtual time, the stages' cost and KV, and the flags that lead there.

The golden file ``fixtures/differential/vllm_pp.json`` holds vLLM's decisions for seeded random
workloads of 2, 3 or 4 stages, async scheduling on (the V2 model runner's decode stagger) or
off, recorded by ``python -m benchmarks.differential --engine vllm-pp --record-fixture``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.helpers import Stages

from tailserve.assemble.build import BuildOptions, build_engine
from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.core.source import ListSource
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.executors.simulated.pipeline import Pipeline, pp_partition, stage_link
from tailserve.kv.paged import KVCacheManager
from tailserve.policies.vllm import VllmConfig, VllmPolicy
from tailserve.policies.vllm_pipeline import DecodeStagger, max_concurrent_batches
from tailserve.validate.golden import check_entry, load_fixture
from tailserve.validate.tailserve_side import run_tailserve
from tailserve.validate.workload import from_compact

FIXTURE = Path(__file__).parent / "fixtures" / "differential" / "vllm_pp.json"


@pytest.fixture(scope="module")
def golden() -> dict:
    return load_fixture(FIXTURE)


def test_golden_pp_spec_traces_are_step_identical():
    """Speculative decoding under pipeline parallelism (async scheduling: vLLM 0.32's default on
    the V2 model runner, drafts in the worker): vLLM's decisions for 240 seeded workloads of 2, 3
    or 4 stages, n-gram (GPU) or EAGLE drafts, recorded by ``python -m benchmarks.differential
    --engine vllm-pp-spec --record-fixture``."""
    golden = load_fixture(FIXTURE.with_name("vllm_pp_spec.json"))
    assert golden["engine"] == "vllm-pp-spec" and golden["version"] == "0.32.0"
    entries = golden["workloads"]
    specs = [from_compact(e["workload"]) for e in entries]
    assert {w.scheduler.pipeline_parallel_size for w in specs} == {2, 3, 4}
    assert {w.scheduler.speculative_method for w in specs} == {"ngram_gpu", "eagle"}
    assert all(w.scheduler.async_scheduling and w.scheduler.num_speculative_tokens for w in specs)
    mismatches = [m for i, e in enumerate(entries) if (m := check_entry(i, e, run_tailserve)) is not None]
    assert not mismatches, f"{len(mismatches)} of {len(entries)} differ; first:\n" + mismatches[0].describe()


def test_the_drafter_runs_on_the_last_stage(monkeypatch):
    """vLLM builds the drafter on the last PP rank only: a step's drafting is the last stage's,
    the rest of the forward pass split over the stages by layers as without drafts."""
    spec = "vllm:speculative_method=eagle:num_speculative_tokens=2:synthetic_acceptance_length=2"
    built = build_engine(_h100_70b(2), spec)
    assert built.scheduler.async_scheduling and built.scheduler.pipeline_parallel_size == 2
    requests = [Request(f"r{i}", 300, 20, 0.0) for i in range(8)]
    engine = built.make_engine(ListSource(requests), options=EngineOptions(check_integrity=True))
    executor = engine.executor
    split = []
    original = type(executor)._on_stages

    def spy(self, result, num_tokens, num_logits, last_stage=0.0):
        work = result.duration - result.host_time
        out = original(self, result, num_tokens, num_logits, last_stage)
        split.append((out.stages, last_stage, work, num_tokens, num_logits))
        return out

    monkeypatch.setattr(type(executor), "_on_stages", spy)
    engine.run()
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)
    drafted = [entry for entry in split if entry[1] > 0]
    assert drafted
    for stages, tail, work, num_tokens, num_logits in drafted:
        forward, _ = executor.cost_model.pipeline_split(work - tail, num_tokens, num_logits)
        assert stages == pytest.approx((*forward[:-1], forward[-1] + tail))
        assert sum(stages) == pytest.approx(work)


def test_eagle3_under_stages_needs_a_decoder_that_relays_aux_hidden_states():
    """vLLM's V2 runner refuses EAGLE-3 under PP unless the decoder relays its auxiliary hidden
    states over the stages (Llama, Qwen2 and the models built on them)."""
    spec = "vllm:speculative_method=eagle3:num_speculative_tokens=2:synthetic_acceptance_length=2"
    assert build_engine(_h100_70b(2), spec).scheduler.pipeline_parallel_size == 2
    moe = Deployment("Qwen3-30B-A3B", "H100-SXM", 2, "none", pp=2)
    with pytest.raises(ValueError, match="Qwen3-30B-A3B does not support eagle3 with pipeline parallelism"):
        build_engine(moe, spec)


def test_golden_pp_traces_are_step_identical(golden):
    assert golden["engine"] == "vllm-pp" and golden["version"] == "0.32.0"
    entries = golden["workloads"]
    assert len(entries) >= 200
    mismatches = [m for i, e in enumerate(entries) if (m := check_entry(i, e, run_tailserve)) is not None]
    assert not mismatches, f"{len(mismatches)} of {len(entries)} differ; first:\n" + mismatches[0].describe()


def test_golden_pp_covers_the_stages_the_stagger_and_stale_outputs(golden, monkeypatch):
    """The fixture reaches what it claims: 2, 3 and 4 stages with async scheduling on and off,
    decodes held back by the stagger, and preempted requests waiting while their steps are in
    flight."""
    specs = [from_compact(e["workload"]) for e in golden["workloads"]]
    assert {(w.scheduler.pipeline_parallel_size, w.scheduler.async_scheduling) for w in specs} == {
        (pp, on) for pp in (2, 3, 4) for on in (False, True)
    }
    seen = {"staggered": 0, "stale": 0}
    waits, schedule = DecodeStagger.waits, Scheduler.schedule

    def counting_waits(self, request):
        held = waits(self, request)
        seen["staggered"] += held
        return held

    def counting_schedule(self, now):
        seen["stale"] += sum(1 for r in self.waiting if r.num_stale_output_tokens)
        return schedule(self, now)

    monkeypatch.setattr(DecodeStagger, "waits", counting_waits)
    monkeypatch.setattr(Scheduler, "schedule", counting_schedule)
    for w in specs:
        run_tailserve(w)
    assert seen["staggered"] > 0 and seen["stale"] > 0, seen


def test_stale_outputs_keep_a_preempted_request_waiting_until_they_drain():
    """vLLM skips a waiting request whose preempted steps are still in the pipeline ("deliverable
    stale output still in flight"), keeping its place in the queue."""
    config = VllmConfig(64, 4, async_scheduling=False, pipeline_parallel_size=3)
    sched = Scheduler(VllmPolicy(config), KVCacheManager(8, 4), 256)
    first, second = Request("a", 8, 4, 0.0), Request("b", 8, 4, 0.0)
    first.num_stale_output_tokens = 1  # as a preemption leaves it with a step in flight
    sched.waiting.add_request(first)
    sched.waiting.add_request(second)
    out = sched.schedule(0.0)
    assert [s.request.request_id for s in out.scheduled] == ["b"]
    assert list(sched.waiting) == [first]


def test_max_concurrent_batches_is_vllms():
    """``VllmConfig.max_concurrent_batches`` on the V2 model runner (config/vllm.py:577-587)."""
    assert max_concurrent_batches(1, False) == 1
    assert max_concurrent_batches(1, True) == 2
    assert max_concurrent_batches(2, False) == 2
    assert max_concurrent_batches(4, True) == 5


@pytest.mark.parametrize(
    ("layers", "pp", "split"),
    [
        (80, 2, (40, 40)),
        (80, 3, (27, 27, 26)),
        (61, 4, (15, 15, 16, 15)),
        (126, 4, (31, 32, 32, 31)),
        (32, 32, (1,) * 32),
    ],
)
def test_layers_split_as_vllm_splits_them(layers, pp, split):
    """``get_pp_indices``: the remainder one layer apiece to the stages before the last, from the
    second-to-last back."""
    assert pp_partition(layers, pp) == split
    assert sum(split) == layers


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match=r"pipeline_parallel_size must be in 1\.\.2"):
        pp_partition(2, 3)


def test_stage_times_add_up_to_the_step_and_the_head_is_the_last_stages():
    pipe = Pipeline((27, 27, 26), stage_link(get_hardware("H100-SXM"), 4, 3), None, 100.0, 1)
    times = pipe.stage_times(0.080 + 0.004, 0.004)
    assert sum(times) == pytest.approx(0.084)
    assert times[0] == pytest.approx(0.080 * 27 / 80)
    assert times[2] == pytest.approx(0.080 * 26 / 80 + 0.004)


def test_the_stages_link_is_nvlink_in_one_domain_and_the_network_past_it():
    h100 = get_hardware("H100-SXM")
    assert stage_link(h100, 4, 2).name.startswith("NVLink")
    network = stage_link(h100, 8, 2)
    assert network.name.startswith("ib-ndr")
    # Vidur's two DGX H100 nodes: 64 MiB in 1.871 ms (send_recv.csv's last row)
    assert network.time(67108864) == pytest.approx(1.871e-3, rel=0.02)
    slower = stage_link(h100, 8, 2, "ib-hdr")
    assert slower.time(1 << 20) > network.time(1 << 20)
    # A network named puts the stages on separate nodes, inside one domain's size too (the
    # Sarathi-Serve paper's Falcon-180B: two nodes of four A100s over 100 Gb Ethernet)
    apart = stage_link(get_hardware("A100-80GB"), 4, 2, "roce-100g")
    assert apart.name.startswith("roce-100g") and apart.time(1 << 20) > stage_link(h100, 8, 2).time(1 << 20)
    with pytest.raises(ValueError, match="unknown --pp-link"):
        stage_link(h100, 8, 2, "carrier-pigeon")


def test_the_activations_sent_are_both_tensors_split_over_tp():
    model = get_model("Llama-3-70B")
    pipe = Pipeline.of(model, get_hardware("H100-SXM"), 4, 2)
    assert pipe.bytes_per_token == 2 * model.hidden_size * 2 / 4
    assert pipe.gather is not None and Pipeline.of(model, get_hardware("H100-SXM"), 1, 2).gather is None


_Stages = Stages


def _engine(requests: list[Request], pp: int, async_scheduling: bool, executor) -> Engine:
    config = VllmConfig(4096, 64, async_scheduling=async_scheduling, pipeline_parallel_size=pp)
    sched = Scheduler(VllmPolicy(config), KVCacheManager(512, 16), 4096)
    return Engine(sched, executor, ListSource(requests), options=EngineOptions(check_integrity=True))


def test_one_request_decodes_once_per_trip_through_the_pipeline():
    """Synchronous PP 2: a lone request is skipped while its step is in a stage, so each token
    takes the host part, both stages and the send between them."""
    r = Request("a", 64, 5, 0.0)
    engine = _engine([r], 2, False, _Stages(0.001, (0.010, 0.012), 0.0005))
    engine.run()
    trip = 0.001 + 0.010 + 0.0005 + 0.012
    assert r.status is RequestStatus.FINISHED_LENGTH
    gaps = [b - a for a, b in zip(r.token_times, r.token_times[1:])]
    assert gaps == pytest.approx([trip] * 4)
    assert r.token_times[0] == pytest.approx(trip)


def test_two_requests_in_two_micro_batches_fill_the_pipeline():
    """A second request that arrives while the first one's batch is being prepared goes into the
    next micro-batch (vLLM returns to its input queue until the batch queue is full): stage 1
    takes it once free, and both then decode every trip, one stage apart, the pipeline full. One
    batch of both would leave a stage idle half the time."""
    a, b = Request("a", 64, 6, 0.0), Request("b", 64, 6, 0.0005)
    engine = _engine([a, b], 2, False, _Stages(0.001, (0.010, 0.010), 0.0))
    engine.run()
    assert a.token_times[0] == pytest.approx(0.021)  # host, stage 1, stage 2
    assert b.token_times[0] == pytest.approx(0.031)  # stage 1 free at 0.011, then stage 2
    for r in (a, b):
        assert [y - x for x, y in zip(r.token_times, r.token_times[1:])] == pytest.approx([0.021] * 5)


def test_async_scheduling_waits_for_the_token_a_decode_continues_from():
    """PP 2 with async scheduling (a queue of 3, the decode stagger of 2): the request is
    scheduled again before its step's outputs are applied, but stage 1 starts only when that
    step's last stage has sampled the token (the V2 model runner's sampled-token ring)."""
    r = Request("a", 64, 5, 0.0)
    engine = _engine([r], 2, True, _Stages(0.001, (0.010, 0.012), 0.0005))
    engine.run()
    gaps = [b - a for a, b in zip(r.token_times, r.token_times[1:])]
    # the next step's host part overlaps the forward pass: a trip is the stages and the send
    assert gaps == pytest.approx([0.010 + 0.0005 + 0.012] * 4)


def _h100_70b(pp: int, tp: int = 4, **kw) -> Deployment:
    return Deployment("Llama-3-70B", "H100-SXM", tp, "none", pp=pp, **kw)


def test_each_stage_holds_its_layers_kv_so_pp_doubles_the_cache():
    one = build_engine(_h100_70b(1), "vllm")
    two = build_engine(_h100_70b(2), "vllm")
    assert two.kv_size.num_blocks > 1.9 * one.kv_size.num_blocks
    assert two.policy_config.pipeline_parallel_size == 2
    assert two.scheduler.max_concurrent_batches == 3  # async scheduling on: the V2 runner's pp + 1
    assert "x PP 2" in two.label


def test_a_simulated_run_under_pp_keeps_every_invariant():
    built = build_engine(
        _h100_70b(2), "vllm", options=BuildOptions(engine=EngineOptions(check_integrity=True))
    )
    requests = [Request(f"r{i}", 200 + 37 * i, 20 + i, 0.01 * i) for i in range(40)]
    engine = built.make_engine(ListSource(requests), options=EngineOptions(check_integrity=True))
    engine.run()
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)
    kv = engine.scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_blocks


def test_stages_price_the_step_and_the_send_on_the_slowest_link():
    cm = build_cost_model(_h100_70b(2, tp=8)).cost_model
    assert cm.pipeline is not None and cm.pipeline.link.name.startswith("ib-ndr")
    assert CostModel(get_model("Llama-3-70B"), get_hardware("H100-SXM"), 8).pipeline is None


@pytest.mark.parametrize(
    ("policy", "deployment", "message"),
    [
        ("sglang", _h100_70b(2), "simulated for the vllm policy"),
        (
            "vllm:num_speculative_tokens=2:speculative_method=eagle3:synthetic_acceptance_length=2:async_scheduling=false",
            _h100_70b(2),
            "speculative decoding under pipeline parallelism is simulated with async scheduling",
        ),
        ("vllm:pipeline_parallel_size=2", _h100_70b(1), "is the deployment's"),
    ],
)
def test_what_pp_does_not_simulate_is_one_line(policy, deployment, message):
    with pytest.raises(ValueError, match=message):
        build_engine(deployment, policy)


def test_pp_with_an_moe_data_parallel_group_is_refused():
    with pytest.raises(ValueError, match=r"pipeline stages .* is not modelled"):
        build_cost_model(Deployment("DeepSeek-V3", "H200", 4, "none", dp=2, pp=2))


def test_the_realtime_executor_refuses_pp():
    with pytest.raises(ValueError, match="not by the realtime-sim executor"):
        build_engine(_h100_70b(2), "vllm", "realtime-sim")


def test_vllm_032s_pp_flag_sets_the_deployment_and_older_ones_say_not_modelled():
    from tailserve.engines.flag_spec import DEPLOYMENT, NOT_MODELLED
    from tailserve.engines.lint import lint

    rows = {r.flag: r for r in lint("vllm serve meta-llama/Llama-3.1-70B-Instruct -tp 4 -pp 2").rows}
    assert rows["-pp"].verdict == DEPLOYMENT and rows["-pp"].feeds == "deployment.pp"
    old = {r.flag: r for r in lint("vllm serve meta-llama/Llama-3.1-70B-Instruct -pp 2", "0.11.0").rows}
    assert old["-pp"].verdict == NOT_MODELLED


def test_busy_time_counts_overlapping_micro_batches_once():
    """A pipelined replica's busy fraction is the union of its micro-batches' spans (they overlap
    in flight), not their sum; disjoint spans sum."""
    from tailserve.core.iteration_log import IterationLog

    log = IterationLog(1)
    for start, duration in ((0.0, 2.0), (1.0, 2.0), (5.0, 1.0)):
        log.record(start, duration, 0, 1, 1, 0, 0)
    assert log.busy_seconds() == pytest.approx(4.0)
    plain = IterationLog(1)
    for start, duration in ((0.0, 1.0), (1.0, 0.5), (3.0, 1.0)):
        plain.record(start, duration, 0, 1, 1, 0, 0)
    assert plain.busy_seconds() == sum(plain.duration)


def test_tune_prints_the_stages_in_vllms_line_and_lint_reads_them_back():
    from tailserve.engines.lint import lint
    from tailserve.policies.registry import PolicySpec
    from tailserve.tune.commands import command_line

    line = command_line(
        PolicySpec("vllm", {}, {}), _h100_70b(2), None, get_hardware("H100-SXM").device_info, 8192
    )
    assert "--tensor-parallel-size 4 --pipeline-parallel-size 2" in line
    rows = {r.name: r for r in lint(line).rows}
    assert (
        rows["pipeline_parallel_size"].value == 2 and rows["pipeline_parallel_size"].feeds == "deployment.pp"
    )


def test_cost_prices_each_stage_and_the_trip(tmp_path, capsys):
    import json

    from tailserve.cli.app import main

    out = tmp_path / "cost.json"
    argv = ["cost", "--model", "Llama-3-70B", "--hardware", "H100-SXM", "--tp", "4", "--pp", "2"]
    assert main([*argv, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "decode on 2 stages (40/40 layers)" in text
    got = json.loads(out.read_text())
    decode = got["pipeline"]["decode"]
    overhead = got["decode_s"] - sum(decode["stages_s"])  # the host's part, once
    assert decode["trip_s"] == pytest.approx(got["decode_s"] + decode["send_s"])
    assert overhead > 0 and decode["stages_s"][1] > decode["stages_s"][0]  # the LM head's stage


def test_explain_says_the_run_crossed_pipeline_stages(capsys):
    from tailserve.cli.app import main

    argv = ["simulate", "--model", "Llama-3-70B", "--hardware", "H100-SXM", "--tp", "4", "--pp", "2"]
    argv += ["--workload", "chat", "--rate", "8", "--num-requests", "60", "--seed", "1", "--explain"]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "The engine ran 2 pipeline stages (40/40 layers" in out


def test_a_busy_receiving_stage_takes_the_send_after_its_previous_batch():
    """vLLM posts the receive in the stage's own execute_model: a send to a stage still on its
    previous batch starts after it (it does not hide behind that batch)."""
    a, b = Request("a", 64, 3, 0.0), Request("b", 64, 3, 0.0005)
    engine = _engine([a, b], 2, False, _Stages(0.001, (0.010, 0.010), 0.002))
    engine.run()
    # a: stage 1 0.001-0.011, send to 0.013, stage 2 0.013-0.023
    assert a.token_times[0] == pytest.approx(0.023)
    # b: stage 1 0.011-0.021, stage 2 free at 0.023, then the send, then 0.025-0.035
    assert b.token_times[0] == pytest.approx(0.035)


def test_cost_checks_the_fit_on_a_stage(capsys):
    from tailserve.cli.app import main

    argv = ["cost", "--model", "DeepSeek-V3", "--hardware", "H100-SXM", "--tp", "8"]
    assert main([*argv, "--pp", "2"]) == 0
    capsys.readouterr()
    assert main(argv) != 0  # the whole model at TP 8 does not fit: one line, with the PP hint
    assert "or split the layers over nodes: --tp 8 --pipeline-parallel-size 2" in capsys.readouterr().err


def test_a_cluster_item_takes_its_own_stages_or_the_runs():
    from tailserve.cluster.spec import parse_cluster
    from tailserve.policies.registry import PolicySpec

    specs = parse_cluster("1xH100-SXM:tp4:pp2,H100-SXM:tp8", "Llama-3-70B", PolicySpec("vllm", {}, {}), pp=1)
    assert [(s.deployment.tp, s.deployment.pp) for s in specs] == [(4, 2), (8, 1)]
    assert [s.label for s in specs] == ["H100-SXM:tp4:pp2", "H100-SXM:tp8"]
    inherited = parse_cluster("2xH100-SXM:tp4", "Llama-3-70B", PolicySpec("vllm", {}, {}), pp=2)
    assert {s.deployment.pp for s in inherited} == {2}
