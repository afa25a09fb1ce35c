"""KVCacheManager against a brute-force model under random allocate/free sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailserve.kv.paged import KVCacheIntegrityError, KVCacheManager

ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "free"]), st.integers(0, 5), st.integers(1, 200)), max_size=60
)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 40), block_size=st.sampled_from([1, 4, 16]), ops=ops)
def test_random_operations_keep_blocks_conserved(num_blocks, block_size, ops):
    kv = KVCacheManager(num_blocks, block_size)
    held: dict[str, int] = {}  # brute force: blocks per request
    for op, rid_n, tokens in ops:
        rid = f"r{rid_n}"
        if op == "alloc":
            want = -(-tokens // block_size)
            need = max(0, want - held.get(rid, 0))
            result = kv.allocate(rid, tokens)
            if need > num_blocks - sum(held.values()):
                assert result is None
            else:
                assert result is not None and len(result) == need
                held[rid] = max(held.get(rid, 0), want)
        else:
            kv.free(rid)
            held.pop(rid, None)
        kv.check_integrity()
        assert kv.num_used_blocks == sum(held.values())
        for r, n in held.items():
            assert kv.num_held(r) == n
            assert len(set(kv.block_tables[r])) == n


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(4, 16)
    assert kv.allocate("a", 48) is not None
    assert kv.allocate("b", 32) is None
    assert (kv.num_free_blocks == 1 and "b" not in kv.block_tables) or kv.num_held("b") == 0
    kv.check_integrity()


def test_integrity_check_catches_a_leak():
    kv = KVCacheManager(4, 16)
    kv.allocate("a", 32)
    kv._free.append(kv.block_tables["a"][0])  # a block both free and held
    with pytest.raises(KVCacheIntegrityError):
        kv.check_integrity()


@pytest.mark.parametrize(("blocks", "size"), [(0, 16), (4, 0)])
def test_bad_sizes_are_rejected(blocks, size):
    with pytest.raises(ValueError):
        KVCacheManager(blocks, size)


# ---- one manager class per kind, built from what the policy declares ----------------------
def test_factory_builds_the_declared_kind_and_plain_without_token_identities() -> None:
    from tailserve.kv.factory import make_kv_cache
    from tailserve.kv.hashed import HashedKVCacheManager
    from tailserve.kv.radix_manager import RadixKVCacheManager
    from tailserve.kv.spec import KVSpec

    assert type(make_kv_cache(KVSpec("hashed"), 8, 16)) is HashedKVCacheManager
    assert type(make_kv_cache(KVSpec("radix"), 8, 1)) is RadixKVCacheManager
    assert type(make_kv_cache(KVSpec("paged"), 8, 16)) is KVCacheManager
    for kind in ("hashed", "radix"):  # bare lengths could never share
        assert type(make_kv_cache(KVSpec(kind), 8, 16, shares_prefixes=False)) is KVCacheManager
    kv = make_kv_cache(KVSpec("hashed"), 8, 16, num_cpu_blocks=4)
    assert kv.num_cpu_blocks == 4 and kv.prefix_caching and kv.shares_prefixes
    with pytest.raises(ValueError, match="KV cache kind must be one of paged, hashed, radix, got 'lru'"):
        KVSpec("lru")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="swap_space_gib must be >= 0"):
        KVSpec("paged", swap_space_gib=-1.0)


def test_each_policy_declares_its_engines_kv_cache() -> None:
    from tailserve.executors.simulated.hardware import get_hardware
    from tailserve.policies.registry import POLICIES

    device = get_hardware("H100-SXM").device_info
    declared = {}
    for name, cls in POLICIES.items():
        spec = cls(cls.default_config(device, 4096)).kv_spec()
        declared[name] = (spec.kind, spec.swap_space_gib)
    assert declared["vllm"] == ("hashed", 0.0)  # V1: automatic prefix caching on by default
    assert declared["vllm-v0"] == ("paged", 4.0)  # V0: off by default, --swap-space 4 GiB
    assert declared["sglang"] == declared["tgi"] == ("radix", 0.0)
    assert declared["sarathi"] == declared["orca"] == declared["static"] == ("paged", 0.0)
    off = POLICIES["sglang"](POLICIES["sglang"].default_config(device, 4096, disable_radix_cache=True))
    assert off.kv_spec().kind == "paged"


def test_the_plain_manager_answers_prefix_questions_with_nothing() -> None:
    kv = KVCacheManager(4, 16)
    kv.allocate("a", 20)
    assert kv.match_prefix("a", 20) is None and kv.num_registered("a") == 0
    assert kv.prefix_cache_stats is None and not kv.prefix_caching and not kv.shares_prefixes
    assert kv.holds("a", 32) and not kv.holds("a", 33) and not kv.holds("b", 1)
    kv.register_computed("a", 20)
    kv.drop_cached()
    kv.check_integrity()


def test_the_factory_gives_a_radix_manager_its_engines_tree_built_with_the_first_keys() -> None:
    """The radix tree is the manager's (``KVSpec.radix``), built when the first request's keys
    arrive; SGLang's per-token keys get no tree with larger pages, TGI's block keys do."""
    from tailserve.kv.factory import make_kv_cache
    from tailserve.kv.spec import KVSpec

    kv = make_kv_cache(KVSpec("radix", radix="sglang"), 64, 1)
    assert kv.radix_tree is None and kv.can_drop_cached
    kv.set_prefix_keys("a", [])  # no token identities: still no tree
    assert kv.radix_tree is None
    kv.set_prefix_keys("a", [1, 2, 3, 4])
    assert kv.radix_tree is not None and kv.radix_tree.block_size == 1 and not kv.can_drop_cached
    paged_sglang = make_kv_cache(KVSpec("radix", radix="sglang"), 64, 16)
    paged_sglang.set_prefix_keys("a", [(1,) * 16])
    assert paged_sglang.radix_tree is None and paged_sglang.match_prefix("a", 40) is None
    tgi = make_kv_cache(KVSpec("radix", radix="tgi"), 64, 16)
    tgi.set_prefix_keys("a", [(1,) * 16])
    assert tgi.radix_tree is not None and tgi.radix_tree.block_size == 16
    with pytest.raises(ValueError, match="radix cache must be one of sglang, tgi"):
        KVSpec("radix", radix="lru")  # type: ignore[arg-type]
    plain = KVCacheManager(8, 16)  # the interface's answers without a prefix cache
    assert plain.radix_tree is None and plain.can_drop_cached and plain.match_prefix("a", 10) is None
    assert plain.evictable_tokens == 0 and not plain.holds_prefix("a") and plain.take_kv_events() == []


@pytest.mark.parametrize("flavour", ["sglang", "tgi"])
def test_a_radix_manager_caches_on_free_as_its_engine_does(flavour) -> None:
    """SGLang inserts a finished request's tokens and only unlocks an aborted or retracted one;
    TGI inserts the computed prompt blocks of any request that leaves, and only unlocks one put
    back with nothing computed."""
    from tailserve.kv.factory import make_kv_cache
    from tailserve.kv.spec import KVSpec

    kv = make_kv_cache(KVSpec("radix", radix=flavour), 64, 1)
    assert kv.warm([9, 9])  # a cached entry nobody holds
    for rid, finished, computed in (("done", True, 6), ("aborted", False, 6), ("put-back", False, 0)):
        kv.set_prefix_keys(
            rid, {"done": [1, 2, 3, 4, 5, 6], "aborted": [7, 8, 9, 10, 11, 12]}.get(rid, [20] * 6)
        )
        match = kv.match_prefix(rid, 6)
        assert match is not None and match.num_tokens == 0
        kv.lock_prefix(match)
        assert kv.allocate_with_prefix(rid, match, 6) and kv.holds_prefix(rid)
        kv.free(rid, computed, finished)
        assert not kv.holds_prefix(rid)
        kv.forget_prefix_keys(rid)
        kv.check_integrity()
    tree = kv.radix_tree
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).num_tokens == 6  # the finished one, both engines
    aborted_cached = tree.match_prefix([7, 8, 9, 10, 11, 12]).num_tokens
    assert aborted_cached == (6 if flavour == "tgi" else 0)
    assert tree.match_prefix([20] * 6).num_tokens == 0  # put back: nothing cached
    assert tree.protected_size == 0 and kv.num_free_blocks + tree.evictable_size == kv.num_blocks
