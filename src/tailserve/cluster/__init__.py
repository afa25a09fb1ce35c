"""Beyond one engine: routers (pure Python, shared with the real ``tailserve router`` proxy),
replicas on one virtual clock, and disaggregated prefill/decode. See docs/cluster.md.

The routing API is re-exported here; the simulator modules are imported from their own files
so a proxy importing routers never loads the simulator.
"""

from __future__ import annotations

from tailserve.cluster.prefix_routers import KvAwareRouter, KvIndex, PrefixAwareRouter
from tailserve.cluster.router_registry import ROUTERS, make_router, parse_router_spec, resolve_router_name
from tailserve.cluster.routers import BaseRouter
from tailserve.cluster.routing import (
    DEFAULT_ROUTER_BLOCK_SIZE,
    NoHealthyReplicaError,
    ReplicaState,
    Router,
    RouteRequest,
    block_keys_from_tokens,
)

__all__ = [
    "DEFAULT_ROUTER_BLOCK_SIZE",
    "ROUTERS",
    "BaseRouter",
    "KvAwareRouter",
    "KvIndex",
    "NoHealthyReplicaError",
    "PrefixAwareRouter",
    "ReplicaState",
    "RouteRequest",
    "Router",
    "block_keys_from_tokens",
    "make_router",
    "parse_router_spec",
    "resolve_router_name",
]
