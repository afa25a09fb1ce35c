"""SGLang's prefill/decode pair (``cluster/sglang_pd.py``, ``policies/sglang_decode.py``): the
decode server pre-allocates KV before the prefill may start, takes the prefill's first token
without a forward pass, and parks retracted requests' KV on the host."""

from __future__ import annotations

import pytest

from tailserve.assemble import BuildOptions, build_engine
from tailserve.cluster.attribution import explain_cluster, pd_breakdown
from tailserve.cluster.build import build_stage, workload_requests
from tailserve.cluster.disagg import PdCluster, make_pd_cluster, pd_specs
from tailserve.cluster.metrics import cluster_summary
from tailserve.cluster.sglang_pd import SglangPdCluster
from tailserve.cluster.spec import replicated
from tailserve.cluster.vllm_pd import VllmPdCluster
from tailserve.core.engine import EngineOptions
from tailserve.core.request import Request, RequestStatus
from tailserve.core.source import ListSource
from tailserve.executors.simulated.deployment import Deployment
from tailserve.policies.registry import PolicySpec
from tailserve.policies.sglang_config import SglangConfig
from tailserve.policies.sglang_decode import SglangDecodePolicy, extra_slots
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.workloads.lengths import Uniform

DEPLOYMENT = Deployment.of("Llama-3.1-8B", "H100")
CHECKED = EngineOptions(check_integrity=True)
SYNC = {"disable_overlap_schedule": "true"}


def small(tokens: int, context: int = 4096) -> dict:
    """A KV pool of ``tokens`` (SGLang's --max-total-tokens) under a context that fits it."""
    return {"max_total_tokens": str(tokens), "max_model_len": str(min(context, tokens))}


def pair(
    requests, prefill=None, decode=None, *, n_prefill=1, n_decode=1, link="ib-ndr", options=CHECKED,
    prefill_name="sglang",
):  # fmt: skip
    pspecs, dspecs = pd_specs(
        replicated(n_prefill, DEPLOYMENT, PolicySpec.make(prefill_name, prefill or {})),
        replicated(n_decode, DEPLOYMENT, PolicySpec.make("sglang", decode or {})),
    )
    p = build_stage(
        pspecs, "round-robin", shares_prefixes=False, options=options, name_prefix="p", pd_pair=True
    )
    d = build_stage(
        dspecs, "least-requests", shares_prefixes=False, options=options, name_prefix="d", pd_pair=True
    )
    cluster = make_pd_cluster(p, d, link)
    if callable(requests):
        requests = requests(pspecs)
    return cluster, cluster.run(requests)


def random_workload(n=120, rate=25.0, seed=1):
    wb = WorkloadBuilder(
        WorkloadSpec("random", num_requests=n, rate=rate, seed=seed, input_len=Uniform(16, 3000),
                     output_len=Uniform(1, 300))
    )  # fmt: skip
    return lambda specs: workload_requests(wb, specs)


def conserved(cluster: PdCluster) -> None:
    for stage in (cluster.prefill, cluster.decode):
        for replica in stage.replicas:
            engine = replica.engine
            engine.check_integrity()
            sched = engine.scheduler
            assert not sched.has_unfinished and replica.source.num_pending == 0, replica.name
            assert not sched.held, replica.name  # every kept KV sent and freed
            kv = sched.kv_cache  # what stays in use is cache nobody holds (SGLang's radix tree)
            assert kv.num_used_blocks * kv.block_size == kv.evictable_tokens, replica.name
        assert all(not inflight for inflight in stage.router.inflight.requests)


def decode_prefill_tokens(cluster: PdCluster) -> int:
    return sum(sum(r.engine.log.num_prefill_tokens) for r in cluster.decode.replicas)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_pair_loses_nothing_and_conserves_kv(overlap):
    flags = {} if overlap else SYNC
    # A decode server of ~10k KV tokens, so pre-allocation waits and decodes retract.
    decode = {**flags, **small(10000)}
    cluster, run = pair(random_workload(), {**flags, **small(30000)}, decode, n_prefill=2)
    assert isinstance(cluster, SglangPdCluster)
    assert [r.status for r in run.requests] == [RequestStatus.FINISHED_LENGTH] * 120
    assert all(len(r.token_times) == r.max_tokens for r in run.requests)
    conserved(cluster)
    policy = cluster.decode.replicas[0].engine.scheduler.policy
    assert isinstance(policy, SglangDecodePolicy)
    assert policy.num_prealloc_blocked > 0  # the small server held prefills back
    assert decode_prefill_tokens(cluster) == 0  # the decode server never prefills, retracted or not
    for r in run.requests:
        t = run.pd_timeline[r.request_id]
        assert r.arrival_time <= t.bootstrapped <= t.prefill_scheduled < t.prefill_done
        assert t.prefill_done <= t.transfer_start < t.transfer_done <= r.token_times[0]


def test_a_lone_request_takes_its_first_token_from_the_prefill():
    request = Request("a", prompt_len=2000, max_tokens=4, arrival_time=1.0)
    cluster, run = pair([request], SYNC, SYNC, link="inf")
    (r,) = run.requests
    t = run.pd_timeline["a"]
    assert t.bootstrapped == t.prefill_scheduled == 1.0  # both servers idle: at once
    # The decode server wakes when the KV lands and emits the prefill's token without a forward.
    assert r.token_times[0] == t.transfer_done == t.prefill_done
    log = cluster.decode.replicas[0].engine.log
    assert list(log.num_prefill_tokens) == [0, 0, 0]  # three decode steps for tokens 2-4
    assert r.token_times[1] == pytest.approx(r.token_times[0] + log.duration[0])


def _two(decode_tokens: int):
    first = Request("a", prompt_len=1000, max_tokens=100, arrival_time=0.0)
    second = Request("b", prompt_len=1000, max_tokens=100, arrival_time=0.01)
    return pair([first, second], SYNC, {**SYNC, **small(decode_tokens, 2048)})


def test_a_decode_server_short_of_kv_holds_the_next_prefill_back():
    # With "a" running, "b" needs max(1000 + 512, 1000 + 100 - retractable) = 1512 tokens of a
    # budget of free - max(512 x 1 active, 1100 - retractable) = 3000 - (1000 + outputs) - 512:
    # it never fits while "a" runs, so its prefill waits for "a" to finish.
    cluster, run = _two(3000)
    a, _ = run.requests
    tb = run.pd_timeline["b"]
    assert tb.bootstrapped == a.finish_time  # the decode server's first turn after "a" left
    assert tb.prefill_scheduled == tb.bootstrapped  # the prefill server was idle, waiting
    explained = explain_cluster(run)
    assert any("decode prealloc wait" in line for line in explained["lines"])
    (notes,) = [r["notes"] for r in cluster_summary(run)["stages"]["decode"]["replicas"]]
    assert any("pre-allocation passes stopped" in n and "queue reached 1 requests" in n for n in notes)
    conserved(cluster)
    # With room for both, "b" is pre-allocated as it arrives.
    _, run = _two(200_000)
    assert run.pd_timeline["b"].bootstrapped == 0.01


def test_budget_and_admission_are_sglangs_formulas():
    """``_allocatable_token_budgets`` and ``_required_admission_tokens`` (decode.py:2096, :508)
    on a hand-made state."""
    engine = build_engine(
        DEPLOYMENT,
        "sglang:disaggregation_mode=decode:disable_overlap_schedule=true:max_total_tokens=5000:max_model_len=4096",
        options=BuildOptions(pd_pair=True, shares_prefixes=False),
        source=ListSource([]),
    ).engine
    sched, policy = engine.scheduler, engine.scheduler.policy
    assert isinstance(policy, SglangDecodePolicy)
    running = Request("r", prompt_len=800, max_tokens=3000, arrival_time=0.0)
    sched.allocate(running, 1000)
    running.num_computed_tokens, running.num_output_tokens = 999, 200
    sched.admit(running, 0.0)
    free = sched.kv_cache.num_free_blocks * sched.kv_cache.block_size
    assert free == 4000
    retractable = 800 + 200
    # single = min(3000, 4096) + 800 - 1000 = 2800 > 512 x 1 active
    assert policy._budget(sched, 0, retractable) == 4000 - 2800
    assert policy._budget(sched, 3, retractable) == 4000 - 2800  # 512 x 4 = 2048 still below it
    assert policy._budget(sched, 5, retractable) == 4000 - 512 * 6
    assert policy._budget(sched, 0, None) == 4000 - 512  # a resume: no single-request term
    new = Request("n", prompt_len=700, max_tokens=5000, arrival_time=0.0)
    # max(700 + 512, 700 + min(5000, 4096) - 1000) = 3796
    assert policy._admission_tokens(1, new, retractable) == 3796
    assert policy._admission_tokens(1, new, 4000) == 1212


def test_extra_slots_follow_sglangs_rule():
    assert extra_slots(SglangConfig(max_running_requests=16), 16) == 32
    assert extra_slots(SglangConfig(max_running_requests=64), 64) == 0
    assert extra_slots(SglangConfig(), 2048) == 0  # auto cap: the hook reads the flag, unset
    assert extra_slots(SglangConfig(disaggregation_decode_extra_slots=7), 2048) == 7


def test_request_slots_cap_what_is_pre_allocated():
    # max_running_requests 2 gives 2 + 4 extra slots: at most 6 requests hold one at once.
    requests = [Request(f"r{i}", prompt_len=200, max_tokens=400, arrival_time=0.0) for i in range(10)]
    cluster, run = pair(requests, SYNC, {**SYNC, "max_running_requests": "2", **small(20000)})
    boot = sorted(run.pd_timeline[r.request_id].bootstrapped for r in run.requests)
    assert boot[:6] == [0.0] * 6 and boot[6] > 0.0
    conserved(cluster)


def test_retracted_requests_are_restored_from_the_host_not_recomputed():
    # Long outputs on a small decode server: admitted on the 512-token reserve, they outgrow it.
    requests = [Request(f"r{i}", prompt_len=100, max_tokens=2000, arrival_time=0.05 * i) for i in range(4)]
    cluster, run = pair(requests, SYNC, {**SYNC, **small(4500)})
    policy = cluster.decode.replicas[0].engine.scheduler.policy
    assert policy.num_retracted >= 1 and policy.restore_seconds > 0
    assert any(r.num_preemptions for r in run.requests)
    assert all(r.status is RequestStatus.FINISHED_LENGTH and len(r.token_times) == 2000 for r in run.requests)
    assert decode_prefill_tokens(cluster) == 0
    conserved(cluster)


def test_a_prefill_refusal_releases_the_decode_servers_kv():
    request = Request("long", prompt_len=3000, max_tokens=10, arrival_time=0.0)
    cluster, run = pair([request], small(2000), {})
    (r,) = run.requests
    assert r.status is RequestStatus.FINISHED_REJECTED and "maximum context length is 2000" in r.status_reason
    conserved(cluster)
    (held,) = cluster.decode.replicas[0].engine.requests
    assert held.status is RequestStatus.FINISHED_ABORTED and held.status_reason.startswith("prefill server:")


def test_a_request_the_decode_server_can_never_take_is_rejected_before_its_prefill():
    request = Request("big", prompt_len=1800, max_tokens=10, arrival_time=0.0)
    cluster, run = pair([request], {}, small(2000))
    (r,) = run.requests
    assert r.status is RequestStatus.FINISHED_REJECTED
    assert "can never be pre-allocated on the decode server" in r.status_reason
    assert cluster.prefill.replicas[0].num_routed == 0
    conserved(cluster)


def test_fast_forward_changes_nothing():
    times = []
    for fast in (True, False):
        _, run = pair(random_workload(n=80, seed=3), {}, {}, options=EngineOptions(fast_forward=fast))
        times.append([r.token_times for r in run.requests])
    assert times[0] == times[1]


def test_the_same_seed_gives_the_same_run():
    runs = [
        pair(random_workload(n=60, seed=4), {}, small(20000), options=EngineOptions())[1] for _ in range(2)
    ]
    assert [r.token_times for r in runs[0].requests] == [r.token_times for r in runs[1].requests]


def test_an_sglang_decode_server_pairs_only_with_sglang_prefill():
    with pytest.raises(ValueError, match="pairs with SGLang prefill servers"):
        pair([Request("a", prompt_len=10, max_tokens=2, arrival_time=0.0)], {}, {}, prefill_name="vllm")


def test_a_single_engine_refuses_a_pd_mode():
    for mode in ("decode", "prefill"):
        with pytest.raises(ValueError, match="one side of a prefill/decode pair"):
            build_engine(DEPLOYMENT, f"sglang:disaggregation_mode={mode}", source=ListSource([]))
    with pytest.raises(ValueError, match="disaggregation_mode must be one of"):
        PolicySpec.make("sglang", {"disaggregation_mode": "both"}) and SglangConfig(
            disaggregation_mode="both"
        )
    with pytest.raises(ValueError, match="num_reserved_decode_tokens must be >= 0"):
        SglangConfig(num_reserved_decode_tokens=-1)
    with pytest.raises(ValueError, match="polling_interval must be >= 1"):
        SglangConfig(disaggregation_decode_polling_interval=0)


def test_the_vllm_pair_has_no_prealloc_part():
    wb = random_workload(n=30)
    specs = replicated(1, DEPLOYMENT, PolicySpec.make("vllm", {}))
    p = build_stage(specs, "round-robin", shares_prefixes=False, name_prefix="p", pd_pair=True)
    d = build_stage(specs, "round-robin", shares_prefixes=False, name_prefix="d", pd_pair=True)
    cluster = make_pd_cluster(p, d, "ib-ndr")
    assert isinstance(cluster, VllmPdCluster)
    lines = explain_cluster(cluster.run(wb(specs)))["lines"]
    assert not any("prealloc" in line for line in lines)


def test_lint_reads_the_decode_servers_flags():
    from tailserve.engines.flag_spec import NO_OP, SCHEDULING
    from tailserve.engines.lint import lint

    line = "python -m sglang.launch_server --model-path Qwen/Qwen3-8B --num-reserved-decode-tokens 256"
    alone = {row.flag: row for row in lint(line).rows}
    assert alone["--num-reserved-decode-tokens"].verdict == NO_OP  # not a decode server
    paired = {row.flag: row for row in lint(line + " --disaggregation-mode decode").rows}
    assert paired["--num-reserved-decode-tokens"].verdict == SCHEDULING
    late = lint(line + " --disaggregation-decode-allocation-policy prefill_complete").rows
    verdicts = {row.flag: row.verdict for row in late}
    assert verdicts["--disaggregation-decode-allocation-policy"] == SCHEDULING


@pytest.mark.parametrize("policy", ["vllm", "sglang"])
def test_a_prefill_replica_keeps_kv_until_it_is_sent(policy):
    """The prefill side frees a request's KV when its transfer is done (vLLM's connector delays
    the free, SGLang's inflight queue): on a slow link the next prompt that needs that memory
    starts only then; on the ideal link right after the prefill."""
    if policy == "vllm":
        small_prefill = {"num_gpu_blocks_override": "500", "max_model_len": "8000"}  # 8,000 tokens
    else:
        small_prefill = small(8000, 8000)
    starts = {}
    for link in ("inf", "roce-100g"):
        requests = [
            Request("a", prompt_len=6000, max_tokens=5, arrival_time=0.0),
            Request("b", prompt_len=6000, max_tokens=5, arrival_time=0.001),
        ]
        pspecs, dspecs = pd_specs(
            replicated(1, DEPLOYMENT, PolicySpec.make(policy, small_prefill)),
            replicated(1, DEPLOYMENT, PolicySpec.make(policy, {})),
        )
        p = build_stage(
            pspecs, "round-robin", shares_prefixes=False, options=CHECKED, name_prefix="p", pd_pair=True
        )
        d = build_stage(dspecs, "round-robin", shares_prefixes=False, name_prefix="d", pd_pair=True)
        cluster = make_pd_cluster(p, d, link)
        run = cluster.run(requests)
        ta, tb = run.pd_timeline["a"], run.pd_timeline["b"]
        assert all(r.status is RequestStatus.FINISHED_LENGTH for r in run.requests)
        starts[link] = (tb.prefill_scheduled, ta.prefill_done, ta.transfer_done)
        prefill_engine = p.replicas[0].engine
        assert prefill_engine.scheduler.kv_cache.num_used_blocks == 0 and not prefill_engine.scheduler.held
    b_start, a_done, a_sent = starts["inf"]
    assert b_start == a_done  # freed at once: nothing to wait for
    b_start, a_done, a_sent = starts["roce-100g"]
    assert a_sent > a_done + 0.05  # 0.79 GB at 12.5 GB/s
    assert b_start == a_sent  # the first iteration once the KV is sent


@pytest.mark.parametrize("policy", ["vllm", "sglang"])
def test_kept_kv_goes_into_the_prefix_cache_when_sent(policy):
    """Shared prompts over a slow link: a prefill replica's kept KV joins its prefix cache once
    sent (the radix tree needs the request's keys then), and the next requests hit it."""
    wb = WorkloadBuilder(WorkloadSpec("shared-prefix", num_requests=40, rate=20.0, seed=2, prefix_len=512))
    pspecs, dspecs = pd_specs(
        replicated(1, DEPLOYMENT, PolicySpec.make(policy, small(20000, 8192))),
        replicated(1, DEPLOYMENT, PolicySpec.make(policy, small(20000, 8192))),
    )
    p = build_stage(
        pspecs, "round-robin", shares_prefixes=True, options=CHECKED, name_prefix="p", pd_pair=True
    )
    d = build_stage(
        dspecs, "round-robin", shares_prefixes=True, options=CHECKED, name_prefix="d", pd_pair=True
    )
    cluster = make_pd_cluster(p, d, "roce-100g")
    run = cluster.run(workload_requests(wb, pspecs))
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in run.requests)
    conserved(cluster)
    copies = p.replicas[0].engine.requests
    assert sum(r.num_cached_tokens for r in copies) > 0


def test_a_polling_interval_delays_admission_but_never_stalls_an_idle_server():
    """``disaggregation_decode_polling_interval`` N: the queues are polled every N-th turn; an
    idle server's turns take no time, so a lone request is taken as at interval 1."""
    times = {}
    for interval in (1, 3):
        flags = {**SYNC, **small(20000), "disaggregation_decode_polling_interval": str(interval)}
        requests = [Request(f"r{i}", prompt_len=500, max_tokens=40, arrival_time=0.2 * i) for i in range(6)]
        cluster, run = pair(requests, {**SYNC, **small(20000)}, flags, link="inf")
        assert all(r.status is RequestStatus.FINISHED_LENGTH for r in run.requests)
        conserved(cluster)
        times[interval] = [r.token_times[0] for r in run.requests]
    assert times[3][0] == times[1][0]  # the first one finds the server idle
    assert times[3] != times[1]  # the later ones arrive while it decodes: polled every 3rd turn


# ---- disaggregation_decode_allocation_policy=prefill_complete ---------------------------------

LATE = {"disaggregation_decode_allocation_policy": "prefill_complete"}


@pytest.mark.parametrize("overlap", [True, False])
def test_prefill_complete_loses_nothing_and_conserves_kv(overlap):
    """The prefill runs at once and holds the KV; the decode server reserves KV once the prefill
    is done (``mark_prefill_complete``), and the KV is sent then."""
    flags = {} if overlap else SYNC
    decode = {**flags, **LATE, **small(10000)}
    cluster, run = pair(random_workload(), {**flags, **small(30000)}, decode, n_prefill=2)
    assert [r.status for r in run.requests] == [RequestStatus.FINISHED_LENGTH] * 120
    assert all(len(r.token_times) == r.max_tokens for r in run.requests)
    conserved(cluster)
    assert cluster._reaching == [0]
    waited = 0
    for r in run.requests:
        t = run.pd_timeline[r.request_id]
        assert r.arrival_time <= t.prefill_scheduled < t.prefill_done <= t.bootstrapped
        assert t.bootstrapped <= t.transfer_start < t.transfer_done <= r.token_times[0]
        assert t.transfer_ready == t.bootstrapped
        waited += t.bootstrapped > t.prefill_done
    assert waited > 0  # the small server made some prefills hold their KV


def test_prefill_complete_starts_the_prefill_and_holds_its_kv_instead():
    """Two requests on a decode server with room for one (``_two``): under ``early`` the second
    one's prefill waits for the first to leave; under ``prefill_complete`` it runs at once and
    its KV waits on the prefill server until the decode server reserves it."""
    first = Request("a", prompt_len=1000, max_tokens=100, arrival_time=0.0)
    second = Request("b", prompt_len=1000, max_tokens=100, arrival_time=0.01)
    cluster, run = pair([first, second], SYNC, {**SYNC, **LATE, **small(3000, 2048)})
    a, b = run.requests
    tb = run.pd_timeline["b"]
    assert tb.prefill_scheduled == pytest.approx(0.01, abs=0.02)  # not held back
    assert tb.bootstrapped == a.finish_time > tb.prefill_done  # reserved once "a" left
    assert tb.transfer_start == tb.bootstrapped
    parts = pd_breakdown(run)
    i = [r.request_id for r in run.requests].index("b")
    assert parts["decode_prealloc_wait"][i] == pytest.approx(tb.bootstrapped - tb.prefill_done)
    assert parts["prefill_wait"][i] == pytest.approx(tb.prefill_scheduled - b.arrival_time)
    conserved(cluster)


def test_prefill_complete_refusals_on_either_side():
    """A prefill refusal takes the request out of the decode server's queue (nothing was
    reserved); a request the decode server can never take is refused, and its prefill (started
    at once) keeps nothing."""
    long = Request("long", prompt_len=3000, max_tokens=10, arrival_time=0.0)
    cluster, run = pair([long], small(2000), LATE)
    (r,) = run.requests
    assert r.status is RequestStatus.FINISHED_REJECTED and "maximum context length is 2000" in r.status_reason
    (held,) = cluster.decode.replicas[0].engine.requests
    assert held.status is RequestStatus.FINISHED_ABORTED and held.status_reason.startswith("prefill server:")
    conserved(cluster)
    assert cluster._reaching == [0]
    big = Request("big", prompt_len=1800, max_tokens=10, arrival_time=0.0)
    cluster, run = pair([big], {}, {**LATE, **small(2000)})
    (r,) = run.requests
    assert r.status is RequestStatus.FINISHED_REJECTED
    assert "can never be pre-allocated on the decode server" in r.status_reason
    conserved(cluster)
    assert cluster._reaching == [0] and not cluster._refused


def test_prefill_complete_fast_forward_changes_nothing():
    times = []
    for fast in (True, False):
        _, run = pair(
            random_workload(n=80, seed=3),
            {},
            {**LATE, **small(20000)},
            options=EngineOptions(fast_forward=fast),
        )
        times.append([r.token_times for r in run.requests])
    assert times[0] == times[1]


def test_the_allocation_policy_is_checked():
    with pytest.raises(ValueError, match="disaggregation_decode_allocation_policy must be one of"):
        SglangConfig(disaggregation_decode_allocation_policy="late")


def test_prefill_complete_on_the_prefill_side_alone_is_refused():
    with pytest.raises(ValueError, match="SGLang needs it on both"):
        pair(random_workload(n=4), LATE, {})
