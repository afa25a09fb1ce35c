"""The ``slo`` policy's rules, each on a hand-worked case with a linear predicted iteration time
(5 ms + 10 us per token), so every number can be checked by hand."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.executor import StepResult
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.core.source import ListSource
from tailserve.executors.simulated.cost_binding import bind_cost_model
from tailserve.executors.simulated.cost_model import BatchShape, CostModel
from tailserve.executors.simulated.driver import SimDriver
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.kv.paged import KVCacheManager
from tailserve.policies.registry import PolicySpec
from tailserve.policies.slo import SloConfig, SloPolicy
from tailserve.policies.slo_classes import parse_slo_classes
from tailserve.policies.slo_predictor import Predictor

CLASSES = "interactive=ttft:500ms,tbt:50ms,priority:0 batch=ttft:30s,tbt:200ms,priority:1"
DEVICE = get_hardware("H100-SXM").device_info


@dataclass
class LinearCost:
    """5 ms per iteration + 10 us per new token."""

    fixed: float = 0.005
    per_token: float = 1e-5

    def iteration_time(self, shape: BatchShape) -> float:
        return self.fixed + self.per_token * shape.num_tokens if shape.num_tokens else 0.0


def _setup(num_blocks: int = 1024, **flags) -> tuple[SloPolicy, Scheduler]:
    config = SloPolicy.default_config(DEVICE, 8192, slo_classes=CLASSES, **flags)
    policy = SloPolicy(config)
    sched = Scheduler(policy, KVCacheManager(num_blocks, 16), 8192)
    policy.predictor = Predictor(LinearCost())  # type: ignore[arg-type]
    return policy, sched


def _decoding(sched: Scheduler, rid: str, prompt: int, last_token: float, priority: int = 0) -> Request:
    """A running request that has produced one token at ``last_token``."""
    r = Request(rid, prompt, 100, 0.0, priority=priority)
    sched.add_request(r, 0.0)
    sched.waiting.remove(r)
    sched.policy.state.info.pop(rid)
    assert sched.allocate(r, prompt)  # the KV of the computed tokens
    r.num_computed_tokens = prompt
    r.num_output_tokens = 1
    r.token_times.append(last_token)
    sched.admit(r, 0.0)
    return r


def test_prefill_budget_from_the_least_tbt_slack():
    _policy, sched = _setup()
    # Deadline 0.0 + 50 ms; at now = 10 ms the iteration may take 40 ms:
    # 5 ms + 10 us * (1 decode + q) <= 40 ms  ->  q <= 3,499.
    _decoding(sched, "d", 100, last_token=0.0)
    _decoding(sched, "b", 100, last_token=0.0, priority=1)  # batch: 200 ms, not the tightest
    sched.add_request(Request("p", 6000, 10, 0.0), 0.0)
    out = sched.schedule(0.010)
    grants = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert grants == {"d": 1, "b": 1, "p": 3498}  # 2 decodes + 3,498 = 3,500 tokens -> 40 ms


def test_no_slack_left_still_gives_the_floor():
    _policy, sched = _setup(min_prefill_tokens=64)
    _decoding(sched, "d", 100, last_token=0.0)
    sched.add_request(Request("p", 6000, 10, 0.0), 0.0)
    out = sched.schedule(0.060)  # the decode is already 10 ms late
    assert {s.request.request_id: s.num_new_tokens for s in out.scheduled} == {"d": 1, "p": 64}


def test_no_decodes_means_only_the_token_cap():
    _policy, sched = _setup(max_num_batched_tokens=2048, max_num_seqs=16)
    sched.add_request(Request("p", 6000, 10, 0.0), 0.0)
    out = sched.schedule(0.0)
    assert [s.num_new_tokens for s in out.scheduled] == [2048]


def test_waiting_by_least_ttft_slack():
    policy, sched = _setup()
    # Both feasible. Batch arrived first (deadline 30 s); interactive (deadline 1.5 s) goes first.
    sched.add_request(Request("batch", 1000, 10, 0.0, priority=1), 0.0)
    sched.add_request(Request("inter", 1000, 10, 1.0, priority=0), 1.0)
    ordered, rejected = policy.order_waiting(sched, 1.0)
    assert [r.request_id for r in ordered] == ["inter", "batch"] and not rejected


def test_prefix_hits_count_in_the_prediction(monkeypatch):
    policy, sched = _setup()

    @dataclass
    class Match:
        num_tokens: int

    hits = {"cached": Match(7000)}
    monkeypatch.setattr(sched.kv_cache, "match_prefix", lambda rid, n: hits.get(rid))
    # Deadline 0.5 s. Uncached, 8,000 tokens predict 5 ms + 80 ms; with 7,000 of them cached,
    # 5 ms + 10 ms. slack(plain) = 0.415 < slack(cached) = 0.485: plain first.
    sched.add_request(Request("cached", 8000, 10, 0.0), 0.0)
    sched.add_request(Request("plain", 8000, 10, 0.0), 0.0)
    assert policy.state.info["cached"].prefill_s == pytest.approx(0.005 + 1e-5 * 1000)
    ordered, _ = policy.order_waiting(sched, 0.0)
    assert [r.request_id for r in ordered] == ["plain", "cached"]
    # At 0.42 s, 80 ms are left: plain (85 ms) can no longer make it; cached (15 ms) can, and
    # only because its hit is counted. Feasible first.
    ordered, _ = policy.order_waiting(sched, 0.42)
    assert [r.request_id for r in ordered] == ["cached", "plain"]


def test_infeasible_best_effort_behind_feasible():
    policy, sched = _setup()
    # 'late' (interactive, 60,000-token prompt: 605 ms alone > 500 ms) can never make its TTFT.
    sched.add_request(Request("late", 6000, 10, 0.0), 0.0)
    policy.state.info["late"].prefill_s = 0.605
    sched.add_request(Request("ok", 1000, 10, 0.1), 0.1)
    ordered, rejected = policy.order_waiting(sched, 0.1)
    assert [r.request_id for r in ordered] == ["ok", "late"] and not rejected


def test_infeasible_rejected_early_with_a_reason():
    policy, sched = _setup(slo_admission="reject")
    sched.add_request(Request("late", 6000, 10, 0.0), 0.0)
    policy.state.info["late"].prefill_s = 0.605
    sched.add_request(Request("ok", 1000, 10, 0.0), 0.0)
    out = sched.schedule(0.0)
    assert [s.request.request_id for s in out.scheduled] == ["ok"]
    (late,) = sched.finished
    assert late.request_id == "late" and late.status is RequestStatus.FINISHED_REJECTED
    assert "TTFT target (0.5 s) cannot be met" in late.status_reason


def test_aging_puts_old_best_effort_work_first():
    policy, sched = _setup(aging_s=5.0)
    sched.add_request(Request("late", 6000, 10, 0.0), 0.0)
    policy.state.info["late"].prefill_s = 0.605
    sched.add_request(Request("ok", 1000, 10, 4.9), 4.9)
    assert [r.request_id for r in policy.order_waiting(sched, 4.9)[0]] == ["ok", "late"]
    sched.add_request(Request("ok2", 1000, 10, 5.0), 5.0)
    assert [r.request_id for r in policy.order_waiting(sched, 5.0)[0]] == ["late", "ok", "ok2"]


def test_aging_takes_at_most_its_share_of_the_prefill_work():
    # Budget 2,048 tokens, aging_share 0.25: aged requests start with one budget of credit.
    policy, sched = _setup(aging_s=5.0, aging_share=0.25, max_num_batched_tokens=2048, max_num_seqs=16)
    sched.add_request(Request("old1", 3000, 10, 0.0), 0.0)
    sched.add_request(Request("old2", 3000, 10, 0.0), 0.0)
    for rid in ("old1", "old2"):
        policy.state.info[rid].prefill_s = 0.605  # 0.5 s TTFT: never feasible
    sched.add_request(Request("ok", 1000, 10, 6.0), 6.0)
    sched.add_request(Request("new-late", 6000, 10, 6.0), 6.0)
    policy.state.info["new-late"].prefill_s = 0.605  # late, but not aged yet
    assert policy.admission.aging_credit == 2048
    assert [r.request_id for r in policy.order_waiting(sched, 6.0)[0]] == ["old1", "old2", "ok", "new-late"]
    # Admitting old1 spends its whole prefill, 3,000 tokens: the credit is 2,048 - 3,000 = -952,
    # and the iteration's 2,048 prefill tokens earn a quarter of them back: -952 + 512 = -440.
    out = sched.schedule(6.0)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("old1", 2048)]
    assert policy.admission.aging_credit == pytest.approx(-440)
    sched.update(out, StepResult(0.1), 6.1)
    # Out of credit: old1's rest continues (rule 2), then the feasible request goes ahead of the
    # aged one, which still comes before the late one that has not aged; old2 takes the 96
    # tokens left and spends its 3,000: -440 - 3,000 + 2,048 / 4 = -2,928.
    assert [r.request_id for r in policy.order_waiting(sched, 6.1)[0]] == ["ok", "old2", "new-late"]
    out = sched.schedule(6.1)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("old1", 952), ("ok", 1000), ("old2", 96)
    ]  # fmt: skip
    assert policy.admission.aging_credit == pytest.approx(-2928)
    # With aging_share=1 aged requests always go first (the rule before the share).
    policy, sched = _setup(aging_s=5.0, aging_share=1.0)
    policy.admission.aging_credit = -1e9
    sched.add_request(Request("old", 3000, 10, 0.0), 0.0)
    policy.state.info["old"].prefill_s = 0.605
    sched.add_request(Request("ok", 1000, 10, 6.0), 6.0)
    assert [r.request_id for r in policy.order_waiting(sched, 6.0)[0]] == ["old", "ok"]


def test_victim_is_the_smallest_slo_loss():
    policy, sched = _setup()
    # At 30 ms: 'inter' (50 ms TBT) has 20 ms of slack, 'batch' (200 ms) 170 ms. Recomputing
    # 1,000 tokens predicts 15 ms: both absorb it -> equal loss 0; recomputing 'big' (3,000
    # tokens, 35 ms) would make interactive work late, so the cheap batch request goes.
    inter = _decoding(sched, "inter", 3000, last_token=0.01)
    batch = _decoding(sched, "batch", 1000, last_token=0.01, priority=1)
    assert policy.slo_loss(inter, 0.03)[0] > 0  # 30 ms + 35 ms > 60 ms deadline
    assert policy.slo_loss(batch, 0.03)[0] == 0
    assert min([inter, batch], key=lambda r: policy.slo_loss(r, 0.03)) is batch
    # An already-late request loses only the recompute it adds, relative to its target.
    late = _decoding(sched, "late", 1000, last_token=-1.0)
    assert policy.slo_loss(late, 0.03)[0] == pytest.approx(0.015 / 0.05)


def test_preemption_takes_the_least_loss_victim():
    # 130 blocks, all held: 'inter' (1,024 tokens, 64 blocks) needs a 65th for its next token.
    # At 50 ms: recomputing 'inter' (15.24 ms) would miss its 60 ms deadline; 'other' (40 tokens,
    # 5.4 ms) is already 0.5 s late, so recompute adds 5.4 ms of lateness; 'batch' (1,000 tokens,
    # 15 ms) has 160 ms of slack and loses nothing: it is the victim.
    policy, sched = _setup(num_blocks=130)
    inter = _decoding(sched, "inter", 1024, last_token=0.01)
    batch = _decoding(sched, "batch", 1000, last_token=0.01, priority=1)
    other = _decoding(sched, "other", 40, last_token=-0.5)
    assert sched.kv_cache.num_free_blocks == 0
    assert policy.slo_loss(other, 0.05)[0] == pytest.approx((0.005 + 40e-5) / 0.05)
    out = sched.schedule(0.05)
    assert out.preempted == [batch]
    assert batch.status is RequestStatus.PREEMPTED and batch in sched.waiting
    assert {s.request.request_id for s in out.scheduled} == {"inter", "other"}
    assert inter.status is other.status is RequestStatus.RUNNING


def test_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="slo_admission must be best-effort or reject"):
        SloConfig(2048, 64, slo_admission="drop")
    with pytest.raises(ValueError, match=r"aging_share must be a fraction in \(0, 1\], got 0"):
        SloConfig(2048, 64, aging_share=0)
    with pytest.raises(ValueError, match="fairness must be one of none, vtc"):
        SloConfig(2048, 64, fairness="drf")
    with pytest.raises(ValueError, match="no tbt target"):
        SloConfig(2048, 64, slo_classes="x=ttft:1s")
    with pytest.raises(ValueError, match="slo has no flag"):
        SloPolicy.default_config(DEVICE, 4096, chunk_size=4)
    assert PolicySpec.make("slo", {"slo_classes": CLASSES}).flags["slo_classes"] == CLASSES


def test_slo_classes_parse_and_select():
    classes = parse_slo_classes(CLASSES + " vip=ttft:100ms,tbt:20ms,tenant:acme default=batch")
    assert [c.name for c in classes.classes] == ["interactive", "batch", "vip"]
    assert classes.by_name("interactive").ttft == 0.5 and classes.by_name("batch").tbt == 0.2
    assert classes.of(Request("a", 1, 1, 0.0, priority=0, tenant_id="acme")).name == "vip"
    assert classes.of(Request("b", 1, 1, 0.0, priority=0)).name == "interactive"
    assert classes.of(Request("c", 1, 1, 0.0, priority=7)).name == "batch"
    for bad, message in [
        ("x=ttft:fast,tbt:1s", "not a time"),
        ("x=ttft:1s,tbt:1s,color:red", "unknown key 'color'"),
        ("x=ttft:1s,tbt:1s y=ttft:1s,tbt:1s,priority:0 z=ttft:1s,tbt:1s,priority:0", "priority 0 is in both"),
        ("x=ttft:1s,tbt:1s default=y", "default='y' is not a class"),
        ("", "is empty"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_slo_classes(bad)


def test_predictor_uses_the_engine_cost_model_and_learns_without_one():
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    policy, _ = _setup()
    bind_cost_model(policy, cost)
    assert policy.predictor.cost_model is cost and policy.predictor.exact
    # The assembler binds the simulator's own cost model, exact, for either simulated executor.
    from tailserve.assemble import build_engine
    from tailserve.executors.simulated.deployment import Deployment, build_cost_model

    built_cost = build_cost_model(Deployment("Llama-3-8B", "H100-SXM", 1, "none"))
    for kind in ("sim", "realtime-sim"):
        built = build_engine(built_cost, "slo", kind)  # type: ignore[arg-type]
        assert built.policy.predictor.cost_model is built_cost.cost_model and built.policy.predictor.exact
    # No cost model: a least-squares fit of measured periods (here exactly linear).
    learned = Predictor()
    assert learned.prefill_time(1000) == 0.0  # nothing measured yet: no deadlines assumed
    truth = LinearCost(0.004, 2e-5)
    for n in range(1, 40):
        shape = BatchShape(n * 37, 1, (n % 5) * 10_000, 0, (n * n * 13) % 997 * 10)
        learned.observe(shape, truth.iteration_time(shape))
    assert learned.prefill_time(1000) == pytest.approx(truth.fixed + truth.per_token * 1000, rel=1e-3)


def test_a_calibrated_estimate_is_corrected_by_a_high_quantile_of_the_measured_ratio():
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    estimate = Predictor(cost, exact=False)
    shape = BatchShape(512, 1, 512 * 513 // 2, 512, 0)
    base = cost.iteration_time(shape)
    assert estimate.time(shape) == base  # predicts from the first iteration
    # The machine runs 2x slower than calibrated (some iterations 2.5x), with one outlier (an
    # idle wait inside a period): the p90 of 20 ratios is 2.5, the outlier does not move it.
    for i in range(20):
        estimate.observe(shape, 50 * base if i == 3 else 2.5 * base if i % 5 == 0 else 2 * base)
    assert estimate.time(shape) == pytest.approx(2.5 * base)
    assert "x 2.500 (p90 of the last 20" in estimate.source
    # An exact one (the simulator's) never moves.
    exact = Predictor(cost)
    exact.observe(shape, 2 * base)
    assert exact.time(shape) == base


def test_every_request_leaves_under_pressure_with_fast_path_exact():
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)

    def run(fast: bool, admission: str) -> list[Request]:
        config = SloPolicy.default_config(DEVICE, 2048, slo_classes=CLASSES, slo_admission=admission)
        sched = Scheduler(SloPolicy(config), KVCacheManager(200, 16), 2048)
        bind_cost_model(sched.policy, cost)  # predicts with the simulator's cost model
        requests = [
            Request(f"r{i}", 200 + 97 * (i % 13), 20 + 11 * (i % 7), 0.01 * i, priority=i % 2)
            for i in range(80)
        ]
        engine = Engine(sched, SimExecutor(cost, 16), ListSource(requests), options=EngineOptions(fast, True))
        SimDriver(engine).run()
        assert len(sched.finished) == 80 and sched.kv_cache.num_free_blocks == 200
        return requests

    for admission in ("best-effort", "reject"):
        fast, slow = run(True, admission), run(False, admission)
        assert [(r.status, r.token_times) for r in fast] == [(r.status, r.token_times) for r in slow]
        assert all(r.status_reason for r in fast if r.status is RequestStatus.FINISHED_REJECTED)


def test_a_protected_tenant_preempts_the_most_served_one_for_room():
    # 130 blocks: heavy holds 100 (recent service 10,000), light holds 10 (100: under half its
    # share, so protected); light's new 640-token prompt needs 40 blocks and 20 are free:
    # heavy's request goes, light's is admitted at once.
    policy, sched = _setup(num_blocks=130, fairness="vtc")
    big = _decoding(sched, "big", 1600, last_token=0.0)
    big.tenant_id = "heavy"
    mine = _decoding(sched, "mine", 160, last_token=0.0)
    mine.tenant_id = "light"
    policy.backlog.recent.step({"heavy": 10_000, "light": 100})
    sched.add_request(Request("new", 640, 10, 0.0, tenant_id="light"), 0.0)
    out = sched.schedule(0.01)
    assert out.preempted == [big] and big in sched.waiting
    assert [s.request.request_id for s in out.scheduled] == ["mine", "new"]
    # The other way round nothing happens: an unprotected tenant preempts nobody.
    policy, sched = _setup(num_blocks=130, fairness="vtc")
    big = _decoding(sched, "big", 1600, last_token=0.0)
    big.tenant_id = "light"
    policy.backlog.recent.step({"heavy": 10_000, "light": 100})
    sched.add_request(Request("new", 640, 10, 0.0, tenant_id="heavy"), 0.0)
    out = sched.schedule(0.01)
    assert not out.preempted and [s.request.request_id for s in out.scheduled] == ["big"]
