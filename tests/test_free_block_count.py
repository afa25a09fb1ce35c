"""``free_block_count`` / ``used_block_count``, the methods the simulator's loop reads, answer what
the ``num_free_blocks`` / ``num_used_blocks`` properties answer, for every manager kind (the
hashed one overrides the method: its free count is the pool's, evictable cached blocks
included)."""

from __future__ import annotations

import random

import pytest

from tailserve.kv.hashed import HashedKVCacheManager
from tailserve.kv.paged import KVCacheManager
from tailserve.kv.radix_manager import RadixKVCacheManager


def _managers() -> list[KVCacheManager]:
    return [
        KVCacheManager(64, 16),  # a list stack
        KVCacheManager(800, 1),  # the compact stack (typed array and its height)
        KVCacheManager(64, 16, num_cpu_blocks=8),
        HashedKVCacheManager(64, 16),
        RadixKVCacheManager(800, 1),
    ]


@pytest.mark.parametrize("index", range(5))
def test_counts_agree_with_properties_through_allocations_and_frees(index: int) -> None:
    kv = _managers()[index]
    rng = random.Random(index)
    held: dict[str, int] = {}

    def check() -> None:
        assert kv.free_block_count() == kv.num_free_blocks
        assert kv.used_block_count() == kv.num_used_blocks == kv.num_blocks - kv.num_free_blocks
        if isinstance(kv, HashedKVCacheManager):
            assert kv.free_block_count() == kv.pool.num_free_blocks

    check()
    for step in range(300):
        rid = f"r{rng.randrange(8)}"
        if rng.random() < 0.65:
            tokens = held.get(rid, 0) + rng.randrange(1, 5 * kv.block_size)
            if kv.allocate(rid, tokens) is not None:
                held[rid] = tokens
        elif rid in held:
            kv.free(rid, held.pop(rid), finished=True)
        check()
        if step % 50 == 49 and held:
            # ``allocate_each``, the runs' path, with room checked first as the runs do.
            ids = sorted(held)
            totals = [held[r] + 1 for r in ids]
            if sum(kv.num_blocks_needed(r, t) for r, t in zip(ids, totals)) <= kv.free_block_count():
                kv.allocate_each(ids, totals)
                held.update(zip(ids, totals))
                check()
