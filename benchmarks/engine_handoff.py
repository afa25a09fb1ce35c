"""What one OpenMP parallel region costs at two threads, per wait setting and pinning.

A decode step of the tiny model opens a few dozen parallel regions (GEMMs, the attention
kernel, elementwise ops above torch's grain), separated by microseconds of Python. Each region
hands work to the second thread and waits for it at the barrier; how fast the hand-off is
depends on how the idle thread waits (spinning, or asleep in the kernel: on a virtual machine a
sleeping vCPU also has to be woken by the host). This times a region too small to matter itself
(``torch.add`` over 2 x 32,768 floats, just above torch's grain, so both threads take part),
called after a gap of Python work: ``--gap-us`` short gaps stand for the ops inside a step,
long ones for the time between steps. The minimum and low percentiles over thousands of calls
are the hand-off with the machine's other load away, which a whole run's time cannot show on a
shared machine.

Each wait setting runs in its own process (GNU OpenMP reads it once), pinned and unpinned
alternating inside it; processes are interleaved over ``--rounds``.

    python benchmarks/engine_handoff.py [--waits passive,spin:10000,spin:100000] [--gap-us 20,3000] \
        [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _paths import default_out  # noqa: E402
from engine_threads import child_env, parse_waits, pooled_stats  # noqa: E402

CHILD = r"""
import json, sys, time
import tailserve.executors.pytorch  # torch with tailserve's wait policy unless the env chose one
import torch
from tailserve.executors.pytorch.threads import ThreadController
gaps = [float(g) * 1e-6 for g in sys.argv[1].split(",")]
calls = int(sys.argv[2])
ctl = ThreadController(2, max_threads=2)
a, b = torch.ones(65536), torch.ones(65536)
c = torch.empty(65536)
out = {}
for arm in ("unpinned", "pinned", "unpinned", "pinned"):
    ctl.set_pinning(arm == "pinned")
    ctl.begin_step()
    try:
        for gap in gaps:
            times = []
            for _ in range(calls):
                end = time.perf_counter() + gap
                while time.perf_counter() < end:
                    pass
                t = time.perf_counter()
                torch.add(a, b, out=c)
                times.append(time.perf_counter() - t)
            out.setdefault(f"{arm}/{gap * 1e6:g}", []).extend(times)
    finally:
        ctl.end_step()
print(json.dumps(out))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--waits", default="passive,spin:10000,spin:100000")
    p.add_argument("--gap-us", default="20,3000", help="Python work before each region, microseconds")
    p.add_argument("--calls", type=int, default=400, help="regions per gap, arm and pass")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        waits = parse_waits(args.waits)
        gaps = [float(g) for g in args.gap_us.split(",")]
        if min(gaps) < 0 or args.calls < 10 or args.rounds < 1:
            raise ValueError("--gap-us must be >= 0, --calls >= 10, --rounds >= 1")
    except ValueError as exc:
        print(f"engine_handoff: error: {exc}", file=sys.stderr)
        return 2
    pooled: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for w in waits if r % 2 == 0 else waits[::-1]:
            cmd = [sys.executable, "-c", CHILD, args.gap_us, str(args.calls)]
            proc = subprocess.run(cmd, env=child_env(w), capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                print(
                    f"{w}: exited with status {proc.returncode}: {proc.stderr.splitlines()[-3:]}", flush=True
                )
                continue
            for key, times in json.loads(proc.stdout.strip().splitlines()[-1]).items():
                pooled.setdefault(f"{w}/{key}", []).extend(times)
            print(f"round {r + 1} {w} done (load {os.getloadavg()[0]:.1f})", flush=True)
    summary: dict[str, Any] = {}
    print("\nparallel region at 2 threads, microseconds: min / p10 / median (gap = Python work before it)")
    for key in sorted(pooled):
        s = summary[key] = pooled_stats(pooled[key])
        print(f"  {key:32s} {s['min'] * 1e6:8.1f} {s['p10'] * 1e6:8.1f} {s['median'] * 1e6:8.1f}")
    out = Path(args.out) if args.out else default_out("engine_handoff.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": " ".join(["engine_handoff.py", *(argv if argv is not None else sys.argv[1:])]),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "summary": summary,
            },
            indent=1,
        )
    )
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
