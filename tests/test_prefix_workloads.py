"""The prefix-sharing workloads: their structure, and what vLLM's prefix caching makes of them."""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise

import numpy as np
import pytest

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
from tailserve.workloads.lengths import Fixed
from tailserve.workloads.prefix import TOKEN_ID_HIGH, TOKEN_ID_LOW, multi_turn, shared_prefix

BLOCK_SIZE = 16  # tokens


def _content(requests: list[Request]) -> list[tuple]:
    return [
        (
            r.request_id,
            r.arrival_time,
            r.prompt_len,
            r.max_tokens,
            tuple(r.prompt_token_ids or ()),
            tuple(r.planned_output_token_ids or ()),
        )
        for r in requests
    ]


def _fresh(requests: list[Request], planned_outputs: bool = True) -> list[Request]:
    """Unstarted copies (a run mutates requests); the token lists are shared, never mutated.
    Without ``planned_outputs`` the copies do not say what they will generate."""
    return [
        Request(
            r.request_id,
            r.prompt_len,
            r.max_tokens,
            r.arrival_time,
            prompt_token_ids=r.prompt_token_ids,
            planned_output_token_ids=r.planned_output_token_ids if planned_outputs else None,
        )
        for r in requests
    ]


def _heads(requests: list[Request], prefix_len: int) -> dict[tuple[int, ...], list[Request]]:
    """Requests grouped by their first ``prefix_len`` tokens; only heads used more than once."""
    groups: dict[tuple[int, ...], list[Request]] = defaultdict(list)
    for r in requests:
        groups[tuple(r.prompt_token_ids[:prefix_len])].append(r)
    return {head: rs for head, rs in groups.items() if len(rs) > 1}


def _sessions(requests: list[Request]) -> dict[str, list[Request]]:
    """Multi-turn requests by session, in turn order."""
    out: dict[str, list[Request]] = defaultdict(list)
    for r in requests:
        out[r.request_id.rpartition("-")[0]].append(r)
    for turns in out.values():
        turns.sort(key=lambda r: int(r.request_id.rpartition("-")[2]))
    return out


def _run(requests: list[Request], caching: bool, num_blocks: int = 2048, fast: bool = True) -> Engine:
    """A small vLLM V1 deployment: Llama-3-8B on one H100, KV checked after every iteration."""
    policy = VllmPolicy(VllmConfig(2048, 64, enable_prefix_caching=caching))
    kv = make_kv_cache(policy.kv_spec(), num_blocks, BLOCK_SIZE)
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    engine = Engine(
        Scheduler(policy, kv, 8192),
        SimExecutor(cost, BLOCK_SIZE),
        ListSource(requests),
        options=EngineOptions(fast_forward=fast, check_integrity=True),
    )
    SimDriver(engine).run()
    assert all(r.finish_reason == "length" for r in requests)
    return engine


def _mean_ttft(requests: list[Request]) -> float:
    return float(np.mean([r.token_times[0] - r.arrival_time for r in requests]))


# --- structure: shared_prefix ---------------------------------------------------------------


def test_shared_prefix_is_deterministic_for_a_seed() -> None:
    a = shared_prefix(50, seed=3)
    assert _content(a) == _content(shared_prefix(50, seed=3))
    assert _content(a) != _content(shared_prefix(50, seed=4))
    assert [r.request_id for r in a] == [f"sp-{i}" for i in range(50)]
    ids = np.concatenate([r.prompt_token_ids for r in a])
    assert ids.min() >= TOKEN_ID_LOW and ids.max() < TOKEN_ID_HIGH


@pytest.mark.parametrize("shared_fraction", [0.0, 0.3, 0.8, 1.0])
def test_the_shared_fraction_start_with_one_of_the_prefixes(shared_fraction: float) -> None:
    n, num_prefixes, prefix_len = 1000, 4, 64
    requests = shared_prefix(n, 50.0, num_prefixes, prefix_len, shared_fraction, seed=1)
    heads = _heads(requests, prefix_len)
    num_shared = sum(len(rs) for rs in heads.values())
    # Binomial(n, f): within four standard deviations (exact at 0 and 1).
    assert abs(num_shared - shared_fraction * n) <= 4 * (n * shared_fraction * (1 - shared_fraction)) ** 0.5
    if shared_fraction > 0:
        # Exactly the system prompts are repeated, each used about equally, each followed by the
        # request's own suffix (no two shared prompts agree on the token after the prefix pair).
        assert len(heads) == num_prefixes
        for rs in heads.values():
            assert len(rs) > num_shared / num_prefixes / 2
            assert len({tuple(r.prompt_token_ids[prefix_len : prefix_len + 4]) for r in rs}) == len(rs)


def test_prompt_lengths_do_not_depend_on_the_shared_fraction() -> None:
    none = shared_prefix(100, shared_fraction=0.0, seed=2)
    every = shared_prefix(100, shared_fraction=1.0, seed=2)
    assert [r.prompt_len for r in none] == [r.prompt_len for r in every]
    assert [r.max_tokens for r in none] == [r.max_tokens for r in every]
    assert all(r.prompt_len > 1024 and r.prompt_len == len(r.prompt_token_ids) for r in every)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_requests": -1}, "num_requests"),
        ({"rate": 0.0}, "rate"),
        ({"num_prefixes": 0}, "num_prefixes"),
        ({"prefix_len": 0}, "prefix_len"),
        ({"shared_fraction": 1.5}, "shared_fraction"),
        ({"shared_fraction": float("nan")}, "shared_fraction"),
    ],
)
def test_shared_prefix_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        shared_prefix(**kwargs)


# --- structure: multi_turn ------------------------------------------------------------------


def test_multi_turn_is_deterministic_for_a_seed() -> None:
    a = multi_turn(10, seed=5)
    assert _content(a) == _content(multi_turn(10, seed=5))
    assert _content(a) != _content(multi_turn(10, seed=6))


def test_each_turn_resends_the_previous_prompt_and_reply() -> None:
    requests = multi_turn(30, turns=(2, 5), system_prompt_len=128, seed=1)
    sessions = _sessions(requests)
    assert len(sessions) == 30
    system = requests[0].prompt_token_ids[:128]
    for turns in sessions.values():
        assert 2 <= len(turns) <= 5  # no session reaches the default 8,192-token cap here
        for r in turns:
            assert r.prompt_token_ids[:128] == system  # one system prompt for every session
            assert r.max_tokens == len(r.planned_output_token_ids) and r.prompt_len == len(r.prompt_token_ids)
        for prev, turn in pairwise(turns):
            history = prev.prompt_token_ids + prev.planned_output_token_ids
            assert turn.prompt_token_ids[: len(history)] == history
            assert turn.prompt_len > len(history)  # plus a new user message


def test_multi_turn_arrives_in_order_after_each_reply_and_think_time() -> None:
    requests = multi_turn(20, think_time=0.0, reply_token_time=0.05, seed=2)
    times = [r.arrival_time for r in requests]
    assert times == sorted(times)
    for turns in _sessions(requests).values():
        for prev, turn in pairwise(turns):
            # With no think time the gap is exactly the reply's assumed streaming time.
            assert turn.arrival_time - prev.arrival_time == pytest.approx(prev.max_tokens * 0.05)
    thinking = multi_turn(20, think_time=5.0, reply_token_time=0.05, seed=2)
    gaps = [
        turn.arrival_time - prev.arrival_time - prev.max_tokens * 0.05
        for turns in _sessions(thinking).values()
        for prev, turn in pairwise(turns)
    ]
    assert min(gaps) > 0 and 3.0 < np.mean(gaps) < 7.0
    # The think time moves arrivals only: the tokens are the same draws.
    assert _content(thinking)[0][2:] == _content(requests)[0][2:]


def test_a_session_ends_before_the_turn_that_would_exceed_max_context() -> None:
    uncapped = {r.request_id: r for r in multi_turn(30, turns=(4, 6), seed=3)}
    capped = multi_turn(30, turns=(4, 6), max_context=2000, seed=3)
    assert 0 < len(capped) < len(uncapped)
    assert all(r.prompt_len + r.max_tokens <= 2000 for r in capped)
    for session, turns in _sessions(capped).items():
        # Up to the cap the sessions are the uncapped ones; the first dropped turn is too long.
        assert _content(turns) == _content([uncapped[r.request_id] for r in turns])
        dropped = uncapped.get(f"{session}-{len(turns)}")
        if dropped is not None:
            assert dropped.prompt_len + dropped.max_tokens > 2000


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_sessions": -1}, "num_sessions"),
        ({"turns": (0, 3)}, "turns"),
        ({"turns": (4, 3)}, "turns"),
        ({"rate": -1.0}, "rate"),
        ({"think_time": float("inf")}, "think_time"),
        ({"reply_token_time": -0.1}, "reply_token_time"),
        ({"system_prompt_len": -1}, "system_prompt_len"),
        ({"max_context": 100, "system_prompt_len": 256}, "max_context"),
    ],
)
def test_multi_turn_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        multi_turn(**kwargs)


# --- behaviour under vLLM V1 with prefix caching --------------------------------------------


def test_shared_system_prompts_are_mostly_served_from_the_cache() -> None:
    prefix_len = 1024  # 64 full blocks
    requests = shared_prefix(100, rate=8.0, prefix_len=prefix_len, shared_fraction=0.8, seed=0)
    heads = _heads(_fresh(requests), prefix_len)
    shared_ids = {r.request_id for rs in heads.values() for r in rs}
    # At most every shared request but the first of each prefix hits the whole prefix; the
    # suffixes and the private heads never hit.
    bound = (len(shared_ids) - len(heads)) * prefix_len
    _run(requests, caching=True)
    summary = prefix_cache_summary(requests)
    cached = summary["prefill_tokens_saved"]
    assert all(r.num_cached_tokens <= prefix_len for r in requests)
    assert all(r.num_cached_tokens == 0 for r in requests if r.request_id not in shared_ids)
    assert 0.9 * bound <= cached <= bound
    total = sum(r.prompt_len for r in requests)
    assert summary["hit_rate_tokens"] == pytest.approx(cached / total)
    assert 0.5 < summary["hit_rate_tokens"] <= bound / total


def test_later_turns_hit_the_previous_turns_reply_blocks() -> None:
    requests = multi_turn(20, seed=0)
    _run(requests, caching=True)  # 2,048 blocks: nothing of these sessions is evicted
    num_checked = 0
    for turns in _sessions(requests).values():
        for prev, turn in pairwise(turns):
            assert prev.finish_time <= turn.arrival_time  # the client's reply estimate held
            # The previous turn's KV covers its prompt and all replies but the last sampled token;
            # the block that token's predecessor just filled may not be registered yet.
            full = (prev.prompt_len + prev.max_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
            assert full - BLOCK_SIZE <= turn.num_cached_tokens <= full
            assert turn.num_cached_tokens > prev.prompt_len
            num_checked += 1
    assert num_checked > 30
    # Without planned outputs the reply blocks have no keys: hits stop at the previous prompt.
    blind = _fresh(requests, planned_outputs=False)
    _run(blind, caching=True)
    blind_sessions = _sessions(blind)
    for turns in blind_sessions.values():
        for prev, turn in pairwise(turns):
            assert turn.num_cached_tokens <= prev.prompt_len
    blind_hits = prefix_cache_summary(blind)["hit_rate_tokens"]
    assert blind_hits < prefix_cache_summary(requests)["hit_rate_tokens"]


@pytest.mark.parametrize(
    "make",
    [lambda: shared_prefix(100, rate=8.0, seed=0), lambda: multi_turn(20, seed=0)],
    ids=["shared-prefix", "multi-turn"],
)
def test_prefix_caching_lowers_mean_ttft(make) -> None:
    requests = make()
    warm, cold = _fresh(requests), _fresh(requests)
    _run(warm, caching=True)
    _run(cold, caching=False)
    assert sum(r.num_cached_tokens for r in cold) == 0
    assert _mean_ttft(warm) < 0.7 * _mean_ttft(cold)


def test_fast_path_equals_stepping_under_eviction() -> None:
    # 700 blocks (11,200 tokens) for 40 sessions: cached replies get evicted and reused.
    requests = multi_turn(40, rate=2.0, think_time=2.0, reply_len=Fixed(200), seed=4)
    fast, stepped = _fresh(requests), _fresh(requests)
    engine = _run(fast, caching=True, num_blocks=700, fast=True)
    _run(stepped, caching=True, num_blocks=700, fast=False)
    assert engine.scheduler.kv_cache.pool.stats.num_evicted_tokens > 0
    assert [r.token_times for r in fast] == [r.token_times for r in stepped]
    assert [r.num_cached_tokens for r in fast] == [r.num_cached_tokens for r in stepped]
