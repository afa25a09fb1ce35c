"""``KVCacheManager.allocate_each`` at the edges of its one-block case (a request that needs
exactly one more block takes the stack's top id itself, no slice): the ids ``allocate`` takes,
and no room when the stack is empty."""

from __future__ import annotations

import pytest

from tailserve.kv.paged import KVCacheManager


def test_one_block_each_takes_the_ids_allocate_would() -> None:
    each, single = KVCacheManager(6, 16), KVCacheManager(6, 16)
    for kv in (each, single):
        assert kv.allocate("a", 16) == [0] and kv.allocate("b", 32) == [2, 1]
    each.allocate_each(["a", "b"], [17, 33])  # one block each, the first request the top id
    for rid, total in (("a", 17), ("b", 33)):
        single.allocate(rid, total)
    assert each.block_tables == single.block_tables == {"a": [0, 3], "b": [2, 1, 4]}
    assert each.free_ids() == single.free_ids() == [5]
    each.check_integrity()


def test_one_block_with_none_free_is_no_room() -> None:
    kv = KVCacheManager(2, 16)
    assert kv.allocate("a", 32) == [1, 0]
    with pytest.raises(RuntimeError, match="no room for a"):
        kv.allocate_each(["a"], [33])
