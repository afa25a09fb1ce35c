"""A router's approximate per-replica prefix tree over chained block keys.

Because key ``i`` of a prompt identifies its whole prefix up to block ``i`` (``RouteRequest``),
a radix tree over such keys is a map ``key -> (last use, depth)`` per replica: a prompt matches
a replica for as many leading keys as the replica's map holds. Inserting a prompt touches its
whole path at one time, so a node is never older than its descendants; evicting oldest first,
deepest first on equal times, therefore removes leaves before their parents (LRU leaf eviction,
as SGLang's router tree does).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class ApproxTree:
    nodes: list[dict[int, tuple[float, int]]] = field(default_factory=list)  # per replica
    num_evicted: int = 0  # nodes removed by eviction or expiry, all replicas

    def _ensure(self, replica: int) -> dict[int, tuple[float, int]]:
        while len(self.nodes) <= replica:
            self.nodes.append({})
        return self.nodes[replica]

    def insert(self, keys: Sequence[int], replica: int, now: float) -> None:
        tree = self._ensure(replica)
        for depth, key in enumerate(keys):
            tree[key] = (now, depth)

    def match(self, keys: Sequence[int], replica: int, *, min_time: float = float("-inf")) -> int:
        """Leading keys of ``keys`` the replica's tree holds (entries used before ``min_time``
        count as gone: a TTL)."""
        if replica >= len(self.nodes):
            return 0
        tree = self.nodes[replica]
        n = 0
        for key in keys:
            entry = tree.get(key)
            if entry is None or entry[0] < min_time:
                break
            n += 1
        return n

    def size(self, replica: int) -> int:
        return len(self.nodes[replica]) if replica < len(self.nodes) else 0

    def evict_to(self, replica: int, max_size: int) -> None:
        """LRU leaves first until the replica's tree holds at most ``max_size`` nodes."""
        tree = self._ensure(replica)
        excess = len(tree) - max_size
        if excess <= 0:
            return
        oldest = heapq.nsmallest(excess, tree.items(), key=lambda kv: (kv[1][0], -kv[1][1]))
        for key, _ in oldest:
            del tree[key]
        self.num_evicted += len(oldest)

    def expire(self, replica: int, before: float) -> None:
        """Drop every node last used before ``before`` (Dynamo's TTL without KV events)."""
        tree = self._ensure(replica)
        stale = [key for key, (t, _) in tree.items() if t < before]
        for key in stale:
            del tree[key]
        self.num_evicted += len(stale)

    def clear(self, replica: int) -> None:
        self._ensure(replica).clear()
