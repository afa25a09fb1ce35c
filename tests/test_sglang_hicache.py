"""SGLang's hierarchical cache (``--enable-hierarchical-cache``): the tree's host tier
(kv/hiradix.py), its manager's load-backs (kv/hiradix_manager.py), the sizing (kv/hicache_spec.py),
the policy's pricing of loads (policies/sglang_hicache.py), whole runs, and the flags."""

from __future__ import annotations

import numpy as np
import pytest

from tailserve.assemble.scheduler import build_scheduler
from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.source import ListSource
from tailserve.engines.lint import lint
from tailserve.engines.translate import translate
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.deployment import Deployment
from tailserve.executors.simulated.driver import SimDriver
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.layerwise_load import layerwise_load_time
from tailserve.executors.simulated.models import get_model
from tailserve.kv.factory import make_kv_cache
from tailserve.kv.hicache_spec import HiCacheSpec
from tailserve.kv.hiradix import HiRadixCache
from tailserve.kv.hiradix_manager import HiRadixKVCacheManager
from tailserve.kv.prefix import PrefixCacheIntegrityError
from tailserve.policies.registry import PolicySpec
from tailserve.policies.sglang import SglangPolicy
from tailserve.policies.sglang_config import SglangConfig
from tailserve.tune.commands import command_line

H100 = get_hardware("H100-SXM").device_info


# ---- the tree's host tier ------------------------------------------------------------------------
def _tree(host: int, policy: str = "write_through") -> tuple[HiRadixCache, list[int]]:
    tree = HiRadixCache(host, policy)
    freed: list[int] = []
    return tree, freed


def test_write_through_backs_up_at_insert_and_eviction_demotes_to_host():
    tree, freed = _tree(100)
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    assert tree.host_used == 4 and tree.host_stats.backed_up_tokens == 4
    assert tree.evict(4, freed.extend) == 4 and freed == [10, 11, 12, 13]
    # Demoted, not deleted: the node stays, host-only, and a match walks into it.
    match = tree.match_prefix([1, 2, 3, 4, 5])
    assert (match.num_tokens, match.host_tokens) == (0, 4) and match.node is tree.root
    assert tree.evictable_size == 0 and tree.host_stats.demoted_tokens == 4
    tree.check_integrity()


def test_a_match_is_the_gpu_prefix_then_the_host_hit():
    tree, freed = _tree(100)
    tree.insert([1, 2, 3], [10, 11, 12])
    tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15])  # a leaf [4 5 6] under [1 2 3]
    tree.evict(3, freed.extend)  # the leaf goes first (least recently used device leaf)
    assert freed == [13, 14, 15]
    match = tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert (match.num_tokens, list(match.kv_indices), match.host_tokens) == (3, [10, 11, 12], 3)
    tree.check_integrity()


def test_selective_write_through_waits_for_a_second_hit():
    tree, _ = _tree(100, "write_through_selective")
    tree.insert([1, 2, 3], [10, 11, 12])
    assert tree.host_used == 0
    tree.insert([1, 2, 3], [10, 11, 12])  # another request inserting the same prefix: its second hit
    assert tree.host_used == 3


def test_an_insert_counts_a_node_once_per_request():
    tree, _ = _tree(100, "write_through_selective")
    tree.insert([1, 2, 3], [10, 11, 12])
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13], counted_from=3)  # the same request, one token more
    assert tree.host_used == 0  # [1 2 3] was counted by its first insert only


def test_write_back_backs_up_only_at_eviction_and_unbacked_eviction_deletes():
    tree, freed = _tree(100, "write_back")
    tree.insert([1, 2, 3], [10, 11, 12])
    assert tree.host_used == 0
    tree.evict(3, freed.extend)
    assert tree.host_used == 3 and tree.match_prefix([1, 2, 3, 9]).host_tokens == 3
    plain, freed2 = _tree(2)  # write_through into a pool too small for the node: the copy is skipped
    plain.insert([1, 2, 3], [10, 11, 12])
    assert plain.host_used == 0 and plain.host_stats.skipped_backup_tokens == 3
    plain.evict(3, freed2.extend)
    assert plain.num_nodes == 1 and plain.match_prefix([1, 2, 3, 4]).host_tokens == 0


def test_host_pool_evicts_least_recently_used_host_leaves_for_a_backup():
    tree, freed = _tree(7)
    tree.insert([1, 2, 3], [10, 11, 12])
    tree.insert([5, 6, 7], [20, 21, 22])
    tree.evict(6, freed.extend)  # both demoted, host pool holds 6 of 7
    tree.match_prefix([5, 6, 7, 8])  # [5 6 7] is now the more recent host leaf
    tree.insert([9, 9, 9], [30, 31, 32])  # its backup needs 2 more: [1 2 3] goes
    assert tree.match_prefix([1, 2, 3, 4]).host_tokens == 0
    assert tree.match_prefix([5, 6, 7, 8]).host_tokens == 3
    assert tree.host_stats.host_evicted_tokens == 3 and tree.host_used == 6
    tree.check_integrity()


def test_an_insert_over_a_host_node_gives_it_the_requests_slots():
    tree, freed = _tree(100)
    adopted: list[int] = []
    tree.adopt = adopted.extend
    tree.insert([1, 2, 3], [10, 11, 12])
    tree.evict(3, freed.extend)
    assert tree.insert([1, 2, 3, 4], [40, 41, 42, 43]) == 3  # [1 2 3] was cached (host-only)
    assert adopted == [40, 41, 42]
    match = tree.match_prefix([1, 2, 3, 4, 5])
    assert (match.num_tokens, match.host_tokens) == (4, 0)
    tree.check_integrity()


def test_integrity_catches_a_host_counter_off():
    tree, _ = _tree(100)
    tree.insert([1, 2, 3], [10, 11, 12])
    tree.host_used += 1
    with pytest.raises(PrefixCacheIntegrityError, match="host copies"):
        tree.check_integrity()


# ---- the manager's load-back ---------------------------------------------------------------------
def test_load_back_gives_the_host_path_slots_and_moves_the_lock():
    kv = HiRadixKVCacheManager(64, 1, 0, HiCacheSpec(), 200)
    keys = list(range(100, 140))
    kv.set_prefix_keys("a", keys)
    kv.allocate("a", 40)
    kv.tree.insert(keys, kv.block_tables["a"])  # cached, backed up
    kv.hold(kv.block_tables["a"])
    kv.free("a")
    kv.evict_cached(40)  # GPU copies dropped, host copies kept
    assert kv.num_free_blocks == 64
    kv.set_prefix_keys("b", [*keys, 1])
    match = kv.match_prefix("b", 41)
    assert (match.num_tokens, match.host_tokens) == (0, 40)
    kv.lock_prefix(match)
    loaded = kv.load_back(match)
    assert loaded is not None and loaded.num_tokens == 40 and len(loaded.kv_indices) == 40
    assert kv.num_free_blocks == 24 and loaded.node.lock_ref == 1 and kv.tree.protected_size == 40
    kv.unlock_prefix(loaded)
    kv.check_integrity()
    assert kv.hicache_stats.loaded_tokens == 40


def test_a_host_hit_under_the_threshold_is_recomputed():
    kv = HiRadixKVCacheManager(64, 1, 0, HiCacheSpec(), 200)
    kv.set_prefix_keys("a", [1, 2, 3, 4, 5])
    kv.allocate("a", 5)
    kv.tree.insert([1, 2, 3, 4, 5], kv.block_tables["a"])
    kv.hold(kv.block_tables["a"])
    kv.free("a")
    kv.evict_cached(5)
    kv.set_prefix_keys("b", [1, 2, 3, 4, 5, 6])
    match = kv.match_prefix("b", 6)
    assert match.host_tokens == 5 and kv.load_back(match) is None
    assert kv.hicache_stats.num_short_hits == 1


# ---- sizing ----------------------------------------------------------------------------------------
def test_host_pool_is_the_device_pool_times_the_ratio_or_the_gb_per_rank():
    assert HiCacheSpec().host_tokens(10_000, 131072) == 20_001  # default ratio 2, one padding page
    assert HiCacheSpec(3.0).host_tokens(10_000, 131072) == 30_001
    assert HiCacheSpec(2.0, 10).host_tokens(10_000, 131072) == int(10e9 // 131072) + 1  # size wins
    with pytest.raises(ValueError, match="write_through, write_through_selective, write_back"):
        HiCacheSpec(write_policy="lazy")


def test_config_refuses_bad_values_and_the_radix_cache_off():
    with pytest.raises(ValueError, match="mutually exclusive"):
        SglangConfig(enable_hierarchical_cache=True, disable_radix_cache=True)
    with pytest.raises(ValueError, match="hicache_ratio must be > 0"):
        SglangConfig(enable_hierarchical_cache=True, hicache_ratio=0.0)
    with pytest.raises(ValueError, match="hicache_write_policy"):
        SglangConfig(hicache_write_policy="write_around")


def test_the_real_executor_refuses_hicache():
    class Size:
        num_blocks, block_size, kv_bytes_per_token = 10_000, 1, 131072

    spec = PolicySpec.make("sglang", {"enable_hierarchical_cache": True})
    with pytest.raises(ValueError, match="needs the simulated executor"):
        build_scheduler(spec, H100, 1024, lambda c: Size(), shares_prefixes=True)
    parts = build_scheduler(spec, H100, 1024, lambda c: Size(), shares_prefixes=True, host_copies=1)
    kv = parts.scheduler.kv_cache
    assert isinstance(kv, HiRadixKVCacheManager) and kv.host_tokens == 20_001


def test_layerwise_overlap_is_the_slower_stream_plus_one_layer_of_the_other():
    assert layerwise_load_time(1.0, 0.0, 32) == 1.0
    assert layerwise_load_time(1.0, 0.5, 32) == pytest.approx(1.0 + 0.5 / 32)
    assert layerwise_load_time(1.0, 3.2, 32) == pytest.approx(3.2 + 1.0 / 32)


# ---- whole runs ------------------------------------------------------------------------------------
def _conversations(seed: int, n: int = 150) -> list[Request]:
    """Sessions whose turns extend their own history, arriving interleaved: more history than
    the GPU pool holds, so prefixes are evicted between a session's turns."""
    rng = np.random.default_rng(seed)
    history = [list(rng.integers(0, 30000, int(rng.integers(300, 900)))) for _ in range(16)]
    out = []
    for i in range(n):
        s = int(rng.integers(0, 16))
        history[s] = history[s] + list(rng.integers(0, 30000, int(rng.integers(10, 80))))
        ids = history[s][-2000:]
        out.append(Request(f"r{i}", len(ids), int(rng.integers(2, 40)), i * 0.03, prompt_token_ids=ids))
    return out


def _run(seed: int, hicache: bool, fast: bool = True, **flags) -> tuple[Engine, list[Request]]:
    config = SglangConfig(chunked_prefill_size=2048, enable_hierarchical_cache=hicache, **flags)
    policy = SglangPolicy(config)
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    policy.bind_cost_model(cost, True)
    device = 6000  # small: evicts between turns
    host = HiCacheSpec(config.hicache_ratio or 2.0).host_tokens(device, 1) if hicache else 0
    kv = make_kv_cache(policy.kv_spec(), device, 1, num_host_blocks=host)
    sched = Scheduler(policy, kv, 8192)
    requests = _conversations(seed)
    engine = Engine(sched, SimExecutor(cost, 1), ListSource(requests), options=EngineOptions(fast, True))
    SimDriver(engine).run()
    return engine, requests


@pytest.mark.parametrize(
    "flags",
    [{}, {"disable_overlap_schedule": False}, {"hicache_write_policy": "write_through_selective"},
     {"hicache_write_policy": "write_back", "hicache_ratio": 1.0}],
    ids=["sync", "overlap", "selective", "write-back"],
)  # fmt: skip
def test_every_request_finishes_and_slots_are_conserved(flags):
    engine, requests = _run(5, True, **flags)  # check_integrity after every step (EngineOptions)
    kv = engine.scheduler.kv_cache
    assert all(r.finish_reason == "length" for r in requests)
    # Nobody holds a slot any more: every slot is free or cached by the tree, once.
    assert kv.num_free_blocks + kv.tree.total_size == kv.num_blocks
    assert kv.hicache_stats.loaded_tokens > 0 and kv.hicache_stats.demoted_tokens > 0
    kv.check_integrity()


def test_hicache_raises_the_hit_rate_and_lowers_ttft_under_gpu_pressure():
    warm_engine, warm = _run(6, True)
    _, cold = _run(6, False)
    ttft = lambda rs: float(np.mean([r.token_times[0] - r.arrival_time for r in rs]))  # noqa: E731
    assert sum(r.num_cached_tokens for r in warm) > 1.3 * sum(r.num_cached_tokens for r in cold)
    assert ttft(warm) < ttft(cold)
    # Every loaded token was priced: its share of the host link, overlapped with its batch.
    policy = warm_engine.scheduler.policy
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    loaded = warm_engine.scheduler.kv_cache.hicache_stats.loaded_tokens
    assert policy.hicache.load_seconds == pytest.approx(loaded * cost.swap_time(1))


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_stepping_and_fast_paths_agree_with_hicache(overlap):
    flags = {"disable_overlap_schedule": not overlap}
    _, fast = _run(7, True, fast=True, **flags)
    _, stepped = _run(7, True, fast=False, **flags)
    assert [tuple(r.token_times) for r in fast] == [tuple(r.token_times) for r in stepped]


# ---- engine flags ----------------------------------------------------------------------------------
LINE = "python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B --enable-hierarchical-cache"


def test_sglang_line_maps_hicache_and_says_what_it_does_not_model():
    flags = translate(lint(LINE + " --hicache-ratio 3 --hicache-write-policy write_back")).spec.flags
    assert flags["enable_hierarchical_cache"] is True and flags["hicache_ratio"] == 3.0
    assert flags["hicache_write_policy"] == "write_back"
    assert translate(lint(LINE + " --hicache-size 64")).spec.flags["hicache_size"] == 64
    verdicts = lambda text: {r.flag: r.verdict for r in lint(text).rows}  # noqa: E731
    v = verdicts(
        LINE + " --hicache-io-backend direct --hicache-mem-layout layer_first --hicache-storage-backend file"
    )
    assert v["--enable-hierarchical-cache"] == "scheduling"
    assert (
        v["--hicache-io-backend"]
        == v["--hicache-mem-layout"]
        == v["--hicache-storage-backend"]
        == "not modelled"
    )
    plain = "python -m sglang.launch_server --model-path m --hicache-ratio 3"
    assert verdicts(plain)["--hicache-ratio"] == "no-op"
    assert lint(LINE + " --disable-radix-cache").refused


def test_tune_writes_the_tier_back():
    spec = PolicySpec.make("sglang", {"enable_hierarchical_cache": True, "hicache_ratio": 3.0})
    line = command_line(spec, Deployment("Llama-3-8B", "H100-SXM", 1), None, H100, 8192)
    assert "--enable-hierarchical-cache --hicache-ratio 3" in line
    plain = command_line(
        PolicySpec.make("sglang", {}), Deployment("Llama-3-8B", "H100-SXM", 1), None, H100, 8192
    )
    assert "hicache" not in plain and "hierarchical" not in plain
