"""Replicas and stages from specs, and a workload's requests for a cluster run."""

from __future__ import annotations

import math
from collections.abc import Sequence

from tailserve.cluster.cluster import Stage
from tailserve.cluster.kv_events import SimKvIndex
from tailserve.cluster.prefix_routers import KvAwareRouter
from tailserve.cluster.replica import FeedSource, Replica, ReplicaSpec, build_replica_engine
from tailserve.cluster.router_registry import make_router
from tailserve.core.engine import EngineOptions
from tailserve.core.request import Request
from tailserve.executors.simulated.deployment import BuiltCostModel, build_cost_model
from tailserve.sim.workload_builder import WorkloadBuilder


def build_stage(
    specs: Sequence[ReplicaSpec],
    router: str,
    *,
    shares_prefixes: bool,
    min_max_model_len: int = 0,
    scrape_interval: float = 0.0,
    options: EngineOptions = EngineOptions(),
    name_prefix: str = "r",
    pd_pair: bool = False,
) -> Stage:
    """One engine per spec (cost models built once per distinct deployment) behind one router."""
    router_obj = make_router(router)
    cost_models: dict[object, BuiltCostModel] = {}
    replicas: list[Replica] = []
    for i, spec in enumerate(specs):
        deployment = spec.deployment.for_policy(spec.policy.name)
        built = cost_models.get(deployment)
        if built is None:
            built = cost_models[deployment] = build_cost_model(deployment)
        source = FeedSource()
        engine = build_replica_engine(
            spec,
            source,
            shares_prefixes=shares_prefixes,
            min_max_model_len=min_max_model_len,
            options=options,
            built=built,
            pd_pair=pd_pair,
        )
        replicas.append(Replica(i, f"{name_prefix}{i}", spec, engine, source))
    stage = Stage(replicas, router_obj, scrape_interval)
    if isinstance(router_obj, KvAwareRouter) and router_obj.config.kv_events:
        stage.kv_index = router_obj.kv_index = SimKvIndex(replicas)
    return stage


def workload_requests(workload: WorkloadBuilder, specs: Sequence[ReplicaSpec]) -> list[Request]:
    """The workload's requests, all of them up front (a cluster routes open-loop arrivals). The
    first replica's cost model times ``hol``'s long prompt."""
    source = workload.build(build_cost_model(specs[0].deployment, specs[0].policy.name).cost_model)
    requests = source.pop_arrived(math.inf)
    if not source.exhausted:
        raise ValueError(
            f"workload {workload.spec.label}: a closed-loop client cannot be split across replicas; "
            "use an open-loop arrival process (poisson, gamma, constant) or a trace"
        )
    if not requests:
        raise ValueError(f"workload {workload.spec.label}: no requests arrived, nothing to simulate")
    return requests
