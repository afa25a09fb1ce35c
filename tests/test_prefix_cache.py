"""Prefix caches (vLLM hashed block pool, SGLang radix tree) against brute-force models.

The models keep the same state in the dumbest representation (a plain list for the free queue,
a dict keyed by whole prefix tuples for the tree); hypothesis drives random request lifecycles
and ``check_integrity()`` runs after every operation.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Hashable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailserve.kv.block_pool import HashedBlockPool
from tailserve.kv.prefix import (
    PrefixCacheIntegrityError,
    PrefixMatch,
    block_hashes,
    keys_from_hash_ids,
    token_keys_from_hash_ids,
)
from tailserve.kv.radix import RadixCache

# ---- brute-force models -----------------------------------------------------------------------


class RefPool:
    """vLLM's block pool in the plainest form: one list as the free queue."""

    def __init__(self, num_blocks: int, front: bool) -> None:
        self.ref = [0] * num_blocks
        self.key: list[Hashable | None] = [None] * num_blocks
        self.queue = list(range(num_blocks))
        self.cache: dict[Hashable, list[int]] = {}
        self.front = front

    def match(self, keys: Sequence[Hashable], num_tokens: int, block_size: int) -> list[int]:
        out: list[int] = []
        for key in keys[: (num_tokens - 1) // block_size]:
            if key not in self.cache:
                break
            out.append(self.cache[key][0])
        return out

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                self.queue.remove(b)
            self.ref[b] += 1

    def _drop(self, b: int) -> None:
        self.cache[self.key[b]].remove(b)
        if not self.cache[self.key[b]]:
            del self.cache[self.key[b]]
        self.key[b] = None

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.queue):
            return None
        out, self.queue = self.queue[:n], self.queue[n:]
        for b in out:
            if self.key[b] is not None:
                self._drop(b)
            self.ref[b] = 1
        return out

    def free(self, blocks: list[int]) -> None:
        front = []  # vLLM 0.32 prepend_n: keyless blocks, tail first, all at the front at once
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.key[b] is None and self.front:
                    front.append(b)
                else:
                    self.queue.append(b)
        self.queue[0:0] = front

    def cache_blocks(self, blocks: list[int], keys: Sequence[Hashable]) -> int:
        already = 0
        for b, k in zip(blocks, keys):
            if self.key[b] is not None:
                already += 1
                continue
            already += k in self.cache
            self.cache.setdefault(k, []).append(b)
            self.key[b] = k
        return already

    def evict(self, n: int) -> int:
        victims = [b for b in self.queue if self.key[b] is not None][:n]
        for b in victims:
            self._drop(b)
        return len(victims)


class RefRadix:
    """Every cached token as ``prefix tuple -> [slot, last access tick]``; locks as prefixes."""

    def __init__(self) -> None:
        self.tokens: dict[tuple, list[int]] = {}
        self.locks: list[tuple] = []
        self.clock = 0

    def lock_count(self, prefix: tuple) -> int:
        return sum(1 for p in self.locks if p[: len(prefix)] == prefix)

    def match(self, keys: list[int], num_tokens: int | None) -> list[int]:
        self.clock += 1
        limit = len(keys) if num_tokens is None else min(len(keys), max(num_tokens - 1, 0))
        slots = []
        for i in range(limit):
            entry = self.tokens.get(tuple(keys[: i + 1]))
            if entry is None:
                break
            entry[1] = self.clock
            slots.append(entry[0])
        return slots

    def insert(self, keys: list[int], slots: list[int]) -> int:
        self.clock += 1
        present = 0
        for i in range(len(keys)):
            prefix = tuple(keys[: i + 1])
            if prefix in self.tokens:
                self.tokens[prefix][1] = self.clock
                present += 1
            else:
                self.tokens[prefix] = [slots[i], self.clock]
        return present

    def is_leaf(self, prefix: tuple) -> bool:
        return not any(len(p) == len(prefix) + 1 and p[:-1] == prefix for p in self.tokens)

    def state(self) -> dict[tuple, tuple[int, int, int]]:
        return {p: (s, t, self.lock_count(p)) for p, (s, t) in self.tokens.items()}

    def sizes(self) -> tuple[int, int]:
        locked = sum(1 for p in self.tokens if self.lock_count(p))
        return len(self.tokens) - locked, locked


def dump(tree: RadixCache) -> dict[tuple, tuple[int, int, int]]:
    out: dict[tuple, tuple[int, int, int]] = {}
    stack = [((), tree.root)]
    while stack:
        prefix, node = stack.pop()
        for child in node.children.values():
            for j, (k, s) in enumerate(zip(child.key, child.value)):
                out[(*prefix, *child.key[:j], k)] = (s, child.last_access_time, child.lock_ref)
            stack.append(((*prefix, *child.key), child))
    return out


# ---- hashing and keys -------------------------------------------------------------------------


def test_block_hashes_chain_only_full_blocks():
    tokens = list(range(40))
    keys = block_hashes(tokens, 16)
    assert len(keys) == 2  # the partial third block gets none
    assert block_hashes(tokens[:32], 16) == keys
    assert block_hashes(tokens[16:], 16, parent=keys[0]) == keys[1:]
    other = block_hashes([99, *tokens[1:]], 16)
    assert other[0] != keys[0] and other[1] != keys[1]  # a change propagates down the chain
    assert block_hashes(tokens, 16, extra_key=7)[0] != keys[0]
    assert block_hashes(tokens[:15], 16) == []


def test_keys_are_deterministic_across_processes():
    code = (
        "from tailserve.kv.prefix import block_hashes, keys_from_hash_ids;"
        "print(block_hashes(list(range(40)), 16), keys_from_hash_ids([3, 1, 2], 1500, 512, 16)[-1],"
        " keys_from_hash_ids([3, 1, 2], 1500, 512, 48)[-1])"
    )
    here = (
        f"{block_hashes(list(range(40)), 16)} {keys_from_hash_ids([3, 1, 2], 1500, 512, 16)[-1]} "
        f"{keys_from_hash_ids([3, 1, 2], 1500, 512, 48)[-1]}"
    )
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == here


@settings(max_examples=200, deadline=None)
@given(
    a=st.lists(st.integers(0, 3), max_size=6),
    b=st.lists(st.integers(0, 3), max_size=6),
    extra_a=st.integers(0, 7),
    extra_b=st.integers(0, 7),
    block_size=st.sampled_from([1, 2, 3, 4, 8, 16]),
)
def test_keys_from_hash_ids_share_exactly_the_shared_ancestors(a, b, extra_a, extra_b, block_size):
    tbs = 8  # a small trace block keeps the example fast; the code does not care
    len_a, len_b = len(a) * tbs - (extra_a if a else 0), len(b) * tbs - (extra_b if b else 0)
    keys_a = keys_from_hash_ids(a, len_a, tbs, block_size)
    keys_b = keys_from_hash_ids(b, len_b, tbs, block_size)
    full_a, full_b = a[: len_a // tbs], b[: len_b // tbs]
    assert len(keys_a) == len(full_a) * tbs // block_size  # full trace blocks only
    shared = next(
        (i for i, (x, y) in enumerate(zip(full_a, full_b)) if x != y), min(len(full_a), len(full_b))
    )
    for j in range(min(len(keys_a), len(keys_b))):
        # block j is shared iff every trace block its tokens touch is in the shared prefix
        assert (keys_a[j] == keys_b[j]) == ((j + 1) * block_size <= shared * tbs), (j, shared)


def test_keys_from_hash_ids_at_mooncake_scale():
    keys = keys_from_hash_ids([10, 11, 12], 1200)  # 2 full 512-blocks, partial third
    assert len(keys) == 64
    same_partial = keys_from_hash_ids([10, 11, 12], 1100)
    assert same_partial == keys  # the partial block (id 12) is never keyed
    longer = keys_from_hash_ids([10, 11, 12, 13], 1600)
    assert longer[:64] == keys and len(longer) == 96
    fork = keys_from_hash_ids([10, 99, 12], 1536)
    assert fork[:32] == keys[:32] and all(x != y for x, y in zip(fork[32:64], keys[32:64]))
    assert keys_from_hash_ids([10, 11], 1024)[-1] == keys[-1]  # exact multiple: all blocks full
    assert keys_from_hash_ids([10], 511) == []
    tkeys = token_keys_from_hash_ids([10, 11, 12], 1200)
    assert len(tkeys) == 1024 and tkeys[0] == tkeys[511] != tkeys[512]


# ---- hashed block pool ------------------------------------------------------------------------


def _run_request(pool: HashedBlockPool, keys: list[int], num_tokens: int) -> tuple[PrefixMatch, list[int]]:
    """Admit, compute and cache one request the way vLLM does; returns (hit, all its blocks)."""
    hit = pool.get_computed_blocks(keys, num_tokens)
    pool.touch(hit.kv_indices)
    new = pool.allocate(-(-num_tokens // pool.block_size) - len(hit.kv_indices))
    assert new is not None
    blocks = hit.kv_indices + new
    pool.cache_full_blocks(blocks[: len(keys)], keys)
    pool.check_integrity()
    return hit, blocks


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    num_blocks=st.integers(1, 20),
    block_size=st.sampled_from([1, 2, 4]),
    front=st.booleans(),
)
def test_pool_matches_reference_model(data, num_blocks, block_size, front):
    pool = HashedBlockPool(num_blocks, block_size, free_unhashed_to_front=front)
    ref = RefPool(num_blocks, front)
    held: list[list] = []  # [blocks, keys, number of blocks cached so far]
    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(["request", "request", "free", "cache_more", "evict", "match"]))
        if op in ("request", "match"):
            tokens = data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=14))
            keys = block_hashes(tokens, block_size)
            n = len(tokens)
            hit = pool.get_computed_blocks(keys, n)
            ref_hit = ref.match(keys, n, block_size)
            assert hit.kv_indices == ref_hit and hit.num_tokens == len(ref_hit) * block_size
            assert hit.num_tokens <= n - 1  # at least one token is always computed
            if op == "request":
                pool.touch(hit.kv_indices)
                ref.touch(ref_hit)
                need = -(-n // block_size) - len(ref_hit)
                new = pool.allocate(need)
                assert new == ref.allocate(need)
                if new is None:
                    pool.free(hit.kv_indices)
                    ref.free(ref_hit)
                else:
                    blocks = hit.kv_indices + new
                    k = data.draw(st.integers(len(ref_hit), len(keys)))  # a chunk may cache a part
                    assert pool.cache_full_blocks(blocks[:k], keys[:k]) == ref.cache_blocks(
                        blocks[:k], keys[:k]
                    )
                    held.append([blocks, keys, k])
        elif op == "free" and held:
            blocks, _, _ = held.pop(data.draw(st.integers(0, len(held) - 1)))
            pool.free(blocks)
            ref.free(blocks)
        elif op == "cache_more" and held:
            req = held[data.draw(st.integers(0, len(held) - 1))]
            blocks, keys, _ = req
            assert pool.cache_full_blocks(blocks[: len(keys)], keys) == ref.cache_blocks(
                blocks[: len(keys)], keys
            )
            req[2] = len(keys)
        elif op == "evict":
            k = data.draw(st.integers(0, 4))
            assert pool.evict(k) == ref.evict(k)
        pool.check_integrity()
        assert pool.free_block_ids() == ref.queue
        assert [pool.ref_count(b) for b in range(num_blocks)] == ref.ref
        assert [pool.block_key(b) for b in range(num_blocks)] == ref.key
        assert pool.num_evictable == sum(1 for b in ref.queue if ref.key[b] is not None)
        assert pool.num_free_blocks == len(ref.queue)
        for blocks, keys, k in held:  # referenced blocks are never evicted
            assert all(pool.ref_count(b) >= 1 for b in blocks)
            assert [pool.block_key(b) for b in blocks[:k]] == keys[:k]


def test_pool_cap_recomputes_the_last_block_of_a_fully_cached_prompt():
    pool = HashedBlockPool(8, 16)
    keys = block_hashes(list(range(32)), 16)
    _, blocks = _run_request(pool, keys, 32)
    pool.free(blocks)
    again = pool.get_computed_blocks(keys, 32)
    assert again.num_tokens == 16 and again.kv_indices == blocks[:1]  # whole last block recomputed
    longer = pool.get_computed_blocks(keys, 33)  # one more token: both blocks count
    assert longer.num_tokens == 32
    assert pool.get_computed_blocks(keys, 1).num_tokens == 0
    assert pool.stats.num_hit_tokens == 48 and pool.stats.num_query_tokens == 32 + 32 + 33 + 1


def test_pool_evicts_least_recently_freed_and_tail_first():
    pool = HashedBlockPool(5, 4)
    _, a = _run_request(pool, block_hashes([1] * 8, 4), 8)
    _, b = _run_request(pool, block_hashes([2] * 8, 4), 8)
    pool.free(a)
    pool.free(b)
    free_before = pool.free_block_ids()
    assert free_before == [4, a[1], a[0], b[1], b[0]]  # uncached first, then LRU, tails first
    assert pool.allocate(2) == [4, a[1]]  # the free block, then A's tail: evicted
    assert pool.block_key(a[1]) is None and pool.stats.num_evicted_tokens == 4
    assert pool.get_computed_blocks(block_hashes([1] * 8, 4), 9).num_tokens == 4  # A's head survives
    assert pool.num_evictable == 3 and pool.num_free_blocks == 3


def test_pool_uncached_blocks_go_to_the_front_cached_to_the_back():
    for front in (True, False):
        pool = HashedBlockPool(5, 4, free_unhashed_to_front=front)
        _, a = _run_request(pool, block_hashes([9] * 8, 4), 8)  # 2 full blocks, freed first
        pool.free(a)
        _, b = _run_request(pool, block_hashes(list(range(10)), 4), 10)  # 2 full + 1 partial
        pool.free(b)
        # front rule: B's uncached partial block is reused before any cached block; vLLM's
        # append-everything-to-the-back reuses A's (older) tail block first.
        assert pool.allocate(1) == ([b[2]] if front else [a[1]])
        pool.check_integrity()


def test_pool_touch_takes_a_cached_block_out_of_the_free_queue():
    pool = HashedBlockPool(4, 4)
    keys = block_hashes([7] * 8, 4)
    _, blocks = _run_request(pool, keys, 8)
    pool.free(blocks)
    assert pool.num_free_blocks == 4 and pool.num_evictable == 2
    hit = pool.get_computed_blocks(keys, 9)
    pool.lock(hit)
    assert pool.num_free_blocks == 2 and pool.num_evictable == 0 and pool.num_cached == 2
    assert pool.allocate(3) is None  # held cached blocks are not evictable; nothing changed
    assert pool.allocate(2) is not None and pool.num_cached == 2
    pool.unlock(hit)
    pool.check_integrity()
    assert pool.num_evictable == 2


def test_pool_keeps_duplicate_blocks_like_vllm():
    pool = HashedBlockPool(6, 4)
    keys = block_hashes([3] * 8, 4)
    first = pool.allocate(2)
    second = pool.allocate(2)  # two requests computing the same prefix at once
    assert first is not None and second is not None
    assert pool.cache_full_blocks(first, keys) == 0
    assert pool.insert(keys, second) == 2  # both keys were already cached; kept anyway
    assert pool.num_cached == 4
    assert pool.get_computed_blocks(keys, 9).kv_indices == first
    pool.free(first)
    pool.free(second)
    pool.check_integrity()
    assert pool.evict(2) == 2  # first's blocks go (freed earlier); second's still answer
    assert pool.get_computed_blocks(keys, 9).kv_indices == second


def test_pool_rejects_misuse_and_integrity_catches_corruption():
    pool = HashedBlockPool(2, 4)
    with pytest.raises(ValueError):
        pool.free([0])
    with pytest.raises(ValueError):
        pool.cache_full_blocks([0], [1])  # not held
    blocks = pool.allocate(1)
    assert blocks is not None
    pool._free.push_front(blocks)  # held and free at once
    with pytest.raises(PrefixCacheIntegrityError, match="ref count 0"):
        pool.check_integrity()


# ---- radix tree ---------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_radix_matches_reference_model(data):
    tree = RadixCache()
    ref = RefRadix()
    slot_ids = itertools.count()
    locks: list[tuple[PrefixMatch, tuple]] = []
    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(["insert", "insert", "match", "lock", "unlock", "evict"]))
        keys = data.draw(st.lists(st.integers(0, 2), max_size=9))
        if op == "insert":
            slots = [next(slot_ids) for _ in keys]
            assert tree.insert(keys, slots) == ref.insert(keys, slots)
        elif op in ("match", "lock"):
            cap = data.draw(st.none() | st.integers(0, 10))
            match = tree.match_prefix(keys, cap)
            expected = ref.match(keys, cap)
            assert match.num_tokens == len(expected) and match.kv_indices == expected
            if op == "lock":
                tree.lock(match)
                prefix = tuple(keys[: match.num_tokens])
                ref.locks.append(prefix)
                locks.append((match, prefix))
        elif op == "unlock" and locks:
            match, prefix = locks.pop(data.draw(st.integers(0, len(locks) - 1)))
            tree.unlock(match)
            ref.locks.remove(prefix)
        elif op == "evict":
            want = data.draw(st.integers(0, 8))
            evictable_before = ref.sizes()[0]
            chunks: list[list[int]] = []
            freed = tree.evict(want, chunks.append)
            slots = [s for c in chunks for s in c]
            assert freed == len(slots) >= min(want, evictable_before)
            assert sum(len(c) for c in chunks[:-1]) < want or not chunks  # stops once enough
            by_slot = {s: p for p, (s, _) in ref.tokens.items()}
            gone = [by_slot[s] for s in slots]
            assert all(ref.lock_count(p) == 0 for p in gone)  # locked tokens are never evicted
            gone_times = [ref.tokens[p][1] for p in gone]
            for p in gone:
                del ref.tokens[p]
            assert all(p[:-1] in ref.tokens for p in ref.tokens if len(p) > 1)  # still a tree
            leaf_times = [t for p, (_, t) in ref.tokens.items() if ref.lock_count(p) == 0 and ref.is_leaf(p)]
            if gone and leaf_times:  # LRU: no evictable leaf left is older than what went
                assert max(gone_times) <= min(leaf_times)
        tree.check_integrity()
        assert dump(tree) == ref.state()
        assert (tree.evictable_size, tree.protected_size) == ref.sizes()


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_radix_evicts_in_lru_order(data):
    tree = RadixCache()
    slot_ids = itertools.count()
    for _ in range(data.draw(st.integers(1, 25))):
        keys = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=8))
        if data.draw(st.booleans()):
            tree.insert(keys, [next(slot_ids) for _ in keys])
        else:
            tree.match_prefix(keys)
    times = {slot: t for slot, t, _ in dump(tree).values()}  # slot -> last access tick
    want = data.draw(st.integers(1, 12))
    chunks: list[list[int]] = []
    tree.evict(want, chunks.append)
    tree.check_integrity()
    evicted_times = [times[c[0]] for c in chunks]
    assert evicted_times == sorted(evicted_times)  # popped oldest first
    remaining = [n.last_access_time for n in tree._evictable_leaves()]
    if chunks and remaining:
        assert max(evicted_times) <= min(remaining)


def test_radix_split_insert_and_match():
    tree = RadixCache()
    assert tree.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14]) == 0
    assert tree.insert([1, 2, 3, 9], [20, 21, 22, 23]) == 3  # caller frees 20, 21, 22
    assert tree.num_nodes == 4  # root, [1 2 3], [4 5], [9]
    m = tree.match_prefix([1, 2, 3, 4, 7])
    assert (m.num_tokens, m.kv_indices) == (4, [10, 11, 12, 13])
    assert tree.num_nodes == 5 and m.node is not None and m.node.key == [4]  # [4 5] split
    assert tree.total_size == 6 and tree.evictable_size == 6
    assert tree.match_prefix([1, 2, 3, 4, 5], num_tokens=5).num_tokens == 4  # the cap
    assert tree.match_prefix([1, 2, 3, 4, 5], num_tokens=6).num_tokens == 5
    assert tree.match_prefix([8]).num_tokens == 0
    tree.check_integrity()


def test_radix_locked_paths_survive_eviction():
    tree = RadixCache()
    tree.insert([1, 2, 3], [0, 1, 2])
    tree.insert([1, 2, 4, 5], [3, 4, 5, 6])
    m = tree.match_prefix([1, 2, 3])
    tree.lock(m)
    assert (tree.protected_size, tree.evictable_size) == (3, 2)
    freed: list[int] = []
    assert tree.evict(100, freed.extend) == 2 and sorted(freed) == [5, 6]
    assert tree.match_prefix([1, 2, 3, 9]).num_tokens == 3
    tree.unlock(m)
    assert tree.evictable_size == 3
    assert tree.evict(1, freed.extend) == 1  # [3] first: the leaf; then [1 2] is a leaf
    assert tree.evict(1, freed.extend) == 2 and tree.total_size == 0
    tree.check_integrity()
    with pytest.raises(ValueError):
        tree.unlock(m)
    with pytest.raises(ValueError):
        tree.lock(m)  # its node was evicted


def test_radix_lru_prefers_the_oldest_leaf():
    tree = RadixCache()
    tree.insert([1, 1], [0, 1])  # tick 1
    tree.insert([2, 2], [2, 3])  # tick 2
    tree.insert([3, 3], [4, 5])  # tick 3
    tree.match_prefix([1, 1])  # tick 4: A is now the newest
    order: list[list[int]] = []
    tree.evict(6, order.append)
    assert order == [[2, 3], [4, 5], [0, 1]]


def test_radix_integrity_catches_corruption():
    tree = RadixCache()
    tree.insert([1, 2], [0, 1])
    tree._evictable_size += 1
    with pytest.raises(PrefixCacheIntegrityError, match="evictable"):
        tree.check_integrity()


# ---- Mooncake-style prompts ---------------------------------------------------------------------

# (input_length, hash_ids): one id per 512-token block, the last one partial unless exact.
MOONCAKE_LIKE = [
    (1200, [0, 1, 2]),
    (1536, [0, 1, 3]),  # shares 0, 1 -> 64 blocks of 16
    (700, [0, 4]),  # shares 0 -> 32
    (1024, [0, 1]),  # shares 0, 1 entirely; cap at num_tokens - 1 -> 63
    (2048, [0, 1, 3, 5]),  # shares 0, 1, 3 -> 96
    (600, [7, 8]),  # -> 0
    (1100, [0, 1, 2]),  # same ids as the first; its partial block 2 was never cached -> 64
    (400, [0]),  # no full block -> 0
]


def direct_shared_full_blocks(rows: Sequence[tuple[int, Sequence[int]]], tbs: int = 512) -> list[int]:
    """Per request, how many leading FULL trace blocks an earlier request's full blocks hold."""
    trie: dict = {}
    out = []
    for input_length, hash_ids in rows:
        full = hash_ids[: input_length // tbs]
        node, shared = trie, 0
        while shared < len(full) and full[shared] in node:
            node = node[full[shared]]
            shared += 1
        out.append(shared)
        node = trie
        for h in full:
            node = node.setdefault(h, {})
    return out


def test_pool_counts_shared_blocks_of_a_mooncake_like_list():
    direct = direct_shared_full_blocks(MOONCAKE_LIKE)
    expected = [min(s * 32, (n - 1) // 16) for s, (n, _) in zip(direct, MOONCAKE_LIKE)]
    assert expected == [0, 64, 32, 63, 96, 0, 64, 0]
    pool = HashedBlockPool(1000, 16)
    got = []
    for n, ids in MOONCAKE_LIKE:
        hit, blocks = _run_request(pool, keys_from_hash_ids(ids, n), n)
        got.append(hit.num_tokens // 16)
        pool.free(blocks)
        pool.check_integrity()
    assert got == expected


@pytest.mark.parametrize("page_size", [1, 16])
def test_radix_counts_shared_tokens_of_a_mooncake_like_list(page_size):
    direct = direct_shared_full_blocks(MOONCAKE_LIKE)
    tree = RadixCache(page_size)
    slot_ids = itertools.count()
    got = []
    for n, ids in MOONCAKE_LIKE:
        keys = (
            token_keys_from_hash_ids(ids, n) if page_size == 1 else keys_from_hash_ids(ids, n, 512, page_size)
        )
        m = tree.match_prefix(keys, n)
        tree.lock(m)
        got.append(m.num_tokens)
        tree.insert(keys, m.kv_indices + [next(slot_ids) for _ in keys[len(m.kv_indices) :]])
        tree.unlock(m)
        tree.check_integrity()
    assert got == [min(s * 512, (n - 1) // page_size * page_size) for s, (n, _) in zip(direct, MOONCAKE_LIKE)]
    assert tree.total_size == 4 * 512 // page_size + 512 // page_size  # ids 0 1 3 5, and 7


def test_mooncake_trace_repeat_fraction(traces_dir):
    path = traces_dir / "mooncake_conversation.jsonl"
    if not path.exists():
        pytest.skip(f"{path} is not present")
    rows = []
    with path.open() as f:
        for line in f:
            obj = json.loads(line)
            rows.append((obj["input_length"], obj["hash_ids"]))
    seen: set[int] = set()
    repeats = total = 0
    for _, ids in rows:
        for h in ids:
            repeats += h in seen
            seen.add(h)
        total += len(ids)
    fraction = repeats / total
    print(f"mooncake: {repeats}/{total} = {fraction:.4f} of 512-token prompt blocks repeat an earlier block")
    assert 0.35 <= fraction <= 0.39  # the trace README says about 37%; measured 36.6%
    # A pool big enough never to evict reports exactly the prefix-shared full blocks.
    direct = direct_shared_full_blocks(rows)
    pool = HashedBlockPool(sum(len(ids) for _, ids in rows), 512)
    hits = 0
    for (n, ids), shared in zip(rows, direct):
        keys = keys_from_hash_ids(ids, n, 512, 512)
        hit = pool.get_computed_blocks(keys, n)
        assert hit.num_tokens == 512 * min(shared, (n - 1) // 512)
        hits += hit.num_tokens // 512
        pool.touch(hit.kv_indices)
        new = pool.allocate(-(-n // 512) - len(hit.kv_indices))
        assert new is not None
        pool.cache_full_blocks((hit.kv_indices + new)[: len(keys)], keys)
        pool.free(hit.kv_indices + new)
    print(f"mooncake: an unbounded vLLM pool hits {hits}/{total} = {hits / total:.4f} of prompt blocks")
    pool.check_integrity()


def test_both_caches_serve_the_same_interface():
    """The lifecycle in ``PrefixCache``'s docstring, run on each implementation."""
    for cache, keys in (
        (HashedBlockPool(8, 4), block_hashes(list(range(12)), 4)),
        (RadixCache(), list(range(12))),
    ):
        assert cache.match_prefix(keys).num_tokens == 0
        first = cache.match_prefix(keys, 12)
        cache.lock(first)
        own = cache.allocate(3) if isinstance(cache, HashedBlockPool) else list(range(100, 112))
        assert own is not None
        assert cache.insert(keys, own) == 0
        cache.unlock(first)
        if isinstance(cache, HashedBlockPool):
            cache.free(own)
        assert cache.num_cached == cache.num_evictable == len(keys)
        again = cache.match_prefix(keys, 12)
        assert again.num_tokens == 12 - cache.block_size  # the cap: one unit is recomputed
        assert cache.match_prefix(keys).num_tokens == 12  # no cap without num_tokens
        cache.lock(again)
        assert cache.num_evictable == 1 and cache.evict(5) == 1
        cache.unlock(again)
        assert cache.evict(100) == len(keys) - 1 and cache.num_cached == 0
        cache.check_integrity()
