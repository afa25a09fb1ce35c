"""The block pool's content index: key -> the oldest block holding it.

vLLM's ``cached_block_hash_to_block`` maps each key to the blocks holding it, and a hit takes the
first. vLLM does not de-duplicate: two requests that computed the same block concurrently both
cache it. Here ``_first`` maps a key to its first holder and ``_more`` lists the later ones,
oldest first (nearly always empty).

A request's keys go in with one ``dict.setdefault`` pass (a C-level loop: the lookup that finds
a duplicate and the insert are one probe) and come out with one ``del`` per key; the rare
duplicates are sorted out afterwards in Python. (A numpy hash table of buckets was tried and was
5x slower per key than the dict; a dict that keeps stale entries instead of deleting them grew
to a few times the pool and lost what it saved to cache misses.)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NO_KEY = -1  # a block without a key (block_pool.py)


class BlockIndex:
    def __init__(self) -> None:
        self._first: dict[int, int] = {}
        self._more: dict[int, list[int]] = {}

    def first_holders(self, keys: Sequence[int], max_blocks: int) -> list[int]:
        """The first holder of each of ``keys[:max_blocks]``, up to the first key nobody holds."""
        get = self._first.get
        found: list[int] = []
        for i in range(max_blocks):
            block_id = get(keys[i])
            if block_id is None:
                break
            found.append(block_id)
        return found

    def add(self, block_ids: list[int], keys: list[int]) -> np.ndarray:
        """Index blocks that were just given these keys, in order. Returns the positions of the
        keys that already had a holder (an earlier block, or one earlier in this call)."""
        first = self._first
        answered = np.fromiter(map(first.setdefault, keys, block_ids), dtype=np.int64, count=len(keys))
        clashes = np.flatnonzero(answered != np.asarray(block_ids, dtype=np.int64))
        more = self._more
        for j in clashes.tolist():
            more.setdefault(keys[j], []).append(block_ids[j])
        return clashes

    def remove(self, block_ids: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """The blocks lose these keys (evicted); a key with later holders hands over to the
        next one. Returns a mask of the keys no block holds any more."""
        first = self._first
        more = self._more
        gone = np.ones(len(keys), dtype=bool)
        if not more:
            for key in keys.tolist():
                del first[key]
            return gone
        for i, (block_id, key) in enumerate(zip(block_ids.tolist(), keys.tolist())):
            others = more.get(key)
            if others is None:
                del first[key]
                continue
            gone[i] = False
            if first[key] == block_id:
                first[key] = others.pop(0)
            else:
                others.remove(block_id)
            if not others:
                del more[key]
        return gone

    def check_integrity(self, block_keys: list[int]) -> str | None:
        """What is wrong, or None: every indexed block holds its key, each once, and every block
        with a key is indexed."""
        indexed = 0
        for key, primary in self._first.items():
            holders = [primary, *self._more.get(key, ())]
            if len(set(holders)) != len(holders) or (key in self._more and not self._more[key]):
                return f"key {key!r} is indexed with block list {holders}"
            for block_id in holders:
                if block_keys[block_id] != key:
                    return f"block {block_id} is indexed under {key!r} but has key {block_keys[block_id]!r}"
            indexed += len(holders)
        if set(self._more) - set(self._first):
            return f"keys {sorted(set(self._more) - set(self._first))[:5]} have later holders but no first"
        with_key = sum(1 for k in block_keys if k != NO_KEY)
        if indexed != with_key:
            return f"{with_key} blocks have a key but {indexed} are indexed"
        return None
