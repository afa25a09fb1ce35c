"""Routing decisions against hand-worked cases, one or more per router."""

from __future__ import annotations

import random

import pytest

from tailserve.cluster import NoHealthyReplicaError, ReplicaState, RouteRequest, make_router
from tailserve.cluster.approx_tree import ApproxTree
from tailserve.cluster.routing import block_keys_from_tokens
from tailserve.policies.registry import PolicySpec


def states(
    *loads: tuple[int, int], kv: tuple[float, ...] = (), healthy: tuple[bool, ...] = (), at: float = 0.0
):
    return [
        ReplicaState(i, f"r{i}", w, r, kv[i] if kv else 0.0, at, healthy[i] if healthy else True)
        for i, (w, r) in enumerate(loads)
    ]


def req(rid: str, keys: tuple[int, ...] = (), prompt_len: int | None = None, session: str | None = None):
    return RouteRequest(rid, prompt_len or max(1, 16 * len(keys)), keys, 16, session)


def send(router, request, replicas, now=0.0) -> int:
    i = router.route(request, replicas, now)
    router.on_routed(request, i, now)
    return i


def test_round_robin_skips_unhealthy():
    router = make_router("round-robin")
    view = states((0, 0), (0, 0), (0, 0), healthy=(True, False, True))
    assert [send(router, req(f"q{i}"), view) for i in range(4)] == [0, 2, 0, 2]


def test_no_healthy_replica_is_an_error():
    for name in ("round-robin", "least-requests", "prefix-aware", "kv-aware", "session"):
        with pytest.raises(NoHealthyReplicaError):
            make_router(name).route(req("q"), states((0, 0), healthy=(False,)), 0.0)


def test_random_is_seeded_and_healthy_only():
    view = states((0, 0), (0, 0), (0, 0), healthy=(True, True, False))
    a = [send(make_router("random:seed=3"), req(f"q{i}"), view) for i in range(1)]
    r1, r2 = make_router("random:seed=3"), make_router("random:seed=3")
    picks1 = [send(r1, req(f"q{i}"), view) for i in range(50)]
    picks2 = [send(r2, req(f"q{i}"), view) for i in range(50)]
    assert picks1 == picks2 and picks1[0] == a[0]
    assert set(picks1) == {0, 1}


def test_least_requests_counts_what_it_sent_since_the_scrape():
    router = make_router("least-requests")
    view = states((2, 3), (1, 1), (4, 0), at=1.0)  # loads 5, 2, 4
    assert send(router, req("a"), view, 1.0) == 1  # 2
    assert send(router, req("b"), view, 1.1) == 1  # 3
    assert send(router, req("c"), view, 1.2) == 1  # 4 ties replica 2: the lower index
    assert send(router, req("d"), view, 1.3) == 2  # 5 vs 4
    # A newer scrape already includes what was sent before it.
    fresh = states((2, 3), (1, 1), (4, 0), at=2.0)
    assert send(router, req("e"), fresh, 2.0) == 1


def test_least_kv_breaks_ties_by_load():
    router = make_router("least-kv")
    view = states((3, 0), (5, 0), (1, 0), kv=(0.5, 0.2, 0.2))
    assert send(router, req("a"), view) == 2


def test_power_of_two_takes_the_lower_of_its_two_draws():
    router = make_router("power-of-two:seed=7")
    view = states((9, 0), (0, 0), (5, 0), (1, 0))
    loads = [9, 0, 5, 1]  # scraped, plus what the router sends (the scrape is never refreshed)
    rng = random.Random(7)  # the router's own stream, replayed
    for i in range(20):
        a, b = rng.sample([0, 1, 2, 3], 2)
        want = b if loads[b] < loads[a] else a
        assert send(router, req(f"q{i}"), view) == want
        loads[want] += 1


def test_session_affinity_moves_only_the_sessions_of_a_replica_taken_out():
    router = make_router("session")
    view = states((0, 0), (0, 0), (0, 0), (0, 0))
    homes = {s: send(router, req(f"{s}-1", session=s), view) for s in (f"user{i}" for i in range(40))}
    assert len(set(homes.values())) > 1  # spread over replicas
    assert all(send(router, req(f"{s}-2", session=s), view) == home for s, home in homes.items())
    gone = homes["user0"]
    down = states((0, 0), (0, 0), (0, 0), (0, 0), healthy=tuple(i != gone for i in range(4)))
    for s, home in homes.items():
        moved = send(router, req(f"{s}-3", session=s), down)
        assert moved != gone
        if home != gone:
            assert moved == home
    # No session id: the least loaded.
    assert send(router, req("anon"), states((3, 0), (0, 1), (2, 2), (5, 0))) == 1


def test_prefix_aware_hand_worked():
    router = make_router("prefix-aware:cache_threshold=0.5")
    view = states((0, 0), (0, 0))
    assert send(router, req("a", (1, 2, 3, 4)), view) == 0  # no match: smallest tree (tie: r0)
    assert router.last_reason.startswith("best match 0%")
    assert send(router, req("b", (1, 2, 3, 9)), view) == 0  # 3 of 4 blocks: 75% > 50%
    assert router.num_cache_hits == 1
    assert send(router, req("c", (1, 8, 9, 10)), view) == 1  # 25%: smallest tree is r1's (0 vs 5)
    assert send(router, req("d", (1, 2)), view) == 0  # 100% on r0, 50% on r1
    # 50% exactly is not above the threshold.
    assert send(router, req("e", (7, 7), prompt_len=64), view) == 1  # 0% -> smaller tree r1 (4 vs 5)


def test_prefix_aware_spreads_prompts_without_keys_by_their_length():
    """A synthetic workload's bare lengths carry no prefix keys: each still grows its replica's
    tree (sgl-router inserts every prompt's text), so the misses go to the smallest, not all to
    the first replica (which an empty tree for every replica made of them)."""
    router = make_router("prefix-aware")
    view = states((0, 0), (0, 0), (0, 0))
    picks = [send(router, req(f"q{i}", prompt_len=n), view) for i, n in enumerate((160, 32, 32, 64, 16))]
    assert picks == [0, 1, 2, 1, 2]  # trees 10/0/0 blocks, then 10/2/0, 10/2/2, 10/6/2, 10/6/3
    assert router.num_cache_misses == 5


def test_prefix_aware_balances_when_both_thresholds_are_exceeded():
    router = make_router("prefix-aware:balance_abs_threshold=4,balance_rel_threshold=2")
    view = states((0, 0), (0, 0))
    for i in range(5):  # all share a prefix: all go to r0 (4 vs 0 in flight is not over 4)
        assert send(router, req(f"p{i}", (1, 2, 3)), view) == 0
    # in flight 5 vs 0: 5 - 0 > 4 and 5 > 0 * 2 -> imbalanced, least loaded despite the match
    assert send(router, req("x", (1, 2, 3)), view) == 1
    assert router.num_balance_events == 1
    # 1 vs 1 in flight is balanced again: both trees match fully, the tie goes to r0.
    for i in range(4):
        router.on_finished(f"p{i}", 0, 1.0)
    assert send(router, req("y", (1, 2, 3)), view) == 0
    assert router.num_balance_events == 1


def test_prefix_aware_evicts_lru_leaves_on_its_interval():
    router = make_router("prefix-aware:max_tree_size=2,eviction_interval_secs=10")
    view = states(
        (0, 0),
    )
    send(router, req("a", (1, 2, 3)), view, 0.0)
    send(router, req("b", (1, 5)), view, 1.0)
    assert router.tree.size(0) == 4
    router.route(req("c", (9,)), view, 10.0)  # eviction pass: keep 2 nodes
    assert router.tree.size(0) == 2
    # The oldest leaves went first (3, then 2): the newer path 1 -> 5 stays whole.
    assert router.tree.match((1, 5), 0) == 2 and router.tree.match((1, 2, 3), 0) == 1


class FakeIndex:
    def __init__(self, overlaps: dict[int, int]) -> None:
        self.overlaps = overlaps

    def overlap(self, request: RouteRequest, replica: int) -> int:
        return self.overlaps[replica]


def test_kv_aware_cost_is_weighted_prefill_plus_decode_blocks():
    # r0 holds the prompt's 4 blocks (and 4 more of another in-flight prompt); r1 holds nothing.
    def fresh(weight: float):
        router = make_router(f"kv-aware:kv_overlap_score_weight={weight}", kv_index=FakeIndex({0: 4, 1: 0}))
        router.on_routed(req("old", (1, 2, 3, 4, 5, 6, 7, 8)), 0, 0.0)
        return router

    view = states((0, 0), (0, 0))
    q = req("q", (1, 2, 3, 4))
    # r0: prefill 0, decode 8 (its keys are active already) -> 8w*0 + 8 = 8; r1: 4w + 4.
    router = fresh(1.0)
    assert router.costs(q, [0, 1], 0.0) == {0: 8.0, 1: 8.0}
    assert fresh(2.0).route(q, view, 0.0) == 0  # 8 vs 12
    assert fresh(0.5).route(q, view, 0.0) == 1  # 8 vs 6
    # When the old request finishes r0's decode blocks drop to the prompt's own 4.
    router.on_finished("old", 0, 1.0)
    assert router.costs(q, [0, 1], 1.0) == {0: 4.0, 1: 8.0}


def test_kv_aware_without_events_uses_its_tree_with_a_ttl():
    router = make_router("kv-aware:router_ttl_secs=5")
    view = states((0, 0), (0, 0))
    router.on_routed(req("a", (1, 2, 3, 4)), 0, 0.0)
    router.on_finished("a", 0, 0.5)
    q = req("b", (1, 2, 3, 4))
    assert router.costs(q, [0, 1], 1.0) == {0: 4.0, 1: 8.0}  # cached on r0: prefill 0
    assert router.route(q, view, 1.0) == 0
    assert router.costs(q, [0, 1], 6.0) == {0: 8.0, 1: 8.0}  # the entry expired


def test_kv_aware_temperature_spreads_picks():
    router = make_router("kv-aware:router_temperature=1,seed=1", kv_index=FakeIndex({0: 4, 1: 0, 2: 0}))
    view = states((0, 0), (0, 0), (0, 0))
    picks = {router.route(req(f"q{i}", (1, 2, 3, 4)), view, 0.0) for i in range(60)}
    assert picks == {0, 1, 2}


def test_make_router_errors_name_the_problem():
    cases = {
        "nope": "unknown router 'nope'",
        "prefix-aware:foo=1": "router prefix-aware has no flag 'foo'",
        "prefix-aware:cache_threshold=x": "cache_threshold: 'x' is not a valid float",
        "prefix-aware:cache_threshold=2": "cache_threshold must be in [0, 1]",
        "random:seed=1.5": "seed: '1.5' is not a valid int",
        "kv-aware:router_temperature": "is not flag=value",
        "kv-aware:router_temperature=-1": "must be >= 0",
    }
    for spec, message in cases.items():
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            make_router(spec)
    assert make_router("cache_aware:cache-threshold=0.5").describe() == "prefix-aware:cache_threshold=0.5"


def test_block_keys_chain_the_prefix():
    a = block_keys_from_tokens(list(range(40)), 16)
    b = block_keys_from_tokens([*range(16), *range(100, 124)], 16)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert RouteRequest.from_tokens("x", list(range(40))).num_blocks == 3


def test_approx_tree_match_stops_at_the_first_gap():
    tree = ApproxTree()
    tree.insert((1, 2, 3), 0, 0.0)
    assert tree.match((1, 2, 3, 4), 0) == 3
    assert tree.match((2, 3), 0) == 2  # chained keys: a real prompt never starts mid-path
    assert tree.match((1, 2, 3), 1) == 0
    assert tree.match((1, 2, 3), 0, min_time=1.0) == 0


def test_router_and_policy_flags_share_one_converter():
    # One converter (core/config_flags.py, standard library only, so routing code may import it):
    # a count may be a whole float on both sides, a fraction is refused on both.
    assert make_router("random:seed=1e3").config.seed == 1000
    assert PolicySpec.make("vllm", {"max_num_seqs": "1e3"}).flags == {"max_num_seqs": 1000}
    with pytest.raises(ValueError, match=r"flag max_num_seqs: '1.5' is not a valid int"):
        PolicySpec.make("vllm", {"max_num_seqs": "1.5"})
    with pytest.raises(ValueError, match=r"router random flag seed: '1.5' is not a valid int"):
        make_router("random:seed=1.5")
    # bool words on both sides; an optional policy flag is unset by "none"
    assert make_router("kv-aware:kv_events=off").config.kv_events is False
    assert PolicySpec.make("vllm", {"enable_chunked_prefill": "no"}).flags == {
        "enable_chunked_prefill": False
    }
    assert PolicySpec.make("tgi", {"max_batch_size": "none"}).flags == {"max_batch_size": None}
