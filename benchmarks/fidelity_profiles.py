"""The cost model against measured GPU figures: Vidur's linear-layer and all-reduce profiles, and
end-to-end points others published (``--parts``, default ``linear,all_reduce,published``).

**linear**: for each GPU, fit the GEMM curve on the training models in both forms (one join per
layer; per GEMM with output tiles in waves over the SMs, gemm.py), keep the form with the lower
training error, and report mean / p99 / max |error| on every model (training and held-out) for the
generic default efficiencies and both fits. **all_reduce**: at TP 2/4/8, the catalog figures
before the fits, one line per TP (latency + link efficiency), and one line per message-size band;
fitted on the even-numbered sizes and tested on the odd-numbered ones, then refitted on all.
The fitted constants are what ``hardware.py`` holds. Both read Vidur's profiles (``--root``,
``$VIDUR_PROFILES``, default ``../shared/profiles/vidur`` beside the clone).

**published** (no profiles needed; docs/fidelity.md):
vLLM's nightly latency benchmark (buildkite vllm/performance-benchmark build 9515, "Latency
tests"): ``benchmark_latency`` with 32 input tokens, 128 output tokens, a fixed batch of 8, on one
H200 node; the figure is the mean end-to-end latency of one batch. Here: 8 requests of 32 prompt
tokens and 128 outputs arrive together, ``vllm`` (V1 defaults for the H200), uncalibrated model;
the batch's latency is the last finish.

Single-request decode speed (``vllm bench serve --max-concurrency 1``, fixed lengths, EOS
ignored): one request alone, the figure is its TPOT (time per output token after the first),
mean of (E2E - TTFT) / (output - 1):

- A100-40GB, Llama-3.1-8B-Instruct bf16, vLLM 0.23.0, 1,024 input / 128 output tokens: "about
  75 tokens/sec" at concurrency 1, i.e. 13.3 ms per token (johnmusgrave.com, "vLLM
  throughput-latency sweep on NVIDIA A100"; the figure is rounded by its author).
- H100-80GB-HBM3, Llama-3.1-8B-Instruct fp16, vLLM 0.21.0, concurrency 1: TPOT p50 6.48 ms
  (yobitelcomm.github.io/bench, recipe "concurrency sweep", workload ``llm.inference.chatbot-short``,
  whose lengths the page does not give: simulated as 128 input / 128 output tokens; at batch 1
  the decode step is the weight read, so the context length barely moves it).

``--variant`` prices the published points with the candidate forms that are not the default
(hardware.py: the H100's per-GEMM wave curve, the NCCL all-reduce bands, the GEMM tile choice of
tile_choice.py on the A100 and H100 curves; docs/fidelity.md).

    python -m benchmarks.fidelity_profiles [--parts linear,all_reduce,published] [--by-tp]
        [--variant catalog|waves|bands|both|tiles] [--root ../shared/profiles/vidur] [--json OUT]
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

from benchmarks._common import cpu_line, save_results
from tailserve.assemble import BuildOptions, build_engine
from tailserve.core.request import Request
from tailserve.core.source import ListSource
from tailserve.executors.simulated.cost_model import CostModel, Efficiency
from tailserve.executors.simulated.deployment import BuiltCostModel, Deployment, build_cost_model
from tailserve.executors.simulated.hardware import (
    A100_ALLREDUCE_BANDS,
    A100_GEMM_TILES,
    A100_TILE_SCALES,
    H100_ALLREDUCE_BANDS,
    H100_GEMM_TILES,
    H100_GEMM_WAVES,
    H100_TILE_SCALES,
    TILE_CHOICE_TILES,
    Hardware,
    get_hardware,
)
from tailserve.executors.simulated.models import get_model
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
from tailserve.executors.simulated.tile_choice import TileChoiceCostModel

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


# (label, model, GPU, TP, batch, input, output, measured ms, source); batch latency points
POINTS = (
    ("vLLM nightly latency_llama70B_tp4", "Llama-3-70B", "H200", 4, 8, 32, 128, 2077.53, "buildkite vllm/performance-benchmark #9515"),
    ("vLLM nightly latency_llama8B_tp1", "Llama-3.1-8B", "H200", 1, 8, 32, 128, 833.421, "buildkite vllm/performance-benchmark #9515"),
)  # fmt: skip


# (label, model, GPU, TP, input, output, measured TPOT ms, source); concurrency-1 decode points
TPOT_POINTS = (
    ("vLLM 0.23 bench serve, concurrency 1", "Llama-3.1-8B", "A100-40GB", 1, 1024, 128, 1000 / 75, "johnmusgrave.com vLLM throughput-latency sweep on A100"),
    ("vLLM 0.21 chatbot-short, concurrency 1", "Llama-3.1-8B", "H100-SXM", 1, 128, 128, 6.48, "yobitelcomm.github.io/bench concurrency-sweep recipe"),
)  # fmt: skip


def generic(model: str, gpu: str, tp: int) -> CostModel:
    """The cost model before the fitted curves: generic efficiencies, one 8 us all-reduce latency."""
    hw = replace(
        get_hardware(gpu), gemm=None, allreduce_latency_by_tp=(), comm_efficiency=None, allreduce_bands=()
    )
    return CostModel(get_model(model), hw, tp)


def batch_latency(cm: CostModel, batch: int, n_in: int, n_out: int) -> tuple[float, float, int]:
    """(the batch's latency, its mean decode step, the number of iterations)."""
    reqs = [Request(f"r{i}", n_in, n_out, 0.0) for i in range(batch)]
    options = BuildOptions(shares_prefixes=False, cpu_swap=False)
    built = BuiltCostModel(cm, "none")  # an uncalibrated cost model made here
    engine = build_engine(built, "vllm", "sim", options, source=ListSource(reqs)).engine
    engine.run()
    decode = [d for d, p in zip(engine.log.duration, engine.log.num_prefill_tokens) if p == 0]
    return max(r.finish_time for r in reqs), sum(decode) / len(decode), len(engine.log.duration)


def variant_hardware(gpu: str, variant: str) -> Hardware:
    hw = get_hardware(gpu)
    hopper = hw.name in ("H100-SXM", "H200")
    if variant in ("waves", "both") and hopper:
        hw = replace(hw, gemm=H100_GEMM_WAVES)
    if variant in ("bands", "both") and (hopper or hw.name.startswith("A100")):
        hw = replace(hw, allreduce_bands=H100_ALLREDUCE_BANDS if hopper else A100_ALLREDUCE_BANDS)
    return hw


def tile_choice_model(model: str, gpu: str, tp: int) -> CostModel:
    """The tile-choice candidate (tile_choice.py) with the GPU's fitted curve and factors."""
    hw = get_hardware(gpu)
    hopper = hw.name in ("H100-SXM", "H200")
    if not (hopper or hw.name.startswith("A100")):
        return CostModel(get_model(model), hw, tp)
    curve, scales = (H100_GEMM_TILES, H100_TILE_SCALES) if hopper else (A100_GEMM_TILES, A100_TILE_SCALES)
    hw = replace(hw, gemm=curve)
    return TileChoiceCostModel(
        get_model(model), hw, tp, Efficiency.for_hardware(hw), TILE_CHOICE_TILES, scales
    )


def lone_tpot(cm: CostModel, n_in: int, n_out: int) -> float:
    """TPOT of one request running alone: (E2E - TTFT) / (output - 1)."""
    req = Request("r0", n_in, n_out, 0.0)
    options = BuildOptions(shares_prefixes=False, cpu_swap=False)
    build_engine(BuiltCostModel(cm, "none"), "vllm", "sim", options, source=ListSource([req])).engine.run()
    return (req.token_times[-1] - req.token_times[0]) / (n_out - 1)


def published(console: Console, variant: str) -> dict:
    """The published end-to-end points (``POINTS``, ``TPOT_POINTS``) priced by the simulator,
    uncalibrated, with the cost model of ``variant``; printed as two tables and returned as rows."""
    rows: dict = {"variant": variant, "batch_latency": [], "tpot": []}

    def model_for(model: str, gpu: str, tp: int) -> CostModel:
        if variant == "catalog":
            return build_cost_model(Deployment(model, gpu, tp, "none")).cost_model
        if variant == "tiles":
            return tile_choice_model(model, gpu, tp)
        return CostModel(get_model(model), variant_hardware(gpu, variant), tp)

    table = Table(title=f"published end-to-end points (uncalibrated, {variant})", title_justify="left")
    cols = (
        "point",
        "model / GPU / TP",
        "measured ms",
        "predicted ms",
        "error",
        "decode step ms",
        "implied overhead ms",
        "generic ms",
        "generic error",
    )
    for col in cols:
        table.add_column(col, justify="right" if "ms" in col or col == "error" else "left")
    for label, model, gpu, tp, batch, n_in, n_out, ms, _source in POINTS:
        cm = model_for(model, gpu, tp)
        t, step, iters = batch_latency(cm, batch, n_in, n_out)
        g, _, _ = batch_latency(generic(model, gpu, tp), batch, n_in, n_out)
        # The per-iteration overhead that would make the prediction exact (time is linear in it
        # and the schedule does not depend on it: every request arrives at 0).
        implied = cm.efficiency.overhead + (ms * 1e-3 - t) / iters
        rows["batch_latency"].append(
            {"point": label, "measured_ms": ms, "predicted_ms": round(t * 1e3, 2), "error": round(t * 1e3 / ms - 1, 4),
             "implied_overhead_ms": round(implied * 1e3, 3), "generic_ms": round(g * 1e3, 2)}
        )  # fmt: skip
        table.add_row(
            label, f"{model} / {gpu} / {tp}", f"{ms:,.1f}", f"{t * 1e3:,.1f}", f"{t * 1e3 / ms - 1:+.1%}",
            f"{step * 1e3:.2f}", f"{implied * 1e3:.2f}", f"{g * 1e3:,.1f}", f"{g * 1e3 / ms - 1:+.1%}",
        )  # fmt: skip
    console.print(table)
    tpot = Table(title=f"single-request TPOT (uncalibrated, {variant})", title_justify="left")
    for col in (
        "point",
        "model / GPU / TP",
        "in / out",
        "measured ms",
        "predicted ms",
        "error",
        "implied overhead ms",
        "generic ms",
        "generic error",
    ):
        tpot.add_column(col, justify="left" if col in ("point", "model / GPU / TP") else "right")
    for label, model, gpu, tp, n_in, n_out, ms, _source in TPOT_POINTS:
        cm = model_for(model, gpu, tp)
        t = lone_tpot(cm, n_in, n_out) * 1e3
        implied = cm.efficiency.overhead * 1e3 + ms - t  # one iteration per output token
        g = lone_tpot(generic(model, gpu, tp), n_in, n_out) * 1e3
        rows["tpot"].append(
            {"point": label, "measured_ms": round(ms, 3), "predicted_ms": round(t, 3), "error": round(t / ms - 1, 4),
             "implied_overhead_ms": round(implied, 3), "generic_ms": round(g, 3)}
        )  # fmt: skip
        tpot.add_row(
            label, f"{model} / {gpu} / {tp}", f"{n_in} / {n_out}", f"{ms:.2f}", f"{t:.2f}", f"{t / ms - 1:+.1%}",
            f"{implied:.2f}", f"{g:.2f}", f"{g / ms - 1:+.1%}",
        )  # fmt: skip
    console.print(tpot)
    print("sources: " + "; ".join(sorted({p[-1] for p in (*POINTS, *TPOT_POINTS)})))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.environ.get("VIDUR_PROFILES", str(ROOT)))
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--by-tp", action="store_true", help="also break the chosen fit's errors down by TP")
    ap.add_argument(
        "--parts",
        default="linear,all_reduce,published",
        help="comma-separated: linear, all_reduce, published (default: %(default)s)",
    )
    ap.add_argument(
        "--variant",
        choices=("catalog", "waves", "bands", "both", "tiles"),
        default="catalog",
        help="the cost model the published points are priced with (default: %(default)s)",
    )
    args = ap.parse_args()
    root = Path(args.root)
    console = Console(width=200)
    parts = set(args.parts.split(","))
    out: dict = {"inf": math.inf}
    print(cpu_line())
    if "linear" in parts:
        out["linear"] = linear(root, console, args.by_tp)
    if "all_reduce" in parts:
        out["all_reduce"] = all_reduce(root, console)
    if "published" in parts:
        out["published"] = published(console, args.variant)
    out.pop("inf")
    save_results(json.loads(json.dumps(out, default=str)), args.json, "fidelity_profiles.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
