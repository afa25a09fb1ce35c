"""Where the GEMM kernel-choice jumps in Vidur's GPU profiles fall, and whether the training
models' GEMMs predict the held-out models' jumps.

Each GEMM is read on its own (``gemm_regimes.py``: model, op, TP, its ``(N, K)`` on the shard).
Four questions, per GPU (the training / held-out split of ``fidelity_profiles.py``):

1. **Is a jump a property of the shape?** Pairs of different models whose GEMM has the same
   ``(N, K)`` (CodeLlama-34B's QKV and output projections are Llama-2-70B's; Llama-2-7B's output
   projection is Llama-3-8B's, its QKV at TP 2t is Llama-3-8B's at TP t): how far apart their
   measured times are at the same token count, and whether their jumps fall at the same counts.
2. **Where the jumps fall**: for every series, the token counts where its time moves from the
   previous count's by > 15% beyond the curve's own step (the wave form's tiles and waves).
3. **Do the held-out jumps appear in the training series?** Of each held-out series' jumps,
   the share that its reference training series (same shape; else the nearest in
   ``(log N, log K)``) also has within one grid step.
4. **A regime correction, held out**: the wave-form curve (fitted on the training layers, as
   ``fidelity_profiles.py`` does) times a training GEMM's measured / curve ratio at the same
   token count: ``exact`` (same shape only), ``nearest`` (nearest shape), ``by-tokens`` (the
   median ratio of all training GEMMs at that count: a rule in the token count alone); and the
   tile-choice form (each GEMM at the fastest of five tile shapes, each at a fitted fraction of
   the curve's compute efficiency). Layer errors (the four GEMMs summed) mean / p99 / max.

    python benchmarks/fidelity_gemm_jumps.py [--root ../shared/profiles/vidur] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from tailserve.executors.simulated.cost_model import Efficiency
from tailserve.executors.simulated.gemm_regimes import (
    MODES,
    by_layer,
    jumps,
    layer_times,
    load_gemm_series,
    pair_agreement,
    reference,
    same_shape_pairs,
)
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.profile_fit import WAVE_GRID, fit_linear
from tailserve.executors.simulated.profiles import VIDUR_GPUS, load_linear_profile
from tailserve.executors.simulated.tile_choice import fit_tile_choice, tile_choice_times

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent / ".." / "shared" / "profiles" / "vidur"
TRAIN = {
    "a100": ("Meta-Llama-3-8B", "Llama-2-70b-hf"),
    "h100": ("Llama-2-70b-hf",),
    "a40": ("Llama-2-7b-hf",),
}
THRESHOLD = 0.15


def _stats(pred: np.ndarray, meas: np.ndarray) -> dict:
    e = np.abs(pred / meas - 1.0)
    return {"mean": float(e.mean()), "p99": float(np.quantile(e, 0.99)), "max": float(e.max())}


def _cell(s: dict) -> str:
    return f"{s['mean']:.1%} / {s['p99']:.0%} / {s['max']:.0%}"


def _near(m: int, counts: list[int], grid: np.ndarray) -> bool:
    """m within one grid step of one of ``counts``."""
    i = int(np.searchsorted(grid, m))
    window = set(grid[max(0, i - 1) : i + 2].tolist())
    return any(c in window for c in counts)


def _jump_list(counts: list[int], limit: int = 14) -> str:
    text = ", ".join(str(c) for c in counts[:limit])
    return text + (f" (+{len(counts) - limit})" if len(counts) > limit else "")


def gpu_report(root: Path, gpu: str, console: Console) -> dict:
    hw = get_hardware(VIDUR_GPUS[gpu])
    files = sorted((root / "compute" / gpu).glob("*/*/mlp.csv"))
    train_names = TRAIN[gpu]
    t0 = time.perf_counter()
    eff: Efficiency = fit_linear(
        [load_linear_profile(f) for f in files if f.parent.name in train_names], hw, WAVE_GRID
    )
    fit_s = time.perf_counter() - t0
    series = [s for f in files for s in load_gemm_series(f)]
    train = [s for s in series if s.model in train_names]
    grid = np.unique(np.concatenate([s.tokens for s in series]))
    jumps_of = {s.label: jumps(s, hw, eff, THRESHOLD) for s in series}  # each series' jumps, once
    console.rule(f"{hw.name}: train {', '.join(train_names)}")
    console.print(
        f"wave-form curve (fitted on the training layers, {fit_s:.0f} s): tile {eff.tile_m}x{eff.tile_n}, "
        f"alpha {eff.wave_alpha:g}, compute {eff.compute:.3f}, memory {eff.memory:.3f}, "
        f"sharpness {eff.sharpness:g}, launch {eff.gemm_latency * 1e6:.2f} us"
    )
    out: dict = {"hardware": hw.name, "train": list(train_names), "curve": asdict(eff)}

    # 1. The same GEMM measured in two models' profiles.
    pairs = same_shape_pairs(series)
    table = Table(
        title="same (N, K) in two models: |time_b / time_a - 1| at equal token counts", title_justify="left"
    )
    for col in ("GEMM a", "GEMM b", "counts", "median", "p90", "max", "jumps a", "jumps b", "shared"):
        table.add_column(col, justify="left" if col.startswith("GEMM") else "right")
    out["same_shape"] = []
    for a, b in pairs:
        d = pair_agreement(a, b)
        ja, jb = jumps_of[a.label], jumps_of[b.label]
        shared = sum(1 for m in jb if _near(m, ja, grid))
        table.add_row(
            a.label, b.label, str(d.size), f"{np.median(d):.1%}", f"{np.quantile(d, 0.9):.1%}",
            f"{d.max():.0%}", str(len(ja)), str(len(jb)), f"{shared}/{len(jb)}",
        )  # fmt: skip
        out["same_shape"].append(
            {
                "a": a.label,
                "b": b.label,
                "median": float(np.median(d)),
                "p90": float(np.quantile(d, 0.9)),
                "max": float(d.max()),
                "jumps_a": ja,
                "jumps_b": jb,
                "jumps_b_in_a": shared,
            }
        )
    console.print(table)

    # 2 and 3. Where every series jumps; how many of a held-out series' jumps its reference has.
    table = Table(
        title=f"held-out GEMMs: jumps (> {THRESHOLD:.0%} beyond the curve's step; every series in the JSON)",
        title_justify="left",
    )
    for col in ("GEMM", "set", "jumps at token counts", "reference (training)", "in reference"):
        table.add_column(col, justify="left" if col != "in reference" else "right")
    out["jumps"] = []
    found = total = 0
    chance: list[float] = []
    for s in series:
        js = jumps_of[s.label]
        role = "train" if s.model in train_names else "held out"
        row = {"gemm": s.label, "set": role, "jumps": js}
        if role == "held out":
            ref = reference(s, train, "nearest")
            assert ref is not None
            rj = jumps_of[ref.label]
            hits = sum(1 for m in js if _near(m, rj, grid))
            found, total = found + hits, total + len(js)
            # The same count against every other training series: how often a jump lands near
            # some other GEMM's jump by the shared tile boundaries alone.
            others = [t for t in train if t is not ref]
            if js and others:
                chance.append(
                    float(np.mean([sum(1 for m in js if _near(m, jumps_of[t.label], grid)) for t in others]))
                    / len(js)
                )
            same = "same shape" if ref.shape == s.shape else "nearest"
            row.update(reference=ref.label, same_shape=ref.shape == s.shape, reference_jumps=rj, found=hits)
            table.add_row(s.label, role, _jump_list(js), f"{ref.label}, {same}", f"{hits}/{len(js)}")
        out["jumps"].append(row)
    console.print(table)
    base = float(np.mean(chance)) if chance else float("nan")
    console.print(
        f"held-out jumps also in the reference series (+-1 grid step): {found}/{total} "
        f"({found / max(total, 1):.0%}); in another training series, on average: {base:.0%}"
    )
    out["held_out_jumps_found"] = [found, total]
    out["held_out_jumps_chance"] = base

    # 4. Layer errors: the curve alone and with each regime transfer.
    table = Table(title="linear layers (4 GEMMs summed), mean / p99 / max |error|", title_justify="left")
    t0 = time.perf_counter()
    choice = fit_tile_choice(list(by_layer(train).values()), hw, eff)
    console.print(
        "tile choice (fitted on the training layers, "
        f"{time.perf_counter() - t0:.0f} s): "
        + ", ".join(f"{tm}x{tn} x{sc:g}" for (tm, tn), sc in zip(choice.tiles, choice.scales))
        + f" of compute {eff.compute:.3f}; launch {choice.eff.gemm_latency * 1e6:.2f} us"
    )
    out["tile_choice"] = {
        "tiles": choice.tiles,
        "scales": choice.scales,
        "gemm_latency": choice.eff.gemm_latency,
    }
    variants = ("waves", *(f"waves + {m}" for m in MODES), "tile choice")
    for col in ("model", "set", "rows", *variants):
        table.add_column(col, justify="left" if col in ("model", "set") else "right")
    per_model: dict[str, dict[str, list[np.ndarray]]] = defaultdict(lambda: defaultdict(list))
    for (model, _tp), layer in by_layer(series).items():
        # A training model is priced from the other training models only (its own ratios
        # would reproduce it exactly).
        pool = [t for t in train if t.model != model]
        for v in variants:
            mode = v.split(" + ")[-1]
            if v == "tile choice":
                pred, meas = layer_times(
                    layer, hw, eff, None, mode, price=lambda g: tile_choice_times(g, hw, choice)
                )
            else:
                pred, meas = layer_times(layer, hw, eff, None if v == "waves" else pool, mode)
            per_model[model][v].append(np.stack([pred, meas]))
    out["layers"] = {}
    for model, cells in per_model.items():
        role = "train" if model in train_names else "held out"
        stats = {}
        for v in variants:
            both = np.concatenate(cells[v], axis=1)
            stats[v] = _stats(both[0], both[1])
        n = np.concatenate(cells["waves"], axis=1).shape[1]
        table.add_row(model, role, str(n), *(_cell(stats[v]) for v in variants))
        out["layers"][model] = {"set": role, "rows": n, **stats}
    console.print(table)
    console.print(
        "  (a training model is priced from the other training models' GEMMs; with one training "
        "model, its own rows get the curve alone; the tile choice is fitted on every training model)"
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.environ.get("VIDUR_PROFILES", str(ROOT)))
    ap.add_argument("--gpus", default="a100,h100,a40")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    console = Console(width=220)
    root = Path(args.root)
    out = {gpu: gpu_report(root, gpu, console) for gpu in args.gpus.split(",")}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
