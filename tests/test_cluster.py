"""The cluster simulator: one replica is a lone engine; nothing is lost and KV is conserved on
every replica for every router, aggregated and P/D; P/D with an ideal link is a TTFT-only split."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tailserve.cluster import ROUTERS
from tailserve.cluster.build import build_stage, workload_requests
from tailserve.cluster.cluster import Stage, route_request, run_aggregated
from tailserve.cluster.disagg import PdCluster, copy_request
from tailserve.cluster.metrics import cluster_summary
from tailserve.cluster.replica import FeedSource, build_replica_engine
from tailserve.cluster.spec import replicated
from tailserve.core.engine import EngineOptions
from tailserve.core.request import RequestStatus
from tailserve.core.source import ListSource
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.policies.registry import PolicySpec
from tailserve.sim.run import run_policy
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.workloads.lengths import Uniform

DEPLOYMENT = Deployment.of("Llama-3.1-8B", "H100")
CHECKED = EngineOptions(check_integrity=True)
# A small KV cache (~1,900 blocks instead of ~30,000), so the per-iteration integrity checks stay
# cheap.
SMALL_KV = {"max_model_len": "8192", "gpu_memory_utilization": "0.26"}


def shared_prefix(n: int = 120, rate: float = 30.0, seed: int = 0) -> WorkloadBuilder:
    return WorkloadBuilder(
        WorkloadSpec("shared-prefix", num_requests=n, rate=rate, seed=seed, prefix_len=512)
    )


def random_lengths(n: int = 120, rate: float = 25.0, seed: int = 1) -> WorkloadBuilder:
    return WorkloadBuilder(
        WorkloadSpec(
            "random",
            num_requests=n,
            rate=rate,
            seed=seed,
            input_len=Uniform(16, 3000),
            output_len=Uniform(1, 300),
        )
    )


def stage_for(
    wb: WorkloadBuilder, n: int, router: str, policy: str = "vllm", flags: dict | None = None, **kw
) -> tuple[Stage, list]:
    specs = replicated(n, DEPLOYMENT, PolicySpec.make(policy, flags or {}))
    stage = build_stage(
        specs, router, shares_prefixes=wb.shares_prefixes, min_max_model_len=wb.min_max_model_len, **kw
    )
    return stage, workload_requests(wb, specs)


def assert_conserved(stage: Stage) -> None:
    for replica in stage.replicas:
        engine = replica.engine
        engine.check_integrity()
        sched = engine.scheduler
        assert not sched.has_unfinished and replica.source.num_pending == 0
        assert sched.kv_cache.num_used_blocks == 0, replica.name
        assert len(engine.requests) == replica.num_routed
    assert all(not inflight for inflight in stage.router.inflight.requests)  # every finish seen


@pytest.mark.parametrize(
    ("policy", "flags"),
    [
        ("vllm", {}),
        ("sglang", {}),
        # TensorRT-LLM's fetch wait spans the cluster's events: the replica stops at each and
        # goes on with the same fetch (Engine._fetched), as a lone engine waits through
        ("trtllm", {"batch_wait_timeout_ms": 5.0}),
        ("trtllm", {"batch_wait_timeout_ms": 5.0, "disable_overlap_scheduler": True}),
        # vLLM's pipeline stages: several batches in flight across the cluster's events
        ("vllm", {"pipeline_parallel_size": 2}),
        # Sarathi-Serve's pipelined engine: its timer and stage-1 wake-ups across the events
        ("sarathi", {"pipeline_parallel_size": 2}),
        ("vllm-v0", {"pipeline_parallel_size": 4}),
    ],
)
def test_one_replica_is_a_lone_engine(policy, flags):
    wb = shared_prefix()
    deployment = replace(DEPLOYMENT, pp=flags.get("pipeline_parallel_size", 1))
    flags = {k: v for k, v in flags.items() if k != "pipeline_parallel_size"}
    ref = run_policy(build_cost_model(deployment), PolicySpec.make(policy, flags), wb)
    specs = replicated(1, deployment, PolicySpec.make(policy, flags))
    stage = build_stage(
        specs, "round-robin", shares_prefixes=wb.shares_prefixes, min_max_model_len=wb.min_max_model_len
    )
    requests = workload_requests(wb, specs)
    run = run_aggregated(stage, requests)
    assert {r.request_id: r.token_times for r in run.requests} == {
        r.request_id: r.token_times for r in ref.requests
    }


@pytest.mark.parametrize("router", list(ROUTERS))
def test_every_router_loses_nothing_and_conserves_kv(router):
    wb = shared_prefix(n=80, seed=2)
    stage, requests = stage_for(wb, 3, router, flags=SMALL_KV, options=CHECKED, scrape_interval=0.05)
    run = run_aggregated(stage, requests)
    assert len(run.requests) == 80
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in run.requests)
    assert all(len(r.token_times) == r.max_tokens for r in run.requests)
    assert_conserved(stage)
    summary = cluster_summary(run)
    assert sum(r["num_routed"] for r in summary["stages"]["replicas"]["replicas"]) == 80


def test_prefix_aware_hits_more_than_round_robin_on_shared_prefixes():
    hits = {}
    for router in ("round-robin", "prefix-aware"):
        stage, requests = stage_for(shared_prefix(n=200, rate=8.0, seed=4), 4, router)
        hits[router] = cluster_summary(run_aggregated(stage, requests))["prefix_cache"]["hit_rate_tokens"]
    assert hits["prefix-aware"] > hits["round-robin"]


@pytest.mark.parametrize("router", ["round-robin", "least-kv", "kv-aware"])
def test_pd_loses_nothing_and_conserves_kv(router):
    wb = random_lengths()
    specs = replicated(2, DEPLOYMENT, PolicySpec.make("vllm", SMALL_KV))
    prefill = build_stage(specs, router, shares_prefixes=False, options=CHECKED, name_prefix="p")
    decode = build_stage(specs, "least-requests", shares_prefixes=False, options=CHECKED, name_prefix="d")
    cluster = PdCluster(prefill, decode, "ib-ndr")
    run = cluster.run(workload_requests(wb, specs))
    assert [r.status for r in run.requests] == [RequestStatus.FINISHED_LENGTH] * 120
    assert all(len(r.token_times) == r.max_tokens for r in run.requests)
    assert_conserved(prefill)
    assert_conserved(decode)
    for r in run.requests:
        t = run.pd_timeline[r.request_id]
        if r.max_tokens == 1:
            continue
        assert t.transfer_done == pytest.approx(
            t.transfer_start + cluster.transfer_time(r, t.prefill_replica)
        )
        assert r.arrival_time < t.prefill_done <= t.transfer_start < t.transfer_done <= r.token_times[0]


def test_pd_with_an_ideal_link_is_a_ttft_only_split():
    """With the ``inf`` link: every request's prefill-side first token equals, to the bit, the
    first token of the same request with max_tokens=1 on a lone engine of the prefill policy
    (a TTFT-only run), its KV reaches the decode replica at that same instant, and the client's
    first token comes from the decode replica's first iteration after it."""
    wb = random_lengths(n=60, rate=6.0, seed=5)
    specs = replicated(1, DEPLOYMENT, PolicySpec.make("vllm", {}))
    prefill = build_stage(specs, "round-robin", shares_prefixes=False, name_prefix="p")
    decode = build_stage(specs, "round-robin", shares_prefixes=False, name_prefix="d")
    requests = workload_requests(wb, specs)
    run = PdCluster(prefill, decode, "inf").run(requests)

    lone = build_replica_engine(specs[0], FeedSource(), shares_prefixes=False).engine
    lone.source = ListSource(copy_request(r, max_tokens=1) for r in workload_requests(wb, specs))
    lone.run()
    ttft_only = {r.request_id: r.token_times[0] for r in lone.requests}
    for r in run.requests:
        t = run.pd_timeline[r.request_id]
        assert t.prefill_done == ttft_only[r.request_id]
        if r.max_tokens > 1:
            assert t.transfer_done == t.prefill_done
            assert r.token_times[0] > t.transfer_done


def test_a_finite_link_adds_exactly_its_transfer_time_to_a_lone_request():
    wb = random_lengths(n=1, seed=6)
    specs = replicated(1, DEPLOYMENT, PolicySpec.make("vllm", {}))
    ttft = {}
    for link in ("inf", "roce-100g"):
        prefill = build_stage(specs, "round-robin", shares_prefixes=False)
        decode = build_stage(specs, "round-robin", shares_prefixes=False)
        cluster = PdCluster(prefill, decode, link)
        (request,) = cluster.run(workload_requests(wb, specs)).requests
        ttft[link] = request.token_times[0] - request.arrival_time
        if link != "inf":
            expected = cluster.transfer_time(request, 0)
            # Llama-3.1-8B: 128 KiB of KV per token at TP 1, over 12.5 GB/s, plus 5 us.
            assert expected == pytest.approx(5e-6 + request.prompt_len * 131072 / 12.5e9)
    assert ttft["roce-100g"] - ttft["inf"] == pytest.approx(expected, abs=1e-9)


def test_pd_rejects_a_decode_policy_that_cannot_take_transferred_kv():
    specs = replicated(1, DEPLOYMENT, PolicySpec.make("sglang", {}))
    stage = build_stage(specs, "round-robin", shares_prefixes=False)
    with pytest.raises(ValueError, match="--decode-policy sglang: a decode replica must admit"):
        PdCluster(stage, stage, "ib-ndr")
    with pytest.raises(ValueError, match="unknown KV link 'carrier-pigeon'"):
        good = build_stage(
            replicated(1, DEPLOYMENT, PolicySpec.make("vllm", {})), "round-robin", shares_prefixes=False
        )
        PdCluster(good, good, "carrier-pigeon")


def test_sarathi_decodes_transferred_requests():
    wb = random_lengths(n=40, seed=7)
    specs = replicated(1, DEPLOYMENT, PolicySpec.make("sarathi", SMALL_KV))
    prefill = build_stage(
        replicated(1, DEPLOYMENT, PolicySpec.make("vllm", {})), "round-robin", shares_prefixes=False
    )
    decode = build_stage(specs, "round-robin", shares_prefixes=False, options=CHECKED)
    run = PdCluster(prefill, decode, "nvlink").run(workload_requests(wb, specs))
    assert all(len(r.token_times) == r.max_tokens for r in run.requests)
    assert_conserved(decode)


def test_kv_events_read_the_replicas_pools_without_counting_a_lookup():
    wb = shared_prefix(n=30, rate=5.0, seed=8)
    stage, requests = stage_for(wb, 2, "kv-aware")
    assert stage.kv_index is not None and stage.router.kv_index is stage.kv_index
    run_aggregated(stage, requests)
    probe = copy_request(requests[-1], max_tokens=1)
    probe.request_id = "probe"
    stage.kv_index.requests = {"probe": probe}
    rr = route_request(probe)
    for i, replica in enumerate(stage.replicas):
        pool = replica.engine.scheduler.kv_cache.pool
        before = (pool.stats.num_lookups, pool.stats.num_query_tokens, pool.stats.num_hit_tokens)
        found = stage.kv_index.overlap(rr, i)
        assert (pool.stats.num_lookups, pool.stats.num_query_tokens, pool.stats.num_hit_tokens) == before
        holds = replica.engine.requests and any(
            r.prompt_token_ids[:512] == probe.prompt_token_ids[:512] for r in replica.engine.requests
        )
        assert (found > 0) == bool(holds), (i, found)
