"""The real executor at two commits, side by side: W (engine_cpu's 64 prompts x 256 ids, 64
greedy bf16 tokens each) through tailserve from a git ref (checked out in a temporary worktree)
and from this working tree, alternating in fresh processes, so a change's speed-up is measured
in one run on the same machine state.

    python benchmarks/engine_commit_ab.py --base e42661c~1 [--models tiny,small] [--reps 2]
        [--threads N] [--out FILE]

Prints, per model and round, wall and process-CPU seconds and output tok/s of each side, the
thread counts the adaptive controller ran at (it drops to one thread while another job holds a
core: compare rounds that ran at the same count), and whether both sides produced the same
tokens (bf16 kernels may round differently between commits). Saves the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _host import simd_flags
from _paths import save_results

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# Runs inside each side's interpreter (PYTHONPATH = that side's src): the same workload and
# measurement for both, independent of either side's benchmark helpers.
CHILD = r"""
import hashlib, json, sys, time
import tailserve.executors.pytorch  # its OpenMP wait policy before torch
from _arrivals import random_prompts  # benchmarks/ is on the path: engine_cpu's W prompts
from tailserve.executors.pytorch.init_model import default_model_dir
from tailserve.llm import LLM, SamplingParams

preset, threads = sys.argv[1], (int(sys.argv[2]) or None)
llm = LLM(default_model_dir(preset), policy="vllm", dtype="bfloat16", threads=threads)
executor = llm.engine.stop_checker.inner
prompts = random_prompts(64, 256, executor.model.config.vocab_size, 1234)
llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], SamplingParams(max_tokens=4, temperature=0.0))
params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
controller = executor.threads
seen = controller.seconds_at() if controller is not None and hasattr(controller, "seconds_at") else None
wall, cpu = time.perf_counter(), time.process_time()
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
at = None
if seen is not None:
    now = controller.seconds_at()
    at = {str(k): round(v - seen.get(k, 0.0), 3) for k, v in now.items() if v - seen.get(k, 0.0) > 0}
tokens = [list(o.outputs[0].token_ids) for o in outs]
print(json.dumps({
    "wall_s": wall, "cpu_s": cpu, "output_tok_s": 64 * 64 / wall, "seconds_at_threads": at,
    "tokens_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest(),
}))
"""


def run_side(src: Path, preset: str, threads: int | None) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(src), str(HERE)))}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, preset, str(threads or 0)],
        capture_output=True, text=True, cwd=tempfile.gettempdir(), env=env,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise SystemExit(f"engine_commit_ab: the run from {src} failed (rc {proc.returncode}):\n{tail}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="git ref to compare this working tree against")
    p.add_argument("--models", default="tiny,small")
    p.add_argument("--reps", type=int, default=2, help="rounds of (base, this tree) per model")
    p.add_argument("--threads", type=int, default=None, help="fixed intra-op threads (default: adaptive)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error(f"--reps must be >= 1, got {args.reps}")
    base = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{args.base}^{{commit}}"],
                          capture_output=True, text=True)  # fmt: skip
    if base.returncode != 0:
        p.error(f"--base {args.base!r} is not a commit of this repository")
    commit = base.stdout.strip()
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    results: dict = {
        "command": " ".join(["engine_commit_ab.py", *(argv if argv is not None else sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cpu_flags": simd_flags(),
        "base": commit,
        "tree": f"{head.stdout.strip()} (+ uncommitted changes, if any)",
        "models": {},
    }
    print(f"CPU: {' '.join(simd_flags()) or 'no AVX-512/AMX flags'}; base {commit[:10]} vs this tree")
    with tempfile.TemporaryDirectory(prefix="tailserve-ab-") as tmp:
        worktree = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(worktree), commit],
                       check=True, capture_output=True)  # fmt: skip
        try:
            sides = {"base": worktree / "src", "tree": REPO / "src"}
            for preset in args.models.split(","):
                rounds = []
                for r in range(args.reps):
                    row = {name: run_side(src, preset, args.threads) for name, src in sides.items()}
                    rounds.append(row)
                    b, t = row["base"], row["tree"]
                    print(
                        f"{preset} round {r + 1}: base {b['wall_s']:.2f} s ({b['output_tok_s']:.0f} tok/s, "
                        f"threads {b['seconds_at_threads']}), tree {t['wall_s']:.2f} s "
                        f"({t['output_tok_s']:.0f} tok/s, threads {t['seconds_at_threads']}): "
                        f"{b['wall_s'] / t['wall_s']:.2f}x, tokens "
                        f"{'identical' if b['tokens_sha256'] == t['tokens_sha256'] else 'differ'}",
                        flush=True,
                    )
                best = {n: min(row[n]["wall_s"] for row in rounds) for n in sides}
                results["models"][preset] = {
                    "rounds": rounds,
                    "speedup_best_wall": best["base"] / best["tree"],
                }
                print(f"{preset}: best wall base {best['base']:.2f} s, tree {best['tree']:.2f} s "
                      f"({best['base'] / best['tree']:.2f}x)")  # fmt: skip
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)],
                           capture_output=True)  # fmt: skip
    save_results(results, args.out, "engine_commit_ab.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
