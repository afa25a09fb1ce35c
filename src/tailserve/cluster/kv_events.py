"""KV events in the simulator: what Dynamo's indexer learns from its workers' "block stored /
removed" events, read straight from each replica's hashed block pool (vLLM's prefix caching),
as if every event arrived at once. Replicas without a hashed pool (SGLang's radix tree, prefix
caching off) report nothing and the router falls back to its own tree."""

from __future__ import annotations

from tailserve.cluster.replica import Replica
from tailserve.cluster.routing import RouteRequest
from tailserve.core.request import Request
from tailserve.core.scheduler import prefix_keys


class SimKvIndex:
    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas
        self.requests: dict[str, Request] = {}  # the request being routed, by id
        # its block keys at one block size: computed once per routing, not once per replica
        self._keys: tuple[str, int, list[int] | None] | None = None

    def overlap(self, request: RouteRequest, replica: int) -> int | None:
        """Leading router blocks of ``request`` cached on ``replica`` now; None without a pool."""
        kv = self.replicas[replica].engine.scheduler.kv_cache
        sim_request = self.requests.get(request.request_id)
        if not kv.prefix_caching or sim_request is None:
            return None
        if self._keys is None or self._keys[:2] != (request.request_id, kv.block_size):
            self._keys = (request.request_id, kv.block_size, prefix_keys(sim_request, kv.block_size))
        keys = self._keys[2]
        if not keys:
            return 0
        cached_tokens = kv.num_cached_prefix(keys) * kv.block_size  # not counted in its hit rate
        return min(cached_tokens // request.block_size, len(request.block_keys))
