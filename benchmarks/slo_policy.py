"""``slo`` against the best tuned configuration of every engine, and VTC fairness.

Capacity (Sarathi-Serve's measure: the highest arrival rate whose p99 TTFT and p99 TBT meet the
SLO, found by ``tailserve.tune.capacity``'s bracketing + bisection, every rate replaying the same
requests) for each deployment x workload cell:

- engines, each tuned on its budget flag (``tailserve tune``'s knob and ladder, 128 ... 16,384
  tokens, with tune's adjustments: vLLM's ``max_num_seqs`` follows a smaller budget down): a
  coarse grid first (vllm ``max_num_batched_tokens`` 512/2,048/8,192, sarathi ``chunk_size``
  256/512/1,024, sglang ``chunked_prefill_size`` 2,048/8,192, tgi ``max_batch_prefill_tokens``
  4,096; on the mixed workload also vllm ``scheduling_policy=priority`` at 512/2,048), then up
  to three rounds of the untried ladder neighbours of each engine's best so far (and sglang
  ``schedule_policy=lpm`` at its best) until every best is a local optimum on the ladder; the
  best capacity of all is kept;
- ``slo`` with the cell's SLO as its classes (its defaults otherwise).

``--families`` limits the engines tuned (vllm and sarathi were the best in every cell of the full
table at 1,000 requests; sglang and tgi stayed 20-76% below).

Each search also records what failed at the lowest failing rate (the binding limit: which
class's p99 TTFT or p99 TBT went past its target, or requests turned away), and the best engine's
and ``slo``'s capacities are replayed with twice the requests (does the rate hold on a longer
trace?). The workloads have 4x the requests of the first version of this table (``--scale``):
on 1,000 Azure / 500 Mooncake requests the capacities were partly transients of the short traces
(Mooncake's halved at 4x).

A cell's SLO: TBT target ``T`` = 5 x one decode iteration of 32 requests at 1,024 tokens on that
deployment, rounded up to 10 ms (Sarathi's "strict" SLO scale); TTFT 2 s (Azure), 6 s (Mooncake,
whose prompts are ~7k tokens). The mixed workload has two classes, 70% interactive (priority 0:
TTFT 1 s, TBT T) and 30% batch (priority 1: TTFT 30 s, TBT 4T), and a rate meets it when *each
class* meets its own p99 bounds. Goodput: requests/s meeting their class's TTFT and TPOT (<= TBT
target) at 1.25x the best engine's capacity, for the best engine, ``slo`` and ``slo`` with
``slo_admission=reject`` (turned-away requests count as not good).

Fairness (Llama-3-8B / H100): tenant ``light`` at a fixed rate, ``heavy`` at 10x it (far past
capacity). The light tenant's p99 TTFT with heavy present against its solo run, under fcfs (vllm,
slo) and VTC (vllm + fairness=vtc, slo + fairness=vtc). Then two tenants both backlogged (both
past capacity, different lengths): the largest measured difference of weighted service
(``w_p`` x prefill + ``w_q`` x decode tokens) over any interval in which both stay backlogged,
against the paper's bound ``2 max(w_p L_input, w_q M)``.

    python -m benchmarks.slo_policy [--quick] [--workers N] [--cells MODEL/WORKLOAD,...]
        [--scale K] [--families vllm,sarathi,...] [--slo-flags F=V;...] [--fairness-seeds 1,2,3]
        [--slo-variants F=V;...,...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Generator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import check_trace, cpu_line, default_out, default_trace, simd_flags
from benchmarks._slo_cpu import cpu_comparison
from benchmarks._slo_fairness import fairness
from tailserve.core.request import Request, RequestStatus
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.policies.registry import PolicySpec
from tailserve.policies.slo_classes import parse_slo_classes
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.tune.capacity import RateScaler, capacity_steps, longer_workload
from tailserve.tune.ceiling import ceiling_of, ceiling_specs
from tailserve.tune.recommend import DEFAULT_CHUNK_SIZES, KNOBS, _with_size
from tailserve.tune.sweep import RunOutcome, RunSpec, Sweep, make_backend
from tailserve.workloads.lengths import LogNormal

DEPLOYMENTS = (("Llama-3-8B", "H100-SXM", 1), ("Llama-3-70B", "A100-80GB", 4), ("Mistral-7B", "A100-80GB", 1))
# (policy, fixed flags) -> the coarse grid of its budget knob (tune's KNOBS).
COARSE: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[int, ...]] = {
    ("vllm", ()): (512, 2048, 8192),
    ("sarathi", ()): (256, 512, 1024),
    ("sglang", ()): (2048, 8192),
    ("tgi", ()): (4096,),
}
PRIORITY = ("vllm", (("scheduling_policy", "priority"),))
PRIORITY_COARSE = (512, 2048)
REL_TOL = 0.05
MAX_REFINEMENTS = 3  # rounds of ladder neighbours after the coarse grid


# ---- cells --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    deployment: Deployment
    workload_name: str
    workload: WorkloadSpec
    classes: str  # the slo policy's classes = the SLO the cell is judged by
    mixed: bool


def tbt_target(deployment: Deployment) -> float:
    cost = build_cost_model(deployment).cost_model
    return math.ceil(5 * cost.decode_time(32, 1024) * 100) / 100


def cells(quick: bool, azure: str, mooncake: str, scale: int = 1) -> list[Cell]:
    """The nine cells (three with ``quick``); ``scale`` multiplies every workload's requests."""
    n = (400 if quick else 1000) * scale
    out = []
    for model, gpu, tp in DEPLOYMENTS[:1] if quick else DEPLOYMENTS:
        d = Deployment.of(model, gpu, tp)
        t = tbt_target(d)
        tb = f"{t * 1000:g}ms"
        out.append(
            Cell(
                d,
                "azure-conv",
                WorkloadSpec("trace", trace_path=azure, max_requests=n),
                f"all=ttft:2s,tbt:{tb}",
                False,
            )
        )
        out.append(
            Cell(
                d,
                "mooncake-conv",
                WorkloadSpec("trace", trace_path=mooncake, max_requests=n // 2),
                f"all=ttft:6s,tbt:{tb}",
                False,
            )
        )
        mixed = WorkloadSpec(
            "random",
            num_requests=n,
            rate=4.0,
            input_len=LogNormal(1024, 1.0, 6000),
            output_len=LogNormal(200, 0.8, 1500),
            priorities=((0, 0.7), (1, 0.3)),
        )
        classes = f"interactive=ttft:1s,tbt:{tb},priority:0 batch=ttft:30s,tbt:{4 * t * 1000:g}ms,priority:1"
        out.append(Cell(d, "mixed", mixed, classes, True))
    return out


def _engine_flags(cell: Cell) -> dict[str, Any]:
    # Mooncake prompts reach 126k tokens: every deployment serves an 8,192-token context (the
    # Llama-3 models' own), so the same requests are refused at any rate everywhere.
    return {"max_model_len": 8192} if cell.workload_name == "mooncake-conv" else {}


def sized(cell: Cell, family: tuple[str, tuple[tuple[str, str], ...]], size: int, **extra: str) -> PolicySpec:
    """An engine at one budget, as ``tailserve tune`` sets it."""
    name, fixed = family
    spec = PolicySpec.make(name, {**dict(fixed), **extra, **_engine_flags(cell)})
    model = get_model(cell.deployment.model)
    device = get_hardware(cell.deployment.hardware).device_info
    max_model_len = spec.engine_flags.get("max_model_len", model.max_position_embeddings)
    return _with_size(spec, KNOBS[name], size, device, max_model_len)


def families(
    cell: Cell, only: frozenset[str] | None = None
) -> dict[tuple[str, tuple[tuple[str, str], ...]], tuple[int, ...]]:
    """The engine families tuned on ``cell`` (those named in ``only``, vllm's priority
    scheduling with vllm)."""
    fams = {**COARSE, PRIORITY: PRIORITY_COARSE} if cell.mixed else dict(COARSE)
    return {f: sizes for f, sizes in fams.items() if only is None or f[0] in only}


def coarse_candidates(
    cell: Cell, slo_flags: dict[str, str] | None = None, only: frozenset[str] | None = None
) -> list[PolicySpec]:
    """Every engine family at its coarse sizes, then ``slo`` (last; ``slo_flags`` on top)."""
    specs = [sized(cell, fam, n) for fam, sizes in families(cell, only).items() for n in sizes]
    specs.append(
        PolicySpec.make("slo", {"slo_classes": cell.classes, **_engine_flags(cell), **(slo_flags or {})})
    )
    return specs


def refined_candidates(
    cell: Cell, found: dict[str, dict[str, Any]], only: frozenset[str] | None = None
) -> list[PolicySpec]:
    """Each family's ladder neighbours of its best size so far that were not tried yet, and
    sglang's lpm at its best; empty once every best is a local optimum on the ladder."""
    specs = []
    for fam in families(cell, only):
        tried = [n for n in DEFAULT_CHUNK_SIZES if sized(cell, fam, n).label in found]
        best = max(tried, key=lambda n: found[sized(cell, fam, n).label]["capacity"])
        i = DEFAULT_CHUNK_SIZES.index(best)
        for j in (i - 1, i + 1):
            if 0 <= j < len(DEFAULT_CHUNK_SIZES) and DEFAULT_CHUNK_SIZES[j] not in tried:
                specs.append(sized(cell, fam, DEFAULT_CHUNK_SIZES[j]))
        if fam[0] == "sglang":
            lpm = sized(cell, fam, best, schedule_policy="lpm")
            if lpm.label not in found:
                specs.append(lpm)
    return specs


# ---- the SLO check ------------------------------------------------------------------------
def class_report(requests: list[Request], classes: str) -> dict[str, dict[str, float | None]]:
    """Per SLO class: p99 TTFT, p99 TBT (every gap), requests turned away, and good requests
    (TTFT and TPOT within the class's targets)."""
    parsed = parse_slo_classes(classes)
    out: dict[str, dict[str, float | None]] = {}
    for c in parsed.classes:
        mine = [r for r in requests if parsed.of(r).name == c.name]
        done = [
            r for r in mine if r.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
        ]
        ttft = [r.token_times[0] - r.arrival_time for r in done]
        gaps = np.concatenate([np.diff(r.token_times) for r in done]) if done else np.array([])
        good = sum(
            1
            for r in done
            if r.token_times[0] - r.arrival_time <= c.ttft
            and (
                len(r.token_times) < 2
                or (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) <= c.tbt
            )
        )
        out[c.name] = {
            "num": len(mine),
            "ttft_p99": float(np.percentile(ttft, 99)) if ttft else None,
            "tbt_p99": float(np.percentile(gaps, 99)) if gaps.size else None,
            "turned_away": sum(1 for r in mine if r.status is RequestStatus.FINISHED_REJECTED),
            "good": good,
            "ttft_target": c.ttft,
            "tbt_target": c.tbt,
        }
    return out


def meets(report: dict[str, dict[str, Any]]) -> bool:
    for c in report.values():
        if c["num"] == 0:
            continue
        if c["ttft_p99"] is None or c["ttft_p99"] > c["ttft_target"] or c["turned_away"]:
            return False
        if c["tbt_p99"] is not None and c["tbt_p99"] > c["tbt_target"]:
            return False
    return True


def _served(outcome: RunOutcome) -> list[Request]:
    assert outcome.run is not None, outcome.error
    # Prompts longer than the model's context are refused at any rate: not the policy's doing.
    limit = min(
        outcome.run.config["max_model_len"],
        outcome.run.config["num_kv_blocks"] * outcome.run.config["block_size"],
    )
    return [r for r in outcome.run.requests if r.prompt_len + r.max_tokens <= limit]


def binding(report: dict[str, dict[str, Any]]) -> list[str]:
    """What a failing rate failed on, per class: "ttft 2.9 s > 2 s", "tbt 61 ms > 50 ms", ..."""
    out = []
    for name, c in report.items():
        if c["num"] == 0:
            continue
        if c["ttft_p99"] is None or c["ttft_p99"] > c["ttft_target"]:
            out.append(f"{name} ttft p99 {c['ttft_p99'] or math.inf:.2f} s > {c['ttft_target']:g} s")
        if c["tbt_p99"] is not None and c["tbt_p99"] > c["tbt_target"]:
            out.append(f"{name} tbt p99 {c['tbt_p99'] * 1e3:.0f} ms > {c['tbt_target'] * 1e3:g} ms")
        if c["turned_away"]:
            out.append(f"{name} {c['turned_away']} turned away")
    return out


def search(cell: Cell, spec: PolicySpec) -> Generator[RunSpec, RunOutcome, dict[str, Any]]:
    scaler = RateScaler.of(RunSpec(cell.deployment, cell.workload, spec, keep_run=True))
    steps = capacity_steps(scaler.rate, scaler.rate, REL_TOL)
    tried: dict[float, dict[str, Any]] = {}
    try:
        rate = next(steps)
        while True:
            outcome = yield scaler.at(rate)
            if outcome.error is not None:
                raise ValueError(f"{spec.label}: {outcome.error}")
            report = class_report(_served(outcome), cell.classes)
            tried[rate] = report
            rate = steps.send(meets(report))
    except StopIteration as stop:
        capacity = stop.value
    failed = tried.get(capacity.upper) if capacity.upper is not None else None
    met = tried.get(capacity.rate)
    return {
        "policy": spec.label,
        "capacity": capacity.rate,
        "upper": capacity.upper,
        "runs": len(tried),
        "fails_on": binding(failed) if failed is not None else None,
        "at_capacity": met,
        "at_upper": failed,
    }


def sustained(cell: Cell, spec: PolicySpec, rate: float) -> Generator[RunSpec, RunOutcome, dict[str, Any]]:
    """The capacity replayed with twice the cell's requests: a rate whose queue grows slowly
    (decodes piling up under a loose TBT bound, a batch class's 30 s of TTFT) meets the SLO on
    a short trace only because the trace ends first, and misses it on a longer one."""
    longer = longer_workload(cell.workload)
    if longer is None:
        raise ValueError(f"{cell.workload_name}: the trace has no more requests to check with")
    scaler = RateScaler.of(RunSpec(cell.deployment, longer, spec, keep_run=True))
    outcome = yield scaler.at(rate)
    if outcome.error is not None:
        raise ValueError(f"{spec.label}: {outcome.error}")
    report = class_report(_served(outcome), cell.classes)
    return {
        "policy": spec.label,
        "rate": rate,
        "workload": longer.label,
        "meets": meets(report),
        "fails_on": binding(report),
    }


def ceiling_run(cell: Cell) -> Generator[RunSpec, RunOutcome, dict[str, Any]]:
    """The deployment's throughput ceiling on the cell's requests (``tailserve.tune.ceiling``:
    all of them queued at once, the best of vLLM's budgets): the rate it completes them at (the
    drain at the end counted: low), the rate at which it had started them all (high), and between
    them a steady-state estimate — admissions per second over the last three quarters of them,
    once the first fill of the KV cache is past (every admission then waits for a finished
    request, so admissions run at the completion rate)."""
    scaler = RateScaler.of(RunSpec(cell.deployment, cell.workload, sized(cell, ("vllm", ()), 2048)))
    specs = [replace(s, keep_run=True) for s in ceiling_specs(scaler, _engine_flags(cell))]
    outcomes = []
    for spec in specs:
        outcomes.append((yield spec))
    ceiling = ceiling_of(specs, outcomes)
    assert ceiling is not None, [o.error for o in outcomes]
    steady = 0.0
    for o in outcomes:
        assert o.run is not None
        admitted = np.sort(
            [r.first_scheduled_time for r in o.run.requests if r.first_scheduled_time is not None]
        )
        k = admitted.size // 4
        # Refused requests count in the workload's rate: scaled to all of them.
        steady = max(
            steady, (admitted.size - k) / (admitted[-1] - admitted[k]) * len(o.run.requests) / admitted.size
        )
    return {"rate": ceiling.rate, "upper": ceiling.upper, "steady_estimate": steady, "policy": ceiling.policy}


def goodput_run(cell: Cell, spec: PolicySpec, rate: float) -> Generator[RunSpec, RunOutcome, dict[str, Any]]:
    scaler = RateScaler.of(RunSpec(cell.deployment, cell.workload, spec, keep_run=True))
    outcome = yield scaler.at(rate)
    requests = _served(outcome)
    report = class_report(requests, cell.classes)
    span = max(r.finish_time or 0.0 for r in requests) - min(r.arrival_time for r in requests)
    good = sum(c["good"] for c in report.values())
    return {"policy": spec.label, "rate": rate, "goodput": good / span, "fraction_good": good / len(requests)}


def cell_filter(text: str) -> set[tuple[str, str]]:
    """``--cells`` -> {(model, workload)}; SystemExit naming an item that is no cell."""
    known = {(m, w) for m, _, _ in DEPLOYMENTS for w in ("azure-conv", "mooncake-conv", "mixed")}
    wanted = set()
    for item in (i.strip() for i in text.split(",")):
        model, _, workload = item.partition("/")
        if (model, workload) not in known:
            names = ", ".join(f"{m}/{w}" for m, w in sorted(known))
            raise SystemExit(f"--cells: {item!r} is not a cell; cells: {names}")
        wanted.add((model, workload))
    return wanted


def capacity_table(
    sweep: Sweep,
    quick: bool,
    azure: str,
    mooncake: str,
    partial: Path,
    wanted: set[tuple[str, str]] | None = None,
    slo_flags: dict[str, str] | None = None,
    scale: int = 1,
    only: frozenset[str] | None = None,
) -> list[dict[str, Any]]:
    """Every cell's row (or those in ``wanted``); the rows so far are rewritten to ``partial``
    after each cell."""
    rows: list[dict[str, Any]] = []
    for cell in cells(quick, azure, mooncake, scale):
        if wanted is not None and (cell.deployment.model, cell.workload_name) not in wanted:
            continue
        t0 = time.perf_counter()
        title = f"{cell.deployment.model} {cell.workload_name}"
        specs = coarse_candidates(cell, slo_flags, only)
        found = sweep.drive([search(cell, s) for s in specs], title)
        for _ in range(MAX_REFINEMENTS):
            more = refined_candidates(cell, {f["policy"]: f for f in found}, only)
            if not more:
                break
            specs = specs[:-1] + more + specs[-1:]
            found = (
                found[:-1] + sweep.drive([search(cell, s) for s in more], title + " (refined)") + found[-1:]
            )
        engines = found[:-1]
        slo = found[-1]
        best = max(engines, key=lambda f: f["capacity"])
        rate = 1.25 * best["capacity"] if best["capacity"] > 0 else slo["capacity"]
        best_spec = specs[found.index(best)]
        if rate <= 0:
            label = f"{cell.deployment.model} / {cell.deployment.hardware} TP{cell.deployment.tp}"
            rows.append(
                {
                    "deployment": label,
                    "workload": cell.workload_name,
                    "engines": engines,
                    "slo_policy": slo,
                    "best_engine": best,
                    "capacity_ratio": None,
                    "goodput": None,
                }
            )
            print(f"{label:34} {cell.workload_name:14} no policy meets the SLO at any rate", flush=True)
            partial.write_text(json.dumps(rows, indent=1, default=str))
            continue
        *goodputs, best_held, slo_held, ceiling = sweep.drive(
            [
                goodput_run(cell, best_spec, rate),
                goodput_run(cell, specs[-1], rate),
                # Past capacity, early rejection (rule 4) keeps the served requests on time.
                goodput_run(
                    cell, replace(specs[-1], flags={**specs[-1].flags, "slo_admission": "reject"}), rate
                ),
                sustained(cell, best_spec, best["capacity"]),
                sustained(cell, specs[-1], slo["capacity"]),
                ceiling_run(cell),
            ],
            "goodput, 2x requests, ceiling",
        )
        row = {
            "deployment": f"{cell.deployment.model} / {cell.deployment.hardware} TP{cell.deployment.tp}",
            "workload": cell.workload_name,
            "slo": cell.classes,
            "engines": engines,
            "best_engine": best,
            "slo_policy": slo,
            "capacity_ratio": slo["capacity"] / best["capacity"] if best["capacity"] > 0 else None,
            "goodput": goodputs,
            "sustained": {"best_engine": best_held, "slo": slo_held},
            "ceiling": ceiling,
            "wall_s": round(time.perf_counter() - t0, 1),
        }
        print(
            f"{row['deployment']:34} {row['workload']:14} best {best['policy']:42} {best['capacity']:7.2f}/s"
            f"  slo {slo['capacity']:7.2f}/s  x{row['capacity_ratio'] or float('nan'):.2f}"
            f"  goodput @{rate:.2f}/s: {goodputs[0]['goodput']:.2f} vs {goodputs[1]['goodput']:.2f}"
            f" (reject: {goodputs[2]['goodput']:.2f})  ({row['wall_s']} s)"
            f"\n    fails on: best engine {best['fails_on']}; slo {slo['fails_on']}"
            f"\n    throughput ceiling {ceiling['rate']:.2f}-{ceiling['upper']:.2f}/s (steady"
            f" {ceiling['steady_estimate']:.2f}/s): best engine at {best['capacity'] / ceiling['steady_estimate']:.0%}"
            f" of the steady estimate, slo at {slo['capacity'] / ceiling['steady_estimate']:.0%}, 1.25x the best"
            f" engine at {rate / ceiling['steady_estimate']:.0%}"
            f"\n    with 2x requests at capacity: best engine "
            f"{'holds' if best_held['meets'] else best_held['fails_on']}, slo "
            f"{'holds' if slo_held['meets'] else slo_held['fails_on']}",
            flush=True,
        )
        rows.append(row)
        partial.write_text(json.dumps(rows, indent=1, default=str))
    return rows


def slo_flag_dict(option: str, text: str) -> dict[str, str]:
    """``a=1;b=2`` -> {"a": "1", "b": "2"}, checked against the slo policy's flags; SystemExit
    naming the bad item."""
    flags = {}
    for item in (i.strip() for i in text.split(";")):
        if not item:
            continue
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"{option}: {item!r} is not FLAG=VALUE")
        flags[key] = value
    try:
        PolicySpec.make("slo", flags)
    except ValueError as e:
        raise SystemExit(f"{option}: {e}") from None
    return flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one deployment, fewer requests")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--trace", default=str(default_trace("azure_llm_2023_conv.csv")))
    parser.add_argument("--mooncake-trace", default=str(default_trace("mooncake_conversation.jsonl")))
    parser.add_argument("--skip-capacity", action="store_true")
    parser.add_argument("--skip-fairness", action="store_true")
    parser.add_argument(
        "--cells",
        metavar="LIST",
        help="capacity: only these cells, comma-separated MODEL/WORKLOAD (e.g. Llama-3-8B/azure-conv; "
        "workloads azure-conv, mooncake-conv, mixed)",
    )
    parser.add_argument(
        "--slo-flags",
        metavar="FLAGS",
        default="",
        help="capacity: extra flags of the slo policy, ;-joined (e.g. tbt_late_fraction=0.009)",
    )
    parser.add_argument(
        "--slo-variants",
        metavar="LIST",
        default="",
        help="fairness: extra slo + vtc rows, comma-separated, each ;-joined slo flags "
        "(e.g. quantum_tbts=0.6,quantum_tbts=0.8;yield_tbts=4)",
    )
    parser.add_argument(
        "--fairness-seeds", metavar="LIST", default="1", help="fairness: traffic seeds, comma-separated"
    )
    parser.add_argument(
        "--scale",
        type=int,
        help="capacity: requests per workload x this (x1: 1,000 Azure, 500 Mooncake, 1,000 mixed; "
        "default x4, x1 with --quick): on a short trace a capacity can be a transient that the "
        "trace ends before",
    )
    parser.add_argument(
        "--families",
        metavar="LIST",
        help="capacity: only these engines tuned, comma-separated (vllm, sarathi, sglang, tgi; "
        "vllm brings its priority scheduling on the mixed workload)",
    )
    parser.add_argument("--cpu", action="store_true", help="also the real CPU executor comparison")
    parser.add_argument(
        "--calibration",
        metavar="FILE",
        help="--cpu: also slo predicting from this `tailserve calibrate --executor torch --cpu-clock "
        "--threads 1` file",
    )
    parser.add_argument("--out", type=Path, default=default_out("slo_policy.json"))
    args = parser.parse_args()
    slo_flags = slo_flag_dict("--slo-flags", args.slo_flags)
    variants = tuple(v.strip() for v in args.slo_variants.split(",") if v.strip())
    for v in variants:
        slo_flag_dict(f"--slo-variants {v!r}", v)
    try:
        seeds = tuple(int(v) for v in args.fairness_seeds.split(","))
    except ValueError:
        raise SystemExit(
            f"--fairness-seeds must be comma-separated integers, got {args.fairness_seeds!r}"
        ) from None
    wanted = cell_filter(args.cells) if args.cells else None
    scale = args.scale if args.scale is not None else 1 if args.quick else 4
    if scale < 1:
        raise SystemExit(f"--scale must be an integer >= 1, got {scale}")
    only = None
    if args.families:
        only = frozenset(f.strip() for f in args.families.split(",") if f.strip())
        unknown = only - {name for name, _ in COARSE}
        if unknown or not only:
            names = ", ".join(sorted(name for name, _ in COARSE))
            raise SystemExit(
                f"--families: {', '.join(sorted(unknown)) or '(none)'} not an engine; engines: {names}"
            )
    for trace in (args.trace, args.mooncake_trace):
        problem = check_trace(trace)
        if problem:
            raise SystemExit(problem)
    result: dict[str, Any] = {
        "command": "python -m benchmarks.slo_policy " + " ".join(sys.argv[1:]),
        "host": platform.node(),
        "loadavg_start": os.getloadavg(),
    }
    t0 = time.perf_counter()
    if not args.skip_capacity:
        with Sweep(make_backend(args.workers), quiet=True) as sweep:
            result["capacity"] = capacity_table(
                sweep,
                args.quick,
                args.trace,
                args.mooncake_trace,
                args.out.with_suffix(".partial.json"),
                wanted,
                slo_flags,
                scale,
                only,
            )
    if not args.skip_fairness:
        print("fairness (Llama-3-8B / H100):", flush=True)
        result["fairness"] = fairness(args.quick, variants, seeds)
    if args.cpu:
        print("real CPU executor (tiny model, CPU time):", flush=True)
        result["cpu"] = cpu_comparison(args.quick, args.calibration)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(cpu_line())
    args.out.write_text(json.dumps({**result, "cpu_flags": simd_flags()}, indent=1, default=str))
    print(f"wrote {args.out} ({result['wall_s']} s)")


if __name__ == "__main__":
    main()
