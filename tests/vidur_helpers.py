"""Vidur-layout profile files for the tests (test_profiles.py, test_gemm_regimes.py)."""

from __future__ import annotations

import csv
from pathlib import Path

from tailserve.executors.simulated.profiles import LINEAR_OPS


def write_mlp(
    path: Path, shape: dict, rows: list[tuple[int, int, tuple[float, float, float, float]]]
) -> Path:
    """An mlp.csv with four per-op times (ms) per (tokens, TP)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = [f"time_stats.{op}.median" for op in LINEAR_OPS] + [*shape, "use_gated_mlp", "num_tokens",
              "num_tensor_parallel_workers"]  # fmt: skip
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for n, tp, ops in rows:
            w.writerow([*ops, *shape.values(), "True", n, tp])
    return path
