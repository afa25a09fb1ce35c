"""The hashed block pool's per-trace-block index (kv/trace_block_index.py) holds what the per-key
index holds: two pools run the same operations, one given Mooncake keys as ``TraceBlockKeys``
(indexed one trace block at a time), the other the same keys as plain lists (one dict entry per
block), and every answer — hits, allocations, evictions, the free queue, KV events — must agree.
The sizes make trace blocks partly evicted, hit after a partial eviction, and computed twice."""

from __future__ import annotations

import pickle
import random

import pytest

from tailserve.kv.block_pool import HashedBlockPool
from tailserve.kv.hashed import HashedKVCacheManager
from tailserve.kv.prefix import NONE_HASH, TraceBlockKeys, block_hashes, keys_from_hash_ids

TRACE_BLOCK, BLOCK = 8, 2  # 4 pool blocks per trace block
KEYS = object()  # stands for a prompt's keys in Twins.same


def _state(pool: HashedBlockPool) -> tuple:
    pool.check_integrity()
    n = pool.num_blocks
    return (
        pool.free_block_ids(),
        [pool.ref_count(b) for b in range(n)],
        [pool.block_key(b) for b in range(n)],
        pool.num_evictable,
        pool.num_cached,
        pool.take_events(),
    )


class Twins:
    """The same pool twice: ``trace`` gets TraceBlockKeys, ``plain`` the same keys as lists."""

    def __init__(self, num_blocks: int) -> None:
        self.trace = HashedBlockPool(num_blocks, BLOCK)
        self.plain = HashedBlockPool(num_blocks, BLOCK)
        self.trace.take_events()  # record KV events from now on
        self.plain.take_events()

    def same(self, method: str, *args, keys: tuple[list[int], int] | None = None, **kwargs):
        """Call ``method`` on both pools (``KEYS`` in ``args``: the prompt's keys, as each pool
        gets them); the answers must agree."""
        answers = []
        for pool, trace in ((self.trace, True), (self.plain, False)):
            given = [_keys(*keys, trace) if a is KEYS else a for a in args]
            answers.append(getattr(pool, method)(*given, **kwargs))
        assert answers[0] == answers[1]
        return answers[0]

    def check(self) -> None:
        assert _state(self.trace) == _state(self.plain)


def _keys(hash_ids: list[int], length: int, trace: bool) -> list[int]:
    keys = keys_from_hash_ids(hash_ids, length, TRACE_BLOCK, BLOCK)
    assert isinstance(keys, TraceBlockKeys) and keys.per == TRACE_BLOCK // BLOCK
    return keys if trace else list(keys)


@pytest.mark.parametrize("seed", range(8))
def test_trace_index_answers_as_the_per_key_index(seed):
    rng = random.Random(seed)
    num_blocks = rng.choice([24, 40, 64])
    twins = Twins(num_blocks)
    # conversations: a prompt is a prefix of one of a few hash-id sequences, plus a few new ids
    bases = [[rng.randrange(4) for _ in range(rng.randrange(1, 7))] for _ in range(5)]
    held: list[list] = []  # [hash_ids, length, blocks, blocks cached]
    for _ in range(300):
        op = rng.choice(["request", "request", "request", "free", "free", "cache_more", "evict", "grow"])
        if op == "request":
            base = rng.choice(bases)
            hash_ids = base[: rng.randrange(1, len(base) + 1)] + [
                rng.randrange(4) for _ in range(rng.randrange(2))
            ]
            length = len(hash_ids) * TRACE_BLOCK - rng.randrange(TRACE_BLOCK)
            num_keys = len(keys_from_hash_ids(hash_ids, length, TRACE_BLOCK, BLOCK))
            hit = twins.same("get_computed_blocks", KEYS, length, keys=(hash_ids, length)).kv_indices
            # a router's view: the uncapped leading run, not counted in the hit rate
            lookups = twins.trace.stats.num_lookups
            cached = twins.same("num_cached_prefix", KEYS, keys=(hash_ids, length))
            assert twins.trace.stats.num_lookups == lookups
            assert cached == len(
                twins.trace.get_computed_blocks(_keys(hash_ids, length, True), None).kv_indices
            )
            need = -(-length // BLOCK) - len(hit)
            twins.same("touch", hit)
            new = twins.same("allocate", need)
            if new is None:
                twins.same("free", hit)
            else:
                blocks = hit + new
                k = rng.randrange(len(hit), num_keys + 1)  # a chunk caches a part, from where it starts
                start = rng.randrange(0, k + 1)
                twins.same(
                    "cache_full_blocks", blocks[start:k], KEYS, None, start=start, keys=(hash_ids, length)
                )
                held.append([hash_ids, length, blocks])
        elif op == "free" and held:
            blocks = held.pop(rng.randrange(len(held)))[2]
            twins.same("free", blocks)
        elif op == "cache_more" and held:
            hash_ids, length, blocks = held[rng.randrange(len(held))]
            n = min(len(blocks), len(keys_from_hash_ids(hash_ids, length, TRACE_BLOCK, BLOCK)))
            twins.same("cache_full_blocks", blocks[:n], KEYS, keys=(hash_ids, length))
        elif op == "grow" and held:  # decode: one more (keyless) block
            blocks = held[rng.randrange(len(held))][2]
            new = twins.same("allocate", 1)
            if new:
                blocks.extend(new)
        elif op == "evict":
            k = rng.randrange(0, 12)
            twins.same("evict", k)
        twins.check()


def test_a_partly_evicted_trace_block_is_hit_up_to_its_first_gap():
    pool = HashedBlockPool(11, BLOCK)
    keys = keys_from_hash_ids([5, 6], 2 * TRACE_BLOCK, TRACE_BLOCK, BLOCK)  # 2 trace blocks, 8 keys
    blocks = pool.allocate(8)
    others = pool.allocate(3)  # the rest of the pool, held elsewhere
    pool.cache_full_blocks(blocks, keys)
    pool.free(blocks)  # tail first: the second trace block's last slot is evicted first
    assert pool.allocate(3) == blocks[::-1][:3]  # slots 3, 2, 1 of the second trace block
    pool.free(others)
    hit = pool.get_computed_blocks(keys, None)
    assert hit.kv_indices == blocks[:5]  # the first trace block and slot 0 of the second
    pool.check_integrity()
    # the hit is taken and the missing slots computed again: the trace block is whole again
    pool.touch(hit.kv_indices)
    again = pool.allocate(3)
    assert pool.cache_full_blocks(again, keys, None, start=5) == 0
    assert pool.get_computed_blocks(keys, None).kv_indices == blocks[:5] + again
    pool.free(blocks[:5] + again)
    pool.check_integrity()
    # everything evicted: no row is left behind
    assert pool.evict(11) == 8 and pool.num_cached == 0
    assert pool.get_computed_blocks(keys, None).kv_indices == []
    assert not pool._trace_index._row_of
    pool.check_integrity()


def test_a_hit_capped_inside_a_trace_block_then_its_rest_evicted_and_computed_twice():
    pool = HashedBlockPool(10, BLOCK)
    keys = keys_from_hash_ids([1], TRACE_BLOCK, TRACE_BLOCK, BLOCK)  # 4 keys, one trace block
    a = pool.allocate(4)
    pool.cache_full_blocks(a, keys)
    pool.free(a)  # the ring: slots 3, 2, 1, 0
    short = pool.get_computed_blocks(keys, 2 * BLOCK + 1)  # a 5-token prompt hits 2 slots
    assert short.kv_indices == a[:2]
    pool.touch(short.kv_indices)  # slots 0-1 leave the free queue; 2-3 stay in it
    filler = pool.allocate(7)  # the 6 keyless blocks, then slot 3 (evicted)
    assert filler[-1] == a[3] and pool.block_key(a[3]) is None
    pool.free(short.kv_indices)
    assert pool.evict(1) == 1 and pool.block_key(a[2]) is None  # least recently freed: slot 2
    pool.free(filler)
    assert pool.get_computed_blocks(keys, None).kv_indices == a[:2]
    b = pool.allocate(4)
    assert pool.cache_full_blocks(b, keys) == 2  # slots 0-1 were cached: b's copies come second
    assert pool.get_computed_blocks(keys, None).kv_indices == a[:2] + b[2:]
    pool.check_integrity()
    pool.free(b)
    assert pool.evict(10) == 6 and pool.num_cached == 0
    pool.check_integrity()


def test_a_gap_before_cached_slots_stops_the_walk_until_it_is_filled():
    pool = HashedBlockPool(8, BLOCK)
    keys = keys_from_hash_ids([2], TRACE_BLOCK, TRACE_BLOCK, BLOCK)
    late = pool.allocate(2)
    pool.cache_full_blocks(late, keys, None, start=2)  # slots 2-3 only
    assert pool.get_computed_blocks(keys, None).kv_indices == []
    early = pool.allocate(2)
    pool.cache_full_blocks(early, keys, None, start=0)
    assert pool.get_computed_blocks(keys, None).kv_indices == early + late
    pool.free(early)
    pool.evict(1)  # slot 1 (freed tail first): slots 0, 2, 3 stay cached
    assert pool.get_computed_blocks(keys, None).kv_indices == early[:1]
    pool.check_integrity()


def test_trace_keys_and_token_keys_share_one_pool():
    pool = HashedBlockPool(16, BLOCK)
    pool.take_events()
    trace = keys_from_hash_ids([3, 4], 2 * TRACE_BLOCK, TRACE_BLOCK, BLOCK)
    tokens = block_hashes(list(range(8)), BLOCK)
    a, b = pool.allocate(8), pool.allocate(4)
    pool.cache_full_blocks(a, trace)
    pool.cache_full_blocks(b, tokens)
    pool.free(b)
    pool.free(a)  # the ring: b tail first, then a tail first
    assert pool.get_computed_blocks(trace, None).kv_indices == a
    assert pool.get_computed_blocks(tokens, None).kv_indices == b
    pool.allocate(6)  # the 4 keyless blocks, then b's last two
    pool.take_events()
    pool.allocate(3)  # b's first two (per-key index) and a's last (trace index) in one call
    assert pool.take_events() == [("removed", [tokens[1], tokens[0], trace[7]])]
    pool.check_integrity()
    assert pool.get_computed_blocks(tokens, None).kv_indices == []
    assert pool.get_computed_blocks(trace, None).kv_indices == a[:7]
    assert pool.evict(16) == 7 and pool.num_cached == 0
    pool.check_integrity()


def test_the_manager_indexes_mooncake_prompts_by_trace_block():
    kv = HashedKVCacheManager(128, 16)
    keys = keys_from_hash_ids([9, 8, 7], 3 * 512)  # 96 keys, 3 trace blocks
    kv.set_prefix_keys("r", keys)
    assert kv.allocate("r", 3 * 512) is not None
    kv.register_computed("r", 700)  # a chunk ending inside the second trace block
    kv.register_computed("r", 3 * 512)
    kv.check_integrity()
    assert len(kv.pool._trace_index._row_of) == 3 and not kv.pool._index._first
    kv.free("r")
    kv.set_prefix_keys("s", keys)
    assert kv.match_prefix("s", 3 * 512 + 1).num_tokens == 3 * 512


def test_trace_block_keys_wrong_use_is_refused_and_they_pickle():
    pool = HashedBlockPool(8, BLOCK)
    blocks = pool.allocate(4)
    pool.cache_full_blocks(blocks, keys_from_hash_ids([1], TRACE_BLOCK, TRACE_BLOCK, BLOCK))
    other = keys_from_hash_ids([1], 16, 16, BLOCK)  # 8 keys per trace block in a 4-per pool
    with pytest.raises(ValueError, match="keys per trace block"):
        pool.get_computed_blocks(other, None)
    with pytest.raises(ValueError, match="keys"):
        pool.cache_full_blocks(pool.allocate(2), other, None, start=7)
    pool.check_integrity()
    keys = keys_from_hash_ids([1, 2], 1024)
    back = pickle.loads(pickle.dumps(keys))
    assert back == keys and isinstance(back, TraceBlockKeys) and back.per == 32
    assert type(keys[:3]) is list  # a slice is plain: hand the pool the whole list
    assert type(keys_from_hash_ids([1, 2], 1024, 512, 512)) is list  # one key per trace block


def _chained_per_block(hash_ids: list[int], length: int, tbs: int, bs: int) -> list[int]:
    """The keys of e2e8cca: every pool block's key chained in Python from the one before."""
    key, out = NONE_HASH, []
    for j in range(min(length // tbs, len(hash_ids))):
        for _ in range(tbs // bs):
            key = hash((key, hash_ids[j]))
            out.append(key)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_mixed_trace_keys_are_equal_exactly_where_the_chained_ones_were(seed):
    rng = random.Random(seed)
    prompts = []
    for _ in range(30):
        ids = [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
        prompts.append((ids, len(ids) * 64 - rng.randrange(64)))
    new = [keys_from_hash_ids(ids, n, 64, 16) for ids, n in prompts]
    old = [_chained_per_block(ids, n, 64, 16) for ids, n in prompts]
    assert [len(k) for k in new] == [len(k) for k in old]
    every_new = [k for keys in new for k in keys]
    every_old = [k for keys in old for k in keys]
    pairs = set(zip(every_new, every_old))
    # a bijection between the two key sets: equal new keys exactly where the old ones are equal
    assert len(pairs) == len(set(every_new)) == len(set(every_old))
    assert -1 not in every_new
    for keys in new:
        if keys:
            assert isinstance(keys, TraceBlockKeys) and keys.array.tolist() == list(keys)
