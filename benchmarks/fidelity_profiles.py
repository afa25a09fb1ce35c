"""The cost model's linear layers and all-reduce against Vidur's measured GPU profiles.

For each GPU: fit the GEMM curve on the training models in both forms (one join per layer; per
GEMM with output tiles in waves over the SMs, gemm.py), keep the form with the lower training
error, and report mean / p99 / max |error| on every model (training and held-out) for the
generic default efficiencies and both fits. Then the all-reduce at TP 2/4/8: the catalog figures
before the fits, one line per TP (latency + link efficiency), and one line per message-size band;
fitted on the even-numbered sizes and tested on the odd-numbered ones, then refitted on all.
The fitted constants are what ``hardware.py`` holds.

    python benchmarks/fidelity_profiles.py [--root ../shared/profiles/vidur] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from tailserve.executors.simulated.cost_model import Efficiency
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.profile_fit import (
    LAYER_GRID,
    WAVE_GRID,
    _LinearTerms,
    _score,
    all_reduce_band_errors,
    all_reduce_errors,
    fit_all_reduce,
    fit_all_reduce_bands,
    fit_linear,
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


def _errors(prof, hw, eff) -> dict:
    t = _LinearTerms(prof, hw)
    e = np.abs(t.times(eff) / t.measured - 1.0)
    return {"mean": float(e.mean()), "p99": float(np.quantile(e, 0.99)), "max": float(e.max())}


def _cell(e: dict) -> str:
    return f"{e['mean']:.1%} / {e['p99']:.0%} / {e['max']:.0%}"


def _describe(eff: Efficiency) -> str:
    form = (
        f"waves tile {eff.tile_m}x{eff.tile_n} alpha {eff.wave_alpha:g}"
        if eff.tile_n
        else f"layer tile {eff.tile_m}"
    )
    return (
        f"{form}, compute {eff.compute:.3f}, memory {eff.memory:.3f}, sharpness {eff.sharpness:g}, "
        f"launch {eff.gemm_latency * 1e6:.2f} us"
    )


def linear(root: Path, console: Console, by_tp: bool) -> dict:
    out = {}
    for gpu, train in TRAIN.items():
        hw = get_hardware(VIDUR_GPUS[gpu])
        profiles = {
            p.parent.name: load_linear_profile(p)
            for p in sorted((root / "compute" / gpu).glob("*/*/mlp.csv"))
        }
        t0 = time.perf_counter()
        train_profiles = [profiles[m] for m in train]
        fits = {
            "layer": fit_linear(train_profiles, hw, LAYER_GRID),
            "waves": fit_linear(train_profiles, hw, WAVE_GRID),
        }
        terms = [_LinearTerms(p, hw) for p in train_profiles]
        train_score = {k: _score(terms, v)[0] for k, v in fits.items()}
        chosen = min(train_score, key=train_score.get)
        fit_s = time.perf_counter() - t0
        table = Table(
            title=f"{hw.name}: linear layers, one decoder layer, all TP degrees (mean / p99 / max |error|)",
            title_justify="left",
        )
        for col in ("model", "set", "rows", "generic", "layer fit", "waves fit"):
            table.add_column(col, justify="left" if col in ("model", "set") else "right")
        rows = []
        for name, prof in profiles.items():
            role = "train" if name in train else "held out"
            cells = {
                "generic": _errors(prof, hw, Efficiency()),
                **{k: _errors(prof, hw, v) for k, v in fits.items()},
            }
            table.add_row(
                name, role, str(len(prof.samples)), *(_cell(cells[k]) for k in ("generic", "layer", "waves"))
            )
            rows.append({"model": name, "set": role, **cells})
            if by_tp:
                for s in linear_errors_by_tp(prof, hw, fits[chosen]):
                    table.add_row(
                        f"  {s.name}",
                        "",
                        str(s.num_points),
                        "",
                        "",
                        f"{s.mean_abs:.1%} / - / {s.max_abs:.0%}",
                    )
        console.print(table)
        for k, v in fits.items():
            mark = "  <- chosen (lower training error)" if k == chosen else ""
            console.print(f"  {k}: {_describe(v)}; training mean |e| {train_score[k]:.2%}{mark}")
        console.print(f"  ({fit_s:.1f} s to fit both forms)")
        out[hw.name] = {
            "train": list(train),
            "fits": {k: asdict(v) for k, v in fits.items()},
            "train_score": train_score,
            "chosen": chosen,
            "rows": rows,
        }
    return out


def _split(samples):
    """Alternate sizes per TP degree: even-numbered to fit, odd-numbered to test."""
    fit, test = [], []
    for tp in sorted({s.num_gpus for s in samples}):
        these = sorted((s for s in samples if s.num_gpus == tp), key=lambda s: s.num_bytes)
        fit += these[0::2]
        test += these[1::2]
    return fit, test


def all_reduce(root: Path, console: Console) -> dict:
    out = {}
    for topo, hw_name in VIDUR_TOPOLOGIES.items():
        hw = get_hardware(hw_name)
        samples = tp_message_sizes(load_all_reduce(root / "network" / topo / "all_reduce.csv"))
        fit_half, test_half = _split(samples)
        generic = replace(hw, allreduce_latency_by_tp=(), comm_efficiency=None, allreduce_bands=())
        lats, eff = fit_all_reduce(fit_half, hw)
        line_hw = replace(
            hw, allreduce_latency_by_tp=tuple(lats.items()), comm_efficiency=eff, allreduce_bands=()
        )
        band_hw = replace(hw, allreduce_bands=fit_all_reduce_bands(fit_half, hw))
        results = {
            "catalog before": all_reduce_errors(test_half, generic, Efficiency().comm),
            "one line": all_reduce_errors(test_half, line_hw, eff),
            "bands": all_reduce_band_errors(test_half, band_hw),
        }
        table = Table(
            title=f"{topo} ({hw.name}): all-reduce 8 KB - 128 MB, odd-numbered sizes held out (mean / p99 / max |error|)",
            title_justify="left",
        )
        for col in ("TP", "points", *results):
            table.add_column(col, justify="right")
        by_name: dict = {}
        for tp_stats in zip(*results.values()):
            n = tp_stats[0].name
            these = [s for s in test_half if f"TP{s.num_gpus}" == n]
            table.add_row(
                n,
                str(len(these)),
                *(
                    f"{s.mean_abs:.1%} / {_p99(s, these, hw_, k):.0%} / {s.max_abs:.0%}"
                    for s, hw_, k in zip(tp_stats, (generic, line_hw, band_hw), results)
                ),
            )
            by_name[n] = {k: asdict(s) for k, s in zip(results, tp_stats)}
        console.print(table)
        all_bands = fit_all_reduce_bands(samples, hw)
        console.print("  bands refitted on every size (the catalog's):")
        for b in all_bands:
            console.print(
                f"    TP{b.tp} <= {b.max_bytes / 2**20:g} MiB: latency {b.latency * 1e6:.1f} us, "
                f"{b.efficiency:.3f} of {hw.interconnect_bandwidth / 1e9:.0f} GB/s"
            )
        out[topo] = {"hardware": hw.name, "held_out": by_name, "bands": [asdict(b) for b in all_bands]}
    return out


def _p99(stats, samples, hw, kind) -> float:
    from tailserve.executors.simulated.profile_fit import all_reduce_band_time, all_reduce_time

    tp = samples[0].num_gpus
    b = np.array([s.num_bytes for s in samples], dtype=float)
    y = np.array([s.seconds for s in samples])
    if kind == "bands":
        pred = all_reduce_band_time(hw.allreduce_bands_at(tp), hw.interconnect_bandwidth, b)
    else:
        pred = all_reduce_time(hw, hw.comm_efficiency or Efficiency().comm, tp, b)
    return float(np.quantile(np.abs(pred / y - 1.0), 0.99))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.environ.get("VIDUR_PROFILES", str(ROOT)))
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--by-tp", action="store_true", help="also break the chosen fit's errors down by TP")
    ap.add_argument("--parts", default="linear,all_reduce", help="comma-separated: linear, all_reduce")
    args = ap.parse_args()
    root = Path(args.root)
    console = Console(width=200)
    parts = set(args.parts.split(","))
    out: dict = {"inf": math.inf}
    if "linear" in parts:
        out["linear"] = linear(root, console, args.by_tp)
    if "all_reduce" in parts:
        out["all_reduce"] = all_reduce(root, console)
    out.pop("inf")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
