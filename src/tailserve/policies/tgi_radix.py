"""TGI's prefix cache, its ``RadixAllocator`` (``backends/v3/src/radix.rs``), for the ``tgi`` policy.

A radix trie over block-aligned *prompt* prefixes. At admission the cached prefix is matched (at
least one prompt token is always computed), locked and shared into the request's table, and only
the rest of its lifetime reservation is allocated, evicting LRU unlocked leaves when short; when
the request leaves, its computed prompt blocks are inserted (the trie holds the ones it adopts,
duplicates go back to the free list) and the lock is released. Generated tokens are never cached.
Unlike TGI, the fit is checked before anything is evicted, so a failed admission changes nothing.
"""

from __future__ import annotations

from typing import Any

from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.kv.prefix import PrefixCacheStats, token_keys_from_hash_ids
from tailserve.kv.radix import RadixCache, RadixNode, _common_len
from tailserve.kv.radix_manager import RadixKVCacheManager


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
    """The trie and what the policy needs of it; built lazily by ``enable``."""

    def __init__(self) -> None:
        self.tree: RadixCache | None = None
        self._kv: RadixKVCacheManager | None = None
        self._keys: dict[str, list[Any]] = {}  # request id -> its prompt's block keys
        self._locked: dict[str, tuple[Request, RadixNode]] = {}  # admitted -> its locked node
        self.prefix_stats = PrefixCacheStats()  # one lookup per admission

    def add(self, sched: Scheduler, request: Request) -> None:
        """Remember a queued request's prompt keys (building the trie on first use)."""
        keys = prompt_keys(request, sched.kv_cache.block_size)
        if keys and self.enable(sched):
            self._keys[request.request_id] = keys

    def enable(self, sched: Scheduler) -> bool:
        """Build the trie (hooked to the KV manager, which counts its references) on first use;
        False where it cannot apply: the manager is not the radix kind the policy declared
        (``kv_spec``; a workload without token identities gets a plain one)."""
        if self.tree is not None:
            return True
        kv = sched.kv_cache
        if not isinstance(kv, RadixKVCacheManager):
            return False
        self._kv = kv
        self.tree = RadixCache(page_size=kv.block_size)
        self._kv.tree = self.tree
        self._kv.on_free = self.on_free
        return True

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens, over every admission."""
        return self.prefix_stats.hit_rate

    def peek(self, request: Request) -> tuple[int, int]:
        """What ``match_prefix`` would find for the prompt, without touching the trie: (matched
        blocks, matched blocks that are unlocked now). At least one prompt token is left."""
        keys = self._keys.get(request.request_id)
        if not keys:
            return 0, 0
        tree = self.tree
        limit = min(len(keys), (request.prompt_len - 1) // tree.block_size)
        if limit < len(keys):
            keys = keys[:limit]
        node = tree.root
        i = unlocked = 0
        while i < limit:
            child = node.children.get(keys[i])
            if child is None:
                break
            p = _common_len(child.key, keys, i)
            if child.lock_ref == 0:
                unlocked += p
            i += p
            if p < len(child.key):
                break
            node = child
        return i, unlocked

    def fit(self, sched: Scheduler, request: Request, total: int) -> tuple[int, int] | None:
        """With the trie: whether the request's lifetime reservation fits once its cached prefix
        is shared and unlocked leaves are evicted, within the free blocks and
        ``max_batch_total_tokens``. (prefix tokens, blocks to evict first), or None."""
        kv = sched.kv_cache
        matched, unlocked = self.peek(request)
        needed = kv.blocks_for(request.prompt_len + request.max_tokens - 1) - matched
        evictable = self.tree.evictable_size - unlocked
        excess = max(needed - kv.num_free_blocks, kv.num_used_blocks + needed - total // kv.block_size)
        if excess > evictable:
            return None
        return matched * kv.block_size, excess

    def take(self, sched: Scheduler, request: Request, prefix: int, excess: int) -> None:
        """``RadixAllocator::allocate`` after a successful ``_fit``: match and lock the prefix,
        evict what is short, share the cached blocks and reserve the rest of the lifetime."""
        tree, kv = self.tree, self._kv
        rid = request.request_id
        keys = self._keys.get(rid)
        match = None
        if keys:
            match = tree.match_prefix(keys, request.prompt_len)
            assert match.num_tokens == prefix, (match.num_tokens, prefix)
            tree.inc_lock_ref(match.node)
            self._locked[rid] = (request, match.node)
        if excess > 0:
            tree.evict(excess, kv.release)
        if match is not None and match.kv_indices:
            kv.share(rid, match.kv_indices)
        allocated = sched.allocate(request, request.prompt_len + request.max_tokens - 1)
        assert allocated, "checked by _fit"
        request.num_computed_tokens = prefix

    def on_free(self, request_id: str) -> None:
        """Called by the KV manager just before the request's references go
        (``RadixAllocator::free``): insert the prompt's computed full blocks with the request's
        blocks (the trie holds the ones it adopts; duplicates go back with the request's own
        references), then unlock. A batch put back before running only unlocks."""
        locked = self._locked.pop(request_id, None)
        if locked is None:
            self._keys.pop(request_id, None)
            return
        request, node = locked
        if request.status is RequestStatus.WAITING:
            self.tree.dec_lock_ref(node)  # put back by ``next_batch``: keeps its keys
            return
        keys = self._keys.pop(request_id)
        kv = self._kv
        table = kv.block_tables.get(request_id, [])
        n = min(len(keys), request.num_computed_tokens // kv.block_size, len(table))
        if n:
            slots = table[:n]
            already = self.tree.insert(keys[:n], slots)
            if already < n:
                kv.hold(slots[already:])
        self.tree.dec_lock_ref(node)
