"""SGLang's radix cache bookkeeping (``mem_cache/radix_cache.py`` as the scheduler uses it), for
the ``sglang`` policy.

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

from dataclasses import dataclass

from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.kv.prefix import PrefixCacheStats, PrefixMatch, token_keys_from_hash_ids
from tailserve.kv.radix import RadixCache, RadixNode
from tailserve.kv.radix_manager import RadixKVCacheManager


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


@dataclass(slots=True)
class _Attached:
    """An admitted request's hold on the tree: the locked node and how far it is inserted."""

    request: Request
    node: RadixNode  # locked (the root when nothing is cached yet)
    inserted: int  # leading keys in the tree along the locked path
    target: int  # the tokens this admission prefills (prompt + outputs so far): checkpoint limit


class SglangRadix:
    """The tree, the requests' keys and locks; inert (``tree is None``) until a request with
    token identities arrives on a KV manager that can hold tree references."""

    def __init__(self) -> None:
        self.tree: RadixCache | None = None
        self._kv: RadixKVCacheManager | None = None
        self._keys: dict[str, list[int]] = {}  # request id -> per-token keys
        self.attached: dict[str, _Attached] = {}  # request id -> its locked path (admitted requests)
        self.prefix_stats = PrefixCacheStats()  # one lookup per admission (prompt + outputs so far)

    def add(self, sched: Scheduler, request: Request) -> None:
        """Remember a queued request's keys (building the tree on first use)."""
        keys = token_keys(request)
        if keys and self.enable(sched):
            self._keys[request.request_id] = keys

    def enable(self, sched: Scheduler) -> bool:
        """Create the tree on first use and hook it to the KV manager; False where it cannot
        apply: the manager is not the radix kind the policy declared (``kv_spec``; the factory
        gives a plain one to a workload without token identities) or its pages are larger than
        one token."""
        if self.tree is not None:
            return True
        kv = sched.kv_cache
        if not isinstance(kv, RadixKVCacheManager) or kv.block_size != 1:
            return False
        self._kv = kv
        self.tree = RadixCache(page_size=1)
        kv.tree = self.tree
        kv.on_free = self._on_free
        return True

    @property
    def hit_rate(self) -> float:
        """Cached tokens / tokens to prefill, over every admission (retractions included)."""
        return self.prefix_stats.hit_rate

    def evictable_tokens(self) -> int:
        return self.tree.evictable_size if self.tree is not None else 0

    def keys(self, request: Request) -> list[int] | None:
        """The request's keys up to its current length (prompt + outputs so far)."""
        keys = self._keys.get(request.request_id)
        return keys[: request.num_tokens] if keys is not None else None

    def match(self, request: Request) -> PrefixMatch | None:
        """The request's longest cached prefix (at most ``num_tokens - 1``); None without keys."""
        keys = self._keys.get(request.request_id) if self.tree is not None else None
        if keys is None:
            return None
        return self.tree.match_prefix(keys, request.num_tokens)

    def full_match(self, request: Request) -> PrefixMatch | None:
        """The match ``calc_priority`` makes: the whole prompt + outputs so far, uncapped (the
        admission match is capped one token short); None without keys."""
        keys = self.keys(request)
        return self.tree.match_prefix(keys) if keys is not None else None

    def lock(self, match: PrefixMatch) -> None:
        self.tree.inc_lock_ref(match.node)

    def unlock(self, match: PrefixMatch) -> None:
        self.tree.dec_lock_ref(match.node)

    def attach(self, request: Request, match: PrefixMatch) -> None:
        """Admission of a waiting request with its (locked) match: share the cached slots into
        its table and start it at the end of the match."""
        assert request.num_computed_tokens == 0 and not self._kv.num_held(request.request_id)
        prefix = match.num_tokens
        self._kv.share(request.request_id, match.kv_indices)
        request.num_computed_tokens = prefix
        self.attached[request.request_id] = _Attached(request, match.node, prefix, request.num_tokens)
        stats = self.prefix_stats
        stats.num_lookups += 1
        stats.num_query_tokens += request.num_tokens
        stats.num_hit_tokens += prefix
        if request.num_preemptions == 0:
            request.num_cached_tokens = min(prefix, request.prompt_len)

    def allocate(self, sched: Scheduler, request: Request, num_total_tokens: int) -> bool:
        """``sched.allocate``, evicting least recently used unlocked leaves first if the free
        slots fall short (SGLang evicts on allocation)."""
        if self.tree is not None:
            kv = sched.kv_cache
            short = kv.num_blocks_needed(request.request_id, num_total_tokens) - kv.num_free_blocks
            if short > 0:
                self.tree.evict(short, self._kv.release)
        return sched.allocate(request, num_total_tokens)

    def evict_for(self, num_tokens: int) -> None:
        """``release_req`` after a retraction: evict until ``num_tokens`` slots are free."""
        kv = self._kv
        short = num_tokens - kv.num_free_blocks * kv.block_size
        if short > 0:
            self.tree.evict(short, kv.release)

    def checkpoint(self, batch: list[Request]) -> None:
        """After a prefill batch: insert what each of its requests has prefilled so far
        (``cache_unfinished_req``); decodes never touch the tree."""
        for request in batch:
            att = self.attached.get(request.request_id)
            if att is not None and not request.is_finished:
                self._insert(att, min(request.num_computed_tokens, att.target))

    def _insert(self, att: _Attached, num_tokens: int) -> None:
        """Insert the request's first ``num_tokens`` keyed tokens with its slots; the tree takes a
        reference on the slots it adopts, and the lock moves to the new deepest node. Slots that
        duplicate ones the tree already has stay the request's own."""
        rid = att.request.request_id
        keys = self._keys[rid]
        table = self._kv.block_tables.get(rid, [])
        n = min(num_tokens, len(keys), len(table))
        if n <= att.inserted:
            return
        tree = self.tree
        slots = table[:n]
        already = tree.insert(keys[:n], slots)
        if already < n:
            self._kv.hold(slots[already:])
        node = tree.root
        i = 0
        while i < n:  # ``insert`` left a node boundary at n
            node = node.children[keys[i]]
            i += len(node.key)
        assert i == n
        tree.inc_lock_ref(node)
        tree.dec_lock_ref(att.node)
        att.node, att.inserted = node, n

    def _on_free(self, request_id: str) -> None:
        """Called by the KV manager just before a request's references are dropped. Finished:
        insert prompt + outputs (``cache_finished_req``), then unlock. Retracted or aborted:
        unlock without inserting the decoded tokens."""
        att = self.attached.pop(request_id, None)
        request = att.request if att is not None else None
        finished = request is not None and request.status in (
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_STOPPED,
        )
        if att is not None:
            if finished:
                self._insert(att, request.num_computed_tokens)
            self.tree.dec_lock_ref(att.node)
        if request is None or request.status is not RequestStatus.RUNNING:
            self._keys.pop(request_id, None)  # a retracted request keeps its keys
