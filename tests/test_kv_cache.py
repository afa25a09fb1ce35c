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
