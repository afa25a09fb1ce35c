"""The lockstep loop of the P/D pairs (``cluster/lockstep_pd.py``): a decode replica runs up to the
prefill side's next iteration (or the next decode replica's that holds requests reaching back),
not to every replica's — the same runs to the bit, in fewer turns."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from tailserve.cluster.build import build_stage, workload_requests
from tailserve.cluster.disagg import make_pd_cluster, pd_specs
from tailserve.cluster.lockstep_pd import LockstepPdCluster
from tailserve.cluster.spec import replicated
from tailserve.core.engine import EngineOptions
from tailserve.executors.simulated.deployment import Deployment
from tailserve.policies.registry import PolicySpec
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.workloads.lengths import Uniform

DEPLOYMENT = Deployment.of("Llama-3.1-8B", "H100")

PAIRS = {
    "vllm async": ("vllm", {}),
    "vllm sync": ("vllm", {"async_scheduling": "false"}),
    "vllm short of KV": ("vllm", {"num_gpu_blocks_override": "900", "max_model_len": "4096"}),
    "sglang overlap": ("sglang", {}),
    "sglang short of KV": ("sglang", {"max_total_tokens": "12000", "max_model_len": "4096"}),
}


def run_pair(policy: str, flags: dict, relaxed: bool):
    pspecs, dspecs = pd_specs(
        replicated(2, DEPLOYMENT, PolicySpec.make(policy, {})),
        replicated(3, DEPLOYMENT, PolicySpec.make(policy, flags)),
    )
    options = EngineOptions()
    p = build_stage(
        pspecs, "round-robin", shares_prefixes=False, options=options, name_prefix="p", pd_pair=True
    )
    d = build_stage(dspecs, "least-kv", shares_prefixes=False, options=options, name_prefix="d", pd_pair=True)
    cluster = make_pd_cluster(p, d, "ib-ndr")
    assert isinstance(cluster, LockstepPdCluster)
    turns = [0] * (len(dspecs) + len(pspecs))
    step = cluster._step

    def counted(i: int, t: float, horizon: float) -> None:
        turns[i] += 1
        step(i, t, horizon)

    cluster._step = counted  # type: ignore[method-assign]
    if not relaxed:  # every decode replica bounded by every replica's next iteration
        cluster._coupled_first = lambda i: cluster._first()[0]  # type: ignore[method-assign]
    wb = WorkloadBuilder(
        WorkloadSpec("random", num_requests=80, rate=30.0, seed=3, input_len=Uniform(16, 2500),
                     output_len=Uniform(1, 300))
    )  # fmt: skip
    run = cluster.run(workload_requests(wb, pspecs))
    return cluster, run, turns


@pytest.mark.parametrize("case", PAIRS)
def test_quiet_decode_replicas_run_ahead_to_the_same_results_in_fewer_turns(case):
    policy, flags = PAIRS[case]
    _, strict, strict_turns = run_pair(policy, flags, relaxed=False)
    cluster, relaxed, relaxed_turns = run_pair(policy, flags, relaxed=True)
    assert [(r.request_id, r.status, r.token_times, r.finish_time) for r in relaxed.requests] == [
        (r.request_id, r.status, r.token_times, r.finish_time) for r in strict.requests
    ]
    assert {k: asdict(v) for k, v in relaxed.pd_timeline.items()} == {
        k: asdict(v) for k, v in strict.pd_timeline.items()
    }
    nd = len(cluster.decode.replicas)
    assert relaxed_turns[nd:] == strict_turns[nd:]  # the prefill side steps as it did
    assert sum(relaxed_turns[:nd]) < 0.8 * sum(strict_turns[:nd])
    assert cluster._reaching == [0] * nd  # every request that reached back is accounted for
