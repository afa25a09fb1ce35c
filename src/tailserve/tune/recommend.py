"""``tailserve tune``: capacity per policy, the best token budget / chunk size, and the flags to use.

1. Capacity: for each policy with its engine's defaults, the highest arrival rate meeting the SLO
   (``capacity.py``); the policies' searches run side by side on the sweep's backend.
2. Budget sweep: at one fixed rate (``sweep_rate``; by default the best policy's capacity, where
   the budget decides whether the SLO holds), each policy runs at every size of its budget flag.
   The objective is the SLO ratio — the worst measured/bound over the SLO's terms, lower is
   better, <= 1 meets it. The *flat region* is the run of neighbouring sizes whose ratio is within
   ``flat_tol`` of the optimum: how far the flag can move before it matters.
3. The command line each policy's engine takes for the recommended size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from tailserve.core.engine import EngineOptions
from tailserve.executors.simulated.deployment import Deployment
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.policies.registry import PolicySpec, get_policy_cls
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.tune.capacity import (
    Capacity,
    CapacitySearch,
    CapacitySlo,
    RateScaler,
    longer_workload,
    search_capacities,
    workload_size,
)
from tailserve.tune.ceiling import Ceiling, ceiling_of, ceiling_specs
from tailserve.tune.commands import command_line
from tailserve.tune.sweep import RunOutcome, RunSpec, Sweep

# The engines a user can run today, and Sarathi-Serve's rule (the essay's subject); vLLM V0 only
# when asked for (`--policies vllm-v0`): vLLM 0.11 removed it, so its command runs on 0.10 or older.
DEFAULT_TUNE_POLICIES = "vllm,sarathi,sglang,trtllm,tgi,slo"
DEFAULT_CHUNK_SIZES = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# Each engine's per-iteration token budget, by its own flag name.
KNOBS = {
    "vllm": "max_num_batched_tokens",
    "vllm-v0": "max_num_batched_tokens",
    "sarathi": "chunk_size",
    "sglang": "chunked_prefill_size",
    "tgi": "max_batch_prefill_tokens",
    "trtllm": "max_num_tokens",
}


@dataclass(frozen=True, slots=True)
class TuneConfig:
    deployment: Deployment
    workload: WorkloadSpec
    slo: CapacitySlo
    policies: tuple[PolicySpec, ...]
    chunk_sizes: tuple[int, ...] = DEFAULT_CHUNK_SIZES
    sweep_rate: float | None = None  # requests/s; None: the best policy's capacity
    rel_tol: float = 0.05  # capacity bracket width / its upper end
    flat_tol: float = 0.10  # flat region: SLO ratio within this fraction of the optimum
    min_rate: float = 1e-3
    max_rate: float = 1e4
    options: EngineOptions = field(default_factory=EngineOptions)
    # Sweep a budget the policy spec sets too, its own value among the sizes (an engine command's
    # line is where the sweep starts); otherwise a budget the user fixed is kept and not swept.
    sweep_given: bool = False

    def __post_init__(self) -> None:
        if not self.policies:
            raise ValueError("tune needs at least one policy")
        if not self.chunk_sizes or any(s < 1 for s in self.chunk_sizes):
            raise ValueError(f"--chunk-sizes must be token counts >= 1, got {self.chunk_sizes}")
        if self.sweep_rate is not None and not self.sweep_rate > 0:
            raise ValueError(f"--request-rate must be > 0 requests/s, got {self.sweep_rate}")
        if not 0 <= self.flat_tol < 1:
            raise ValueError(f"--flat-tol must be in [0, 1), got {self.flat_tol}")
        if not 0 < self.rel_tol < 1:
            raise ValueError(f"--rel-tol must be in (0, 1), got {self.rel_tol}")
        if not self.max_rate > self.min_rate:
            raise ValueError(f"--max-rate must be > {self.min_rate:g} requests/s, got {self.max_rate}")


@dataclass(slots=True)
class SizePoint:
    size: int
    spec: PolicySpec  # the policy with this size (and what it needs, e.g. max_num_seqs)
    ratio: float  # SLO ratio (see CapacitySlo.ratio); inf when the flags are invalid
    summary: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def num_turned_away(self) -> int:
        return self.summary.get("num_turned_away", 0)

    @property
    def meets(self) -> bool:
        return self.error is None and self.ratio <= 1 and self.num_turned_away == 0


@dataclass(slots=True)
class PolicyTune:
    spec: PolicySpec
    capacity: Capacity
    knob: str | None  # None: the policy has no budget flag (orca, static)
    capacity_size: int | None  # the budget its capacity was measured at (engine default or user's)
    points: list[SizePoint] = field(default_factory=list)
    best: SizePoint | None = None
    flat: tuple[int, int] | None = None  # sizes at the flat region's ends
    command: str | None = None
    # The same rate replayed with twice the requests (``capacity.longer_workload``): whether it
    # still meets the SLO, and its SLO ratio; None when not checked (no capacity, or a whole
    # trace that has no more requests).
    holds_longer: bool | None = None
    longer_ratio: float | None = None
    longer_label: str | None = None

    @property
    def flat_sizes(self) -> list[int]:
        if self.flat is None:
            return []
        return [p.size for p in self.points if self.flat[0] <= p.size <= self.flat[1]]


@dataclass(slots=True)
class TuneResult:
    config: TuneConfig
    sweep_rate: float
    policies: list[PolicyTune]  # ranked: highest capacity, then fewest turned away and lowest ratio at best
    # The most requests/s the deployment completes on the workload's requests (ceiling.py): no
    # policy sustains more; None for a multi-turn workload.
    ceiling: Ceiling | None = None


def with_slo_targets(spec: PolicySpec, slo: CapacitySlo) -> PolicySpec:
    """The ``slo`` policy scheduled against the SLO being tuned for (one class whose TTFT and
    TBT targets are the SLO's p99 bounds), unless the user gave it classes; others unchanged."""
    if spec.name != "slo" or "slo_classes" in spec.flags:
        return spec
    bounds = {metric: bound for metric, _, bound in slo.tails}
    ttft = bounds.get("ttft_s") or (slo.request.ttft if slo.request is not None else None)
    tbt = bounds.get("itl_s") or (slo.request.tpot if slo.request is not None else None)
    if not ttft or not tbt:
        return spec  # the SLO bounds neither: the policy keeps its default classes
    classes = f"tuned=ttft:{ttft * 1000:g}ms,tbt:{tbt * 1000:g}ms"
    return PolicySpec(spec.name, {**spec.flags, "slo_classes": classes}, spec.engine_flags)


def tune(config: TuneConfig, sweep: Sweep, model_id: str | None = None) -> TuneResult:
    config = replace(config, policies=tuple(with_slo_targets(s, config.slo) for s in config.policies))
    # The per-request part of the SLO makes each run's summary count good requests (goodput).
    base = [
        RunSpec(config.deployment, config.workload, spec, config.slo.request, config.options)
        for spec in config.policies
    ]
    scalers = [RateScaler.of(b) for b in base]
    searches = [
        CapacitySearch(s, config.slo, config.rel_tol, config.min_rate, config.max_rate) for s in scalers
    ]
    capacities = search_capacities(sweep, searches)
    best_capacity = max(c.rate for c in capacities)
    if config.sweep_rate is None and best_capacity <= 0:
        raise ValueError(
            f"no policy meets the SLO ({config.slo}) at any rate down to {config.min_rate:g} requests/s; "
            "relax --slo or give --request-rate for the budget sweep"
        )
    rate = config.sweep_rate if config.sweep_rate is not None else best_capacity
    device, model = get_hardware(config.deployment.hardware).device_info, get_model(config.deployment.model)
    tunes: list[PolicyTune] = []
    specs: list[RunSpec] = []
    for spec, scaler, capacity in zip(config.policies, scalers, capacities):
        max_model_len = _max_model_len(spec, model.max_position_embeddings)
        knob = KNOBS.get(spec.name)
        capacity_size = None
        if knob is not None:
            config_used = get_policy_cls(spec.name).default_config(device, max_model_len, **spec.flags)
            capacity_size = getattr(config_used, knob)
        pt = PolicyTune(spec, capacity, knob, capacity_size)
        if knob is not None and (config.sweep_given or knob not in spec.flags):
            sizes = {*config.chunk_sizes, *([spec.flags[knob]] if spec.flags.get(knob) else [])}
            for size in sorted(sizes):
                sized = _with_size(spec, knob, size, device, max_model_len)
                pt.points.append(SizePoint(size, sized, math.inf))
                specs.append(scaler.at(rate, policy=sized))
        tunes.append(pt)
    _check_longer(tunes, scalers, config, sweep)
    flood = ceiling_specs(scalers[0], config.policies[0].engine_flags)
    ceiling = ceiling_of(flood, sweep.run(flood, "throughput ceiling")) if flood else None
    outcomes = iter(sweep.run(specs, "budget sweep"))
    for pt in tunes:
        for point in pt.points:
            _score(point, next(outcomes), config.slo)
        _choose(pt, config.flat_tol)
        # A policy whose budget the user fixed was not swept: its command keeps that budget.
        chosen = pt.best.spec if pt.best is not None else pt.spec
        max_model_len = _max_model_len(pt.spec, model.max_position_embeddings)
        pt.command = command_line(chosen, config.deployment, model_id, device, max_model_len)
    tunes.sort(
        key=lambda t: (
            -t.capacity.rate,
            *((t.best.num_turned_away, t.best.ratio) if t.best else (0, math.inf)),
        )
    )
    return TuneResult(config, rate, tunes, ceiling)


def _check_longer(
    tunes: list[PolicyTune], scalers: list[RateScaler], config: TuneConfig, sweep: Sweep
) -> None:
    """Replay each capacity with twice the requests: a rate whose queue grows slowly meets the
    SLO on a short trace only because the trace ends first, and misses it on a longer one."""
    longer = longer_workload(config.workload)  # every policy's runs share the workload
    if longer is None:
        return
    longer_scaler = RateScaler.of(replace(scalers[0].base, workload=longer))
    checks: list[tuple[PolicyTune, RunSpec]] = []
    for pt, scaler in zip(tunes, scalers):
        if pt.capacity.rate <= 0:
            continue
        pt.longer_label = workload_size(longer)
        checks.append((pt, longer_scaler.at(pt.capacity.rate, policy=scaler.base.policy)))
    for (pt, _), outcome in zip(checks, sweep.run([spec for _, spec in checks], "capacity on 2x requests")):
        if outcome.error is not None:
            continue
        pt.longer_ratio = config.slo.ratio(outcome.summary)
        pt.holds_longer = config.slo.meets(outcome.summary)


def _max_model_len(spec: PolicySpec, model_context: int) -> int:
    # As run_policy sizes it (tune refuses ``hol``, the one workload that raises it).
    return spec.engine_flags.get("max_model_len", model_context)


def _with_size(spec: PolicySpec, knob: str, size: int, device: Any, max_model_len: int) -> PolicySpec:
    """The policy at one budget, with what its engine then requires: vLLM rejects a budget below
    ``max_num_seqs`` (so the cap follows it down), and vLLM V0 without chunked prefill rejects a
    budget below ``max_model_len`` (so smaller budgets switch chunked prefill on), as TensorRT-LLM
    refuses prompts longer than ``max_num_tokens`` without it (likewise)."""
    flags = {**spec.flags, knob: size}
    if spec.name == "trtllm" and size < max_model_len and "enable_chunked_prefill" not in spec.flags:
        # Without chunked prefill TensorRT-LLM refuses prompts longer than max_num_tokens.
        flags["enable_chunked_prefill"] = True
    if spec.name in ("vllm", "vllm-v0"):
        if spec.name == "vllm-v0" and size < max_model_len and "enable_chunked_prefill" not in spec.flags:
            flags["enable_chunked_prefill"] = True
        cls = get_policy_cls(spec.name)
        if "max_num_seqs" not in spec.flags:
            probe = cls.default_config(device, max_model_len, **{k: v for k, v in flags.items() if k != knob})
            flags["max_num_seqs"] = min(probe.max_num_seqs, size)
    return PolicySpec(spec.name, flags, spec.engine_flags)


def _score(point: SizePoint, outcome: RunOutcome, slo: CapacitySlo) -> None:
    if outcome.error is not None:
        point.error = outcome.error
        return
    point.summary = outcome.summary
    point.ratio = slo.ratio(outcome.summary)


def _choose(pt: PolicyTune, flat_tol: float) -> None:
    """The optimum — fewest requests turned away, then the smallest SLO ratio, then the smaller
    size — and the contiguous run of sizes around it that turn away as many and whose ratio is
    within ``flat_tol`` of it."""
    ranked = [i for i, p in enumerate(pt.points) if p.error is None and math.isfinite(p.ratio)]
    if not ranked:
        return
    b = min(ranked, key=lambda i: (pt.points[i].num_turned_away, pt.points[i].ratio))
    pt.best = pt.points[b]

    def flat(p: SizePoint) -> bool:
        assert pt.best is not None
        return (
            p.error is None
            and p.num_turned_away == pt.best.num_turned_away
            and p.ratio <= pt.best.ratio * (1 + flat_tol)
        )

    lo = hi = b
    while lo > 0 and flat(pt.points[lo - 1]):
        lo -= 1
    while hi + 1 < len(pt.points) and flat(pt.points[hi + 1]):
        hi += 1
    pt.flat = (pt.points[lo].size, pt.points[hi].size)


def best_run_specs(result: TuneResult) -> list[RunSpec]:
    """Each policy at its best size at the sweep rate, to run again whole for a report: with the
    batch record (who ran in each iteration) that the attribution of TTFT reads."""
    c = result.config
    options = replace(c.options, record_batches=True)
    return [
        RateScaler.of(RunSpec(c.deployment, c.workload, t.best.spec, c.slo.request)).at(
            result.sweep_rate, options=options, keep_run=True
        )
        for t in result.policies
        if t.best is not None
    ]


def tune_json(result: TuneResult) -> dict[str, Any]:
    c = result.config
    return {
        "slo": str(c.slo),
        "deployment": {"model": c.deployment.model, "hardware": c.deployment.hardware, "tp": c.deployment.tp},
        "workload": c.workload.label,
        "sweep_rate": result.sweep_rate,
        "flat_tol": c.flat_tol,
        "throughput_ceiling": None
        if result.ceiling is None
        else {
            "req_s": result.ceiling.rate,
            "upper_req_s": result.ceiling.upper,
            "policy": result.ceiling.policy,
        },
        "policies": [
            {
                "policy": t.spec.label,
                "capacity_req_s": t.capacity.rate,
                "capacity_upper_req_s": t.capacity.upper,
                "capacity_runs": [{"rate": r, "meets_slo": ok} for r, ok in t.capacity.evaluations],
                "holds_on_longer": t.holds_longer,
                "longer_workload": t.longer_label,
                "longer_slo_ratio": t.longer_ratio
                if t.longer_ratio is None or math.isfinite(t.longer_ratio)
                else None,
                "knob": t.knob,
                "capacity_at_size": t.capacity_size,
                "best_size": t.best.size if t.best else None,
                "flat_region": list(t.flat) if t.flat else None,
                "command": t.command,
                "sweep": [
                    {
                        "size": p.size,
                        "slo_ratio": p.ratio if math.isfinite(p.ratio) else None,
                        "error": p.error,
                        "ttft_p99_s": p.summary.get("metrics", {}).get("ttft_s", {}).get("p99"),
                        "tbt_p99_s": p.summary.get("metrics", {}).get("itl_s", {}).get("p99"),
                        "output_tokens_per_s": p.summary.get("throughput", {}).get("output_tokens_per_s"),
                        "num_turned_away": p.summary.get("num_turned_away"),
                    }
                    for p in t.points
                ],
            }
            for t in result.policies
        ],
    }
