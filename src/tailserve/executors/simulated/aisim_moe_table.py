"""AISimulate's measured fused-MoE times as the routed experts' time: ``--calibration aisim:FILE``.

The export ``benchmarks/_aisim_tables.py`` writes holds, per GPU, fused-MoE rows [format, tokens,
hidden, inter, top-k, experts, expert TP, EP, kernel, ms]: one MoE layer's routed experts timed
with the engine's own kernels at 27 token counts (1 to 16,384) for each model shape (hidden,
per-expert intermediate size, top-k, experts) and expert TP or EP (a "series"). A deployment
whose experts match a measured series exactly is priced from it instead of from the catalog's
fitted fused-MoE curve:

- the kernel is the one the engine runs for the experts' format on that GPU (vLLM 0.32's choice,
  ``VLLM_KERNELS`` / ``VLLM_EP_KERNELS``, the same table ``benchmarks/fidelity_aisim.py`` prices
  its held-out rows with; where the tables lack it, none: another kernel's times are up to 3x
  off), or for a format vLLM's choice is not known for, the kernel with the most model shapes;
- within the series the time is interpolated linearly in log time and log tokens; beyond the
  largest count (16,384) the last row's achieved fraction of the layer's roofline is held
  (``moe.grouped_gemm_parts`` without row padding: the touched experts' FLOPs at the format's peak
  or their weights and the routed rows at the GPU's bandwidth), so the time grows with it.

On half the token counts of each series held out (``benchmarks/fidelity_aisim_moe_table.py``) log
time gave a lower mean error than the roofline fraction (the GEMM tables' quantity) on 34 of 37
GPU and format pairs, by at most half a point; the fraction's maxima were lower (docs/fidelity.md).
A shape, expert TP or EP the tables do not time, or a format or kernel they lack, keeps the
catalog's curve (``MoeTable.why_outside`` says why, in the note the table path prints). The
exchange of expert parallelism with data-parallel attention stays the catalog's
(``moe_comm.py``): the rows time one rank's layer with every token already on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from tailserve.executors.simulated.aisim_table import ACT_BYTES
from tailserve.executors.simulated.hardware import Hardware
from tailserve.executors.simulated.moe import grouped_gemm_parts
from tailserve.executors.simulated.precision import get_precision

# The experts' weight format (tailserve's name) -> the tables' format. Static-scale FP8 (ModelOpt)
# checkpoints run their own kernels, timed among the tables' fp8 rows; INT4 and MXFP4 here are the
# weight-only kernels (bf16 activations), as the catalog's curves for them were fitted.
TABLE_FORMATS = {
    "bf16": "bfloat16",
    "fp16": "bfloat16",
    "fp8": "fp8",
    "fp8_static": "fp8",
    "fp8_block": "fp8_block",
    "nvfp4": "nvfp4",
    "int4": "int4_wo",
    "mxfp4": "w4a16_mxfp4",
}

# The fused-MoE kernel vLLM 0.32 runs by default for a format on a GPU (tensor parallel), where
# the tables hold several; the sources are cited where benchmarks/fidelity_aisim.py, which prices
# its held-out rows with these same tables, imports them (``VLLM_MOE_KERNELS``).
BLACKWELL = ("b200_sxm", "gb200", "b300_sxm")
HOPPER = ("h100_sxm", "h200_sxm")
FP8_STATIC_KERNELS = {
    **{(g, "fp8_static"): "vllm_modeloptfp8moe_flashinfer_cutlass_flashinferexperts" for g in HOPPER},
    **{(g, "fp8_static"): "vllm_modeloptfp8moe_flashinfer_trtllm_trtllmfp8expertsmonolithic" for g in BLACKWELL},
}  # fmt: skip
VLLM_KERNELS = {
    **FP8_STATIC_KERNELS,
    **{(g, "fp8"): "vllm_fused_moe" for g in (*HOPPER, *BLACKWELL)},
    **{(g, "fp8_block"): "vllm_fp8moe_triton_tritonexperts" for g in HOPPER},
    **{(g, "fp8_block"): "vllm_fp8moe_flashinfer_trtllm_trtllmfp8expertsmonolithic" for g in BLACKWELL},
}
# With expert parallelism vLLM 0.32 on Hopper runs FlashInfer's CUTLASS kernel for block FP8.
VLLM_EP_KERNELS = {
    **{(g, "fp8_block"): "vllm_fp8moe_flashinfer_cutlass_flashinferexperts" for g in HOPPER},
    **FP8_STATIC_KERNELS,
}

# A series: (hidden, per-expert intermediate size, top-k, experts, expert TP, EP)
Series = tuple[int, int, int, int, int, int]


@dataclass(frozen=True, eq=False)
class MoeRows:
    """One GPU's fused-MoE rows of an export: per table format and kernel, each series' token
    counts (ascending) and seconds."""

    series: dict[tuple[str, str], dict[Series, tuple[np.ndarray, np.ndarray]]]

    @staticmethod
    def of(rows: list) -> MoeRows:
        """From the export's rows; rows that are not [str, 7 numbers > 0, str, ms > 0] are left out
        (the tables hold a few failed measurements as 0 ms)."""
        groups: dict[tuple[str, str], dict[Series, list[tuple[float, float]]]] = {}
        for r in rows:
            if not (isinstance(r, list) and len(r) == 10 and isinstance(r[0], str) and isinstance(r[8], str)):
                continue
            nums = r[1:8] + r[9:]
            if not all(isinstance(x, (int, float)) and x > 0 for x in nums):
                continue
            key = (int(r[2]), int(r[3]), int(r[4]), int(r[5]), int(r[6]), int(r[7]))
            groups.setdefault((r[0], r[8]), {}).setdefault(key, []).append((float(r[1]), float(r[9]) * 1e-3))
        series = {}
        for kind, by in groups.items():
            series[kind] = {}
            for key, pts in by.items():
                t, s = np.array(sorted(pts, key=lambda p: p[0])).T  # stable: rows in file order
                t, first = np.unique(t, return_index=True)  # a repeated token count: its first row
                series[kind][key] = (t, s[first])
        return MoeRows(series)

    def kernel(self, gpu: str, fmt: str, framework: str, expert_parallel: bool) -> tuple[str | None, str]:
        """The kernel whose rows price experts in ``fmt`` (tailserve's name) on ``gpu``
        (AISimulate's name), or None and why: with vLLM's tables the engine's own kernel where
        it is known (``VLLM_KERNELS``, with expert parallelism ``VLLM_EP_KERNELS`` first), None
        if the rows lack it (another kernel's rows would be up to 3x off); else the table format's
        kernel with the most model shapes at EP 1 (ties: the most rows)."""
        table = TABLE_FORMATS.get(fmt)
        kernels = {kn for f, kn in self.series if f == table}
        if not kernels:
            return None, f"no {table or fmt} fused-MoE rows"
        if framework == "vllm":
            choices = (VLLM_EP_KERNELS, VLLM_KERNELS) if expert_parallel else (VLLM_KERNELS,)
            named = next((c[(gpu, fmt)] for c in choices if (gpu, fmt) in c), None)
            if named is not None:
                return (named, "") if named in kernels else (None, f"vLLM's kernel {named} not timed here")

        def rank(kn: str) -> tuple:
            ep1 = [s for s in self.series[(table, kn)] if s[5] == 1]
            return len({s[:4] for s in ep1}), sum(len(self.series[(table, kn)][s][0]) for s in ep1), kn

        return max(kernels, key=rank), ""


def describe(key: Series) -> str:
    hidden, inter, topk, experts, tp, ep = key
    return f"{hidden} x {inter}, top-{topk} of {experts} experts, " + (
        f"EP {ep}" if ep > 1 else f"expert TP {tp}"
    )


def roofline(tokens, key: Series, peak: float, bandwidth: float, weight_bytes: float) -> np.ndarray:
    """Seconds of one MoE layer's routed experts on one rank at ``peak`` FLOP/s or at
    ``bandwidth``, whichever is longer (``grouped_gemm_parts`` with no row tile); ``tokens`` a
    number or an array."""
    hidden, inter, topk, experts, tp, ep = key
    out = []
    for t in np.atleast_1d(np.asarray(tokens, dtype=float)):
        flops, moved = grouped_gemm_parts(
            max(1, round(t)), experts, topk, hidden, inter,
            weight_bytes=weight_bytes, act_bytes=ACT_BYTES, tile_m=1, moe_tp=tp, ep=ep,
        )  # fmt: skip
        out.append(max(flops / peak, moved / bandwidth))
    return np.array(out)


@dataclass(frozen=True, eq=False)
class MoeTable:
    """A deployment's routed experts priced from one measured series, or, outside the tables,
    None and why (the catalog's curve prices them)."""

    key: Series
    fmt: str  # the experts' format, tailserve's name
    kernel: str | None
    log_tokens: np.ndarray | None  # the series' token counts, ascending (None: outside)
    log_seconds: np.ndarray | None
    peak: float  # the roofline's rates, beyond the largest token count
    bandwidth: float
    weight_bytes: float
    why_outside: str = ""
    _memo: dict[int, float] = field(default_factory=dict, repr=False)

    @staticmethod
    def of(
        rows: MoeRows | None,
        gpu: str,
        framework: str,
        fmt: str,
        key: Series,
        expert_parallel: bool,
        hw: Hardware,
    ) -> MoeTable:
        """``key``: the deployment's series (expert TP 1 with expert parallelism, EP 1 without);
        ``hw``: the GPU the rows were timed on (the roofline beyond the last row: the times
        apply as measured, as the GEMMs' do)."""
        prec = get_precision(fmt)
        peak, bw = hw.peak_for(prec.compute), hw.memory_bandwidth
        shape = describe(key)
        kernel, why = (
            rows.kernel(gpu, fmt, framework, expert_parallel)
            if rows is not None
            else (None, "no fused-MoE rows")
        )
        if kernel is None:
            why = f"fused MoE {shape} {fmt} ({why})"
            return MoeTable(key, fmt, None, None, None, peak, bw, prec.bytes, why)
        assert rows is not None
        found = rows.series[(TABLE_FORMATS[fmt], kernel)].get(key)
        if found is None:
            why = f"fused MoE {shape} {fmt} (not a shape {kernel.removeprefix('vllm_')} was timed at)"
            return MoeTable(key, fmt, kernel, None, None, peak, bw, prec.bytes, why)
        tokens, seconds = found
        return MoeTable(key, fmt, kernel, np.log(tokens), np.log(seconds), peak, bw, prec.bytes)

    @property
    def priced(self) -> bool:
        """Whether the rows price the experts (else the catalog's curve does)."""
        return self.log_tokens is not None

    @property
    def note(self) -> str:
        """Where the routed experts' times come from, for the table path's notes."""
        if not self.priced:
            return ""
        return f"fused MoE ({describe(self.key)} {self.fmt}) priced from the rows of {self.kernel}"

    def seconds(self, tokens: int) -> float:
        """One MoE layer's routed experts over ``tokens`` tokens (all the experts' ranks see);
        memoised (the cost model's own memo is per token and logit count)."""
        t = self._memo.get(tokens)
        if t is None:
            t = self._memo[tokens] = self._seconds(max(tokens, 1))
        return t

    def _seconds(self, tokens: int) -> float:
        assert self.log_tokens is not None and self.log_seconds is not None
        x = math.log(tokens)
        if x <= self.log_tokens[-1]:
            return math.exp(float(np.interp(x, self.log_tokens, self.log_seconds)))
        # beyond the largest count: the last row's fraction of the roofline, held
        last = math.exp(self.log_tokens[-1])
        return math.exp(self.log_seconds[-1]) * self._roofline(tokens) / self._roofline(round(last))

    def _roofline(self, tokens: int) -> float:
        return float(roofline(tokens, self.key, self.peak, self.bandwidth, self.weight_bytes)[0])
