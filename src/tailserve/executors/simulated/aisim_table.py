"""AISimulate's measured GEMM times as the dense GEMMs' times: ``--calibration aisim:FILE[:GPU]``.

AISimulate (NVIDIA) bundles GEMM latencies measured with vLLM's own kernels on H100, H200, B200,
GB200 and B300 (``benchmarks/_aisim_tables.py`` exports them as JSON in AISimulate's venv:
tailserve reads the JSON and never imports AISimulate). Each format's rows time 57-74 row counts
M (1 to 32,768, both sides of each row-tile boundary up to 4,353) at each of 419-495 weight shapes
(N, K). A GEMM of the deployment is priced from them instead of from a fitted curve:

- the measured time is turned into the achieved fraction of the GEMM's roofline
  ``max(2 M N K / peak, (N K w + M (N + K) 2) / bandwidth)`` (the format's tensor-core peak and
  the GPU's bandwidth, the catalog's), a number that moves slowly with the shape;
- within a measured (N, K) it is interpolated linearly in log M; beyond the largest M held at the
  last row's (compute-bound: the time then grows with M), below the smallest at the first's;
- across shapes, in log K between the two measured K around the GEMM's K within a measured N,
  then in log N between the nearest such N below and above (most tables time two thirds of
  their N x K grid, 495 of 748 shapes, so the nearest N whose K range holds K, not the adjacent
  N alone).

On half the weight shapes held out (``benchmarks/fidelity_aisim_table.py``), this order (K within
N, then N) and quantity (the roofline fraction, not log time) gave the lowest mean error on 15
of the 18 GPU and format pairs (2.0-6.8%, against 6.1-16.6% for the fitted waves + quantization
curve); docs/fidelity.md has the figures. A GEMM whose (N, K) no measured
shapes surround is priced on the catalog's curve instead (``TableLayers.outside`` says which).

A format's rows that do not grow with M are left out (``flat_series``): the vLLM export's B200
block-FP8 rows (AISimulate 0.13.0.dev) take 165-265 us at 7,168 x 2,048 from 1 to 4,096 rows,
against 7-77 us for bf16 on the same GPU and 13-62 us for the same format on the GB200; over its
model-sized shapes the time at 4,096 rows is 1.7x the fastest row's (median), against 9-21x for
every other GPU and format. That is not a GEMM kernel's scaling (4,096 rows of a model-sized
GEMM are compute-bound on every GPU here); those GEMMs take the catalog's curve, said in a note.

The times are vLLM's isolated operators: a quantized format's rows include the kernel that
quantizes the activations, which a served vLLM fuses into the norm before (torch.compile); the
catalog's format curves were fitted to the same rows and carry it too.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tailserve.executors.simulated.gemm import curve_gemm_time
from tailserve.executors.simulated.hardware import GemmCurve, Hardware, get_hardware
from tailserve.executors.simulated.precision import get_precision

if TYPE_CHECKING:
    from tailserve.executors.simulated.aisim_mla_table import MlaRows
    from tailserve.executors.simulated.aisim_moe_table import MoeRows

PREFIX = "aisim:"
# AISimulate's system names -> tailserve's catalog names (the GPUs its tables time GEMMs on)
GPUS = {"h100_sxm": "H100-SXM", "h200_sxm": "H200", "b200_sxm": "B200", "gb200": "GB200", "b300_sxm": "B300"}
# AISimulate's format names -> tailserve's (``precision.py``)
FORMATS = {"bfloat16": "bf16", "fp8": "fp8", "fp8_block": "fp8_block", "nvfp4": "nvfp4"}
# formats whose GEMMs run another format's kernel (fp16: bf16's tensor-core rate and kernels)
SAME_KERNEL = {"fp16": "bf16"}
ACT_BYTES = 2.0  # activations in and out in bf16
# A format's rows are a GEMM kernel's only if 4,096 rows of a model-sized weight (N K >= 2^24)
# take several times its fastest row: 9-21x (median over shapes) for every GPU and format of the
# exports but one, whose 1.7x is a flat series (module docstring). Below this median: left out.
FLAT_RATIO = 3.0
FLAT_ROWS = 4096
# The curve of a GPU without a fitted one: the cost model's generic efficiencies, one join.
GENERIC_CURVE = GemmCurve(0.6, 0.8, math.inf, 1, 0.0, "generic")


@dataclass(frozen=True, slots=True, eq=False)
class Profile:
    """One weight shape's achieved roofline fraction along M: ``log_m`` ascending."""

    log_m: np.ndarray
    fraction: np.ndarray


@dataclass(frozen=True, eq=False)
class FormatRows:
    """One format's measured GEMMs on one GPU: per measured N, its K values (ascending) and each
    shape's ``Profile``; the roofline they are fractions of."""

    fmt: str  # tailserve's name
    peak: float  # FLOP/s: the format's tensor-core rate on the GPU
    bandwidth: float  # bytes/s
    weight_bytes: float  # per weight element
    ns: np.ndarray  # measured N, ascending
    ks: dict[float, np.ndarray]  # N -> its measured K, ascending
    shapes: dict[tuple[float, float], Profile]

    def roofline(self, m, n: float, k: float):
        return roofline(m, n, k, self.peak, self.bandwidth, self.weight_bytes)

    def profile(self, n: float, k: float) -> Profile | None:
        """(N, K)'s profile interpolated from the measured shapes around it; None outside them."""
        below = self.ns[self.ns <= n][::-1]
        above = self.ns[self.ns >= n]
        lo = next(((c, p) for c in below if (p := self._in_column(c, k)) is not None), None)
        hi = next(((c, p) for c in above if (p := self._in_column(c, k)) is not None), None)
        if lo is None or hi is None:
            return None
        if lo[0] == hi[0]:
            return lo[1]
        w = (math.log(n) - math.log(lo[0])) / (math.log(hi[0]) - math.log(lo[0]))
        return _blend(lo[1], hi[1], w)

    def _in_column(self, n: float, k: float) -> Profile | None:
        """The profile at K within the measured N (log-K interpolation); None if K is outside
        that N's measured K."""
        ks = self.ks[n]
        if not ks[0] <= k <= ks[-1]:
            return None
        j = int(np.searchsorted(ks, k))
        if ks[j] == k:
            return self.shapes[(n, k)]
        lo, hi = ks[j - 1], ks[j]
        w = (math.log(k) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return _blend(self.shapes[(n, lo)], self.shapes[(n, hi)], w)

    def seconds(self, m, n: float, k: float, profile: Profile):
        """A GEMM of ``m`` rows (a number or an array) on the shape's profile."""
        fraction = np.interp(np.log(np.maximum(m, 1)), profile.log_m, profile.fraction)
        return self.roofline(m, n, k) / fraction


def roofline(m, n: float, k: float, peak: float, bandwidth: float, weight_bytes: float):
    """Seconds of an M x N x K GEMM at ``peak`` FLOP/s or at ``bandwidth`` (weights once,
    activations in and out), whichever is longer; ``m`` a number or an array."""
    compute = 2.0 * m * n * k / peak
    memory = (n * k * weight_bytes + m * (n + k) * ACT_BYTES) / bandwidth
    return np.maximum(compute, memory)


def _blend(a: Profile, b: Profile, w: float) -> Profile:
    """``(1 - w) a + w b`` on the union of their M (the tables' shapes share one M grid)."""
    if a.log_m.shape == b.log_m.shape and np.array_equal(a.log_m, b.log_m):
        return Profile(a.log_m, (1 - w) * a.fraction + w * b.fraction)
    log_m = np.union1d(a.log_m, b.log_m)
    return Profile(
        log_m,
        (1 - w) * np.interp(log_m, a.log_m, a.fraction) + w * np.interp(log_m, b.log_m, b.fraction),
    )


def _series(rows: np.ndarray) -> Iterator[tuple[float, float, np.ndarray, np.ndarray]]:
    """Each weight shape's (N, K, M ascending, seconds) in rows [m, n, k, seconds]; a repeated
    M keeps its first row in file order."""
    order = np.lexsort((rows[:, 0], rows[:, 2], rows[:, 1]))  # by N, K, then M (stable)
    rows = rows[order]
    starts = np.flatnonzero(np.r_[True, np.any(np.diff(rows[:, 1:3], axis=0) != 0, axis=1)])
    for a, b in zip(starts, [*starts[1:], len(rows)]):
        m, n, k, t = rows[a:b].T
        m, first = np.unique(m, return_index=True)
        yield float(n[0]), float(k[0]), m, t[first]


def format_rows(fmt: str, rows: np.ndarray, hardware: Hardware) -> FormatRows:
    """``FormatRows`` of one format's rows [m, n, k, seconds] measured on ``hardware``."""
    prec = get_precision(fmt)
    peak, bw = hardware.peak_for(prec.compute), hardware.memory_bandwidth
    shapes: dict[tuple[float, float], Profile] = {}
    for n, k, m, t in _series(rows):
        shapes[(n, k)] = Profile(np.log(m), roofline(m, n, k, peak, bw, prec.bytes) / t)
    ns = np.array(sorted({n for n, _ in shapes}))
    ks = {float(n): np.array(sorted(k for c, k in shapes if c == n)) for n in ns}
    return FormatRows(fmt, peak, bw, prec.bytes, ns, ks, shapes)


@dataclass(frozen=True, eq=False)
class GemmTimes:
    """One GPU's GEMM rows of an ``_aisim_tables.py`` export, per tailserve format."""

    path: str
    gpu: str  # AISimulate's name
    hardware: str  # the catalog's name of that GPU
    formats: dict[str, FormatRows]
    framework: str = "vllm"  # the engine whose kernels were timed (_aisim_tables.py --framework)
    moe: MoeRows | None = None  # the GPU's fused-MoE rows (aisim_moe_table.py), None without
    mla: MlaRows | None = None  # the GPU's MLA module rows (aisim_mla_table.py), None without
    left_out: tuple[tuple[str, str], ...] = ()  # (format, why) of rows not taken (flat_series)

    def rows_for(self, fmt: str) -> FormatRows | None:
        """The format's rows; None when they were left out (the catalog's curve prices it)."""
        name = get_precision(fmt).gemm_format
        name = SAME_KERNEL.get(name, name)
        if any(name == f for f, _ in self.left_out):
            return None
        if name not in self.formats:
            raise ValueError(
                f"aisim:{self.path}: no {name} GEMM rows for {self.gpu} (it has {', '.join(self.formats)})"
            )
        return self.formats[name]


def split_source(text: str) -> tuple[str, str]:
    """(FILE, GPU) of ``aisim:FILE[:GPU]``'s part after the prefix; GPU "" when not given."""
    if Path(text).is_file() or ":" not in text:
        return text, ""
    path, gpu = text.rsplit(":", 1)
    return path, gpu


def load_gemm_times(path: str | Path, gpu: str) -> GemmTimes:
    """The GEMM rows of ``gpu`` (AISimulate's name or the catalog's) in the export at ``path``;
    read once per process for the file as it is now (the export is ~50 MB of JSON)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(
            f"aisim:{path}: no such file (export one with AISimulate's python -m benchmarks._aisim_tables --out FILE)"
        )
    st = p.stat()
    return _load(str(p.resolve()), st.st_mtime_ns, st.st_size, str(path), gpu)


@functools.lru_cache(maxsize=4)
def _load(path: str, mtime_ns: int, size: int, shown: str, gpu: str) -> GemmTimes:
    try:
        body = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"aisim:{shown}: not a JSON file ({e})") from None
    if not isinstance(body, dict) or not isinstance(body.get("gpus"), dict):
        raise ValueError(f"aisim:{shown}: not a benchmarks/_aisim_tables.py export (no 'gpus')")
    have = [g for g, entry in body["gpus"].items() if isinstance(entry, dict) and entry.get("gemm")]
    by_catalog = {GPUS.get(g, g).lower(): g for g in have}
    name = gpu if gpu in have else by_catalog.get(gpu.lower(), "")
    if not name:
        raise ValueError(
            f"aisim:{shown}: no GEMM rows for {gpu} (the file has "
            f"{', '.join(f'{g} ({GPUS[g]})' if g in GPUS else g for g in have) or 'none'})"
        )
    if name not in GPUS:
        raise ValueError(f"aisim:{shown}: {name} is not a GPU of tailserve's catalog ({', '.join(GPUS)})")
    hardware = get_hardware(GPUS[name])
    rows = body["gpus"][name]["gemm"]
    formats = {}
    left_out = []
    for fmt in FORMATS:  # formats tailserve has no name for are left out
        found = [r for r in rows if isinstance(r, list) and r and r[0] == fmt]
        if found:
            a = _numbers(found, f"aisim:{shown}: a {name} {fmt} GEMM row")
            a[:, 3] *= 1e-3  # milliseconds
            why = flat_series(a)
            if why:
                left_out.append((FORMATS[fmt], why))
                continue
            formats[FORMATS[fmt]] = format_rows(FORMATS[fmt], a, hardware)
    if not formats:
        raise ValueError(f"aisim:{shown}: no {', '.join(FORMATS)} GEMM rows for {name}")
    # imported here: aisim_moe_table and aisim_mla_table build on this module
    from tailserve.executors.simulated.aisim_mla_table import MlaRows
    from tailserve.executors.simulated.aisim_moe_table import MoeRows

    moe = body["gpus"][name].get("moe")
    moe_rows = MoeRows.of(moe) if isinstance(moe, list) and moe else None
    framework = str(body.get("framework", "vllm"))
    mla_rows = MlaRows.of(body["gpus"][name])
    return GemmTimes(shown, name, hardware.name, formats, framework, moe_rows, mla_rows, tuple(left_out))


def flat_series(rows: np.ndarray) -> str:
    """Why a format's rows [m, n, k, seconds] are not a GEMM kernel's timing ("" when they are):
    over the model-sized weights timed at both ``FLAT_ROWS`` rows and fewer, the median of the
    time at ``FLAT_ROWS`` over the fastest row's is below ``FLAT_RATIO``."""
    ratios = [
        t[m == FLAT_ROWS][0] / t.min()
        for n, k, m, t in _series(rows[rows[:, 1] * rows[:, 2] >= 2**24])
        if len(m) > 1 and FLAT_ROWS in m
    ]
    if not ratios or float(np.median(ratios)) >= FLAT_RATIO:
        return ""
    return (
        f"{FLAT_ROWS:,} rows take {float(np.median(ratios)):.1f}x the fastest row's time (median over "
        f"{len(ratios)} model-sized weights; a GEMM kernel's grow {FLAT_RATIO:g}x or more)"
    )


def _numbers(rows: list, what: str) -> np.ndarray:
    """Rows [format, m, n, k, ms] as an array of [m, n, k, ms], all > 0; checked as one array (a
    Python loop over ~100,000 rows took 0.4 s), row by row only to name a bad one."""
    try:
        a = np.array([r[1:] for r in rows], dtype=float)
        if a.ndim == 2 and a.shape[1] == 4 and np.all(a > 0):
            return a
    except (TypeError, ValueError):
        pass
    good = lambda r: len(r) == 5 and all(isinstance(x, (int, float)) and x > 0 for x in r[1:])  # noqa: E731
    bad = next((r for r in rows if not good(r)), rows[0])
    raise ValueError(f"{what} is not [format, m, n, k, ms > 0]: {bad!r}")


def catalog_curve(hardware: Hardware, fmt: str) -> GemmCurve:
    """The curve the catalog prices one GEMM of ``fmt`` with on ``hardware``: the format's own,
    else the GPU's bf16 curve with the format's factors, else the generic efficiencies."""
    g = hardware.gemm
    if g is None:
        return GENERIC_CURVE
    own = g.curve_for(fmt)
    if own is not None:
        return own
    fc, fm = g.factors_for(fmt)
    return replace(g, compute=g.compute * fc, memory=g.memory * fm, format_curves=(), format_factors=())


@dataclass(frozen=True, slots=True, eq=False)
class TableGemm:
    """One GEMM of every layer of a kind: its shard's (N, K), launches over all layers, and
    either its measured shape's profile or, outside the table, the catalog's curve."""

    n: float
    k: float
    count: int
    fmt: str
    rows: FormatRows | None  # None: the format's rows were left out (``GemmTimes.left_out``)
    profile: Profile | None
    curve: GemmCurve  # the catalog's, used when ``profile`` is None
    peak: float  # the deployment GPU's rate for the curve
    weight_bytes: float


@dataclass(frozen=True, slots=True, eq=False)
class TableLayers:
    """A deployment's dense GEMMs and LM head priced from a ``GemmTimes``."""

    gemms: tuple[TableGemm, ...]
    head: TableGemm | None
    hardware: Hardware  # the deployment's GPU (the curves' rates)

    @staticmethod
    def of(
        times: GemmTimes,
        gemms: tuple[tuple[float, float, int, str], ...],
        head: tuple[float, float] | None,
        hardware: Hardware,
    ) -> TableLayers:
        """``gemms``: (N, K, launches, weight format) of each dense GEMM; ``head``: the LM head's
        (N, K), bf16."""

        def one(n: float, k: float, count: int, fmt: str) -> TableGemm:
            rows = times.rows_for(fmt)
            prec = get_precision(fmt)
            curve = catalog_curve(hardware, prec.gemm_format)
            profile = rows.profile(n, k) if rows is not None else None
            peak = hardware.peak_for(prec.compute)
            return TableGemm(n, k, count, prec.gemm_format, rows, profile, curve, peak, prec.bytes)

        return TableLayers(tuple(one(*g) for g in gemms), one(*head, 1, "bf16") if head else None, hardware)

    @property
    def outside(self) -> tuple[str, ...]:
        """The GEMMs no measured shapes surround, as ``N x K fmt`` (a format whose rows were left
        out is said once by its own note, not per GEMM)."""
        gemms = (*self.gemms, *((self.head,) if self.head else ()))
        return tuple(f"{g.n:g} x {g.k:g} {g.fmt}" for g in gemms if g.profile is None and g.rows is not None)

    def layers(self, num_tokens: int) -> float:
        """Seconds of every dense GEMM of every layer over ``num_tokens`` rows."""
        return sum(g.count * self._one(g, num_tokens) for g in self.gemms)

    def lm_head(self, num_logits: int) -> float:
        return self._one(self.head, num_logits) if self.head is not None and num_logits else 0.0

    def _one(self, g: TableGemm, rows: int) -> float:
        if g.profile is not None and g.rows is not None:
            return float(g.rows.seconds(rows, g.n, g.k, g.profile))
        hw = self.hardware
        return float(
            curve_gemm_time(
                rows, g.n, g.k, g.curve, g.peak, hw.memory_bandwidth, hw.sms, g.weight_bytes, ACT_BYTES
            )
        )


def table_hardware(text: str, hardware: Hardware) -> tuple[Hardware, tuple[str, ...]]:
    """``hardware`` carrying the GEMM times of ``aisim:FILE[:GPU]``'s part after the prefix (the
    GPU: the deployment's own by default), and a note on where they were measured."""
    path, gpu = split_source(text)
    if not gpu:
        gpu = next((g for g, name in GPUS.items() if name == hardware.name), hardware.name)
    times = load_gemm_times(path, gpu)
    notes = [
        f"GEMMs priced from {Path(path).name}: {times.framework}'s kernels measured on {times.gpu}, "
        f"{', '.join(times.formats)} rows"
    ]
    notes += [f"{times.gpu}'s {fmt} GEMM rows left out: {why}" for fmt, why in times.left_out]
    if times.hardware != hardware.name:
        notes.append(f"the GEMMs were timed on {times.hardware}; their times are applied to {hardware.name}")
    return replace(hardware, gemm_table=times), tuple(notes)
