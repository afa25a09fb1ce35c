"""vLLM V1's block pool with automatic prefix caching (``vllm/v1/core/block_pool.py``).

The pool owns ``num_blocks`` KV blocks. Each has a ref count (requests holding it) and, once it
is full and computed, a key (``prefix_cache.block_hashes``). Blocks with ref count 0 sit in ONE
free queue, which is also the cache's LRU list::

    front (reused first)                                               back (reused last)
    [ free blocks without a key ... | cached blocks, least recently freed ... most recently ]

- ``free`` walks a request's blocks tail first. A block reaching ref count 0 that is cached
  goes to the BACK (``append_n``: LRU); one without a key goes to the FRONT (``prepend_n``, in
  that tail-first order, so the request's last keyless block is reused first), as vLLM 0.32's
  ``BlockPool.free_blocks`` does — found by the differential tests (docs/validation.md): with
  every keyless block at the back, a fresh allocation evicted a cached block vLLM keeps. A
  request's deeper cached blocks are evicted before its shallower ones, which keeps cached
  chains prefix-closed in practice. ``free_unhashed_to_front=False`` appends every block to
  the back (older vLLM releases).
- ``allocate`` pops from the front; popping a cached block evicts its key.
- ``touch`` (a cache hit on a block with ref count 0) takes it out of the queue.

So free and evictable cached blocks form one pool: ``num_free_blocks`` counts both, which is
what vLLM's admission check counts. Differences from vLLM: no null block (block 0 is an ordinary
block), one KV cache group, keys are ints.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from tailserve.kv.prefix import PrefixCache, PrefixCacheIntegrityError, PrefixCacheStats, PrefixMatch


class HashedBlockPool(PrefixCache):
    """KV blocks with ref counts, a content-key index and one LRU free queue; every op is O(1)
    per block touched."""

    def __init__(self, num_blocks: int, block_size: int, *, free_unhashed_to_front: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_unhashed_to_front = free_unhashed_to_front
        self._ref_counts: list[int] = [0] * num_blocks
        self._keys: list[Hashable | None] = [None] * num_blocks
        # key -> the block holding it, or a list of blocks (oldest first) in the rare case of
        # several: vLLM does not de-duplicate, so two requests that computed the same block
        # concurrently both cache it, and a hit takes the first. (An int, not a one-entry
        # container, because that case is nearly all of them.)
        self._cached: dict[Hashable, int | list[int]] = {}
        self._num_cached_blocks = 0
        # The free queue as an ordered set: popitem(last=False) is the front, move_to_end(b,
        # last=False) inserts at the front; both O(1), as is removal from the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._num_free_cached = 0
        self.stats = PrefixCacheStats()

    # ---- counters -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out: free ones plus evictable cached ones."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0..1 (cached-but-free blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached(self) -> int:
        """Blocks that have a key (held or free)."""
        return self._num_cached_blocks

    @property
    def num_evictable(self) -> int:
        """Cached blocks with ref count 0 (in the free queue)."""
        return self._num_free_cached

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_key(self, block_id: int) -> Hashable | None:
        return self._keys[block_id]

    def free_block_ids(self) -> list[int]:
        """The free queue, front (next to be allocated) first. O(n): for tests and debugging."""
        return list(self._free)

    # ---- lookup -------------------------------------------------------------------------------
    def get_computed_blocks(self, block_keys: Sequence[Hashable], num_tokens: int | None) -> PrefixMatch:
        """Longest chain of cached blocks for ``block_keys`` (the request's full-block keys),
        walking until the first miss, capped at ``num_tokens - 1`` tokens rounded down to a block
        so at least one token is computed: a request whose blocks are all cached recomputes its
        whole last block when ``num_tokens`` is a multiple of ``block_size``. ``num_tokens=None``:
        no cap. Changes only stats.
        """
        size = self.block_size
        if num_tokens is None:
            max_blocks = len(block_keys)
            num_tokens = max_blocks * size
        else:
            max_blocks = min(len(block_keys), max(num_tokens - 1, 0) // size)
        cached = self._cached
        hits: list[int] = []
        for i in range(max_blocks):
            holders = cached.get(block_keys[i])
            if holders is None:
                break
            hits.append(holders if type(holders) is int else holders[0])
        stats = self.stats
        stats.num_lookups += 1
        stats.num_query_tokens += num_tokens
        stats.num_hit_tokens += len(hits) * size
        return PrefixMatch(len(hits) * size, hits)

    def match_prefix(self, keys: Sequence[Hashable], num_tokens: int | None = None) -> PrefixMatch:
        return self.get_computed_blocks(keys, num_tokens)

    # ---- ownership ----------------------------------------------------------------------------
    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on each block (cache hits); a free one leaves the free queue."""
        refs = self._ref_counts
        free = self._free
        keys = self._keys
        for block_id in block_ids:
            if refs[block_id] == 0:
                del free[block_id]
                if keys[block_id] is not None:
                    self._num_free_cached -= 1
            refs[block_id] += 1

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Pop ``num_blocks`` blocks from the front of the free queue, evicting the key of any
        cached block popped; each gets ref count 1. None (and nothing changed) when fewer than
        ``num_blocks`` are free."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        free = self._free
        if num_blocks > len(free):
            return None
        refs = self._ref_counts
        keys = self._keys
        out: list[int] = []
        evicted = 0
        cached = self._cached
        popitem = free.popitem
        for _ in range(num_blocks):
            block_id = popitem(last=False)[0]
            key = keys[block_id]
            if key is not None:  # evict: the common single-holder case of _drop_key, inlined
                if type(cached[key]) is int:
                    del cached[key]
                    keys[block_id] = None
                else:
                    self._drop_key(block_id)
                evicted += 1
            refs[block_id] = 1
            out.append(block_id)
        if evicted:
            self._num_free_cached -= evicted
            self._num_cached_blocks -= evicted
            self.stats.num_evicted_tokens += evicted * self.block_size
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block, given in the request's order (first block first);
        they are processed tail first. A block reaching ref count 0 enters the free queue: at
        the back if it is cached, else at the front (see the module docstring)."""
        refs = self._ref_counts
        free = self._free
        keys = self._keys
        to_front: list[int] = []
        for block_id in reversed(block_ids):
            if refs[block_id] <= 0:
                raise ValueError(f"block {block_id} freed but its ref count is {refs[block_id]}")
            refs[block_id] -= 1
            if refs[block_id]:
                continue
            free[block_id] = None
            if keys[block_id] is not None:
                self._num_free_cached += 1
            elif self.free_unhashed_to_front:
                to_front.append(block_id)
        # prepend_n: the first of them (the request's last keyless block) ends up at the front.
        for block_id in reversed(to_front):
            free.move_to_end(block_id, last=False)

    def cache_full_blocks(self, block_ids: Sequence[int], block_keys: Sequence[Hashable]) -> int:
        """Register ``block_ids[i]`` as holding the full, computed block ``block_keys[i]``.

        Blocks that already carry a key are skipped (it must be the same key: a block's content
        does not change while it is held). Each block must be held (ref count > 0). Returns how
        many of the keys were cached before the call (by this block or another one); duplicates
        stay cached, as in vLLM, so the caller frees nothing.
        """
        if len(block_ids) != len(block_keys):
            raise ValueError(f"{len(block_ids)} blocks but {len(block_keys)} keys")
        refs = self._ref_counts
        keys = self._keys
        cached = self._cached
        already = newly = 0
        for block_id, key in zip(block_ids, block_keys):
            if refs[block_id] <= 0:
                raise ValueError(f"block {block_id} is not held (ref count {refs[block_id]})")
            current = keys[block_id]
            if current is not None:
                if current != key:
                    raise ValueError(f"block {block_id} is cached under another key")
                already += 1
                continue
            holders = cached.get(key)
            if holders is None:
                cached[key] = block_id
            else:
                already += 1
                if type(holders) is int:
                    cached[key] = [holders, block_id]
                else:
                    holders.append(block_id)
            keys[block_id] = key
            newly += 1
        self._num_cached_blocks += newly
        return already

    def evict(self, num: int) -> int:
        """Drop the keys of up to ``num`` cached free blocks, least recently freed first; the
        blocks stay free. Returns how many were dropped. (Allocation evicts on its own; this is
        for resetting or shrinking the cache.)"""
        if num <= 0 or not self._num_free_cached:
            return 0
        keys = self._keys
        victims: list[int] = []
        for block_id in self._free:
            if keys[block_id] is not None:
                victims.append(block_id)
                if len(victims) == num:
                    break
        for block_id in victims:
            self._drop_key(block_id)
        self._num_free_cached -= len(victims)
        self._num_cached_blocks -= len(victims)
        self.stats.num_evicted_tokens += len(victims) * self.block_size
        return len(victims)

    def _drop_key(self, block_id: int) -> None:
        """Forget the block's key (the caller updates the counters)."""
        keys = self._keys
        key = keys[block_id]
        cached = self._cached
        holders = cached[key]
        if type(holders) is int:
            del cached[key]
        else:
            holders.remove(block_id)
            if len(holders) == 1:
                cached[key] = holders[0]
        keys[block_id] = None

    # ---- PrefixCache --------------------------------------------------------------------------
    def lock(self, match: PrefixMatch) -> None:
        self.touch(match.kv_indices)

    def unlock(self, match: PrefixMatch) -> None:
        self.free(match.kv_indices)

    def insert(self, keys: Sequence[Hashable], kv_indices: Sequence[int]) -> int:
        return self.cache_full_blocks(kv_indices, keys)

    def check_integrity(self) -> None:
        """Free queue = blocks with ref count 0, each once; key index matches every block's key;
        counters match; with ``free_unhashed_to_front`` no uncached block is behind a cached one."""
        err = PrefixCacheIntegrityError
        refs = self._ref_counts
        keys = self._keys
        free = self._free
        if len(free) != len(set(free)):
            raise err("a block appears twice in the free queue")
        bad_refs = [b for b, r in enumerate(refs) if r < 0]
        if bad_refs:
            raise err(f"negative ref counts on blocks {bad_refs[:5]}")
        zero = {b for b, r in enumerate(refs) if r == 0}
        if zero != set(free):
            raise err(
                f"{len(zero)} blocks have ref count 0 but the free queue holds {len(free)} "
                f"(missing {sorted(zero - set(free))[:5]}, held but free {sorted(set(free) - zero)[:5]})"
            )
        if len(free) + sum(1 for r in refs if r > 0) != self.num_blocks:
            raise err(f"{len(free)} free + used != {self.num_blocks} blocks")
        indexed = 0
        for key, entry in self._cached.items():
            holders = [entry] if type(entry) is int else entry
            if type(entry) is not int and (len(holders) < 2 or len(set(holders)) != len(holders)):
                raise err(f"key {key!r} is indexed with block list {holders}")
            for block_id in holders:
                if keys[block_id] != key:
                    raise err(f"block {block_id} is indexed under {key!r} but has key {keys[block_id]!r}")
            indexed += len(holders)
        with_key = sum(1 for k in keys if k is not None)
        if indexed != with_key or with_key != self._num_cached_blocks:
            raise err(
                f"{with_key} blocks have a key, {indexed} are indexed, counter says {self._num_cached_blocks}"
            )
        free_cached = sum(1 for b in free if keys[b] is not None)
        if free_cached != self._num_free_cached:
            raise err(f"{free_cached} cached blocks are free but the counter says {self._num_free_cached}")
        if self.free_unhashed_to_front:
            seen_cached = False
            for block_id in free:
                if keys[block_id] is not None:
                    seen_cached = True
                elif seen_cached:
                    raise err(f"uncached free block {block_id} is behind a cached one in the free queue")
