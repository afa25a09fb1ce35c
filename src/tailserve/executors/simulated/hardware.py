"""GPU catalog: public peak figures of each accelerator (dense, no sparsity; bf16 and, where the
GPU has them, FP8 / INT8 / FP4 tensor-core rates).

Sources are the vendors' data sheets (SXM / OAM form factors where there is a choice).
Memory is what the driver reports, in GiB, because vLLM's device-based defaults compare GiB.
Interconnect is the per-GPU, per-direction bandwidth a ring all-reduce can use (NVLink /
Infinity Fabric; PCIe for cards without a GPU-to-GPU link). SM counts (compute units on AMD) are
the data sheets' for the shipped parts: A100 108, H100/H200 SXM 132, H20 78, A40 84, L4 58,
L40S 142, B200/B300/GB200 148, MI300X/MI325X 304, MI355X 256.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tailserve.core.device import DeviceInfo
from tailserve.executors.simulated.precision import gemm_format

if TYPE_CHECKING:
    from tailserve.executors.simulated.aisim_table import GemmTimes

GB = 1e9


@dataclass(frozen=True, slots=True)
class GemmCurve:
    """A GPU's linear-layer (GEMM) efficiency curve, fitted to measured operator profiles
    (``profiles.py``; the fit, its held-out errors and the source in docs/fidelity.md)."""

    compute: float  # fraction of peak FLOP/s at large token counts
    memory: float  # fraction of peak bandwidth for the weight reads of small batches
    sharpness: float  # p of the p-norm joining compute and memory time (see cost_model.join)
    tile_m: int  # row tile: token counts are rounded up to it
    gemm_latency: float  # seconds per GEMM launch
    source: str  # which profiles the fit came from
    tile_n: int = 0  # column tile of the per-GEMM wave form (gemm.py); 0: one join per layer
    wave_alpha: float = 1.0  # fraction of a whole wave a partial last wave costs
    # GEMMs with weights in another format against this (bf16) curve: (format, factor on the
    # compute efficiency, factor on the memory efficiency); a format not listed keeps the curve.
    format_factors: tuple[tuple[str, float, float], ...] = ()
    # (format, bytes per input element): the kernel that quantizes a GEMM's bf16 input to the
    # format before it (reads 2 bytes, writes the format and its scales: FP8 per tensor 3) runs
    # on its own at the curve's memory rate. vLLM's isolated-op tables (AISimulate's) time it
    # with the GEMM; served under torch.compile, vLLM fuses it into the RMSNorm or SiLU-and-mul
    # before (PassConfig fuse_norm_quant / fuse_act_quant), so the catalog leaves it out. Not
    # listed: 0.
    quant_bytes: tuple[tuple[str, float], ...] = ()
    # (format, its own curve): GEMMs with weights in that format priced per GEMM in the wave form
    # with the format's own efficiencies (of the format's tensor-core peak), tiles, partial-wave
    # cost and launch latency, instead of ``format_factors`` on this curve. FP8 and NVFP4 GEMMs
    # miss by N, not M (few output tiles of a narrow N each running a long K loop), which two
    # factors on a bf16 curve cannot price (docs/fidelity.md).
    format_curves: tuple[tuple[str, GemmCurve], ...] = ()
    # The kernel's tile by shape, first match wins: (rows at most, N at most, tile M, tile N),
    # a bound of 0 matching any; GEMMs no entry matches take tile_m x tile_n. vLLM's CUTLASS FP8
    # kernel on Hopper picks its tile by M (and by N below 64 rows).
    m_tiles: tuple[tuple[int, int, int, int], ...] = ()

    def __post_init__(self) -> None:
        for name, value in self.quant_bytes:
            if not value >= 0:
                raise ValueError(f"GemmCurve quant_bytes for {name} must be >= 0 bytes, got {value}")
        for name, curve in self.format_curves:
            if curve.format_curves:
                raise ValueError(f"GemmCurve format_curves for {name}: a format's curve holds no formats")
        for entry in self.m_tiles:
            if len(entry) != 4 or min(entry) < 0 or min(entry[2:]) < 1:
                raise ValueError(f"GemmCurve m_tiles entry {entry}: (rows, N, tile M >= 1, tile N >= 1)")
        if self.m_tiles and self.tile_n < 1:
            raise ValueError(
                "GemmCurve m_tiles needs the wave form (tile_n >= 1) for the shapes no entry matches"
            )

    # A format's dense GEMMs are those of its ``Precision.gemm`` (fp8_static: fp8's kernel)
    def factors_for(self, fmt: str) -> tuple[float, float]:
        fmt = gemm_format(fmt)
        for name, compute, memory in self.format_factors:
            if name == fmt:
                return compute, memory
        return 1.0, 1.0

    def quant_bytes_for(self, fmt: str) -> float:
        fmt = gemm_format(fmt)
        return next((value for name, value in self.quant_bytes if name == fmt), 0.0)

    def curve_for(self, fmt: str) -> GemmCurve | None:
        """The format's own curve (``format_curves``), None without one."""
        fmt = gemm_format(fmt)
        return next((curve for name, curve in self.format_curves if name == fmt), None)


@dataclass(frozen=True, slots=True)
class MoeCurve:
    """One expert weight format's fused MoE kernel on a curve of its own (``MoeKernel.format_curves``):
    the grouped GEMMs' p-norm join at its own compute and memory efficiency, row tile and
    sharpness, a fixed time per layer and a time per routed row element, fitted to that
    format's kernel in AISimulate's tables (benchmarks/fidelity_aisim.py). The formats' kernels
    differ (on the H200: Triton for bf16 and FP8, FlashInfer's CUTLASS for block FP8 under expert
    parallelism, Marlin for INT4), which factors on one curve cannot follow."""

    compute: float  # fraction of the peak of ``math``
    memory: float  # fraction of memory_bandwidth
    sharpness: float
    tile_m: int
    layer_latency: float  # seconds per MoE layer
    row_element: float  # seconds per routed row and hidden element (as MoeKernel's)
    math: str  # the tensor-core format it computes in: weight-only kernels (INT4, MXFP4 W4A16) bf16

    def __post_init__(self) -> None:
        for name in ("compute", "memory"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"MoeCurve {name} must be in (0, 1], got {getattr(self, name)}")
        if self.layer_latency < 0 or self.row_element < 0 or self.tile_m < 1 or self.sharpness <= 0:
            raise ValueError(f"MoeCurve: negative time, tile_m < 1 or sharpness <= 0 in {self}")


@dataclass(frozen=True, slots=True)
class MoeKernel:
    """The fused MoE kernel (routing, the permutation of rows, two grouped GEMMs) against the
    GPU's GEMM curve: factors on its compute and memory rates and a fixed time per layer,
    fitted to AISimulate's measured fused-MoE tables (benchmarks/fidelity_aisim.py)."""

    compute: float
    memory: float
    layer_latency: float  # seconds per MoE layer
    source: str
    # Seconds per routed row and hidden element (routed rows: tokens x experts per token): the rows'
    # gather, activation and scatter around the grouped GEMMs, which tensor parallelism inside
    # the experts does not split (a layer at expert TP 32 still moves every routed row whole).
    row_element: float = 0.0
    # (expert weight format, its own curve): experts in that format priced on it instead of the
    # factors above on the GPU's curve (with the format's GEMM factors); others keep the factors.
    format_curves: tuple[tuple[str, MoeCurve], ...] = ()
    # (format, curve) where the engine runs another kernel, or the same kernel fits apart, when
    # the experts are placed whole (expert parallelism): vLLM 0.32 on Hopper moves FlashInfer's
    # CUTLASS kernel ahead of Triton for block FP8 with EP > 1
    # (vllm/model_executor/layers/fused_moe/oracle/fp8.py:120-130@v0.32.0); static FP8's kernels
    # fitted on their EP rows.
    ep_format_curves: tuple[tuple[str, MoeCurve], ...] = ()

    def __post_init__(self) -> None:
        if not self.row_element >= 0:
            raise ValueError(f"MoeKernel row_element must be >= 0 seconds, got {self.row_element}")

    def curve_for(self, fmt: str, expert_parallel: bool = False) -> MoeCurve | None:
        """The format's own fused-MoE curve (its expert-parallel one with ``expert_parallel``
        where it has one), None without one."""
        if expert_parallel:
            own = next((curve for name, curve in self.ep_format_curves if name == fmt), None)
            if own is not None:
                return own
        return next((curve for name, curve in self.format_curves if name == fmt), None)


@dataclass(frozen=True, slots=True)
class MlaCurveTerms:
    """A weight format's MLA block terms when the model's dense GEMMs run on the format's own
    curve (``MlaKernel.curve_terms``). The block's projections then leave the layer join, whose
    four launches per layer and activation bytes per token had priced the block's launches and
    its per-token work between them (norms, RoPE, the activations' quantization, the cache
    write): here the fixed time per layer holds the launches and ``token`` the per-token work."""

    gemm_factor: float  # on the projections' join, as MlaKernel.gemm_factors
    latency: float  # seconds per layer on each path run, on top of the path's latency
    decode_request: float  # seconds per decode request and layer, on top of decode_request
    token: float  # seconds per new token and layer

    def __post_init__(self) -> None:
        if not 0.0 < self.gemm_factor <= 1.0 or min(self.latency, self.decode_request, self.token) < 0:
            raise ValueError(f"MlaCurveTerms: gemm_factor in (0, 1] and times >= 0, got {self}")


@dataclass(frozen=True, slots=True)
class MlaKernel:
    """vLLM's MLA attention block (the q/kv down- and up-projections, the attention kernel,
    o_proj, and the norms, RoPE and cache writes between them) against the GPU's curves: a
    factor on the projections' GEMM time per weight format, factors on the prefill and decode
    attention rates (<= 1), a fixed time per layer for each path an iteration runs (its
    prefill path when it has a prefill chunk, its decode path when it has a decode) and each
    path's times per request (prefill chunk or decode), fitted to AISimulate's MLA module tables
    (benchmarks/fidelity_aisim.py)."""

    gemm_factors: tuple[tuple[str, float], ...]  # (weight format, factor <= 1); others: 1
    prefill_attention: float
    decode_attention: float
    prefill_latency: float  # seconds per MLA layer of an iteration with a prefill chunk
    decode_latency: float  # seconds per MLA layer of an iteration with decodes
    source: str
    # The decode path's work per request (FLASHINFER_MLA / FLASH_ATTN_MLA decode, vLLM's absorbed
    # form): seconds per decode request, per decode request and head of the shard (the absorbed
    # up-projections run as per-head batched matmuls, K = 128 / N = 512 and back, far below the
    # GEMM curve), and per token of the decodes' mean context (a lone request's KV is read by
    # a few split-KV tiles, not the whole GPU). Per MLA layer.
    decode_request: float = 0.0
    decode_head: float = 0.0
    decode_context: float = 0.0
    # (weight format, seconds per decode request and layer on top of decode_request; seconds per
    # layer on each path run, on top of its latency): block-scaled FP8 quantizes the activations
    # before every projection, one more kernel each
    decode_request_by_format: tuple[tuple[str, float], ...] = ()
    latency_by_format: tuple[tuple[str, float], ...] = ()
    # The prefill path's work per prefill chunk (``BatchShape.num_prefills``): seconds per chunk
    # and per chunk and head of the shard, per MLA layer. Blackwell's FLASH_ATTN prefill runs
    # 16-token prompts at 2.2x the time the same tokens take as 512-token ones (B200, 128 heads:
    # 256 x 16 tokens 2.62 ms, 8 x 512 tokens 1.18 ms), in proportion to the heads: each
    # request's query tiles are padded per head; Hopper's FLASH_ATTN_MLA shows no such cost.
    prefill_request: float = 0.0
    prefill_head: float = 0.0
    # The decode path's per-request terms saturate: past ``decode_knee`` decodes (0: never) each
    # further decode adds ``decode_beyond`` of a decode's time. Hopper's block flattens past 512
    # (H200, 128 heads, <= 64 tokens of context: 0.26 ms at 256 decodes, 0.51 at 512, 0.72 at
    # 1,024; fitted: 512 and 0); Blackwell's bends less (fitted: 128 and 0.5). Read from the
    # tables' batch sizes (powers of two), not from the kernels.
    decode_knee: int = 0
    decode_beyond: float = 1.0
    # (weight format, its terms on that format's own GEMM curve): an MLA model whose weights'
    # format has a curve here and in ``GemmCurve.format_curves`` prices its dense GEMMs on that
    # curve, and these terms replace the format's factor, latency_by_format and
    # decode_request_by_format above (fitted on the layer join's path, which a calibrated
    # efficiency or another engine's GEMM set without the curve keeps).
    curve_terms: tuple[tuple[str, MlaCurveTerms], ...] = ()

    # a format's projections are priced as those of its ``Precision.gemm``
    def gemm_factor(self, fmt: str) -> float:
        return dict(self.gemm_factors).get(gemm_format(fmt), 1.0)

    def format_request(self, fmt: str) -> float:
        return dict(self.decode_request_by_format).get(gemm_format(fmt), 0.0)

    def format_latency(self, fmt: str) -> float:
        return dict(self.latency_by_format).get(gemm_format(fmt), 0.0)

    def curve_terms_for(self, fmt: str) -> MlaCurveTerms | None:
        return dict(self.curve_terms).get(gemm_format(fmt))


@dataclass(frozen=True, slots=True)
class LinkFit:
    """One collective or exchange phase: ``max(floor, latency + tokens x per_token + bytes /
    (interconnect_bandwidth x efficiency))``. DeepEP's phases have a floor (high-throughput
    dispatch: its notify and layout round, ~250 us, flat up to ~512 tokens a rank) and a cost per
    token sent beside its bytes (the kernel's per-token work: the measured time grows with the
    tokens more than with their hidden size); NCCL's collectives take neither (0)."""

    latency: float  # seconds per call
    efficiency: float  # fraction of interconnect_bandwidth
    per_token: float = 0.0  # seconds per token the rank sends
    floor: float = 0.0  # seconds: the phase is never faster


@dataclass(frozen=True, slots=True)
class MoeExchange:
    """The token exchanges of an MoE layer under data-parallel attention (``moe_comm.py``),
    fitted per phase to AISimulate's tables of this GPU: DeepEP's high-throughput (normal) and
    low-latency dispatch and combine as vLLM runs them, and NCCL's all-gather and
    reduce-scatter per group size (vLLM's default allgather_reducescatter backend)."""

    ht_dispatch: LinkFit
    ht_combine: LinkFit
    ll_dispatch: LinkFit
    ll_combine: LinkFit
    # (GPUs in the group, fit); a group may have one fit per NCCL protocol: the fastest prices it
    all_gather: tuple[tuple[int, LinkFit], ...]
    reduce_scatter: tuple[tuple[int, LinkFit], ...]
    source: str


@dataclass(frozen=True, slots=True)
class AllReduceBand:
    """One message-size band of a fitted all-reduce at one TP degree: messages up to
    ``max_bytes`` take ``latency + 2 (tp-1)/tp * bytes / (link * efficiency)``. NCCL changes
    protocol (LL, LL128, Simple) and algorithm with the size, and vLLM its kernel
    (``allreduce_regimes.py``: the bands' edges are then vLLM's boundaries), so one line per band."""

    tp: int
    max_bytes: float  # upper edge of the band (the last band of a TP also prices larger messages)
    latency: float  # seconds per collective
    efficiency: float  # fraction of interconnect_bandwidth


@dataclass(frozen=True, slots=True)
class EngineKernels:
    """One serving engine's own GEMM and fused-MoE kernels on a GPU, fitted the way the catalog's
    (vLLM's) are but to that engine's tables (benchmarks/fidelity_aisim.py ``--framework``).
    ``engine_hardware`` swaps them in for the GPU's own."""

    engine: str  # "trtllm" or "sglang" (KERNEL_ENGINES)
    gemm: GemmCurve | None  # None: the GPU's own curve
    moe: MoeKernel | None  # None: the GPU's own fused-MoE figures
    source: str


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    memory_bandwidth: float  # HBM bytes/s
    memory_gib: float  # device memory reported by the driver, GiB
    interconnect_bandwidth: float  # GPU-to-GPU bytes/s per direction
    pcie_bandwidth: float  # host-to-device bytes/s per direction (KV swap traffic)
    allreduce_latency: float = 8e-6  # seconds per collective (launch + sync, small messages)
    vendor: str = "nvidia"
    sms: int = 0  # streaming multiprocessors (AMD: compute units), for GEMM waves; 0: unknown
    gemm: GemmCurve | None = None  # fitted linear-layer curve; None: the generic default efficiencies
    # Measured all-reduce latency per TP degree ((2, s), (4, s), (8, s)); others use allreduce_latency.
    allreduce_latency_by_tp: tuple[tuple[int, float], ...] = ()
    comm_efficiency: float | None = None  # fitted all-reduce link efficiency; None: the generic 0.8
    # Fitted all-reduce per message-size band (by TP, ascending max_bytes); a TP degree without
    # bands uses allreduce_latency_by_tp and comm_efficiency.
    allreduce_bands: tuple[AllReduceBand, ...] = ()
    # Dense tensor-core FLOP/s of other formats, (format, FLOP/s): ("fp8", ...), ("fp4", ...),
    # ("int8", ...). A format the GPU lacks runs weight-only kernels at the bf16 rate (peak_for).
    peak_flops_by_dtype: tuple[tuple[str, float], ...] = ()
    # GPUs one NVLink / Infinity Fabric domain joins at ``interconnect_bandwidth`` (8 for a
    # board, 72 for GB200/GB300 NVL72); beyond it traffic goes over the network.
    nvlink_domain: int = 8
    moe: MoeKernel | None = None  # the fused MoE kernel's figures; None: MOE_GENERIC
    mla: MlaKernel | None = None  # the MLA attention block's figures; None: the plain curves
    moe_exchange: MoeExchange | None = None  # None: the all-reduce's latency and efficiency
    # Other engines' kernels on this GPU (the fields above are vLLM's); engine_hardware picks one
    engine_kernels: tuple[EngineKernels, ...] = ()
    # Measured GEMM times that price the dense GEMMs instead of the curves (``--calibration
    # aisim:FILE``, aisim_table.py); hashed by identity. None: the curves.
    gemm_table: GemmTimes | None = None

    def __post_init__(self) -> None:
        for name in (
            "peak_flops",
            "memory_bandwidth",
            "memory_gib",
            "interconnect_bandwidth",
            "pcie_bandwidth",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"hardware {self.name}: {name} must be > 0, got {getattr(self, name)}")

    def peak_for(self, compute: str) -> float:
        """Dense FLOP/s of a GEMM in the tensor-core format ``compute`` (``precision.Precision``):
        bf16's ``peak_flops`` unless the GPU lists that format."""
        if compute == "bf16":
            return self.peak_flops
        return dict(self.peak_flops_by_dtype).get(compute, self.peak_flops)

    def allreduce_latency_at(self, tp: int) -> float:
        return dict(self.allreduce_latency_by_tp).get(tp, self.allreduce_latency)

    def allreduce_bands_at(self, tp: int) -> tuple[AllReduceBand, ...]:
        return tuple(b for b in self.allreduce_bands if b.tp == tp)

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    @property
    def device_info(self) -> DeviceInfo:
        return DeviceInfo(self.name, self.memory_gib, self.vendor)


# Fitted by benchmarks/fidelity_profiles.py to Vidur's linear-layer profiles (docs/fidelity.md
# has the held-out errors). A GPU without profiles borrows the nearest profiled one's curve.
_VIDUR = "Vidur mlp.csv profiles"
A100_GEMM = GemmCurve(0.732, 0.788, 2.75, 128, 6.06e-6, f"{_VIDUR}, A100: Llama-3-8B + Llama-2-70B")
H100_GEMM = GemmCurve(0.746, 0.934, 3.0, 256, 7.45e-6, f"{_VIDUR}, H100: Llama-2-70B")
A40_GEMM = GemmCurve(0.778, 0.816, 1.75, 64, 5.18e-6, f"{_VIDUR}, A40: Llama-2-7B")
# Candidate forms fitted by the same benchmark but not the default (docs/fidelity.md has the
# tables): per-GEMM waves on the H100 (lower held-out max error, higher mean on Llama-2-7B, and
# the H200 Llama-3.1-8B batch point moves away while two others come closer) and NCCL all-reduce per message-size band (lower
# mean error, but NCCL is slower than vLLM's custom all-reduce at decode sizes, so the H200 TP 4
# end-to-end point moves from +3% to +14%). ``python -m benchmarks.fidelity_profiles --parts published --variant`` uses them.
H100_GEMM_WAVES = GemmCurve(
    0.760, 0.864, 6.0, 256, 2.99e-6, f"{_VIDUR}, H100: Llama-2-70B (wave form)", tile_n=128, wave_alpha=0.3
)
# The tile-choice candidate (tile_choice.py, benchmarks/fidelity_gemm_jumps.py (since removed; at daf5455)): the wave-form
# curve fitted on the training models, each GEMM at the fastest of TILE_CHOICE_TILES with these
# compute-efficiency factors (0.6: the grid's floor, in effect unused). Lower held-out errors on
# the H100 and the A100's CodeLlama-34B, not on the A40; ``fidelity_profiles --parts published --variant tiles``.
TILE_CHOICE_TILES = ((64, 64), (64, 128), (128, 128), (128, 256), (256, 128))
A100_GEMM_TILES = GemmCurve(
    0.736, 0.768, 3.0, 128, 4.46e-6, f"{_VIDUR}, A100 (tile choice)", tile_n=128, wave_alpha=0.1
)
A100_TILE_SCALES = (0.6, 0.8, 1.0, 0.6, 0.6)
H100_GEMM_TILES = GemmCurve(
    0.760, 0.864, 6.0, 256, 4.49e-6, f"{_VIDUR}, H100: Llama-2-70B (tile choice)", tile_n=128, wave_alpha=0.3
)
H100_TILE_SCALES = (0.6, 0.6, 0.8, 0.9, 1.0)
A100_ALLREDUCE_BANDS = (
    AllReduceBand(2, 524288, 43.7e-6, 1.000),
    AllReduceBand(2, 8388608, 47.6e-6, 0.672),
    AllReduceBand(2, 67108864, 45.1e-6, 0.571),
    AllReduceBand(4, 524288, 24.5e-6, 0.517),
    AllReduceBand(4, 8388608, 22.2e-6, 0.340),
    AllReduceBand(4, 67108864, 67.3e-6, 0.634),
    AllReduceBand(8, 524288, 33.5e-6, 0.200),
    AllReduceBand(8, 8388608, 30.7e-6, 0.382),
    AllReduceBand(8, 67108864, 91.2e-6, 0.627),
)
H100_ALLREDUCE_BANDS = (
    AllReduceBand(2, 524288, 8.8e-6, 0.091),
    AllReduceBand(2, 8388608, 21.6e-6, 0.647),
    AllReduceBand(2, 67108864, 15.9e-6, 0.636),
    AllReduceBand(4, 524288, 37.9e-6, 0.267),
    AllReduceBand(4, 8388608, 30.2e-6, 0.944),
    AllReduceBand(4, 67108864, 22.5e-6, 0.767),
    AllReduceBand(8, 524288, 23.8e-6, 0.240),
    AllReduceBand(8, 8388608, 27.4e-6, 0.682),
    AllReduceBand(8, 67108864, 41.1e-6, 0.838),
)
# Fitted by benchmarks/fidelity_aisim.py to AISimulate's silicon tables (vLLM 0.27-0.31 GEMMs on
# real GPUs, model-sized weights, half the shapes held out; docs/fidelity.md): the Blackwell GPUs'
# bf16 curves (no Vidur profile covers them) and every fitted GPU's factors for FP8 (per tensor),
# block-scaled FP8 and NVFP4 weights against its bf16 curve.
_AISIM = "AISimulate silicon tables (vLLM GEMMs)"
HOPPER_FORMAT_FACTORS = (("fp8", 0.63, 0.99), ("fp8_block", 0.81, 0.95))
# Each quantized format's own per-GEMM wave curve (GemmCurve.format_curves), fitted by the same
# benchmark on the same training shapes without the input's quantization kernel (served, vLLM
# fuses it into the norm or activation before; the isolated-op tables time it with the GEMM, so
# the rates and launch latency here hold its time, as the factors above do). Not B200's
# block-scaled FP8: none of its table's rows (vLLM 0.27.1's DeepGEMM) takes under 149 us, a
# 177 us launch in the fit, which no served B200 pays; it keeps its factors.
H100_FORMAT_CURVES = (
    ("fp8", GemmCurve(0.51, 0.81, 6.0, 256, 6.78e-6, f"{_AISIM}, H100 fp8", tile_n=64, wave_alpha=0.7)),
    ("fp8_block", GemmCurve(0.69, 0.80, 2.0, 256, 4.69e-6, f"{_AISIM}, H100 fp8_block", tile_n=64, wave_alpha=0.7)),
)  # fmt: skip
H200_FORMAT_CURVES = (
    ("fp8", GemmCurve(0.57, 0.81, 3.0, 256, 7.17e-6, f"{_AISIM}, H200 fp8", tile_n=64, wave_alpha=0.7)),
    ("fp8_block", GemmCurve(0.68, 0.81, 2.5, 256, 7.01e-6, f"{_AISIM}, H200 fp8_block", tile_n=64, wave_alpha=0.5)),
)  # fmt: skip
B200_GEMM = GemmCurve(
    0.73, 0.84, 2.5, 64, 3.70e-6, f"{_AISIM}, B200",
    format_factors=(("fp8", 0.68, 1.0), ("fp8_block", 1.0, 1.0), ("nvfp4", 0.95, 1.0)),
    format_curves=(
        ("fp8", GemmCurve(0.50, 0.82, 3.0, 64, 7.35e-6, f"{_AISIM}, B200 fp8", tile_n=256, wave_alpha=0.5)),
        ("nvfp4", GemmCurve(0.61, 0.92, 1.5, 64, 6.52e-6, f"{_AISIM}, B200 nvfp4", tile_n=256, wave_alpha=0.7)),
    ),
)  # fmt: skip
GB200_GEMM = GemmCurve(
    0.74, 0.81, 2.5, 64, 3.39e-6, f"{_AISIM}, GB200",
    format_factors=(("fp8", 0.73, 1.0), ("fp8_block", 0.68, 1.0), ("nvfp4", 0.84, 1.0)),
    format_curves=(
        ("fp8", GemmCurve(0.51, 0.85, 2.5, 64, 7.28e-6, f"{_AISIM}, GB200 fp8", tile_n=256, wave_alpha=0.5)),
        ("fp8_block", GemmCurve(0.51, 0.86, 3.0, 64, 13.82e-6, f"{_AISIM}, GB200 fp8_block", tile_n=256, wave_alpha=0.5)),
        ("nvfp4", GemmCurve(0.60, 0.90, 1.5, 64, 6.14e-6, f"{_AISIM}, GB200 nvfp4", tile_n=256, wave_alpha=0.7)),
    ),
)  # fmt: skip
B300_GEMM = GemmCurve(
    0.81, 0.82, 3.0, 64, 3.71e-6, f"{_AISIM}, B300",
    format_factors=(("fp8", 0.69, 1.0), ("fp8_block", 0.75, 1.0), ("nvfp4", 0.63, 1.0)),
    format_curves=(
        ("fp8", GemmCurve(0.52, 0.81, 3.0, 64, 7.26e-6, f"{_AISIM}, B300 fp8", tile_n=256, wave_alpha=0.5)),
        ("fp8_block", GemmCurve(0.61, 0.83, 4.0, 64, 12.29e-6, f"{_AISIM}, B300 fp8_block", tile_n=256, wave_alpha=0.5)),
        ("nvfp4", GemmCurve(0.47, 0.97, 1.25, 64, 5.12e-6, f"{_AISIM}, B300 nvfp4", tile_n=256, wave_alpha=0.7)),
    ),
)  # fmt: skip
H100_GEMM_FORMATS = replace(H100_GEMM, format_factors=HOPPER_FORMAT_FACTORS, format_curves=H100_FORMAT_CURVES)
H200_GEMM_FORMATS = replace(H100_GEMM, format_factors=HOPPER_FORMAT_FACTORS, format_curves=H200_FORMAT_CURVES)
# The fused bf16 MoE kernel per GPU (the rows of its kernel with the most model shapes; formats
# share them), fitted with its time per routed row element; the memory factor at most 1. The
# default for GPUs without a table: the median of the five. Since 2026-12-03 each expert format
# with a held-out table has its own curve (MoeCurve: its kernel's rows, fitted on half the model
# shapes by benchmarks/fidelity_aisim.py, uncapped), kept where the held-out error fell against
# these factors (docs/fidelity.md); B200 bf16 and GB200 NVFP4 did not: their factors price them.
_Q = "fp8"  # FP8's tensor-core rate (per tensor and block-scaled)
# FP8 per tensor as --quantization fp8 makes it (a bf16 checkpoint quantized at load, dynamic
# per-tensor activation scales: vllm/model_executor/model_loader/weight_utils.py:351-358 and
# layers/quantization/online/fp8.py:517-523@v0.32.0) runs vLLM's Triton fused MoE on every GPU
# here: FlashInfer's CUTLASS and TRT-LLM FP8 kernels take static activation scales only
# (fused_moe/experts/flashinfer_cutlass_moe.py:146-181, trtllm_fp8_moe.py:379-388), DeepGEMM
# block scales only, so the oracle's first supported backend (oracle/fp8.py:86-102, 515-526) is
# Triton (triton_moe.py:126-179). Fitted to the tables' Triton fused_moe FP8 rows (vLLM 0.19):
# the H200's for Hopper, the B200's for Blackwell (GB200 and B300 have no such rows).
_TRITON_FP8_HOPPER = MoeCurve(0.619, 0.82, 2.5, 256, 28.4e-6, 1.78e-12, _Q)
_TRITON_FP8_BLACKWELL = MoeCurve(0.354, 0.664, 2.5, 128, 28.4e-6, 2.20e-12, _Q)
# FP8 per tensor with the checkpoint's static activation scales (fp8_static: ModelOpt FP8, keyed
# kFp8StaticTensorSym x kFp8StaticTensorSym, quantization/modelopt.py:495-501@v0.32.0) runs the
# first backend in the order that takes static scales: FlashInfer's CUTLASS kernel on Hopper
# (experts/flashinfer_cutlass_moe.py:146-175; FLASHINFER_TRTLLM is sm100 only), FlashInfer's
# TRT-LLM monolithic kernel on Blackwell (experts/trtllm_fp8_moe.py:165-172, 379-388; routing
# Renormalize, DeepSeekV3, Llama4, ...: 399-432), with TP and EP alike (oracle/fp8.py:86-130
# reorders only block FP8). Fitted by benchmarks/fidelity_aisim.py on each GPU's rows of that
# kernel (all ModelOpt layers), half the model shapes held out; under expert parallelism
# (ep_format_curves) on its rows at EP 2-64, each rank its E / EP experts. Hopper's CUTLASS
# kernel takes ~2-4x Triton's time at decode sizes (docs/fidelity.md).
MOE_H100 = MoeKernel(
    0.71, 1.0, 33.3e-6, f"{_AISIM}: fused MoE, H100", row_element=2.01e-12,
    format_curves=(
        ("bf16", MoeCurve(0.588, 0.872, 4.0, 64, 33.3e-6, 2.01e-12, "bf16")),  # Triton
        # FP8 per tensor (--quantization fp8: dynamic activation scales): Triton, the H200's curve
        # (the tables time no Triton FP8 per-tensor rows on the H100; the two GPUs' bf16 and block
        # FP8 Triton curves agree within 0.09 of compute efficiency)
        ("fp8", _TRITON_FP8_HOPPER),
        ("fp8_block", MoeCurve(0.348, 0.829, 2.5, 256, 29.2e-6, 1.98e-12, _Q)),  # Triton (TP)
        ("mxfp4", MoeCurve(0.588, 0.698, 4.0, 64, 35.3e-6, 1.84e-12, "bf16")),  # OAI Triton W4A16
        ("fp8_static", MoeCurve(0.157, 0.191, 3.0, 256, 66.7e-6, 0.48e-12, _Q)),  # FlashInfer CUTLASS
    ),
    # block FP8 with expert parallelism: FlashInfer's CUTLASS kernel (its rows at EP 2-64)
    ep_format_curves=(
        ("fp8_block", MoeCurve(0.582, 0.829, 2.5, 256, 26.7e-6, 13.67e-12, _Q)),
        ("fp8_static", MoeCurve(0.182, 0.191, 3.0, 256, 24.9e-6, 0.0, _Q)),
    ),
)  # fmt: skip
MOE_H200 = MoeKernel(
    0.82, 1.0, 34.2e-6, f"{_AISIM}: fused MoE, H200", row_element=2.19e-12,
    format_curves=(
        ("bf16", MoeCurve(0.673, 0.903, 6.0, 64, 34.2e-6, 2.19e-12, "bf16")),
        ("fp8", _TRITON_FP8_HOPPER),
        ("fp8_block", MoeCurve(0.353, 0.82, 2.5, 256, 27.3e-6, 2.07e-12, _Q)),
        ("int4", MoeCurve(0.123, 0.142, 6.0, 64, 30.8e-6, 2.03e-12, "bf16")),  # Marlin
        ("mxfp4", MoeCurve(0.581, 0.579, 6.0, 64, 36.4e-6, 1.84e-12, "bf16")),
        ("fp8_static", MoeCurve(0.214, 0.135, 2.5, 256, 65.5e-6, 0.0, _Q)),  # FlashInfer CUTLASS
    ),
    ep_format_curves=(
        ("fp8_block", MoeCurve(0.712, 0.761, 2.5, 256, 26.3e-6, 12.89e-12, _Q)),
        ("fp8_static", MoeCurve(0.255, 0.134, 2.5, 256, 23.1e-6, 0.0, _Q)),
    ),
)  # fmt: skip
MOE_B200 = MoeKernel(
    0.51, 0.92, 31.0e-6, f"{_AISIM}: fused MoE, B200", row_element=2.22e-12,
    format_curves=(
        ("fp8", _TRITON_FP8_BLACKWELL),
        # FlashInfer's TRT-LLM kernel, first in vLLM 0.32's order on Blackwell (was Triton's curve)
        ("fp8_block", MoeCurve(0.213, 0.743, math.inf, 256, 25.2e-6, 1.00e-12, _Q)),
        ("int4", MoeCurve(0.073, 0.105, 2.5, 64, 40.1e-6, 0.04e-12, "bf16")),  # Marlin
        ("nvfp4", MoeCurve(0.735, 0.926, 1.0, 64, 18.5e-6, 0.62e-12, "fp4")),  # TRT-LLM
        ("mxfp4", MoeCurve(0.286, 0.477, 2.5, 64, 21.8e-6, 2.91e-12, "bf16")),  # TRT-LLM MXFP4 x bf16
        ("fp8_static", MoeCurve(0.494, 0.83, 2.5, 128, 17.6e-6, 0.59e-12, _Q)),  # FlashInfer TRT-LLM
    ),
    ep_format_curves=(("fp8_static", MoeCurve(0.476, 0.892, 2.5, 128, 18.1e-6, 1.25e-12, _Q)),),
)  # fmt: skip
MOE_GB200 = MoeKernel(
    0.63, 1.0, 17.2e-6, f"{_AISIM}: fused MoE, GB200", row_element=0.39e-12,
    format_curves=(
        ("bf16", MoeCurve(0.469, 0.894, 2.5, 64, 17.2e-6, 0.39e-12, "bf16")),  # TRT-LLM
        ("fp8", _TRITON_FP8_BLACKWELL),  # the B200's: no Triton FP8 per-tensor rows here
        ("fp8_block", MoeCurve(0.203, 0.797, 3.0, 128, 25.5e-6, 0.79e-12, _Q)),
        ("mxfp4", MoeCurve(0.279, 0.476, 2.5, 64, 22.0e-6, 2.58e-12, "bf16")),
        ("fp8_static", MoeCurve(0.552, 0.86, 1.5, 64, 18.3e-6, 0.51e-12, _Q)),  # FlashInfer TRT-LLM
    ),
    ep_format_curves=(("fp8_static", MoeCurve(0.46, 0.924, 1.5, 64, 18.9e-6, 0.84e-12, _Q)),),
)  # fmt: skip
MOE_B300 = MoeKernel(
    0.61, 1.0, 16.0e-6, f"{_AISIM}: fused MoE, B300", row_element=0.44e-12,
    format_curves=(
        ("bf16", MoeCurve(0.495, 0.871, 3.0, 64, 16.0e-6, 0.44e-12, "bf16")),  # TRT-LLM
        ("fp8", _TRITON_FP8_BLACKWELL),  # the B200's: no Triton FP8 per-tensor rows here
        ("fp8_block", MoeCurve(0.206, 0.809, 2.5, 64, 24.6e-6, 0.77e-12, _Q)),
        ("nvfp4", MoeCurve(0.487, 0.898, 1.0, 64, 17.7e-6, 0.56e-12, "fp4")),
        ("mxfp4", MoeCurve(0.295, 0.449, 3.0, 64, 20.4e-6, 2.80e-12, "bf16")),
        ("fp8_static", MoeCurve(0.595, 0.84, 1.5, 64, 16.9e-6, 0.50e-12, _Q)),  # FlashInfer TRT-LLM
    ),
    ep_format_curves=(("fp8_static", MoeCurve(0.496, 0.903, 1.5, 64, 17.2e-6, 0.91e-12, _Q)),),
)  # fmt: skip
# vLLM's custom all-reduce under CUDA graphs (its decode path), fitted per GPU by
# benchmarks/fidelity_aisim.py: one latency per TP degree, one link efficiency per GPU.
B200_ALLREDUCE = ((2, 7.23e-6), (4, 7.44e-6), (8, 8.43e-6))
GB200_ALLREDUCE = ((2, 3.74e-6), (4, 4.08e-6))
B300_ALLREDUCE = ((2, 4.16e-6), (4, 3.95e-6), (8, 4.46e-6))
# The same all-reduce, one line per kernel vLLM picks for the message (allreduce_regimes.py: the
# band edges are vLLM's regime boundaries at the tables' version, not fitted; the last band of a
# TP, up to 2**40 bytes, prices everything above), fitted on the same even-indexed sizes by
# benchmarks/fidelity_aisim.py (--parts allreduce). B200 (vLLM 0.24.0): custom one stage, custom
# two stages (TP 4, 8), symmetric memory (two-shot at TP 2, 4, multimem at 8), NCCL.
B200_ALLREDUCE_REGIMES = (
    AllReduceBand(2, 2097136, 6.75e-06, 0.196), AllReduceBand(2, 8388608, 2.43e-05, 0.500),
    AllReduceBand(2, 2**40, 2.49e-05, 0.572),
    AllReduceBand(4, 524272, 7.03e-06, 0.273), AllReduceBand(4, 2097136, 1.49e-05, 0.500),
    AllReduceBand(4, 33554432, 1.73e-05, 0.551), AllReduceBand(4, 2**40, 0.0, 0.597),
    AllReduceBand(8, 262128, 7.78e-06, 0.144), AllReduceBand(8, 1048560, 2.48e-05, 0.500),
    AllReduceBand(8, 134217728, 1.38e-05, 0.641), AllReduceBand(8, 2**40, 1.38e-05, 0.641),
)  # fmt: skip
# GB200 (vLLM 0.31.0): FlashInfer one shot, two shots, NCCL
GB200_ALLREDUCE_REGIMES = (
    AllReduceBand(2, 524288, 3.71e-06, 0.719), AllReduceBand(2, 67108864, 4.15e-06, 0.522),
    AllReduceBand(2, 2**40, 4.15e-06, 0.522),
    AllReduceBand(4, 262144, 4.07e-06, 0.456), AllReduceBand(4, 33554432, 4.72e-06, 0.680),
    AllReduceBand(4, 2**40, 0.0, 0.576),
)  # fmt: skip
# B300 (vLLM 0.31.0): FlashInfer one shot, two shots, multimem (TP 8), NCCL
B300_ALLREDUCE_REGIMES = (
    AllReduceBand(2, 524288, 4.01e-06, 0.395), AllReduceBand(2, 67108864, 4.33e-06, 0.520),
    AllReduceBand(2, 2**40, 4.33e-06, 0.520),
    AllReduceBand(4, 262144, 3.73e-06, 0.230), AllReduceBand(4, 67108864, 4.9e-06, 0.680),
    AllReduceBand(4, 2**40, 4.9e-06, 0.680),
    AllReduceBand(8, 131072, 4.19e-06, 0.153), AllReduceBand(8, 4194304, 5.88e-06, 0.851),
    AllReduceBand(8, 67108864, 5.96e-06, 0.742), AllReduceBand(8, 2**40, 5.96e-06, 0.742),
)  # fmt: skip
MOE_GENERIC = MoeKernel(
    0.63, 1.0, 31.0e-6, "median of the AISimulate fits (no table for this GPU)", row_element=2.01e-12
)
# vLLM's MLA block per GPU (DeepSeek-V3 shapes, 1-128 heads, bf16 KV; bf16 and block-scaled FP8
# projections) and the MoE token exchanges under data-parallel attention (DeepEP under vLLM,
# NCCL all-gather / reduce-scatter), fitted by benchmarks/fidelity_aisim.py on half the head
# counts / model shapes / message sizes (docs/fidelity.md has the held-out errors). The H20
# borrows the H100's (same kernels, same NVLink 4 link). Block-scaled FP8 has two sets of terms:
# on the layer join's path (the factors) and, where the GPU has a block-FP8 GEMM curve (all but
# the B200), on that curve's path (MlaCurveTerms), which the catalog's MLA models take.
MLA_H100 = MlaKernel(
    (("bf16", 0.82), ("fp8_block", 0.60)), 1.00, 1.00, 3.91e-6, 0.50e-6,
    f"{_AISIM}: MLA module, H100", decode_request=44.0e-9, decode_head=1.821e-9, decode_context=362e-12,
    decode_request_by_format=(("fp8_block", 4.8e-9),), latency_by_format=(("fp8_block", 5.49e-6),),
    prefill_request=0.0e-9, prefill_head=2.09e-9, decode_knee=512, decode_beyond=0.00,
    curve_terms=(("fp8_block", MlaCurveTerms(0.63, 36.06e-6, 4.6e-9, 12.6e-9)),),
)  # fmt: skip
MLA_H200 = MlaKernel(
    (("bf16", 0.82), ("fp8_block", 0.60)), 1.00, 1.00, 3.23e-6, 0.97e-6,
    f"{_AISIM}: MLA module, H200", decode_request=42.2e-9, decode_head=1.459e-9, decode_context=409e-12,
    decode_request_by_format=(("fp8_block", 9.6e-9),), latency_by_format=(("fp8_block", 6.46e-6),),
    prefill_request=0.0e-9, prefill_head=1.48e-9, decode_knee=512, decode_beyond=0.00,
    curve_terms=(("fp8_block", MlaCurveTerms(0.60, 36.31e-6, 10.6e-9, 6.0e-9)),),
)  # fmt: skip
MLA_B200 = MlaKernel(
    (("bf16", 1.00), ("fp8_block", 0.60)), 1.00, 0.88, 18.78e-6, 16.71e-6,
    f"{_AISIM}: MLA module, B200", decode_request=63.9e-9, decode_head=5.758e-9, decode_context=273e-12,
    decode_request_by_format=(("fp8_block", 0.0e-9),), latency_by_format=(("fp8_block", 9.22e-6),),
    prefill_request=0.0e-9, prefill_head=47.87e-9, decode_knee=128, decode_beyond=0.50,
)  # fmt: skip
MLA_GB200 = MlaKernel(
    (("bf16", 0.90), ("fp8_block", 0.79)), 1.00, 0.88, 18.61e-6, 17.15e-6,
    f"{_AISIM}: MLA module, GB200", decode_request=55.6e-9, decode_head=5.059e-9, decode_context=249e-12,
    decode_request_by_format=(("fp8_block", 0.0e-9),), latency_by_format=(("fp8_block", 12.49e-6),),
    prefill_request=0.0e-9, prefill_head=39.61e-9, decode_knee=128, decode_beyond=0.50,
    curve_terms=(("fp8_block", MlaCurveTerms(0.79, 26.04e-6, 0.0, 4.7e-9)),),
)  # fmt: skip
MLA_B300 = MlaKernel(
    (("bf16", 0.90), ("fp8_block", 0.70)), 1.00, 0.88, 16.66e-6, 14.33e-6,
    f"{_AISIM}: MLA module, B300", decode_request=64.6e-9, decode_head=5.458e-9, decode_context=278e-12,
    decode_request_by_format=(("fp8_block", 0.0e-9),), latency_by_format=(("fp8_block", 11.51e-6),),
    prefill_request=0.0e-9, prefill_head=43.51e-9, decode_knee=128, decode_beyond=0.50,
    curve_terms=(("fp8_block", MlaCurveTerms(0.70, 26.31e-6, 0.0, 5.0e-9)),),
)  # fmt: skip
EXCHANGE_H100 = MoeExchange(
    LinkFit(150.2e-6, 0.825, 83e-9, 257.1e-6), LinkFit(79.0e-6, 0.613, 96e-9, 0.0e-6),
    LinkFit(51.4e-6, 0.517, 267e-9, 66.2e-6), LinkFit(35.8e-6, 0.776, 185e-9, 47.9e-6),
    (
        (2, LinkFit(5.9e-6, 0.220)),
        (2, LinkFit(19.7e-6, 0.544)),
        (4, LinkFit(8.1e-6, 0.320)),
        (4, LinkFit(25.5e-6, 0.688)),
        (8, LinkFit(12.3e-6, 0.503)),
        (8, LinkFit(40.3e-6, 0.759)),
    ),
    (
        (2, LinkFit(5.9e-6, 0.243)),
        (2, LinkFit(14.6e-6, 0.503)),
        (4, LinkFit(7.6e-6, 0.353)),
        (4, LinkFit(17.8e-6, 0.662)),
        (8, LinkFit(10.8e-6, 0.493)),
        (8, LinkFit(26.4e-6, 0.759)),
    ),
    f"{_AISIM}: DeepEP (vLLM 0.24.0), NCCL 2.29.2, H100",
)  # fmt: skip
EXCHANGE_H200 = MoeExchange(
    LinkFit(133.7e-6, 1.000, 96e-9, 258.5e-6), LinkFit(77.9e-6, 0.690, 101e-9, 82.3e-6),
    LinkFit(46.8e-6, 0.266, 48e-9, 0.0e-6), LinkFit(30.9e-6, 0.410, 0e-9, 53.4e-6),
    (
        (2, LinkFit(5.8e-6, 0.224)),
        (2, LinkFit(19.3e-6, 0.554)),
        (4, LinkFit(8.0e-6, 0.326)),
        (4, LinkFit(24.0e-6, 0.702)),
        (8, LinkFit(13.5e-6, 0.544)),
        (8, LinkFit(37.2e-6, 0.759)),
    ),
    (
        (2, LinkFit(5.7e-6, 0.248)),
        (2, LinkFit(14.0e-6, 0.513)),
        (4, LinkFit(7.5e-6, 0.339)),
        (4, LinkFit(18.2e-6, 0.675)),
        (8, LinkFit(11.7e-6, 0.493)),
        (8, LinkFit(26.2e-6, 0.759)),
    ),
    f"{_AISIM}: DeepEP (vLLM 0.24.0), NCCL 2.29.2, H200",
)  # fmt: skip
EXCHANGE_B200 = MoeExchange(
    LinkFit(170.2e-6, 0.402, 158e-9, 288.4e-6), LinkFit(86.5e-6, 0.244, 200e-9, 110.9e-6),
    LinkFit(45.0e-6, 0.162, 53e-9, 55.0e-6), LinkFit(39.3e-6, 0.393, 0e-9, 61.4e-6),
    (
        (2, LinkFit(9.6e-6, 0.188)),
        (2, LinkFit(20.2e-6, 0.503)),
        (4, LinkFit(11.9e-6, 0.181)),
        (4, LinkFit(28.6e-6, 0.662)),
        (8, LinkFit(17.9e-6, 0.314)),
        (8, LinkFit(62.7e-6, 0.759)),
    ),
    (
        (2, LinkFit(9.5e-6, 0.220)),
        (2, LinkFit(17.8e-6, 0.474)),
        (4, LinkFit(11.8e-6, 0.238)),
        (4, LinkFit(34.8e-6, 0.675)),
        (8, LinkFit(16.9e-6, 0.307)),
        (8, LinkFit(57.1e-6, 0.745)),
    ),
    f"{_AISIM}: DeepEP (vLLM 0.24.0), NCCL 2.29.2, B200",
)  # fmt: skip
EXCHANGE_GB200 = MoeExchange(
    LinkFit(307.2e-6, 1.000, 212e-9, 424.3e-6), LinkFit(96.6e-6, 0.304, 92e-9, 0.0e-6),
    LinkFit(62.8e-6, 0.138, 6e-9, 68.9e-6), LinkFit(34.5e-6, 0.277, 0e-9, 74.7e-6),
    (
        (2, LinkFit(10.1e-6, 0.196)),
        (2, LinkFit(20.3e-6, 0.503)),
        (4, LinkFit(12.1e-6, 0.199)),
        (4, LinkFit(29.3e-6, 0.662)),
    ),
    (
        (2, LinkFit(9.9e-6, 0.216)),
        (2, LinkFit(17.6e-6, 0.465)),
        (4, LinkFit(12.0e-6, 0.229)),
        (4, LinkFit(27.2e-6, 0.636)),
    ),
    f"{_AISIM}: DeepEP (vLLM 0.24.0), NCCL 2.29.2, GB200",
)  # fmt: skip
EXCHANGE_B300 = MoeExchange(
    LinkFit(146.2e-6, 0.422, 160e-9, 262.8e-6), LinkFit(88.1e-6, 0.254, 207e-9, 110.7e-6),
    LinkFit(43.0e-6, 0.166, 46e-9, 51.5e-6), LinkFit(32.0e-6, 0.354, 0e-9, 48.5e-6),
    (
        (2, LinkFit(8.9e-6, 0.188)),
        (2, LinkFit(19.6e-6, 0.513)),
        (4, LinkFit(11.7e-6, 0.263)),
        (4, LinkFit(37.2e-6, 0.716)),
        (8, LinkFit(17.1e-6, 0.314)),
        (8, LinkFit(60.7e-6, 0.759)),
    ),
    (
        (2, LinkFit(8.9e-6, 0.192)),
        (2, LinkFit(17.2e-6, 0.474)),
        (4, LinkFit(11.6e-6, 0.314)),
        (4, LinkFit(33.9e-6, 0.675)),
        (8, LinkFit(16.5e-6, 0.314)),
        (8, LinkFit(69.8e-6, 0.906)),
    ),
    f"{_AISIM}: DeepEP (vLLM 0.24.0), NCCL 2.29.2, B300",
)  # fmt: skip

# TensorRT-LLM's and SGLang's own kernels (hardware.EngineKernels; --kernels), fitted by
# benchmarks/fidelity_aisim.py --framework trtllm,sglang exactly as vLLM's above (one-join form,
# half the shapes held out; docs/fidelity.md): TensorRT-LLM 1.3.0rc20's GEMMs and 1.3.0rc10-rc23's
# fused MoE (CUTLASS), SGLang 0.5.14-0.5.20's (torch linear, sgl-kernel FP8, DeepGEMM, CuTe DSL NVFP4;
# Triton fused MoE on Hopper, FlashInfer's TRT-LLM MoE on Blackwell). On Hopper the set keeps the
# catalog's bf16 curve (Vidur's) and holds the engine's format factors against its own bf16 fit;
# on Blackwell the bf16 curve is the engine's own. MoE: the engine's bf16 fused-MoE kernel, its
# factors capped at 1 as the catalog's (TensorRT-LLM's compute fitted 1.06-1.50: at 1.50 the
# B200's experts would run above the dense peak).
_TRT = "AISimulate silicon tables (TensorRT-LLM 1.3.0rc10-rc23 kernels)"
_SGL = "AISimulate silicon tables (SGLang 0.5.14-0.5.20 kernels)"


def _hopper_set(engine: str, source: str, gpu: str, factors: tuple, moe: MoeKernel) -> EngineKernels:
    """A Hopper set: the catalog's bf16 curve with the engine's own format factors and MoE."""
    gemm = replace(
        H100_GEMM, format_factors=factors, source=f"{_VIDUR}, H100: Llama-2-70B; formats: {source}, {gpu}"
    )
    return EngineKernels(engine, gemm, moe, f"{source}, {gpu}")


TRTLLM_H100 = _hopper_set(
    "trtllm", _TRT, "H100", (("fp8", 0.81, 0.99), ("fp8_block", 0.75, 1.0)),
    MoeKernel(1.0, 1.0, 36.0e-6, f"{_TRT}: fused MoE, H100", row_element=3.51e-12),
)  # fmt: skip
TRTLLM_H200 = _hopper_set(
    "trtllm", _TRT, "H200", (("fp8", 0.80, 0.99), ("fp8_block", 0.74, 1.0)),
    MoeKernel(1.0, 1.0, 38.2e-6, f"{_TRT}: fused MoE, H200", row_element=3.21e-12),
)  # fmt: skip
TRTLLM_B200 = EngineKernels(
    "trtllm", GemmCurve(0.69, 0.80, 2.5, 64, 3.79e-6, f"{_TRT}, B200",
                        format_factors=(("fp8", 0.84, 1.0), ("fp8_block", 0.90, 1.0), ("nvfp4", 0.64, 0.82))),
    MoeKernel(1.0, 1.0, 40.2e-6, f"{_TRT}: fused MoE, B200", row_element=2.48e-12), f"{_TRT}, B200",
)  # fmt: skip
TRTLLM_GB200 = EngineKernels(
    "trtllm", GemmCurve(0.65, 0.77, 3.0, 64, 3.44e-6, f"{_TRT}, GB200",
                        format_factors=(("fp8", 0.85, 1.0), ("fp8_block", 0.92, 1.0), ("nvfp4", 0.63, 0.83))),
    MoeKernel(1.0, 1.0, 39.8e-6, f"{_TRT}: fused MoE, GB200", row_element=2.30e-12), f"{_TRT}, GB200",
)  # fmt: skip
TRTLLM_B300 = EngineKernels(
    "trtllm", GemmCurve(0.71, 0.79, 3.0, 64, 3.82e-6, f"{_TRT}, B300",
                        format_factors=(("fp8", 0.86, 1.0), ("fp8_block", 0.97, 1.0), ("nvfp4", 0.62, 0.81))),
    MoeKernel(1.0, 1.0, 36.6e-6, f"{_TRT}: fused MoE, B300", row_element=2.23e-12), f"{_TRT}, B300",
)  # fmt: skip
SGLANG_H100 = _hopper_set(
    "sglang", _SGL, "H100", (("fp8", 0.73, 1.0), ("fp8_block", 0.85, 1.0)),
    MoeKernel(0.59, 0.99, 27.3e-6, f"{_SGL}: fused MoE, H100", row_element=2.08e-12),
)  # fmt: skip
SGLANG_H200 = _hopper_set(
    "sglang", _SGL, "H200", (("fp8", 0.78, 0.99), ("fp8_block", 0.84, 1.0)),
    MoeKernel(0.38, 0.95, 29.8e-6, f"{_SGL}: fused MoE, H200", row_element=1.15e-12),
)  # fmt: skip
SGLANG_B200 = EngineKernels(
    "sglang", GemmCurve(0.66, 0.84, 3.0, 64, 4.19e-6, f"{_SGL}, B200",
                        format_factors=(("fp8", 0.76, 0.95), ("fp8_block", 0.92, 1.0), ("nvfp4", 0.85, 1.0))),
    MoeKernel(1.0, 1.0, 19.1e-6, f"{_SGL}: fused MoE, B200", row_element=1.03e-12), f"{_SGL}, B200",
)  # fmt: skip
SGLANG_GB200 = EngineKernels(
    "sglang", GemmCurve(0.69, 0.81, 2.5, 64, 3.63e-6, f"{_SGL}, GB200",
                        format_factors=(("fp8", 0.78, 1.0), ("fp8_block", 0.88, 1.0), ("nvfp4", 0.94, 1.0))),
    MoeKernel(0.95, 1.0, 19.2e-6, f"{_SGL}: fused MoE, GB200", row_element=0.98e-12), f"{_SGL}, GB200",
)  # fmt: skip
SGLANG_B300 = EngineKernels(
    "sglang", GemmCurve(0.75, 0.82, 3.0, 64, 4.10e-6, f"{_SGL}, B300",
                        format_factors=(("fp8", 0.75, 0.96), ("fp8_block", 0.93, 1.0), ("nvfp4", 0.61, 1.0))),
    MoeKernel(0.96, 1.0, 17.9e-6, f"{_SGL}: fused MoE, B300", row_element=0.99e-12), f"{_SGL}, B300",
)  # fmt: skip

# Hopper's dense FP8 and INT8 tensor-core rates (H100/H200 SXM data sheets, no sparsity).
HOPPER_FORMATS = (("fp8", 1979e12), ("int8", 1979e12))
# All-reduce latency per TP degree and link efficiency fitted to Vidur's NCCL profiles
# (a100_dgx, h100_dgx; messages 8 KB - 128 MB, one node).
A100_ALLREDUCE = ((2, 37.0e-6), (4, 28.9e-6), (8, 39.6e-6))
H100_ALLREDUCE = ((2, 19.2e-6), (4, 27.5e-6), (8, 28.2e-6))

HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        # A100 SXM: 312 TFLOP/s bf16, NVLink 3 600 GB/s total (300 per direction), PCIe 4 x16.
        *(
            Hardware(
                name,
                312e12,
                bw * GB,
                gib,
                300 * GB,
                32 * GB,
                gemm=A100_GEMM,
                allreduce_latency_by_tp=A100_ALLREDUCE,
                comm_efficiency=0.518,
                sms=108,
                peak_flops_by_dtype=(("int8", 624e12),),
            )
            for name, bw, gib in (("A100-40GB", 1555, 40.0), ("A100-80GB", 2039, 80.0))
        ),
        # H100 SXM: 989 TFLOP/s bf16 dense, HBM3 3.35 TB/s, NVLink 4 900 GB/s, PCIe 5 x16.
        Hardware(
            "H100-SXM",
            989e12,
            3350 * GB,
            79.6,
            450 * GB,
            64 * GB,
            gemm=H100_GEMM_FORMATS,
            allreduce_latency_by_tp=H100_ALLREDUCE,
            comm_efficiency=0.740,
            sms=132,
            moe=MOE_H100,
            mla=MLA_H100,
            moe_exchange=EXCHANGE_H100,
            peak_flops_by_dtype=HOPPER_FORMATS,
            engine_kernels=(TRTLLM_H100, SGLANG_H100),
        ),
        # H200 SXM: same compute as H100, HBM3e 4.8 TB/s, 141 GB; the H100's bf16 curve (same die),
        # its own format curves.
        Hardware(
            "H200",
            989e12,
            4800 * GB,
            140.4,
            450 * GB,
            64 * GB,
            gemm=H200_GEMM_FORMATS,
            allreduce_latency_by_tp=H100_ALLREDUCE,
            comm_efficiency=0.740,
            sms=132,
            moe=MOE_H200,
            mla=MLA_H200,
            moe_exchange=EXCHANGE_H200,
            peak_flops_by_dtype=HOPPER_FORMATS,
            engine_kernels=(TRTLLM_H200, SGLANG_H200),
        ),
        # A40: 149.7 TFLOP/s bf16 dense, 696 GB/s GDDR6, 48 GB; PCIe 4 between cards (the
        # NVLink bridge joins pairs only). In the catalog because Vidur profiled it.
        Hardware(
            "A40", 149.7e12, 696 * GB, 45.0, 32 * GB, 32 * GB, allreduce_latency=20e-6, gemm=A40_GEMM, sms=84
        ),
        # L4: 121 TFLOP/s bf16 dense, 300 GB/s GDDR6, no NVLink (PCIe 4 x16 between cards).
        # L4 and L40S borrow the A40's curve (the profiled PCIe card with GDDR memory).
        Hardware(
            "L4",
            121e12,
            300 * GB,
            22.5,
            32 * GB,
            32 * GB,
            allreduce_latency=20e-6,
            gemm=A40_GEMM,
            sms=58,
            peak_flops_by_dtype=(("fp8", 242e12), ("int8", 242e12)),  # Ada: FP8 tensor cores
        ),
        # L40S: 362 TFLOP/s bf16 dense, 864 GB/s GDDR6, no NVLink.
        Hardware(
            "L40S",
            362e12,
            864 * GB,
            45.0,
            32 * GB,
            32 * GB,
            allreduce_latency=20e-6,
            gemm=A40_GEMM,
            sms=142,
            peak_flops_by_dtype=(("fp8", 733e12), ("int8", 733e12)),
        ),
        # MI300X: 1307 TFLOP/s bf16 dense, 5.3 TB/s HBM3, 192 GB, Infinity Fabric 7 x 64 GB/s.
        # No AMD profile is at hand: MI300X keeps the generic efficiencies.
        Hardware(
            "MI300X",
            1307e12,
            5300 * GB,
            192.0,
            448 * GB,
            64 * GB,
            vendor="amd",
            sms=304,
            peak_flops_by_dtype=(("fp8", 2615e12), ("int8", 2615e12)),
        ),
        # H20 (China export part, Hopper): 148 TFLOP/s bf16 dense, 296 FP8, 96 GB HBM3 at
        # 4.0 TB/s, NVLink 4 (900 GB/s total); the H100's GEMM curve (same die family).
        Hardware(
            "H20",
            148e12,
            4000 * GB,
            95.0,
            450 * GB,
            64 * GB,
            gemm=H100_GEMM_FORMATS,
            sms=78,
            allreduce_latency_by_tp=H100_ALLREDUCE,
            comm_efficiency=0.740,
            mla=MLA_H100,
            moe_exchange=EXCHANGE_H100,
            peak_flops_by_dtype=(("fp8", 296e12), ("int8", 296e12)),
        ),
        # Blackwell (HGX B200, B300 and GB200 NVL72 data sheets, dense, per GPU): NVLink 5 at
        # 1.8 TB/s total (900 GB/s per direction), PCIe 6 on HGX boards (5 on GB200's Grace
        # link side, NVLink-C2C to the CPU is not modelled). GEMM curves and fused-MoE figures
        # fitted to AISimulate's tables of these GPUs (above; docs/fidelity.md).
        Hardware(
            "B200",
            2250e12,
            7700 * GB,
            179.1,
            900 * GB,
            128 * GB,
            sms=148,
            gemm=B200_GEMM,
            allreduce_latency_by_tp=B200_ALLREDUCE,
            allreduce_bands=B200_ALLREDUCE_REGIMES,
            comm_efficiency=0.50,
            moe=MOE_B200,
            mla=MLA_B200,
            moe_exchange=EXCHANGE_B200,
            peak_flops_by_dtype=(("fp8", 4500e12), ("int8", 4500e12), ("fp4", 9000e12)),
            engine_kernels=(TRTLLM_B200, SGLANG_B200),
        ),
        Hardware(
            "B300",
            2250e12,
            7750 * GB,
            268.6,
            900 * GB,
            128 * GB,
            sms=148,
            gemm=B300_GEMM,
            allreduce_latency_by_tp=B300_ALLREDUCE,
            allreduce_bands=B300_ALLREDUCE_REGIMES,
            comm_efficiency=0.66,
            moe=MOE_B300,
            # Blackwell Ultra trades INT8 for FP4: 14 PFLOP/s dense FP4, INT8 cut to 153 TOPS
            mla=MLA_B300,
            moe_exchange=EXCHANGE_B300,
            peak_flops_by_dtype=(("fp8", 4500e12), ("int8", 153.5e12), ("fp4", 14000e12)),
            engine_kernels=(TRTLLM_B300, SGLANG_B300),
        ),
        Hardware(
            "GB200",
            2500e12,
            8000 * GB,
            185.0,
            900 * GB,
            64 * GB,
            sms=148,
            nvlink_domain=72,
            gemm=GB200_GEMM,
            allreduce_latency_by_tp=GB200_ALLREDUCE,
            allreduce_bands=GB200_ALLREDUCE_REGIMES,
            comm_efficiency=0.56,
            moe=MOE_GB200,
            mla=MLA_GB200,
            moe_exchange=EXCHANGE_GB200,
            peak_flops_by_dtype=(("fp8", 5000e12), ("int8", 5000e12), ("fp4", 10000e12)),
            engine_kernels=(TRTLLM_GB200, SGLANG_GB200),
        ),
        # GB300 NVL72: B300 (Blackwell Ultra) silicon at the rack's higher power, per GPU and dense
        # (NVIDIA's GB300 NVL72 data sheet, rack figures / 72: FP4 1,080 PFLOP/s, FP8 360, BF16
        # 180, INT8 ~12 POPS; HBM3e 576 TB/s, NVLink 5 130 TB/s): 2.5 PFLOP/s bf16, 5 FP8, 15
        # FP4, 0.165 POPS INT8 (Blackwell Ultra's cut), 8 TB/s, 288 GB HBM3e (the B300's stacks:
        # its 268.6 GiB as the driver reports them), NVLink 5 at 900 GB/s per direction in a
        # 72-GPU domain. No AISimulate table of its own: the B300's kernel fits (same SMs and
        # kernels, efficiencies of this entry's peaks, as GB200 to B200) and the GB200's NVL72
        # fabric fits (all-reduce, link efficiency, the MoE token exchange).
        Hardware(
            "GB300",
            2500e12,
            8000 * GB,
            268.6,
            900 * GB,
            64 * GB,
            sms=148,
            nvlink_domain=72,
            gemm=B300_GEMM,
            allreduce_latency_by_tp=GB200_ALLREDUCE,
            comm_efficiency=0.56,
            moe=MOE_B300,
            mla=MLA_B300,
            moe_exchange=EXCHANGE_GB200,
            peak_flops_by_dtype=(("fp8", 5000e12), ("int8", 165e12), ("fp4", 15000e12)),
            engine_kernels=(TRTLLM_B300, SGLANG_B300),
        ),
        # AMD Instinct (CDNA 3 / 4 data sheets, dense): MI325X 256 GB HBM3E at 6 TB/s; MI355X
        # 288 GB at 8 TB/s with FP4/FP6; Infinity Fabric 7 links (448 / 537.6 GB/s per direction).
        Hardware(
            "MI325X",
            1307e12,
            6000 * GB,
            256.0,
            448 * GB,
            64 * GB,
            vendor="amd",
            sms=304,
            peak_flops_by_dtype=(("fp8", 2615e12), ("int8", 2615e12)),
        ),
        Hardware(
            "MI355X",
            2500e12,
            8000 * GB,
            288.0,
            537.6 * GB,
            64 * GB,
            vendor="amd",
            sms=256,
            peak_flops_by_dtype=(("fp8", 5000e12), ("int8", 5000e12), ("fp4", 10000e12)),
        ),
    )
}

_ALIASES = {
    "A100": "A100-80GB",
    "A100-80G": "A100-80GB",
    "A100-SXM": "A100-80GB",
    "A100-40G": "A100-40GB",
    "H100": "H100-SXM",
    "H100-80GB": "H100-SXM",
    "H100-SXM5": "H100-SXM",
    "H200-SXM": "H200",
    "L40S-48GB": "L40S",
    "B200-SXM": "B200",
    "HGX-B200": "B200",
    "B300-SXM": "B300",
    "GB200-NVL72": "GB200",
    "GB300-NVL72": "GB300",
    "MI325": "MI325X",
    "MI355": "MI355X",
}


def resolve_hardware_name(name: str) -> str:
    """The catalog name for any accepted spelling (any case, dashes or underscores, the aliases
    above, an ``NVIDIA``/``AMD`` prefix); ValueError naming the catalog otherwise."""
    key = name.strip().upper().replace("_", "-").replace(" ", "-")
    for prefix in ("NVIDIA-", "AMD-"):
        key = key.removeprefix(prefix)
    by_upper = {known.upper(): known for known in HARDWARE}
    found = by_upper.get(key) or _ALIASES.get(key)
    if found is None:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}")
    return found


def get_hardware(name: str) -> Hardware:
    return HARDWARE[resolve_hardware_name(name)]


# The engines whose kernels the catalog can price with: vLLM's are every entry's own fields.
KERNEL_ENGINES = ("vllm", "sglang", "trtllm")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}


def engine_hardware(hardware: Hardware, engine: str) -> tuple[Hardware, str]:
    """``hardware`` with ``engine``'s GEMM curve and fused-MoE kernel in place of its own (vLLM's),
    and a note ("" when none is due): an engine without a set on this GPU keeps vLLM's curves."""
    if engine not in KERNEL_ENGINES:
        raise ValueError(
            f"--kernels: unknown engine {engine!r}; choose from auto, {', '.join(KERNEL_ENGINES)}"
        )
    if engine == "vllm":
        return hardware, ""
    found = next((k for k in hardware.engine_kernels if k.engine == engine), None)
    if found is None:
        return hardware, (
            f"{hardware.name} has no {ENGINE_NAMES[engine]} kernel set in the catalog: its GEMMs and fused "
            "MoE are priced with the GPU's own curves (--kernels vllm)"
        )
    swapped = replace(hardware, gemm=found.gemm or hardware.gemm, moe=found.moe or hardware.moe)
    return swapped, ""


# ---- links between instances (disaggregated prefill/decode KV transfer) -------------------
@dataclass(frozen=True, slots=True)
class Link:
    """A per-GPU path for moving KV from a prefill instance to a decode instance: line rate per
    direction and one-way latency (the fabric's, not the transfer library's own overhead)."""

    name: str
    bandwidth: float  # bytes/s per GPU per direction; math.inf for an ideal link
    latency: float  # seconds per transfer
    note: str = ""


LINKS: dict[str, Link] = {
    link.name: link
    for link in (
        # One NIC per GPU, as on DGX H100 (8 x ConnectX-7) and DGX A100 (8 x ConnectX-6).
        Link("ib-ndr", 400e9 / 8, 2e-6, "InfiniBand NDR, 400 Gb/s per GPU"),
        Link("ib-hdr", 200e9 / 8, 2e-6, "InfiniBand HDR, 200 Gb/s per GPU"),
        Link("roce-400g", 400e9 / 8, 5e-6, "RoCE v2 over 400 GbE per GPU"),
        Link("roce-100g", 100e9 / 8, 5e-6, "RoCE v2 over 100 GbE per GPU"),
        # Same node: the GPU's own NVLink (interconnect_bandwidth of its catalog entry).
        Link("nvlink", float("nan"), 1e-6, "the prefill GPU's NVLink (same node)"),
        Link("inf", float("inf"), 0.0, "ideal: no transfer time (a TTFT-only split)"),
    )
}


def get_link(name: str, hardware: Hardware | None = None) -> Link:
    """A link by name; ``nvlink`` takes ``hardware``'s interconnect bandwidth."""
    key = name.strip().lower().replace("_", "-")
    link = LINKS.get(key)
    if link is None:
        raise ValueError(f"unknown KV link {name!r}; known: {', '.join(LINKS)}")
    if key == "nvlink":
        if hardware is None:
            raise ValueError("the nvlink KV link needs the prefill GPU")
        return Link(f"nvlink ({hardware.name})", hardware.interconnect_bandwidth, link.latency, link.note)
    return link
