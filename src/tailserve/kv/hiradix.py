"""SGLang's radix tree with a host tier behind it (HiCache, ``--enable-hierarchical-cache``).

Followed from SGLang 0.5.23's ``UnifiedRadixCache`` with HiCache on
(``mem_cache/unified_radix_cache.py``, its tree core ``mem_cache/unified_cache/unified_tree_core.py``,
``UTC`` below, all ``@v0.5.23``). A node may hold its KV on the GPU, on the host, or both:

- **Backups** (``UTC:1368-1447``, ``_inc_hit_count_and_check`` ``UTC:1104-1122``): every insert
  counts once each node it walks past what the same request inserted before, and its new leaf;
  a node counted ``write_through_threshold`` times (1: ``write_through``, 2:
  ``write_through_selective``) is copied to the host pool. ``write_back`` copies a node only when
  the GPU evicts it (``evict_device_leaf``, ``UTC:1788-1822``). A copy that finds the pool full
  first evicts host leaves, and is skipped when that does not make room
  (``_execute_kv_backup``, ``unified_radix_cache.py:1737-1750``).
- **GPU eviction** (``evict_device_leaf``): least recently used unlocked *device leaves* (nodes
  with GPU KV and no child holding GPU KV) go first. One with a host copy is *demoted*: its GPU
  slots are freed, the node stays in the tree host-only (``_demote``, ``UTC:2077-2123``). One
  without is deleted, and with it any host-only nodes below it (``_delete_unbacked_device_leaf``;
  under ``write_back`` a failed copy drops the subtree, ``drop_subtree_no_host`` ``UTC:1825``).
- **Host eviction** (``drive_host_eviction`` and ``FullComponent.drive_host_eviction``,
  ``unified_cache/components/full.py:250-280``): least recently used *host leaves* (host-only,
  no children, unpinned, ``_is_host_leaf`` ``UTC:2366``) are removed; a parent left a childless
  host-only node becomes one.
- **Matches** (``_match_prefix_helper``, ``UTC:905-984``): the walk goes on through host-only
  nodes; the GPU prefix (its slots and node: the lock handle) ends at the last node with GPU KV,
  the host hit is what follows. The whole matched path is stamped.
- **Inserts over host-only nodes** (``_unevict_node_on_insert``, ``UTC:1564-1590``): the
  inserting request's own KV becomes the node's GPU copy, the host copy stays.
- **Loads** (``load_back``, ``unified_radix_cache.py:1820-1937``): the host-only nodes of a match
  get fresh GPU slots (evicting for them first) and become GPU nodes again, host copy kept.

Copies are taken as done at once (SGLang acknowledges them a few steps later, ``writing_check``;
meanwhile the node stays on the GPU). Device slots are the caller's (``RadixCache``); the host pool
is counted in tokens (page size 1).
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from tailserve.kv.prefix import PrefixCacheIntegrityError, PrefixMatch
from tailserve.kv.radix import RadixCache, RadixNode, _common_len


class HiRadixNode(RadixNode):
    """A radix node with a host tier: ``on_device`` (its ``value`` holds GPU slots; empty when
    host-only), ``backed`` (a host copy exists), the insert hits that trigger a backup, and pins
    that keep a host-only node from host eviction while it is loaded."""

    __slots__ = ("backed", "hit_count", "host_pins", "on_device")

    def __init__(self, key: list[Hashable], value: list[int], parent: RadixNode | None, node_id: int) -> None:
        super().__init__(key, value, parent, node_id)
        self.on_device = True
        self.backed = False
        self.hit_count = 0
        self.host_pins = 0


@dataclass(frozen=True, slots=True)
class HiPrefixMatch(PrefixMatch):
    """A match with its host part: ``host_tokens`` after the GPU prefix, down to ``host_node``."""

    host_tokens: int = 0
    host_node: RadixNode | None = None


@dataclass(slots=True)
class HiCacheStats:
    """The host tier's counters since construction, in tokens unless named otherwise."""

    num_loads: int = 0  # load-backs done (one per admitted request with a host hit)
    loaded_tokens: int = 0
    num_failed_loads: int = 0  # host hits recomputed: no GPU room for the load
    num_short_hits: int = 0  # host hits under the load-back threshold, recomputed
    backed_up_tokens: int = 0  # copied GPU -> host
    skipped_backup_tokens: int = 0  # copies skipped: the host pool could not make room
    demoted_tokens: int = 0  # GPU copies dropped, host copy kept
    host_evicted_tokens: int = 0
    dropped_tokens: int = 0  # host-only tokens dropped with an unbacked GPU parent


class HiRadixCache(RadixCache):
    """``RadixCache`` plus the host tier: ``host_capacity`` tokens, SGLang's write policy.
    ``adopt`` receives the slots an insert gives a host-only node (the caller takes a reference
    for the tree, as for a new leaf)."""

    def __init__(
        self, host_capacity: int, write_policy: str, page_size: int = 1, typed_slots: bool = False
    ) -> None:
        if page_size != 1:
            raise ValueError("SGLang's HiCache is modelled with one-token pages (its CUDA default)")
        super().__init__(page_size, typed_slots)
        if host_capacity < 1:
            raise ValueError(f"the HiCache host pool must hold at least one token, got {host_capacity}")
        self.host_capacity = host_capacity
        self.write_policy = write_policy
        self.write_back = write_policy == "write_back"
        self.write_through_threshold = 1 if write_policy == "write_through" else 2
        self.host_used = 0  # tokens of nodes with a host copy
        self._host_heap: list[tuple[int, int, HiRadixNode]] = []  # host leaves, lazily
        self.host_stats = HiCacheStats()
        self.adopt: Callable[[list[int]], None] | None = None

    def _new_node(self, key: list[Hashable], value: list[int], parent: RadixNode | None) -> RadixNode:
        node = HiRadixNode(key, value, parent, self._next_id)
        self._next_id += 1
        return node

    def _empty(self) -> list[int]:
        return array("q") if self._typed else []  # type: ignore[return-value]

    # ---- node classes ------------------------------------------------------------------------
    @staticmethod
    def _is_device_leaf(node: HiRadixNode) -> bool:
        if not node.on_device:
            return False
        return all(not child.on_device for child in node.children.values())  # type: ignore[attr-defined]

    def _is_host_leaf(self, node: HiRadixNode) -> bool:
        return node is not self.root and not node.on_device and not node.children and not node.host_pins

    def _push_host(self, node: HiRadixNode) -> None:
        heapq.heappush(self._host_heap, (node.last_access_time, node.node_id, node))

    # ---- lookup ------------------------------------------------------------------------------
    def match_prefix(self, keys: Sequence[Hashable], num_tokens: int | None = None) -> HiPrefixMatch:
        """As ``RadixCache.match_prefix``, walking on through host-only nodes: the GPU prefix
        (slots, lock node) and the host hit after it."""
        limit = len(keys) if num_tokens is None else min(len(keys), max(num_tokens - 1, 0))
        keys = list(keys[:limit]) if limit < len(keys) or type(keys) is not list else keys
        slots: list[int] = self._empty()
        now = self._tick()
        root = node = device = self.root
        root.last_access_time = now
        i = on_device = 0
        while i < limit:
            child = node.children.get(keys[i])
            if child is None:
                break
            p = _common_len(child.key, keys, i)
            if p < len(child.key):
                child = self._split(child, p)
            child.last_access_time = now
            node = child
            i += p
            if child.on_device:  # type: ignore[attr-defined]
                slots.extend(child.value)
                device, on_device = child, i
        if device is not root and device.lock_ref == 0 and self._is_device_leaf(device):  # type: ignore[arg-type]
            self._push(device)
        if node is not device and self._is_host_leaf(node):  # type: ignore[arg-type]
            self._push_host(node)  # type: ignore[arg-type]
        self._compact()
        stats = self.stats
        stats.num_lookups += 1
        stats.num_query_tokens += len(keys) if num_tokens is None else num_tokens
        stats.num_hit_tokens += on_device
        return HiPrefixMatch(on_device, slots, device, i - on_device, node)

    def host_path(self, match: HiPrefixMatch) -> list[HiRadixNode]:
        """The host-only nodes of ``match``, top-down (empty without a host hit)."""
        path: list[HiRadixNode] = []
        node = match.host_node
        while node is not None and node is not match.node:
            path.append(node)  # type: ignore[arg-type]
            node = node.parent
        path.reverse()
        return path

    # ---- insertion and backups ---------------------------------------------------------------
    def insert(self, keys: Sequence[Hashable], kv_indices: Sequence[int], counted_from: int = 0) -> int:
        """As ``RadixCache.insert``; host-only nodes on the path take the caller's slots
        (``adopt``), and the nodes past ``counted_from`` (what the request inserted before)
        count a hit toward their backup."""
        n = len(keys)
        if len(kv_indices) != n:
            raise ValueError(f"{n} keys but {len(kv_indices)} slots")
        if type(keys) is not list:
            keys = list(keys)
        now = self._tick()
        node = self.root
        node.last_access_time = now
        counted: list[HiRadixNode] = []
        i = 0
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                break
            p = _common_len(child.key, keys, i)
            if p < len(child.key):
                child = self._split(child, p)
            child.last_access_time = now
            if not child.on_device:  # type: ignore[attr-defined]
                self._unevict(child, kv_indices[i : i + p])  # type: ignore[arg-type]
            node = child
            i += p
            if i > counted_from:
                counted.append(child)  # type: ignore[arg-type]
        leaf = node
        if i < n:
            value = kv_indices[i:] if type(kv_indices) is array else list(kv_indices[i:])
            leaf = self._new_node(keys[i:], value, node)
            leaf.last_access_time = now
            node.children[keys[i]] = leaf
            self._num_nodes += 1
            self._evictable_size += n - i
            counted.append(leaf)  # type: ignore[arg-type]
        if leaf is not self.root and leaf.lock_ref == 0 and self._is_device_leaf(leaf):  # type: ignore[arg-type]
            self._push(leaf)
        if not self.write_back:
            threshold = self.write_through_threshold
            for hit in counted:
                hit.hit_count += 1
                if not hit.backed and hit.hit_count >= threshold:
                    self._backup(hit)
        self._compact()
        return i

    def _unevict(self, node: HiRadixNode, slots: Sequence[int]) -> None:
        value = slots if type(slots) is array else list(slots)
        node.value = value  # type: ignore[assignment]
        node.on_device = True
        self._evictable_size += len(value)  # host-only nodes are never locked
        if self.adopt is not None:
            self.adopt(value)  # type: ignore[arg-type]

    def _backup(self, node: HiRadixNode) -> bool:
        """Copy ``node`` to the host pool, evicting host leaves for room; False if skipped."""
        size = len(node.key)
        short = self.host_used + size - self.host_capacity
        if short > 0:
            node.host_pins += 1  # never evict the node being copied (write_back: host-only kids)
            self.evict_host(short)
            node.host_pins -= 1
            if self.host_used + size > self.host_capacity:
                self.host_stats.skipped_backup_tokens += size
                return False
        node.backed = True
        self.host_used += size
        self.host_stats.backed_up_tokens += size
        return True

    # ---- loads -------------------------------------------------------------------------------
    def load_back(self, path: list[HiRadixNode], slots: Sequence[int]) -> None:
        """Give the host-only ``path`` (top-down) fresh GPU ``slots``, in order; the caller holds
        a reference on each for the tree and locks the path's last node."""
        offset = 0
        for node in path:
            size = len(node.key)
            part = slots[offset : offset + size]
            node.value = part if type(part) is array else list(part)  # type: ignore[assignment]
            node.on_device = True
            self._evictable_size += size
            offset += size
        if offset != len(slots):
            raise ValueError(f"{len(slots)} slots for a host path of {offset} tokens")

    def pin(self, path: list[HiRadixNode]) -> None:
        """Keep ``path`` from host eviction while its load is prepared (SGLang's host lock)."""
        for node in path:
            node.host_pins += 1

    def unpin(self, path: list[HiRadixNode]) -> None:
        for node in path:
            node.host_pins -= 1
            if self._is_host_leaf(node):  # its heap entry may have been dropped while pinned
                self._push_host(node)

    # ---- eviction ----------------------------------------------------------------------------
    def evict(self, num: int, free_fn: Callable[[list[int]], None] | None = None) -> int:
        """Evict GPU KV of least recently used unlocked device leaves until ``num`` tokens are
        freed: a node with a host copy is demoted (stays, host-only), one without is deleted with
        the host-only nodes below it. Returns the GPU tokens freed."""
        heap = self._heap
        root = self.root
        freed = 0
        while freed < num and heap:
            time, _, node = heapq.heappop(heap)
            if (
                node.parent is None
                or node.lock_ref
                or node.last_access_time != time
                or not self._is_device_leaf(node)  # type: ignore[arg-type]
            ):
                continue  # stale entry
            if not node.backed and self.write_back:  # type: ignore[attr-defined]
                self._backup(node)  # type: ignore[arg-type]
            size = len(node.key)
            if free_fn is not None:
                free_fn(node.value)
            parent = node.parent
            self._evictable_size -= size
            freed += size
            if node.backed:  # type: ignore[attr-defined]
                node.value = self._empty()
                node.on_device = False  # type: ignore[attr-defined]
                self.host_stats.demoted_tokens += size
                if self._is_host_leaf(node):  # type: ignore[arg-type]
                    self._push_host(node)  # type: ignore[arg-type]
            else:
                self._drop_host_subtree(node)  # type: ignore[arg-type]
                del parent.children[node.key[0]]
                node.parent = None
                self._num_nodes -= 1
            if parent is not root and parent.lock_ref == 0 and self._is_device_leaf(parent):  # type: ignore[arg-type]
                self._push(parent)
        self.stats.num_evicted_tokens += freed
        self._compact()
        return freed

    def _drop_host_subtree(self, node: HiRadixNode) -> None:
        """Remove the host-only nodes below ``node`` (unreachable once it goes)."""
        stack = list(node.children.values())
        node.children = {}
        while stack:
            child = stack.pop()
            stack.extend(child.children.values())
            child.children = {}
            child.parent = None
            self._num_nodes -= 1
            size = len(child.key)
            self.host_used -= size
            self.host_stats.dropped_tokens += size

    def evict_host(self, num: int) -> int:
        """Remove least recently used host leaves until ``num`` host tokens are free."""
        heap = self._host_heap
        root = self.root
        freed = 0
        while freed < num and heap:
            time, _, node = heapq.heappop(heap)
            if node.parent is None or node.last_access_time != time or not self._is_host_leaf(node):
                continue  # stale entry
            parent = node.parent
            del parent.children[node.key[0]]
            node.parent = None
            self._num_nodes -= 1
            size = len(node.key)
            self.host_used -= size
            freed += size
            if parent is not root and self._is_host_leaf(parent):  # type: ignore[arg-type]
                self._push_host(parent)  # type: ignore[arg-type]
        self.host_stats.host_evicted_tokens += freed
        if len(heap) > 2 * self._num_nodes + 64:
            self._host_heap = [
                (n.last_access_time, n.node_id, n) for n in self._nodes() if self._is_host_leaf(n)
            ]  # type: ignore[arg-type]
            heapq.heapify(self._host_heap)
        return freed

    def dec_lock_ref(self, node: RadixNode) -> int:
        moved = super().dec_lock_ref(node)
        # A node whose children are all host-only is a device leaf too.
        if node is not self.root and node.lock_ref == 0 and node.children and self._is_device_leaf(node):  # type: ignore[arg-type]
            self._push(node)
        return moved

    def _split(self, child: RadixNode, p: int) -> RadixNode:
        mid = super()._split(child, p)
        mid.on_device = child.on_device  # type: ignore[attr-defined]
        mid.backed = child.backed  # type: ignore[attr-defined]
        mid.hit_count = child.hit_count  # type: ignore[attr-defined]
        return mid

    def _evictable_leaves(self) -> list[RadixNode]:
        return [
            n for n in self._nodes() if n is not self.root and n.lock_ref == 0 and self._is_device_leaf(n)
        ]  # type: ignore[arg-type]

    # ---- invariants --------------------------------------------------------------------------
    # ---- integrity: RadixCache.check_integrity's hooks ------------------------------------------
    def _check_child(self, node: RadixNode, child: RadixNode) -> None:
        if child.on_device and node is not self.root and not node.on_device:  # type: ignore[attr-defined]
            raise PrefixCacheIntegrityError(f"{child!r} holds GPU KV under the host-only {node!r}")

    def _check_host_only(self, node: RadixNode) -> bool:
        """A host-only node has a host copy, no slots and no lock (its children are host-only
        too: ``_check_child``)."""
        if node.on_device:  # type: ignore[attr-defined]
            return False
        if node.value or node.lock_ref or not node.backed:  # type: ignore[attr-defined]
            raise PrefixCacheIntegrityError(
                f"host-only {node!r} holds {len(node.value)} slots, lock {node.lock_ref}"
            )
        return True

    def _check_tiers(self, nodes: list[RadixNode]) -> None:
        """The host pool holds exactly the backed nodes' tokens, within its capacity; every host
        leaf is in its heap."""
        err = PrefixCacheIntegrityError
        host = sum(len(node.key) for node in nodes if node is not self.root and node.backed)  # type: ignore[attr-defined]
        if host != self.host_used or host > self.host_capacity:
            raise err(f"host copies hold {host} tokens, counter {self.host_used}, pool {self.host_capacity}")
        host_entries = {(t, nid) for t, nid, _ in self._host_heap}
        for node in nodes:
            if self._is_host_leaf(node) and (node.last_access_time, node.node_id) not in host_entries:  # type: ignore[arg-type]
                raise err(f"host leaf {node!r} has no host heap entry")
