"""KVCacheManager against a brute-force model under random allocate/free sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailserve.core.kv_cache import KVCacheIntegrityError, KVCacheManager

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
