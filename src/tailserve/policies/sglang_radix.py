"""SGLang's radix cache as the ``sglang`` policy asks it (``mem_cache/radix_cache.py`` as the
scheduler uses it); the tree, the keys, the locks and the insertions are the KV manager's
(``kv/radix_manager.py``, flavour ``sglang``), which the policy's ``KVSpec`` asks for.

Page size 1: one radix key per token (token ids plus the planned outputs, or Mooncake
``hash_ids`` expanded per token of each full 512-token block). The tree holds one reference on
each slot it caches, a request one per table entry (``RadixKVCacheManager``). An admitted request
shares its matched slots (match capped so one token is computed), keeps its node locked, and
starts at the match. After every prefill batch its prefilled tokens are inserted
(``cache_unfinished_req``, the lock moves to the new node); at finish prompt + outputs with KV
are inserted (``cache_finished_req``), then it unlocks. Retracted or aborted requests unlock
without inserting decoded tokens. Allocation evicts least recently used unlocked leaves when the
free slots fall short. Deviation: a request keeps its own slots for tokens it computed that
another request inserted meanwhile (SGLang frees them and points at the tree's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.kv.prefix import PrefixCacheStats, PrefixMatch, token_keys_from_hash_ids

if TYPE_CHECKING:
    from tailserve.kv.radix import RadixCache


def token_keys(request: Request) -> list[int] | None:
    """Per-token radix keys: the token ids (with the planned outputs, in simulation), or Mooncake
    ``hash_ids`` expanded to one key per token of each full 512-token block; None without either."""
    if request.prompt_token_ids is not None:
        keys = list(request.prompt_token_ids)
        if request.planned_output_token_ids:
            keys.extend(request.planned_output_token_ids)
        return keys
    if request.prefix_block_hashes:
        return token_keys_from_hash_ids(request.prefix_block_hashes, request.prompt_len)
    return None


class SglangRadix:
    """What the ``sglang`` policy asks of its radix cache, in SGLang's terms; the cache itself
    (tree, keys, locks, insertion) is the KV manager's (``kv/radix_manager.py``, built from the
    policy's ``KVSpec``), reached through the scheduler. Inert (``tree is None``) until a request
    with token identities arrives on a manager that can hold a tree."""

    def __init__(self) -> None:
        self._sched: Scheduler | None = None  # the scheduler whose KV manager holds the cache
        self.prefix_stats = PrefixCacheStats()  # one lookup per admission (prompt + outputs so far)

    def add(self, sched: Scheduler, request: Request) -> None:
        """Hand a queued request's keys to the KV manager (which builds its tree on first use)."""
        self._sched = sched
        keys = token_keys(request)
        if keys:
            sched.set_prefix_keys(request, keys)

    @property
    def tree(self) -> RadixCache | None:
        """The KV manager's tree; None until a request with keys arrived (or where the manager
        can hold none: the factory gives a plain one to a workload without token identities,
        and SGLang's per-token keys need one-token pages)."""
        return self._sched.kv_cache.radix_tree if self._sched is not None else None

    @property
    def hit_rate(self) -> float:
        """Cached tokens / tokens to prefill, over every admission (retractions included)."""
        return self.prefix_stats.hit_rate

    def evictable_tokens(self) -> int:
        return self._sched.kv_cache.evictable_tokens if self._sched is not None else 0

    def keys(self, request: Request) -> list[int] | None:
        """The request's keys up to its current length (prompt + outputs so far)."""
        return self._sched.kv_cache.prefix_keys(request.request_id, request.num_tokens)

    def match(self, request: Request) -> PrefixMatch | None:
        """The request's longest cached prefix (at most ``num_tokens - 1``); None without keys."""
        return self._sched.cached_prefix(request) if self.tree is not None else None

    def full_match(self, request: Request) -> PrefixMatch | None:
        """The match ``calc_priority`` makes: the whole prompt + outputs so far, uncapped (the
        admission match is capped one token short); None without keys."""
        return self._sched.kv_cache.match_whole_prefix(request.request_id, request.num_tokens)

    def lock(self, match: PrefixMatch) -> None:
        self._sched.lock_cached_prefix(match)

    def unlock(self, match: PrefixMatch) -> None:
        self._sched.unlock_cached_prefix(match)

    def attached(self, request: Request) -> bool:
        """True while the request holds its matched path (admitted with a match, not yet freed)."""
        return self._sched.kv_cache.holds_prefix(request.request_id)

    def attach(self, request: Request, match: PrefixMatch) -> None:
        """Admission of a waiting request with its (locked) match: share the cached slots into
        its table and start it at the end of the match; what its admission prefills
        (prompt + outputs so far) caps what the checkpoints insert."""
        assert request.num_computed_tokens == 0
        prefix = match.num_tokens
        self._sched.allocate_with_cached_prefix(request, match, prefix, cache_limit=request.num_tokens)
        stats = self.prefix_stats
        stats.num_lookups += 1
        stats.num_query_tokens += request.num_tokens
        stats.num_hit_tokens += prefix
        if request.num_preemptions == 0:
            request.num_cached_tokens = min(prefix, request.prompt_len)

    def load_back(self, match: PrefixMatch) -> PrefixMatch | None:
        """HiCache: load the host part of the (locked) ``match`` to the GPU; the longer match,
        locked in its place, or None when it is recomputed instead (``kv/hiradix_manager.py``)."""
        return self._sched.kv_cache.load_back(match)  # type: ignore[attr-defined]

    def allocate(self, sched: Scheduler, request: Request, num_total_tokens: int) -> bool:
        """``sched.allocate``, evicting least recently used unlocked leaves first if the free
        slots fall short (SGLang evicts on allocation)."""
        if self.tree is not None:
            kv = sched.kv_cache
            short = kv.num_blocks_needed(request.request_id, num_total_tokens) - kv.num_free_blocks
            if short > 0:
                sched.evict_cached(short)
        return sched.allocate(request, num_total_tokens)

    def allocate_decodes(self, sched: Scheduler, decodes: list[Request]) -> None:
        """``alloc_for_decode``: one more slot for each decode (its last token's), in batch
        order, as ``allocate`` for each would (the caller checked the batch fits). Each needs
        at most one new slot (it holds its computed tokens), so when the free slots number at
        least the batch no ``allocate`` of the loop would evict or fail: the manager takes the
        same slots for the whole batch in one call (``allocate_each``), where the chain of
        calls per decode per step (policy, cache, scheduler, manager) took 2.7 s of a 9.1 s
        cProfile of 5,000 long-prompt requests stepped (r47). Otherwise (eviction may interleave with
        the slots taken) the loop."""
        kv = sched.kv_cache
        if len(decodes) <= kv.free_block_count() and not kv.prefix_caching:
            kv.allocate_each([r.request_id for r in decodes], [r.num_computed_tokens + 1 for r in decodes])
            return
        for request in decodes:
            self.allocate(sched, request, request.num_computed_tokens + 1)

    def evict_for(self, num_tokens: int) -> None:
        """``release_req`` after a retraction: evict until ``num_tokens`` slots are free."""
        kv = self._sched.kv_cache
        short = num_tokens - kv.num_free_blocks * kv.block_size
        if short > 0:
            self._sched.evict_cached(short)

    def checkpoint(self, batch: list[Request]) -> None:
        """After a prefill batch: insert what each of its requests has prefilled so far
        (``cache_unfinished_req``); decodes never touch the tree."""
        sched = self._sched
        for request in batch:
            if not request.is_finished:
                sched.cache_computed(request, request.num_computed_tokens)
