"""Independent simulation runs, fanned out over a local process pool, run serially, or on Ray.

A ``RunSpec`` (deployment, workload with its seed, policy with its flags, SLO) fully determines
its run (another kind of run with the same surface, ``SweepSpec``, rides the same backends:
``tune/cluster_plan.ClusterRunSpec``, a cluster layout): the simulator is deterministic, so every backend gives identical results for the same
specs. Runs come back as ``RunOutcome``: the compact summary (metric dicts, a few kB) unless the
caller asks for the whole ``RunResult`` (``keep_run``: requests and iteration log, several MB for
a long trace) because its output reads per-request timestamps.

Finished runs are appended to a results file, one JSON line each keyed by ``RunSpec.key`` (a hash
of the spec), the moment they finish; a later sweep over the same file reuses them, so an
interrupted sweep resumes where it stopped.

``Sweep.drive`` runs several *searches* at once: generators that yield a ``RunSpec``, receive its
``RunOutcome`` and finally return a value (a bisection that picks its next rate from the last
result). Each search has one run in flight; the backend runs as many searches' runs at a time as
it has workers.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

from tailserve import __version__
from tailserve.core.engine import EngineOptions
from tailserve.core.request import RequestStatus
from tailserve.executors.simulated.deployment import BuiltCostModel, Deployment, build_cost_model
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.pipeline import resolved_stage_link
from tailserve.metrics.summary import Slo
from tailserve.policies.registry import PolicySpec
from tailserve.sim.run import run_policy
from tailserve.sim.run_file import RunResult
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.tune.backends import Backend, ProcessBackend, RayBackend, SerialBackend, make_backend
from tailserve.tune.progress import SweepProgress

__all__ = [
    "Backend",
    "ProcessBackend",
    "RayBackend",
    "ResultsFile",
    "RunOutcome",
    "RunSpec",
    "SerialBackend",
    "Sweep",
    "SweepSpec",
    "execute",
    "make_backend",
]

T = TypeVar("T")
Search = Generator["SweepSpec", "RunOutcome", T]
RESULTS_FORMAT = 1  # bump when a summary's meaning changes: old results files then stop matching


@dataclass(frozen=True, slots=True)
class RunSpec:
    deployment: Deployment
    workload: WorkloadSpec  # carries the seed
    policy: PolicySpec
    slo: Slo | None = None  # adds goodput to the summary
    options: EngineOptions = field(default_factory=EngineOptions)  # speed only: not in the key
    keep_run: bool = False  # bring the whole RunResult back, not only its summary

    def describe(self) -> dict[str, Any]:
        """Everything that decides the run's result, as plain JSON values."""
        workload = _plain(self.workload)
        if self.workload.trace_path:
            # The same file by any relative path matches; a trace edited in place does not.
            path = Path(self.workload.trace_path).resolve()
            stat = path.stat()
            workload["trace_path"] = str(path)
            workload["trace_file"] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        return {
            "format": RESULTS_FORMAT,
            "tailserve": __version__,
            "deployment": deployment_plain(self.deployment),
            "workload": workload,
            "policy": {"name": self.policy.name, **self.policy.flags, **self.policy.engine_flags},
            "slo": _plain(self.slo),
        }

    @property
    def key(self) -> str:
        return spec_key(self.describe())

    def execute(self) -> RunOutcome:
        return _execute_engine(self)


class SweepSpec(Protocol):
    """What a sweep runs: everything that decides the result in ``describe`` (hashed to ``key``),
    and ``execute``, which runs it in whatever process the backend chose (the spec pickles)."""

    keep_run: bool

    @property
    def key(self) -> str: ...

    def describe(self) -> dict[str, Any]: ...

    def execute(self) -> RunOutcome: ...


def spec_key(describe: dict[str, Any]) -> str:
    text = json.dumps(describe, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


# Deployment fields added after results files existed: left out at their defaults, so a run
# described before they existed keeps its key (a results file resumes)
_LATER_DEPLOYMENT_FIELDS = {
    "expert_imbalance": 0.0,
    "enable_eplb": False,
    "num_redundant_experts": 0,
    "expert_imbalance_ep": 0,
    "pp": 1,
}


def deployment_plain(deployment: Any) -> dict[str, Any]:
    """``_plain`` of a deployment, without the fields at their defaults that were added later."""
    out = _plain(deployment)
    for name, default in _LATER_DEPLOYMENT_FIELDS.items():
        if out.get(name) == default:
            del out[name]
    # The link between the stages, resolved ("nvlink" or the network), under a name of its own:
    # until 2026-12-06 a --pp-link inside one NVLink domain meant NVLink, so a key saying
    # "pp_link" may hold a run over another link than it names (pipeline.py's stage_link).
    link = out.pop("pp_link", "auto")
    if out.get("pp", 1) > 1:
        domain = get_hardware(deployment.hardware).nvlink_domain
        out["stage_link"] = resolved_stage_link(domain, deployment.tp, deployment.pp, link)
    return out


def _plain(value: Any) -> Any:
    """Dataclasses to dicts that name their class (Fixed(512) and Uniform(512, 512) differ)."""
    if is_dataclass(value) and not isinstance(value, type):
        return {"type": type(value).__name__} | {
            f.name: _plain(getattr(value, f.name)) for f in fields(value)
        }
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@dataclass(slots=True)
class RunOutcome:
    key: str
    label: str
    summary: dict[str, Any]  # RunResult.summary(slo) plus ``num_turned_away``; {} on error
    wall_s: float  # seconds the simulation took where it ran
    run: RunResult | None = None  # only with RunSpec.keep_run
    error: str | None = None  # the ValueError a bad spec raised (unknown flag, model too big, ...)
    reused: bool = False  # read from the results file, not run now
    # CPU seconds of the whole spec where it ran (workload, engine, run, summary), its thread's
    # alone: against wall_s it shows a run slowed by other processes on the same cores.
    cpu_s: float = 0.0

    def to_json(self, spec: SweepSpec) -> dict[str, Any]:
        return {
            "key": self.key,
            "label": self.label,
            "wall_s": self.wall_s,
            "cpu_s": self.cpu_s,
            "spec": spec.describe(),
            "summary": self.summary,
        }


# ---- one run, wherever it executes --------------------------------------------------------
# Per-process memos: a pool worker runs many specs with the same deployment (the calibration fit)
# and the same workload (the parsed trace). Both are pure; builders hand out fresh requests.
@lru_cache(maxsize=8)
def _cost_model(deployment: Deployment) -> BuiltCostModel:
    return build_cost_model(deployment)  # its kernels resolved (Deployment.for_policy)


@lru_cache(maxsize=4)
def _workload(spec: WorkloadSpec) -> WorkloadBuilder:
    return WorkloadBuilder(spec)


def execute(spec: SweepSpec) -> RunOutcome:
    """Run one spec where the backend put it (a module-level function: it pickles)."""
    started = time.thread_time()
    outcome = spec.execute()
    outcome.cpu_s = time.thread_time() - started
    return outcome


def _execute_engine(spec: RunSpec) -> RunOutcome:
    """Run one engine. A ValueError (bad flag, model that does not fit) comes back as ``error``, so
    every backend reports it the same way; anything else is a bug and propagates."""
    try:
        run = run_policy(
            _cost_model(spec.deployment.for_policy(spec.policy.name)),
            spec.policy,
            _workload(spec.workload),
            options=spec.options,
        )
    except ValueError as e:
        return RunOutcome(spec.key, spec.policy.label, {}, 0.0, error=str(e))
    summary = run.summary(spec.slo)
    summary["num_turned_away"] = num_turned_away(run)
    summary["last_admission_s"] = last_admission_s(run)
    return RunOutcome(spec.key, run.label, summary, run.wall_s, run if spec.keep_run else None)


def num_turned_away(run: RunResult) -> int:
    """Requests a policy refused although they fit the model (TGI's ``max_concurrent_requests``
    backpressure), as opposed to prompts longer than ``max_model_len``, refused at any rate."""
    limit = min(run.config["max_model_len"], run.config["num_kv_blocks"] * run.config["block_size"])
    return sum(
        1
        for r in run.requests
        if r.status is RequestStatus.FINISHED_REJECTED and r.prompt_len + r.max_tokens <= limit
    )


def last_admission_s(run: RunResult) -> float | None:
    """Seconds from the first arrival to the last finished request's first admission: with every
    request queued at once, how long the engine took to start them all (``ceiling.py``)."""
    if run.finished is not None:
        admitted = np.frombuffer(run.finished.first_scheduled_time, dtype=np.float64)
        last = float(admitted.max()) if admitted.size else None
        first = run.finished.first_arrival or 0.0
    else:
        done = (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
        times = [r.first_scheduled_time for r in run.requests if r.status in done]
        last = max((t for t in times if t is not None), default=None)
        first = min((r.arrival_time for r in run.requests), default=0.0)
    return None if last is None else last - first


# ---- results file -------------------------------------------------------------------------
class ResultsFile:
    """JSON lines of finished runs, keyed by spec; appended and flushed as each run finishes."""

    def __init__(self, path: str | Path, *, resume: bool = True) -> None:
        self.path = Path(path)
        self._done: dict[str, dict[str, Any]] = {}
        if resume and self.path.exists():
            self._load()
        elif not resume:
            self.path.unlink(missing_ok=True)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _load(self) -> None:
        lines = self.path.read_text().splitlines()
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                self._done[row["key"]] = row
            except (json.JSONDecodeError, KeyError, TypeError):
                if number == len(lines):
                    break  # the line being written when the sweep was interrupted
                raise ValueError(
                    f"{self.path}:{number}: not a results line (expected JSON with a 'key'); "
                    "pass another --out or --no-resume"
                ) from None

    def __len__(self) -> int:
        return len(self._done)

    def rows(self) -> list[dict[str, Any]]:
        """Every finished run's line, as read or written."""
        return list(self._done.values())

    def get(self, key: str) -> RunOutcome | None:
        row = self._done.get(key)
        if row is None:
            return None
        return RunOutcome(
            key, row["label"], row["summary"], row["wall_s"], reused=True, cpu_s=row.get("cpu_s", 0.0)
        )

    def append(self, spec: SweepSpec, outcome: RunOutcome) -> None:
        row = outcome.to_json(spec)
        self._done[outcome.key] = row
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


# ---- the sweep ----------------------------------------------------------------------------
@dataclass
class Sweep:
    """Runs specs and searches on a backend, with an optional results file and a progress bar
    (on stderr, only when it is a terminal and not ``quiet``)."""

    backend: Backend
    results: ResultsFile | None = None
    quiet: bool = False
    num_executed: int = 0
    num_reused: int = 0
    _memo: dict[str, RunOutcome] = field(default_factory=dict)

    def __enter__(self) -> Sweep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.backend.close()

    def run(self, specs: Sequence[SweepSpec], description: str = "runs") -> list[RunOutcome]:
        """Every spec's outcome, in the order of ``specs`` whatever order they finish in."""
        return self.drive([_single(spec) for spec in specs], description)

    def drive(self, searches: Sequence[Search[T]], description: str = "runs") -> list[T]:
        """Run searches side by side; return each one's value, in order."""
        values: list[Any] = [None] * len(searches)
        waiting: dict[str, list[tuple[int, SweepSpec]]] = {}  # key -> searches waiting for it
        num_runs = 0
        with self._progress(description) as (progress, task):

            def advance(i: int, outcome: RunOutcome | None) -> None:
                nonlocal num_runs
                while True:
                    try:
                        spec = next(searches[i]) if outcome is None else searches[i].send(outcome)
                    except StopIteration as stop:
                        values[i] = stop.value
                        return
                    num_runs += 1
                    progress.update(task, total=num_runs)
                    outcome = self._known(spec)
                    if outcome is not None:
                        progress.advance(task)
                        continue
                    if spec.key not in waiting:
                        self.backend.submit(spec)
                    waiting.setdefault(spec.key, []).append((i, spec))
                    return

            for i in range(len(searches)):
                advance(i, None)
            while waiting:
                for outcome in self.backend.wait():
                    waiters = waiting.pop(outcome.key)
                    self._record(waiters[0][1], outcome)
                    for i, _ in waiters:
                        progress.advance(task)
                        advance(i, outcome)
        return values

    def _known(self, spec: SweepSpec) -> RunOutcome | None:
        if spec.keep_run:
            return None  # the results file holds summaries only
        outcome = self._memo.get(spec.key)
        if outcome is None and self.results is not None:
            outcome = self.results.get(spec.key)
            if outcome is not None:
                self.num_reused += 1
                self._memo[spec.key] = outcome
        return outcome

    def _record(self, spec: SweepSpec, outcome: RunOutcome) -> None:
        self.num_executed += 1
        if outcome.error is None:
            # A kept run (every request and iteration) is never reused (``_known``); memoizing it
            # would hold every run of a long sweep in memory (a 9-cell capacity table: 23 GB).
            if not spec.keep_run:
                self._memo[spec.key] = outcome
            if self.results is not None:
                self.results.append(spec, outcome)

    def _progress(self, description: str) -> SweepProgress:
        return SweepProgress(description, disable=self.quiet or not sys.stderr.isatty())


def _single(spec: SweepSpec) -> Search[RunOutcome]:
    return (yield spec)
