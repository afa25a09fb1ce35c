"""vLLM's prefill/decode pair with its NIXL connector (``cluster/vllm_pd.py``,
``policies/vllm_remote.py``): the decode replica reads a prompt's KV once it admits the request,
and the prefill replica keeps that KV until it is read."""

from __future__ import annotations

import pytest

from tailserve.cluster.attribution import explain_cluster, pd_breakdown
from tailserve.cluster.build import build_stage, workload_requests
from tailserve.cluster.disagg import make_pd_cluster, pd_specs
from tailserve.cluster.metrics import cluster_summary
from tailserve.cluster.spec import replicated
from tailserve.cluster.vllm_pd import VllmPdCluster
from tailserve.core.engine import EngineOptions
from tailserve.core.request import Request, RequestStatus
from tailserve.executors.simulated.deployment import Deployment
from tailserve.policies.registry import PolicySpec
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.workloads.lengths import Uniform

DEPLOYMENT = Deployment.of("Llama-3.1-8B", "H100")
CHECKED = EngineOptions(check_integrity=True)
SYNC = {"async_scheduling": "false"}


def blocks(n: int, context: int = 8000) -> dict:
    """A KV pool of ``n`` 16-token blocks (vLLM's --num-gpu-blocks-override) and a context it fits."""
    return {"num_gpu_blocks_override": str(n), "max_model_len": str(min(context, 16 * n))}


def pair(requests, prefill=None, decode=None, *, n_prefill=1, n_decode=1, link="ib-ndr"):
    pspecs, dspecs = pd_specs(
        replicated(n_prefill, DEPLOYMENT, PolicySpec.make("vllm", prefill or {})),
        replicated(n_decode, DEPLOYMENT, PolicySpec.make("vllm", decode or {})),
    )
    p = build_stage(
        pspecs, "round-robin", shares_prefixes=False, options=CHECKED, name_prefix="p", pd_pair=True
    )
    d = build_stage(
        dspecs, "least-requests", shares_prefixes=False, options=CHECKED, name_prefix="d", pd_pair=True
    )
    cluster = make_pd_cluster(p, d, link)
    assert isinstance(cluster, VllmPdCluster)
    if callable(requests):
        requests = requests(pspecs)
    return cluster, cluster.run(requests)


def conserved(cluster) -> None:
    for stage in (cluster.prefill, cluster.decode):
        for replica in stage.replicas:
            engine = replica.engine
            engine.check_integrity()
            sched = engine.scheduler
            assert not sched.has_unfinished and replica.source.num_pending == 0, replica.name
            assert not sched.held and sched.kv_cache.num_used_blocks == 0, replica.name


@pytest.mark.parametrize("flags", [{}, SYNC])
def test_the_pair_loses_nothing_and_conserves_kv(flags):
    wb = WorkloadBuilder(
        WorkloadSpec("random", num_requests=120, rate=25.0, seed=1, input_len=Uniform(16, 3000),
                     output_len=Uniform(1, 300))
    )  # fmt: skip
    small = {**flags, **blocks(700, 4096)}  # ~11k tokens a side: reads wait for room
    cluster, run = pair(lambda specs: workload_requests(wb, specs), small, small, n_prefill=2, n_decode=2)
    assert [r.status for r in run.requests] == [RequestStatus.FINISHED_LENGTH] * 120
    assert all(len(r.token_times) == r.max_tokens for r in run.requests)
    conserved(cluster)
    waited = 0
    for r in run.requests:
        t = run.pd_timeline[r.request_id]
        if r.max_tokens == 1:
            assert t.transfer_done is None
            continue
        assert r.arrival_time <= t.prefill_scheduled < t.prefill_done <= t.transfer_start < t.transfer_done
        assert t.transfer_done < r.token_times[0]
        waited += t.transfer_start > t.prefill_done
    assert waited  # some reads waited for the decode side to admit them


def test_a_lone_request_is_read_when_admitted_and_decodes_after():
    request = Request("a", prompt_len=2000, max_tokens=3, arrival_time=1.0)
    cluster, run = pair([request], SYNC, SYNC)
    (r,) = run.requests
    t = run.pd_timeline["a"]
    assert t.transfer_start == t.prefill_done  # the idle decode replica admits it at once
    assert t.transfer_done == pytest.approx(t.transfer_start + cluster.transfer_seconds(2000, 0))
    log = cluster.decode.replicas[0].engine.log
    # Its first step computes the last prompt token (the read prompt was all of it) at the load's end.
    assert log.num_prefill_tokens[0] + log.num_decode_tokens[0] == 1 and log.start[0] == t.transfer_done
    assert r.token_times[0] == pytest.approx(t.transfer_done + log.duration[0])


def test_a_decode_side_short_of_kv_holds_the_prefill_side_back():
    """ "b" cannot be admitted on the decode side while "a" decodes, so its prompt stays on the
    prefill side, which then has no room for "c" until "b" is read."""
    requests = [
        Request("a", prompt_len=3000, max_tokens=200, arrival_time=0.0),
        Request("b", prompt_len=3000, max_tokens=200, arrival_time=0.01),
        Request("c", prompt_len=3000, max_tokens=5, arrival_time=0.02),
    ]
    # prefill: 320 blocks = 5,120 tokens (one held prompt and a bit); decode: 250 blocks = 4,000
    cluster, run = pair(requests, {**SYNC, **blocks(320, 4096)}, {**SYNC, **blocks(250, 4096)})
    a = run.requests[0]
    tb, tc = run.pd_timeline["b"], run.pd_timeline["c"]
    assert tb.transfer_start >= a.finish_time  # read once "a" left the decode side
    assert tc.prefill_scheduled >= tb.transfer_done  # the prefill side waited for that read
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in run.requests)
    conserved(cluster)
    # The wait is the decode side admitting "b", not the link: --explain and the summary say so.
    assert tb.decode_admitted == tb.transfer_start and tb.decode_admitted >= a.finish_time
    parts = pd_breakdown(run)
    i = [r.request_id for r in run.requests if r.request_id in run.pd_timeline].index("b")
    assert parts["decode_admission_wait"][i] == pytest.approx(tb.decode_admitted - tb.prefill_done)
    assert parts["link_wait"][i] == 0.0
    summary = cluster_summary(run)
    assert summary["decode_admission_wait_s"]["p99"] > summary["kv_transfer_s"]["p99"]
    assert summary["kv_transfer_s"]["p99"] == pytest.approx(cluster.transfer_seconds(3000, 0), rel=0.01)
    lines = explain_cluster(run)["lines"]
    assert any("decode admission wait" in line for line in lines)
    assert any(line.startswith("  Most of it") and "decode side is full" in line for line in lines)


def test_refusals_and_one_token_requests_free_the_prefill_copy():
    requests = [
        Request("one", prompt_len=500, max_tokens=1, arrival_time=0.0),  # done on the prefill side
        Request("big", prompt_len=3000, max_tokens=10, arrival_time=0.1),  # too long for the decode side
    ]
    cluster, run = pair(requests, {}, blocks(250, 2048))
    one, big = run.requests
    assert one.status is RequestStatus.FINISHED_LENGTH and len(one.token_times) == 1
    assert big.status is RequestStatus.FINISHED_REJECTED
    conserved(cluster)


def test_a_decode_replica_counts_the_requests_it_reads_as_waiting():
    """A router reads a decode replica's waiting count as vLLM's metrics give it, which counts
    the requests holding KV while they wait (``get_request_counts``: ``kv_holding_waiting``)."""
    requests = [Request(f"r{i}", prompt_len=3000, max_tokens=50, arrival_time=0.01 * i) for i in range(4)]
    cluster, _ = pair(requests, SYNC, {**SYNC, **blocks(250, 4096)})
    replica = cluster.decode.replicas[0]
    sched = replica.engine.scheduler
    waiting_only = replica.state(0.0).num_waiting
    sched.loading.append(Request("held", prompt_len=10, max_tokens=2, arrival_time=0.0))
    try:
        assert replica.state(0.0).num_waiting == waiting_only + 1
    finally:
        sched.loading.pop()


def test_decode_routing_counts_the_wait_to_be_admitted_as_queueing():
    """``--explain``'s decode routing lines: a request sent to a busier decode replica queued
    there from the hand-over until the replica admitted it to read its KV, not until its first
    pass after the read (``routed_waits``)."""
    from tailserve.cluster.attribution import routed_waits

    wb = WorkloadBuilder(
        WorkloadSpec("random", num_requests=120, rate=25.0, seed=1, input_len=Uniform(16, 3000),
                     output_len=Uniform(1, 300))
    )  # fmt: skip
    pspecs, dspecs = pd_specs(
        replicated(2, DEPLOYMENT, PolicySpec.make("vllm", {})),
        replicated(2, DEPLOYMENT, PolicySpec.make("vllm", blocks(700, 4096))),
    )
    p = build_stage(pspecs, "round-robin", shares_prefixes=False, name_prefix="p", pd_pair=True)
    d = build_stage(dspecs, "round-robin", shares_prefixes=False, name_prefix="d", pd_pair=True)
    cluster = make_pd_cluster(p, d, "ib-ndr")
    run = cluster.run(workload_requests(wb, pspecs))
    waits = routed_waits(run, run.stages["decode"])
    assert waits
    for w in waits:
        t = run.pd_timeline[w.request_id]
        assert t.decode_admitted is not None
        assert w.queue == pytest.approx(t.decode_admitted - w.decision.time)
