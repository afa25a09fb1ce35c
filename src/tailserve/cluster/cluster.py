"""N replicas on one virtual clock behind one router (data parallel), in one event loop.

The loop visits the requests in arrival order. Before routing a request that arrives at ``t``
every replica is advanced to ``t`` (``Replica.advance_to``), so the router's view is the
cluster at ``t``, seen through its scrapes: with ``scrape_interval > 0`` a replica's state is
the one taken at the last multiple of the interval (the replicas are advanced to that tick
first and snapshotted there), with 0 it is read at ``t``. A request then joins its replica at
the replica's next iteration, as it would arrive at a lone engine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tailserve.cluster.replica import Replica
from tailserve.cluster.routers import BaseRouter
from tailserve.cluster.routing import ReplicaState, RouteRequest
from tailserve.core.gc_pause import paused_gc
from tailserve.core.request import Request
from tailserve.core.stream_interval import StreamInterval
from tailserve.kv.prefix import MOONCAKE_BLOCK_SIZE, keys_from_hash_ids


def session_of(request: Request) -> str | None:
    """The session a client would send: the tenant (user) id, or for the built-in multi-turn
    workload the conversation (``mt-S-K`` is turn K of conversation S)."""
    if request.tenant_id is not None:
        return request.tenant_id
    if request.request_id.startswith("mt-"):
        return request.request_id.rpartition("-")[0]
    return None


def route_request(request: Request) -> RouteRequest:
    """What a router may know of a simulated request: its length, its session, and its prompt's
    block keys (Mooncake ``hash_ids`` at their 512-token blocks, or token ids at 16)."""
    session = session_of(request)
    if request.prefix_block_hashes:
        keys = keys_from_hash_ids(
            request.prefix_block_hashes, request.prompt_len, MOONCAKE_BLOCK_SIZE, MOONCAKE_BLOCK_SIZE
        )
        return RouteRequest(request.request_id, request.prompt_len, tuple(keys), MOONCAKE_BLOCK_SIZE, session)
    if request.prompt_token_ids:
        return RouteRequest.from_tokens(request.request_id, request.prompt_token_ids, session_id=session)
    return RouteRequest(request.request_id, request.prompt_len, session_id=session)


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """One routing choice and the true state of the cluster at that moment (not the router's
    possibly stale view): what explain needs to blame waiting on the route."""

    request_id: str
    time: float  # seconds
    replica: int
    num_waiting: int  # at the chosen replica, true
    min_waiting: int  # the fewest waiting at any healthy replica, true
    min_waiting_replica: int


@dataclass
class Stage:
    """Replicas behind one router: the whole cluster, or one side of a P/D split."""

    replicas: list[Replica]
    router: BaseRouter
    scrape_interval: float = 0.0  # seconds between /metrics scrapes; 0: always fresh
    # KV events for kv-aware (kv_events.SimKvIndex): told which request is being routed.
    kv_index: Any = None
    decisions: list[RoutingDecision] = field(default_factory=list)
    # what the deployment's cost model says of itself (expert imbalance, a dense model's DP)
    cost_notes: tuple[str, ...] = ()
    _states: list[ReplicaState] = field(default_factory=list)
    _scraped_at: float = -math.inf

    def __post_init__(self) -> None:
        if not self.scrape_interval >= 0:  # NaN too: it fails every comparison, so was accepted
            raise ValueError(f"scrape_interval must be >= 0 seconds, got {self.scrape_interval}")
        for replica in self.replicas:
            replica.source.finish_hooks.insert(0, self._router_hook(replica.index))

    def placement(self) -> str:
        """What places arriving requests on the replicas, as reports name it."""
        return self.router.describe()

    def _router_hook(self, index: int) -> Callable[[Request, float], None]:
        def on_finish(request: Request, now: float) -> None:
            self.router.on_finished(request.request_id, index, now)

        return on_finish

    def advance_to(self, t: float | None) -> None:
        if t is not None and self.scrape_interval > 0:
            tick = math.floor(t / self.scrape_interval) * self.scrape_interval
            if tick > self._scraped_at:
                for replica in self.replicas:
                    replica.advance_to(tick)
                self._states = [r.state(tick) for r in self.replicas]
                self._scraped_at = tick
        for replica in self.replicas:
            replica.advance_to(t)

    def states(self, now: float) -> list[ReplicaState]:
        if self.scrape_interval == 0 or not self._states:
            return [r.state(now) for r in self.replicas]
        return self._states

    def route(
        self, request: Request, t: float, release_time: float | None = None, hand_over: bool = True
    ) -> Replica:
        """Route ``request`` at ``t`` (replicas already advanced there) and hand it over
        (``hand_over`` False: the caller adds it to the replica later, SGLang's bootstrap)."""
        rr = route_request(request)
        if self.kv_index is not None:
            self.kv_index.requests = {request.request_id: request}
        i = self.router.route(rr, self.states(t), t)
        self.router.on_routed(rr, i, t)
        waiting = [len(r.engine.scheduler.waiting) + r.source.num_pending for r in self.replicas]
        least = min(range(len(waiting)), key=waiting.__getitem__)
        self.decisions.append(RoutingDecision(request.request_id, t, i, waiting[i], waiting[least], least))
        replica = self.replicas[i]
        if hand_over:
            replica.add(request, t if release_time is None else release_time)
        return replica


@dataclass
class ClusterRun:
    """A finished cluster simulation: the requests as the clients saw them, each stage."""

    requests: list[Request]
    stages: dict[str, Stage]
    wall_s: float  # seconds of this machine's clock the simulation took
    pd_timeline: dict[str, PdTimes] = field(default_factory=dict)
    cpu_s: float = 0.0  # seconds of CPU this process spent on it (less than wall_s on a busy host)

    @property
    def replicas(self) -> list[Replica]:
        return [r for stage in self.stages.values() for r in stage.replicas]

    @property
    def stream(self) -> StreamInterval:
        """How the replicas that stream tokens to clients (a P/D split's decode side) chunk
        them; ValueError where they differ (the pooled ITL would mix two rules)."""
        stage = self.stages.get("decode")
        replicas = stage.replicas if stage is not None else self.replicas
        rules = {rep.engine.scheduler.policy.stream_interval() for rep in replicas}
        if len(rules) > 1:
            raise ValueError(
                "the replicas stream with different stream_interval settings ("
                + ", ".join(sorted(rule.describe() for rule in rules))
                + "): give them one, the cluster's ITL pools their chunks"
            )
        return rules.pop() if rules else StreamInterval()


@dataclass(slots=True)
class PdTimes:
    """One request's path through a P/D split, seconds on the cluster clock."""

    prefill_replica: int
    decode_replica: int = -1
    prefill_scheduled: float | None = None  # first admitted on the prefill replica
    prefill_done: float | None = None  # its first token sampled on the prefill replica
    transfer_start: float | None = None  # the prefill replica's link was free for it
    transfer_done: float | None = None  # its KV is on the decode replica
    # SGLang: the decode server pre-allocated its KV, so its prefill may start (None elsewhere)
    bootstrapped: float | None = None
    # vLLM's pair: the decode replica admitted it to read its KV (blocks for its prompt), which
    # starts the read once the prefill replica's link is free (None elsewhere)
    decode_admitted: float | None = None

    @property
    def transfer_ready(self) -> float | None:
        """When its KV could start moving: the prefill done and, in vLLM's pair, the decode
        replica ready to read it (in SGLang's under ``prefill_complete``, its KV reserved there
        after the prefill)."""
        if self.decode_admitted is not None:
            return self.decode_admitted
        if (
            self.bootstrapped is not None
            and self.prefill_done is not None
            and self.bootstrapped > self.prefill_done
        ):
            return self.bootstrapped
        return self.prefill_done


def run_aggregated(stage: Stage, requests: Sequence[Request]) -> ClusterRun:
    """Every request through ``stage`` in arrival order, then drain."""
    ordered = sorted(requests, key=lambda r: r.arrival_time)
    t0, c0 = time.perf_counter(), time.process_time()
    with paused_gc():
        for request in ordered:
            stage.advance_to(request.arrival_time)
            stage.route(request, request.arrival_time)
        stage.advance_to(None)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return ClusterRun(list(ordered), {"replicas": stage}, wall, cpu_s=cpu)
