"""Uneven expert routing and EPLB (``executors/simulated/expert_load.py``): the fitted popularities,
the busiest rank's rows, agreement with TensorRT-LLM's measured load statistics, and what the
cost model, the KV cache and the CLI make of them."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from tailserve.executors.simulated import expert_load as X
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.executors.simulated.expert_load import ExpertLoad, busiest_rank_rows, steady_imbalance
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.kv_capacity import kv_capacity
from tailserve.executors.simulated.moe import grouped_gemm_parts
from tailserve.executors.simulated.moe_comm import LinkFit, exchange_time

EP8 = Deployment.of("DeepSeek-V3", "H200", 8, expert_parallel=True)


def _cost(**kw):
    return build_cost_model(replace(EP8, **kw)).cost_model


# ---- the popularities ---------------------------------------------------------------------------
@pytest.mark.parametrize(("imbalance", "ep"), [(0.1, 8), (0.42, 8), (1.564, 32), (3.0, 64)])
def test_the_fitted_spread_gives_the_imbalance_asked_for(imbalance, ep):
    assert steady_imbalance(ExpertLoad(imbalance), 256, ep) == pytest.approx(imbalance, rel=1e-6)


def test_uniform_routing_prices_exactly_as_before():
    args = (4096, 256, 8, 7168, 2048)
    kw = dict(weight_bytes=1.0, act_bytes=2.0, tile_m=64, ep=8)
    assert grouped_gemm_parts(*args, **kw, load=ExpertLoad()) == grouped_gemm_parts(*args, **kw)
    assert _cost()._busiest_factor(4096) == 1.0


def test_hot_experts_load_the_busiest_rank_and_eplb_spreads_it():
    rows = 8192 * 8
    uniform = busiest_rank_rows(rows, ExpertLoad(), 256, 8)
    hot = busiest_rank_rows(rows, ExpertLoad(0.42), 256, 8)
    balanced = busiest_rank_rows(rows, ExpertLoad(0.42, 32), 256, 8)
    assert uniform < balanced < hot
    assert hot / (rows / 8) == pytest.approx(1.42, abs=0.03)  # a large batch: the steady imbalance
    # a small batch is dominated by the binomial spread either way
    assert busiest_rank_rows(8, ExpertLoad(0.42), 256, 8) < 8


def test_an_imbalance_no_rank_can_show_is_refused():
    with pytest.raises(ValueError, match="beyond what 8 EP ranks can show"):
        steady_imbalance(ExpertLoad(9.0), 256, 8)
    with pytest.raises(ValueError, match="finite ratio >= 0"):
        ExpertLoad(-0.1)


# ---- agreement with the measured statistics (TensorRT-LLM tech blog 4, Table 1) ------------------
def test_one_fitted_number_predicts_the_others_of_tensorrt_llms_table():
    # fitted: the per-rank imbalance without EPLB (1.564 at EP 32, 1,024 rows a rank)
    imbalance, std = X.measured_imbalance(ExpertLoad(1.564), 256, 32, 1024)
    assert imbalance == pytest.approx(1.564, rel=0.02)
    assert std * 1024 == pytest.approx(491.6, rel=0.05)  # predicted: the per-rank std
    w = X.lognormal_weights(256, X._sigma_for(1.564, 256, 32))
    expert_imb, expert_std = X.load_statistics(np.tile(w, (8, 1)), 128)
    assert expert_imb == pytest.approx(10.948, rel=0.1)  # predicted: the hottest expert
    assert expert_std * 128 == pytest.approx(164.1, rel=0.1)
    # EPLB, 288 slots at EP 32 (its estimate error fitted to 0.109) and at EP 36 (predicted: 0.115)
    assert X.load_statistics(X.eplb_layers(w, 32, 32), 1024)[0] == pytest.approx(0.109, rel=0.1)
    assert X.load_statistics(X.eplb_layers(w, 36, 32), 1024)[0] == pytest.approx(0.115, rel=0.1)


# ---- the cost model ------------------------------------------------------------------------------
def test_the_busiest_rank_sets_the_moe_layer_and_eplb_takes_most_of_it_back():
    uniform, hot = _cost(), _cost(expert_imbalance=0.42)
    eplb = _cost(expert_imbalance=0.42, enable_eplb=True, num_redundant_experts=32)
    big = 16384  # a prefill-sized step: the experts compute-bound
    assert hot._experts(big) > 1.2 * uniform._experts(big)
    assert uniform._experts(big) < eplb._experts(big) < hot._experts(big)
    # a decode step: EPLB's extra local experts are more weights to read
    assert eplb._experts(64) > uniform._experts(64)


def test_deepep_waits_for_the_busiest_receiver_an_all_gather_does_not():
    hw = get_hardware("H200")
    fallback = LinkFit(10e-6, 0.7)
    kw = dict(tokens=256, dp=8, tp=1, hidden=7168, k=8, num_experts=256, act_bytes=2.0)
    for backend in ("deepep_low_latency", "deepep_high_throughput"):
        assert exchange_time(backend, hw, fallback, **kw, receive_factor=1.5) > exchange_time(
            backend, hw, fallback, **kw
        )
    gather = "allgather_reducescatter"
    assert exchange_time(gather, hw, fallback, **kw, receive_factor=1.5) == exchange_time(
        gather, hw, fallback, **kw
    )


def test_redundant_experts_take_kv_memory():
    cm = _cost(enable_eplb=True, num_redundant_experts=32)
    m = cm.model
    assert cm.redundant_expert_bytes == 32 * m.expert_params * m.expert_bytes_per_param * m.num_moe_layers / 8
    hw = cm.hardware
    plain = kv_capacity(m, hw, 8, 0.9, 16, 8192)
    with_slots = kv_capacity(m, hw, 8, 0.9, 16, 8192, extra_weights=cm.redundant_expert_bytes)
    assert with_slots.num_blocks < plain.num_blocks


def test_what_the_engines_refuse_is_refused():
    with pytest.raises(ValueError, match="num_redundant_experts is set to 8 but EPLB is not enabled"):
        replace(EP8, num_redundant_experts=8)
    with pytest.raises(ValueError, match="enable_expert_parallel must be True to use EPLB"):
        Deployment.of("DeepSeek-V3", "H200", 8, enable_eplb=True)
    with pytest.raises(ValueError, match="do not split over 8 EP ranks"):
        _cost(enable_eplb=True, num_redundant_experts=3)
    with pytest.raises(ValueError, match="need an MoE model with --enable-expert-parallel"):
        build_cost_model(Deployment.of("DeepSeek-V3", "H200", 8, expert_imbalance=0.4))


def test_simulate_names_the_busiest_rank_and_the_memory():
    out = subprocess.run(
        [sys.executable, "-m", "tailserve", "simulate", "--model", "DeepSeek-V3", "--hardware", "H200",
         "--tp", "8", "--enable-expert-parallel", "--expert-imbalance", "0.42", "--enable-eplb",
         "--num-redundant-experts", "32", "--workload", "chat", "--num-requests", "20"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "the busiest rank routes 1.03x the mean at a large batch (1.42x without EPLB)" in out.stderr
    assert "9.5 GiB per GPU from the KV cache" in out.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "tailserve", "simulate", "--model", "DeepSeek-V3", "--hardware", "H200",
         "--tp", "8", "--num-redundant-experts", "8", "--workload", "chat", "--num-requests", "5"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "EPLB is not enabled" in bad.stderr


def test_explain_names_the_uneven_routing_and_eplb():
    from tailserve.core.engine import EngineOptions
    from tailserve.metrics.attribution import explain_run
    from tailserve.policies.registry import PolicySpec
    from tailserve.sim.run import run_policy
    from tailserve.sim.workload_builder import WorkloadBuilder
    from tailserve.sim.workload_spec import WorkloadSpec

    workload = WorkloadBuilder(WorkloadSpec("chat", num_requests=30, rate=4.0, seed=1))

    def summary(**kw):
        built = build_cost_model(replace(EP8, **kw))
        run = run_policy(
            built, PolicySpec.make("vllm", {}), workload, options=EngineOptions(record_batches=True)
        )
        return explain_run(run).summary

    hot = summary(expert_imbalance=0.42)
    assert "Routing was uneven (expert imbalance 0.42)" in hot and "--enable-eplb" in hot
    assert "busiest expert-parallel rank, 1.42x the mean share" in hot
    balanced = summary(expert_imbalance=0.42, enable_eplb=True, num_redundant_experts=32)
    assert "1.03x the mean share at a large batch with EPLB (1.42x without)" in balanced
    assert "simulate it with" not in balanced
    assert "Routing was uneven" not in summary()


def test_a_capacity_plan_drops_the_routing_for_its_tensor_parallel_expert_layouts():
    # tune --gpus N --plan-ep both with --enable-eplb: a layout without EP has nothing to balance
    from tailserve.policies.registry import PolicySpec
    from tailserve.sim.workload_spec import WorkloadSpec
    from tailserve.tune.cluster_plan import Layout, run_layout

    d = Deployment.of(
        "Qwen3-30B-A3B",
        "H100",
        2,
        expert_parallel=True,
        expert_imbalance=0.3,
        enable_eplb=True,
        num_redundant_experts=16,
    )
    spec = WorkloadSpec("chat", num_requests=8, rate=2.0, seed=1)
    for ep in (False, True):
        run = run_layout(Layout(1, 0, 2, ep), d, PolicySpec.make("vllm", {}), spec, "round-robin", "ib-ndr")
        assert len(run.requests) == 8
        cost = run.stages["replicas"].replicas[0].engine.executor.cost_model
        assert cost.expert_load == (d.expert_load if ep else ExpertLoad())


def test_a_tune_results_file_keeps_its_keys_at_uniform_routing():
    # the routing fields are left out of a run's description at their defaults: a results file
    # written before they existed resumes
    from tailserve.policies.registry import PolicySpec
    from tailserve.sim.workload_spec import WorkloadSpec
    from tailserve.tune.sweep import RunSpec

    described = RunSpec(
        Deployment.of("Llama-3-8B", "H100"), WorkloadSpec("chat"), PolicySpec.make("vllm", {})
    ).describe()
    assert not {"expert_imbalance", "enable_eplb", "num_redundant_experts"} & set(described["deployment"])
    hot = RunSpec(
        replace(EP8, expert_imbalance=0.42), WorkloadSpec("chat"), PolicySpec.make("vllm", {})
    ).describe()
    assert hot["deployment"]["expert_imbalance"] == 0.42


def test_exchange_of_no_tokens_is_free_under_uneven_routing():
    cm = _cost(expert_imbalance=0.42, dp=8, tp=1, all2all_backend="deepep_low_latency")
    assert cm.exchange_time(0) == 0.0


def test_the_roofline_bound_and_the_replicas_note_see_the_routing():
    from tailserve.executors.simulated.cost_model import BatchShape

    shape = BatchShape.of([(4096, 0)], [])
    assert _cost(expert_imbalance=0.42).roofline(shape).compute_s[0] > _cost().roofline(shape).compute_s[0]
    out = subprocess.run(
        [sys.executable, "-m", "tailserve", "simulate", "--model", "Qwen3-30B-A3B", "--hardware", "H100", "--tp", "2",
         "--enable-expert-parallel", "--expert-imbalance", "0.3", "--replicas", "2", "--workload", "chat",
         "--num-requests", "10"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stderr.count("expert imbalance 0.3 over 2 EP ranks") == 1


def test_a_data_parallel_explain_says_the_routing_and_the_streaming():
    out = subprocess.run(
        [sys.executable, "-m", "tailserve", "simulate", "--model", "Qwen3-30B-A3B", "--hardware", "H100", "--tp", "1",
         "--dp", "2", "--enable-expert-parallel", "--expert-imbalance", "0.3", "--policy", "vllm:stream_interval=4",
         "--workload", "chat", "--num-requests", "30", "--rate", "4", "--seed", "1", "--explain"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "Routing was uneven (expert imbalance 0.3)" in out.stdout
    assert "Streaming holds tokens back (stream_interval=4 (tokens))" in out.stdout
