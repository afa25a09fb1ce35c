"""Fit the cost model's efficiencies and overhead to measured iteration times.

A point is ``prefill:N[@C]=S`` (one N-token prefill chunk over C cached tokens took S seconds)
or ``decode:BxL=S`` (one decode iteration of B requests at L context tokens each took S).

The fit is least squares in relative error over the cost model's own prediction (``calibrate``;
by default the compute and memory efficiencies and the per-iteration overhead). Overhead is
fitted only from three or more points; with fewer it keeps its default. A fit that implies more
than the hardware's peak is accepted, with a warning that says by how much and which point
implies it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from tailserve.executors.simulated.cost_model import BatchShape, CostModel, Efficiency


class Measured(Protocol):
    """A measured iteration: its batch shape and how long it took."""

    @property
    def shape(self) -> BatchShape: ...

    @property
    def seconds(self) -> float: ...


@dataclass(frozen=True, slots=True)
class MeasuredBatch:
    """Any batch shape (mixed prefill and decode) with its measured seconds."""

    batch: BatchShape
    seconds: float
    label: str = ""

    @property
    def shape(self) -> BatchShape:
        return self.batch

    def __str__(self) -> str:
        return f"{self.label or self.batch}={self.seconds:g}"


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
    # The efficiency shape the points are fitted on (the fit replaces compute and memory).
    base: Efficiency = field(default_factory=Efficiency)


PRESETS: dict[str, CalibrationPreset] = {
    "seed": CalibrationPreset(
        name="seed",
        points="prefill:4096=0.120,decode:10x1024=0.018",
        model="Llama-3-70B",
        hardware="A100-80GB",
        tp=4,
        note="the seed essay's reference figures (A100 80GB, Llama-3-70B): a 4,096-token "
        "prefill ~120 ms, one decode step ~18 ms",
        # Fitted on the plain roofline with the generic 80% all-reduce link: the essay's prefill is
        # faster than the A100's measured curves allow (its all-reduce alone, at the NCCL
        # bandwidth Vidur measured, takes ~104 ms), so only the plain shape can reproduce it.
        base=Efficiency(),
    ),
}


@dataclass(frozen=True, slots=True)
class CalibrationResult:
    efficiency: Efficiency
    points: tuple[Measured, ...]
    predicted: tuple[float, ...]  # seconds, per point, with the fitted efficiencies
    warnings: tuple[str, ...] = field(default=())

    @property
    def max_relative_error(self) -> float:
        return max(abs(p - pt.seconds) / pt.seconds for p, pt in zip(self.predicted, self.points))


FIT_FIELDS = ("compute", "memory", "overhead")
_POSITIVE = (
    "compute",
    "memory",
    "comm",
    "sharpness",
    "prefill_attention",
    "decode_attention",
)  # fitted in log space: stay > 0


def calibrate(
    cost_model: CostModel,
    points: Sequence[Measured],
    fields: tuple[str, ...] = FIT_FIELDS,
    max_iter: int = 100,
    prior: float = 0.0,
) -> CalibrationResult:
    """Fit ``fields`` of the cost model's ``Efficiency`` to measured points.

    ``prior`` > 0 adds, per efficiency fitted, ``prior`` x its log-distance from the starting
    value as one more residual: a term the points do not pin stays near where it started instead
    of running off to 0 or 1e17 (a factor e away costs as much as a ``prior`` relative error on
    one point). 0: plain least squares.

    Least squares in relative error (Levenberg-Marquardt with a numerical Jacobian): the model
    is smooth but not linear in its efficiencies once a GEMM joins its compute and memory time
    by a p-norm. Overhead is fitted only from three or more points; with fewer it keeps its
    value. A field no point constrains keeps its prior value (the damping holds it there). A
    fitted overhead below zero is not physical: it is pinned at zero and the rest refitted.
    """
    base = cost_model.efficiency
    y = np.array([p.seconds for p in points])
    if len(points) < 3:
        fields = tuple(f for f in fields if f not in ("overhead", "per_token", "per_logit"))
    fields = tuple(fields)
    x = _encode(base, fields)
    shapes = [p.shape for p in points]

    x0 = x.copy()
    anchored = np.array([f in _POSITIVE for f in fields]) * prior

    def residuals(v: np.ndarray) -> np.ndarray:
        cm = cost_model.with_efficiency(_decode(base, fields, v))
        errors = np.array([cm.iteration_time(s) for s in shapes]) / y - 1.0
        return np.concatenate([errors, anchored * (v - x0)]) if prior > 0 else errors

    # Positive fields live in log space (unbounded below); sharpness stays >= 1 (a p-norm below 1
    # would exceed the sum of compute and memory time); times stay >= 0.
    lower = np.array([(0.0 if f == "sharpness" else -np.inf) if f in _POSITIVE else 0.0 for f in fields])
    x = _levenberg_marquardt(residuals, np.maximum(x, lower), lower, max_iter)
    eff = _decode(base, fields, x)
    negative = [f for f in fields if f not in _POSITIVE and getattr(eff, f) < 0]
    if negative:
        pinned = replace(eff, **{f: 0.0 for f in negative})
        rest = tuple(f for f in fields if f not in negative)
        return calibrate(cost_model.with_efficiency(pinned), points, rest, max_iter, prior)
    fitted = cost_model.with_efficiency(eff)
    predicted = tuple(fitted.iteration_time(s) for s in shapes)
    return CalibrationResult(eff, tuple(points), predicted, tuple(_warnings(cost_model, points, eff)))


def _encode(eff: Efficiency, fields: tuple[str, ...]) -> np.ndarray:
    return np.array([np.log(getattr(eff, f)) if f in _POSITIVE else getattr(eff, f) for f in fields])


def _decode(base: Efficiency, fields: tuple[str, ...], v: np.ndarray) -> Efficiency:
    # A trial step can run a log far off (a term the points barely constrain): clipped, exp
    # neither overflows nor underflows to an efficiency of 0.
    values = {
        f: float(np.exp(np.clip(x, -40.0, 40.0))) if f in _POSITIVE else float(x) for f, x in zip(fields, v)
    }
    # A trial step may propose a negative time; price it at zero (the final fit is checked).
    return replace(base, **{f: (max(x, 0.0) if f not in _POSITIVE else x) for f, x in values.items()})


def _levenberg_marquardt(f, x: np.ndarray, lower: np.ndarray, max_iter: int) -> np.ndarray:
    """Minimise |f(x)|^2 with x >= lower (each trial step projected onto the bound)."""
    if len(x) == 0:
        return x
    r = f(x)
    cost = float(r @ r)
    lam = 1e-3
    for _ in range(max_iter):
        # Forward differences; overhead-like fields move in seconds, so the step is absolute.
        jac = np.empty((len(r), len(x)))
        for j in range(len(x)):
            h = 1e-7 * max(1.0, abs(x[j])) if abs(x[j]) > 1e-3 else 1e-7
            step = x.copy()
            step[j] += h
            jac[:, j] = (f(step) - r) / h
        g = jac.T @ r
        a = jac.T @ jac
        improved = False
        for _ in range(20):
            try:
                dx = -np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-12), g)
            except np.linalg.LinAlgError:
                lam *= 10
                continue
            x_new = np.maximum(x + dx, lower)
            r_new = f(x_new)
            c_new = float(r_new @ r_new)
            if c_new < cost:
                x, r, improved = x_new, r_new, True
                done = cost - c_new < 1e-15 * max(cost, 1e-30) or c_new < 1e-26
                cost, lam = c_new, max(lam / 10, 1e-12)
                break
            lam *= 10
        if not improved or done:
            break
    return x


def _warnings(cost_model: CostModel, points: Sequence[Measured], eff: Efficiency) -> list[str]:
    hw, tp, model = cost_model.hardware, cost_model.tp, cost_model.model
    out = []
    for point in points:
        r = cost_model.roofline(point.shape)
        if point.seconds < r.limit_s:
            bound = "compute" if sum(r.compute_s) >= sum(r.memory_s) else "memory"
            if bound == "compute":
                # A CPU entry's peak is a measured GFLOP/s rate, in whatever dtype it was measured.
                rate = (
                    f"{hw.peak_flops / 1e12:.0f} TFLOP/s bf16"
                    if hw.peak_flops >= 1e12
                    else f"{hw.peak_flops / 1e9:.0f} GFLOP/s"
                )
                detail = (
                    f"{r.flops * tp:.2e} FLOP on {tp} x {hw.name} ({rate} each) needs >= "
                    f"{r.limit_s:.3f} s at 100% of peak"
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
