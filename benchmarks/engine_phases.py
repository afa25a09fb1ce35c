"""W's phases side by side: tailserve's real executor and vLLM's CPU build, step by step.

The same W workload as ``engine_cpu.py`` (64 prompts of 256 ids, 64 new tokens, greedy, bf16),
run ``--repeats`` times by each engine with its per-iteration timing: tailserve's iteration log,
and inside vLLM (``_vllm_phases.py``, engine core in-process) ``EngineCore.step`` with what its
scheduler scheduled. Both schedule W the same way (vLLM V1's rules), so their steps pair up:

- **prefill phase**: every step that carries prompt tokens (with the decodes mixed into it);
- **decode at batch B**: decode-only steps of B requests — median and min step time.

Figures are min over repeats of each phase's time (the machine is shared). tailserve runs with
``--threads`` fixed (default 2) and vLLM with ``VLLM_CPU_OMP_THREADS_BIND`` (default 0-1).

    python benchmarks/engine_phases.py [--models tiny,small] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import importlib  # noqa: E402

importlib.import_module("tailserve.executors.pytorch")  # its OpenMP wait policy before torch

import torch  # noqa: E402
from _arrivals import random_prompts  # noqa: E402
from _engine_report import machine_info  # noqa: E402
from _paths import default_out, peer_venv  # noqa: E402

from tailserve.executors.pytorch.init_model import default_model_dir  # noqa: E402
from tailserve.llm import LLM, SamplingParams  # noqa: E402

W_SEED, WARMUP_SEED, PROMPT_LEN, MAX_TOKENS = 1234, 7, 256, 64
DTYPE = "bfloat16"


def tailserve_runs(
    model_dir: Path, prompts: list[list[int]], repeats: int, threads: int, budget: int
) -> list[dict]:
    llm = LLM(model_dir, policy="vllm", dtype=DTYPE, threads=threads, max_num_batched_tokens=budget)
    loop = llm.engine.engine
    loop.options = dataclasses.replace(loop.options, keep_iteration_log=True)
    cpu: list[float] = []  # this thread's CPU per logged iteration (all of it at one thread)
    step = loop.step

    def timed_step() -> bool:
        n, c = len(loop.log), time.thread_time()
        more = step()
        if len(loop.log) > n:
            cpu.append(time.thread_time() - c)
        return more

    loop.step = timed_step

    def generate(ps: list[list[int]], n: int) -> int:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return sum(len(o.token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in ps], params))

    generate(random_prompts(2, 64, 8192, WARMUP_SEED), 8)
    runs = []
    for r in range(repeats):
        # Fresh prompt ids per repeat would change the work; the prefix cache is what must not
        # help, so each repeat's prompts differ in their second id.
        ps = [[p[0], 3 + (p[1] + r) % 5000, *p[2:]] for p in prompts]
        log = loop.log
        first = len(log)
        cpu.clear()
        t = time.perf_counter()
        n = generate(ps, MAX_TOKENS)
        wall = time.perf_counter() - t
        steps = [
            {
                "start": log.start[i],
                "duration": log.duration[i],
                "num_prefill_tokens": log.num_prefill_tokens[i],
                "num_decode_tokens": log.num_decode_tokens[i],
                "batch_size": log.batch_size[i],
                "cpu_s": cpu[i - first] if len(cpu) == len(log) - first else None,
            }
            for i in range(first, len(log))
        ]
        runs.append({"wall_s": wall, "output_tokens": n, "steps": steps})
    return runs


def vllm_runs(model_dir: Path, prompts: list[list[int]], repeats: int, bind: str, venv: Path) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="engine_phases_vllm_"))
    spec = {
        "model_dir": str(model_dir),
        "dtype": DTYPE,
        "max_model_len": None,
        "w_prompts": prompts,
        "w_max_tokens": MAX_TOKENS,
        "warmup_prompts": random_prompts(2, 64, 8192, WARMUP_SEED),
        "repeats": repeats,
    }
    (folder / "spec.json").write_text(json.dumps(spec))
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    cmd = [
        str(venv / "bin" / "python"),
        str(HERE / "_vllm_phases.py"),
        str(folder / "spec.json"),
        str(folder / "out.json"),
    ]
    with open(folder / "vllm.log", "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1800).returncode
    if rc != 0:
        tail = (folder / "vllm.log").read_text(errors="replace").splitlines()[-8:]
        raise RuntimeError(
            f"vLLM phase driver exited with {rc}; log {folder / 'vllm.log'}:\n" + "\n".join(tail)
        )
    return json.loads((folder / "out.json").read_text())


def phases(run: dict, cpu: bool = False) -> dict[str, Any]:
    """One W run's phases: the prefill steps' total, and decode-only steps by batch size; in
    wall seconds, or with ``cpu`` in the stepping thread's CPU seconds (the whole step's at one
    thread, and far less disturbed by other processes on a shared machine)."""
    steps = run["steps"]
    key = "cpu_s" if cpu and all(s.get("cpu_s") is not None for s in steps) else "duration"
    pre = [s for s in steps if s["num_prefill_tokens"] > 0]
    decode: dict[int, list[float]] = {}
    for s in steps:
        if s["num_prefill_tokens"] == 0 and s["num_decode_tokens"] > 0:
            decode.setdefault(s["num_decode_tokens"], []).append(s[key])
    return {
        "wall_s": run["wall_s"],
        "num_steps": len(steps),
        "prefill_steps": [(s["num_prefill_tokens"], s["num_decode_tokens"]) for s in pre],
        "measure": key,
        "prefill_s": sum(s[key] for s in pre),
        "decode": {
            b: {"num": len(d), "median_s": statistics.median(d), "min_s": min(d), "sum_s": sum(d)}
            for b, d in sorted(decode.items())
        },
    }


def best(runs: list[dict], cpu: bool = False) -> dict[str, Any]:
    """Min over repeats of each phase figure."""
    ps = [phases(r, cpu) for r in runs]
    out = {
        "measure": ps[0]["measure"],
        "wall_s": min(p["wall_s"] for p in ps),
        "num_steps": ps[0]["num_steps"],
        "prefill_steps": ps[0]["prefill_steps"],
        "prefill_s": min(p["prefill_s"] for p in ps),
        "decode": {},
    }
    for b in ps[0]["decode"]:
        rows = [p["decode"][b] for p in ps if b in p["decode"]]
        out["decode"][b] = {
            "num": rows[0]["num"],
            "median_s": min(r["median_s"] for r in rows),
            "min_s": min(r["min_s"] for r in rows),
            "sum_s": min(r["sum_s"] for r in rows),
        }
    return out


def report(preset: str, ours: dict, theirs: dict) -> None:
    unit = "CPU ms of the stepping thread" if ours["measure"] == "cpu_s" else "wall ms"
    print(f"\n{preset}: W phases, {unit} (min over repeats); ratio = tailserve / vLLM (lower is better)")
    print(f"  {'phase':34s} {'tailserve':>10s} {'vLLM':>10s} {'ratio':>6s}")

    def row(name: str, a: float, b: float) -> None:
        print(f"  {name:34s} {a * 1e3:10.1f} {b * 1e3:10.1f} {a / b:6.2f}")

    row("W wall", ours["wall_s"], theirs["wall_s"])
    row(
        f"prefill phase ({len(ours['prefill_steps'])} / {len(theirs['prefill_steps'])} steps)",
        ours["prefill_s"],
        theirs["prefill_s"],
    )
    for b, d in ours["decode"].items():
        v = theirs["decode"].get(b)
        if v is None or d["num"] < 3:
            continue
        row(f"decode batch {b} median ({d['num']}/{v['num']} steps)", d["median_s"], v["median_s"])
    if ours["measure"] == "duration":  # wall time outside the steps: output handling, detokenising
        other = ours["wall_s"] - ours["prefill_s"] - sum(d["sum_s"] for d in ours["decode"].values())
        vother = theirs["wall_s"] - theirs["prefill_s"] - sum(d["sum_s"] for d in theirs["decode"].values())
        row("outside steps (wall - steps)", other, vother)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,small")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="tailserve's torch threads (fixed)")
    p.add_argument("--vllm-threads-bind", default="0-1")
    p.add_argument("--vllm-venv", default=str(peer_venv("vllm")))
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=4096,
        help="tailserve's budget (vLLM CPU's default: 4096)",
    )
    p.add_argument(
        "--cpu",
        action="store_true",
        help="phase figures in CPU time (needs --threads 1 and a bind of one core)",
    )
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--out", default=None, help="JSON (default benchmarks/out/engine_phases.json)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.threads < 1:
        print("engine_phases: error: --repeats and --threads must be at least 1", file=sys.stderr)
        return 2
    if args.cpu and (args.threads != 1 or "-" in args.vllm_threads_bind or "," in args.vllm_threads_bind):
        print(
            "engine_phases: error: --cpu needs --threads 1 and --vllm-threads-bind of one core",
            file=sys.stderr,
        )
        return 2
    out_path = Path(args.out) if args.out else default_out("engine_phases.json")
    results: dict[str, Any] = {
        "command": " ".join(["engine_phases.py", *(argv if argv is not None else sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_before": os.getloadavg(),
        "machine": machine_info(),
        "torch_threads": args.threads,
        "vllm_threads_bind": args.vllm_threads_bind,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "models": {},
    }
    for preset in [m.strip() for m in args.models.split(",") if m.strip()]:
        model_dir = default_model_dir(preset)
        prompts = random_prompts(64, PROMPT_LEN, 8192, W_SEED)
        torch.set_num_threads(args.threads)
        ours = tailserve_runs(model_dir, prompts, args.repeats, args.threads, args.max_num_batched_tokens)
        entry: dict[str, Any] = {
            "tailserve": best(ours, args.cpu),
            "tailserve_runs": [phases(r, args.cpu) for r in ours],
        }
        if not args.skip_vllm:
            v = vllm_runs(model_dir, prompts, args.repeats, args.vllm_threads_bind, Path(args.vllm_venv))
            entry["vllm"] = best(v["runs"], args.cpu)
            entry["vllm_runs"] = [phases(r, args.cpu) for r in v["runs"]]
            entry["vllm_info"] = {k: v[k] for k in ("versions", "env", "max_num_batched_tokens")}
            report(preset, entry["tailserve"], entry["vllm"])
        results["models"][preset] = entry
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(results, indent=1, default=str))
    results["load_after"] = os.getloadavg()
    out_path.write_text(json.dumps(results, indent=1, default=str))
    print(
        f"results: {out_path} (load before {results['load_before'][0]:.2f}, after {results['load_after'][0]:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
