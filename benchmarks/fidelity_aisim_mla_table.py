"""The MLA block priced from AISimulate's measured module rows (``--calibration aisim:FILE``), held out.

For each GPU, path (context = prefill, generation = decode) and projections' format, on vLLM's
MLA module rows (the rows ``fidelity_aisim.py``'s MLA part fits the catalog's ``MlaKernel`` on),
three splits, each priced by ``aisim_mla_table.py`` from the training rows alone and by the
catalog's ``MlaKernel`` (the cost model on a one-layer model of that many heads at TP 1, as
``fidelity_aisim.mla_part`` prices a row) on exactly the same held-out rows:

- **grid** (checkerboard): within each head count's series, the rows whose batch index plus
  length index (in the series' sorted batches and lengths) is odd are held out, half the rows;
  each is interpolated from the other half (bilinear in log batch and log length, the roofline
  fraction held past a row's ends, the same tokens at the longest prompt plus the catalog's
  attention past it). The catalog's fit saw half the head counts at every batch and length, so
  about half these rows were in its training set: its figures here flatter it;
- **heads**: the catalog's own split (head counts sorted, every other one held out: 2, 8, 16, 32,
  64, 128): the table has no series of a held-out head count (the cost model keeps the catalog's
  kernel there); here measured, as a way not taken, log time interpolated in log heads between
  the two training head counts around it at the same batch and length (past the largest, its
  roofline fraction held). The catalog's figures are held out here (fitted on the other heads);
- **long prompts** (context rows of GPUs timed past 512-token prompts, Blackwell): trained on the
  prompts up to 512 tokens, tested on the longer ones: how the rule past the longest prompt
  (Hopper's rows stop at 512) does, beside holding the roofline fraction and holding the time
  per token.

    python -m benchmarks.fidelity_aisim_mla_table --rows /tmp/aisim_rows.json [--gpus ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from itertools import product
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks._common import run_stamp, save_results
from benchmarks.fidelity_aisim import GPUS, MLA_FORMATS, _mla_layer, _mla_linear, _mla_shape, stats
from tailserve.executors.simulated.aisim_mla_table import (
    Grid,
    ModuleRoofline,
    context_seconds,
    grid_log_seconds,
)
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.hardware import get_hardware

LONG = 512  # the Hopper tables' longest prompt: the long-prompt split trains up to it
FORMATS = {**MLA_FORMATS, "nvfp4": "nvfp4"}  # TensorRT-LLM's tables time NVFP4 projections too


class Catalog:
    """The catalog's ``MlaKernel`` pricing one row, and its prefill attention per pair (the
    table's rule past the longest prompt), per head count."""

    def __init__(self, hw, weights: str, kv: str = "") -> None:
        self.hw, self.weights, self.kv = hw, weights, kv
        self.models: dict[int, CostModel] = {}

    def model(self, heads: int) -> CostModel:
        if heads not in self.models:
            layer = replace(_mla_layer(heads, self.weights), kv_dtype=self.kv)
            self.models[heads] = CostModel(layer, self.hw, 1)
        return self.models[heads]

    def seconds(self, phase: str, heads: int, batch: int, length: int) -> float:
        cm = self.model(heads)
        shape = _mla_shape(phase, batch, length)
        return _mla_linear(cm, shape.num_tokens) + cm.attention_time(shape) + cm.mla_fixed_time(shape)

    def pair_seconds(self, heads: int) -> float:
        cm = self.model(heads)
        return cm._prefill_pair_flops / cm._prefill_rates[0]


def price(grid: Grid, roof: ModuleRoofline, pair_s: float, phase: str, batch: float, length: float) -> float:
    """One row as ``MlaTable`` prices it from ``grid``."""
    if phase == "context":
        return context_seconds(grid, roof, pair_s, batch, length)
    return float(np.exp(grid_log_seconds(grid, roof, phase, batch, length))[0])


def grid_split(rows: list, phase: str, weights: str, hw, catalog: Catalog, kv_bytes: float) -> dict:
    """The checkerboard: per head count, the odd (batch index + length index) rows held out."""
    pred, cat, y = [], [], []
    for heads in sorted({r[0] for r in rows}):
        own = [r for r in rows if r[0] == heads]
        bs = sorted({r[1] for r in own})
        ls = sorted({r[2] for r in own})
        odd = [(bs.index(r[1]) + ls.index(r[2])) % 2 == 1 for r in own]
        grid = Grid.of([(r[1], r[2], r[3] * 1e-3) for r, o in zip(own, odd) if not o])
        roof = ModuleRoofline.of(heads, weights, hw, kv_bytes)
        pair_s = catalog.pair_seconds(heads)
        for r, o in zip(own, odd):
            if o:
                pred.append(price(grid, roof, pair_s, phase, r[1], r[2]))
                cat.append(catalog.seconds(phase, heads, r[1], r[2]))
                y.append(r[3] * 1e-3)
    y_a = np.array(y)
    return {"table": stats(np.array(pred), y_a), "catalog": stats(np.array(cat), y_a)}


def head_split(rows: list, phase: str, weights: str, hw, catalog: Catalog, kv_bytes: float) -> dict:
    """The catalog's head split: held-out head counts priced in log heads between training ones."""
    heads = sorted({r[0] for r in rows})
    train_heads = heads[0::2]
    grids = {h: Grid.of([(r[1], r[2], r[3] * 1e-3) for r in rows if r[0] == h]) for h in train_heads}
    roofs = {h: ModuleRoofline.of(h, weights, hw, kv_bytes) for h in heads}

    def at(h: int, batch: float, length: float) -> float:
        return np.log(price(grids[h], roofs[h], catalog.pair_seconds(h), phase, batch, length))

    pred, cat, y = [], [], []
    for r in rows:
        h = r[0]
        if h in grids:
            continue
        lo = max((t for t in train_heads if t < h), default=None)
        hi = min((t for t in train_heads if t > h), default=None)
        if lo is not None and hi is not None:
            w = (np.log(h) - np.log(lo)) / (np.log(hi) - np.log(lo))
            log_t = (1 - w) * at(lo, r[1], r[2]) + w * at(hi, r[1], r[2])
        else:  # past the training heads: the nearest one's roofline fraction held
            near = lo if lo is not None else hi
            assert near is not None
            ratio = roofs[h].seconds(phase, r[1], r[2]) / roofs[near].seconds(phase, r[1], r[2])
            log_t = at(near, r[1], r[2]) + np.log(ratio)
        pred.append(float(np.exp(log_t)))
        cat.append(catalog.seconds(phase, h, r[1], r[2]))
        y.append(r[3] * 1e-3)
    y_a = np.array(y)
    return {
        "held_out_heads": [h for h in heads if h not in grids],
        "table_log_heads": stats(np.array(pred), y_a),
        "catalog": stats(np.array(cat), y_a),
    }


def long_split(rows: list, weights: str, hw, catalog: Catalog, kv_bytes: float) -> dict | None:
    """Context rows trained on prompts up to ``LONG`` tokens, tested on longer ones: the rule
    past the longest prompt (``context_seconds``) beside two it was chosen over."""
    test = [r for r in rows if r[2] > LONG]
    if not test:
        return None
    rule, fraction, per_token, cat, y = [], [], [], [], []
    grids: dict[int, Grid] = {}
    for r in test:
        h = r[0]
        if h not in grids:
            grids[h] = Grid.of([(q[1], q[2], q[3] * 1e-3) for q in rows if q[0] == h and q[2] <= LONG])
        grid, roof = grids[h], ModuleRoofline.of(h, weights, hw, kv_bytes)
        rule.append(context_seconds(grid, roof, catalog.pair_seconds(h), r[1], r[2]))
        fraction.append(float(np.exp(grid_log_seconds(grid, roof, "context", r[1], r[2]))[0]))
        at_long = float(np.exp(grid_log_seconds(grid, roof, "context", r[1], LONG))[0])
        per_token.append(at_long * r[2] / LONG)
        cat.append(catalog.seconds("context", h, r[1], r[2]))
        y.append(r[3] * 1e-3)
    y_a = np.array(y)
    return {
        "held_out_rows": len(y),
        "same_tokens_plus_catalog_attention": stats(np.array(rule), y_a),
        "roofline_fraction_held": stats(np.array(fraction), y_a),
        "time_per_token_held": stats(np.array(per_token), y_a),
        "catalog": stats(np.array(cat), y_a),
    }


def _cell(s: dict) -> str:
    return f"{s['mean']:.1%} / {s['p90']:.1%} / {s['max']:.0%}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", required=True, help="an export of benchmarks/_aisim_tables.py (vLLM's)")
    parser.add_argument(
        "--gpus", default=",".join(GPUS), help="AISimulate system names (default: %(default)s)"
    )
    parser.add_argument(
        "--out", default=None, help="results JSON (default benchmarks/out/fidelity_aisim_mla_table.json)"
    )
    args = parser.parse_args()
    console = Console(width=200)
    body = json.loads(Path(args.rows).read_text())
    framework = body.get("framework", "vllm")
    if framework not in ("vllm", "trtllm"):
        print("fidelity_aisim_mla_table: vLLM's or TensorRT-LLM's tables (the others have no MLA rows)",
              file=sys.stderr)  # fmt: skip
        return 2
    tables = body["gpus"]
    start = time.time()
    results: dict = {
        **run_stamp("fidelity_aisim_mla_table", console.print),
        "framework": framework,
        "mla": {},
    }
    table = Table(
        title="MLA module per layer held out (vLLM 0.25, DeepSeek-V3 shapes, bf16 KV): |error| mean / p90 / max, "
        "the measured table interpolated vs the catalog's MlaKernel on the same rows"
    )
    for col in ("GPU", "path", "projections, KV", "(a) grid rows", "table", "catalog", "(b) heads rows",
                "table, log heads", "catalog (held out)", "(c) long rows", "rule", "roofline fraction",
                "time per token", "catalog"):  # fmt: skip
        table.add_column(col)
    for gpu in [g for g in args.gpus.split(",") if g]:
        entry = tables.get(gpu) or {}
        if gpu not in GPUS or not entry.get("mla_context") or not entry.get("mla_generation"):
            continue
        hw = get_hardware(GPUS[gpu])
        out: dict = {"versions": {p: entry.get(f"mla_{p}_version") for p in ("context", "generation")}}
        for phase, (table_fmt, weights), (kv, suffix) in product(
            ("context", "generation"), FORMATS.items(), (("", ""), ("fp8", "_fp8kv"))
        ):
            rows = [r[1:] for r in entry.get(f"mla_{phase}{suffix}", []) if r[0] == table_fmt and r[4] > 0]
            if not rows:
                continue
            catalog = Catalog(hw, weights, kv)
            kv_bytes = 1.0 if kv else 2.0
            res = {
                "rows": len(rows),
                "grid": grid_split(rows, phase, weights, hw, catalog, kv_bytes),
                "heads": head_split(rows, phase, weights, hw, catalog, kv_bytes),
            }
            long = long_split(rows, weights, hw, catalog, kv_bytes) if phase == "context" else None
            if long:
                res["long_prompts"] = long
            label = f"{phase}/{weights}" + (f"/{kv}kv" if kv else "")
            out[label] = res
            g, h = res["grid"], res["heads"]
            table.add_row(
                GPUS[gpu], phase, f"{weights}, {kv or 'bf16'}", str(g["table"]["n"]), _cell(g["table"]), _cell(g["catalog"]),
                str(h["catalog"]["n"]), _cell(h["table_log_heads"]), _cell(h["catalog"]),
                str(long["held_out_rows"]) if long else "-",
                _cell(long["same_tokens_plus_catalog_attention"]) if long else "-",
                _cell(long["roofline_fraction_held"]) if long else "-",
                _cell(long["time_per_token_held"]) if long else "-",
                _cell(long["catalog"]) if long else "-",
            )  # fmt: skip
        results["mla"][gpu] = out
    console.print(table)
    results["wall_s"] = round(time.time() - start, 1)
    save_results(results, args.out, "fidelity_aisim_mla_table.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
