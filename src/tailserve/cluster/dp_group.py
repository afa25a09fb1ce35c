"""Data-parallel attention: one engine's DP ranks as replicas behind the engine's own balancer
(``--data-parallel-size N``; SGLang's ``--dp-size N --enable-dp-attention``).

Each rank is a full engine of its own (scheduler, KV cache of its own requests, attention at
``--tp``). For an MoE model the ranks share the experts: every MoE layer exchanges tokens
across all of them (``moe_comm.py``), so they step in lockstep. vLLM runs such ranks as
``DPEngineCoreProc`` (vllm/v1/engine/core.py, chosen when the model is MoE): while any rank has
work, the idle ones run a dummy batch (``execute_dummy_batch``) so the collectives meet; every
rank's batch is padded to the largest (vllm/v1/worker/dp_utils.py). ``LockstepStage`` steps
them so: each step every rank schedules, the group's time is ``CostModel.group_time`` (the
slowest rank, GEMMs over the padded batch; with draft tokens each rank's verification, its
drafter's pass and its own acceptance draws, the group waiting for the slowest drafter too), and
every rank's clock moves by it. A dense model's
DP ranks never wait for each other (vLLM runs them as plain engines): they are an ordinary
``Stage`` of replicas behind the same balancer.

The balancer is the engine's own: vLLM's ``DPLBAsyncMPClient`` scores each rank ``4 x waiting +
running`` from counts its coordinator publishes every 100 ms (routers.VllmDpRouter);
SGLang's data-parallel controller deals requests round-robin (``load_balance_method``'s
default); TensorRT-LLM's attention-DP ranks share one waiting queue and place its head each
iteration, and may hold contexts (``attention_dp_config``): ``adp_stage.py``. The exact fast
paths are off in a lockstep group (each rank's run would end at every other rank's events).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tailserve.cluster.cluster import Stage
from tailserve.cluster.replica import FeedSource, Replica, ReplicaSpec, build_replica_engine
from tailserve.cluster.router_registry import make_router
from tailserve.cluster.routers import BaseRouter
from tailserve.core.engine import EngineOptions, EngineStalledError
from tailserve.core.executor import StepResult
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.cuda_graph import is_generation_only
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.executors.simulated.executor import advanced_batch_shape, batch_shape, window_shape
from tailserve.executors.simulated.layerwise_load import layerwise_load_time
from tailserve.policies.registry import PolicySpec
from tailserve.policies.trtllm_adp import AdpBalance
from tailserve.policies.vllm_dp_prefill import PrefillCadence

# vLLM's DP coordinator publishes the ranks' request counts every 100 ms (coordinator.py)
BALANCER_REFRESH_S = 0.1
ADP_PLACEMENT = "TensorRT-LLM's attention-DP placement"  # the trtllm MoE group's (adp_stage.py)


def engine_balancer(policy: PolicySpec) -> str:
    """The router standing for the engine's own DP balancer: SGLang's round-robin for the
    SGLang policies, vLLM's request-count score for the others."""
    return "round-robin" if policy.name.startswith("sglang") else "vllm-dp"


def balancer_label(policy: PolicySpec, lockstep: bool) -> str:
    """What places requests on the ranks, in words: TensorRT-LLM's attention-DP group places
    them itself each step (``_trtllm_adp_stage``), the others through ``engine_balancer``."""
    if lockstep and policy.name == "trtllm":
        return ADP_PLACEMENT
    return engine_balancer(policy)


@dataclass
class LockstepStage(Stage):
    """The DP ranks of one MoE engine: replicas stepped together (module docstring)."""

    cost_model: CostModel | None = None  # the group's (its ``dp`` > 1); set by build_dp_stage
    # vLLM's --prefill-schedule-interval: the group's step counter (policies/vllm_dp_prefill.py);
    # None for an engine without the flag, or at 1
    cadence: PrefillCadence | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        throttles = [getattr(r.engine.scheduler.policy, "prefill_throttle", None) for r in self.replicas]
        interval = getattr(self.replicas[0].engine.scheduler.policy.config, "prefill_schedule_interval", 1)
        if interval > 1 and all(t is not None for t in throttles):
            self.cadence = PrefillCadence(interval)
            self._throttles = throttles
            for throttle in throttles:
                throttle.tracking = True

    def advance_to(self, t: float | None) -> None:
        if t is not None and self.scrape_interval > 0:
            tick = math.floor(t / self.scrape_interval) * self.scrape_interval
            if tick > self._scraped_at:
                self._run_until(tick)
                self._states = [r.state(tick) for r in self.replicas]
                self._scraped_at = tick
        self._run_until(t)

    @property
    def now(self) -> float:
        return self.replicas[0].now

    def _run_until(self, t: float | None) -> None:
        for replica in self.replicas:
            replica.source.horizon = t
        while t is None or self.now < t:
            if not self.step():
                return

    def step(self) -> bool:
        """One lockstep iteration of every rank (or a wait for the next event); False once
        every rank is done."""
        assert self.cost_model is not None
        engines = [r.engine for r in self.replicas]
        cadence = self.cadence
        if cadence is not None:
            throttled = cadence.throttles()
            for throttle in self._throttles:
                throttle.throttled = throttled
        pending = [e.schedule_step() for e in engines]
        if all(p is None for p in pending):
            return self._idle()
        cm = self.cost_model
        # A speculative verification (vLLM's accounting: ``advanced``) is priced as the rank's
        # own executor prices it.
        shapes = [
            None if p is None else advanced_batch_shape(p[0]) if p[0].advanced else batch_shape(p[0])
            for p in pending
        ]
        executor = engines[0].executor
        graph = getattr(executor, "graph", None)
        outs = [p[0] for p in pending if p is not None]
        padded = [0] * len(pending)  # dummy requests each rank's graph adds (they draft too)
        if graph is not None and all(is_generation_only(out) for out in outs):
            # TensorRT-LLM's attention-DP ranks replay one CUDA graph size: the largest rank's
            # batch, padded up to a captured size (cuda_graph.py).
            size = graph.padded_batch(max(len(out.scheduled) for out in outs))
            shapes = [
                None if p is None or shape is None else graph.pad(shape, len(p[0].scheduled), size)
                for p, shape in zip(pending, shapes, strict=True)
            ]
            # as SimExecutor counts them: only vLLM's accounting drafts for the padding
            padded = [0 if p is None or not p[0].advanced else size - len(p[0].scheduled) for p in pending]
        windows = None
        if cm.windowed:
            windows = [None if p is None else window_shape(p[0], cm.model.sliding_window) for p in pending]
        duration = cm.group_time(shapes, windows)
        # Host copies a rank's forward waits for (TensorRT-LLM's host pool): the group waits
        # for the slowest rank's.
        duration += max((p[0].kv_copy_time for p in pending if p is not None), default=0.0)
        loads = [p[0].host_load_seconds for p in pending if p is not None]
        if any(loads):  # SGLang's HiCache load-backs: the group waits for the slowest rank's
            duration = layerwise_load_time(duration, max(loads), cm.model.num_layers)
        accepted: list[dict[str, int] | None] = [None] * len(pending)
        if getattr(executor, "spec", None) is not None:
            # Each rank drafts for its own requests and draws its own acceptances; the drafter's
            # layer is the target's (its experts exchanged across the ranks too), so the group
            # waits for the slowest rank's drafting as for its forward pass.
            slowest = 0.0
            for i, (engine, p, shape) in enumerate(zip(engines, pending, shapes, strict=True)):
                if p is not None and shape is not None:
                    drafting, accepted[i] = engine.executor.drafts(p[0], shape, padded[i])
                    slowest = max(slowest, drafting)
            duration += slowest
        for engine, p, drafts in zip(engines, pending, accepted, strict=True):
            if p is None:
                engine.clock.advance(duration)  # a dummy batch, its time the group's
            else:
                engine.complete_step(p, StepResult(duration=duration, num_accepted=drafts))
        if cadence is not None:
            cadence.stepped(not any(e.scheduler.has_unfinished for e in engines))
        return True

    def _idle(self) -> bool:
        """No rank scheduled anything: wait for the earliest arrival or policy wake-up."""
        now = self.now
        wakes = [w for r in self.replicas if (w := r.engine.next_wake(now)) is not None]
        if not wakes:
            stalled = [r.name for r in self.replicas if r.engine.scheduler.has_unfinished]
            if stalled:
                raise EngineStalledError(f"DP ranks {', '.join(stalled)} hold requests but schedule nothing")
            return False
        wake = min(wakes)
        if wake <= now:
            arrivals = [r.source.next_arrival_time() for r in self.replicas]
            if any(a is not None and a <= now for a in arrivals):
                return True  # released during the last step: the next one adds it
            raise EngineStalledError(f"a DP rank asked to be woken at t={wake} but scheduled nothing")
        for replica in self.replicas:
            replica.engine.clock.wait_until(wake)
        return True


def _group_wide_rules(replicas: list[Replica]) -> None:
    """The rules a DP engine applies to its ranks as one: vLLM's admission limits, checked by one
    API server for all of them (``policies/vllm_admission.py``); TensorRT-LLM's batch waiting,
    which ``PyExecutor._schedule`` skips under attention DP, a dense model's ranks included."""
    policies = [r.engine.scheduler.policy for r in replicas]
    admission = getattr(policies[0], "admission", None)
    if admission is not None:
        admission.share([r.engine.scheduler for r in replicas])
        for policy in policies[1:]:
            policy.share_admission(admission)
    for policy in policies:
        if hasattr(policy, "in_attention_dp"):
            policy.in_attention_dp = True
        if policy.fetch_wait() is not None:
            # rank 0 fetches for the whole group (then balances over the ranks): not modelled
            raise ValueError("batch_wait_timeout_ms with attention DP (a DP group) is not simulated")


def build_dp_stage(
    deployment: Deployment,
    policy: PolicySpec,
    *,
    shares_prefixes: bool,
    min_max_model_len: int = 0,
    options: EngineOptions = EngineOptions(),
    router: str | None = None,
    name_prefix: str = "dp",
) -> Stage:
    """The deployment's ``dp`` ranks behind the engine's balancer: a ``LockstepStage`` for an
    MoE model, independent replicas of ``tp`` GPUs for a dense one."""
    if deployment.dp < 2:
        raise ValueError(f"a data-parallel group needs --data-parallel-size >= 2, got {deployment.dp}")
    ranks = deployment.dp
    lockstep = deployment.data_parallel_group
    if not lockstep:  # dense: each rank a plain engine of its own deployment
        deployment = replace(deployment, dp=1)
    built = build_cost_model(deployment, policy.name)
    spec = ReplicaSpec(deployment, policy)
    if lockstep:
        options = replace(options, fast_forward=False)
    replicas = []
    for i in range(ranks):
        source = FeedSource()
        engine = build_replica_engine(
            spec,
            source,
            shares_prefixes=shares_prefixes,
            min_max_model_len=min_max_model_len,
            options=options,
            built=built,
        )
        replicas.append(Replica(i, f"{name_prefix}{i}", spec, engine, source))
    balancer = make_router(router or engine_balancer(policy))
    _group_wide_rules(replicas)
    if lockstep:
        if policy.name == "trtllm":
            stage = _trtllm_adp_stage(replicas, balancer, built.cost_model)
        else:
            stage = LockstepStage(replicas, balancer, BALANCER_REFRESH_S, cost_model=built.cost_model)
    else:
        stage = Stage(replicas, balancer, BALANCER_REFRESH_S)
    stage.cost_notes = built.notes
    return stage


def _trtllm_adp_stage(replicas: list[Replica], balancer: BaseRouter, cost_model: CostModel) -> LockstepStage:
    """TensorRT-LLM's attention-DP group: its own placement each step and, with
    ``attention_dp_enable_balance``, its context holding (cluster/adp_stage.py)."""
    from tailserve.cluster.adp_stage import AdpLockstepStage  # it builds on LockstepStage

    cfg = replicas[0].engine.scheduler.policy.config
    balance = None
    if cfg.attention_dp_enable_balance:
        balance = AdpBalance(
            cfg.attention_dp_timeout_iters, cfg.attention_dp_batching_wait_iters, cfg.batch_size
        )
    return AdpLockstepStage(
        replicas,
        balancer,
        BALANCER_REFRESH_S,
        cost_model=cost_model,
        max_num_active=cfg.batch_size,
        balance=balance,
    )
