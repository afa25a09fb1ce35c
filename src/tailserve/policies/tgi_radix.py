"""TGI's prefix cache, its ``RadixAllocator`` (``backends/v3/src/radix.rs``), as the ``tgi`` policy
asks it; the trie itself is the KV manager's (``kv/radix_manager.py``, flavour ``tgi``).

A radix trie over block-aligned *prompt* prefixes. At admission the cached prefix is matched (at
least one prompt token is always computed), locked and shared into the request's table, and only
the rest of its lifetime reservation is allocated, evicting LRU unlocked leaves when short; when
the request leaves, its computed prompt blocks are inserted (the trie holds the ones it adopts,
duplicates go back to the free list) and the lock is released. Generated tokens are never cached.
Unlike TGI, the fit is checked before anything is evicted, so a failed admission changes nothing.
"""

from __future__ import annotations

from typing import Any

from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.kv.prefix import PrefixCacheStats, token_keys_from_hash_ids
from tailserve.kv.radix import RadixCache


def prompt_keys(request: Request, block_size: int) -> list[Any] | None:
    """The radix keys of the prompt's full blocks (one per block: the token id at block size 1,
    else the block's tuple of token keys): token ids, or Mooncake ``hash_ids`` expanded per token
    (full 512-token trace blocks only). Only the prompt: TGI caches no generated token. None
    without token identities."""
    if request.prompt_token_ids is not None:
        tokens = list(request.prompt_token_ids[: request.prompt_len])
    elif request.prefix_block_hashes:
        tokens = token_keys_from_hash_ids(request.prefix_block_hashes, request.prompt_len)
    else:
        return None
    if block_size == 1:
        return tokens
    n = len(tokens) // block_size
    return [tuple(tokens[i * block_size : (i + 1) * block_size]) for i in range(n)]


class RadixAllocator:
    """What the ``tgi`` policy asks of its prefix cache, in TGI's terms; the trie, the keys, the
    locks and the insertion when a request leaves are the KV manager's (``kv/radix_manager.py``,
    flavour ``tgi``, built from the policy's ``KVSpec``), reached through the scheduler."""

    def __init__(self) -> None:
        self._sched: Scheduler | None = None  # the scheduler whose KV manager holds the trie
        self.prefix_stats = PrefixCacheStats()  # one lookup per admission

    def add(self, sched: Scheduler, request: Request) -> None:
        """Hand a queued request's prompt keys to the KV manager (which builds its trie on first
        use; a plain manager, given to a workload without token identities, has none)."""
        self._sched = sched
        keys = prompt_keys(request, sched.kv_cache.block_size)
        if keys:
            sched.set_prefix_keys(request, keys)

    @property
    def tree(self) -> RadixCache | None:
        return self._sched.kv_cache.radix_tree if self._sched is not None else None

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens, over every admission."""
        return self.prefix_stats.hit_rate

    def fit(self, sched: Scheduler, request: Request, total: int) -> tuple[int, int] | None:
        """With the trie: whether the request's lifetime reservation fits once its cached prefix
        is shared and unlocked leaves are evicted, within the free blocks and
        ``max_batch_total_tokens``. (prefix tokens, blocks to evict first), or None. Reads the
        trie without touching it (``peek_prefix``: at least one prompt token is left)."""
        kv = sched.kv_cache
        matched, unlocked = kv.peek_prefix(request.request_id, request.prompt_len)
        needed = kv.blocks_for(request.prompt_len + request.max_tokens - 1) - matched
        evictable = kv.evictable_tokens // kv.block_size - unlocked
        excess = max(needed - kv.num_free_blocks, kv.num_used_blocks + needed - total // kv.block_size)
        if excess > evictable:
            return None
        return matched * kv.block_size, excess

    def take(self, sched: Scheduler, request: Request, prefix: int, excess: int) -> None:
        """``RadixAllocator::allocate`` after a successful ``fit``: match and lock the prefix,
        evict what is short, share the cached blocks and reserve the rest of the lifetime. The
        request keeps the lock until it leaves (or is put back), when the manager inserts its
        computed prompt blocks (``RadixAllocator::free``)."""
        lifetime = request.prompt_len + request.max_tokens - 1
        match = sched.cached_prefix(request, request.prompt_len)
        if match is not None:
            assert match.num_tokens == prefix, (match.num_tokens, prefix)
            sched.lock_cached_prefix(match)
        if excess > 0:
            sched.evict_cached(excess)
        if match is not None:  # it starts at the end of the match
            allocated = sched.allocate_with_cached_prefix(request, match, lifetime)
        else:
            allocated = sched.allocate(request, lifetime)
        assert allocated, "checked by fit"
        assert request.num_computed_tokens == prefix, (request.num_computed_tokens, prefix)
