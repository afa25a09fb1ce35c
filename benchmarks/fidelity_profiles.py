"""The cost model's linear layers and all-reduce against Vidur's measured GPU profiles.

For each GPU: fit the GEMM curve on the training models, report mean/max |error| on every model
(training and held-out), before (the generic default efficiencies, no tile) and after (the
fitted curve); then the all-reduce at TP 2/4/8 with the catalog's figures and with the fitted
latency and efficiency. The fitted constants are what ``hardware.py`` holds.

    python benchmarks/fidelity_profiles.py [--root ../shared/profiles/vidur] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tailserve.executors.simulated.cost_model import Efficiency
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.profile_fit import (
    all_reduce_errors,
    fit_all_reduce,
    fit_linear,
    linear_errors,
    linear_errors_by_tp,
    tp_message_sizes,
)
from tailserve.executors.simulated.profiles import (
    VIDUR_GPUS,
    VIDUR_TOPOLOGIES,
    load_all_reduce,
    load_linear_profile,
)

ROOT = Path(__file__).resolve().parents[1] / ".." / "shared" / "profiles" / "vidur"
# Fit on these models; every other model of the GPU is held out.
TRAIN = {
    "a100": ("Meta-Llama-3-8B", "Llama-2-70b-hf"),
    "h100": ("Llama-2-70b-hf",),
    "a40": ("Llama-2-7b-hf",),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.environ.get("VIDUR_PROFILES", str(ROOT)))
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--by-tp", action="store_true", help="also break the linear errors down by TP")
    args = ap.parse_args()
    root = Path(args.root)
    console = Console()
    out: dict = {"linear": {}, "all_reduce": {}}
    for gpu, train in TRAIN.items():
        hw = get_hardware(VIDUR_GPUS[gpu])
        profiles = {
            p.parent.name: load_linear_profile(p)
            for p in sorted((root / "compute" / gpu).glob("*/*/mlp.csv"))
        }
        t0 = time.perf_counter()
        fitted = fit_linear([profiles[m] for m in train], hw)
        fit_s = time.perf_counter() - t0
        table = Table(
            title=f"{hw.name}: linear layers, one decoder layer, all TP degrees", title_justify="left"
        )
        for col in (
            "model",
            "set",
            "points",
            "default mean|e|",
            "default max|e|",
            "fitted mean|e|",
            "fitted max|e|",
            "fitted bias",
        ):
            table.add_column(col, justify="right" if col not in ("model", "set") else "left")
        rows = []
        for name, prof in profiles.items():
            before = linear_errors(prof, hw, Efficiency())  # the generic default: 0.6 / 0.8, max, no tile
            after = linear_errors(prof, hw, fitted)
            role = "train" if name in train else "held out"
            table.add_row(
                name, role, str(after.num_points),
                f"{before.mean_abs:.1%}", f"{before.max_abs:.1%}",
                f"{after.mean_abs:.1%}", f"{after.max_abs:.1%}", f"{after.bias:+.1%}",
            )  # fmt: skip
            rows.append({"model": name, "set": role, "default": asdict(before), "fitted": asdict(after)})
            if args.by_tp:
                for s in linear_errors_by_tp(prof, hw, fitted):
                    table.add_row(
                        f"  {s.name}",
                        "",
                        str(s.num_points),
                        "",
                        "",
                        f"{s.mean_abs:.1%}",
                        f"{s.max_abs:.1%}",
                        f"{s.bias:+.1%}",
                    )
        console.print(table)
        console.print(
            f"  fitted: compute {fitted.compute:.3f}, memory {fitted.memory:.3f}, sharpness {fitted.sharpness:g}, "
            f"tile {fitted.tile_m}, launch {fitted.gemm_latency * 1e6:.2f} us  ({fit_s:.1f} s to fit)"
        )
        out["linear"][hw.name] = {"train": list(train), "fitted": asdict(fitted), "rows": rows}
    for topo, hw_name in VIDUR_TOPOLOGIES.items():
        hw = get_hardware(hw_name)
        samples = tp_message_sizes(load_all_reduce(root / "network" / topo / "all_reduce.csv"))
        lats, eff = fit_all_reduce(samples, hw)
        generic = replace(hw, allreduce_latency_by_tp=(), comm_efficiency=None)
        fitted_hw = replace(hw, allreduce_latency_by_tp=tuple(lats.items()))
        before = all_reduce_errors(samples, generic, Efficiency().comm)
        after = all_reduce_errors(samples, fitted_hw, eff)
        table = Table(title=f"{topo} ({hw.name}): all-reduce, 8 KB - 128 MB", title_justify="left")
        for col in (
            "TP",
            "points",
            "catalog mean|e|",
            "catalog max|e|",
            "fitted mean|e|",
            "fitted max|e|",
            "fitted bias",
        ):
            table.add_column(col, justify="right")
        for b, a in zip(before, after):
            table.add_row(
                a.name,
                str(a.num_points),
                f"{b.mean_abs:.1%}",
                f"{b.max_abs:.1%}",
                f"{a.mean_abs:.1%}",
                f"{a.max_abs:.1%}",
                f"{a.bias:+.1%}",
            )
        console.print(table)
        lat_text = ", ".join(f"TP{tp} {v * 1e6:.1f} us" for tp, v in lats.items())
        console.print(
            f"  fitted: latency {lat_text}; link efficiency {eff:.3f} of {hw.interconnect_bandwidth / 1e9:.0f} GB/s"
        )
        out["all_reduce"][topo] = {
            "hardware": hw.name, "latency_s": lats, "comm_eff": eff,
            "catalog": [asdict(s) for s in before], "fitted": [asdict(s) for s in after],
        }  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
