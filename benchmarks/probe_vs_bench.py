"""The same decode step timed two ways on one running server: through ``calibrate --from-server``'s
probe (``ServerProbe.streams``, the steady step its decode points fit) and through ``tailserve
bench`` (the client the closed loop's cells are measured with), interleaved.

B streams at once, prompts of P token ids, N tokens each; per repeat the probe's steady step
(median over streams of each stream's middle-half median gap) and bench's ITL / TPOT p50. A gap
between the two is what a twin calibrated through the probe carries into cells measured through
bench (docs/fidelity.md, "The engine as its own twin").

    tailserve serve --model DIR --port 8091 --threads 2 &
    python -m benchmarks.probe_vs_bench --url http://127.0.0.1:8091 --shape 1x112x32 --shape 8x112x64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._common import cpu_line, save_results
from tailserve.fidelity.server_calibrate import _steady_step
from tailserve.fidelity.server_probe import Prompts, ServerProbe, served_models


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        b, p, n = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"probe_vs_bench: --shape {text!r}: expected BxPxN, e.g. 8x112x64") from None
    if min(b, p) < 1 or n < 4:
        raise SystemExit(f"probe_vs_bench: --shape {text!r}: B and P >= 1, N >= 4")
    return b, p, n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8091")
    ap.add_argument(
        "--shape", action="append", default=None, help="BxPxN (repeatable; default 1x112x32, 8x112x64)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=8192, help="token ids are drawn below it")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    shapes = [parse_shape(s) for s in (args.shape or ["1x112x32", "8x112x64"])]
    model = served_models(args.url, {})[0]
    probe = ServerProbe(args.url, model.id, {})
    prompts = Prompts(True, args.vocab)
    print(cpu_line())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for b, p, n in shapes:
            for rep in range(args.repeats):
                timings = probe.streams([prompts.make(p) for _ in range(b)], n)
                steady = statistics.median(_steady_step(t) for t in timings)
                out = Path(tmp) / f"bench-{b}-{rep}.json"
                cmd = [
                    sys.executable,
                    "-m",
                    "tailserve.cli",
                    "bench",
                    "--base-url",
                    args.url,
                    "--model",
                    model.id,
                ]
                cmd += ["--dataset", "random", "--num-prompts", str(b), "--random-input-len", str(p)]
                cmd += ["--random-output-len", str(n), "--request-rate", "inf", "--max-concurrency", str(b)]
                cmd += ["--seed", str(rep), "--json", str(out)]
                if model.root and Path(model.root).is_dir():
                    cmd += ["--tokenizer", model.root]
                subprocess.run(cmd, check=True, capture_output=True)
                r = json.loads(out.read_text())
                row = {
                    "shape": f"{b}x{p}x{n}",
                    "repeat": rep,
                    "probe_step_ms": steady * 1e3,
                    "bench_itl_p50_ms": r["median_itl_ms"],
                    "bench_tpot_p50_ms": r["median_tpot_ms"],
                    "load_average": os.getloadavg()[0],
                }
                rows.append(row)
                print(
                    f"{row['shape']} #{rep + 1}: probe step {row['probe_step_ms']:.2f} ms, bench ITL p50 "
                    f"{row['bench_itl_p50_ms']:.2f} ms, TPOT p50 {row['bench_tpot_p50_ms']:.2f} ms "
                    f"(load {row['load_average']:.2f})",
                    flush=True,
                )
    save_results(
        {"url": args.url, "model": model.id, "rows": rows, "cpu": cpu_line()}, args.out, "probe_vs_bench.json"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
