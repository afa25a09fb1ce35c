"""Simulator speed side by side: tailserve vs NVIDIA's AISimulate on the same requests.

One generator writes the workload in each tool's format (tailserve JSONL and Mooncake JSONL):
Azure LLM 2023 conversation lengths (sampled from ``shared/traces``), Poisson arrivals at
5 req/s (times rounded to the millisecond, Mooncake's unit, in both files), Llama-3-8B on one
A100-80GB (AISimulate: ``meta-llama/Meta-Llama-3.1-8B`` on ``a100_sxm``, the same architecture).
Each (policy, size) pair runs both tools in separate processes, interleaved (the order flips
each repeat), and reports medians and min-max of simulated requests per wall second:

- loop: the simulation alone (tailserve ``RunResult.wall_s``; AISimulate's ``wall_time_ms``);
- process: the whole command, interpreter start, imports, trace load and metrics included;
- peak RSS of the process (``os.wait4``).

Policies and their AISimulate counterparts (AISimulate has no Sarathi: a 512-token vLLM budget
is the same chunking rule):

    vllm    max_num_batched_tokens=4096, max_num_seqs=256  | vllm,   max_batched_tokens 4096
    sarathi chunk_size=512, max_num_seqs=256               | vllm,   max_batched_tokens 512
    sglang  chunked_prefill_size=8192, max_running=256     | sglang, max_batched_tokens 8192
    trtllm  max_num_tokens=8192, max_batch_size=256        | trtllm, max_batched_tokens 8192
    sglang-overlap  the sglang case with its overlap scheduler | sglang, 8192, host_loop: true

(the first four synchronous: AISimulate's backends step without an overlapped host loop by
default; ``sglang-overlap`` is SGLang's default loop against AISimulate's model of it).
Each row also gives both tools' TTFT and TPOT p50 / p99 on those requests: the two simulate the
same scheduling rule on their own cost models, so the figures agree roughly, not exactly.

Then tailserve alone on the whole Azure conversation trace and the Mooncake conversation trace.
Vidur is not run (see docs/benchmarks.md). An absent AISimulate venv is reported with how to
make it (``scripts/setup-peers.sh aisimulate``) and tailserve runs alone.

    python -m benchmarks.sim_speed [--sizes 2000,20000] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks._common import (
    check_trace,
    default_out,
    default_trace,
    missing_peer,
    module_cmd,
    module_env,
    peer_venv,
)

HERE = Path(__file__).resolve().parent
AZURE = default_trace("azure_llm_2023_conv.csv")
MOONCAKE = default_trace("mooncake_conversation.jsonl")
RATE = 5.0  # requests per second
MOONCAKE_BLOCK = 512  # tokens per hash id in the Mooncake format


@dataclass(frozen=True, slots=True)
class Case:
    name: str  # tailserve policy name
    spec: str  # tailserve policy spec
    backend: str  # AISimulate backend
    budget: int  # AISimulate max_batched_tokens
    host_loop: bool = False  # AISimulate's model of SGLang's overlap scheduler (sglang only)


CASES = (
    # Synchronous, as AISimulate's vllm backend schedules (tailserve's vllm default is async on a GPU).
    Case("vllm", "vllm:max_num_batched_tokens=4096,max_num_seqs=256,async_scheduling=false", "vllm", 4096),
    Case("sarathi", "sarathi:chunk_size=512,max_num_seqs=256", "vllm", 512),
    # Synchronous too: AISimulate's sglang backend runs without its host loop (``host_loop``
    # false by default, aisimulate/config/engine.py), and SGLang's overlap scheduler (on by
    # default in tailserve since 759b815) turns the decode fast paths off.
    Case(
        "sglang",
        "sglang:chunked_prefill_size=8192,max_running_requests=256,disable_overlap_schedule=true",
        "sglang",
        8192,
    ),
    # TensorRT-LLM's defaults (GUARANTEED_NO_EVICT, no chunked prefill) without its overlap
    # scheduler: AISimulate's trtllm backend steps synchronously (its TPOT p50 on the 2,000-request
    # workload is 21.6 ms, tailserve's synchronous trtllm 22.2 ms, with overlap 18.3 ms).
    # SGLang's default, its overlap scheduler, against AISimulate's model of it (``host_loop``:
    # "each pass one SGLang overlap-scheduler iteration: requests received at iteration
    # boundaries, a forward's outputs visible one iteration later", aisimulate/config/engine.py).
    Case(
        "sglang-overlap",
        "sglang:chunked_prefill_size=8192,max_running_requests=256",
        "sglang",
        8192,
        host_loop=True,
    ),
    Case(
        "trtllm",
        "trtllm:max_num_tokens=8192,max_batch_size=256,disable_overlap_scheduler=true",
        "trtllm",
        8192,
    ),
)


# ---- workload -----------------------------------------------------------------------------
def azure_lengths(path: Path) -> np.ndarray:
    with path.open(newline="") as f:
        rows = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    return np.array(rows, dtype=np.int64)


def write_workload(
    n: int, lengths: np.ndarray, folder: Path, seed: int = 0, rate: float = RATE
) -> tuple[Path, Path]:
    """The same n requests as tailserve JSONL and as Mooncake JSONL (unique hash ids: no reuse)."""
    rng = np.random.default_rng(seed)
    pick = lengths[rng.integers(0, len(lengths), n)]
    ms = np.round(np.cumsum(rng.exponential(1.0 / rate, n)) * 1000).astype(np.int64)
    ours, theirs = folder / f"tailserve_{n}.jsonl", folder / f"mooncake_{n}.jsonl"
    write_both(((t, prompt, output) for t, (prompt, output) in zip(ms.tolist(), pick.tolist())), ours, theirs)
    return ours, theirs


def write_both(rows: Iterable[tuple[int, int, int]], ours: Path, theirs: Path) -> None:
    """(arrival ms, prompt tokens, output tokens) rows as tailserve JSONL and as Mooncake JSONL
    (unique hash ids: no reuse)."""
    next_hash = 0
    with ours.open("w") as fo, theirs.open("w") as ft:
        for t, prompt, output in rows:
            fo.write(
                json.dumps({"arrival_time": t / 1000, "prompt_len": prompt, "max_tokens": output}) + "\n"
            )
            blocks = -(-prompt // MOONCAKE_BLOCK)
            hashes = list(range(next_hash, next_hash + blocks))
            next_hash += blocks
            ft.write(
                json.dumps(
                    {"timestamp": t, "input_length": prompt, "output_length": output, "hash_ids": hashes}
                )
                + "\n"
            )


def aisimulate_config(case: Case, trace: Path, folder: Path) -> Path:
    path = folder / f"aisimulate_{case.name}_{trace.stem}.yaml"
    path.write_text(
        f"""traffic:
  source: {{type: trace, paths: [{json.dumps(str(trace))}]}}
  load: {{type: trace_timestamps}}
engine:
  model: meta-llama/Meta-Llama-3.1-8B
  hardware: a100_sxm
  backend: {case.backend}
  workers:
    aggregated:
      scheduler: {{max_batched_tokens: {case.budget}, max_sequences: 256}}
"""
        + ("      host_loop: true\n" if case.host_loop else "")
    )
    return path


# ---- one process per run --------------------------------------------------------------------
def run_process(cmd: list[str]) -> tuple[float, float, int, str]:
    """(whole-process wall seconds, CPU seconds (user + sys, its waited-for children too), peak
    RSS in MiB, stdout) of one command."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=err, env=module_env({**os.environ, "OMP_NUM_THREADS": "1"})
        )
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"sim_speed: error: {cmd[0]} exited {proc.returncode}: {err.read()[-2000:]}")
        return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss // 1024, out.read()


def run_tailserve(spec: str, trace: Path) -> dict:
    wall, cpu, rss, stdout = run_process(module_cmd(sys.executable, "sim_speed", "--worker", spec, trace))
    r = json.loads(stdout.strip().splitlines()[-1])
    return {
        "requests": r["requests"],
        "iterations": r["iterations"],
        "loop_s": r["loop_s"],
        "loop_cpu_s": r["loop_cpu_s"],
        "latency_ms": r["latency_ms"],
        "process_s": wall,
        "process_cpu_s": cpu,
        "rss_mib": rss,
    }


def run_aisimulate(exe: Path, config: Path) -> dict:
    # It writes report files beside its JSON: keep them in the scratch folder, not the cwd.
    cmd = [str(exe), "predict", "-c", str(config), "--format", "json"]
    cmd += ["--output-dir", str(config.with_suffix(".out")), "--overwrite"]
    wall, cpu, rss, stdout = run_process(cmd)
    r = json.loads(stdout[stdout.index("{") :])
    return {
        "requests": r["completed_requests"],
        "loop_s": r["wall_time_ms"] / 1000,
        "latency_ms": {
            f"{name}_{q}": r[f"{prefix}_{name}_ms"]
            for name in ("ttft", "tpot")
            for q, prefix in (("p50", "median"), ("p99", "p99"))
        },
        "process_s": wall,
        "process_cpu_s": cpu,
        "rss_mib": rss,
    }


def worker(spec_text: str, trace: str) -> None:
    """Child process: simulate one trace with one policy, print one JSON line."""
    from tailserve.executors.simulated.deployment import Deployment, build_cost_model
    from tailserve.policies.registry import parse_policy_list
    from tailserve.sim.run import run_policy
    from tailserve.sim.workload_builder import WorkloadBuilder
    from tailserve.sim.workload_spec import WorkloadSpec

    built = build_cost_model(Deployment("Llama-3-8B", "A100-80GB", 1, "none"))
    workload = WorkloadBuilder(WorkloadSpec("trace", trace_path=trace))
    run = run_policy(built, parse_policy_list(spec_text)[0], workload)
    summary = run.summary()  # the metrics, as AISimulate's process computes its own
    metrics = summary["metrics"]
    print(
        json.dumps(
            {
                "requests": summary["num_requests"],
                "iterations": summary["num_iterations"],
                "loop_s": run.wall_s,
                "loop_cpu_s": run.loop_cpu_s,
                "latency_ms": {
                    f"{name}_{q}": metrics[f"{name}_s"][q] * 1000
                    for name in ("ttft", "tpot")
                    for q in ("p50", "p99")
                },
            }
        )
    )


# ---- statistics and report ----------------------------------------------------------------
def stats(runs: list[dict]) -> dict:
    out: dict = {"runs": runs}
    for key in ("loop", "process", "loop_cpu", "process_cpu"):
        if f"{key}_s" not in runs[0]:
            continue  # AISimulate reports no CPU time of its loop
        rates = [r["requests"] / r[f"{key}_s"] for r in runs]
        out[f"{key}_req_per_s"] = {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}
    out["rss_mib_max"] = max(r["rss_mib"] for r in runs)
    if "iterations" in runs[0]:
        out["iterations"] = runs[0]["iterations"]
    out["latency_ms"] = runs[0]["latency_ms"]  # the same in every run: both tools are deterministic
    return out


def latency(s: dict) -> str:
    d = s["latency_ms"]
    return f"TTFT p50/p99 {d['ttft_p50']:,.0f}/{d['ttft_p99']:,.0f} ms, TPOT {d['tpot_p50']:.1f}/{d['tpot_p99']:.1f} ms"


def fmt(s: dict, key: str) -> str:
    d = s[f"{key}_req_per_s"]
    return f"{d['median']:8,.0f} ({d['min']:,.0f}-{d['max']:,.0f})"


def cpu_features() -> dict:
    flags: list[str] = []
    model = ""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        text = ""
    for line in text.splitlines():
        if line.startswith("Model name:"):
            model = line.split(":", 1)[1].strip()
        if line.startswith("Flags:"):
            flags = [f for f in line.split()[1:] if f.startswith(("avx512", "amx"))]
    return {"model": model, "cpus": os.cpu_count(), "avx512_amx_flags": flags}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "TRACE"), help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="2000,20000", help="request counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each tool per (policy, size)")
    parser.add_argument("--policies", default="vllm,sarathi,sglang,sglang-overlap,trtllm")
    parser.add_argument(
        "--trace", default=str(AZURE), help="Azure conversation trace: the lengths, and a run alone"
    )
    parser.add_argument("--mooncake-trace", default=str(MOONCAKE), help="Mooncake trace for a run alone")
    parser.add_argument(
        "--no-alone", action="store_true", help="skip the whole-trace runs of tailserve alone"
    )
    parser.add_argument("--aisimulate-venv", default=str(peer_venv("aisimulate")))
    parser.add_argument("--out", default=None, help="results JSON (default: benchmarks/out/sim_speed.json)")
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        raise SystemExit(
            f"sim_speed: error: --sizes must be integers separated by commas, got {args.sizes!r}"
        ) from None
    if any(n < 1 for n in sizes) or args.repeats < 1:
        raise SystemExit("sim_speed: error: --sizes and --repeats must be >= 1")
    by_name = {c.name: c for c in CASES}
    if unknown := [p for p in args.policies.split(",") if p not in by_name]:
        raise SystemExit(f"sim_speed: error: unknown policy {unknown[0]!r}; known: {', '.join(by_name)}")
    cases = [by_name[p] for p in args.policies.split(",")]
    azure, mooncake = Path(args.trace), Path(args.mooncake_trace)
    for trace in (azure, mooncake):
        if (problem := check_trace(trace)) is not None:
            raise SystemExit(f"sim_speed: error: {problem}")
    out_path = Path(args.out) if args.out else default_out("sim_speed.json")
    exe = Path(args.aisimulate_venv) / "bin" / "aisimulate"
    peer = exe.exists()
    machine = {**cpu_features(), "loadavg_start": os.getloadavg(), "python": sys.version.split()[0]}
    print(
        f"CPU: {machine['model']}, {machine['cpus']} cpus; avx512/amx: {' '.join(machine['avx512_amx_flags']) or 'none'}"
    )
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in machine['loadavg_start'])}")
    if not peer:
        print(
            f"AISimulate absent: {missing_peer('aisimulate', args.aisimulate_venv)} Running tailserve alone."
        )
    result: dict = {"machine": machine, "rate_req_per_s": RATE, "side_by_side": [], "alone": []}
    try:
        lengths = azure_lengths(azure)
    except (KeyError, ValueError) as error:
        raise SystemExit(
            f"sim_speed: error: {azure}: not an Azure conversation trace CSV ({error})"
        ) from None
    if len(lengths) == 0:
        raise SystemExit(f"sim_speed: error: {azure}: no requests in the trace")
    with tempfile.TemporaryDirectory(prefix="sim_speed_") as tmp:
        folder = Path(tmp)
        for n in sizes:
            ours, theirs = write_workload(n, lengths, folder)
            for case in cases:
                config = aisimulate_config(case, theirs, folder) if peer else None
                runs: dict[str, list[dict]] = {"tailserve": [], "aisimulate": []}
                for rep in range(args.repeats):
                    order = ["tailserve", "aisimulate"] if rep % 2 == 0 else ["aisimulate", "tailserve"]
                    for tool in order:
                        if tool == "tailserve":
                            runs[tool].append(run_tailserve(case.spec, ours))
                        elif config is not None:
                            runs[tool].append(run_aisimulate(exe, config))
                row = {
                    "policy": case.spec,
                    "aisimulate_backend": f"{case.backend}, max_batched_tokens {case.budget}",
                    "requests": n,
                    "tailserve": stats(runs["tailserve"]),
                }
                line = f"{case.name:>8} {n:>7,}: tailserve loop {fmt(row['tailserve'], 'loop')} req/s, process {fmt(row['tailserve'], 'process')}, {row['tailserve']['rss_mib_max']} MiB; {latency(row['tailserve'])}"
                if runs["aisimulate"]:
                    row["aisimulate"] = stats(runs["aisimulate"])
                    row["loop_ratio"] = (
                        row["tailserve"]["loop_req_per_s"]["median"]
                        / row["aisimulate"]["loop_req_per_s"]["median"]
                    )
                    row["process_ratio"] = (
                        row["tailserve"]["process_req_per_s"]["median"]
                        / row["aisimulate"]["process_req_per_s"]["median"]
                    )
                    # Per CPU second of the whole process: what a loaded machine does not
                    # distort (AISimulate's threads take a larger share of a busy machine).
                    row["process_cpu_ratio"] = (
                        row["tailserve"]["process_cpu_req_per_s"]["median"]
                        / row["aisimulate"]["process_cpu_req_per_s"]["median"]
                    )
                    line += (
                        f"\n{'':>17}aisimulate loop {fmt(row['aisimulate'], 'loop')} req/s, process {fmt(row['aisimulate'], 'process')}, "
                        f"{row['aisimulate']['rss_mib_max']} MiB  -> loop {row['loop_ratio']:.2f}x, process {row['process_ratio']:.2f}x, "
                        f"process CPU {row['process_cpu_ratio']:.2f}x (tailserve loop CPU {fmt(row['tailserve'], 'loop_cpu')} req/s); "
                        f"{latency(row['aisimulate'])}"
                    )
                print(line, flush=True)
                result["side_by_side"].append(row)
        if not args.no_alone:
            for trace in (azure, mooncake):
                for case in cases:
                    s = stats([run_tailserve(case.spec, trace) for _ in range(args.repeats)])
                    result["alone"].append({"trace": trace.name, "policy": case.spec, "tailserve": s})
                    print(
                        f"alone {trace.name} {case.name:>8}: {s['runs'][0]['requests']:,} requests, "
                        f"loop {min(r['loop_s'] for r in s['runs']):.2f}-{max(r['loop_s'] for r in s['runs']):.2f} s "
                        f"(CPU {min(r['loop_cpu_s'] for r in s['runs']):.2f}-{max(r['loop_cpu_s'] for r in s['runs']):.2f} s), "
                        f"{fmt(s, 'loop')} req/s, process {fmt(s, 'process')}, {s['rss_mib_max']} MiB",
                        flush=True,
                    )
    machine["loadavg_end"] = os.getloadavg()
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in machine['loadavg_end'])}")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out_path}")


if __name__ == "__main__":
    main()
