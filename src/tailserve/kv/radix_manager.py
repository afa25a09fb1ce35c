"""A KV cache whose slots may also be held by a radix tree it owns (SGLang's RadixCache, TGI's
RadixAllocator).

``KVCacheManager`` counts one reference per block-table entry. A radix cache keeps KV slots
alive after the requests that computed them leave, and hands cached slots to new requests; here
the tree owns one reference on every slot it caches (``hold`` / ``release``), a request owns one
per table entry (``share`` appends cached slots to its table), and a slot returns to the free
list when its last reference goes. ``check_integrity`` counts the tree's references too.

The manager owns the tree, the requests' keys, their locks and what is inserted when; the
policy asks through ``Scheduler`` (``cached_prefix``, ``allocate_with_cached_prefix``,
``cache_computed``, ...). ``kv/factory.py`` builds this class for a ``KVSpec(kind="radix")``,
whose ``radix`` field names the engine's flavour:

- ``"sglang"`` (``mem_cache/radix_cache.py`` as SGLang's scheduler uses it): one key per token,
  so there is no tree with pages of more than one token. An admitted request shares its matched
  slots and keeps its node locked; ``register_computed`` inserts what it prefilled so far
  (``cache_unfinished_req``; the lock moves to the new node); a request that finished inserts
  prompt + outputs with KV (``cache_finished_req``), then unlocks; a retracted or aborted one
  unlocks without inserting.
- ``"tgi"`` (``backends/v3/src/radix.rs``): one key per block of the prompt; a request that leaves
  inserts its computed prompt blocks (the trie holds the ones it adopts, duplicates go back with
  the request's references) and unlocks; one put back before running (``free`` with nothing
  computed) only unlocks.

The tree is built with the first request whose keys arrive (``set_prefix_keys``): a run whose
requests carry no token identities has no tree (``tree is None``), as the engines' caches stay
empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from tailserve.kv.paged import _VECTOR_MIN, KVCacheIntegrityError, KVCacheManager, int64s
from tailserve.kv.radix import RadixCache, RadixNode, _common_len

if TYPE_CHECKING:
    from tailserve.kv.prefix import PrefixCacheStats, PrefixMatch


@dataclass(slots=True)
class _Held:
    """A request's hold on the tree: its locked node, how many of its leading keys are in the
    tree along that path, and (sglang) the tokens its admission prefills, which caps what
    ``register_computed`` inserts."""

    node: RadixNode  # locked (the root when nothing is cached yet)
    inserted: int  # keys
    limit: int  # tokens


class RadixKVCacheManager(KVCacheManager):
    """``KVCacheManager`` plus the radix tree it owns, which holds references on cached slots
    (no hashed pool, no CPU pool use)."""

    shares_prefixes: ClassVar[bool] = True

    def __init__(
        self, num_blocks: int, block_size: int = 1, num_cpu_blocks: int = 0, flavour: str = "sglang"
    ) -> None:
        super().__init__(num_blocks, block_size, num_cpu_blocks)
        if flavour not in ("sglang", "tgi"):
            raise ValueError(f"radix cache flavour must be sglang or tgi, got {flavour!r}")
        self.flavour = flavour
        self.registers_from = None  # ``register_computed`` inserts tokens: every call counts
        # SGLang's keys are per token: with larger pages its cache stays off (as before).
        self._tree_allowed = flavour == "tgi" or block_size == 1
        # The tree whose node values are the references counted by ``hold``; built by
        # ``set_prefix_keys`` with the first request that has keys.
        self.tree: RadixCache | None = None
        self._keys: dict[str, list[Any]] = {}  # request id -> its radix keys
        self._held: dict[str, _Held] = {}  # request id -> its locked path (admitted requests)
        self._tree_refs = 0

    def _build_tree(self) -> None:
        """The tree, with the first keys; from now on slots may be shared: the reference counts
        (none kept before: every held slot had its request's one), taken from the tables, are
        kept (``KVCacheManager._live_refs``)."""
        self.tree = RadixCache(page_size=self.block_size, typed_slots=self._compact)
        self._live_refs()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        return self.tree.stats if self.tree is not None else None

    @property
    def radix_tree(self) -> RadixCache | None:
        return self.tree

    @property
    def can_drop_cached(self) -> bool:
        # The tree holds references on slots a failed step may never have written, and what it
        # caches is not dropped here: an engine cannot recover from a failed step with a tree.
        return self.tree is None

    # ---- keys and lookups -------------------------------------------------------------------
    def set_prefix_keys(
        self, request_id: str, keys: list[Any], token_ids: Sequence[int] | None = None
    ) -> None:
        """The request's radix keys (sglang: one per token of prompt + planned outputs; tgi: one
        per full block of the prompt), building the tree with the first; ignored where this
        manager can have no tree (sglang with pages of more than one token)."""
        if not keys or not self._tree_allowed:
            return
        if self.tree is None:
            self._build_tree()
        self._keys[request_id] = keys

    def forget_prefix_keys(self, request_id: str) -> None:
        if self._keys:
            self._keys.pop(request_id, None)

    def prefix_keys(self, request_id: str, num_keys: int | None = None) -> list[Any] | None:
        """The request's keys (the first ``num_keys``), None without keys."""
        keys = self._keys.get(request_id)
        if keys is None or num_keys is None:
            return keys
        return keys[:num_keys]

    def match_prefix(self, request_id: str, num_tokens: int) -> PrefixMatch | None:
        """The request's longest cached prefix, at most ``num_tokens - 1`` tokens; None without
        keys. Stamps the matched path (LRU) and may split a node; locks nothing."""
        keys = self._keys.get(request_id) if self.tree is not None else None
        if keys is None:
            return None
        return self.tree.match_prefix(keys, num_tokens)

    def match_whole_prefix(self, request_id: str, num_tokens: int) -> PrefixMatch | None:
        """The match of the request's first ``num_tokens`` keys, uncapped (SGLang's
        ``calc_priority`` matches the whole prompt + outputs so far); None without keys."""
        keys = self.prefix_keys(request_id, num_tokens) if self.tree is not None else None
        return self.tree.match_prefix(keys) if keys is not None else None

    def peek_prefix(self, request_id: str, num_tokens: int) -> tuple[int, int]:
        """What ``match_prefix(request_id, num_tokens)`` would find, without touching the tree:
        (matched keys, matched keys that are unlocked now)."""
        keys = self._keys.get(request_id) if self.tree is not None else None
        if not keys:
            return 0, 0
        tree = self.tree
        limit = min(len(keys), (num_tokens - 1) // tree.block_size)
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

    # ---- locks, sharing, insertion, eviction --------------------------------------------------
    def lock_prefix(self, match: PrefixMatch) -> None:
        """Protect a match from eviction (``inc_lock_ref`` on its node)."""
        self.tree.inc_lock_ref(match.node)

    def unlock_prefix(self, match: PrefixMatch) -> None:
        self.tree.dec_lock_ref(match.node)

    def holds_prefix(self, request_id: str) -> bool:
        """True while the request holds a locked path (from ``allocate_with_prefix`` until it
        is freed)."""
        return request_id in self._held

    def allocate_with_prefix(
        self, request_id: str, match: PrefixMatch, num_total_tokens: int, limit: int | None = None
    ) -> bool:
        """Share the match's (locked) slots into the request's table and allocate the rest up to
        ``num_total_tokens``; the request keeps the lock until it is freed. False when the rest
        does not fit (the slots stay shared and the lock held: callers check the fit first).
        ``limit`` (sglang): the tokens this admission prefills, the most ``register_computed``
        inserts."""
        if self.flavour == "sglang":
            assert not self.num_held(request_id)
            inserted = match.num_tokens
        else:
            inserted = 0  # TGI inserts once, when the request leaves
        self._held[request_id] = _Held(match.node, inserted, num_total_tokens if limit is None else limit)
        if match.kv_indices:
            self.share(request_id, match.kv_indices)
        return self.allocate(request_id, num_total_tokens) is not None

    def register_computed(self, request_id: str, num_computed_tokens: int) -> None:
        """Insert the request's first ``num_computed_tokens`` keyed tokens (at most its
        admission's ``limit``) with its slots, the lock moving to the new deepest node
        (``cache_unfinished_req``); nothing for a request that holds no path."""
        held = self._held.get(request_id)
        # The engine's async path (SGLang's overlap scheduler) asks after every decode step;
        # past its admission's limit a request has nothing more to insert, known here without
        # ``_insert``'s call and lookups (one per decode per step).
        if held is not None and held.inserted < held.limit:
            self._insert(request_id, held, min(num_computed_tokens, held.limit))

    @property
    def evictable_tokens(self) -> int:
        """Cached tokens no request holds: evictable now (0 without a tree)."""
        return self.tree.evictable_size * self.block_size if self.tree is not None else 0

    def evict_cached(self, num_blocks: int) -> None:
        """Evict least recently used unlocked leaves until at least ``num_blocks`` blocks came
        back (or nothing evictable is left)."""
        if num_blocks > 0:
            self.tree.evict(num_blocks, self.release)

    def warm(self, keys: list[Any]) -> bool:
        """Cache ``keys`` as if a request had computed them and left (slots from the free list,
        held by the tree): a warm cache for the order differential and tests. False where this
        manager can have no tree."""
        if not self._tree_allowed:
            return False
        if self.tree is None:
            self._build_tree()
        warmer = "\0warm"
        if self.allocate(warmer, len(keys) * self.block_size) is None:
            raise ValueError(f"{len(keys)} keys do not fit in {self.num_free_blocks} free blocks")
        slots = self.block_tables[warmer][: len(keys)]
        already = self.tree.insert(keys, slots)
        if already < len(keys):
            self.hold(slots[already:])
        super().free(warmer)
        return True

    def _insert(self, request_id: str, held: _Held, num_tokens: int) -> None:
        """Insert the request's first ``num_tokens`` keyed tokens with its slots; the tree takes a
        reference on the slots it adopts, and the lock moves to the new deepest node. Slots that
        duplicate ones the tree already has stay the request's own."""
        keys = self._keys[request_id]
        table = self.block_tables.get(request_id, [])
        n = min(num_tokens, len(keys), len(table))
        if n <= held.inserted:
            return
        tree = self.tree
        slots = table[:n]
        already = self._tree_insert(keys[:n], slots, held)
        if already < n:
            self.hold(slots[already:])
        node = tree.root
        i = 0
        while i < n:  # ``insert`` left a node boundary at n
            node = node.children[keys[i]]
            i += len(node.key)
        assert i == n
        tree.inc_lock_ref(node)
        tree.dec_lock_ref(held.node)
        held.node, held.inserted = node, n

    def _tree_insert(self, keys: list, slots: list[int], held: _Held) -> int:
        """The tree's ``insert`` for a request holding ``held`` (a tree with a host tier counts
        what the request inserted before: ``HiRadixKVCacheManager``)."""
        return self.tree.insert(keys, slots)

    def _cache_on_free(self, request_id: str, num_computed_tokens: int, finished: bool) -> None:
        """Before a request's references go: what its flavour caches of it, then unlock."""
        held = self._held.pop(request_id, None)
        if held is None:
            return
        if self.flavour == "sglang":
            if finished:
                self._insert(request_id, held, num_computed_tokens)
            self.tree.dec_lock_ref(held.node)
            return
        keys = self._keys[request_id]
        table = self.block_tables.get(request_id, [])
        n = min(len(keys), num_computed_tokens // self.block_size, len(table))
        if n:
            slots = table[:n]
            already = self.tree.insert(keys[:n], slots)
            if already < n:
                self.hold(slots[already:])
        self.tree.dec_lock_ref(held.node)

    # ---- references ------------------------------------------------------------------------
    def share(self, request_id: str, block_ids: list[int]) -> None:
        """Append already-referenced blocks (cached slots) to the request's table, ref += 1."""
        self._ref_held(block_ids, "only held blocks can be shared")
        table = self.block_tables.get(request_id)
        if table is None:
            table = self.block_tables[request_id] = self._new_table()
        table.extend(block_ids)

    def hold(self, block_ids: list[int]) -> None:
        """One reference for the tree on each (already referenced) block."""
        self._ref_held(block_ids, "the tree can only adopt held blocks")
        self._tree_refs += len(block_ids)

    def _ref_held(self, block_ids: list[int], rule: str) -> None:
        """One more reference on each of ``block_ids``, distinct slots every one of which is held
        already (a path's, a table's), or a ValueError naming the first free one and ``rule``.
        Past a few ids vectorised, as ``_unref`` drops them: one gather, one test, one scatter,
        where the loop paid ~0.2 us a slot (an SGLang prompt shares or caches ~1,000; 29% of its
        loop on the Mooncake conversation trace, r50)."""
        refs = self._live_refs()
        if len(block_ids) < _VECTOR_MIN:
            for block_id in block_ids:
                if refs[block_id] <= 0:
                    raise ValueError(f"block {block_id} is free; {rule}")
                refs[block_id] += 1
            return
        counts = np.frombuffer(refs, dtype=np.int64)
        ids = int64s(block_ids)
        held = counts[ids]
        if held.min() <= 0:
            raise ValueError(f"block {int(ids[held <= 0][0])} is free; {rule}")
        counts[ids] = held + 1  # distinct ids: each count rises by exactly one

    def release(self, block_ids: list[int]) -> None:
        """Drop the tree's reference on each block (``RadixCache.evict``'s ``free_fn``)."""
        # In node order (``_unref``, vectorised as a request's release is).
        self._unref(int64s(block_ids))
        self._tree_refs -= len(block_ids)

    def free(self, request_id: str, num_computed_tokens: int = 0, finished: bool = False) -> int:
        if self._held:
            self._cache_on_free(request_id, num_computed_tokens, finished)
        return super().free(request_id)

    # ---- invariants ------------------------------------------------------------------------
    def _external_refs(self) -> dict[int, int]:
        return self.tree_refs()

    def tree_refs(self) -> dict[int, int]:
        """References the tree holds, per block (from its nodes)."""
        counted: dict[int, int] = {}
        tree = self.tree
        if tree is None:
            return counted
        for node in tree._nodes():
            if node is tree.root:
                continue
            for slot in node.value:
                counted[slot] = counted.get(slot, 0) + 1
        return counted

    def check_integrity(self) -> None:
        """As ``KVCacheManager``, counting the tree's references next to the tables; the tree's
        own invariants hold; the tree holds exactly the references ``hold`` took."""
        if self.tree is not None:
            self.tree.check_integrity()
        held = self.tree_refs()
        if sum(held.values()) != self._tree_refs:
            raise KVCacheIntegrityError(
                f"the tree caches {sum(held.values())} slots but holds {self._tree_refs} references"
            )
        super().check_integrity()
