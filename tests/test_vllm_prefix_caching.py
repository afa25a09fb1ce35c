"""vLLM V1 automatic prefix caching wired into the KV manager and the vllm policy."""

from __future__ import annotations

import numpy as np

from helpers import grants, step
from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.source import ListSource
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.driver import SimDriver
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.kv.factory import make_kv_cache
from tailserve.metrics.summary import prefix_cache_summary
from tailserve.policies.vllm import VllmConfig, VllmPolicy


def _sched(num_blocks: int, caching: bool = True, budget: int = 2048) -> Scheduler:
    policy = VllmPolicy(VllmConfig(budget, 64, enable_prefix_caching=caching))
    kv = make_kv_cache(policy.kv_spec(), num_blocks, 16)
    return Scheduler(policy, kv, 4096)


def _req(rid: str, ids: list[int], max_tokens: int = 4, t: float = 0.0) -> Request:
    return Request(rid, len(ids), max_tokens, t, prompt_token_ids=ids)


SYSTEM = list(range(1000, 1000 + 96))  # a 96-token shared system prompt: 6 full blocks


def test_a_shared_prefix_is_computed_once():
    sched = _sched(64)
    a = _req("a", [*SYSTEM, 1, 2, 3, 4, 5])
    sched.add_request(a, 0.0)
    assert grants(step(sched)) == [("a", 101, 0)]
    b = _req("b", [*SYSTEM, 7, 8, 9])
    sched.add_request(b, 0.01)
    out = step(sched, 0.01)
    # b finds a's six full system-prompt blocks and computes only its 3 own tokens.
    assert ("b", 3, 96) in grants(out)
    assert b.num_cached_tokens == 96
    sched.kv_cache.check_integrity()
    # The six blocks are shared, not copied: 7 blocks for a (101 tokens + 1) and 1 more for b.
    assert sched.kv_cache.num_used_blocks == 7 + 1


def test_hit_is_capped_so_one_token_is_computed():
    sched = _sched(64)
    a = _req("a", SYSTEM)
    sched.add_request(a, 0.0)
    step(sched)
    twin = _req("twin", list(SYSTEM))
    sched.add_request(twin, 0.01)
    out = step(sched, 0.01)
    # All 96 tokens are cached, but the cap (num_tokens - 1, block-aligned) recomputes the
    # whole last block: 80 hit, 16 computed.
    assert ("twin", 16, 80) in grants(out)


def test_finished_requests_blocks_stay_cached_until_evicted():
    sched = _sched(16)
    a = _req("a", [*SYSTEM, 1], max_tokens=1)
    sched.add_request(a, 0.0)
    step(sched)
    assert a.is_finished and sched.kv_cache.num_used_blocks == 0
    b = _req("b", [*SYSTEM, 2], max_tokens=1)
    sched.add_request(b, 1.0)
    assert grants(step(sched, 1.0)) == [("b", 1, 96)]
    # Without prefix caching nothing is shared.
    cold = _sched(16, caching=False)
    for r in (_req("a", [*SYSTEM, 1], max_tokens=1), _req("b", [*SYSTEM, 2], max_tokens=1)):
        cold.add_request(r, 0.0)
    assert grants(step(cold)) == [("a", 97, 0), ("b", 97, 0)]


def _workload(seed: int, n: int = 80) -> list[Request]:
    rng = np.random.default_rng(seed)
    prefixes = [list(rng.integers(0, 30000, int(rng.integers(16, 400)))) for _ in range(4)]
    out = []
    for i in range(n):
        ids = prefixes[int(rng.integers(0, 4))] + list(rng.integers(0, 30000, int(rng.integers(1, 300))))
        out.append(
            Request(f"r{i}", len(ids), int(rng.integers(1, 200)), float(i) * 0.02, prompt_token_ids=ids)
        )
    return out


def _run(seed: int, caching: bool, fast: bool) -> tuple[Engine, list[Request]]:
    sched = _sched(160, caching)  # small: forces preemption and eviction
    requests = _workload(seed)
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    engine = Engine(sched, SimExecutor(cost, 16), ListSource(requests), options=EngineOptions(fast, True))
    SimDriver(engine).run()
    return engine, requests


def test_under_pressure_blocks_are_conserved_and_the_fast_path_is_exact():
    for seed in (1, 2):
        engine, requests = _run(seed, True, True)
        assert all(r.finish_reason == "length" for r in requests)
        assert engine.scheduler.num_preemptions > 0
        kv = engine.scheduler.kv_cache
        assert kv.num_free_blocks == kv.num_blocks and kv.pool.num_evictable > 0
        summary = prefix_cache_summary(requests)
        assert 0 < summary["hit_rate_tokens"] < 1
        _, stepped = _run(seed, True, False)
        assert [tuple(r.token_times) for r in requests] == [tuple(r.token_times) for r in stepped]


def test_prefix_caching_lowers_ttft_on_shared_prefixes():
    _, warm = _run(3, True, True)
    _, cold = _run(3, False, True)
    ttft = lambda rs: np.mean([r.token_times[0] - r.arrival_time for r in rs])  # noqa: E731
    assert sum(r.num_cached_tokens for r in warm) > 0 and sum(r.num_cached_tokens for r in cold) == 0
    assert ttft(warm) < ttft(cold)


def test_mooncake_hash_ids_share_exactly_their_common_blocks():
    # Two conversations share the first 512-token block (hash id 0); the second turn of the first
    # shares its first two blocks with the first turn.
    rows = [([0, 1], 1000), ([0, 2, 3], 1500), ([0, 1, 4], 1400)]
    sched = _sched(400)
    hits = []
    for i, (hash_ids, n) in enumerate(rows):
        r = Request(f"m{i}", n, 1, float(i), prefix_block_hashes=hash_ids)
        sched.add_request(r, float(i))
        step(sched, float(i))
        hits.append(r.num_cached_tokens)
    # m1 shares block 0 (512 tokens). m2 names blocks 0 and 1, but m0 held hash id 1 only as
    # its partial last block (1000 - 512 = 488 tokens), which carries no keys: a partial block's
    # content is not the named 512-token block, so m2 hits block 0 only.
    assert hits == [0, 512, 512]
    # A full shared block 1 is hit: m3 repeats m2's first two blocks.
    r = Request("m3", 1100, 1, 3.0, prefix_block_hashes=[0, 1, 5])
    sched.add_request(r, 3.0)
    step(sched, 3.0)
    assert r.num_cached_tokens == 1024
