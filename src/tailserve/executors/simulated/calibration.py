"""Fit the cost model's efficiencies and overhead to measured iteration times.

A point is ``prefill:N[@C]=S`` (one N-token prefill chunk over C cached tokens took S seconds)
or ``decode:BxL=S`` (one decode iteration of B requests at L context tokens each took S).

The model is ``t = sum_p max(a*C_p, b*M_p) + comm + o`` with ``a = 1/compute_eff`` and
``b = 1/memory_eff``: linear in (a, b, o) once each part's regime (compute- or memory-bound) is
fixed, so the fit alternates between assigning regimes and solving linear least squares until
the regimes stop changing. Overhead is fitted only from three or more points; with fewer it
keeps its default. A fit that implies more than the hardware's peak is accepted, with a warning
that says by how much and which point implies it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import numpy as np

from tailserve.executors.simulated.cost_model import BatchShape, CostModel, Efficiency


@dataclass(frozen=True, slots=True)
class CalibrationPoint:
    kind: str  # "prefill" or "decode"
    seconds: float
    num_tokens: int = 0  # prefill chunk
    num_context_tokens: int = 0  # prefill: cached before the chunk; decode: per request
    batch_size: int = 0  # decode

    def __post_init__(self) -> None:
        if self.seconds <= 0:
            raise ValueError(f"measured time must be > 0 seconds, got {self.seconds}")

    @property
    def shape(self) -> BatchShape:
        if self.kind == "prefill":
            return BatchShape.of([(self.num_tokens, self.num_context_tokens)], [])
        return BatchShape.of([], [self.num_context_tokens] * self.batch_size)

    def __str__(self) -> str:
        if self.kind == "prefill":
            ctx = f"@{self.num_context_tokens}" if self.num_context_tokens else ""
            return f"prefill:{self.num_tokens}{ctx}={self.seconds:g}"
        return f"decode:{self.batch_size}x{self.num_context_tokens}={self.seconds:g}"


_PREFILL = re.compile(r"^prefill:(\d+)(?:@(\d+))?=([0-9.eE+-]+)$")
_DECODE = re.compile(r"^decode:(\d+)x(\d+)=([0-9.eE+-]+)$")

POINT_SYNTAX = "prefill:N[@CONTEXT]=SECONDS or decode:BATCHxCONTEXT=SECONDS, comma-separated"


def parse_points(text: str) -> list[CalibrationPoint]:
    points = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        try:
            if m := _PREFILL.match(item):
                n, ctx, s = int(m[1]), int(m[2] or 0), float(m[3])
                if n < 1:
                    raise ValueError("a prefill needs >= 1 token")
                points.append(CalibrationPoint("prefill", s, num_tokens=n, num_context_tokens=ctx))
                continue
            if m := _DECODE.match(item):
                b, ctx, s = int(m[1]), int(m[2]), float(m[3])
                if b < 1:
                    raise ValueError("a decode batch needs >= 1 request")
                points.append(CalibrationPoint("decode", s, num_context_tokens=ctx, batch_size=b))
                continue
        except ValueError as e:
            raise ValueError(f"calibration point {item!r}: {e}") from None
        raise ValueError(f"calibration point {item!r} is not {POINT_SYNTAX}")
    if not points:
        raise ValueError(f"no calibration points given; expected {POINT_SYNTAX}")
    return points


@dataclass(frozen=True, slots=True)
class CalibrationPreset:
    name: str
    points: str
    model: str
    hardware: str
    tp: int
    note: str


PRESETS: dict[str, CalibrationPreset] = {
    "seed": CalibrationPreset(
        name="seed",
        points="prefill:4096=0.120,decode:10x1024=0.018",
        model="Llama-3-70B",
        hardware="A100-80GB",
        tp=4,
        note="the seed essay's reference figures (A100 80GB, Llama-3-70B): a 4,096-token "
        "prefill ~120 ms, one decode step ~18 ms",
    ),
}


@dataclass(frozen=True, slots=True)
class CalibrationResult:
    efficiency: Efficiency
    points: tuple[CalibrationPoint, ...]
    predicted: tuple[float, ...]  # seconds, per point, with the fitted efficiencies
    warnings: tuple[str, ...] = field(default=())

    @property
    def max_relative_error(self) -> float:
        return max(abs(p - pt.seconds) / pt.seconds for p, pt in zip(self.predicted, self.points))


def calibrate(cost_model: CostModel, points: list[CalibrationPoint], max_iter: int = 50) -> CalibrationResult:
    base = cost_model.efficiency
    rooflines = [cost_model.roofline(p.shape) for p in points]
    y = np.array([p.seconds for p in points])
    fit_overhead = len(points) >= 3
    a, b, o = 1.0 / base.compute, 1.0 / base.memory, base.overhead
    regimes: list[tuple[bool, ...]] | None = None
    for _ in range(max_iter):
        new_regimes = [tuple(a * c >= b * m for c, m in zip(r.compute_s, r.memory_s)) for r in rooflines]
        if new_regimes == regimes:
            break
        regimes = new_regimes
        comp = np.array(
            [sum(c for c, cb in zip(r.compute_s, reg) if cb) for r, reg in zip(rooflines, regimes)]
        )
        mem = np.array(
            [sum(m for m, cb in zip(r.memory_s, reg) if not cb) for r, reg in zip(rooflines, regimes)]
        )
        comm = np.array([r.comm_s for r in rooflines])
        columns, names = [], []
        target = y - comm - (0.0 if fit_overhead else o)
        if comp.any():
            columns.append(comp)
            names.append("a")
        if mem.any():
            columns.append(mem)
            names.append("b")
        if fit_overhead:
            columns.append(np.ones_like(y))
            names.append("o")
        # A regime no point exercises keeps its prior value.
        if "a" not in names:
            target = target - a * comp
        if "b" not in names:
            target = target - b * mem
        solution, *_ = np.linalg.lstsq(np.column_stack(columns), target, rcond=None)
        values = dict(zip(names, solution))
        a = float(values.get("a", a))
        b = float(values.get("b", b))
        o = float(values.get("o", o))
        if a <= 0 or b <= 0:
            raise ValueError(
                "calibration points are inconsistent with the cost model (fitted a non-positive "
                f"time per FLOP or per byte): {', '.join(map(str, points))}"
            )
        if o < 0:
            # A negative overhead is not physical: pin it at zero and refit the rest.
            o, fit_overhead, regimes = 0.0, False, None
    efficiency = replace(base, compute=1.0 / a, memory=1.0 / b, overhead=o)
    fitted = cost_model.with_efficiency(efficiency)
    predicted = tuple(fitted.iteration_time(p.shape) for p in points)
    return CalibrationResult(
        efficiency, tuple(points), predicted, tuple(_warnings(cost_model, points, efficiency))
    )


def _warnings(cost_model: CostModel, points: list[CalibrationPoint], eff: Efficiency) -> list[str]:
    hw, tp, model = cost_model.hardware, cost_model.tp, cost_model.model
    out = []
    for point in points:
        r = cost_model.roofline(point.shape)
        if point.seconds < r.limit_s:
            bound = "compute" if sum(r.compute_s) >= sum(r.memory_s) else "memory"
            if bound == "compute":
                detail = (
                    f"{r.flops * tp:.2e} FLOP on {tp} x {hw.name} ({hw.peak_flops / 1e12:.0f} TFLOP/s "
                    f"bf16 each) needs >= {r.limit_s:.3f} s at 100% of peak"
                )
            else:
                detail = (
                    f"{r.bytes / 1e9:.1f} GB per GPU at {hw.memory_bandwidth / 1e12:.2f} TB/s "
                    f"needs >= {r.limit_s * 1e3:.1f} ms at 100% of peak bandwidth"
                )
            out.append(
                f"{point} ({model.name}, TP {tp}) is faster than the {hw.name} roofline: {detail}, "
                f"{r.limit_s / point.seconds:.1f}x the measured time"
            )
    if eff.compute > 1:
        out.append(
            f"the fit implies {eff.compute * 100:.0f}% of {hw.name} peak FLOP/s (above 100% is not physical)"
        )
    if eff.memory > 1:
        out.append(
            f"the fit implies {eff.memory * 100:.0f}% of {hw.name} peak memory bandwidth (above 100% is not physical)"
        )
    return out
