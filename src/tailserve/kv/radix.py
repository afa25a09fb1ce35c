"""SGLang's RadixAttention prefix cache (``mem_cache/radix_cache.py``), token- or page-granular.

A radix tree over key sequences (token ids, or per-token keys such as
``prefix_cache.token_keys_from_hash_ids``). Each node holds a run of keys and the KV slot index
of each; the path from the root spells a cached prefix::

    root ── [1 2 3] ── [4 5]        "1 2 3 4 5" and "1 2 3 9" are cached; a match of
               └─────── [9]         "1 2 3 4 7" splits [4 5] into [4] ── [5] and stops at [4].

- The tree never allocates: slots come from the caller's allocator, ``insert`` adopts them and
  ``evict`` hands them back through ``free_fn``.
- ``lock_ref`` counts the requests using a node or any node below it (``inc_lock_ref`` walks to
  the root), so a locked node's whole path is locked. Tokens are *protected* (lock_ref > 0) or
  *evictable*; evictable tokens count as available memory (SGLang's ``remaining_total``).
- ``page_size`` > 1 (SGLang's paged mode, TGI's block-aligned trie) keys whole pages: one key
  and one slot (page index) per page; sizes then count pages.
- LRU: a logical clock ticks once per ``match_prefix``/``insert``; every node on the touched path
  gets the tick. A parent's time is therefore never older than its children's, so popping leaves
  in (time, node id) order and pushing parents that become leaves evicts in LRU order.
  SGLang uses wall time and also stamps the unmatched tail of a split node; here only the matched
  part is stamped, and ties go to the older node (creation order), so runs are reproducible.
- Evictable leaves live in a lazy heap: an entry is stale once its node was evicted, gained a
  child, got locked or was touched again; stale entries are skipped and the heap is rebuilt when
  it holds over twice as many entries as the tree has nodes.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable, Hashable, Sequence

from tailserve.kv.prefix import PrefixCache, PrefixCacheIntegrityError, PrefixCacheStats, PrefixMatch

_SCAN = 64  # keys compared per slice while looking for a divergence point


class RadixNode:
    """One run of keys. Read-only for callers; the tree edits it. ``key`` and ``value`` have the
    same length (>= 1 except for the root); ``children`` maps each child's first key to it."""

    __slots__ = ("children", "key", "last_access_time", "lock_ref", "node_id", "parent", "value")

    def __init__(self, key: list[Hashable], value: list[int], parent: RadixNode | None, node_id: int) -> None:
        self.key = key
        self.value = value  # KV slot index of each key
        self.parent = parent  # None for the root and for evicted nodes
        self.children: dict[Hashable, RadixNode] = {}
        self.lock_ref = 0
        self.last_access_time = 0  # logical clock ticks
        self.node_id = node_id  # creation order; LRU tie-break

    def __repr__(self) -> str:
        return f"RadixNode(id={self.node_id}, len={len(self.key)}, lock={self.lock_ref}, t={self.last_access_time})"


def _common_len(node_key: list[Hashable], keys: list[Hashable], start: int) -> int:
    """Length of the common prefix of ``node_key`` and ``keys[start:]``."""
    n = min(len(node_key), len(keys) - start)
    if n == len(node_key):
        if node_key == keys[start : start + n]:
            return n
    elif node_key[:n] == keys[start : start + n]:
        return n
    lo = 0
    while lo + _SCAN <= n and node_key[lo : lo + _SCAN] == keys[start + lo : start + lo + _SCAN]:
        lo += _SCAN
    for i in range(lo, n):
        if node_key[i] != keys[start + i]:
            return i
    return n


class RadixCache(PrefixCache):
    """Radix tree of cached KV slots with lock refs and LRU eviction of leaves.

    ``page_size`` tokens per key (SGLang's ``--page-size``; 1, the CUDA default, is token
    granular; TGI's block-aligned trie is ``page_size = block_size``). Keys, slots and every
    size are per page; ``PrefixMatch.num_tokens`` is in tokens.
    """

    def __init__(self, page_size: int = 1, typed_slots: bool = False) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.block_size = page_size
        # Slots as typed arrays (``array("q")``): a manager whose tables are (one-token slots,
        # ``KVCacheManager.typed_slots``) hands the tree slices of them, and its matches come
        # back typed, so sharing and releasing them copies machine integers (r50).
        self._typed = typed_slots
        self._next_id = 0
        self.root = self._new_node([], [], None)
        self.root.lock_ref = 1  # never evictable, never counted
        self._clock = 0
        self._num_nodes = 1
        self._evictable_size = 0  # pages in nodes with lock_ref == 0
        self._protected_size = 0  # pages in nodes with lock_ref > 0
        self._heap: list[tuple[int, int, RadixNode]] = []  # (last_access_time, node_id, node)
        self.stats = PrefixCacheStats()

    # ---- counters -------------------------------------------------------------------------
    @property
    def evictable_size(self) -> int:
        return self._evictable_size

    @property
    def protected_size(self) -> int:
        return self._protected_size

    @property
    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    @property
    def num_cached(self) -> int:
        return self._evictable_size + self._protected_size

    @property
    def num_evictable(self) -> int:
        return self._evictable_size

    @property
    def num_nodes(self) -> int:
        """Nodes including the root."""
        return self._num_nodes

    # ---- lookup and insertion -------------------------------------------------------------
    def match_prefix(self, keys: Sequence[Hashable], num_tokens: int | None = None) -> PrefixMatch:
        """Longest cached prefix of ``keys``: its length, its slots, and the last matched node
        (the lock handle; the root when nothing matched). With ``num_tokens`` at most
        ``num_tokens - 1`` tokens (whole pages) are matched. A match ending inside a node splits
        it there. Stamps the matched path with a new clock tick; locks nothing."""
        page = self.block_size
        limit = len(keys) if num_tokens is None else min(len(keys), max(num_tokens - 1, 0) // page)
        keys = list(keys[:limit]) if limit < len(keys) or type(keys) is not list else keys
        slots: list[int] = array("q") if self._typed else []  # type: ignore[assignment]
        node, i = self._descend(keys, limit, slots)
        if not node.children and node.lock_ref == 0:
            self._push(node)
            self._compact()
        stats = self.stats
        stats.num_lookups += 1
        stats.num_query_tokens += len(keys) * page if num_tokens is None else num_tokens
        stats.num_hit_tokens += i * page
        return PrefixMatch(i * page, slots, node)

    def _descend(self, keys: list[Hashable], limit: int, slots: list[int] | None) -> tuple[RadixNode, int]:
        """Walk ``keys[:limit]`` from the root on a new clock tick, splitting the node a match ends
        inside and stamping the path; collects the matched slots into ``slots`` if given.
        Returns the deepest matched node and the number of keys matched."""
        now = self._tick()
        node = self.root
        node.last_access_time = now
        i = 0
        while i < limit:
            child = node.children.get(keys[i])
            if child is None:
                break
            p = _common_len(child.key, keys, i)
            if p < len(child.key):
                child = self._split(child, p)
            child.last_access_time = now
            if slots is not None:
                slots.extend(child.value)
            node = child
            i += p
        return node, i

    def insert(self, keys: Sequence[Hashable], kv_indices: Sequence[int]) -> int:
        """Cache ``keys`` with ``kv_indices`` (one slot per key). Returns how many leading keys
        were already cached: the tree keeps its own slots for those, and the rest are adopted as
        a new evictable leaf. The caller frees its now-duplicate slots
        ``kv_indices[len(its own match):returned]`` (SGLang's ``cache_finished_req``)."""
        n = len(keys)
        if len(kv_indices) != n:
            raise ValueError(f"{n} keys but {len(kv_indices)} slots")
        if type(keys) is not list:
            keys = list(keys)
        node, i = self._descend(keys, n, None)
        now = node.last_access_time
        if i < n:
            value = kv_indices[i:] if type(kv_indices) is array else list(kv_indices[i:])
            leaf = self._new_node(keys[i:], value, node)
            leaf.last_access_time = now
            node.children[keys[i]] = leaf
            self._num_nodes += 1
            self._evictable_size += n - i
            self._push(leaf)
        elif not node.children and node.lock_ref == 0:
            self._push(node)
        self._compact()
        return i

    # ---- locking ----------------------------------------------------------------------------
    def inc_lock_ref(self, node: RadixNode) -> int:
        """Lock ``node`` and every ancestor; returns the pages that moved from evictable to
        protected. Raises ``ValueError`` if the node was evicted."""
        root = self.root
        if node.parent is None and node is not root:
            raise ValueError(f"{node!r} was evicted; match again before locking")
        moved = 0
        while node is not root:
            if node.lock_ref == 0:
                moved += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]
        self._evictable_size -= moved
        self._protected_size += moved
        return moved

    def dec_lock_ref(self, node: RadixNode) -> int:
        """Undo one ``inc_lock_ref(node)``; returns the pages that became evictable. Raises
        ``ValueError`` if the node is not locked."""
        root = self.root
        if node is root:
            return 0
        if node.lock_ref <= 0:
            raise ValueError(f"{node!r} is not locked")
        moved = 0
        start = node
        while node is not root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                moved += len(node.key)
            node = node.parent  # type: ignore[assignment]
        self._evictable_size += moved
        self._protected_size -= moved
        if start.lock_ref == 0 and not start.children:
            self._push(start)
            self._compact()
        return moved

    def lock(self, match: PrefixMatch) -> None:
        if match.node is not None:
            self.inc_lock_ref(match.node)

    def unlock(self, match: PrefixMatch) -> None:
        if match.node is not None:
            self.dec_lock_ref(match.node)

    # ---- eviction ---------------------------------------------------------------------------
    def evict(self, num: int, free_fn: Callable[[list[int]], None] | None = None) -> int:
        """Evict unlocked leaves, least recently used first, until at least ``num`` pages are
        gone or nothing evictable is left; ``free_fn`` receives each evicted node's slots. A
        parent left childless and unlocked becomes a candidate. Returns the pages evicted (whole
        leaves, so possibly more than ``num``)."""
        heap = self._heap  # _push never replaces it; _compact (which does) runs after the loop
        root = self.root
        freed = 0
        while freed < num and heap:
            time, _, node = heapq.heappop(heap)
            if node.parent is None or node.children or node.lock_ref or node.last_access_time != time:
                continue  # stale entry
            if free_fn is not None:
                free_fn(node.value)
            parent = node.parent
            del parent.children[node.key[0]]
            node.parent = None
            size = len(node.key)
            freed += size
            self._evictable_size -= size
            self._num_nodes -= 1
            if parent is not root and not parent.children and parent.lock_ref == 0:
                self._push(parent)
        self.stats.num_evicted_tokens += freed * self.block_size
        self._compact()
        return freed

    # ---- internals --------------------------------------------------------------------------
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_node(self, key: list[Hashable], value: list[int], parent: RadixNode | None) -> RadixNode:
        node = RadixNode(key, value, parent, self._next_id)
        self._next_id += 1
        return node

    def _split(self, child: RadixNode, p: int) -> RadixNode:
        """Cut ``child`` after its first ``p`` keys; returns the new upper node (same lock_ref
        and time as ``child``, so sizes and LRU order do not change)."""
        parent = child.parent
        assert parent is not None
        mid = self._new_node(child.key[:p], child.value[:p], parent)
        mid.lock_ref = child.lock_ref
        mid.last_access_time = child.last_access_time
        parent.children[child.key[0]] = mid
        child.key = child.key[p:]
        child.value = child.value[p:]
        child.parent = mid
        mid.children[child.key[0]] = child
        self._num_nodes += 1
        return mid

    def _push(self, node: RadixNode) -> None:
        heapq.heappush(self._heap, (node.last_access_time, node.node_id, node))

    def _compact(self) -> None:
        """Rebuild the heap once stale entries dominate (amortised O(1) per push)."""
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._heap = [(n.last_access_time, n.node_id, n) for n in self._evictable_leaves()]
            heapq.heapify(self._heap)

    def _nodes(self) -> list[RadixNode]:
        out: list[RadixNode] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _evictable_leaves(self) -> list[RadixNode]:
        return [n for n in self._nodes() if n is not self.root and not n.children and n.lock_ref == 0]

    def check_integrity(self) -> None:
        """Sizes add up; children are indexed by their first key; every non-root node has keys
        and one slot per key; no slot is held twice; each node's lock_ref covers its children's;
        a parent is never less recent than a child; every evictable leaf is in the heap."""
        err = PrefixCacheIntegrityError
        root = self.root
        if root.lock_ref != 1 or root.key or root.parent is not None:
            raise err(f"root corrupted: lock_ref {root.lock_ref}, {len(root.key)} keys")
        nodes = self._nodes()
        evictable = protected = 0
        slots: set[int] = set()
        num_slots = 0
        for node in nodes:
            child_locks = 0
            for first, child in node.children.items():
                if child.parent is not node:
                    raise err(f"{child!r} is a child of {node!r} but points to {child.parent!r}")
                if not child.key or child.key[0] != first:
                    raise err(f"{child!r} is indexed under {first!r} but starts with {child.key[:1]!r}")
                if child.last_access_time > node.last_access_time:
                    raise err(f"{child!r} was used more recently than its parent {node!r}")
                self._check_child(node, child)
                child_locks += child.lock_ref
            if node is root or self._check_host_only(node):
                continue
            if not node.key or len(node.key) != len(node.value):
                raise err(f"{node!r} has {len(node.key)} keys and {len(node.value)} slots")
            if node.lock_ref < child_locks:
                raise err(f"{node!r} has lock_ref {node.lock_ref} < its children's {child_locks}")
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
            slots.update(node.value)
            num_slots += len(node.value)
        if num_slots != len(slots):
            raise err(f"{num_slots - len(slots)} slots are held by two keys")
        if len(nodes) != self._num_nodes:
            raise err(f"{len(nodes)} nodes reachable but the counter says {self._num_nodes}")
        if evictable != self._evictable_size or protected != self._protected_size:
            raise err(
                f"evictable {evictable} / protected {protected} pages counted, counters say "
                f"{self._evictable_size} / {self._protected_size}"
            )
        entries = {(t, nid) for t, nid, _ in self._heap}
        for leaf in self._evictable_leaves():
            if (leaf.last_access_time, leaf.node_id) not in entries:
                raise err(f"evictable leaf {leaf!r} has no heap entry")
        self._check_tiers(nodes)

    # Hooks for a tree with a tier behind it (SGLang's HiCache, kv/hiradix.py); no-ops here.
    def _check_child(self, node: RadixNode, child: RadixNode) -> None:
        """More rules for one parent-child edge."""

    def _check_host_only(self, node: RadixNode) -> bool:
        """True for a node whose KV is elsewhere (checked by the hook): no slots to count."""
        return False

    def _check_tiers(self, nodes: list[RadixNode]) -> None:
        """More rules over every node, once the tree's own add up."""
