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

Speed: a request's blocks move through the pool in batches (numpy arrays of ref counts and keys,
``kv/free_queue.py`` for the queue), so one allocation, caching or free of ~750 blocks costs a
few array operations and one C-level pass over the key index, not a Python loop per block. The
order of every queue and index operation is the one-block-at-a-time order above
(tests/test_prefix_cache.py and tests/test_block_pool_batches.py check it against a plain model).
Keys from Mooncake ``hash_ids`` (``prefix.TraceBlockKeys``) go to a second index with one entry
per trace block (``kv/trace_block_index.py``) instead of one per block; it holds the same holders
(tests/test_trace_block_index.py runs both side by side).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from tailserve.kv.block_index import NO_KEY, BlockIndex
from tailserve.kv.free_queue import FreeBlockQueue
from tailserve.kv.prefix import (
    PrefixCache,
    PrefixCacheIntegrityError,
    PrefixCacheStats,
    PrefixMatch,
    TraceBlockKeys,
)
from tailserve.kv.trace_block_index import TraceBlockIndex

# Keys are 64-bit ints (``prefix.block_hashes``, ``keys_from_hash_ids``: values of ``hash()``,
# which never returns -1 in CPython), so NO_KEY = -1 marks a block without one.


class HashedBlockPool(PrefixCache):
    """KV blocks with ref counts, a content-key index and one LRU free queue; each operation is
    a few array operations per call plus O(1) C-level work per block touched."""

    def __init__(self, num_blocks: int, block_size: int, *, free_unhashed_to_front: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_unhashed_to_front = free_unhashed_to_front
        self._refs = np.zeros(num_blocks, dtype=np.int32)
        self._keys = np.full(num_blocks, NO_KEY, dtype=np.int64)
        self._index = BlockIndex()  # key -> its first holder (kv/block_index.py)
        self._trace_index: TraceBlockIndex | None = None  # Mooncake keys, made at their first use
        self._num_cached_blocks = 0
        self._free = FreeBlockQueue(num_blocks)
        self._num_free_cached = 0
        self.stats = PrefixCacheStats()
        # vLLM's KV events (``--kv-events-config``), when someone listens: ("stored", keys,
        # parent key or None, their blocks' token ids or []) when keys gain their first holder, ("removed", keys) when they
        # lose their last one, in the order it happened; ``take_events`` empties it.
        self.kv_events: list[tuple] | None = None
        # Called with the keys an allocation evicts (those that lost their last holder, in
        # eviction order): TensorRT-LLM's secondary pool offloads them (kv/secondary_pool.py);
        # None (vLLM) evicts them for good.
        self.on_evict: Callable[[list[int]], None] | None = None

    def _record_stored(
        self,
        block_keys: Sequence[int],
        slots: list[int],
        parent_key: int | None,
        token_ids: Sequence[int] | None,
    ) -> None:
        """KV events for the blocks ``block_keys[slots]`` that gained a first holder: one event per
        run of consecutive blocks, each with the key of the block before it (a consumer that
        rehashes tokens, as Dynamo's indexer and the tailserve router do, chains from it) and,
        when ``token_ids`` are known, its blocks' tokens."""
        bs = self.block_size
        i = 0
        while i < len(slots):
            j = i + 1
            while j < len(slots) and slots[j] == slots[j - 1] + 1:
                j += 1
            first, last = slots[i], slots[j - 1] + 1
            parent = int(block_keys[first - 1]) if first > 0 else parent_key
            keys = [int(k) for k in block_keys[first:last]]
            tokens = list(token_ids[first * bs : last * bs]) if token_ids is not None else []
            self.kv_events.append(("stored", keys, parent, tokens))  # type: ignore[union-attr]
            i = j

    def take_events(self) -> list[tuple]:
        """The KV events recorded since the last call (recording starts with the first call)."""
        events = self.kv_events or []
        self.kv_events = []
        return events

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
        return int(self._refs[block_id])

    def num_unreferenced(self, block_ids: Sequence[int]) -> int:
        """How many of the blocks have ref count 0 (sit in the free queue)."""
        if not block_ids:
            return 0
        return int(np.count_nonzero(self._refs[np.asarray(block_ids)] == 0))

    def block_key(self, block_id: int) -> int | None:
        key = int(self._keys[block_id])
        return None if key == NO_KEY else key

    def free_block_ids(self) -> list[int]:
        """The free queue, front (next to be allocated) first. O(n): for tests and debugging."""
        return self._free.to_list()

    # ---- lookup -------------------------------------------------------------------------------
    def get_computed_blocks(self, block_keys: Sequence[int], num_tokens: int | None) -> PrefixMatch:
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
        hits: list[int] = []
        if max_blocks:
            trace = isinstance(block_keys, TraceBlockKeys)
            index = self._trace_for(block_keys.per) if trace else self._index
            hits = index.first_holders(block_keys, max_blocks)
        stats = self.stats
        stats.num_lookups += 1
        stats.num_query_tokens += num_tokens
        stats.num_hit_tokens += len(hits) * size
        return PrefixMatch(len(hits) * size, hits)

    def num_cached_prefix(self, block_keys: Sequence[int]) -> int:
        """Leading blocks of ``block_keys`` cached now, uncapped and not counted in the stats:
        what a router's view of this pool (KV events) sees."""
        if not block_keys:
            return 0
        if isinstance(block_keys, TraceBlockKeys):
            return self._trace_for(block_keys.per).prefix_length(block_keys)
        return len(self._index.first_holders(block_keys, len(block_keys)))

    def match_prefix(self, keys: Sequence[int], num_tokens: int | None = None) -> PrefixMatch:
        return self.get_computed_blocks(keys, num_tokens)

    # ---- ownership ----------------------------------------------------------------------------
    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on each block (cache hits; distinct blocks); a free one leaves the
        free queue."""
        if not block_ids:
            return
        ids = np.asarray(block_ids, dtype=np.int64)
        refs = self._refs
        before = refs[ids]
        refs[ids] = before + 1
        unreferenced = ids[before == 0]
        if len(unreferenced):
            self._free.remove(unreferenced)
            self._num_free_cached -= int(np.count_nonzero(self._keys[unreferenced] != NO_KEY))

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Pop ``num_blocks`` blocks from the front of the free queue, evicting the key of any
        cached block popped; each gets ref count 1. None (and nothing changed) when fewer than
        ``num_blocks`` are free."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self._free):
            return None
        if not num_blocks:
            return []
        # The front stack holds only keyless blocks; ring blocks may be cached (evicted here).
        out, from_ring = self._free.pop_front(num_blocks)
        refs = self._refs
        if len(out) == 1:
            refs[out[0]] = 1
        elif out:
            refs[out] = 1
        if from_ring is not None:
            refs[from_ring] = 1
            keyed = from_ring[self._keys[from_ring] != NO_KEY]
            if len(keyed):
                keys, gone = self._forget_keys(keyed)
                if self.on_evict is not None:
                    self.on_evict(keys[gone].tolist())
                evicted = len(keyed)
                self._num_free_cached -= evicted
                self._num_cached_blocks -= evicted
                self.stats.num_evicted_tokens += evicted * self.block_size
            out += from_ring.tolist()
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block (distinct blocks, in the request's order: first
        block first); they are processed tail first. A block reaching ref count 0 enters the
        free queue: at the back if it is cached, else at the front (see the module docstring)."""
        if not block_ids:
            return
        ids = np.asarray(block_ids, dtype=np.int64)[::-1]
        refs = self._refs
        before = refs[ids]
        if (before <= 0).any():
            bad = int(ids[np.flatnonzero(before <= 0)[0]])
            raise ValueError(f"block {bad} freed but its ref count is {refs[bad]}")
        refs[ids] = before - 1
        released = ids[before == 1]
        if not len(released):
            return
        keyed = self._keys[released] != NO_KEY
        num_keyed = int(np.count_nonzero(keyed))
        self._num_free_cached += num_keyed
        if not self.free_unhashed_to_front or num_keyed == len(released):
            self._free.push_back(released)
            return
        # prepend_n: keyless blocks at the front, the first of them (in tail-first order: the
        # request's last keyless block) first; cached ones at the back, tail first.
        self._free.push_back(released[keyed])
        self._free.push_front(released[~keyed].tolist())

    def cache_full_blocks(
        self,
        block_ids: Sequence[int],
        block_keys: Sequence[int],
        parent_key: int | None = None,
        start: int = 0,
        token_ids: Sequence[int] | None = None,
    ) -> int:
        """Register ``block_ids[i]`` as holding the full, computed block ``block_keys[start + i]``
        (``block_keys``: a request's keys; a ``TraceBlockKeys`` must be passed whole).

        Blocks that already carry a key are skipped (it must be the same key: a block's content
        does not change while it is held). Each block must be held (ref count > 0); nothing
        changes when a check fails. Returns how many of the keys were cached before the call (by
        this block or another one); duplicates stay cached, as in vLLM, so the caller frees
        nothing. ``parent_key``: the key of the block before ``block_keys[start]``, and
        ``token_ids`` the tokens ``block_keys`` were made from (KV events only).
        """
        n = len(block_ids)
        if start < 0 or start + n > len(block_keys):
            raise ValueError(f"{n} blocks from key {start} but {len(block_keys)} keys")
        if not n:
            return 0
        ids = np.asarray(block_ids, dtype=np.int64)
        trace = isinstance(block_keys, TraceBlockKeys)
        if trace:
            new_keys = block_keys.array[start : start + n]
        else:
            span = block_keys[start : start + n] if start or n != len(block_keys) else block_keys
            try:
                new_keys = np.asarray(span, dtype=np.int64)
            except (OverflowError, TypeError, ValueError) as error:
                raise ValueError(f"block keys must be 64-bit ints ({error})") from None
        refs = self._refs[ids]
        if (refs <= 0).any():
            bad = int(ids[np.flatnonzero(refs <= 0)[0]])
            raise ValueError(f"block {bad} is not held (ref count {refs[np.flatnonzero(refs <= 0)[0]]})")
        if (new_keys == NO_KEY).any():
            raise ValueError(f"block key {NO_KEY} is reserved (no key)")
        index = self._trace_for(block_keys.per) if trace else None  # before anything changes
        current = self._keys[ids]
        keyless = current == NO_KEY
        already = 0
        # each block's place in ``block_keys``: the trace index and the KV events need it
        positions = np.arange(start, start + n) if trace or self.kv_events is not None else None
        if not keyless.all():
            if (current[~keyless] != new_keys[~keyless]).any():
                bad = int(ids[np.flatnonzero(~keyless & (current != new_keys))[0]])
                raise ValueError(f"block {bad} is cached under another key")
            already = len(ids) - int(np.count_nonzero(keyless))
            ids, new_keys = ids[keyless], new_keys[keyless]
            if positions is not None:
                positions = positions[keyless]
            if not len(ids):
                return already
        self._keys[ids] = new_keys
        self._num_cached_blocks += len(ids)
        if index is not None:
            clashes = index.add(ids, block_keys, positions)
        else:
            keys = list(span) if len(ids) == n else new_keys.tolist()
            clashes = self._index.add(ids.tolist(), keys)
        if self.kv_events is not None:
            self._record_stored(block_keys, np.delete(positions, clashes).tolist(), parent_key, token_ids)
        return already + len(clashes)

    def evict(self, num: int) -> int:
        """Drop the keys of up to ``num`` cached free blocks, least recently freed first; the
        blocks stay free, where they are in the queue. Returns how many were dropped.
        (Allocation evicts on its own; this is for resetting or shrinking the cache.)"""
        if num <= 0 or not self._num_free_cached:
            return 0
        ring = self._free.ring_blocks()  # the front stack holds no cached block
        victims = ring[self._keys[ring] != NO_KEY][:num]
        self._forget_keys(victims)
        n = len(victims)
        self._num_free_cached -= n
        self._num_cached_blocks -= n
        self.stats.num_evicted_tokens += n * self.block_size
        return n

    def _trace_for(self, per: int) -> TraceBlockIndex:
        """The index of Mooncake keys with ``per`` keys per trace block (one per pool: a pool has
        one block size)."""
        index = self._trace_index
        if index is None:
            index = self._trace_index = TraceBlockIndex(self.num_blocks, per)
        elif index.per != per:
            raise ValueError(f"trace keys with {per} keys per trace block, but this pool's have {index.per}")
        return index

    def _forget_keys(self, block_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Take the blocks' keys off them (the caller updates the counters). Returns the keys
        they had and which of them lost their last holder."""
        keys = self._keys[block_ids]
        trace = self._trace_index
        if trace is None:
            gone = self._index.remove(block_ids, keys)
        else:
            in_trace = trace.holds(block_ids)
            if in_trace.all():
                gone = trace.remove(block_ids, keys)
            elif not in_trace.any():
                gone = self._index.remove(block_ids, keys)
            else:  # both kinds of keys in one pool: each index keeps its own order
                gone = np.empty(len(block_ids), dtype=bool)
                gone[in_trace] = trace.remove(block_ids[in_trace], keys[in_trace])
                gone[~in_trace] = self._index.remove(block_ids[~in_trace], keys[~in_trace])
        self._keys[block_ids] = NO_KEY
        if self.kv_events is not None and gone.any():
            self.kv_events.append(("removed", keys[gone].tolist()))
        return keys, gone

    # ---- PrefixCache --------------------------------------------------------------------------
    def lock(self, match: PrefixMatch) -> None:
        self.touch(match.kv_indices)

    def unlock(self, match: PrefixMatch) -> None:
        self.free(match.kv_indices)

    def insert(self, keys: Sequence[int], kv_indices: Sequence[int]) -> int:
        return self.cache_full_blocks(kv_indices, keys)

    def check_integrity(self) -> None:
        """Free queue = blocks with ref count 0, each once; key index matches every block's key;
        counters match; with ``free_unhashed_to_front`` no uncached block is behind a cached one."""
        err = PrefixCacheIntegrityError
        refs = self._refs.tolist()
        keys = [None if k == NO_KEY else k for k in self._keys.tolist()]
        problem = self._free.check_integrity()
        if problem:
            raise err(problem)
        free = self._free.to_list()
        if any(keys[b] is not None for b in free[: self._free.num_front]):
            raise err("a cached block is in the free queue's front stack")
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
        in_trace = self._trace_index.holds(np.arange(self.num_blocks)) if self._trace_index else None
        plain_keys = self._keys if in_trace is None else np.where(in_trace, NO_KEY, self._keys)
        problem = self._index.check_integrity(plain_keys.tolist())
        if problem is None and self._trace_index is not None:
            problem = self._trace_index.check_integrity(self._keys.tolist())
        if problem:
            raise err(problem)
        with_key = sum(1 for k in keys if k is not None)
        if with_key != self._num_cached_blocks:
            raise err(f"{with_key} blocks have a key but the counter says {self._num_cached_blocks}")
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
