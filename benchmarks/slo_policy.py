"""``slo`` against the best tuned configuration of every engine, and VTC fairness.

Capacity (Sarathi-Serve's measure: the highest arrival rate whose p99 TTFT and p99 TBT meet the
SLO, found by ``tailserve.tune.capacity``'s bracketing + bisection, every rate replaying the same
requests) for each deployment x workload cell:

- engines, each at a small grid of its budget flag (the best capacity is kept — a reduced
  version of ``tailserve tune``'s budget sweep): vllm ``max_num_batched_tokens`` 512/2048/8192,
  sarathi ``chunk_size`` 256/512/1024, sglang ``chunked_prefill_size`` 2048/8192, tgi defaults;
  on the mixed workload also vllm ``scheduling_policy=priority`` at 512/2048;
- ``slo`` with the cell's SLO as its classes (its defaults otherwise).

A cell's SLO: TBT target ``T`` = 5 x one decode iteration of 32 requests at 1,024 tokens on that
deployment, rounded up to 10 ms (Sarathi's "strict" SLO scale); TTFT 2 s (Azure), 6 s (Mooncake,
whose prompts are ~7k tokens). The mixed workload has two classes, 70% interactive (priority 0:
TTFT 1 s, TBT T) and 30% batch (priority 1: TTFT 30 s, TBT 4T), and a rate meets it when *each
class* meets its own p99 bounds. Goodput: requests/s meeting their class's TTFT and TPOT (<= TBT
target) at 1.25x the best engine's capacity.

Fairness (Llama-3-8B / H100): tenant ``light`` at a fixed rate, ``heavy`` at 10x it (far past
capacity). The light tenant's p99 TTFT with heavy present against its solo run, under fcfs (vllm,
slo) and VTC (vllm + fairness=vtc, slo + fairness=vtc). Then two tenants both backlogged (both
past capacity, different lengths): the largest measured difference of weighted service
(``w_p`` x prefill + ``w_q`` x decode tokens) over any interval in which both stay backlogged,
against the paper's bound ``2 max(w_p L_input, w_q M)``.

    python benchmarks/slo_policy.py [--quick] [--workers N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from _paths import check_trace, default_out, default_trace

from tailserve.assemble import BuildOptions, build_engine
from tailserve.core.engine import EngineOptions
from tailserve.core.request import Request, RequestStatus
from tailserve.core.source import ListSource
from tailserve.policies.fairness import FairPolicy, TenantBacklog
from tailserve.policies.registry import PolicySpec
from tailserve.policies.slo_classes import parse_slo_classes
from tailserve.policies.vtc import VirtualTokenCounter
from tailserve.sim.deployment import Deployment, build_cost_model
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.tune.capacity import RateScaler, capacity_steps
from tailserve.tune.sweep import RunOutcome, RunSpec, Sweep, make_backend
from tailserve.workloads.lengths import LogNormal
from tailserve.workloads.tenants import tenant_streams

DEPLOYMENTS = (("Llama-3-8B", "H100-SXM", 1), ("Llama-3-70B", "A100-80GB", 4), ("Mistral-7B", "A100-80GB", 1))
ENGINE_GRID: dict[str, list[dict[str, Any]]] = {
    "vllm": [{"max_num_batched_tokens": n} for n in (512, 2048, 8192)],
    "sarathi": [{"chunk_size": n} for n in (256, 512, 1024)],
    "sglang": [{"chunked_prefill_size": n} for n in (2048, 8192)],
    "tgi": [{}],
}
PRIORITY_GRID = [{"scheduling_policy": "priority", "max_num_batched_tokens": n} for n in (512, 2048)]
REL_TOL = 0.05


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


def cells(quick: bool, azure: str, mooncake: str) -> list[Cell]:
    n = 400 if quick else 1000
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


def candidates(cell: Cell) -> list[PolicySpec]:
    # Mooncake prompts reach 126k tokens: every deployment serves an 8,192-token context (the
    # Llama-3 models' own), so the same requests are refused at any rate everywhere.
    engine = {"max_model_len": 8192} if cell.workload_name == "mooncake-conv" else {}
    specs = [
        PolicySpec.make(name, {**flags, **engine}) for name, grid in ENGINE_GRID.items() for flags in grid
    ]
    if cell.mixed:
        specs += [PolicySpec.make("vllm", {**flags, **engine}) for flags in PRIORITY_GRID]
    specs.append(PolicySpec.make("slo", {"slo_classes": cell.classes, **engine}))
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
    return {"policy": spec.label, "capacity": capacity.rate, "upper": capacity.upper, "runs": len(tried)}


def goodput_run(cell: Cell, spec: PolicySpec, rate: float) -> Generator[RunSpec, RunOutcome, dict[str, Any]]:
    scaler = RateScaler.of(RunSpec(cell.deployment, cell.workload, spec, keep_run=True))
    outcome = yield scaler.at(rate)
    requests = _served(outcome)
    report = class_report(requests, cell.classes)
    span = max(r.finish_time or 0.0 for r in requests) - min(r.arrival_time for r in requests)
    good = sum(c["good"] for c in report.values())
    return {"policy": spec.label, "rate": rate, "goodput": good / span, "fraction_good": good / len(requests)}


def capacity_table(
    sweep: Sweep, quick: bool, azure: str, mooncake: str, partial: Path
) -> list[dict[str, Any]]:
    """Every cell's row; the rows so far are rewritten to ``partial`` after each cell."""
    rows: list[dict[str, Any]] = []
    for cell in cells(quick, azure, mooncake):
        specs = candidates(cell)
        t0 = time.perf_counter()
        found = sweep.drive([search(cell, s) for s in specs], f"{cell.deployment.model} {cell.workload_name}")
        engines = [f for f in found if not f["policy"].startswith("slo")]
        slo = next(f for f in found if f["policy"].startswith("slo"))
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
        goodputs = sweep.drive(
            [goodput_run(cell, best_spec, rate), goodput_run(cell, specs[-1], rate)], "goodput"
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
            "wall_s": round(time.perf_counter() - t0, 1),
        }
        print(
            f"{row['deployment']:34} {row['workload']:14} best {best['policy']:42} {best['capacity']:7.2f}/s"
            f"  slo {slo['capacity']:7.2f}/s  x{row['capacity_ratio'] or float('nan'):.2f}"
            f"  goodput @{rate:.2f}/s: {goodputs[0]['goodput']:.2f} vs {goodputs[1]['goodput']:.2f}  ({row['wall_s']} s)",
            flush=True,
        )
        rows.append(row)
        partial.write_text(json.dumps(rows, indent=1, default=str))
    return rows


# ---- fairness -----------------------------------------------------------------------------
class Recorder(TenantBacklog):
    """A backlog that also records, after every iteration, each tenant's weighted service so far
    and who was backlogged; ``fair=False`` keeps the wrapped policy's own (FCFS) order."""

    def __init__(self, counter: VirtualTokenCounter, fair: bool) -> None:
        super().__init__(counter)
        self.fair = fair
        self.served: dict[str, float] = {}
        self.samples: list[tuple[dict[str, float], frozenset[str]]] = []

    def order(self, requests):  # type: ignore[override]
        return super().order(requests) if self.fair else list(requests)

    def charge(self, out) -> None:  # type: ignore[override]
        super().charge(out)
        for s in out.scheduled:
            t = s.request.tenant_id or ""
            cost = self.vtc.output_price if s.num_new_tokens == 1 else self.vtc.input_price * s.num_new_tokens
            self.served[t] = self.served.get(t, 0.0) + cost
        self._sample()

    def charge_decode_run(self, running, num_steps: int) -> None:  # type: ignore[override]
        super().charge_decode_run(running, num_steps)
        for r in running:
            t = r.tenant_id or ""
            self.served[t] = self.served.get(t, 0.0) + self.vtc.output_price * num_steps
        self._sample()

    def _sample(self) -> None:
        backlogged = frozenset(t for t, n in self.num_waiting.items() if n > 0)
        self.samples.append((dict(self.served), backlogged))


def run_tenants(policy: str, requests: list[Request], fair: bool) -> tuple[list[Request], Recorder, int]:
    deployment = Deployment.of("Llama-3-8B", "H100-SXM", 1)
    name, _, flags = policy.partition(":")
    spec = PolicySpec.make(name, dict(f.split("=", 1) for f in flags.split(";") if f))
    built = build_engine(deployment, spec, "sim", BuildOptions(shares_prefixes=False))
    recorder = Recorder(VirtualTokenCounter(), fair)
    inner = built.policy
    if isinstance(inner, FairPolicy):
        inner = inner.inner
    if policy.startswith("slo"):
        inner.backlog = recorder  # slo's own VTC, observed
        wrapped = inner
    else:
        wrapped = FairPolicy(inner, recorder)
    built.scheduler.policy = wrapped
    built.parts.policy = wrapped
    fresh = [
        Request(r.request_id, r.prompt_len, r.max_tokens, r.arrival_time, tenant_id=r.tenant_id)
        for r in requests
    ]
    engine = built.make_engine(ListSource(fresh), options=EngineOptions())
    engine.run()
    return fresh, recorder, built.scheduler.kv_cache.num_blocks * built.scheduler.kv_cache.block_size


def p99_ttft(requests: list[Request], tenant: str) -> float:
    ttft = [r.token_times[0] - r.arrival_time for r in requests if r.tenant_id == tenant and r.token_times]
    return float(np.percentile(ttft, 99))


def max_service_difference(recorder: Recorder, a: str, b: str) -> float:
    """max over intervals [t1, t2] with both backlogged throughout of |dW_a - dW_b|."""
    worst = 0.0
    lo = hi = None
    for served, backlogged in recorder.samples:
        if a in backlogged and b in backlogged:
            d = served.get(a, 0.0) - served.get(b, 0.0)
            lo = d if lo is None else min(lo, d)
            hi = d if hi is None else max(hi, d)
            worst = max(worst, hi - lo)
        else:
            lo = hi = None
    return worst


def fairness(quick: bool) -> dict[str, Any]:
    duration = 30.0 if quick else 60.0
    lengths = (LogNormal(1024, 0.8, 4000), LogNormal(200, 0.8, 1000))
    light_rate = 5.0
    both = tenant_streams((("light", light_rate), ("heavy", 10 * light_rate)), duration, *lengths, seed=1)
    solo = [r for r in both if r.tenant_id == "light"]
    out: dict[str, Any] = {
        "light_rate": light_rate,
        "heavy_rate": 10 * light_rate,
        "duration_s": duration,
    }
    rows = []
    for label, policy, fair in [
        ("vllm fcfs", "vllm", False),
        ("vllm + vtc", "vllm", True),
        ("slo (no vtc)", "slo:slo_classes=all=ttft:2s,tbt:50ms", False),
        ("slo + vtc", "slo:fairness=vtc;slo_classes=all=ttft:2s,tbt:50ms", True),
    ]:
        alone, _, _ = run_tenants(policy, solo, fair)
        shared, recorder, _ = run_tenants(policy, both, fair)
        s, w = p99_ttft(alone, "light"), p99_ttft(shared, "light")
        rows.append(
            {"policy": label, "light_p99_ttft_solo_s": s, "light_p99_ttft_shared_s": w, "ratio": w / s}
        )
        print(
            f"  {label:12} light p99 TTFT solo {s:.3f} s, beside heavy {w:.3f} s (x{w / s:.2f})", flush=True
        )
    out["well_behaved"] = rows
    # Both backlogged: a sends long prompts, b short ones with long outputs, each past capacity.
    a = tenant_streams((("a", 30.0),), duration, LogNormal(2000, 0.5, 4000), LogNormal(100, 0.5, 400), seed=2)
    b = tenant_streams((("b", 30.0),), duration, LogNormal(300, 0.5, 1000), LogNormal(400, 0.5, 1000), seed=3)
    mix = sorted(a + b, key=lambda r: r.arrival_time)
    diffs = []
    for label, policy, fair in [
        ("vllm fcfs", "vllm", False),
        ("vllm + vtc", "vllm", True),
        ("slo + vtc", "slo:fairness=vtc", True),
    ]:
        _, recorder, kv_tokens = run_tenants(policy, mix, fair)
        measured = max_service_difference(recorder, "a", "b")
        bound = recorder.vtc.bound(max(r.prompt_len for r in mix), kv_tokens)
        diffs.append(
            {"policy": label, "max_service_difference": measured, "bound": bound, "within": measured <= bound}
        )
        print(f"  {label:12} max service difference {measured:,.0f} (bound {bound:,.0f})", flush=True)
    out["backlogged"] = diffs
    return out


# ---- the real CPU executor -----------------------------------------------------------------
def cpu_comparison(quick: bool) -> dict[str, Any]:
    """The same comparison at small scale on the real PyTorch executor (the tiny model on this
    CPU): short prompts decoding while long ones arrive. Time is the engine thread's CPU time
    (``fidelity.recorder.CpuClock``), so other processes on the machine do not enter it."""
    from tailserve.executors.pytorch.init_model import default_model_dir
    from tailserve.fidelity.recorder import install
    from tailserve.fidelity.replay import _TimedQueueSource
    from tailserve.llm import LLMEngine, SamplingParams

    rng = np.random.default_rng(7)
    n = 24 if quick else 48
    arrivals = np.cumsum(rng.exponential(0.25, n))
    planned = []
    for i in range(n):
        long = i % 4 == 0
        prompt = [int(t) for t in rng.integers(10, 1000, 1200 if long else 64)]
        planned.append((prompt, 48, float(arrivals[i])))
    classes = "all=ttft:2s,tbt:150ms"
    rows = []
    for label, policy, flags in [
        ("vllm (default budget)", "vllm", {}),
        ("vllm budget 256", "vllm", {"max_num_batched_tokens": "256"}),
        ("slo", "slo", {"slo_classes": classes}),
    ]:
        engine = LLMEngine.from_args(
            str(default_model_dir()), executor="torch", policy=policy, policy_flags=flags, dtype="float32"
        )
        install(engine, cpu_clock=True)
        source = _TimedQueueSource()
        engine.source = engine.engine.source = source
        start = engine.now
        requests = []
        for i, (prompt, max_tokens, at) in enumerate(planned):
            engine.add_request(
                f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
            )
            request = engine.stop_checker.requests[f"r{i}"]
            request.arrival_time = start + at
            requests.append(request)
        while engine.has_unfinished_requests():
            engine.step()
        ttft = [r.token_times[0] - r.arrival_time for r in requests]
        gaps = np.concatenate([np.diff(r.token_times) for r in requests])
        row = {
            "policy": label,
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "tbt_p99_s": float(np.percentile(gaps, 99)),
            "tbt_max_s": float(gaps.max()),
            "predictor": engine.scheduler.policy.predictor.source if policy == "slo" else None,
        }
        rows.append(row)
        print(
            f"  {label:22} TTFT p99 {row['ttft_p99_s']:.3f} s  TBT p99 {row['tbt_p99_s'] * 1e3:.1f} ms"
            f"  max {row['tbt_max_s'] * 1e3:.1f} ms",
            flush=True,
        )
    return {"requests": n, "slo_classes": classes, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one deployment, fewer requests")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--trace", default=str(default_trace("azure_llm_2023_conv.csv")))
    parser.add_argument("--mooncake-trace", default=str(default_trace("mooncake_conversation.jsonl")))
    parser.add_argument("--skip-capacity", action="store_true")
    parser.add_argument("--skip-fairness", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="also the real CPU executor comparison")
    parser.add_argument("--out", type=Path, default=default_out("slo_policy.json"))
    args = parser.parse_args()
    for trace in (args.trace, args.mooncake_trace):
        problem = check_trace(trace)
        if problem:
            raise SystemExit(problem)
    result: dict[str, Any] = {
        "command": "python benchmarks/slo_policy.py" + (" --quick" if args.quick else ""),
        "host": platform.node(),
        "loadavg_start": os.getloadavg(),
    }
    t0 = time.perf_counter()
    if not args.skip_capacity:
        with Sweep(make_backend(args.workers), quiet=True) as sweep:
            result["capacity"] = capacity_table(
                sweep, args.quick, args.trace, args.mooncake_trace, args.out.with_suffix(".partial.json")
            )
    if not args.skip_fairness:
        print("fairness (Llama-3-8B / H100):", flush=True)
        result["fairness"] = fairness(args.quick)
    if args.cpu:
        print("real CPU executor (tiny model, CPU time):", flush=True)
        result["cpu"] = cpu_comparison(args.quick)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out} ({result['wall_s']} s)")


if __name__ == "__main__":
    main()
