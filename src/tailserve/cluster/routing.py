"""What a router sees and the interface every router implements — pure Python, shared by the
cluster simulator and the real ``tailserve router`` proxy.

A router knows only what a real one can: each replica's load as last scraped from its
/metrics (``ReplicaState``, possibly stale), what it has itself routed and seen finish
(in-flight requests, their prompt blocks), and, for the prefix-aware routers, its own
approximate tree of the prompts it sent where (or, for ``kv-aware``, KV events).

Contract: the caller calls ``route`` and then ``on_routed`` with the replica it actually used
(the proxy may retry elsewhere), and ``on_finished`` exactly once per routed request when it
leaves the replica (finished, aborted or failed). Replicas are indices into the ``replicas``
list, whose order stays fixed; a replica taken out has ``healthy=False``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

# Tokens per router block when a prompt is keyed from its token ids (the engines' common page).
DEFAULT_ROUTER_BLOCK_SIZE = 16
# The first block's parent key: kv/prefix.py's NONE_HASH (this module imports nothing of the
# engine), so token keys here are the keys a tailserve engine's block pool caches and reports in
# its KV events (tests/test_router_kv_events.py checks they agree).
_NONE_HASH = 0x7A11_5E4E_0F1C_ACE5


class NoHealthyReplicaError(RuntimeError):
    """Every replica is marked unhealthy: nowhere to send the request."""


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """One replica as the router last saw it (a /metrics scrape)."""

    replica_id: int  # index in the router's replica list
    name: str  # a URL for the proxy, "r0"... or "H100-SXM#0" in the simulator
    num_waiting: int = 0  # vllm:num_requests_waiting at the scrape
    num_running: int = 0  # vllm:num_requests_running at the scrape
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc, fraction 0..1
    scraped_at: float = 0.0  # seconds, on the router's clock
    healthy: bool = True

    @property
    def num_requests(self) -> int:
        return self.num_waiting + self.num_running


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """The part of a request a router may use."""

    request_id: str
    prompt_len: int  # tokens
    # Chained keys of the prompt's full blocks: key i identifies tokens [0, (i+1)*block_size),
    # so two prompts share a prefix of k blocks exactly when their first k keys are equal.
    block_keys: tuple[int, ...] = ()
    block_size: int = DEFAULT_ROUTER_BLOCK_SIZE  # tokens per key
    session_id: str | None = None  # session or user id, for affinity
    token_keys: bool = False  # keys from token ids (comparable with an engine's KV events)

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError(f"request {self.request_id}: prompt_len must be >= 1, got {self.prompt_len}")
        if self.block_size < 1:
            raise ValueError(f"request {self.request_id}: block_size must be >= 1, got {self.block_size}")

    @classmethod
    def from_tokens(
        cls,
        request_id: str,
        token_ids: Sequence[int],
        *,
        block_size: int = DEFAULT_ROUTER_BLOCK_SIZE,
        session_id: str | None = None,
    ) -> RouteRequest:
        """Keys from token ids (a proxy without a tokenizer keys the prompt's UTF-8 bytes with
        ``block_keys_from_tokens`` instead, and says so by leaving ``token_keys`` False)."""
        return cls(
            request_id,
            max(1, len(token_ids)),
            block_keys_from_tokens(token_ids, block_size),
            block_size,
            session_id,
            token_keys=True,
        )

    @property
    def num_blocks(self) -> int:
        """Blocks the prompt occupies, the partial last one included."""
        return -(-self.prompt_len // self.block_size)


def block_keys_from_tokens(
    token_ids: Sequence[int], block_size: int = DEFAULT_ROUTER_BLOCK_SIZE
) -> tuple[int, ...]:
    """Chained keys of every full block: ``hash((parent, 0, *block))`` from the parent's key, as
    ``kv.prefix.block_hashes`` (CPython hashes ints and tuples the same in every process)."""
    return extend_block_keys(None, token_ids, block_size)


def extend_block_keys(
    parent: int | None, token_ids: Sequence[int], block_size: int = DEFAULT_ROUTER_BLOCK_SIZE
) -> tuple[int, ...]:
    """The keys of the full blocks of ``token_ids`` continuing the chain after the block keyed
    ``parent`` (None: the prompt's first block) — how a KV-event consumer keys the blocks an
    engine reports with their tokens and parent."""
    keys: list[int] = []
    key = _NONE_HASH if parent is None else parent
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        key = hash((key, 0, *token_ids[start : start + block_size]))
        keys.append(key)
    return tuple(keys)


class Router(Protocol):
    name: str

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaState], now: float) -> int:
        """Index of the replica to send ``request`` to; NoHealthyReplicaError if none is healthy.
        May advance the router's own counters or random stream, never its per-replica records
        (those change in ``on_routed``)."""
        ...

    def on_routed(self, request: RouteRequest, replica: int, now: float) -> None:
        """``request`` was sent to ``replica`` (in-flight counts, the router's tree)."""
        ...

    def on_finished(self, request_id: str, replica: int, now: float) -> None:
        """A request routed to ``replica`` left it (finished, aborted or failed)."""
        ...

    def describe(self) -> str:
        """The router's name with its flags, for labels and logs."""
        ...


@dataclass(slots=True)
class InFlight:
    """What the router itself knows about each replica: requests sent and not yet finished,
    and how many were sent since the replica's last scrape (a scrape already counts older ones)."""

    requests: list[dict[str, RouteRequest]] = field(default_factory=list)
    sent_since_scrape: list[int] = field(default_factory=list)
    last_scrape: list[float] = field(default_factory=list)

    def ensure(self, num_replicas: int) -> None:
        while len(self.requests) < num_replicas:
            self.requests.append({})
            self.sent_since_scrape.append(0)
            self.last_scrape.append(float("-inf"))

    def count(self, replica: int) -> int:
        return len(self.requests[replica]) if replica < len(self.requests) else 0

    def observe(self, replicas: Sequence[ReplicaState]) -> None:
        """A newer scrape of a replica already includes the requests sent before it."""
        self.ensure(len(replicas))
        for i, state in enumerate(replicas):
            if state.scraped_at > self.last_scrape[i]:
                self.last_scrape[i] = state.scraped_at
                self.sent_since_scrape[i] = 0

    def add(self, request: RouteRequest, replica: int) -> None:
        self.ensure(replica + 1)
        self.requests[replica][request.request_id] = request
        self.sent_since_scrape[replica] += 1

    def remove(self, request_id: str, replica: int) -> RouteRequest | None:
        if replica >= len(self.requests):
            return None
        return self.requests[replica].pop(request_id, None)


def healthy_indices(replicas: Sequence[ReplicaState]) -> list[int]:
    found = [i for i, r in enumerate(replicas) if r.healthy]
    if not found:
        raise NoHealthyReplicaError(f"no healthy replica among {len(replicas)}")
    return found
