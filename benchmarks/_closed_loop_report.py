"""The closed loop's numbers: predicted vs measured per cell, the errors against the issue's
targets (p50 within 10%, p99 within 20%), and whether the flag settings rank the same.

A cell's metrics are ``vllm bench serve``'s (``bench/result.py``): TTFT, ITL and TPOT p50/p99 in
ms and output tokens/s. Ranking, per engine and workload, over its settings, for each metric:
Spearman's rho (average ranks for ties) and the share of setting pairs ordered the same way;
a pair whose measured values differ by less than ``TIE`` is a tie the measurement cannot order
and is left out of the pairwise share (it still counts in rho).
"""

from __future__ import annotations

import math
from itertools import combinations
from typing import Any

import numpy as np

METRICS = (
    ("ttft_p50", "p50_ttft_ms"),
    ("ttft_p99", "p99_ttft_ms"),
    ("itl_p50", "p50_itl_ms"),
    ("itl_p99", "p99_itl_ms"),
    ("tpot_p50", "p50_tpot_ms"),
    ("tpot_p99", "p99_tpot_ms"),
    ("throughput", "output_throughput"),
)
P50_TARGET, P99_TARGET = 0.10, 0.20
TIE = 0.05


def figures(result: dict[str, Any]) -> dict[str, float]:
    return {name: float(result[key]) for name, key in METRICS}


def errors(predicted: dict[str, float], measured: dict[str, float]) -> dict[str, float]:
    return {k: predicted[k] / measured[k] - 1.0 if measured[k] else math.nan for k in measured}


def within_target(metric: str, error: float) -> bool:
    limit = P99_TARGET if metric.endswith("p99") else P50_TARGET
    return abs(error) <= limit


def _ranks(values: list[float]) -> np.ndarray:
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(len(values), dtype=float)
    for v in set(values):  # ties share their average rank
        idx = [i for i, x in enumerate(values) if x == v]
        ranks[idx] = ranks[idx].mean()
    return ranks


def spearman(predicted: list[float], measured: list[float]) -> float:
    if len(predicted) < 3:
        return math.nan
    a, b = _ranks(predicted), _ranks(measured)
    if a.std() == 0 or b.std() == 0:
        return math.nan
    return float(np.corrcoef(a, b)[0, 1])


def pairwise(predicted: list[float], measured: list[float]) -> tuple[int, int]:
    """(pairs ordered the same, pairs the measurement orders), ties under ``TIE`` left out."""
    same = total = 0
    for i, j in combinations(range(len(measured)), 2):
        if abs(measured[i] - measured[j]) < TIE * max(abs(measured[i]), abs(measured[j])):
            continue
        total += 1
        same += (predicted[i] - predicted[j]) * (measured[i] - measured[j]) > 0
    return same, total


def rankings(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per engine and workload with >= 2 measured settings: rho and pairwise per metric."""
    out = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in cells:
        if c.get("measured") and c.get("predicted"):
            groups.setdefault((c["engine"], c["workload"], c.get("pass", 0)), []).append(c)
    for (engine, workload, pass_no), group in groups.items():
        if len(group) < 2:
            continue
        row: dict[str, Any] = {
            "engine": engine,
            "workload": workload,
            "settings": [c["setting"] for c in group],
        }
        if pass_no:
            row["pass"] = pass_no
        for name, _ in METRICS:
            p = [c["predicted"][name] for c in group]
            m = [c["measured"][name] for c in group]
            same, total = pairwise(p, m)
            row[name] = {"spearman": spearman(p, m), "pairs_same": same, "pairs": total}
        out.append(row)
    return out


def target_shares(cells: list[dict[str, Any]], key: str = "error") -> dict[str, dict[str, Any]]:
    """Per engine: cells whose every p50 is within 10% and every p99 within 20% (TTFT, ITL,
    TPOT), and the share of single figures within their target; ``key`` names the errors
    (``error_uncorrected``: the twin without the gauge's rescaling)."""
    out: dict[str, dict[str, Any]] = {}
    for c in cells:
        if not (c.get("measured") and c.get(key)):
            continue
        e = out.setdefault(
            c["engine"], {"cells": 0, "cells_all_within": 0, "figures": 0, "figures_within": 0}
        )
        oks = [within_target(k, v) for k, v in c[key].items() if k != "throughput"]
        e["cells"] += 1
        e["cells_all_within"] += all(oks)
        e["figures"] += len(oks)
        e["figures_within"] += sum(oks)
    return out


def print_cells(cells: list[dict[str, Any]]) -> None:
    head = f"{'engine':<10} {'workload':<14} {'setting':<20}"
    for name, _ in METRICS:
        head += f" {name + ' pred/meas':>24}"
    print(head)
    for c in cells:
        setting = c["setting"] + (f" #{c['pass'] + 1}" if c.get("pass") else "")
        line = f"{c['engine']:<10} {c['workload']:<14} {setting:<20}"
        if not c.get("measured"):
            print(line + f" not run: {c.get('skipped', '?')}")
            continue
        for name, _ in METRICS:
            p, m, e = c["predicted"][name], c["measured"][name], c["error"][name]
            line += f" {p:>8.1f}/{m:<8.1f}{e:>+7.0%}"
        print(line)


def print_rankings(rows: list[dict[str, Any]]) -> None:
    print(f"{'engine':<10} {'workload':<14}" + "".join(f" {name:>14}" for name, _ in METRICS))
    for r in rows:
        workload = r["workload"] + (f" #{r['pass'] + 1}" if r.get("pass") else "")
        line = f"{r['engine']:<10} {workload:<14}"
        for name, _ in METRICS:
            x = r[name]
            rho = "  nan" if math.isnan(x["spearman"]) else f"{x['spearman']:+.2f}"
            line += f" {rho:>6} {x['pairs_same']:>3}/{x['pairs']:<3}"
        print(line)


def print_stalls(cells: list[dict[str, Any]]) -> None:
    """Per cell: the real engine's stalls, how many the twin has too, and how many it blames on
    the prefill the recording shows in flight (``fidelity/stall_check.py``)."""
    rows = [c for c in cells if c.get("stalls")]
    if not rows:
        return
    print("\nthe real engine's stalls against the twin's explanation (explain --measured):")
    print(
        f"{'engine':<10} {'workload':<14} {'setting':<20} {'stalls':>6} {'caught':>6} {'same cause':>10} {'twin only':>9}"
    )
    for c in rows:
        s = c["stalls"]
        setting = c["setting"] + (f" #{c['pass'] + 1}" if c.get("pass") else "")
        print(
            f"{c['engine']:<10} {c['workload']:<14} {setting:<20} {s['real_stalls']:>6} "
            f"{s['caught']:>6} {s['same_cause']:>10} {s['twin_only']:>9}"
        )


def stall_totals(cells: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per engine and workload: the real stalls, caught by the twin, blamed on the same prefill."""
    out: dict[str, dict[str, int]] = {}
    for c in cells:
        s = c.get("stalls")
        if not s:
            continue
        t = out.setdefault(
            f"{c['engine']}/{c['workload']}",
            {"real": 0, "caught": 0, "same_cause": 0, "caught_same_cause": 0},
        )
        t["real"] += s["real_stalls"]
        t["caught"] += s["caught"]
        t["same_cause"] += s["same_cause"]
        t["caught_same_cause"] += s["caught_same_cause"]
    return out


def repeatability(cells: list[dict[str, Any]]) -> dict[str, Any] | None:
    """With ``--repeat``: each cell's first pass taken as the prediction of its later passes — the
    engine as its own twin. Its share of cells and figures within the targets is the most any twin
    calibrated once could reach on that machine in that run; beside it, the twin's own errors on
    the same later-pass cells. None without a repeated cell."""
    first: dict[tuple[str, str, str], dict[str, Any]] = {}
    for c in cells:
        if c.get("measured") and c.get("pass", 0) == 0:
            first[(c["engine"], c["workload"], c["setting"])] = c
    pairs = []
    for c in cells:
        base = first.get((c["engine"], c["workload"], c["setting"]))
        if c.get("measured") and c.get("pass", 0) > 0 and base is not None:
            pairs.append(
                {
                    "engine": c["engine"],
                    "workload": c["workload"],
                    "setting": c["setting"],
                    "pass": c["pass"],
                    "measured": c["measured"],
                    "error": errors(base["measured"], c["measured"]),
                    "twin_error": c.get("error"),
                }
            )
    if not pairs:
        return None
    shares = target_shares(pairs)
    twin_shares = target_shares(pairs, "twin_error")
    median_abs: dict[str, dict[str, dict[str, float]]] = {}
    for engine in shares:
        mine = [q for q in pairs if q["engine"] == engine]
        median_abs[engine] = {
            name: {
                "self": float(np.median([abs(q["error"][name]) for q in mine])),
                "twin": float(np.median([abs(q["twin_error"][name]) for q in mine if q["twin_error"]]))
                if any(q["twin_error"] for q in mine)
                else math.nan,
            }
            for name, _ in METRICS
        }
    ranks = []
    for engine, workload in sorted({(q["engine"], q["workload"]) for q in pairs}):
        group = [q for q in pairs if q["engine"] == engine and q["workload"] == workload and q["pass"] == 1]
        if len(group) < 3:
            continue
        bases = [first[(engine, workload, q["setting"])]["measured"] for q in group]
        again = [q["measured"] for q in group]
        ranks.append(
            {
                "engine": engine,
                "workload": workload,
                **{name: spearman([b[name] for b in bases], [a[name] for a in again]) for name, _ in METRICS},
            }
        )
    return {
        "pairs": pairs,
        "shares": shares,
        "twin_shares": twin_shares,
        "median_abs_error": median_abs,
        "rankings": ranks,
    }


def print_repeatability(rep: dict[str, Any]) -> None:
    for engine, s in rep["shares"].items():
        t = rep["twin_shares"].get(engine, {"cells_all_within": 0, "figures_within": 0})
        print(
            f"{engine}: itself {s['cells_all_within']}/{s['cells']} cells, {s['figures_within']}/{s['figures']} "
            f"figures within target; the twin on the same cells {t['cells_all_within']} cells, "
            f"{t['figures_within']} figures"
        )
        m = rep["median_abs_error"][engine]
        print(
            "  median |error| itself / twin: "
            + ", ".join(f"{name} {m[name]['self']:.0%} / {m[name]['twin']:.0%}" for name, _ in METRICS)
        )
    for r in rep["rankings"]:
        print(
            f"  {r['engine']} / {r['workload']}: pass 1 vs pass 2 Spearman "
            + ", ".join(f"{name} {r[name]:+.2f}" for name, _ in METRICS)
        )
