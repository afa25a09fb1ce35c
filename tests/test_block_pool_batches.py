"""The batched block pool (numpy ref counts and keys, kv/free_queue.py, kv/block_index.py)
against the plain one-block-at-a-time model of tests/test_prefix_cache.py, at sizes where whole
requests move through the ring, the ring is compacted and keys are cached twice."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tailserve.kv.block_pool import HashedBlockPool
from tailserve.kv.free_queue import FreeBlockQueue
from tailserve.kv.prefix import block_hashes
from test_prefix_cache import RefPool


def _check(pool: HashedBlockPool, ref: RefPool, num_blocks: int) -> None:
    pool.check_integrity()
    assert pool.free_block_ids() == ref.queue
    assert [pool.ref_count(b) for b in range(num_blocks)] == ref.ref
    assert [pool.block_key(b) for b in range(num_blocks)] == ref.key
    assert pool.num_free_blocks == len(ref.queue)
    assert pool.num_evictable == sum(1 for b in ref.queue if ref.key[b] is not None)


@pytest.mark.parametrize("front", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_batched_pool_matches_the_plain_model(seed, front):
    rng = random.Random(seed)
    num_blocks, block_size = rng.choice([(40, 1), (120, 2), (300, 4)])
    pool = HashedBlockPool(num_blocks, block_size, free_unhashed_to_front=front)
    ref = RefPool(num_blocks, front)
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(1, 90))] for _ in range(12)]
    held: list[tuple[list[int], list[int]]] = []
    for _ in range(400):
        op = rng.choice(["request", "request", "request", "free", "free", "cache_again", "evict", "grow"])
        if op == "request":
            base = rng.choice(prompts)
            tokens = base[: rng.randrange(1, len(base) + 1)] + [
                rng.randrange(3) for _ in range(rng.randrange(4))
            ]
            keys = block_hashes(tokens, block_size)
            hit = pool.get_computed_blocks(keys, len(tokens))
            assert hit.kv_indices == ref.match(keys, len(tokens), block_size)
            need = -(-len(tokens) // block_size) - len(hit.kv_indices)
            assert pool.num_unreferenced(hit.kv_indices) == sum(1 for b in hit.kv_indices if ref.ref[b] == 0)
            pool.touch(hit.kv_indices)
            ref.touch(hit.kv_indices)
            new = pool.allocate(need)
            assert new == ref.allocate(need)
            if new is None:
                pool.free(hit.kv_indices)
                ref.free(hit.kv_indices)
            else:
                blocks = hit.kv_indices + new
                k = rng.randrange(len(hit.kv_indices), len(keys) + 1)  # a chunk caches a part
                assert pool.cache_full_blocks(blocks[:k], keys[:k]) == ref.cache_blocks(blocks[:k], keys[:k])
                held.append((blocks, keys))
        elif op == "free" and held:
            blocks, _ = held.pop(rng.randrange(len(held)))
            pool.free(blocks)
            ref.free(blocks)
        elif op == "cache_again" and held:
            blocks, keys = held[rng.randrange(len(held))]
            n = min(len(blocks), len(keys))
            assert pool.cache_full_blocks(blocks[:n], keys[:n]) == ref.cache_blocks(blocks[:n], keys[:n])
        elif op == "grow" and held:  # decode: one more block
            blocks, keys = held[rng.randrange(len(held))]
            new = pool.allocate(1)
            assert new == ref.allocate(1)
            if new:
                blocks.extend(new)
        elif op == "evict":
            k = rng.randrange(0, 12)
            assert pool.evict(k) == ref.evict(k)
        _check(pool, ref, num_blocks)


def test_a_key_cached_twice_hands_over_to_its_second_holder():
    pool = HashedBlockPool(8, 2)
    keys = block_hashes([1, 2, 3, 4], 2)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert pool.cache_full_blocks(a, keys) == 0
    assert pool.cache_full_blocks(b, keys) == 2  # computed concurrently: both cached
    assert pool.get_computed_blocks(keys, 5).kv_indices == a  # a hit takes the first holder
    pool.free(a)
    pool.evict(2)  # a's copies go; b's answer now
    assert pool.get_computed_blocks(keys, 5).kv_indices == b
    pool.check_integrity()
    assert pool.cache_full_blocks(pool.allocate(1), [keys[0]]) == 1
    pool.check_integrity()


def test_one_key_twice_in_one_call_counts_once_as_already_cached():
    pool = HashedBlockPool(4, 1)
    blocks = pool.allocate(2)
    assert pool.cache_full_blocks(blocks, [7, 7]) == 1
    assert pool.get_computed_blocks([7], None).kv_indices == blocks[:1]
    pool.check_integrity()


def test_pool_rejects_keys_it_cannot_store():
    pool = HashedBlockPool(4, 1)
    blocks = pool.allocate(1)
    with pytest.raises(ValueError, match="reserved"):
        pool.cache_full_blocks(blocks, [-1])
    with pytest.raises(ValueError, match="64-bit"):
        pool.cache_full_blocks(blocks, [2**70])
    pool.check_integrity()  # nothing changed


def test_free_queue_ring_compacts_and_keeps_its_order():
    queue = FreeBlockQueue(6)
    assert queue.pop_front(6)[0] == [0, 1, 2, 3, 4, 5]
    order: list[int] = []
    for round_ in range(20):  # far more pushes than the ring's array holds
        ids = np.array([round_ % 6])
        queue.push_back(ids)
        order.append(round_ % 6)
        taken, ring = queue.pop_front(1)
        assert taken == [] and ring.tolist() == [order.pop(0)]
    queue.push_back(np.array([3, 1, 4]))
    queue.remove(np.array([1]))
    queue.push_front([5, 0])
    assert queue.to_list() == [5, 0, 3, 4] and len(queue) == 4
    assert queue.check_integrity() is None
