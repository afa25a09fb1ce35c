"""The expert-load model (``executors/simulated/expert_load.py``) against TensorRT-LLM's measured
load statistics: DeepSeek-R1 on 32 GB200, a machine-translation dataset, tech blog 4 ("Scaling
Expert Parallelism in TensorRT-LLM", Table 1: the standard deviation and imbalance ratio of the
routed tokens per rank and per expert slot, averaged over layers and iterations; 1,024 rows per
rank, 128 per expert slot).

One number is fitted per part, the rest is predicted:

- the log-normal spread of the experts' popularities, to the per-rank imbalance without EPLB
  (1.564 at EP 32); predicted: that row's per-rank standard deviation and its per-expert
  imbalance and standard deviation;
- EPLB's estimate error (``EPLB_ESTIMATE_ERROR``), to EPLB's per-rank imbalance at EP 32 with 288
  slots (0.109); predicted: that row's standard deviation and the EP 36 / 288 slots row.

    python -m benchmarks.expert_imbalance [--out benchmarks/results/expert_imbalance.json]

Prints the table and saves it as JSON; runs in seconds on numpy alone (no peer, no GPU).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from tailserve.executors.simulated import expert_load as X

EXPERTS = 256
ROWS_PER_RANK = 1024  # Table 1's average per rank (32 x 1,024 = 32,768 routed rows a layer)
STEPS = 20  # simulated iterations per sampled layer
# Table 1: (EP, slots per rank, by-rank std, by-rank imbalance, by-slot std, by-slot imbalance)
BLOG = {
    "no EPLB, EP 32 (8 slots a rank)": (32, 8, 491.6, 1.564, 164.1, 10.948),
    "EPLB, EP 32 (9 slots a rank)": (32, 9, 52.0, 0.109, 77.8, 1.792),
    "EPLB, EP 36 (8 slots a rank)": (36, 8, 53.9, 0.115, 87.5, 1.791),
}
SOURCE = (
    "https://github.com/NVIDIA/TensorRT-LLM/blob/main/docs/source/blogs/tech_blog/"
    "blog4_Scaling_Expert_Parallelism_in_TensorRT-LLM.md (Table 1)"
)


def _fit_error(weights: np.ndarray, target: float) -> float:
    """EPLB's estimate error that gives ``target`` per-rank imbalance at EP 32 with 288 slots."""
    lo, hi = 0.0, 0.5
    for _ in range(30):
        mid = (lo + hi) / 2
        got, _ = X.load_statistics(X.eplb_layers(weights, 32, 32, mid), ROWS_PER_RANK, STEPS)
        lo, hi = (mid, hi) if got < target else (lo, mid)
    return (lo + hi) / 2


def run() -> dict:
    sigma = X._sigma_for(BLOG["no EPLB, EP 32 (8 slots a rank)"][3], EXPERTS, 32)
    w = X.lognormal_weights(EXPERTS, sigma)
    fitted_error = _fit_error(w, BLOG["EPLB, EP 32 (9 slots a rank)"][3])
    rows = []
    for name, (ep, per_rank, rank_std, rank_imb, slot_std, slot_imb) in BLOG.items():
        if name.startswith("no EPLB"):
            shares = X.default_layers(w, ep)
            slots = np.tile(w, (len(shares), 1))  # each expert its own slot
        else:
            shares = X.eplb_layers(w, ep, ep * per_rank - EXPERTS)
            slots = None
        imb, std = X.load_statistics(shares, ROWS_PER_RANK, STEPS)
        row = {
            "row": name,
            "by_rank": {"imbalance": [rank_imb, imb], "std": [rank_std, std * ROWS_PER_RANK]},
        }
        if slots is not None:
            s_imb, s_std = X.load_statistics(slots, 128, STEPS)
            row["by_expert"] = {"imbalance": [slot_imb, s_imb], "std": [slot_std, s_std * 128]}
        rows.append(row)
    return {
        "source": SOURCE,
        "fitted": {
            "lognormal_sigma": sigma,
            "eplb_estimate_error": fitted_error,
            "eplb_estimate_error_in_code": X.EPLB_ESTIMATE_ERROR,
        },
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/expert_imbalance.json")
    args = parser.parse_args()
    t0 = time.perf_counter()
    result = run()
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result["seconds"] = round(time.perf_counter() - t0, 1)
    f = result["fitted"]
    print(f"fitted: log-normal sigma {f['lognormal_sigma']:.3f}; EPLB estimate error {f['eplb_estimate_error']:.3f} "
          f"(in code: {f['eplb_estimate_error_in_code']})")  # fmt: skip
    print(f"{'row':34} {'statistic':22} {'measured':>9} {'model':>9} {'error':>7}")
    for row in result["rows"]:
        for part in ("by_rank", "by_expert"):
            for stat, (measured, model) in row.get(part, {}).items():
                print(
                    f"{row['row']:34} {part + ' ' + stat:22} {measured:9.3f} {model:9.3f} "
                    f"{(model - measured) / measured:+7.1%}"
                )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"saved {args.out} ({result['seconds']} s)")


if __name__ == "__main__":
    main()
