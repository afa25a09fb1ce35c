"""The ``sglang`` policy with SGLang's radix prefix cache (``shared/reference/policies.md`` §3(c)).

Requests carrying token ids (or Mooncake ``hash_ids``) share KV through a token-granular radix
tree: matched at admission, locked while used, checkpointed at the end of each prefill chunk,
inserted with the outputs at finish, evicted LRU leaf first under pressure. Page size 1.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import add as _add
from helpers import drain as _drain
from helpers import grants, ids, scheduler_for, step
from helpers import token_request as _req
from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.core.source import ListSource
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.driver import SimDriver
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.kv.radix_manager import RadixKVCacheManager
from tailserve.policies.sglang import SglangConfig, SglangPolicy

SYSTEM = list(range(1000, 1100))  # a 100-token shared system prompt


def _sched(num_blocks: int, **cfg) -> Scheduler:
    return scheduler_for(SglangPolicy(SglangConfig(**cfg)), num_blocks, 1, 8192)


def test_a_shared_system_prompt_is_computed_once():
    sched = _sched(1000)
    a = _add(sched, _req("a", [*SYSTEM, 1, 2, 3, 4, 5]))
    assert grants(step(sched)) == [("a", 105, 0)]
    b = _add(sched, _req("b", [*SYSTEM, 7, 8, 9]))
    out = step(sched)  # prefill first: b's suffix only, starting after the cached system prompt
    assert grants(out) == [("b", 3, 100)]
    assert b.num_cached_tokens == 100 and a.num_cached_tokens == 0
    kv = sched.kv_cache
    assert kv.block_tables["b"][:100] == kv.block_tables["a"][:100]  # the same slots, shared
    kv.check_integrity()
    _drain(sched)
    assert kv.num_held("a") == kv.num_held("b") == 0
    policy: SglangPolicy = sched.policy
    # Both finished: their prompts stay cached (outputs carry no keys without planned token ids).
    assert policy.tree.evictable_size == 105 + 3 and policy.tree.protected_size == 0
    assert kv.num_free_blocks == 1000 - policy.tree.evictable_size
    assert policy.prefix_cache_hit_rate == pytest.approx(100 / (105 + 103))


def test_the_match_leaves_one_token_to_compute_and_a_finished_reply_is_reused():
    sched = _sched(1000)
    a = _add(sched, _req("a", SYSTEM, max_tokens=4, planned_output_token_ids=[5, 6, 7, 8]))
    _drain(sched)
    same = _add(sched, _req("same", SYSTEM, max_tokens=1), 1.0)
    assert grants(step(sched, 1.0)) == [("same", 1, 99)]
    # The next turn carries the first reply: prompt + the 3 output tokens whose KV was computed.
    turn = _add(sched, _req("turn", [*SYSTEM, 5, 6, 7, 8, 9], max_tokens=1), 2.0)
    assert grants(step(sched, 2.0)) == [("turn", 2, 103)]
    assert a.is_finished and same.is_finished and turn.is_finished


def test_locked_paths_survive_pressure_and_lru_leaves_go_first():
    sched = _sched(400)
    policy: SglangPolicy = sched.policy
    kv = sched.kv_cache
    old = _add(sched, _req("old", list(range(100)), max_tokens=1))
    _drain(sched)
    newer = _add(sched, _req("newer", list(range(200, 300)), max_tokens=1), 1.0)
    _drain(sched, 1.0)
    assert policy.tree.evictable_size == 200 and kv.num_free_blocks == 200
    # A runner hits "newer" and holds its path locked while running.
    runner = _add(sched, _req("runner", list(range(200, 300)) + [7] * 50, max_tokens=40), 2.0)
    step(sched, 2.0)
    assert runner.num_cached_tokens == 100 and policy.tree.protected_size == 100
    # A big cold prompt needs more than the free slots: only the unlocked "old" leaf can go.
    big = _add(sched, _req("big", list(range(5000, 5180)), max_tokens=1), 2.1)
    now = 2.1
    while not big.is_finished:
        step(sched, now)
        kv.check_integrity()
        now += 0.01
    assert policy.tree.match_prefix(list(range(100))).num_tokens == 0  # evicted
    assert policy.tree.match_prefix(list(range(200, 300))).num_tokens == 100  # locked: kept
    assert not runner.is_finished
    _drain(sched, now)
    assert old.is_finished and newer.is_finished


def _shared_prefix_run(fast: bool, seed: int, num_blocks: int, **cfg) -> tuple[Engine, list[Request]]:
    rng = np.random.default_rng(seed)
    prefixes = [list(rng.integers(0, 30000, int(rng.integers(16, 400)))) for _ in range(4)]
    requests = []
    for i in range(80):
        toks = prefixes[int(rng.integers(0, 4))] + list(rng.integers(0, 30000, int(rng.integers(1, 300))))
        requests.append(_req(f"r{i}", toks, int(rng.integers(1, 200)), float(i) * 0.02))
    policy = SglangPolicy(SglangConfig(chunked_prefill_size=256, **cfg))
    sched = scheduler_for(policy, num_blocks, 1, 4096)
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    engine = Engine(sched, SimExecutor(cost, 1), ListSource(requests), options=EngineOptions(fast, True))
    SimDriver(engine).run()
    return engine, requests


@pytest.mark.parametrize(
    ("seed", "num_blocks", "schedule_policy"),
    [(1, 1200, "fcfs"), (2, 1200, "fcfs"), (1, 1200, "dfs-weight"), (1, 20000, "lpm")],
)
def test_blocks_are_conserved_and_the_fast_path_is_exact(seed, num_blocks, schedule_policy):
    # check_integrity after every iteration (EngineOptions(_, True)) counts the tree's references.
    engine, fast = _shared_prefix_run(True, seed, num_blocks, schedule_policy=schedule_policy)
    policy: SglangPolicy = engine.scheduler.policy
    assert all(r.finish_reason == "length" for r in fast)
    assert 0 < policy.prefix_cache_hit_rate < 1
    kv = engine.scheduler.kv_cache
    assert isinstance(kv, RadixKVCacheManager)
    assert kv.num_free_blocks + policy.tree.evictable_size == kv.num_blocks
    if num_blocks == 1200:  # under pressure: leaves are evicted and requests retracted
        assert policy.tree.stats.num_evicted_tokens > 0
        assert engine.scheduler.num_preemptions > 0
    _, stepped = _shared_prefix_run(False, seed, num_blocks, schedule_policy=schedule_policy)
    assert [tuple(r.token_times) for r in fast] == [tuple(r.token_times) for r in stepped]


def test_the_cache_lowers_ttft_on_shared_prefixes():
    _, warm = _shared_prefix_run(True, 1, 20000)
    _, cold = _shared_prefix_run(True, 1, 20000, disable_radix_cache=True)
    ttft = lambda rs: np.mean([r.token_times[0] - r.arrival_time for r in rs])  # noqa: E731
    assert sum(r.num_cached_tokens for r in warm) > 0 and sum(r.num_cached_tokens for r in cold) == 0
    assert ttft(warm) < ttft(cold)


def test_retraction_frees_without_inserting_decoded_tokens():
    sched = _sched(130, schedule_conservativeness=0.1)  # optimistic: both run, then one is retracted
    policy: SglangPolicy = sched.policy
    outs = [50 + i for i in range(60)]
    a = _add(sched, _req("a", list(range(30)), max_tokens=60, planned_output_token_ids=outs))
    _add(sched, _req("x", [7] * 5, max_tokens=2))  # admitted with a; its finish unblocks b
    b = _add(sched, _req("b", list(range(100, 130)), max_tokens=60))
    now = 0.0
    while not (a.num_preemptions or b.num_preemptions):
        assert now < 5, "no retraction"
        step(sched, now)
        sched.kv_cache.check_integrity()
        now += 0.01
    victim = a if a.num_preemptions else b
    assert victim.num_output_tokens > 1 and victim.status is RequestStatus.PREEMPTED
    keys = list(range(30)) + outs if victim is a else list(range(100, 130))
    # Its prompt was checkpointed at the end of prefill; none of its decoded tokens was inserted.
    assert policy.tree.match_prefix(keys).num_tokens == 30
    _drain(sched, now)
    assert a.is_finished and b.is_finished


def test_lpm_orders_by_match_length_and_falls_back_to_fcfs_above_128_waiting():
    sched = _sched(100_000, schedule_policy="lpm", max_running_requests=1)
    _add(sched, _req("warm", SYSTEM, max_tokens=1))
    _drain(sched)
    cold = _add(sched, _req("cold", [9] * 50, max_tokens=1), 1.0)
    half = _add(sched, _req("half", SYSTEM[:50] + [8] * 50, max_tokens=1), 1.0)
    hot = _add(sched, _req("hot", [*SYSTEM, 7], max_tokens=1), 1.0)
    step(sched, 1.0)
    assert hot.is_finished and ids(sched.waiting) == ["half", "cold"]
    assert not cold.num_computed_tokens and not half.num_computed_tokens
    # Above 128 waiting: arrival order.
    sched = _sched(100_000, schedule_policy="lpm", max_running_requests=1)
    _add(sched, _req("warm", SYSTEM, max_tokens=1))
    _drain(sched)
    for i in range(129):
        _add(sched, _req(f"c{i}", [i + 1] * 5, max_tokens=1), 1.0)
    _add(sched, _req("hot", [*SYSTEM, 7], max_tokens=1), 1.0)
    out = step(sched, 1.0)
    assert grants(out)[0][0] == "c0"


def test_dfs_weight_serves_the_heaviest_subtree_first():
    sched = _sched(100_000, schedule_policy="dfs-weight", max_running_requests=1)
    other = list(range(5000, 5100))
    _add(sched, _req("w1", SYSTEM, max_tokens=1))
    _add(sched, _req("w2", other, max_tokens=1))
    _drain(sched)
    _add(sched, _req("o1", [*other, 1], max_tokens=2), 1.0)
    _add(sched, _req("s1", [*SYSTEM, 1], max_tokens=2), 1.0)
    _add(sched, _req("s2", [*SYSTEM, 2], max_tokens=2), 1.0)
    step(sched, 1.0)
    # The system-prompt subtree weighs 2, the other 1: s1 goes first, then s2, then o1.
    assert ids(sched.running) == ["s1"]
    assert ids(sched.waiting) == ["s2", "o1"]


def test_lpm_aging_lets_a_cold_request_overtake_after_waiting():
    def order(rate: float) -> list[str]:
        sched = _sched(100_000, schedule_policy="lpm", max_running_requests=1, lpm_aging_rate=rate)
        _add(sched, _req("warm", SYSTEM, max_tokens=1))
        _drain(sched)
        _add(sched, _req("cold", [9] * 50, max_tokens=2), 0.0)  # waits from t = 0
        _add(sched, _req("hot", [*SYSTEM, 7], max_tokens=2), 10.0)  # matches 100 tokens
        step(sched, 10.0)
        return ids(sched.running) + ids(sched.waiting)

    assert order(0.0) == ["hot", "cold"]  # plain lpm: the cold request keeps losing
    assert order(5.0) == ["hot", "cold"]  # 5 tok/s x 10 s = 50 < 100
    assert order(20.0) == ["cold", "hot"]  # 200 > 100: the cold request overtakes


def test_mooncake_hash_ids_hit_exactly_their_shared_blocks():
    rows = [([0, 1], 1000), ([0, 2, 3], 1500), ([0, 1, 4], 1400)]
    sched = _sched(20_000, chunked_prefill_size=-1)
    hits = []
    now = 0.0
    for i, (hash_ids, n) in enumerate(rows):
        r = _add(sched, Request(f"m{i}", n, 1, now, prefix_block_hashes=hash_ids), now)
        now = _drain(sched, now)
        hits.append(r.num_cached_tokens)
    # Only full 512-token blocks carry keys; m0's block 1 was partial (488 tokens).
    assert hits == [0, 512, 512]


def test_requests_without_token_identities_leave_the_cache_inert():
    sched = _sched(1000, schedule_policy="lpm")
    _add(sched, Request("a", 10, 2, 0.0))
    _drain(sched)
    assert sched.policy.tree is None and sched.kv_cache.tree is None


def test_disable_radix_cache_shares_nothing():
    sched = _sched(1000, disable_radix_cache=True)
    _add(sched, _req("a", SYSTEM, max_tokens=1))
    _drain(sched)
    b = _add(sched, _req("b", [*SYSTEM, 1], max_tokens=1))
    assert grants(step(sched)) == [("b", 101, 0)] and b.num_cached_tokens == 0
