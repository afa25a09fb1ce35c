"""tailserve's W throughput with another process busy on one core, against the quiet figure.

For each thread setting, W (``engine_cpu.py``'s offline batch: 64 prompts of 256 ids, 64 new
tokens, greedy, bf16) runs twice in a fresh process: on the quiet machine, then beside a
competitor (``python -c "while True: pass"`` pinned with ``taskset`` to the last core, started
after the engine warmed up, killed after). Settings:

- ``adaptive``: tailserve's defaults (threads from the free cores, revisited every 0.5 s;
  OpenMP threads spin 30,000 times, then sleep: ``threads.SPIN_COUNT``);
- ``adaptive-passive``: adaptive threads that sleep at once (``OMP_WAIT_POLICY=PASSIVE``),
  tailserve's default before the bounded spin;
- ``fixed-2-spin``: 2 threads and GNU OpenMP's spinning wait (``GOMP_SPINCOUNT=300000``, its
  default), what tailserve did before any of this;
- ``fixed-2-passive``: 2 threads that wait passively, no adaptation;
- ``adaptive-spin``: adaptive threads, GNU OpenMP's own spinning wait (300,000).

Each quiet run waits for the machine to be quiet first (``_quiet.py``), and records the load.

    python benchmarks/engine_contention.py [--models tiny] [--settings adaptive,fixed-2-spin]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _host import simd_flags  # noqa: E402
from _paths import save_results  # noqa: E402
from _quiet import gated  # noqa: E402

SETTINGS: dict[str, dict[str, Any]] = {
    "adaptive": {"threads": None, "env": {}},
    "adaptive-passive": {"threads": None, "env": {"OMP_WAIT_POLICY": "PASSIVE"}},
    "fixed-2-spin": {"threads": 2, "env": {"GOMP_SPINCOUNT": "300000"}},
    "fixed-2-passive": {"threads": 2, "env": {"OMP_WAIT_POLICY": "PASSIVE"}},
    "adaptive-spin": {"threads": None, "env": {"GOMP_SPINCOUNT": "300000"}},
}

# One W run in a child process: warm up, then time W, optionally beside the competitor.
CHILD = r"""
import json, os, signal, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from _arrivals import random_prompts
from tailserve.llm import LLM, SamplingParams
from tailserve.executors.pytorch.init_model import default_model_dir
preset, threads, compete = sys.argv[2], sys.argv[3], sys.argv[4] == "1"
kwargs = {} if threads == "auto" else {"threads": int(threads)}
llm = LLM(default_model_dir(preset), policy="vllm", dtype="bfloat16", **kwargs)
vocab = llm.engine.tokenizer.vocab_size
params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
llm.generate([{"prompt_token_ids": p} for p in random_prompts(2, 64, vocab, 7)], params)
prompts = [{"prompt_token_ids": p} for p in random_prompts(64, 256, vocab, 1234)]
competitor = None
if compete:
    core = str(max(os.sched_getaffinity(0)))
    competitor = subprocess.Popen(["taskset", "-c", core, sys.executable, "-c", "while True: pass"])
    time.sleep(1.0)
try:
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t
finally:
    if competitor is not None:
        competitor.kill()
        competitor.wait()
threads_ctl = llm.engine.stop_checker.inner.threads
print(json.dumps({
    "wall_s": wall,
    "output_tok_s": sum(len(o.token_ids) for o in outs) / wall,
    "threads_at_end": threads_ctl.threads if threads_ctl else None,
    "thread_changes": threads_ctl.num_changes if threads_ctl else None,
    "description": llm.engine.description,
}))
"""


def run_once(preset: str, setting: str, compete: bool, timeout_s: float) -> dict[str, Any]:
    spec = SETTINGS[setting]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    }
    env.update(spec["env"])
    threads = "auto" if spec["threads"] is None else str(spec["threads"])
    cmd = [sys.executable, "-c", CHILD, str(HERE), preset, threads, "1" if compete else "0"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-3:]
        return {"error": f"exited with status {proc.returncode}", "stderr_tail": tail}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny")
    p.add_argument("--settings", default="adaptive,fixed-2-spin,fixed-2-passive")
    p.add_argument("--quiet-threshold", type=float, default=0.2)
    p.add_argument("--quiet-timeout", type=float, default=300.0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for one W run, startup included")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    bad = [s for s in settings if s not in SETTINGS]
    if bad:
        print(
            f"engine_contention: error: unknown setting(s) {', '.join(bad)}; known: {', '.join(SETTINGS)}",
            file=sys.stderr,
        )
        return 2
    if shutil.which("taskset") is None:
        print(
            "engine_contention: error: taskset (util-linux) is needed to pin the competitor", file=sys.stderr
        )
        return 2
    results: dict[str, Any] = {
        "command": " ".join(["engine_contention.py", *(argv if argv is not None else sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cpu_flags": simd_flags(),
        "cores": len(os.sched_getaffinity(0)),
        "runs": {},
    }
    for preset in [m.strip() for m in args.models.split(",") if m.strip()]:
        for setting in settings:
            row: dict[str, Any] = {}
            for compete in (False, True):
                row["quiet_gate" if not compete else "gate_before_competitor"] = gated(
                    args.quiet_threshold, args.quiet_timeout
                )
                row["loadavg_before"] = os.getloadavg()[0]
                row["competing" if compete else "quiet"] = run_once(preset, setting, compete, args.timeout)
            q, c = row["quiet"], row["competing"]
            if "output_tok_s" in q and "output_tok_s" in c:
                row["ratio"] = c["output_tok_s"] / q["output_tok_s"]
                print(
                    f"{preset} {setting}: quiet {q['output_tok_s']:.0f} tok/s, with a busy core "
                    f"{c['output_tok_s']:.0f} tok/s ({row['ratio']:.2f}x)",
                    flush=True,
                )
            else:
                print(f"{preset} {setting}: failed: {q.get('error') or c.get('error')}", flush=True)
            results["runs"][f"{preset}/{setting}"] = row
    save_results(results, args.out, "engine_contention.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
