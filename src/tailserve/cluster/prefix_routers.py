"""The cache-aware routers: ``prefix-aware`` (sgl-router's ``cache_aware`` policy) and
``kv-aware`` (Dynamo's KV router). Pure Python. Rules and defaults, with their sources, are in
docs/cluster.md.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tailserve.cluster.approx_tree import ApproxTree
from tailserve.cluster.routers import BaseRouter
from tailserve.cluster.routing import ReplicaState, RouteRequest


@dataclass(frozen=True, slots=True)
class PrefixAwareFlags:
    """sglang_router's launch defaults (router_args.py; the Rust library's own
    ``CacheAwareConfig::default`` differs: 0.5 / 32 / 1.1 / 30 s / 10,000)."""

    cache_threshold: float = 0.3  # match rate above which the best-matching replica wins
    balance_abs_threshold: int = 64  # imbalanced if max - min in-flight > this ...
    balance_rel_threshold: float = 1.5  # ... and max > min * this
    eviction_interval_secs: float = 120.0  # seconds between LRU eviction passes
    max_tree_size: int = 2**26  # nodes per replica kept by each pass (ours: blocks, theirs: chars)

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if self.eviction_interval_secs <= 0 or self.max_tree_size < 1:
            raise ValueError("eviction_interval_secs must be > 0 and max_tree_size >= 1")


class PrefixAwareRouter(BaseRouter):
    """sgl-router's cache-aware policy. Load is the router's own in-flight count per replica
    (``worker.load()``). When loads are imbalanced (both thresholds exceeded) the least-loaded
    replica wins; otherwise the replica whose approximate tree matches the prompt longest wins
    if the match rate (matched / prompt tokens) exceeds ``cache_threshold``, else the replica
    with the smallest tree. Either way the prompt is inserted into the chosen replica's tree."""

    name = "prefix-aware"
    config_cls = PrefixAwareFlags

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.tree = ApproxTree()
        self._last_eviction = 0.0
        self.num_cache_hits = 0  # routed by match (rate > cache_threshold)
        self.num_cache_misses = 0  # routed to the smallest tree
        self.num_balance_events = 0  # routed by load because loads were imbalanced
        self.last_reason = ""
        # Blocks of keyless prompts routed to each replica (a synthetic workload of bare
        # lengths): sgl-router inserts every prompt's text into the chosen worker's tree, so a
        # prompt without keys still grows it, by its length (``_tree_size``).
        self._unkeyed: Counter[int] = Counter()

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaState], now: float) -> int:
        healthy = self._candidates(replicas)
        cfg = self.config
        self._maybe_evict(now, len(replicas))
        loads = {i: self.inflight.count(i) for i in healthy}
        hi, lo = max(loads.values()), min(loads.values())
        if hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold:
            self.num_balance_events += 1
            chosen = min(healthy, key=lambda i: (loads[i], i))
            self.last_reason = f"loads imbalanced ({hi} vs {lo} in flight): least loaded"
            return chosen
        matched = {i: self.tree.match(request.block_keys, i) for i in healthy}
        best = max(healthy, key=lambda i: (matched[i], -loads[i], -i))
        rate = min(request.prompt_len, matched[best] * request.block_size) / request.prompt_len
        if rate > cfg.cache_threshold:
            self.num_cache_hits += 1
            self.last_reason = f"prefix match {rate:.0%} > cache_threshold {cfg.cache_threshold:g}"
            return best
        self.num_cache_misses += 1
        self.last_reason = f"best match {rate:.0%} <= cache_threshold: smallest tree"
        return min(healthy, key=lambda i: (self._tree_size(i), i))

    def _tree_size(self, replica: int) -> int:
        return self.tree.size(replica) + self._unkeyed[replica]

    def on_routed(self, request: RouteRequest, replica: int, now: float) -> None:
        super().on_routed(request, replica, now)
        if request.block_keys:
            self.tree.insert(request.block_keys, replica, now)
        else:
            self._unkeyed[replica] += -(-request.prompt_len // request.block_size)

    def _maybe_evict(self, now: float, num_replicas: int) -> None:
        if now - self._last_eviction < self.config.eviction_interval_secs:
            return
        self._last_eviction = now
        for i in range(num_replicas):
            self.tree.evict_to(i, self.config.max_tree_size)
            room = max(self.config.max_tree_size - self.tree.size(i), 0)
            if self._unkeyed[i] > room:
                self._unkeyed[i] = room


class KvIndex(Protocol):
    """Cached blocks per replica as KV events report them (the simulator reads its replicas'
    caches; a proxy without KV events has none)."""

    def overlap(self, request: RouteRequest, replica: int) -> int | None:
        """Leading ``request.block_keys`` cached on ``replica``; None when it cannot tell (the
        router then uses its own tree)."""
        ...


@dataclass(frozen=True, slots=True)
class KvAwareFlags:
    """Dynamo's frontend defaults (--router-kv-overlap-score-weight, --router-temperature,
    --router-kv-events, --router-ttl-secs, --router-max-tree-size, --router-prune-target-ratio)."""

    kv_overlap_score_weight: float = 1.0
    router_temperature: float = 0.0  # 0: lowest cost; > 0: softmax over normalised costs
    kv_events: bool = True  # use the KV index when the caller has one, else the router's tree
    router_ttl_secs: float = 120.0  # without KV events: a routed prefix counts as cached this long
    router_max_tree_size: int = 2**20  # without KV events: prune the tree above this many nodes
    router_prune_target_ratio: float = 0.8  # ... down to this fraction of it
    seed: int = 0  # ties and softmax draws

    def __post_init__(self) -> None:
        if self.kv_overlap_score_weight < 0 or self.router_temperature < 0:
            raise ValueError("kv_overlap_score_weight and router_temperature must be >= 0")
        if self.router_ttl_secs <= 0 or self.router_max_tree_size < 1:
            raise ValueError("router_ttl_secs must be > 0 and router_max_tree_size >= 1")
        if not 0 < self.router_prune_target_ratio <= 1:
            raise ValueError(
                f"router_prune_target_ratio must be in (0, 1], got {self.router_prune_target_ratio}"
            )


class KvAwareRouter(BaseRouter):
    """Dynamo's KV router: for each replica, ``cost = kv_overlap_score_weight * prefill_blocks +
    decode_blocks``, where prefill_blocks are the prompt's blocks not cached there and
    decode_blocks the blocks its in-flight requests hold plus this prompt's new ones (blocks
    shared by in-flight prompts counted once: ``--router-assume-kv-reuse``). Lowest cost wins
    (ties: a seeded random pick); a temperature samples a softmax instead."""

    name = "kv-aware"
    config_cls = KvAwareFlags

    def __init__(self, config: Any = None, kv_index: KvIndex | None = None) -> None:
        super().__init__(config)
        self.kv_index = kv_index
        self.tree = ApproxTree()
        self._rng = random.Random(self.config.seed)
        self._active: list[Counter[int]] = []  # block keys of in-flight prompts, per replica
        self._unkeyed: list[int] = []  # their blocks without a key (partial last blocks)
        self.last_costs: dict[int, float] = {}

    def overlap(self, request: RouteRequest, replica: int, now: float) -> int:
        if self.config.kv_events and self.kv_index is not None:
            found = self.kv_index.overlap(request, replica)
            if found is not None:
                return found
        return self.tree.match(request.block_keys, replica, min_time=now - self.config.router_ttl_secs)

    def costs(self, request: RouteRequest, healthy: Sequence[int], now: float) -> dict[int, float]:
        self._ensure(max(healthy) + 1)
        w = self.config.kv_overlap_score_weight
        out: dict[int, float] = {}
        num_blocks = request.num_blocks
        unkeyed = num_blocks - len(request.block_keys)
        for i in healthy:
            prefill_blocks = max(num_blocks - self.overlap(request, i, now), 0)
            active = self._active[i]
            keys = request.block_keys
            new_blocks = len(keys) - sum(map(active.__contains__, keys)) + unkeyed
            decode_blocks = len(active) + self._unkeyed[i] + new_blocks
            out[i] = w * prefill_blocks + decode_blocks
        return out

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaState], now: float) -> int:
        healthy = self._candidates(replicas)
        costs = self.costs(request, healthy, now)
        self.last_costs = costs
        temperature = self.config.router_temperature
        lo = min(costs.values())
        if temperature == 0:
            return self._rng.choice([i for i in healthy if costs[i] == lo])
        hi = max(costs.values())
        span = hi - lo
        weights = [math.exp(-((costs[i] - lo) / span if span else 0.0) / temperature) for i in healthy]
        return self._rng.choices(healthy, weights)[0]

    def on_routed(self, request: RouteRequest, replica: int, now: float) -> None:
        super().on_routed(request, replica, now)
        self._ensure(replica + 1)
        self._active[replica].update(request.block_keys)
        self._unkeyed[replica] += request.num_blocks - len(request.block_keys)
        # The tree is the fallback for replicas the KV index cannot see (and all without one).
        self.tree.insert(request.block_keys, replica, now)
        cap = self.config.router_max_tree_size
        if self.tree.size(replica) > cap:
            self.tree.evict_to(replica, int(cap * self.config.router_prune_target_ratio))

    def on_finished(self, request_id: str, replica: int, now: float) -> None:
        request = self.inflight.remove(request_id, replica)
        if request is None:
            return
        active = self._active[replica]
        active.subtract(request.block_keys)
        for key in request.block_keys:
            if key in active and active[key] <= 0:
                del active[key]
        self._unkeyed[replica] -= request.num_blocks - len(request.block_keys)

    def _ensure(self, num_replicas: int) -> None:
        while len(self._active) < num_replicas:
            self._active.append(Counter())
            self._unkeyed.append(0)
