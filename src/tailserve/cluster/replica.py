"""One replica of a simulated cluster: a full engine (own policy, KV cache, cost model) fed by
the cluster's router, advanced on its own virtual clock up to the cluster's next event.

The engine never sees the future: its source reports as "next arrival" the cluster's next
event time (the horizon), so the exact fast paths stop there and a request routed at that time
joins the replica at its next iteration, exactly as in a single-engine run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tailserve.assemble import BuildOptions, BuiltEngine, build_engine
from tailserve.cluster.routing import ReplicaState
from tailserve.core.engine import EngineOptions
from tailserve.core.request import Request
from tailserve.executors.simulated.deployment import BuiltCostModel, Deployment
from tailserve.executors.simulated.driver import SimDriver
from tailserve.policies.registry import PolicySpec


class FeedSource:
    """Requests handed over by the cluster, each released at its routing (or transfer) time."""

    def __init__(self) -> None:
        self._pending: deque[tuple[float, Request]] = deque()
        self.horizon: float | None = None  # the cluster's next event, None when draining
        # Called for every request that leaves the replica (the router, the P/D hand-over).
        self.finish_hooks: list[Callable[[Request, float], None]] = []

    def add(self, request: Request, release_time: float) -> None:
        self._pending.append((release_time, request))

    def next_arrival_time(self) -> float | None:
        head = self._pending[0][0] if self._pending else None
        if head is None:
            return self.horizon
        return head if self.horizon is None else min(head, self.horizon)

    def pop_arrived(self, now: float) -> list[Request]:
        out: list[Request] = []
        pending = self._pending
        while pending and pending[0][0] <= now:
            out.append(pending.popleft()[1])
        return out

    def on_finish(self, request: Request, now: float) -> None:
        for hook in self.finish_hooks:
            hook(request, now)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def exhausted(self) -> bool:
        return not self._pending


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """What one replica runs: a deployment (GPU, TP, calibration) and a policy with its flags."""

    deployment: Deployment
    policy: PolicySpec

    @property
    def label(self) -> str:
        pp = f":pp{self.deployment.pp}" if self.deployment.pp > 1 else ""
        return f"{self.deployment.hardware}:tp{self.deployment.tp}{pp}"


def build_replica_engine(
    spec: ReplicaSpec,
    source: FeedSource,
    *,
    shares_prefixes: bool,
    min_max_model_len: int = 0,
    options: EngineOptions = EngineOptions(),
    built: BuiltCostModel | None = None,
    pd_pair: bool = False,
) -> BuiltEngine:
    """The one place a cluster replica's engine is made: ``build_engine`` over ``source`` (a
    shared ``built`` cost model lets replicas of one deployment share its fit)."""
    target = built if built is not None else spec.deployment
    build = BuildOptions(
        min_max_model_len=min_max_model_len, shares_prefixes=shares_prefixes, engine=options, pd_pair=pd_pair
    )
    return build_engine(target, spec.policy, "sim", build, source=source)


class Replica:
    def __init__(
        self, index: int, name: str, spec: ReplicaSpec, built: BuiltEngine, source: FeedSource
    ) -> None:
        self.index = index
        self.name = name
        self.spec = spec
        self.built = built
        assert built.engine is not None  # build_replica_engine always makes it
        self.engine = built.engine
        self.driver = SimDriver(self.engine)  # the exact fast paths after each step
        self.source = source
        self.num_routed = 0

    @property
    def now(self) -> float:
        return self.engine.clock.now

    def add(self, request: Request, release_time: float) -> None:
        self.num_routed += 1
        self.source.add(request, release_time)

    def advance_to(self, t: float | None) -> None:
        """Run iterations until the clock reaches ``t`` (an iteration under way then ends after
        it); ``None``: until every request has left."""
        engine = self.engine
        fast_forward = self.driver.fast_forward
        self.source.horizon = t
        if t is None:
            while engine.step():
                fast_forward()
            return
        while engine.clock.now < t:
            if not engine.step():
                engine.clock.wait_until(t)
                return
            fast_forward()

    def state(self, now: float) -> ReplicaState:
        """What a /metrics scrape would say now."""
        sched = self.engine.scheduler
        kv = sched.kv_cache
        return ReplicaState(
            replica_id=self.index,
            name=self.name,
            # Requests holding KV while they wait (a load, a P/D read or pre-allocation) count as
            # waiting, as vLLM's get_request_counts counts its kv_holding_waiting queue.
            num_waiting=len(sched.waiting)
            + len(sched.loading)
            + len(sched.swapped)
            + self.source.num_pending,
            num_running=len(sched.running),
            kv_usage=kv.num_used_blocks / kv.num_blocks if kv.num_blocks else 0.0,
            scraped_at=now,
        )
