"""The two-thread step, side by side: OpenMP wait settings x pinned or unpinned threads on W.

Each wait setting (``--waits``) needs its own process (GNU OpenMP reads it once, when torch
loads); inside each process W (``engine_cpu.py``'s offline batch: 64 prompts of 256 ids, 64 new
tokens, greedy, bf16) runs alternately unpinned and pinned (``threads.py``), so the pinning A/B
shares a process. Processes are interleaved over ``--rounds`` so every setting sees the same
spread of machine load; the summary is the minimum and median per arm, wall time and the
process's CPU time beside it (a spinning wait spends CPU the figure must show).

Wait settings: ``default`` (tailserve's: ``GOMP_SPINCOUNT=30000``, ``threads.SPIN_COUNT``),
``passive`` (``OMP_WAIT_POLICY=PASSIVE``: sleep at once; tailserve's default before), ``spin:N``
(``GOMP_SPINCOUNT=N``: spin N times, then sleep; GNU OpenMP's own default is 300,000), ``active``
(``OMP_WAIT_POLICY=ACTIVE``: spin without end).

    python benchmarks/engine_threads.py [--models tiny] [--threads 2] \
        [--waits passive,spin:10000,spin:100000,spin:300000,active] [--rounds 3] [--runs 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _host import simd_flags  # noqa: E402
from _paths import default_out  # noqa: E402

from tailserve.executors.pytorch.threads import _WAIT_VARIABLES  # noqa: E402


def wait_env(setting: str) -> dict[str, str]:
    if setting == "default":
        return {}  # tailserve's own choice (threads.SPIN_COUNT)
    if setting == "passive":
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    if setting == "active":
        return {"OMP_WAIT_POLICY": "ACTIVE"}
    name, _, count = setting.partition(":")
    if name == "spin" and count.isdigit():
        return {"GOMP_SPINCOUNT": count}
    raise ValueError(f"--waits: {setting!r} is not default, passive, active or spin:N")


def parse_waits(raw: str) -> list[str]:
    """The ``--waits`` list, each setting checked (ValueError)."""
    waits = [w.strip() for w in raw.split(",") if w.strip()]
    for w in waits:
        wait_env(w)
    return waits


def child_env(wait: str) -> dict[str, str]:
    """This process's environment for a child with wait setting ``wait`` and torch's thread count."""
    env = {k: v for k, v in os.environ.items() if k not in (*_WAIT_VARIABLES, "OMP_NUM_THREADS")}
    env.update(wait_env(wait))
    return env


def pooled_stats(values: list[float]) -> dict[str, float] | None:
    """min / p10 / median / n of ``values``; None when empty."""
    xs = sorted(values)
    if not xs:
        return None
    return {"min": xs[0], "p10": xs[len(xs) // 10], "median": statistics.median(xs), "n": len(xs)}


def run_child(preset: str, threads: str, wait: str, runs: int, first: str, timeout_s: float) -> dict:
    env = child_env(wait)
    cmd = [sys.executable, str(HERE / "_engine_threads_child.py"), preset, threads, str(runs), first]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        return {
            "error": f"exited with status {proc.returncode}",
            "stderr_tail": proc.stderr.splitlines()[-5:],
        }
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict]) -> dict[str, Any]:
    def stats(key: str) -> dict[str, float] | None:
        xs = [r[key] for r in runs if r.get(key) is not None]
        return {"min": min(xs), "median": statistics.median(xs), "n": len(xs)} if xs else None

    out: dict[str, Any] = {
        k: stats(k) for k in ("wall_s", "process_cpu_s", "decode_step_b64_s", "loadavg", "others_cpu_s")
    }
    # Pooled over runs: the fastest steps are the ones the machine's other load left alone.
    for key in ("decode_b64_durations_s", "prefill_durations_s"):
        out[key] = pooled_stats([x for r in runs for x in r.get(key, [])])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="tiny")
    p.add_argument("--threads", default="2", help="torch threads (a count, or auto for adaptive)")
    p.add_argument("--waits", default="passive,spin:10000,spin:100000,spin:300000,active")
    p.add_argument("--rounds", type=int, default=3, help="interleaved passes over the wait settings")
    p.add_argument("--runs", type=int, default=2, help="W runs per arm in each process")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for one process")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        waits = parse_waits(args.waits)
        if args.rounds < 1 or args.runs < 1:
            raise ValueError("--rounds and --runs must be at least 1")
        if args.threads != "auto" and not (args.threads.isdigit() and int(args.threads) > 0):
            raise ValueError(f"--threads: {args.threads!r} is not a positive count or auto")
    except ValueError as exc:
        print(f"engine_threads: error: {exc}", file=sys.stderr)
        return 2
    results: dict[str, Any] = {
        "command": " ".join(["engine_threads.py", *(argv if argv is not None else sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cpu_flags": simd_flags(),
        "cores": len(os.sched_getaffinity(0)),
        "runs": {},
    }
    out = Path(args.out) if args.out else default_out("engine_threads.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    for preset in [m.strip() for m in args.models.split(",") if m.strip()]:
        raw: dict[str, list[dict]] = {f"{w}/{arm}": [] for w in waits for arm in ("unpinned", "pinned")}
        for r in range(args.rounds):
            for w in waits:
                first = "unpinned" if r % 2 == 0 else "pinned"
                child = run_child(preset, args.threads, w, args.runs, first, args.timeout)
                if "error" in child:
                    print(f"{preset} {w}: {child['error']}: {child['stderr_tail']}", flush=True)
                    continue
                for run in child["runs"]:
                    raw[f"{w}/{run['arm']}"].append(run)
                done = ", ".join(f"{x['arm']} {x['wall_s']:.2f} s" for x in child["runs"])
                print(f"{preset} round {r + 1} {w}: {done} (load {os.getloadavg()[0]:.1f})", flush=True)
        summary = {key: summarize(runs) for key, runs in raw.items() if runs}
        results["runs"][preset] = {"raw": raw, "summary": summary}
        out.write_text(json.dumps(results, indent=1))
        print(
            f"\n{preset}: W wall s (min / median), process CPU s (median); decode step at batch 64 and "
            "prefill step ms (min / p10 over every step of the arm's runs)"
        )
        for key, s in summary.items():
            dec, pre = s["decode_b64_durations_s"], s["prefill_durations_s"]
            print(
                f"  {key:24s} {s['wall_s']['min']:6.2f} / {s['wall_s']['median']:6.2f}   "
                f"{s['process_cpu_s']['median']:6.2f}   {_ms(dec)}   {_ms(pre)}"
            )
    print(f"results: {out}")
    return 0


def _ms(stats: dict | None) -> str:
    return f"{stats['min'] * 1e3:6.1f} / {stats['p10'] * 1e3:6.1f}" if stats else "     - /      -"


if __name__ == "__main__":
    sys.exit(main())
