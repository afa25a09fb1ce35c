"""Is the CPU's run-to-run speed a property of the engine instance? The same decode, repeated
inside one engine and across fresh engines.

``fidelity_cpu.py`` builds a fresh engine (and so fresh weight and KV allocations) for every run
and every probe, and its runs' decode levels spread far wider than one run's step-to-step
scatter even on a quiet machine. Here ``--engines`` fresh engines each run the probe's decode
(4 requests at 128 tokens of context, ``torch_calibrate.PROBE``) ``--repeats`` times in a row;
the median step of each repeat is one sample. If the spread between engines is much wider than
within one, the level belongs to the instance (where its buffers landed), not to the moment.

    OMP_NUM_THREADS=1 python benchmarks/fidelity_cpu_instances.py [--engines 8] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
from pathlib import Path

import numpy as np

from tailserve.executors.pytorch.init_model import default_model_dir
from tailserve.fidelity.recorder import install
from tailserve.fidelity.replay import kv_gib_for
from tailserve.fidelity.torch_calibrate import PROBE


def engine_samples(model_dir: Path, repeats: int, seed: int) -> list[float]:
    """The probe's median decode period, ``repeats`` times in one engine (CPU clock)."""
    from tailserve.llm import LLMEngine, SamplingParams

    n_req = len(PROBE.prompt_lens)
    tokens = sum(n + PROBE.max_tokens for n in PROBE.prompt_lens) * repeats
    engine = LLMEngine.from_args(
        str(model_dir), executor="torch", policy="vllm", policy_flags=dict(PROBE.policy_flags),
        dtype="bfloat16", kv_cache_memory_gib=kv_gib_for(model_dir, tokens, n_req * repeats),
    )  # fmt: skip
    recorder = install(engine, cpu_clock=True)
    rng = random.Random(seed)
    vocab = engine.tokenizer.vocab_size
    params = SamplingParams(max_tokens=PROBE.max_tokens, ignore_eos=True, temperature=0.0)
    out = []
    for rep in range(repeats):
        recorder.records.clear()
        recorder.mark_idle()
        for i, n in enumerate(PROBE.prompt_lens):
            engine.add_request(f"r{rep}-{i}", [rng.randrange(3, vocab) for _ in range(n)], params)
        while engine.has_unfinished_requests():
            engine.step()
        out.append(
            statistics.median(
                r.period_s for r in recorder.records if r.period_s and not r.shape.prefill_pairs
            )
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    if args.engines < 2 or args.repeats < 2:
        ap.error("--engines and --repeats must be >= 2 (a spread needs two samples)")
    import torch

    torch.set_num_threads(1)
    model_dir = default_model_dir("tiny")
    up0 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    samples = np.array([engine_samples(model_dir, args.repeats, seed=e) for e in range(args.engines)])
    up1 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    means = samples.mean(axis=1)
    within = float(np.median(np.abs(samples / means[:, None] - 1.0)))
    between = float(np.median(np.abs(means / np.median(means) - 1.0)))
    for e, row in enumerate(samples):
        print(f"engine {e}: " + " ".join(f"{x * 1e3:.2f}" for x in row) + " ms")
    print(
        f"within one engine: median |sample / engine mean - 1| {within:.1%}; between engines: median "
        f"|engine mean / median - 1| {between:.1%} (engine means {means.min() * 1e3:.2f}-{means.max() * 1e3:.2f} ms)"
    )
    print(f"uptime before: {up0}\nuptime after: {up1}")
    if args.json:
        body = {
            "samples_s": samples.tolist(), "within": within, "between": between,
            "uptime_before": up0, "uptime_after": up1, "cpu_count": os.cpu_count(),
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(body, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
