"""Put a simulated deployment together and run a workload through one policy.

deployment (model, hardware, TP, calibration) -> CostModel
policy spec + engine flags                    -> Policy, KVCacheManager (sized like vLLM)
workload spec                                 -> RequestSource (fresh requests every run)
Engine(Scheduler, SimExecutor, source).run()  -> RunResult (requests + iteration log)
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.iteration_log import BatchRecord, IterationLog
from tailserve.core.kv_factory import make_kv_cache
from tailserve.core.radix_kv_cache import RadixKVCacheManager
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.core.source import ListSource, RequestSource
from tailserve.executors.simulated.calibration import (
    PRESETS,
    CalibrationResult,
    calibrate,
    parse_points,
)
from tailserve.executors.simulated.calibration_files import is_calibration_source, load_calibration_source
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.hardware import get_hardware, resolve_hardware_name
from tailserve.executors.simulated.kv_capacity import KVCapacity, kv_capacity
from tailserve.executors.simulated.models import get_model, resolve_model_name
from tailserve.metrics.summary import Slo, prefix_cache_summary, summarize
from tailserve.policies.registry import PolicySpec, get_policy_cls
from tailserve.workloads import builtin, prefix
from tailserve.workloads.arrivals import ArrivalSpec
from tailserve.workloads.lengths import Fixed, LengthDist
from tailserve.workloads.traces import load_trace

SEED_PRESET = PRESETS["seed"]


# ---- deployment ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Deployment:
    """Model, GPU, TP and calibration, with the names resolved to their catalog entries on
    construction: every spelling a user may type (``llama-3-70b``, ``A100``, a Hugging Face id)
    becomes the canonical name here, so defaults, labels, calibration and JSON never see it."""

    model: str = SEED_PRESET.model
    hardware: str = SEED_PRESET.hardware
    tp: int = SEED_PRESET.tp
    calibration: str = "auto"  # "auto", "none", a preset name, or measured points

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", resolve_model_name(self.model))
        object.__setattr__(self, "hardware", resolve_hardware_name(self.hardware))
        keyword = self.calibration.strip().lower()
        if keyword in ("auto", "none") or keyword in PRESETS:
            object.__setattr__(self, "calibration", keyword)
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp}")

    @classmethod
    def of(cls, model: str, hardware: str, tp: int | None = None, calibration: str = "auto") -> Deployment:
        """As the CLI builds one: without a TP, the seed deployment's own (4) for its model and
        GPU, 1 otherwise — decided on the resolved names, whatever the spelling."""
        names = cls(model, hardware, 1, calibration)
        if tp is None:
            tp = SEED_PRESET.tp if names.is_seed else 1
        return cls(names.model, names.hardware, tp, names.calibration)

    @property
    def is_seed(self) -> bool:
        return (self.model, self.hardware) == (SEED_PRESET.model, SEED_PRESET.hardware)

    def resolved_calibration(self) -> str:
        """``auto`` means the seed preset for the seed's model and GPU, the bare roofline otherwise."""
        if self.calibration != "auto":
            return self.calibration
        return SEED_PRESET.name if self.is_seed else "none"


@dataclass(frozen=True, slots=True)
class BuiltCostModel:
    cost_model: CostModel
    calibration: str  # what was applied: "none", a preset name or the points
    fit: CalibrationResult | None = None
    notes: tuple[str, ...] = ()


def build_cost_model(deployment: Deployment) -> BuiltCostModel:
    model = get_model(deployment.model)
    hardware = get_hardware(deployment.hardware)
    base = CostModel(model, hardware, deployment.tp)
    calibration = deployment.resolved_calibration()
    if calibration == "none":
        return BuiltCostModel(base, "none")
    notes: list[str] = []
    if calibration in PRESETS:
        preset = PRESETS[calibration]
        points = parse_points(preset.points)
        # The points were measured at the preset's deployment: fit there, apply here.
        fit_at = CostModel(get_model(preset.model), get_hardware(preset.hardware), preset.tp, preset.base)
        if model.name != preset.model or hardware.name != preset.hardware:
            notes.append(
                f"calibration {preset.name!r} was measured on {preset.model} / {preset.hardware}; "
                f"its efficiencies are applied to {model.name} / {hardware.name}"
            )
    elif is_calibration_source(calibration):  # FILE.json or vidur:DIR
        cm, source_fit, source_notes = load_calibration_source(calibration, model, hardware, deployment.tp)
        return BuiltCostModel(cm, calibration, source_fit, source_notes)
    else:
        points = parse_points(calibration)
        fit_at = base
    fit = calibrate(fit_at, points)
    return BuiltCostModel(base.with_efficiency(fit.efficiency), calibration, fit, tuple(notes))


# ---- workload -----------------------------------------------------------------------------
WORKLOADS = ("hol", "chat", "random", "shared-prefix", "multi-turn")


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    name: str = "hol"  # hol | chat | random | trace
    num_requests: int = 200
    rate: float = 4.0  # requests per second
    seed: int = 0
    input_len: LengthDist = field(default_factory=lambda: Fixed(1024))
    output_len: LengthDist = field(default_factory=lambda: Fixed(128))
    arrival: ArrivalSpec = field(default_factory=lambda: ArrivalSpec("poisson"))
    trace_path: str | None = None
    rate_scale: float = 1.0
    max_requests: int | None = None
    # (priority value, fraction of requests) pairs; empty = every request has priority 0.
    priorities: tuple[tuple[int, float], ...] = ()
    # shared-prefix: system prompts, their length (tokens), the fraction of requests using one
    num_prefixes: int = 4
    prefix_len: int = 1024
    shared_fraction: float = 0.8
    # multi-turn: sessions (started at ``rate`` per second), turns per session, think time (s)
    num_sessions: int = 40
    turns: tuple[int, int] = (2, 6)
    think_time: float = 5.0
    system_prompt_len: int = 256

    def __post_init__(self) -> None:
        if self.name not in (*WORKLOADS, "trace"):
            raise ValueError(
                f"unknown workload {self.name!r}; known: {', '.join(WORKLOADS)} (or --trace PATH)"
            )
        if self.rate <= 0:
            raise ValueError(f"--rate must be > 0 requests/s, got {self.rate}")
        if self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        if self.rate_scale <= 0:
            raise ValueError(f"--rate-scale must be > 0, got {self.rate_scale}")
        # Empty work is an error, not a table of dashes with exit status 0.
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"--max-requests must be >= 1, got {self.max_requests}")
        if self.name == "multi-turn" and self.num_sessions < 1:
            raise ValueError(f"--num-sessions must be >= 1, got {self.num_sessions}")
        if self.priorities and (
            any(f < 0 for _, f in self.priorities) or abs(sum(f for _, f in self.priorities) - 1) > 1e-6
        ):
            raise ValueError(f"--priorities fractions must be >= 0 and sum to 1, got {self.priorities}")

    @property
    def label(self) -> str:
        if self.name == "trace":
            return f"trace {Path(self.trace_path or '').name} (rate x{self.rate_scale:g})"
        if self.name == "hol":
            return "hol (10 decoding requests + one 8,192-token prompt)"
        if self.name == "multi-turn":
            return f"multi-turn ({self.num_sessions} sessions at {self.rate:g}/s, seed {self.seed})"
        if self.name == "shared-prefix":
            return (
                f"shared-prefix ({self.num_requests} requests at {self.rate:g}/s, {self.num_prefixes} x "
                f"{self.prefix_len}-token prompts shared by {self.shared_fraction:.0%}, seed {self.seed})"
            )
        return f"{self.name} ({self.num_requests} requests at {self.rate:g}/s, seed {self.seed})"


def hol_long_arrival(cost_model: CostModel) -> float:
    """When the long prompt of ``hol`` arrives: after the ten 512-token prompts were prefilled one
    512-token chunk at a time (the slowest way any policy here does it) and eight decode steps,
    so every policy has them all decoding by then."""
    return 10 * cost_model.prefill_time(512) + 8 * cost_model.decode_time(10, 520)


class WorkloadBuilder:
    """Builds fresh requests for each run (requests carry mutable progress); parses a trace once."""

    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec
        self._trace: list[Request] | None = None

    @property
    def shares_prefixes(self) -> bool:
        """True when requests carry token ids or prefix block hashes (a Mooncake trace)."""
        if self.spec.name in ("shared-prefix", "multi-turn"):
            return True
        if self.spec.name != "trace":
            return False
        return any(r.prefix_block_hashes or r.prompt_token_ids for r in self._load_trace())

    @property
    def min_max_model_len(self) -> int:
        """The context the workload needs. ``hol``'s 8,192-token prompt plus its 256 outputs
        exceed Llama-3-70B's 8,192-token context, so that scenario raises max_model_len (as
        ``--max-model-len`` with ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`` would in vLLM)."""
        if self.spec.name == "hol":
            return builtin.HOL_LONG_PROMPT_LEN + builtin.HOL_OUTPUT_LEN
        return 0

    def build(self, cost_model: CostModel) -> RequestSource:
        source = self._build(cost_model)
        if self.spec.priorities:
            return PrioritySource(source, self.spec.priorities, self.spec.seed)
        return source

    def _build(self, cost_model: CostModel) -> RequestSource:
        s = self.spec
        if s.name == "hol":
            return ListSource(builtin.hol(hol_long_arrival(cost_model)))
        if s.name == "chat":
            return ListSource(builtin.chat(s.num_requests, s.rate, s.seed))
        if s.name == "random":
            return builtin.synthetic(s.num_requests, s.rate, s.input_len, s.output_len, s.arrival, s.seed)
        if s.name == "shared-prefix":
            return ListSource(
                prefix.shared_prefix(
                    s.num_requests, s.rate, s.num_prefixes, s.prefix_len, s.shared_fraction, seed=s.seed
                )
            )
        if s.name == "multi-turn":
            return ListSource(
                prefix.multi_turn(
                    s.num_sessions,
                    s.turns,
                    s.rate,
                    s.think_time,
                    system_prompt_len=s.system_prompt_len,
                    max_context=cost_model.model.max_position_embeddings,
                    seed=s.seed,
                )
            )
        return ListSource(_fresh(r) for r in self._load_trace())

    def _load_trace(self) -> list[Request]:
        if self._trace is None:
            s = self.spec
            trace = load_trace(s.trace_path or "", rate_scale=s.rate_scale, max_requests=s.max_requests)
            if not trace:
                raise ValueError(f"trace {s.trace_path}: no requests in it (a header and no rows?)")
            self._trace = trace
        return self._trace


class PrioritySource:
    """Gives each request a priority drawn from a seeded mix as it arrives (any workload)."""

    def __init__(self, source: RequestSource, mix: tuple[tuple[int, float], ...], seed: int) -> None:
        self._source = source
        self._values = [v for v, _ in mix]
        self._weights = [f for _, f in mix]
        self._rng = random.Random(seed + 7919)  # its own stream: lengths and arrivals unchanged

    def next_arrival_time(self) -> float | None:
        return self._source.next_arrival_time()

    def pop_arrived(self, now: float) -> list[Request]:
        arrived = self._source.pop_arrived(now)
        for request in arrived:
            request.priority = self._rng.choices(self._values, self._weights)[0]
        return arrived

    def on_finish(self, request: Request, now: float) -> None:
        self._source.on_finish(request, now)

    @property
    def exhausted(self) -> bool:
        return self._source.exhausted


def parse_priorities(text: str) -> tuple[tuple[int, float], ...]:
    """``0=0.8,10=0.2`` -> ((0, 0.8), (10, 0.2)): priority value = fraction of requests."""
    mix = []
    for item in text.split(","):
        value, eq, fraction = item.strip().partition("=")
        try:
            mix.append((int(value), float(fraction)))
        except ValueError:
            raise ValueError(
                f"--priorities item {item!r} is not PRIORITY=FRACTION, e.g. 0=0.8,10=0.2"
            ) from None
        if not eq:
            raise ValueError(f"--priorities item {item!r} is not PRIORITY=FRACTION, e.g. 0=0.8,10=0.2")
    return tuple(mix)


def _fresh(r: Request) -> Request:
    return Request(
        request_id=r.request_id,
        prompt_len=r.prompt_len,
        max_tokens=r.max_tokens,
        arrival_time=r.arrival_time,
        priority=r.priority,
        tenant_id=r.tenant_id,
        prompt_token_ids=r.prompt_token_ids,
        prefix_block_hashes=r.prefix_block_hashes,
        planned_output_token_ids=r.planned_output_token_ids,
    )


# ---- one run ------------------------------------------------------------------------------
@dataclass
class RunResult:
    label: str
    config: dict[str, Any]
    requests: list[Request]
    log: IterationLog
    kv: KVCapacity
    wall_s: float  # seconds the simulation took on this machine
    notes: list[str] = field(default_factory=list)  # how this configuration is simulated
    prefix_stats: dict[str, Any] | None = None  # pool counters when prefix caching ran
    batches: BatchRecord | None = None  # with EngineOptions(record_batches=True)

    def summary(self, slo: Slo | None = None) -> dict[str, Any]:
        out = {"config": self.config, **summarize(self.requests, slo)}
        out["num_iterations"] = len(self.log)
        if self.prefix_stats is not None:
            out["prefix_cache"] = {**prefix_cache_summary(self.requests), **self.prefix_stats}
        return out

    def to_json(self) -> dict[str, Any]:
        """The whole run (``simulate --save-run``): requests with their timestamps, the iteration
        log and the batch record, so ``tailserve explain`` can work on it offline."""
        return {
            "tailserve_run": 1,
            "label": self.label,
            "config": self.config,
            "notes": self.notes,
            "kv": asdict(self.kv),
            "wall_s": self.wall_s,
            "prefix_stats": self.prefix_stats,
            "summary": self.summary(),
            "requests": [_request_json(r) for r in self.requests],
            "iteration_log": {name: getattr(self.log, name) for name in IterationLog.FIELDS},
            "batches": self.batches.to_json() if self.batches is not None else None,
        }


_REQUEST_FIELDS = (
    "request_id", "prompt_len", "max_tokens", "arrival_time", "priority", "num_preemptions",
    "num_cached_tokens", "status_reason", "first_scheduled_time", "token_times", "finish_time",
)  # fmt: skip


def _request_json(r: Request) -> dict[str, Any]:
    return {**{name: getattr(r, name) for name in _REQUEST_FIELDS}, "status": r.status.value}


def load_run(path: str | Path) -> RunResult:
    """A run saved with ``RunResult.to_json``; ValueError naming what is wrong with the file."""
    try:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or data.get("tailserve_run") != 1:
            raise ValueError("not a run saved by tailserve simulate --save-run")
        requests = []
        for item in data["requests"]:
            r = Request(item["request_id"], item["prompt_len"], item["max_tokens"], item["arrival_time"])
            for name in _REQUEST_FIELDS[4:]:
                setattr(r, name, item[name])
            r.status = RequestStatus(item["status"])
            r.num_output_tokens = len(r.token_times)
            requests.append(r)
        log = IterationLog(data["kv"]["num_blocks"])
        for name in IterationLog.FIELDS:
            getattr(log, name).extend(data["iteration_log"][name])
        batches = BatchRecord.from_json(data["batches"]) if data.get("batches") else None
        return RunResult(
            data["label"],
            data["config"],
            requests,
            log,
            KVCapacity(**data["kv"]),
            data["wall_s"],
            data["notes"],
            data["prefix_stats"],
            batches,
        )
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    except KeyError as e:
        raise ValueError(
            f"{path}: no field {e} (expected a run saved by tailserve simulate --save-run)"
        ) from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


def policy_kv_capacity(
    cost_model: CostModel, spec: PolicySpec, config: Any, max_model_len: int
) -> KVCapacity:
    """KV blocks a policy's engine gets on the simulated deployment (its block size and memory
    fraction, activation reserve for its largest batch); ValueError, with vLLM's message, when
    one full-length sequence would not fit."""
    cls = get_policy_cls(spec.name)
    model, hardware = cost_model.model, cost_model.hardware
    capacity = kv_capacity(
        model,
        hardware,
        cost_model.tp,
        spec.engine_flags.get("gpu_memory_utilization", cls.default_gpu_memory_utilization),
        spec.engine_flags.get("block_size", cls.default_block_size),
        cls.profile_tokens(config, max_model_len),
    )
    if capacity.num_tokens < max_model_len:
        raise ValueError(
            f"The model's max seq len ({max_model_len}) is larger than the maximum number of tokens "
            f"that can be stored in KV cache ({capacity.num_tokens}) for {model.name} on "
            f"{hardware.name} at TP {cost_model.tp}. Try increasing gpu_memory_utilization or "
            "decreasing max_model_len."
        )
    return capacity


def run_policy(
    built: BuiltCostModel,
    spec: PolicySpec,
    workload: WorkloadBuilder,
    *,
    options: EngineOptions = EngineOptions(),
) -> RunResult:
    cost_model = built.cost_model
    cls = get_policy_cls(spec.name)
    hardware = cost_model.hardware
    model = cost_model.model
    max_model_len = spec.engine_flags.get(
        "max_model_len", max(model.max_position_embeddings, workload.min_max_model_len)
    )
    config = cls.default_config(hardware.device_info, max_model_len, **spec.flags)
    policy = cls(config)
    capacity = policy_kv_capacity(cost_model, spec, config, max_model_len)
    swap_gib = getattr(config, "swap_space", 0.0)  # vLLM V0 --swap-space, GiB per GPU
    num_cpu_blocks = int(swap_gib * 2**30 // (capacity.block_size * capacity.kv_bytes_per_token))
    # Prefix caching needs token identities; a workload of bare lengths could never share.
    # vLLM hashes blocks into its block pool; SGLang keeps a radix tree beside its slots.
    kv = make_kv_cache(
        config, capacity.num_blocks, capacity.block_size, num_cpu_blocks, workload.shares_prefixes
    )
    prefix_caching = kv.pool is not None
    radix = isinstance(kv, RadixKVCacheManager)
    scheduler = Scheduler(policy, kv, max_model_len)
    executor = SimExecutor(cost_model, capacity.block_size)
    engine = Engine(scheduler, executor, workload.build(cost_model), options=options)
    t0 = time.perf_counter()
    engine.run()
    wall = time.perf_counter() - t0
    if not engine.requests:
        raise ValueError(f"workload {workload.spec.label}: no requests arrived, nothing to simulate")
    run_config = {
        "policy": spec.name,
        "policy_flags": asdict(config),
        "model": model.name,
        "hardware": hardware.name,
        "tp": cost_model.tp,
        "calibration": built.calibration,
        "efficiency": asdict(cost_model.efficiency),
        "max_model_len": max_model_len,
        "block_size": capacity.block_size,
        "num_kv_blocks": capacity.num_blocks,
        "kv_cache_gib": round(capacity.kv_gib, 3),
        "workload": workload.spec.label,
        "seed": workload.spec.seed,
    }
    label = spec.label
    budget_flag = getattr(config, "max_num_batched_tokens", None)
    if budget_flag is not None and "max_num_batched_tokens" not in spec.flags:
        label += f" (default budget {budget_flag})"
    run_config["prefix_caching"] = prefix_caching or radix
    prefix_stats = None
    if kv.pool is not None:
        prefix_stats = {"evicted_tokens": kv.pool.stats.num_evicted_tokens}
    elif radix:
        tree = getattr(kv, "tree", None)
        prefix_stats = {"evicted_tokens": tree.stats.num_evicted_tokens if tree is not None else 0}
    notes = list(policy.notes())
    if (
        workload.spec.name == "hol"
        and "max_model_len" not in spec.engine_flags
        and model.max_position_embeddings < builtin.HOL_LONG_PROMPT_LEN
    ):
        notes.insert(
            0,
            f"hol's {builtin.HOL_LONG_PROMPT_LEN:,}-token prompt is longer than {model.name}'s "
            f"{model.max_position_embeddings:,}-token context; max_model_len is raised to "
            f"{max_model_len:,} for it (as vLLM with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1), which the "
            "model was not trained for",
        )
    return RunResult(
        label,
        run_config,
        engine.requests,
        engine.log,
        capacity,
        wall,
        notes,
        prefix_stats,
        engine.batches,
    )
