"""The ``tgi`` policy with TGI's prefix cache, the radix allocator (``shared/reference/policies.md``
§4(c)).

Requests carrying token ids (or Mooncake ``hash_ids``) share KV through a block-aligned radix trie:
the prompt is matched at admission (leaving at least one token to compute), its node locked, its
blocks shared into the request's table and only the rest of the lifetime reservation taken;
when the request leaves, its PROMPT blocks are inserted and the lock dropped. Unlocked leaves are
evicted least recently used first when blocks run short.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from helpers import add as _add
from helpers import drain as _drain
from helpers import grants, ids, scheduler_for, step
from helpers import token_request as _req
from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.source import ListSource
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.driver import SimDriver
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.kv.paged import KVCacheManager
from tailserve.kv.radix_manager import RadixKVCacheManager
from tailserve.policies.tgi import TgiConfig, TgiPolicy

SYSTEM = list(range(1000, 1100))  # a 100-token shared system prompt


def _sched(num_blocks: int, block_size: int = 1, **cfg) -> Scheduler:
    return scheduler_for(TgiPolicy(TgiConfig(**cfg)), num_blocks, block_size, 8192)


def test_a_shared_system_prompt_is_computed_once():
    sched = _sched(1000)
    policy: TgiPolicy = sched.policy
    a = _add(sched, _req("a", [*SYSTEM, 1, 2, 3, 4, 5]))
    assert grants(step(sched)) == [("a", 105, 0)]
    _drain(sched)
    kv = sched.kv_cache
    assert isinstance(kv, RadixKVCacheManager) and kv.tree is policy.tree
    assert policy.tree.evictable_size == 105  # a's prompt, cached when it left
    b = _add(sched, _req("b", [*SYSTEM, 7, 8, 9], max_tokens=5), 1.0)
    out = step(sched, 1.0)  # b's first forward starts after the cached system prompt
    assert grants(out) == [("b", 3, 100)]
    assert b.num_cached_tokens == 100 and a.num_cached_tokens == 0
    assert kv.num_held("b") == 3 + 5 - 1 + 100  # the lifetime reservation, 100 of it shared
    assert policy.tree.protected_size == 100  # b's matched path is locked while it runs
    kv.check_integrity()
    _drain(sched, 1.0)
    assert kv.num_held("b") == 0 and policy.tree.protected_size == 0
    assert policy.tree.evictable_size == 105 + 3
    assert kv.num_free_blocks == 1000 - policy.tree.evictable_size
    assert policy.prefix_cache_hit_rate == pytest.approx(100 / (105 + 103))
    assert policy.notes() and "prefix cache" in policy.notes()[0]


def test_concurrent_identical_prompts_do_not_share_and_duplicates_go_back():
    # Insertion happens when a request leaves, so two prompts admitted together both compute;
    # the second insertion finds the first and its blocks return to the free list.
    sched = _sched(1000)
    _add(sched, _req("a", SYSTEM, max_tokens=2))
    _add(sched, _req("b", SYSTEM, max_tokens=2))
    assert grants(step(sched)) == [("a", 100, 0), ("b", 100, 0)]
    _drain(sched)
    policy: TgiPolicy = sched.policy
    assert policy.tree.evictable_size == 100
    assert sched.kv_cache.num_free_blocks == 900


def test_output_tokens_are_not_cached():
    sched = _sched(1000)
    _add(sched, _req("a", SYSTEM, max_tokens=4, planned_output_token_ids=[5, 6, 7, 8]))
    _drain(sched)
    # The next turn carries the reply, but only the prompt part was cached.
    turn = _add(sched, _req("turn", [*SYSTEM, 5, 6, 7, 8, 9], max_tokens=1), 1.0)
    assert grants(step(sched, 1.0)) == [("turn", 5, 100)]
    assert turn.num_cached_tokens == 100


def test_a_fully_cached_prompt_still_computes_one_token():
    sched = _sched(1000)
    _add(sched, _req("a", SYSTEM, max_tokens=2))
    _drain(sched)
    same = _add(sched, _req("same", SYSTEM, max_tokens=1), 1.0)
    assert grants(step(sched, 1.0)) == [("same", 1, 99)]
    assert same.num_cached_tokens == 99 and same.is_finished
    _drain(sched, 1.0)
    assert sched.policy.tree.evictable_size == 100


def test_block_aligned_prefixes_with_larger_blocks():
    sched = _sched(100, block_size=16)
    _add(sched, _req("a", list(range(40)), max_tokens=2))  # 2 full blocks cached, 8 tokens not
    _drain(sched)
    assert sched.policy.tree.evictable_size == 2
    b = _add(sched, _req("b", [*range(40), 99], max_tokens=1), 1.0)
    assert grants(step(sched, 1.0)) == [("b", 9, 32)] and b.num_cached_tokens == 32
    # A prompt of exactly two cached blocks keeps its last block to compute.
    c = _add(sched, _req("c", list(range(32)), max_tokens=1), 2.0)
    assert grants(step(sched, 2.0)) == [("c", 16, 16)] and c.num_cached_tokens == 16


def test_locked_paths_survive_pressure_and_lru_leaves_go_first():  # blocks conserved throughout
    sched = _sched(400)
    policy: TgiPolicy = sched.policy
    kv = sched.kv_cache
    old = _add(sched, _req("old", list(range(100)), max_tokens=1))
    _drain(sched)
    newer = _add(sched, _req("newer", list(range(200, 300)), max_tokens=1), 1.0)
    _drain(sched, 1.0)
    assert policy.tree.evictable_size == 200 and kv.num_free_blocks == 200
    # A runner hits "newer" and holds its path locked; it reserves 150 + 40 - 1 - 100 = 89 blocks.
    runner = _add(sched, _req("runner", list(range(200, 300)) + [7] * 50, max_tokens=40), 2.0)
    step(sched, 2.0)
    assert runner.num_cached_tokens == 100 and policy.tree.protected_size == 100
    assert kv.num_free_blocks == 111
    # Too big even after evicting everything unlocked: it waits, and the trie is untouched.
    _add(sched, _req("huge", list(range(5000, 5150)), max_tokens=100), 2.01)
    stamps = {id(n): n.last_access_time for n in policy.tree._nodes()}
    step(sched, 2.01)
    assert ids(sched.waiting) == ["huge"] and policy.tree.evictable_size == 100
    assert {id(n): n.last_access_time for n in policy.tree._nodes()} == stamps
    sched.abort_request("huge", "test", 2.02)
    # 180 blocks > 111 free: the unlocked "old" leaf goes, the locked "newer" path stays.
    big = _add(sched, _req("big", list(range(5000, 5180)), max_tokens=1), 2.1)
    now = 2.1
    while not big.is_finished:
        step(sched, now)
        kv.check_integrity()
        now += 0.01
    assert policy.tree.stats.num_evicted_tokens == 100
    assert policy.tree.match_prefix(list(range(100))).num_tokens == 0  # evicted
    assert policy.tree.match_prefix(list(range(200, 300))).num_tokens == 100  # locked: kept
    assert not runner.is_finished
    _drain(sched, now)
    assert old.is_finished and newer.is_finished and runner.is_finished
    assert kv.num_free_blocks + policy.tree.evictable_size == kv.num_blocks


def _shared_prefix_run(
    fast: bool, seed: int, num_blocks: int, block_size: int = 1, **cfg
) -> tuple[Engine, list[Request]]:
    rng = np.random.default_rng(seed)
    prefixes = [[int(x) for x in rng.integers(0, 30000, int(rng.integers(16, 400)))] for _ in range(4)]
    requests = []
    for i in range(80):
        suffix = [int(x) for x in rng.integers(0, 30000, int(rng.integers(1, 300)))]
        toks = prefixes[int(rng.integers(0, 4))] + suffix
        requests.append(_req(f"r{i}", toks, int(rng.integers(1, 200)), float(i) * 0.02))
    budget = 512 if cfg.get("prefill_chunking", True) else 1024  # legacy: whole prompts only
    policy = TgiPolicy(TgiConfig(max_batch_prefill_tokens=budget, **cfg))
    sched = scheduler_for(policy, num_blocks, block_size, 4096)
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    engine = Engine(
        sched,
        SimExecutor(cost, block_size),
        ListSource(requests),
        options=EngineOptions(fast_forward=fast, check_integrity=True),
    )
    SimDriver(engine).run()
    return engine, requests


@pytest.mark.parametrize(
    ("seed", "num_blocks", "block_size", "chunking"),
    [(1, 1500, 1, True), (2, 1500, 1, False), (3, 100, 16, True), (1, 20000, 1, True)],
)
def test_blocks_are_conserved_and_the_fast_path_is_exact(seed, num_blocks, block_size, chunking):
    # check_integrity after every iteration counts the trie's references next to the tables.
    engine, fast = _shared_prefix_run(True, seed, num_blocks, block_size, prefill_chunking=chunking)
    policy: TgiPolicy = engine.scheduler.policy
    assert all(r.finish_reason == "length" for r in fast)
    assert 0 < policy.prefix_cache_hit_rate < 1
    kv = engine.scheduler.kv_cache
    assert isinstance(kv, RadixKVCacheManager)
    assert kv.num_free_blocks + policy.tree.evictable_size == kv.num_blocks
    if num_blocks < 20000:  # under pressure: leaves are evicted
        assert policy.tree.stats.num_evicted_tokens > 0
    assert engine.scheduler.num_preemptions == 0
    _, stepped = _shared_prefix_run(False, seed, num_blocks, block_size, prefill_chunking=chunking)
    assert [tuple(r.token_times) for r in fast] == [tuple(r.token_times) for r in stepped]
    assert [r.num_cached_tokens for r in fast] == [r.num_cached_tokens for r in stepped]


def test_the_cache_lowers_ttft_on_shared_prefixes():
    _, warm = _shared_prefix_run(True, 1, 20000)
    _, cold = _shared_prefix_run(True, 1, 20000, disable_radix_cache=True)
    ttft = lambda rs: np.mean([r.token_times[0] - r.arrival_time for r in rs])  # noqa: E731
    assert sum(r.num_cached_tokens for r in warm) > 0 and sum(r.num_cached_tokens for r in cold) == 0
    assert ttft(warm) < ttft(cold)


def test_mooncake_hash_ids_hit_exactly_their_shared_blocks():
    rows = [([0, 1], 1000), ([0, 2, 3], 1500), ([0, 1, 4], 1400)]
    sched = _sched(20_000)
    hits = []
    now = 0.0
    for i, (hash_ids, n) in enumerate(rows):
        r = _add(sched, Request(f"m{i}", n, 1, now, prefix_block_hashes=hash_ids), now)
        now = _drain(sched, now)
        hits.append(r.num_cached_tokens)
    # Only full 512-token blocks carry keys; m0's block 1 was partial (488 tokens).
    assert hits == [0, 512, 512]


def test_requests_without_token_identities_leave_the_cache_inert():
    sched = _sched(1000)
    _add(sched, Request("a", 10, 2, 0.0))
    _drain(sched)
    assert sched.policy.tree is None and sched.kv_cache.tree is None
    assert sched.policy.notes() == []


def test_disable_radix_cache_shares_nothing():
    sched = _sched(1000, disable_radix_cache=True)
    _add(sched, _req("a", SYSTEM, max_tokens=1))
    _drain(sched)
    b = _add(sched, _req("b", [*SYSTEM, 1], max_tokens=1))
    assert grants(step(sched)) == [("b", 101, 0)] and b.num_cached_tokens == 0
    assert sched.policy.tree is None and type(sched.kv_cache) is KVCacheManager


def test_later_turns_hit_the_previous_prompt_but_not_the_reply():
    from tailserve.workloads.prefix import multi_turn

    requests = multi_turn(20, seed=0)  # planned replies: the next turn resends them
    sched = scheduler_for(TgiPolicy(TgiConfig()), 200_000, 1, 8192)
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    # Integrity checks are skipped here (200k blocks per iteration); the runs above do them.
    engine = Engine(sched, SimExecutor(cost, 1), ListSource(requests), options=EngineOptions(True, False))
    SimDriver(engine).run()
    assert all(r.finish_reason == "length" for r in requests)
    sched.kv_cache.check_integrity()
    sessions: dict[str, list[Request]] = {}
    for r in requests:
        sessions.setdefault(r.request_id.rpartition("-")[0], []).append(r)
    num_checked = 0
    for turns in sessions.values():
        turns.sort(key=lambda r: int(r.request_id.rpartition("-")[2]))
        for prev, turn in pairwise(turns):
            assert prev.finish_time <= turn.arrival_time
            assert turn.num_cached_tokens == prev.prompt_len  # the reply was never inserted
            num_checked += 1
    assert num_checked > 30
