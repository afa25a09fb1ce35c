"""Capacity planning for a GPU budget: every layout of ``gpus`` GPUs — all aggregated replicas,
and each prefill:decode split — and the highest arrival rate each meets an SLO at.

The rate is searched as a multiple of the workload's own (a trace's ``rate_scale``, a synthetic
workload's ``rate``) by ``bisect_capacity``, so every run replays the same requests with only
their arrival times scaled. Each layout's replicas run the same deployment (its TP: a replica
takes ``tp`` GPUs) and policy; the aggregated layout and the prefill side use one router, the
decode side ``least-kv``.

Each layout's search is a generator of ``ClusterRunSpec``s (one cluster run at one rate), driven
by a ``Sweep`` like every other sweep: serially, on the process pool (``--workers``) or on Ray
(``--ray-address``), the layouts' searches side by side, with identical results on every backend.

With ``tps`` the plan also searches the replicas' parallelism: TP 1, 2, 4, 8 (those dividing the
budget and the model's heads), and for an MoE model experts sliced or split whole over the TP
ranks (``--enable-expert-parallel``) — 8 GPUs as 8 replicas of TP 1 (data parallelism behind the
router) up to one of TP 8. With ``dps`` (``--plan-dp``), an MoE model's layouts also include one
engine of data-parallel attention ranks over the whole budget: DP d x TP t = ``gpus``, its ranks
in lockstep behind the engine's balancer (cluster/dp_group.py).

With ``pps`` (``--plan-pp``) every shape is also planned at each pipeline-parallel size: replicas
of TP x PP GPUs, the layers split over PP stages (executors/simulated/pipeline.py), so a TP whose
weights leave no room for a KV cache alone may fit with PP (the fit is judged on the fullest
stage, ``ModelSpec.pipeline_stage``). A layout with PP > 1 is aggregated replicas only (P/D
splits under PP are not simulated) and runs a policy simulated under stages (vLLM's batch queue,
TensorRT-LLM's PP loop, Sarathi-Serve's engine where the stages divide the layers:
``plannable_pps``); DP engines stay PP 1.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass, replace
from typing import Any

from tailserve.cluster.build import build_stage, workload_requests
from tailserve.cluster.cluster import ClusterRun, run_aggregated
from tailserve.cluster.disagg import make_pd_cluster, pd_specs
from tailserve.cluster.dp_group import build_dp_stage
from tailserve.cluster.metrics import cluster_summary
from tailserve.cluster.replica import ReplicaSpec
from tailserve.cluster.spec import replicated
from tailserve.executors.simulated.deployment import Deployment
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.kv_capacity import kv_capacity
from tailserve.metrics.summary import Slo
from tailserve.policies.registry import PIPELINED_POLICIES, PolicySpec, runs_under_stages
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.tune.capacity import CapacitySlo, capacity_steps
from tailserve.tune.sweep import RunOutcome, SerialBackend, Sweep, _plain, deployment_plain, spec_key
from tailserve.workloads.traces import load_trace


@dataclass(frozen=True, slots=True)
class Layout:
    num_prefill: int  # replicas; with num_decode == 0, the aggregated replicas
    num_decode: int = 0
    # The replicas' parallelism when the plan searches it (``tps``): TP degree and whether an MoE
    # model's experts are split whole over the TP ranks; 0: the deployment's own, not shown.
    tp: int = 0
    expert_parallel: bool = False
    dp: int = 0  # > 1: one engine of DP ranks of ``tp`` GPUs (num_prefill 1, num_decode 0)
    # EPLB as the plan sets it on an expert-parallel layout (``--plan-eplb``): None, the
    # deployment's own; -1, off; N >= 0, on with N redundant experts
    eplb: int | None = None
    # Pipeline stages when the plan searches them (``pps``), shown in the label (PP 1 included,
    # so the rows compare); 0: the deployment's own, not shown
    pp: int = 0

    @property
    def label(self) -> str:
        pp = f" x PP {self.pp}" if self.pp else ""
        if self.dp:
            return (
                f"1 engine x DP {self.dp} x TP {self.tp}"
                + (" EP" if self.expert_parallel else "")
                + pp
                + self._eplb
            )
        shape = ""
        if self.tp:
            shape = f" x TP {self.tp}" + (" EP" if self.expert_parallel else "")
        shape += pp
        if self.num_decode == 0:
            return f"{self.num_prefill} aggregated{shape}{self._eplb}"
        return f"{self.num_prefill} prefill + {self.num_decode} decode{shape}{self._eplb}"

    @property
    def _eplb(self) -> str:
        if self.eplb is None:
            return ""
        return ", no EPLB" if self.eplb < 0 else f", EPLB +{self.eplb} experts"


@dataclass(frozen=True, slots=True)
class PlanRow:
    layout: Layout
    rate: float  # requests/s: the highest rate found meeting the SLO (0: not even the lowest)
    upper: float | None  # the lowest rate found missing it
    summary_at_rate: dict[str, Any] | None  # the run at ``rate``


def layouts(num_replicas: int, tp: int = 0, expert_parallel: bool = False, pp: int = 0) -> list[Layout]:
    """All aggregated, then every split with at least one replica on each side; with ``pp`` > 1
    the aggregated layout alone (P/D splits under pipeline parallelism are not simulated)."""
    if num_replicas < 1:
        raise ValueError(f"the GPU budget holds no replica (got {num_replicas} replicas)")
    shape = dict(tp=tp, expert_parallel=expert_parallel, pp=pp)
    if pp > 1:
        return [Layout(num_replicas, **shape)]
    return [
        Layout(num_replicas, **shape),
        *(Layout(p, num_replicas - p, **shape) for p in range(1, num_replicas)),
    ]


def parallel_shapes(
    gpus: int, deployment: Deployment, tps: list[int], expert_parallel: str, pp: int = 1
) -> list[tuple[int, bool]]:
    """(TP, EP) of the replicas to plan: each TP of ``tps`` that divides the budget (in replicas
    of TP x ``pp`` GPUs) and the model's heads and leaves room for a KV cache on the fullest of
    ``pp`` stages, with and/or without expert parallelism (``expert_parallel``: off, on or both;
    on and both apply to MoE models at TP > 1 only)."""
    shapes = _shapes(gpus, deployment, tps, expert_parallel, pp)
    if not shapes:
        spec = deployment.model_spec()
        at_pp = f" at PP {pp}" if pp > 1 else ""
        raise ValueError(
            f"no TP of {tps} splits {gpus} GPUs and {spec.name}'s {spec.num_heads} attention heads "
            f"with room for its KV cache on {deployment.hardware}{at_pp}"
        )
    return shapes


def _shapes(
    gpus: int, deployment: Deployment, tps: list[int], expert_parallel: str, pp: int
) -> list[tuple[int, bool]]:
    if expert_parallel not in ("off", "on", "both"):
        raise ValueError(f"--plan-ep must be off, on or both, got {expert_parallel!r}")
    spec = deployment.model_spec()
    too_small = unfit(deployment, [tp for tp in tps if tp >= 1], pp=pp)
    shapes = []
    for tp in tps:
        if tp < 1 or gpus % (tp * pp) or spec.num_heads % tp or tp in too_small:
            continue
        ep_options = [False]
        if spec.is_moe and tp > 1 and expert_parallel != "off":
            ep_options = [True] if expert_parallel == "on" else [False, True]
        shapes += [(tp, ep) for ep in ep_options]
    return shapes


def unfit(deployment: Deployment, tps: list[int], dp: int = 1, pp: int = 1) -> dict[int, str]:
    """The TP degrees of ``tps`` at which the model leaves no room for a KV cache (the weights
    alone; with ``dp``, the experts spread over the DP ranks too; with ``pp``, on the pipeline
    stage holding the most layers), each with the reason."""
    spec, hardware = deployment.model_spec(), get_hardware(deployment.hardware)
    if pp > spec.num_layers:
        return {tp: f"PP {pp} is more stages than {spec.name}'s {spec.num_layers} layers" for tp in tps}
    stage = spec.pipeline_stage(pp)
    reasons = {}
    for tp in tps:
        try:
            kv_capacity(stage, hardware, tp, 0.9, 16, 8192, dp=dp, pp=pp)
        except ValueError as error:
            reasons[tp] = str(error)
    return reasons


def dp_layouts(gpus: int, deployment: Deployment, dps: list[int], expert_parallel: str) -> list[Layout]:
    """One DP engine over the whole budget per (DP, EP) that fits: TP = ``gpus`` / DP dividing
    the heads, an MoE model (a dense model's DP ranks are the aggregated replicas)."""
    spec = deployment.model_spec()
    if not spec.is_moe:
        raise ValueError(
            f"--plan-dp: {spec.name} is dense; its DP ranks are the aggregated replicas already planned"
        )
    out = []
    for dp in dps:
        if dp < 2 or gpus % dp:
            continue
        tp = gpus // dp
        if spec.num_heads % tp or unfit(deployment, [tp], dp):
            continue
        ep_options = {"off": [False], "on": [True], "both": [False, True]}[expert_parallel]
        out += [Layout(1, 0, tp, ep, dp) for ep in ep_options if not ep or spec.num_experts % gpus == 0]
    return out


def replica_layouts(
    gpus: int,
    deployment: Deployment,
    tps: list[int] | None = None,
    expert_parallel: str = "off",
    pps: list[int] | None = None,
) -> list[Layout]:
    """The replicas' layouts of a plan: with ``tps``, every (TP, EP) shape that fits; with
    ``pps``, each of those (or the deployment's TP) at each PP size whose replicas of TP x PP
    GPUs divide the budget and leave room for a KV cache on their fullest stage (PP > 1:
    aggregated only). Without ``pps`` the deployment's own PP, not shown: replicas of TP x PP
    GPUs, aggregated only when PP > 1."""
    own_pp = deployment.pp
    if pps is None and not tps:
        replica = deployment.tp * own_pp
        if gpus % replica:
            pp = f" x PP {own_pp}" if own_pp > 1 else ""
            raise ValueError(f"{gpus} GPUs do not split into replicas of TP {deployment.tp}{pp}")
        return layouts(gpus // replica) if own_pp == 1 else [Layout(gpus // replica)]
    out: list[tuple[int, int, Layout]] = []  # (TP's place, PP's place, layout)
    for j, pp in enumerate(pps or [own_pp]):
        shown = pp if pps else 0
        if tps:
            shapes = _shapes(gpus, deployment, tps, expert_parallel, pp)
        else:
            fits = gpus % (deployment.tp * pp) == 0 and not unfit(deployment, [deployment.tp], pp=pp)
            shapes = [(0, False)] if fits else []
        for tp, ep in shapes:
            replicas = gpus // ((tp or deployment.tp) * pp)
            found = layouts(replicas, tp, ep, shown) if pp == 1 else [Layout(replicas, 0, tp, ep, pp=shown)]
            out += [(tps.index(tp) if tps else 0, j, layout) for layout in found]
    if not out:
        spec = deployment.model_spec()
        tp_text = f"TP of {tps}" if tps else f"TP {deployment.tp}"
        pp_text = f" x PP of {pps}" if pps else (f" x PP {own_pp}" if own_pp > 1 else "")
        raise ValueError(
            f"no {tp_text}{pp_text} splits {gpus} GPUs and {spec.name}'s {spec.num_heads} attention heads "
            f"with room for its KV cache on {deployment.hardware}"
        )
    out.sort(key=lambda item: item[:2])  # stable: each shape's layouts in order, its PP sizes after
    return [layout for _, _, layout in out]


def base_rate(spec: WorkloadSpec) -> float:
    if spec.name != "trace":
        return spec.rate
    trace = load_trace(spec.trace_path or "", max_requests=spec.max_requests)
    span = trace[-1].arrival_time - trace[0].arrival_time if len(trace) > 1 else 0.0
    if span <= 0:
        raise ValueError(
            f"{spec.trace_path}: needs two or more requests at different times to scale its rate"
        )
    return len(trace) / span * spec.rate_scale


def layout_deployment(layout: Layout, deployment: Deployment) -> Deployment:
    """The deployment a layout runs: its TP, DP and expert parallelism, and its EPLB setting.
    A TP-sliced layout has no busiest rank and nothing for EPLB to place; an expert-parallel one
    reads the routing ``--expert-imbalance`` gives at the EP size it was measured at (the base
    deployment's), not as if measured at its own."""
    changes: dict[str, Any] = {}
    if layout.pp:
        changes["pp"] = layout.pp
    elif layout.dp and deployment.pp != 1:  # a DP engine's ranks run unpipelined
        changes["pp"] = 1
    if layout.tp:
        changes.update(tp=layout.tp, expert_parallel=layout.expert_parallel, dp=max(1, layout.dp))
        if not layout.expert_parallel:
            changes.update(
                expert_imbalance=0.0, enable_eplb=False, num_redundant_experts=0, expert_imbalance_ep=0
            )
        elif deployment.expert_imbalance and not deployment.expert_imbalance_ep:
            changes["expert_imbalance_ep"] = deployment.tp * deployment.dp
    if layout.eplb is not None:
        changes.update(enable_eplb=layout.eplb >= 0, num_redundant_experts=max(layout.eplb, 0))
    return replace(deployment, **changes) if changes else deployment


def _eplb_unfit(layout: Layout, deployment: Deployment) -> str | None:
    """Why an EPLB variant cannot run (slots that do not split over its EP ranks, redundant
    experts that leave no room for a KV cache), or None."""
    from tailserve.executors.simulated.deployment import build_cost_model

    try:
        cm = build_cost_model(layout_deployment(layout, deployment)).cost_model
        stage, extra, pp = cm.fullest_stage
        kv_capacity(stage, cm.hardware, cm.tp, 0.9, 16, 8192, dp=cm.dp, extra_weights=extra, pp=pp)
    except ValueError as error:
        return str(error)
    return None


def run_layout(
    layout: Layout, deployment: Deployment, policy: PolicySpec, spec: WorkloadSpec, router: str, link: str
) -> ClusterRun:
    deployment = layout_deployment(layout, deployment)
    wb = WorkloadBuilder(spec)
    if layout.dp:  # one engine of DP ranks behind its own balancer
        stage = build_dp_stage(
            deployment, policy, shares_prefixes=wb.shares_prefixes, min_max_model_len=wb.min_max_model_len
        )
        return run_aggregated(stage, workload_requests(wb, [ReplicaSpec(deployment, policy)]))
    common: dict[str, Any] = dict(
        shares_prefixes=wb.shares_prefixes, min_max_model_len=wb.min_max_model_len, scrape_interval=0.05
    )
    if layout.num_decode == 0:
        specs = replicated(layout.num_prefill, deployment, policy)
        return run_aggregated(build_stage(specs, router, **common), workload_requests(wb, specs))
    prefill_specs, decode_specs = pd_specs(
        replicated(layout.num_prefill, deployment, policy), replicated(layout.num_decode, deployment, policy)
    )
    prefill = build_stage(prefill_specs, router, name_prefix="p", pd_pair=True, **common)
    decode = build_stage(decode_specs, "least-kv", name_prefix="d", pd_pair=True, **common)
    return make_pd_cluster(prefill, decode, link).run(workload_requests(wb, prefill_specs))


@dataclass(frozen=True, slots=True)
class ClusterRunSpec:
    """One cluster run: a layout of replicas on a workload (its rate included), a ``SweepSpec``."""

    layout: Layout
    deployment: Deployment
    policy: PolicySpec
    workload: WorkloadSpec
    router: str
    link: str
    # Per-request bounds: the summary's goodput, which an SLO like ttft=2s,tpot=100ms is judged
    # on (without it every run counted no good request and every layout's capacity was "none").
    slo: Slo | None = None
    keep_run: bool = False  # summaries only

    def describe(self) -> dict[str, Any]:
        layout = _plain(self.layout)
        if self.layout.eplb is None:  # the plans before --plan-eplb keep their results files' keys
            del layout["eplb"]
        if not self.layout.pp:  # and those before --plan-pp theirs
            del layout["pp"]
        out = {
            "kind": "cluster",
            "layout": layout,
            "deployment": deployment_plain(self.deployment),
            "policy": {"name": self.policy.name, **self.policy.flags, **self.policy.engine_flags},
            "workload": _plain(self.workload),
            "router": self.router,
            "link": self.link,
        }
        if self.slo is not None:  # only then: a tail-SLO plan keeps the keys its results file has
            out["slo"] = _plain(self.slo)
        return out

    @property
    def key(self) -> str:
        return spec_key(self.describe())

    def execute(self) -> RunOutcome:
        label = self.layout.label
        started = time.perf_counter()
        try:
            run = run_layout(self.layout, self.deployment, self.policy, self.workload, self.router, self.link)
        except ValueError as error:
            return RunOutcome(self.key, label, {}, 0.0, error=str(error))
        return RunOutcome(self.key, label, cluster_summary(run, self.slo), time.perf_counter() - started)


def _scaled(spec: WorkloadSpec, x: float) -> WorkloadSpec:
    """The workload at ``x`` times its own rate (same requests, arrival times / x)."""
    if spec.name == "trace":
        return replace(spec, rate_scale=spec.rate_scale * x)
    return replace(spec, rate=spec.rate * x)


def layout_search(
    base: ClusterRunSpec, slo: CapacitySlo, rate0: float, rel_tol: float
) -> Generator[ClusterRunSpec, RunOutcome, PlanRow]:
    """The layout's capacity search as a sweep's search: yields a run per rate tried."""
    summaries: dict[float, dict[str, Any]] = {}
    steps = capacity_steps(1.0, 1.0, rel_tol, min_rate=1 / 64, max_rate=64.0)
    try:
        x = next(steps)
        while True:
            outcome = yield replace(base, workload=_scaled(base.workload, x))
            if outcome.error is not None:
                raise ValueError(f"{base.layout.label}: {outcome.error}")
            summaries[x] = outcome.summary
            x = steps.send(slo.meets(outcome.summary))
    except StopIteration as stop:
        found = stop.value
    upper = None if found.upper is None else found.upper * rate0
    return PlanRow(base.layout, found.rate * rate0, upper, summaries.get(found.rate))


def plannable_pps(policy: PolicySpec, deployment: Deployment, pps: list[int]) -> tuple[list[int], str | None]:
    """The PP sizes of ``--plan-pp`` the policy runs on (Sarathi-Serve's engine needs the layers
    divisible by the stages), and a note naming those left out (None: none was); one line when
    none is left."""
    layers = deployment.model_spec().num_layers
    kept = [pp for pp in pps if pp == 1 or runs_under_stages(policy.name, layers, pp)]
    uneven = [pp for pp in pps if pp not in kept and policy.name in PIPELINED_POLICIES]
    if not uneven:
        return pps, None
    why = f"{policy.name} runs in Sarathi-Serve's pipelined engine, which needs the layers ({layers}) divisible by the stages"
    if not kept:
        raise ValueError(f"--plan-pp: {why}; none of {', '.join(map(str, uneven))} does")
    return kept, f"PP {', '.join(map(str, uneven))} left out: {why}"


def plan(
    gpus: int,
    deployment: Deployment,
    policy: PolicySpec,
    spec: WorkloadSpec,
    slo: CapacitySlo,
    *,
    router: str = "prefix-aware",
    link: str = "ib-ndr",
    rel_tol: float = 0.1,
    sweep: Sweep | None = None,
    tps: list[int] | None = None,
    expert_parallel: str = "off",
    dps: list[int] | None = None,
    dp_only: bool = False,
    eplb: list[int] | None = None,
    notes: list[str] | None = None,
    pps: list[int] | None = None,
) -> list[PlanRow]:
    """Every layout's capacity; the runs on ``sweep``'s backend (default: this process). With
    ``tps``, the replicas' TP (and, for an MoE model, expert parallelism) is searched too: every
    layout of every (TP, EP) shape that fits the budget. With ``dps``, one DP engine per (DP,
    TP, EP) over the whole budget too; ``dp_only``: those alone (``tune --data-parallel-size``).
    With ``eplb`` (-1: off, N >= 0: N redundant experts), every expert-parallel layout once per
    setting (``tune --plan-eplb``); a setting that cannot run there is left out, and why goes to
    ``notes``. With ``pps`` (``tune --plan-pp``), each replica shape at each pipeline-parallel
    size that fits (``replica_layouts``); a PP > 1 needs a policy simulated under stages."""
    if policy.name not in PIPELINED_POLICIES and max(pps or [deployment.pp]) > 1 and not dp_only:
        raise ValueError(
            f"pipeline parallelism is simulated for {', '.join(PIPELINED_POLICIES)}, not {policy.name}: "
            "give --plan-policy vllm, or PP sizes of 1"
        )
    if dp_only and pps:
        raise ValueError(
            "--plan-pp plans replicas over --gpus: not with --data-parallel-size (one DP engine)"
        )
    if pps:
        pps, note = plannable_pps(policy, deployment, pps)
        if note and notes is not None:
            notes.append(note)
    if deployment.expert_imbalance and not (deployment.expert_parallel and deployment.tp * deployment.dp > 1):
        raise ValueError(
            "--expert-imbalance is the routing measured at an EP size: give the --tp / --data-parallel-size "
            "and --enable-expert-parallel it was measured at (a plan reads it at each layout's EP size)"
        )
    extra = dp_layouts(gpus, deployment, dps, expert_parallel) if dps else []
    if dps and not extra:
        raise ValueError(
            f"--plan-dp {','.join(map(str, dps))}: no DP x TP of {gpus} GPUs fits {deployment.model} on "
            f"{deployment.hardware}"
        )
    if pps:  # the DP engines' label shows their PP 1 too, so the rows compare
        extra = [replace(layout, pp=1) for layout in extra]
    all_layouts = extra if dp_only else replica_layouts(gpus, deployment, tps, expert_parallel, pps) + extra
    if eplb:
        all_layouts = [
            variant
            for layout in all_layouts
            for variant in (
                [replace(layout, eplb=n) for n in eplb]
                if (layout.expert_parallel if layout.tp else deployment.expert_parallel)
                else [layout]
            )
        ]
        kept = []
        for layout in all_layouts:
            reason = _eplb_unfit(layout, deployment) if layout.eplb is not None and layout.eplb >= 0 else None
            if reason is None:
                kept.append(layout)
            elif notes is not None:
                notes.append(f"{layout.label} left out: {reason}")
        all_layouts = kept
        if not any(layout.eplb is not None for layout in all_layouts):
            raise ValueError(
                "--plan-eplb: no layout splits the experts whole (EPLB places whole experts): give "
                "--enable-expert-parallel, or --plan-ep on or both with --plan-tps"
            )
    rate0 = base_rate(spec)
    searches = [
        layout_search(
            ClusterRunSpec(layout, deployment, policy, spec, router, link, slo.request), slo, rate0, rel_tol
        )
        for layout in all_layouts
    ]
    if sweep is not None:
        return sweep.drive(searches, f"{gpus} GPUs")
    with Sweep(SerialBackend(), quiet=True) as serial:
        return serial.drive(searches, f"{gpus} GPUs")
