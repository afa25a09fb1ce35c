"""``assemble.build_engine``: one assembly path, usable without running (replicas, a cluster)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tailserve.assemble import BuildOptions, build_engine
from tailserve.core.engine import EngineOptions
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.realtime import RealtimeSimExecutor
from tailserve.kv.radix_manager import RadixKVCacheManager
from tailserve.policies.registry import parse_policy_list
from tailserve.sim.run import run_policy
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec

DEPLOYMENT = Deployment("Llama-3-8B", "H100-SXM", 1, "none")
CHAT = WorkloadSpec("chat", num_requests=60, rate=8.0, seed=2)


def test_built_engine_runs_like_run_policy() -> None:
    built = build_cost_model(DEPLOYMENT)
    workload = WorkloadBuilder(CHAT)
    assembled = build_engine(
        built,
        "vllm:max_num_batched_tokens=512",
        "sim",
        BuildOptions(shares_prefixes=workload.shares_prefixes),
        source=workload.build(built.cost_model),
    )
    assert assembled.engine is not None and not assembled.engine.requests  # built, not run
    assembled.engine.run()
    reference = run_policy(built, parse_policy_list("vllm:max_num_batched_tokens=512")[0], workload)
    ours = {r.request_id: r.token_times for r in assembled.engine.requests}
    assert ours == {r.request_id: r.token_times for r in reference.requests}
    assert len(ours) == CHAT.num_requests
    assert assembled.kv_size.num_blocks == reference.config["num_kv_blocks"]


def test_replicas_from_one_cost_model_are_independent() -> None:
    built = build_cost_model(DEPLOYMENT)
    workload = WorkloadBuilder(CHAT)
    replicas = [
        build_engine(built, "sglang", "sim", source=workload.build(built.cost_model)) for _ in range(2)
    ]
    a, b = (r.engine for r in replicas)
    assert a is not None and b is not None
    assert a.scheduler is not b.scheduler and a.scheduler.kv_cache is not b.scheduler.kv_cache
    # Step one replica only: the other's clock and queues do not move.
    for _ in range(20):
        a.step()
    assert a.clock.now > 0 and b.clock.now == 0 and not b.requests
    b.run()
    a.run()
    assert [r.token_times for r in a.requests] == [r.token_times for r in b.requests]


def test_kv_manager_follows_the_policy_and_the_workload() -> None:
    radix = build_engine(DEPLOYMENT, "sglang", "sim")
    assert isinstance(radix.scheduler.kv_cache, RadixKVCacheManager)
    bare = build_engine(DEPLOYMENT, "sglang", "sim", BuildOptions(shares_prefixes=False))
    assert not isinstance(bare.scheduler.kv_cache, RadixKVCacheManager)
    swap = build_engine(DEPLOYMENT, "vllm-v0:preemption_mode=swap", "sim")
    assert swap.parts.num_cpu_blocks > 0
    no_swap = build_engine(DEPLOYMENT, "vllm-v0:preemption_mode=swap", "sim", BuildOptions(cpu_swap=False))
    assert no_swap.parts.num_cpu_blocks == 0


def test_executor_kinds_and_engine_once() -> None:
    sim = build_engine(DEPLOYMENT, "vllm", "sim")
    assert isinstance(sim.executor, SimExecutor) and sim.engine is None
    live = build_engine(DEPLOYMENT, "vllm", "realtime-sim", BuildOptions(vocab_size=1000, eos_token_ids=(2,)))
    assert isinstance(live.executor, RealtimeSimExecutor)
    assert live.label == "simulated Llama-3-8B on H100-SXM x1"
    source = WorkloadBuilder(CHAT).build(build_cost_model(DEPLOYMENT).cost_model)
    engine = sim.make_engine(source, options=EngineOptions(fast_forward=False))
    assert engine.options.fast_forward is False
    with pytest.raises(ValueError, match="already has its Engine"):
        sim.make_engine(source)


@pytest.mark.parametrize(
    ("target", "policy", "kind", "message"),
    [
        (DEPLOYMENT, "vllm", "gpu", "unknown executor kind 'gpu'; known: sim, realtime-sim, torch"),
        (DEPLOYMENT, "vllm", "torch", "executor 'torch' needs a model directory"),
        ("some/dir", "vllm", "sim", "executor 'sim' needs a simulated Deployment"),
        (DEPLOYMENT, "vllm,sglang", "sim", "one policy expected"),
        (DEPLOYMENT, "nope", "sim", "unknown policy"),
        (DEPLOYMENT, "vllm:max_model_len=10000000", "sim", "larger than the maximum number of tokens"),
    ],
)
def test_bad_builds_are_one_line_errors(target, policy, kind, message) -> None:
    with pytest.raises(ValueError, match=message):
        build_engine(target, policy, kind)


def test_assembly_does_not_import_torch() -> None:
    code = (
        "import sys; from tailserve.assemble import build_engine; "
        "from tailserve.executors.simulated.deployment import Deployment; "
        "build_engine(Deployment('Llama-3-8B', 'H100-SXM', 1, 'none'), 'vllm', 'realtime-sim'); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_executors_do_not_import_the_llm_layer() -> None:
    """SamplingParams lives in core: the torch sampler and Request need nothing from ``llm/``."""
    code = (
        "import sys; import tailserve.executors.pytorch.sampler, tailserve.core.request; "
        "from tailserve.core.request import Request; "
        "print(sorted(m for m in sys.modules if m.startswith('tailserve.llm')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    from tailserve import SamplingParams
    from tailserve.core.sampling_params import SamplingParams as core_params
    from tailserve.llm import SamplingParams as llm_params

    assert SamplingParams is core_params is llm_params
