"""The closed loop's predictions again, from a saved run (``closed_loop --from-json FILE``).

The real engines' cells are the expensive, noisy part of a closed-loop run (minutes of a quiet
machine); the twin's side is deterministic. A change to the cost model or to how a calibration is
fitted is judged on the cells already measured: every cell of the file is predicted again with
the code as it is now, on the calibration the run took (``--refit``: its probes fitted again with
today's fit, e.g. after a new cost-model term), and the error table, rankings, target shares and
tune's advice are recomputed. The stall check is the run's own (it reads the client's per-token
times, kept compact in the file, against the twin as it was).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks import _closed_loop_report as report
from benchmarks._closed_loop_engines import SETTINGS, Setting
from benchmarks._closed_loop_workloads import Workload, build


def saved_calibrations(saved: dict[str, Any], model: Path, work: Path, refit: bool) -> dict[str, dict]:
    """Each engine's calibration file written back from the run's JSON (refitted on request)."""
    out = {}
    for engine, cal in saved["calibrations"].items():
        body = dict(cal["body"])
        path = work / f"calibration-{engine}.json"
        path.write_text(json.dumps(body))
        if refit:
            body["efficiency"] = _refitted(path, model)
            body["source"] = body["source"] + "; refitted by closed_loop --from-json --refit"
            path.write_text(json.dumps(body))
        out[engine] = {**cal, "file": str(path), "refitted": refit}
    return out


def _refitted(path: Path, model: Path) -> dict[str, Any]:
    from tailserve.executors.simulated.calibration_files import read_calibration_file
    from tailserve.executors.simulated.models import load_hf_config
    from tailserve.fidelity.server_calibrate import fit_points

    cal = read_calibration_file(path)
    fit = fit_points(load_hf_config(model), cal.hardware, cal.tp, list(cal.points))
    eff = asdict(fit.efficiency)
    if math.isinf(eff["sharpness"]):
        eff["sharpness"] = "inf"
    return eff


def run_settings(saved: dict[str, Any]) -> list[Setting]:
    names = [s["name"] for s in saved["settings"]]
    return [s for s in SETTINGS if s.name in names]


def run_workloads(saved: dict[str, Any], vocab: int, seed: int, trace: Path | None) -> list[Workload]:
    """The run's workloads rebuilt from their seeds (the same requests and send times); a quick
    run's shorter ones are recognised by their request counts."""
    names = [w["name"] for w in saved["workloads"]]
    full = build(names, vocab, seed, False, trace)
    counts = {w["name"]: w["requests"] for w in saved["workloads"]}
    if all(len(w.requests) == counts[w.name] for w in full):
        return full
    quick = build(names, vocab, seed, True, trace)
    if all(len(w.requests) == counts[w.name] for w in quick):
        return quick
    raise SystemExit(
        "closed_loop --from-json: the file's workloads do not match this code's (request counts "
        f"{counts}); was it run with another --seed or --trace?"
    )


def repredict_cells(
    cells: list[dict[str, Any]],
    settings: list[Setting],
    workloads: list[Workload],
    calibrations: dict[str, dict],
    model: Path,
    predict,
) -> list[dict[str, Any]]:
    """Every measured cell with the twin's figures and errors recomputed (``predict`` is
    ``closed_loop.predict``)."""
    out = []
    for c in cells:
        if "measured" not in c:
            out.append(c)
            continue
        setting = next(s for s in settings if s.name == c["setting"])
        w = next(w for w in workloads if w.name == c["workload"])
        figures, _ = predict(w, setting, calibrations[c["engine"]]["file"], model)
        c = {**c, "predicted": report.figures(figures)}
        c["error"] = report.errors(c["predicted"], c["measured"])
        c.pop("gauge", None)
        c.pop("predicted_uncorrected", None)
        c.pop("error_uncorrected", None)
        out.append(c)
    return out
