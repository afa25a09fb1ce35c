"""vLLM V1 with ``scheduling_policy="priority"`` against ``shared/reference/policies.md`` §1(a)-(b).

The waiting queue is ordered by (priority, arrival time, request id), lower first; the victim of
a preemption is the running request with the largest (priority, arrival time), and if it was
already scheduled in this iteration its tokens go back to the budget; a request that preempts
itself ends the running pass (as vLLM 0.32 does, shown by tests/test_differential*.py); a
preempted request re-enters the queue by its key, not at the front. FCFS behaves as before. Tests drive the policy through ``Scheduler.schedule`` /
``Scheduler.update`` with hand-sized caches so every grant and queue position is exact.
"""

from __future__ import annotations

import random

import pytest

from helpers import grants as _grants
from helpers import ids as _ids
from helpers import step as _step
from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.core.source import ListSource
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.driver import SimDriver
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.kv.paged import KVCacheManager
from tailserve.policies.registry import parse_policy_list
from tailserve.policies.vllm import VllmConfig, VllmPolicy

# ---- helpers ------------------------------------------------------------------------------


def _v1(num_blocks: int, block_size: int = 16, policy: str = "priority", **cfg) -> Scheduler:
    cfg.setdefault("max_num_batched_tokens", 256)
    cfg.setdefault("max_num_seqs", 16)
    config = VllmConfig(scheduling_policy=policy, **cfg)
    return Scheduler(VllmPolicy(config), KVCacheManager(num_blocks, block_size), 4096)


def _add(
    sched: Scheduler, rid: str, prompt: int, max_tokens: int, priority: int = 0, arrival: float = 0.0
) -> Request:
    request = Request(rid, prompt, max_tokens, arrival, priority=priority)
    assert sched.add_request(request, arrival)
    return request


# ---- the waiting queue ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "order"),
    [("priority", ["c", "d", "b", "e", "a"]), ("fcfs", ["a", "b", "d", "c", "e"])],
)
def test_waiting_order_is_priority_then_arrival_then_id(policy, order):
    sched = _v1(1000, policy=policy)
    _add(sched, "a", 10, 1, priority=5, arrival=0.0)
    _add(sched, "b", 10, 1, priority=0, arrival=1.0)
    _add(sched, "d", 10, 1, priority=0, arrival=0.5)
    _add(sched, "c", 10, 1, priority=0, arrival=0.5)  # ties d on (priority, arrival): id decides
    _add(sched, "e", 10, 1, priority=1, arrival=2.0)
    assert _ids(sched.waiting) == order
    out = _step(sched, now=3.0)
    assert _ids(s.request for s in out.scheduled) == order  # admitted in that order


@pytest.mark.parametrize(("policy", "first"), [("priority", "urgent"), ("fcfs", "early")])
def test_a_more_urgent_later_arrival_is_admitted_first(policy, first):
    # 4 blocks of 16: each 48-token prompt needs 3, so only one fits.
    sched = _v1(4, policy=policy)
    _add(sched, "early", 48, 2, priority=5, arrival=0.0)
    _add(sched, "urgent", 48, 2, priority=0, arrival=1.0)
    out = _step(sched, now=1.0)
    assert _grants(out) == [(first, 48, 0)]
    assert len(sched.waiting) == 1 and sched.waiting.peek_request().request_id != first


def test_no_preemption_in_favour_of_a_more_urgent_waiting_request():
    # V1 preempts only when a running request cannot grow; an urgent arrival that does not fit
    # simply waits.
    sched = _v1(4)
    _add(sched, "low", 48, 10, priority=9)
    _step(sched)
    _add(sched, "urgent", 48, 2, priority=0, arrival=0.5)
    out = _step(sched, now=1.0)
    assert _grants(out) == [("low", 1, 48)]
    assert not out.preempted and _ids(sched.waiting) == ["urgent"]


# ---- the victim ----------------------------------------------------------------------------


def _victim_setup(policy: str) -> Scheduler:
    """6 blocks of 4. v (priority 9) runs first; u and x (priority 0) join it, and the cache is
    full: v (7 tokens) and x (6) still fit their second block, u (8) needs a third. Then the
    budget is cut to 2 tokens so that each returned token matters."""
    sched = _v1(6, block_size=4, policy=policy)
    _add(sched, "v", 6, 10, priority=9)
    assert _grants(_step(sched)) == [("v", 6, 0)]
    _add(sched, "u", 8, 10, priority=0, arrival=1.0)
    _add(sched, "x", 6, 10, priority=0, arrival=2.0)
    assert _grants(_step(sched, now=2.0)) == [("v", 1, 6), ("u", 8, 0), ("x", 6, 0)]
    assert _ids(sched.running) == ["v", "u", "x"] and sched.kv_cache.num_free_blocks == 0
    sched.policy.config = VllmConfig(max_num_batched_tokens=2, max_num_seqs=2, scheduling_policy=policy)
    return sched


def test_priority_victim_is_the_least_urgent_and_its_scheduled_tokens_go_back():
    sched = _victim_setup("priority")
    v = sched.running[0]
    out = _step(sched, now=3.0)
    # v was scheduled first (1 token of the 2); u then needs a block and the victim is v, the
    # largest (priority, arrival): v leaves the batch, its token returns, so x still decodes.
    assert _grants(out) == [("u", 1, 8), ("x", 1, 6)]
    assert out.num_scheduled_tokens == 2
    assert out.preempted == [v]
    assert v.status is RequestStatus.PREEMPTED and v.num_computed_tokens == 0
    assert sched.kv_cache.num_held("v") == 0
    assert _ids(sched.running) == ["u", "x"] and _ids(sched.waiting) == ["v"]


def test_fcfs_victim_is_the_last_admitted():
    sched = _victim_setup("fcfs")
    out = _step(sched, now=3.0)
    # v keeps its token; u preempts x (the tail) and the 2-token budget is spent.
    assert _grants(out) == [("v", 1, 7), ("u", 1, 8)]
    assert _ids(out.preempted) == ["x"]
    assert _ids(sched.waiting) == ["x"]


def test_priority_ties_go_to_the_latest_arrival():
    # b (priority 5, arrival 1.0) reaches the scheduler before a (priority 5, arrival 0.0), so it
    # is admitted first; the victim is still b: same priority, later arrival.
    sched = _v1(4, block_size=4)
    _add(sched, "b", 6, 6, priority=5, arrival=1.0)
    _step(sched, now=1.0)
    _add(sched, "a", 8, 6, priority=5, arrival=0.0)
    assert _grants(_step(sched, now=1.0)) == [("b", 1, 6), ("a", 8, 0)]
    assert sched.kv_cache.num_free_blocks == 0
    out = _step(sched, now=2.0)  # b (7 -> 8) fits; a (8 -> 9) needs a third block
    assert _ids(out.preempted) == ["b"]
    assert _grants(out) == [("a", 1, 8)]


# ---- self-preemption and re-entry ----------------------------------------------------------


def _self_preempt_setup(policy: str) -> Scheduler:
    """4 blocks of 4. v (priority 9, 7 tokens) runs first, u (priority 0, 6 tokens) joins: the
    cache is full. Next, v's 9th token needs a third block; u's 7th fits. z (0) and y (9) wait."""
    sched = _v1(4, block_size=4, policy=policy)
    _add(sched, "v", 7, 5, priority=9)
    assert _grants(_step(sched)) == [("v", 7, 0)]
    _add(sched, "u", 6, 5, priority=0, arrival=1.0)
    assert _grants(_step(sched, now=1.0)) == [("v", 1, 7), ("u", 6, 0)]
    _add(sched, "z", 4, 1, priority=0, arrival=1.5)
    _add(sched, "y", 4, 1, priority=9, arrival=1.6)
    return sched


def test_priority_self_preemption_ends_the_running_pass_and_requeues_by_key():
    sched = _self_preempt_setup("priority")
    out = _step(sched, now=2.0)
    # v is its own victim (largest key); that ends the pass: u does not decode this iteration
    # (vLLM 0.32: ``if new_blocks is None: break``), and nobody is admitted after a preemption.
    assert _ids(out.preempted) == ["v"]
    assert _grants(out) == []
    # v re-enters by (priority, arrival): behind z (priority 0), ahead of y (9, later).
    assert _ids(sched.waiting) == ["z", "v", "y"]
    # u finishes after 2 more iterations... it has 5 tokens to make: run it out and see the
    # queue drain in key order (z, then v recomputing prompt + its 2 outputs, then y).
    admitted = []
    for k in range(12):
        out = _step(sched, now=3.0 + k)
        admitted += [s.request.request_id for s in out.scheduled if s.num_context_tokens == 0]
    assert admitted == ["z", "v", "y"]
    v = next(r for r in sched.finished if r.request_id == "v")
    assert v.num_preemptions == 1 and v.num_output_tokens == 5


def test_fcfs_self_preemption_is_not_reached_and_the_tail_is_requeued_at_the_front():
    sched = _self_preempt_setup("fcfs")
    out = _step(sched, now=2.0)
    # Under FCFS the victim is the tail u, not v; u goes to the front of the queue.
    assert _ids(out.preempted) == ["u"]
    assert _grants(out) == [("v", 1, 8)]
    assert _ids(sched.waiting) == ["u", "z", "y"]


# ---- config and whole runs -----------------------------------------------------------------


def test_scheduling_policy_flag():
    with pytest.raises(ValueError, match="scheduling_policy"):
        VllmConfig(max_num_batched_tokens=256, max_num_seqs=16, scheduling_policy="lifo")
    spec = parse_policy_list("vllm:scheduling_policy=priority")[0]
    config = VllmPolicy.default_config(get_hardware("H100-SXM").device_info, 4096, **spec.flags)
    assert config.scheduling_policy == "priority"


def _workload(seed: int, n: int = 60) -> list[Request]:
    rng = random.Random(seed)
    t = 0.0
    requests = []
    for i in range(n):
        t += rng.expovariate(200.0)
        prompt, max_tokens = rng.randint(1, 400), rng.randint(1, 150)
        requests.append(Request(f"r{i}", prompt, max_tokens, t, priority=rng.choice((0, 0, 1, 5))))
    return requests


@pytest.mark.parametrize("budget", [256, 2048])
def test_whole_run_under_kv_pressure_with_priorities(budget):
    requests = _workload(seed=5)
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    outcomes = []
    for fast_forward in (False, True):
        sched = _v1(48, max_num_batched_tokens=budget)
        batch = [
            Request(r.request_id, r.prompt_len, r.max_tokens, r.arrival_time, priority=r.priority)
            for r in requests
        ]
        options = EngineOptions(fast_forward=fast_forward, check_integrity=True)
        SimDriver(Engine(sched, SimExecutor(cost, 16), ListSource(batch), options=options)).run()
        assert all(r.status is RequestStatus.FINISHED_LENGTH for r in batch)
        assert all(len(r.token_times) == r.max_tokens for r in batch)
        assert sched.kv_cache.num_free_blocks == 48
        assert sched.num_preemptions > 0
        outcomes.append([(r.request_id, r.num_preemptions, tuple(r.token_times)) for r in batch])
    assert outcomes[0] == outcomes[1]
