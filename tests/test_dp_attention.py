"""Data-parallel attention with expert parallelism: the MoE layer's token exchange, the DP
group's step time, the lockstep simulation behind the engine's balancer, and MLA's TP
replication and fitted block."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest

from tailserve.cli import main
from tailserve.cluster import ReplicaState, RouteRequest, make_router
from tailserve.cluster.build import workload_requests
from tailserve.cluster.cluster import Stage, run_aggregated
from tailserve.cluster.dp_group import LockstepStage, build_dp_stage
from tailserve.cluster.replica import ReplicaSpec
from tailserve.executors.simulated.cost_model import BatchShape, CostModel
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.executors.simulated.hardware import LinkFit, get_hardware
from tailserve.executors.simulated.kv_capacity import kv_capacity
from tailserve.executors.simulated.models import get_model
from tailserve.executors.simulated.moe_comm import exchange_time, remote_ranks
from tailserve.policies.registry import PolicySpec
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.workloads.lengths import parse_length

H200 = get_hardware("H200")
DEEPSEEK = get_model("deepseek-v3")
QWEN_MOE = get_model("Qwen3-30B-A3B")


@pytest.mark.parametrize("experts,k,ep", [(8, 2, 4), (8, 3, 2), (16, 4, 8), (12, 1, 3)])
def test_remote_ranks_counts_subsets(experts, k, ep):
    """Against every equally likely choice of k experts: the other ranks holding one of them."""
    local = experts // ep
    subsets = list(itertools.combinations(range(experts), k))
    mean = sum(len({e // local for e in s} - {0}) for s in subsets) / len(subsets)
    assert remote_ranks(k, experts, ep) == pytest.approx(mean)


def test_exchange_bytes_by_backend():
    fallback = LinkFit(0.0, 1.0)
    bare = replace(H200, moe_exchange=None)  # every phase at the fallback: bytes / link
    link = H200.interconnect_bandwidth
    common = dict(tokens=64, dp=8, tp=1, hidden=7168, k=8, num_experts=256, act_bytes=2.0)
    ag = exchange_time("allgather_reducescatter", bare, fallback, **common)
    assert ag == pytest.approx(2 * 7 / 8 * 8 * 64 * 7168 * 2 / link)  # all-gather + reduce-scatter
    ht = exchange_time("deepep_high_throughput", bare, fallback, **common)
    assert ht == pytest.approx(2 * 64 * remote_ranks(8, 256, 8) * 7168 * 2 / link)
    ll = exchange_time("deepep_low_latency", bare, fallback, **common)
    assert ll == pytest.approx(64 * 8 * 7 / 8 * 7168 * ((1 + 4 / 128) + 2) / link)
    assert exchange_time("deepep_low_latency", bare, fallback, **{**common, "dp": 1}) == 0.0
    # the fitted figures add each phase's latency
    assert exchange_time("deepep_low_latency", H200, fallback, **common) > ll


def test_deepep_phase_floor_and_per_token():
    """A DeepEP phase is ``max(floor, latency + tokens x per_token + bytes / (link x eff))``."""
    link = H200.interconnect_bandwidth
    phase = LinkFit(100e-6, 0.5, 200e-9, 250e-6)
    hw = replace(H200, moe_exchange=replace(H200.moe_exchange, ht_dispatch=phase, ht_combine=phase))
    common = dict(dp=8, tp=1, hidden=7168, k=8, num_experts=256, act_bytes=2.0)

    def line(tokens):
        moved = tokens * remote_ranks(8, 256, 8) * 7168 * 2
        return 100e-6 + tokens * 200e-9 + moved / (link * 0.5)

    fallback = LinkFit(0.0, 1.0)
    assert line(16) < 250e-6  # below the floor: the floor
    assert exchange_time("deepep_high_throughput", hw, fallback, tokens=16, **common) == pytest.approx(
        2 * 250e-6
    )
    assert line(8192) > 250e-6
    assert exchange_time("deepep_high_throughput", hw, fallback, tokens=8192, **common) == pytest.approx(
        2 * line(8192)
    )


def test_nccl_collective_takes_the_faster_protocol():
    """A group with two fitted protocols prices each size at the faster line."""
    link = H200.interconnect_bandwidth
    small, large = LinkFit(5e-6, 0.2), LinkFit(20e-6, 0.8)
    fits = replace(
        H200.moe_exchange, all_gather=((8, small), (8, large)), reduce_scatter=((8, small), (8, large))
    )
    hw = replace(H200, moe_exchange=fits)
    common = dict(dp=8, tp=1, hidden=7168, k=8, num_experts=256, act_bytes=2.0)
    for tokens in (1, 64, 4096):
        moved = 7 / 8 * 8 * tokens * 7168 * 2
        line = min(f.latency + moved / (link * f.efficiency) for f in (small, large))
        got = exchange_time("allgather_reducescatter", hw, LinkFit(0.0, 1.0), tokens=tokens, **common)
        assert got == pytest.approx(2 * line)


def test_dp_one_is_the_engine_as_before():
    cm = CostModel(QWEN_MOE, H200, 2)
    same = cm.with_data_parallel(1)
    for shape in (BatchShape.of([(2048, 0)], []), BatchShape.of([], [1000] * 16)):
        assert same.iteration_time(shape) == cm.iteration_time(shape)


def test_impossible_layouts_are_one_line():
    with pytest.raises(ValueError, match="dense: its data-parallel ranks are independent replicas"):
        CostModel(get_model("Llama-3-8B"), H200, 1, dp=2)
    with pytest.raises(ValueError, match="128 experts, not divisible by the 6 expert-parallel ranks"):
        CostModel(QWEN_MOE, H200, 2, expert_parallel=True, dp=3)
    with pytest.raises(ValueError, match="more than one H200 NVLink domain"):
        build_cost_model(Deployment.of("deepseek-v3", "H200", 8, dp=2))
    with pytest.raises(ValueError, match="--all2all-backend 'pplx'"):
        Deployment.of("deepseek-v3", "H200", 1, dp=8, all2all_backend="pplx")


def test_group_time_waits_for_the_slowest_rank_and_pads_to_the_largest():
    cm = CostModel(DEEPSEEK, H200, 1, expert_parallel=True, dp=4)
    decode = BatchShape.of([], [2000] * 8)
    prefill = BatchShape.of([(4096, 0)], [])
    uniform = cm.group_time([decode] * 4)
    assert uniform == pytest.approx(cm.iteration_time(decode))
    # idle ranks run a dummy batch: the group takes the busy rank's time
    assert cm.group_time([decode, None, None, None]) == pytest.approx(uniform)
    # one rank's prefill pads every rank's GEMMs to 4,096 rows: the decode ranks wait for it
    mixed = cm.group_time([prefill, decode, decode, decode])
    assert mixed >= cm.iteration_time(prefill) * 0.999
    assert mixed > 5 * uniform


def test_dp_spreads_the_experts_so_deepseek_fits_one_gpu_per_rank():
    with pytest.raises(ValueError, match="does not fit on H200 at TP 1"):
        kv_capacity(DEEPSEEK, H200, 1, 0.9, 16, 8192)
    cap = kv_capacity(DEEPSEEK, H200, 1, 0.9, 16, 8192, dp=8)
    assert cap.weights_gib == pytest.approx(DEEPSEEK.weight_bytes_per_shard(1, 8) / 2**30)
    assert cap.num_blocks > 0


def test_mla_down_projections_stay_whole_on_every_rank():
    m = DEEPSEEK
    replicated = m.hidden_size * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim)
    assert m.mla_replicated_params_per_layer == replicated
    assert m.attention_params_per_shard(8) == pytest.approx(
        (m.attention_params_per_layer - replicated) / 8 + replicated
    )
    # one TP-8 shard of 128 heads holds what a 16-head model holds whole
    sixteen = replace(m, num_heads=16, num_kv_heads=16)
    assert m.attention_params_per_shard(8) == pytest.approx(sixteen.attention_params_per_layer)


def test_mla_block_is_fitted_and_its_decode_run_stays_exact():
    cm = CostModel(DEEPSEEK, H200, 8)
    assert cm._mla is H200.mla and H200.mla is not None
    neutral = CostModel(DEEPSEEK, replace(H200, mla=None), 8)
    shape = BatchShape.of([], [1000] * 32)
    assert cm.iteration_time(shape) > neutral.iteration_time(shape)  # factors <= 1, fixed times >= 0
    steps = cm.decode_step_times(32, 32 * 1000 + 32, 5)
    run = cm.decode_run_times(32, 32 * 1000 + 32, 5)
    singles = [cm.iteration_time(BatchShape.of([], [1000 + j] * 32)) for j in range(5)]
    assert steps == list(run) == singles


def test_vllm_dp_balancer_scores_waiting_four_times_running():
    router = make_router("vllm-dp")
    view = [ReplicaState(0, "dp0", 1, 0, 0.0, 0.0), ReplicaState(1, "dp1", 0, 3, 0.0, 0.0)]  # 4 vs 3
    assert router.route(RouteRequest("a", 10), view, 0.0) == 1
    router.on_routed(RouteRequest("a", 10), 1, 0.0)  # now dp1 counts 4 x 1 + 3 = 7 until a scrape
    assert router.route(RouteRequest("b", 10), view, 0.0) == 0


def _run(deployment: Deployment, policy: str = "vllm", n: int = 24):
    spec = WorkloadSpec(
        name="random", num_requests=n, rate=6.0, input_len=parse_length("300"), output_len=parse_length("30")
    )
    wb = WorkloadBuilder(spec)
    policy_spec = PolicySpec.make(policy, {})
    stage = build_dp_stage(deployment, policy_spec, shares_prefixes=False)
    return stage, run_aggregated(stage, workload_requests(wb, [ReplicaSpec(deployment, policy_spec)]))


def test_lockstep_ranks_share_one_clock_and_every_step():
    stage, run = _run(Deployment.of("Qwen3-30B-A3B", "H100-SXM", 1, expert_parallel=True, dp=2))
    assert isinstance(stage, LockstepStage)
    assert all(r.is_finished for r in run.requests)
    assert len({r.now for r in stage.replicas}) == 1
    # every busy iteration of every rank starts with a group step and lasts as long as it
    steps: dict[float, float] = {}
    for replica in stage.replicas:
        for row in replica.engine.log.rows():
            assert steps.setdefault(row["start"], row["duration"]) == row["duration"]
    shared = [set(r["start"] for r in replica.engine.log.rows()) for replica in stage.replicas]
    assert shared[0] & shared[1]  # the ranks ran steps together
    assert sum(r.num_routed for r in stage.replicas) == 24


def test_dense_dp_ranks_are_independent_replicas():
    stage, run = _run(Deployment.of("Llama-3-8B", "H100-SXM", 1, dp=2))
    assert type(stage) is Stage
    assert all(r.is_finished for r in run.requests)
    note = build_cost_model(Deployment.of("Llama-3-8B", "H100-SXM", 1, dp=2)).notes[-1]
    assert "independent replicas" in note


def test_sglang_deals_round_robin():
    stage, _ = _run(Deployment.of("Qwen3-30B-A3B", "H100-SXM", 1, expert_parallel=True, dp=2), "sglang")
    assert stage.router.name == "round-robin"
    assert [r.num_routed for r in stage.replicas] == [12, 12]


def test_cli_takes_vllms_flags(tmp_path, capsys):
    out = tmp_path / "dp.json"
    argv = ["simulate", "--model", "Qwen3-30B-A3B", "--hardware", "H100-SXM", "--tp", "1",
            "--data-parallel-size", "2", "--enable-expert-parallel", "--all2all-backend", "deepep_low_latency",
            "--workload", "random", "--input-len", "300", "--output-len", "20", "--num-requests", "20",
            "--rate", "5", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "DP 2 x TP 1 in lockstep" in capsys.readouterr().out
    assert json.loads(out.read_text())["num_finished"] == 20
    assert main(["cost", "--model", "deepseek-v3", "--hardware", "H200", "--tp", "1", "--dp", "8",
                 "--enable-expert-parallel"]) == 0  # fmt: skip
    assert "data-parallel attention: each of the 8 DP ranks" in capsys.readouterr().out
    assert main(["compare", "--model", "deepseek-v3", "--hardware", "H200", "--tp", "1", "--dp", "8"]) == 2
    assert "--data-parallel-size runs in" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("policy", "placement"),
    [("vllm", "vllm-dp"), ("sglang", "round-robin"), ("trtllm", "TensorRT-LLM's attention-DP placement")],
)
def test_a_router_is_refused_where_the_engine_places_requests_itself(tmp_path, capsys, policy, placement):
    argv = ["simulate", "--model", "Qwen3-30B-A3B", "--hardware", "H100-SXM", "--tp", "1", "--policy", policy,
            "--data-parallel-size", "2", "--enable-expert-parallel", "--workload", "random", "--input-len", "300",
            "--output-len", "20", "--num-requests", "12", "--rate", "5"]  # fmt: skip
    assert main([*argv, "--router", "least-kv"]) == 2
    err = capsys.readouterr().err
    assert "--router least-kv routes between replicas" in err and f"balancer ({placement})" in err
    assert len(err.strip().splitlines()) == 1
    out = tmp_path / "dp.json"
    assert main([*argv, "--json", str(out)]) == 0
    assert f"balancer {placement}" in capsys.readouterr().out.replace("\n", " ")
    assert json.loads(out.read_text())["stages"]["replicas"]["router"].startswith(placement)


def test_tune_searches_a_dp_engine(capsys):
    common = ["--model", "Qwen3-30B-A3B", "--hardware", "H100-SXM", "--workload", "random", "--input-len", "300",
              "--output-len", "30", "--num-requests", "60", "--rate", "4", "--slo", "ttft_p99=2s,tbt_p99=300ms",
              "--quiet"]  # fmt: skip
    assert main(["tune", *common, "--gpus", "2", "--plan-tps", "2", "--plan-dp", "2", "--plan-ep", "on"]) == 0
    out = capsys.readouterr().out
    assert "1 aggregated x TP 2 EP" in out and "1 engine x DP 2 x TP 1 EP" in out
    assert main(["tune", *common, "--tp", "1", "--dp", "2", "--enable-expert-parallel"]) == 0
    out = capsys.readouterr().out
    assert "one engine of DP 2 x TP 1" in out and "1 engine x DP 2 x TP 1 EP" in out
    assert main(["tune", *common, "--gpus", "2", "--plan-dp", "2", "--model", "Llama-3-8B"]) == 2
    assert "--plan-dp: Llama-3-8B is dense" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["deepseek-v3", "Qwen3-30B-A3B", "gpt-oss-120b", "Mixtral-8x7B"])
@pytest.mark.parametrize("gpu", ["H200", "B200", "MI355X"])
def test_a_dp_rank_is_never_faster_than_its_roofline(name, gpu):
    model = get_model(name)
    for dp, tp, ep in ((2, 1, True), (4, 2, False), (8, 1, True)):
        try:
            cm = CostModel(model, get_hardware(gpu), tp, expert_parallel=ep, dp=dp)
        except ValueError:
            continue  # experts not divisible by the ranks
        for shape in (
            BatchShape.of([(4096, 0)], []),
            BatchShape.of([], [1000] * 64),
            BatchShape.of([], [10]),
        ):
            assert cm.iteration_time(shape) >= cm.roofline(shape).limit_s
