"""Calibration sources beyond measured points: a calibration file, Vidur's GPU profiles, or
``generic`` (the roofline before the fitted GPU curves, to reproduce figures measured with it).

``--calibration FILE.json`` loads a file ``tailserve calibrate --executor torch`` wrote: the
host's hardware entry (measured GEMM rate and memory bandwidth), the fitted efficiencies, the
profiled points and their errors. ``--calibration vidur:DIR`` fits the GEMM curve to every
``mlp.csv`` under DIR (a Vidur profile root, one GPU's folder or one model's folder) and applies
it to the deployment's GPU; when DIR is a Vidur root holding the GPU's one-node NCCL profile
(``network/a100_dgx`` or ``h100_dgx``, next to ``compute/``), the all-reduce is fitted per
message-size band too. ``--calibration gemm:FILE`` fits the GPU's bf16 and FP8 GEMM curves to
GEMMs ``scripts/gpu_gemm.py`` timed on a GPU (``gemm_table.py``); ``--calibration
aisim:FILE[:GPU]`` prices the dense GEMMs, routed experts and MLA block from AISimulate's measured
tables (``aisim_table.py``, ``aisim_moe_table.py``, ``aisim_mla_table.py``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from tailserve.executors.simulated import aisim_table
from tailserve.executors.simulated.aisim_table import PREFIX as AISIM_PREFIX
from tailserve.executors.simulated.calibration import CalibrationResult, MeasuredBatch, calibrate
from tailserve.executors.simulated.cost_model import BatchShape, CostModel, Efficiency
from tailserve.executors.simulated.gemm_table import PREFIX as GEMM_PREFIX
from tailserve.executors.simulated.hardware import (
    AllReduceBand,
    EngineKernels,
    GemmCurve,
    Hardware,
    LinkFit,
    MlaCurveTerms,
    MlaKernel,
    MoeCurve,
    MoeExchange,
    MoeKernel,
)
from tailserve.executors.simulated.models import ModelSpec
from tailserve.executors.simulated.profiles import VIDUR_GPUS, VIDUR_TOPOLOGIES, load_linear_profile
from tailserve.executors.simulated.saved_shape import shape_from_saved

FORMAT = "tailserve-calibration"
VERSION = 1
VIDUR_PREFIX = "vidur:"


GENERIC = "generic"


def is_calibration_source(text: str) -> bool:
    return (
        text == GENERIC
        or text.startswith((VIDUR_PREFIX, GEMM_PREFIX, AISIM_PREFIX))
        or text.endswith(".json")
    )


def generic_hardware(hardware: Hardware) -> Hardware:
    """The GPU without its fitted curves: the cost model before the measured profiles."""
    return replace(hardware, gemm=None, allreduce_latency_by_tp=(), allreduce_bands=(), comm_efficiency=None)


@dataclass(frozen=True, slots=True)
class CalibrationFile:
    hardware: Hardware
    efficiency: Efficiency
    model: str  # the model it was measured with
    tp: int
    source: str  # how it was measured
    points: tuple[MeasuredBatch, ...] = ()
    # A fixed reference iteration's period measured beside the points (torch calibration's
    # ``probe``): comparing it with the same probe later says how the machine's speed moved.
    probe_s: float | None = None
    # A server calibrated from outside (``calibrate --from-server``): the median of the client's
    # TTFT less the server's own prefill time over its one-at-a-time probes, the time a request
    # spends in the API server, the network and the tokenizer. The engine model leaves it out;
    # a prediction of what a client measures adds it to each TTFT (``sim/twin.py``).
    request_overhead_s: float | None = None


def _shape_dict(shape: BatchShape) -> dict[str, int]:
    return {f.name: getattr(shape, f.name) for f in fields(BatchShape)}


def write_calibration_file(
    path: str | Path, cal: CalibrationFile, fit: CalibrationResult | None = None
) -> None:
    hw = asdict(cal.hardware)
    hw.pop("gemm_table")  # measured GEMM times (aisim:FILE) stay in their own file
    eff = asdict(cal.efficiency)
    if math.isinf(eff["sharpness"]):
        eff["sharpness"] = "inf"
    body: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "model": cal.model,
        "tp": cal.tp,
        "source": cal.source,
        "hardware": hw,
        "efficiency": eff,
        "points": [
            {"label": p.label, "seconds": p.seconds, "shape": _shape_dict(p.batch)} for p in cal.points
        ],
    }
    if cal.probe_s is not None:
        body["probe_s"] = cal.probe_s
    if cal.request_overhead_s is not None:
        body["request_overhead_s"] = cal.request_overhead_s
    if fit is not None:
        body["predicted"] = list(fit.predicted)
        body["warnings"] = list(fit.warnings)
    Path(path).write_text(json.dumps(body, indent=2) + "\n")


def read_calibration_file(path: str | Path) -> CalibrationFile:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"calibration file {p} does not exist")
    try:
        body = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}:{e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ValueError(f'{p}: not a tailserve calibration file (no "format": "{FORMAT}")')
    if body.get("version") != VERSION:
        raise ValueError(
            f"{p}: calibration file version {body.get('version')!r}, this tailserve reads {VERSION}"
        )
    try:
        hw = dict(body["hardware"])
        if hw.get("gemm") is not None:
            hw["gemm"] = _gemm_curve(hw["gemm"])
        if hw.get("moe") is not None:
            hw["moe"] = _moe_kernel(hw["moe"])
        if hw.get("mla") is not None:
            hw["mla"] = _mla_kernel(hw["mla"])
        if hw.get("moe_exchange") is not None:
            hw["moe_exchange"] = _moe_exchange(hw["moe_exchange"])
        hw["allreduce_latency_by_tp"] = tuple(tuple(x) for x in hw.get("allreduce_latency_by_tp", ()))
        hw["allreduce_bands"] = tuple(AllReduceBand(**b) for b in hw.get("allreduce_bands", ()))
        hw["peak_flops_by_dtype"] = tuple((str(f), float(r)) for f, r in hw.get("peak_flops_by_dtype", ()))
        hw["engine_kernels"] = tuple(_engine_kernels(k) for k in hw.get("engine_kernels", ()))
        hardware = Hardware(**hw)
        eff = dict(body["efficiency"])
        if eff.get("sharpness") == "inf":
            eff["sharpness"] = math.inf
        efficiency = Efficiency(**eff)
        points = tuple(
            MeasuredBatch(shape_from_saved(pt["shape"]), float(pt["seconds"]), str(pt.get("label", "")))
            for pt in body.get("points", [])
        )
        probe = body.get("probe_s")
        overhead = body.get("request_overhead_s")
        return CalibrationFile(
            hardware,
            efficiency,
            str(body["model"]),
            int(body["tp"]),
            str(body["source"]),
            points,
            None if probe is None else float(probe),
            None if overhead is None else float(overhead),
        )
    except KeyError as e:
        raise ValueError(f"{p}: missing key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{p}: {e}") from None


def _gemm_curve(body: dict) -> GemmCurve:
    """``hardware.GemmCurve`` from its ``asdict`` (JSON turns its pairs into lists; a format's
    own curve is a GemmCurve too)."""
    gemm = dict(body)
    gemm["format_factors"] = tuple((str(f), float(c), float(m)) for f, c, m in gemm.get("format_factors", ()))
    gemm["quant_bytes"] = tuple((str(f), float(b)) for f, b in gemm.get("quant_bytes", ()))
    gemm["format_curves"] = tuple((str(f), _gemm_curve(c)) for f, c in gemm.get("format_curves", ()))
    gemm["m_tiles"] = tuple(tuple(int(v) for v in entry) for entry in gemm.get("m_tiles", ()))
    return GemmCurve(**gemm)


def _engine_kernels(saved: dict[str, Any]) -> EngineKernels:
    """``hardware.EngineKernels`` from its ``asdict`` (its curves nested)."""
    gemm, moe = saved.get("gemm"), saved.get("moe")
    return EngineKernels(
        str(saved["engine"]),
        None if gemm is None else _gemm_curve(gemm),
        None if moe is None else _moe_kernel(moe),
        str(saved["source"]),
    )


def _moe_kernel(saved: dict[str, Any]) -> MoeKernel:
    """``hardware.MoeKernel`` from its ``asdict`` (each format's curve nested)."""
    moe = dict(saved)
    for key in ("format_curves", "ep_format_curves"):
        moe[key] = tuple((str(f), MoeCurve(**c)) for f, c in moe.get(key, ()))
    return MoeKernel(**moe)


def _mla_kernel(saved: dict[str, Any]) -> MlaKernel:
    """``hardware.MlaKernel`` from its ``asdict`` (JSON turns its pairs into lists)."""
    pairs = ("gemm_factors", "decode_request_by_format", "latency_by_format")
    mla = {k: tuple((str(f), float(x)) for f, x in v) if k in pairs else v for k, v in saved.items()}
    mla["curve_terms"] = tuple((str(f), MlaCurveTerms(**t)) for f, t in saved.get("curve_terms", ()))
    return MlaKernel(**mla)


def _moe_exchange(saved: dict[str, Any]) -> MoeExchange:
    """``hardware.MoeExchange`` from its ``asdict``."""
    phases = {k: LinkFit(**saved[k]) for k in ("ht_dispatch", "ht_combine", "ll_dispatch", "ll_combine")}
    groups = {
        k: tuple((int(n), LinkFit(**fit)) for n, fit in saved[k]) for k in ("all_gather", "reduce_scatter")
    }
    return MoeExchange(**phases, **groups, source=str(saved["source"]))


def load_calibration_source(
    text: str, model: ModelSpec, hardware: Hardware, tp: int
) -> tuple[CostModel, CalibrationResult | None, tuple[str, ...]]:
    """(cost model, fit, notes) for ``generic``, ``FILE.json``, ``vidur:DIR``, ``gemm:FILE`` or
    ``aisim:FILE[:GPU]``."""
    if text == GENERIC:
        note = "generic roofline: compute 0.6, memory 0.8, max, no tile, 8 us all-reduce at 80% of the link"
        return CostModel(model, generic_hardware(hardware), tp), None, (note,)
    if text.startswith(VIDUR_PREFIX):
        return _from_vidur(Path(text[len(VIDUR_PREFIX) :]), model, hardware, tp)
    if text.startswith(GEMM_PREFIX):
        from tailserve.executors.simulated.gemm_table import table_hardware

        hw, notes = table_hardware(text[len(GEMM_PREFIX) :], hardware)
        return CostModel(model, hw, tp), None, notes
    if text.startswith(AISIM_PREFIX):
        hw, notes = aisim_table.table_hardware(text[len(AISIM_PREFIX) :], hardware)
        # what the tables leave to the catalog's curves is said by build_cost_model, once the
        # deployment's expert parallelism and DP (which pick the fused-MoE series) are applied
        return CostModel(model, hw, tp), None, notes
    cal = read_calibration_file(text)
    notes = [f"calibration file {text}: {cal.source}"]
    if cal.hardware.name != hardware.name:
        notes.append(f"the file's hardware {cal.hardware.name} replaces {hardware.name}")
    if cal.model != model.name:
        notes.append(f"measured with {cal.model}; applied to {model.name}")
    cm = CostModel(model, cal.hardware, tp, cal.efficiency)
    fit = None
    if cal.points and cal.model == model.name:
        fit = CalibrationResult(
            cal.efficiency, cal.points, tuple(cm.iteration_time(p.batch) for p in cal.points)
        )
    return cm, fit, tuple(notes)


def _from_vidur(root: Path, model: ModelSpec, hardware: Hardware, tp: int):
    from tailserve.executors.simulated.profile_fit import fit_linear, linear_errors

    if root.is_file() and root.name == "mlp.csv":
        files = [root]
    else:
        files = sorted(root.glob("mlp.csv")) or sorted(root.glob("*/*/mlp.csv"))
        files = files or sorted(root.glob("compute/*/*/*/mlp.csv"))
    if not files:
        raise ValueError(f"vidur:{root}: no mlp.csv under it (a Vidur profile root, GPU or model folder)")
    gpus = {f.parents[2].name for f in files if f.parents[2].name in VIDUR_GPUS}
    if len(gpus) > 1:
        raise ValueError(
            f"vidur:{root}: profiles of several GPUs ({', '.join(sorted(gpus))}); point at one GPU's folder"
        )
    notes = []
    if gpus:
        gpu = VIDUR_GPUS[gpus.pop()]
        if gpu != hardware.name:
            notes.append(f"the profiles were measured on {gpu}; their curve is applied to {hardware.name}")
    profiles = [load_linear_profile(f) for f in files]
    fitted = fit_linear(profiles, hardware)
    errors = [linear_errors(p, hardware, fitted) for p in profiles]
    notes.append(
        f"GEMM curve fitted to {len(files)} profile(s): compute {fitted.compute:.3f}, memory "
        f"{fitted.memory:.3f}, sharpness {fitted.sharpness:g}, tile {fitted.tile_m}; mean |error| "
        + ", ".join(f"{e.name} {e.mean_abs:.1%}" for e in errors)
    )
    base = CostModel(model, hardware, tp).efficiency
    eff = replace(
        base,
        compute=fitted.compute,
        memory=fitted.memory,
        sharpness=fitted.sharpness,
        tile_m=fitted.tile_m,
        gemm_latency=fitted.gemm_latency,
    )
    hardware, band_note = _vidur_all_reduce(root, hardware)
    if band_note:
        notes.append(band_note)
    return CostModel(model, hardware, tp, eff), None, tuple(notes)


def _vidur_all_reduce(root: Path, hardware: Hardware) -> tuple[Hardware, str]:
    """The hardware with NCCL all-reduce bands fitted to the root's one-node profile of this GPU
    (the topology VIDUR_TOPOLOGIES names for it), or unchanged when the root has none."""
    from tailserve.executors.simulated.profile_fit import (
        all_reduce_band_errors,
        fit_all_reduce_bands,
        tp_message_sizes,
    )
    from tailserve.executors.simulated.profiles import load_all_reduce

    topo = next((t for t, name in VIDUR_TOPOLOGIES.items() if name == hardware.name), None)
    # DIR may be the root, one GPU's folder or one model's (or its mlp.csv): look up to the root.
    found = [b / "network" / topo / "all_reduce.csv" for b in (root, *list(root.parents)[:4])] if topo else []
    path = next((f for f in found if f.is_file()), None)
    if path is None:
        return hardware, ""
    samples = tp_message_sizes(load_all_reduce(path))
    if not samples:
        return hardware, f"{path}: no one-node all-reduce at TP 2/4/8; the catalog's all-reduce kept"
    banded = replace(hardware, allreduce_bands=fit_all_reduce_bands(samples, hardware))
    errors = all_reduce_band_errors(samples, banded)
    return banded, (
        f"all-reduce fitted per message-size band to {topo}: mean |error| "
        + ", ".join(f"{e.name} {e.mean_abs:.1%}" for e in errors)
    )


def refit(cal: CalibrationFile, model: ModelSpec, fields_: tuple[str, ...]) -> CalibrationResult:
    """Refit a file's points (tests and ``calibrate --json``)."""
    cm = CostModel(model, cal.hardware, cal.tp, cal.efficiency)
    return calibrate(cm, list(cal.points), fields_)


def request_overhead(calibration: str) -> float:
    """The client-side time per request a calibration file measured (0 for any other source)."""
    if not calibration.endswith(".json"):
        return 0.0
    return read_calibration_file(calibration).request_overhead_s or 0.0
