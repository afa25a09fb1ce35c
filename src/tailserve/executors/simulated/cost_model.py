"""Iteration time from the batch shape, on the roofline of one tensor-parallel shard.

time = linear layers + prefill attention + decode attention + TP all-reduce + overhead

- linear layers (the GEMMs), two of them: the decoder's weight matrices over every new token
  and the LM head over the requests that sample this iteration. Each is
  ``join(C, M) + launches``: ``C = 2 * params * pad(tokens) / (peak * compute_eff)`` with the
  token count rounded up to the GEMM's row tile (a 129-token GEMM runs a second 128-row tile:
  the step real profiles show at tile boundaries), ``M = (weights + activations + KV writes) /
  (bandwidth * memory_eff)``, ``join`` the p-norm ``(C^p + M^p)^(1/p)`` (p = ``sharpness``;
  infinity is the plain ``max``: compute and memory overlap perfectly, which real GEMMs near
  the ridge point do not), and ``launches`` a fixed latency per GEMM (4 per layer, 1 LM head).
  The defaults per GPU (``hardware.GemmCurve``) are fitted to measured linear-layer profiles
  (``profiles.py``, docs/fidelity.md);
  the attention parts are ``max(FLOPs / (peak * compute_eff), bytes / (bandwidth * memory_eff))``
  from first principles (no measured attention profiles are at hand):
- prefill attention: causal query-key pairs of each chunk over its context; bytes = the KV read;
- decode attention: one query over each decode's KV; bytes = that KV (memory-bound in practice);
- TP all-reduce: two per layer of (tokens x hidden) activations, ring algorithm,
  ``2 (tp-1)/tp`` of the message over the interconnect, plus a per-collective latency.

Beyond that core (docs/cost_model.md): the routed experts of an MoE model (``moe.py``), MLA's
fitted attention block (``hardware.MlaKernel``), sliding-window layers' window-bounded attention
(``window.py``: ``iteration_time``'s ``window``), data-parallel attention (``dp`` > 1: the
experts over the dp x tp ranks with each MoE layer's token exchange, ``moe_comm.py``; a lockstep
group's step in ``group_time``), and a checkpoint's groups of linear layers kept in another format
(``ModelSpec.module_dtypes``: each at its own rate and bytes, ``group_terms.py``).

With efficiencies <= 1 and overhead >= 0 a prediction is never faster than the roofline limit
(FLOPs / peak, bytes / bandwidth). Calibration (``calibration.py``) fits the efficiencies and
overhead to measured points.

``_iteration_time`` is written once for Python numbers and numpy arrays alike, so the vectorised
decode-run path and the per-iteration path give the same floats bit for bit.

Past ~300 lines because the formula is one class whose pieces share the per-shard constants set
up in ``__init__``; one GEMM's wave arithmetic lives in ``gemm.py``, the fits in ``profile_fit.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tailserve.executors.simulated.aisim_mla_table import MlaTable
from tailserve.executors.simulated.aisim_moe_table import MoeTable
from tailserve.executors.simulated.aisim_table import GemmTimes, TableLayers
from tailserve.executors.simulated.expert_load import (
    ExpertLoad,
    busiest_rank_rows,
    layer_shares,
    steady_imbalance,
)
from tailserve.executors.simulated.gemm import (
    MIN_TILE,
    curve_gemm_time,
    gemm_shapes,
    join,
    padded_tokens,
    wave_flops,
)
from tailserve.executors.simulated.group_terms import GroupTerms
from tailserve.executors.simulated.hardware import MOE_GENERIC, GemmCurve, Hardware, LinkFit, get_hardware
from tailserve.executors.simulated.models import ModelSpec
from tailserve.executors.simulated.module_formats import group_dtype
from tailserve.executors.simulated.moe import grouped_gemm_parts, touched_experts
from tailserve.executors.simulated.moe_comm import AUTO, exchange_time, resolve_backend
from tailserve.executors.simulated.pipeline import Pipeline
from tailserve.executors.simulated.precision import get_precision
from tailserve.executors.simulated.window import WindowShape

__all__ = ["MIN_TILE", "BatchShape", "CostModel", "Efficiency", "Roofline", "join", "padded_tokens"]

DEFAULT_COMM = 0.8  # generic all-reduce link efficiency (GPUs without a fitted one)
GEMMS_PER_LAYER = 4  # QKV, attention output, gate+up, down
# How far one side of an attention's roofline must lead per token for ``decode_step_times`` to
# take it as the max without comparing (rounding moves each side by ~1e-16 of itself).
_CLEAR_LEAD = 1.0 + 1e-9


@dataclass(frozen=True, slots=True)
class Efficiency:
    compute: float = 0.6  # fraction of peak FLOP/s that matmuls and attention reach
    memory: float = 0.8  # fraction of peak HBM bandwidth
    comm: float = DEFAULT_COMM  # fraction of interconnect bandwidth an all-reduce reaches
    overhead: float = 0.002  # seconds per iteration: scheduling, launches, sampling
    # The shape of a GEMM's time between memory- and compute-bound (see the module docstring).
    sharpness: float = math.inf  # p of the p-norm joining compute and memory time; inf = max
    tile_m: int = 1  # GEMM row tile in tokens (1: no rounding)
    # Per-GEMM output tiles in waves over the SMs (gemm.py): the column tile; 0 prices the
    # layer's GEMMs in one join instead (no waves).
    tile_n: int = 0
    wave_alpha: float = 1.0  # fraction of a whole wave a partial last wave costs (with tile_n)
    gemm_latency: float = 0.0  # seconds per GEMM launch
    per_token: float = 0.0  # seconds per new token outside the GEMMs (host-side work, elementwise)
    prefill_attention: float = 1.0  # prefill attention's rates relative to compute / memory above
    decode_attention: float = 1.0  # decode attention's rates relative to compute / memory above
    # Seconds per sampled row (a request's token this step) outside the GEMMs: the host's work
    # per sequence (sampling, detokenizing, streaming the token), as seen from outside a server.
    per_logit: float = 0.0

    def __post_init__(self) -> None:
        for name in ("compute", "memory", "comm", "sharpness", "prefill_attention", "decode_attention"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} efficiency must be > 0, got {getattr(self, name)}")
        for name in ("overhead", "gemm_latency", "per_token", "per_logit"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")
        if self.tile_m < 1:
            raise ValueError(f"tile_m must be >= 1 token, got {self.tile_m}")
        if self.tile_n < 0:
            raise ValueError(f"tile_n must be >= 0, got {self.tile_n}")
        if not 0.0 <= self.wave_alpha <= 1.0:
            raise ValueError(f"wave_alpha must be in [0, 1], got {self.wave_alpha}")

    @staticmethod
    def for_hardware(hardware: Hardware) -> Efficiency:
        """The GPU's fitted GEMM curve (``Hardware.gemm``) or, without one, the generic default."""
        g = hardware.gemm
        comm = hardware.comm_efficiency or DEFAULT_COMM
        if g is None:
            return Efficiency(comm=comm)
        return Efficiency(
            comm=comm,
            compute=g.compute,
            memory=g.memory,
            sharpness=g.sharpness,
            tile_m=g.tile_m,
            tile_n=g.tile_n,
            wave_alpha=g.wave_alpha,
            gemm_latency=g.gemm_latency,
        )


@dataclass(frozen=True, slots=True)
class BatchShape:
    """The aggregates of one iteration that decide its time."""

    num_tokens: int = 0  # new tokens of all requests
    num_logits: int = 0  # requests that sample a token this iteration
    prefill_pairs: int = 0  # causal (query, key) pairs of prefill chunks
    prefill_kv_tokens: int = 0  # KV tokens prefill chunks read (context + chunk)
    decode_kv_tokens: int = 0  # KV tokens decodes read (context + 1 each)
    # Counts, after the aggregates so positional construction keeps working. A scheduled entry
    # of one new token is a decode (its KV in ``decode_kv_tokens``), any longer one a prefill
    # chunk, finishing or not; a speculative decode verifying 1 + s tokens is priced as a chunk
    # (its pairs and KV in the prefill aggregates) but counted as neither.
    num_prefills: int = 0
    num_decodes: int = 0

    @staticmethod
    def of(prefill: list[tuple[int, int]], decode_contexts: list[int]) -> BatchShape:
        """From (chunk tokens, context before it) per prefill and context per decode."""
        pairs = sum(q * c + q * (q + 1) // 2 for q, c in prefill)
        return BatchShape(
            num_tokens=sum(q for q, _ in prefill) + len(decode_contexts),
            num_logits=len(prefill) + len(decode_contexts),
            prefill_pairs=pairs,
            prefill_kv_tokens=sum(q + c for q, c in prefill),
            decode_kv_tokens=sum(c + 1 for c in decode_contexts),
            num_prefills=len(prefill),
            num_decodes=len(decode_contexts),
        )


@dataclass(frozen=True, slots=True)
class Roofline:
    """Per-part work of one iteration on one shard (before efficiencies)."""

    compute_s: tuple[float, float, float]  # linear, prefill attention, decode attention at peak
    memory_s: tuple[float, float, float]  # the same parts at full bandwidth
    comm_s: float  # all-reduce time (with its own efficiency), not fitted
    flops: float
    bytes: float

    @property
    def limit_s(self) -> float:
        """The fastest this iteration could possibly run: FLOPs / peak or bytes / bandwidth."""
        return max(sum(self.compute_s), sum(self.memory_s))


class CostModel:
    def __init__(
        self,
        model: ModelSpec,
        hardware: Hardware,
        tp: int = 1,
        efficiency: Efficiency | None = None,
        expert_parallel: bool = False,
        dp: int = 1,
        all2all: str = "allgather_reducescatter",
        expert_load: ExpertLoad | None = None,
        pipeline: Pipeline | None = None,
    ) -> None:
        model.check_tp(tp)
        if dp < 1:
            raise ValueError(f"--dp must be >= 1, got {dp}")
        if dp > 1 and not model.is_moe:
            # A dense model's DP ranks never wait for each other (vLLM runs them as separate
            # engines): price one rank, dp 1, and simulate the ranks as replicas.
            raise ValueError(f"{model.name} is dense: its data-parallel ranks are independent replicas")
        self.model = model
        # Pipeline stages (pipeline.py): the whole model's step is priced here on one TP shard;
        # the simulated executor splits it into stages. None: one stage.
        self.pipeline = pipeline
        # Data-parallel attention (dp > 1): this rank's attention and dense layers over its own
        # tokens at TP ``tp``; the routed experts over the dp x tp ranks, each MoE layer
        # exchanging the tokens (moe_comm.py, vLLM's --all2all-backend).
        self.dp = dp
        self.all2all = resolve_backend(all2all)
        group = tp * dp
        # vLLM's --enable-expert-parallel: each rank of the MoE group holds num_experts / group
        # whole experts instead of every expert's 1/group slice (with dp 1 the layer still ends
        # in the TP all-reduce: every rank holds every token)
        self._expert_parallel_flag = expert_parallel  # as asked: kept by with_* for a later dp
        self.expert_parallel = expert_parallel and model.is_moe and group > 1
        if self.expert_parallel and model.num_experts % group:
            raise ValueError(
                f"{model.name} has {model.num_experts} experts, not divisible by the {group} "
                f"expert-parallel ranks (--tp {tp} x --dp {dp})"
            )
        # How routing concentrates on experts, and EPLB's redundant experts (expert_load.py):
        # the busiest expert-parallel rank's rows, its exchange, its extra weights
        self.expert_load = expert_load or ExpertLoad()
        if not (self.expert_load.is_uniform and not self.expert_load.eplb):
            if not self.expert_parallel:
                raise ValueError(
                    f"{self.expert_load.describe()}: expert imbalance and EPLB are about the busiest "
                    "expert-parallel rank; they need an MoE model with --enable-expert-parallel over "
                    "more than one GPU (--tp or --data-parallel-size)"
                )
            layer_shares(self.expert_load, model.num_experts, group)  # refuses slots that do not split
        self.hardware = hardware
        self.tp = tp
        self.efficiency = efficiency or Efficiency.for_hardware(hardware)
        m, hw = model, hardware
        self._lm_head_flops_per_logit = 2.0 * m.hidden_size * m.vocab_size / tp
        eff0 = self.efficiency
        curve = eff0.tile_m > 1 or eff0.sharpness != math.inf or eff0.gemm_latency > 0.0
        self._mla = hw.mla if m.is_mla and curve else None  # the plain roofline keeps one join
        if m.is_mla:
            # MLA's down-projections stay whole on every rank (model_spec.dense_matmul_params_per_shard)
            dense_shard = m.dense_matmul_params_per_shard(tp)
            self._linear_flops_per_token = 2.0 * dense_shard
            self._layer_weight_bytes = float(dense_shard * m.weight_bytes_per_param)
        elif m.is_moe or m.weight_dtype:
            # The dense matrices here; the routed experts priced per batch in ``_experts``.
            dense = m.num_dense_matmul_params
            self._linear_flops_per_token = 2.0 * dense / tp
            self._layer_weight_bytes = float(dense * m.weight_bytes_per_param / tp)
        else:
            self._linear_flops_per_token = 2.0 * m.num_matmul_params / tp
            self._layer_weight_bytes = float(m.num_matmul_params * m.dtype_bytes / tp)
        self._lm_head_bytes = float(m.vocab_size * m.hidden_size * m.dtype_bytes / tp)
        self._weight_bytes = self._layer_weight_bytes + self._lm_head_bytes
        self._kv_bytes_per_token = float(m.kv_bytes_per_token(tp))
        # Activations each GEMM reads and writes per token (its K inputs and N outputs), all layers;
        # priced only when the GEMM curve is on (tile_m > 1), so the plain roofline stays as it was.
        if m.is_moe or m.is_mla:
            self._act_bytes_per_token = float(m.dtype_bytes * _dense_io_per_token(m, tp))
        else:
            self._act_bytes_per_token = float(m.dtype_bytes * m.num_layers * _gemm_io_per_token(m, tp))
        self._lm_head_act_bytes = float(m.dtype_bytes * (m.hidden_size + m.vocab_size / tp))
        self._init_mla_projections(m, tp)
        self._num_gemms = GEMMS_PER_LAYER * m.num_layers
        self._linear_cache: dict[tuple[int, int], float] = {}
        # ``_comm`` per token count, for ``_iteration_time`` (a dict read, not a call, per
        # priced iteration).
        self._comm_cache: dict[int, float] = {}
        # SGLang's DeepEP auto mode: the memoised GEMMs carry the decode steps' low-latency
        # exchange; a step with a prompt in it adds the normal kernels' difference
        # (``_prefill_exchange``, moe_comm.py)
        self._auto_exchange = self.all2all == AUTO and self.dp > 1 and self.model.is_moe
        self._prefill_exchange_cache: dict[int, float] = {}
        # ``decode_step_times``' per-step constant before the KV term (the GEMMs and the absent
        # prefill's attention) per decode count: three calls fewer per decode run or segment of
        # one, which the simulator prices per event (1.8% of a vLLM loop's instructions).
        self._decode_head_cache: dict[int, float] = {}
        # (N, K) of each GEMM of one layer on this shard, for the per-GEMM wave form.
        self._gemm_shapes = gemm_shapes(
            m.hidden_size,
            m.num_heads * m.dim_per_head / tp,
            m.kv_heads_per_shard(tp) * m.dim_per_head,
            m.intermediate_size / tp,
            m.gated_mlp,
        )
        if self.efficiency.tile_n and hardware.sms < 1:
            raise ValueError(f"hardware {hardware.name}: the per-GEMM wave form needs its SM count")
        if self.efficiency.tile_n and (m.is_moe or m.is_mla):
            raise ValueError(f"{m.name}: the per-GEMM wave form prices dense GQA models only")
        self._init_attention(m, tp)
        eff = self.efficiency
        self._flops_rate = hw.peak_flops * eff.compute
        self._byte_rate = hw.memory_bandwidth * eff.memory
        self._init_formats(m, hw, eff)
        self._init_groups(m, hw, eff)
        self._table = self._init_table(m, hw)
        # Attention kernels relative to the GEMMs (1 on a GPU; a CPU's gather-and-softmax is not).
        self._prefill_rates = (
            self._flops_rate * eff.prefill_attention,
            self._byte_rate * eff.prefill_attention,
        )
        self._decode_rates = (self._flops_rate * eff.decode_attention, self._byte_rate * eff.decode_attention)
        if self._mla is not None:
            pf, df = self._mla.prefill_attention, self._mla.decode_attention
            self._prefill_rates = (self._prefill_rates[0] * pf, self._prefill_rates[1] * pf)
            self._decode_rates = (self._decode_rates[0] * df, self._decode_rates[1] * df)
        if m.is_mla and hw.gemm_table is not None:  # after the rates: past its rows it takes theirs
            self._init_mla_table(m, hw.gemm_table)
        self._init_comm(m, hw, tp, eff)
        self._init_window(m)

    def _init_mla_projections(self, m: ModelSpec, tp: int) -> None:
        """With the GPU's fitted MLA block (``hardware.MlaKernel``), the attention projections
        leave the layers' join for their own: the module's GEMMs run below the dense curve (small
        K: 512, 1,536) by the fitted factor, and each layer pays the block's fixed time."""
        self._mla_flops_per_token = self._mla_weight_bytes = self._mla_act_bytes_per_token = 0.0
        self._mla_factor = 1.0
        self._mla_prefill_fixed = self._mla_decode_fixed = 0.0
        self._mla_per_decode = self._mla_per_context_token = self._mla_per_prefill = 0.0
        self._mla_knee, self._mla_beyond = 0, 1.0
        self._mla_per_token = 0.0
        if self._mla is None:
            return
        proj = m.num_layers * m.attention_params_per_shard(tp)
        self._mla_flops_per_token = 2.0 * proj
        self._mla_weight_bytes = float(proj * m.weight_bytes_per_param)
        self._linear_flops_per_token -= self._mla_flops_per_token
        self._layer_weight_bytes -= self._mla_weight_bytes  # _weight_bytes keeps the whole
        attention_io = m.num_layers * _mla_io_per_token(m, tp) * m.dtype_bytes
        self._mla_act_bytes_per_token = float(attention_io)
        self._act_bytes_per_token -= self._mla_act_bytes_per_token
        fmt = m.weight_dtype or "bf16"
        mla = self._mla
        self._set_mla_terms(
            m, tp, mla.gemm_factor(fmt), mla.format_latency(fmt), mla.format_request(fmt), 0.0
        )
        self._mla_per_context_token = m.num_layers * mla.decode_context
        self._mla_per_prefill = m.num_layers * (mla.prefill_request + m.num_heads / tp * mla.prefill_head)
        self._mla_knee, self._mla_beyond = mla.decode_knee, mla.decode_beyond

    def _set_mla_terms(
        self, m: ModelSpec, tp: int, factor: float, latency: float, per_decode: float, per_token: float
    ) -> None:
        """The MLA block's terms that depend on the weights' format and on the path its dense
        GEMMs take (``MlaKernel.curve_terms``): the projections' factor, the fixed times per
        layer, the time per decode and per new token, all layers."""
        assert self._mla is not None
        self._mla_factor = factor
        self._mla_prefill_fixed = m.num_layers * (self._mla.prefill_latency + latency)
        self._mla_decode_fixed = m.num_layers * (self._mla.decode_latency + latency)
        request = self._mla.decode_request + per_decode + m.num_heads / tp * self._mla.decode_head
        self._mla_per_decode = m.num_layers * request
        self._mla_per_token = m.num_layers * per_token

    def _init_window(self, m: ModelSpec) -> None:
        """Sliding-window layers (window.py): their share of the per-layer attention constants."""
        self._window = m.sliding_window if m.num_sliding_layers else 0
        self._full_share = m.num_full_layers / m.num_layers
        self._sliding_share = m.num_sliding_layers / m.num_layers

    def _init_attention(self, m: ModelSpec, tp: int) -> None:
        heads_per_shard = m.num_heads / tp
        # QK^T and PV: 2 FLOPs each per (query, key) pair per head dimension.
        self._attn_flops_per_pair = 4.0 * heads_per_shard * m.dim_per_head * m.num_layers
        self._prefill_pair_flops = self._decode_pair_flops = self._attn_flops_per_pair
        if m.is_mla:
            # Prefill runs as multi-head attention on the up-projected K/V (QK over nope + rope
            # dims, PV over v); decode absorbs the up-projections and attends over the latent
            # (QK over kv_lora + rope, PV over kv_lora), as vLLM's and SGLang's MLA backends do.
            self._prefill_pair_flops = (
                2.0
                * heads_per_shard
                * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
                * m.num_layers
            )
            self._decode_pair_flops = (
                2.0 * heads_per_shard * (2 * m.kv_lora_rank + m.qk_rope_head_dim) * m.num_layers
            )

    def _init_formats(self, m: ModelSpec, hw: Hardware, eff: Efficiency) -> None:
        # Layer GEMMs run at their weights' tensor-core rate (FP8 W8A8, FP4 on Blackwell); the
        # attention kernels and the LM head at bf16's.
        self._gemm_flops_rate = self._flops_rate
        self._gemm_byte_rate = self._byte_rate
        self._gemm_peak = self._moe_peak = hw.peak_flops
        self._quant_bytes_per_token = 0.0
        self._format_curve: GemmCurve | None = None
        self._dense_gemms: tuple[tuple[float, float, int], ...] = ()
        if m.weight_dtype:
            fmt = get_precision(m.weight_dtype)
            fc, fm = hw.gemm.factors_for(fmt.name) if hw.gemm else (1.0, 1.0)
            self._gemm_peak = hw.peak_for(fmt.compute)
            self._gemm_flops_rate = self._gemm_peak * eff.compute * fc
            self._gemm_byte_rate = self._byte_rate * fm
            # The kernel quantizing each dense GEMM's input to the format (GemmCurve.quant_bytes)
            quant = hw.gemm.quant_bytes_for(fmt.name) if hw.gemm else 0.0
            self._quant_bytes_per_token = quant * _dense_inputs_per_token(m, self.tp)
            # The format's own curve (GemmCurve.format_curves): its dense GEMMs each priced in
            # its wave form. Only on the GPU's own curve: a calibrated or hand-set efficiency
            # keeps the factors on it, so its fitted rates still move every GEMM. An MLA model
            # only where its fitted block has terms for that path (MlaKernel.curve_terms): the
            # projections keep the block's own join, and the block's launches and per-token
            # work, which the layer join priced before, are in those terms.
            mla_terms = self._mla.curve_terms_for(fmt.name) if self._mla is not None else None
            own = hw.gemm.curve_for(fmt.name) if hw.gemm and (not m.is_mla or mla_terms) else None
            if own is not None and _gemm_fields(eff) == _gemm_fields(Efficiency.for_hardware(hw)):
                if hw.sms < 1:
                    raise ValueError(f"hardware {hw.name}: the {fmt.name} GEMM curve needs its SM count")
                self._format_curve = own
                self._dense_gemms = _dense_gemms(m, self.tp)
                if mla_terms is not None:
                    t = mla_terms
                    self._set_mla_terms(m, self.tp, t.gemm_factor, t.latency, t.decode_request, t.token)
        self._moe_rate = self._moe_byte_rate = self._moe_fixed = self._moe_row_element = 0.0
        self._moe_tile_m, self._moe_sharpness = eff.tile_m, eff.sharpness
        if m.is_moe:
            # The fused MoE kernel runs below the dense GEMM curve and pays a fixed time per
            # layer (routing, the row permutation): hardware.MoeKernel, fitted to measured tables.
            kernel = hw.moe or MOE_GENERIC
            fmt = get_precision(
                group_dtype(m, "experts") if m.module_dtypes else (m.expert_dtype or m.weight_dtype or "bf16")
            )
            own = kernel.curve_for(fmt.name, self.expert_parallel)
            if own is not None and _gemm_fields(eff) == _gemm_fields(Efficiency.for_hardware(hw)):
                # The format's own fused-MoE curve (hardware.MoeCurve); a calibrated or hand-set
                # efficiency keeps the factors below, so its fitted rates move the experts too.
                self._moe_peak = hw.peak_for(fmt.compute)  # the roofline's, as below
                self._moe_rate = hw.peak_for(own.math) * own.compute
                self._moe_byte_rate = hw.memory_bandwidth * own.memory
                self._moe_tile_m, self._moe_sharpness = own.tile_m, own.sharpness
                self._moe_fixed, self._moe_row_element = own.layer_latency, own.row_element
                return
            fc, fm = hw.gemm.factors_for(fmt.name) if hw.gemm else (1.0, 1.0)
            self._moe_peak = hw.peak_for(fmt.compute)
            self._moe_rate = self._moe_peak * eff.compute * fc * kernel.compute
            self._moe_byte_rate = self._byte_rate * fm * kernel.memory
            self._moe_fixed = kernel.layer_latency
            self._moe_row_element = kernel.row_element

    def _init_groups(self, m: ModelSpec, hw: Hardware, eff: Efficiency) -> None:
        """A checkpoint that keeps some groups of linear layers in another format
        (``ModelSpec.module_dtypes``): each group's GEMMs at its format's rate, its weights at its
        format's size (``group_terms.py``); None when every group shares the weights' format."""
        self._groups: GroupTerms | None = None
        self._dense_gemm_groups: tuple[str, ...] = ()
        if not m.module_dtypes:
            return
        g = GroupTerms.of(m, hw, self.tp, eff.compute, self._byte_rate, self._mla is not None)
        self._groups = g
        self._layer_weight_bytes = g.layer_weight_bytes
        self._mla_weight_bytes = g.mla_weight_bytes
        self._weight_bytes = g.layer_weight_bytes + g.mla_weight_bytes + self._lm_head_bytes
        if self._quant_bytes_per_token:  # only the quantized groups' inputs are quantized
            quant = hw.gemm.quant_bytes_for(get_precision(m.weight_dtype).name) if hw.gemm else 0.0
            self._quant_bytes_per_token = quant * g.quantized_inputs
        self._dense_gemm_groups = _dense_gemm_groups(m)
        if self._mla is not None and self._format_curve is None:
            # the MLA block's fitted terms of its projections' own format
            fmt = group_dtype(m, "mla")
            mla = self._mla
            self._set_mla_terms(
                m, self.tp, mla.gemm_factor(fmt), mla.format_latency(fmt), mla.format_request(fmt), 0.0
            )

    def _init_table(self, m: ModelSpec, hw: Hardware) -> TableLayers | None:
        """The dense GEMMs and the LM head priced from measured times (``--calibration
        aisim:FILE``, aisim_table.py): each GEMM at its group's format (``module_formats.py``)."""
        self._moe_table: MoeTable | None = None
        self._mla_table: MlaTable | None = None
        self._mla_block: MlaTable | None = None  # the MLA table where it prices the block
        if hw.gemm_table is None:
            return None
        times = hw.gemm_table
        # the table prices the dense GEMMs, not the format's curve. An MLA model's attention
        # block (its projections, attention and fixed terms) is priced from the measured MLA
        # module rows where they time its series (aisim_mla_table.py); elsewhere it keeps the
        # catalog's fitted terms: those of the format's curve path where it has one (fitted
        # beside dense GEMMs priced one by one, as here), else the layer join's
        # (``_init_formats``, ``_init_groups``).
        self._format_curve = None
        groups = self._dense_gemm_groups  # _init_groups's, () when every group shares one format
        fmt = m.weight_dtype or "bf16"
        gemms = tuple(
            (n, k, count, group_dtype(m, groups[i]) if groups else fmt)
            for i, (n, k, count) in enumerate(_dense_gemms(m, self.tp))
        )
        if m.is_moe:  # the routed experts from the measured fused-MoE rows (aisim_moe_table.py)
            group = self.tp * self.dp
            ep = group if self.expert_parallel else 1
            shape = (m.hidden_size, m.moe_intermediate_size, m.experts_per_token, m.num_experts)
            key = (*shape, group // ep, ep)
            experts_fmt = group_dtype(m, "experts") if m.module_dtypes else (m.expert_dtype or fmt)
            self._moe_table = MoeTable.of(
                times.moe, times.gpu, times.framework, experts_fmt, key, self.expert_parallel,
                get_hardware(times.hardware),
            )  # fmt: skip
        return TableLayers.of(times, gemms, (m.vocab_size / self.tp, m.hidden_size), hw)

    def _init_mla_table(self, m: ModelSpec, times: GemmTimes) -> None:
        """The MLA block from the measured module rows (``aisim_mla_table.py``): past their
        longest prompts, and for a chunk's earlier context, with this model's prefill attention
        per causal pair and layer."""
        fmt = group_dtype(m, "mla") if m.module_dtypes else (m.weight_dtype or "bf16")
        pair_seconds = self._prefill_pair_flops / m.num_layers / self._prefill_rates[0]
        hw = get_hardware(times.hardware)
        table = MlaTable.of(times.mla, times.gpu, times.framework, m, self.tp, fmt, hw, pair_seconds)
        self._mla_table = table
        self._mla_block = table if table.priced else None

    @property
    def table_notes(self) -> tuple[str, ...]:
        """With measured times, which rows price the routed experts and the MLA block."""
        tables = (self._moe_table, self._mla_table)
        return tuple(t.note for t in tables if t is not None and t.priced)

    @property
    def table_outside(self) -> tuple[str, ...]:
        """With measured times, the GEMMs and routed experts outside them (priced on the
        catalog's curves)."""
        if self._table is None:
            return ()
        moe = self._moe_table
        return self._table.outside + ((moe.why_outside,) if moe is not None and not moe.priced else ())

    @property
    def table_parts(self) -> tuple[str, ...]:
        """With measured times, what they price: the GEMMs, and the routed experts and the MLA
        block where their rows time them."""
        moe = self._moe_table is not None and self._moe_table.priced
        return ("GEMMs", *(("routed experts",) if moe else ()), *(("MLA block",) if self._mla_block else ()))

    @property
    def mla_outside(self) -> str:
        """With measured times, why the MLA block keeps the catalog's fitted terms ("" when the
        rows price it, or without measured times or MLA)."""
        mla = self._mla_table
        return mla.why_outside if mla is not None and not mla.priced else ""

    def _init_comm(self, m: ModelSpec, hw: Hardware, tp: int, eff: Efficiency) -> None:
        if tp > 1:
            ring = 2.0 * (tp - 1) / tp
            self._comm_fixed = 2.0 * m.num_layers * hw.allreduce_latency_at(tp)
            self._comm_per_token = (
                2.0
                * m.num_layers
                * ring
                * m.hidden_size
                * m.dtype_bytes
                / (hw.interconnect_bandwidth * eff.comm)
            )
        else:
            self._comm_fixed = 0.0
            self._comm_per_token = 0.0
        # Fitted all-reduce bands (hardware.AllReduceBand): (last token count of the band, fixed
        # seconds, seconds per token) per band; a calibrated comm efficiency scales the bandwidth
        # term against the hardware's own (factor 1 with the defaults).
        self._comm_bands: tuple[tuple[float, float, float], ...] = ()
        bands = hw.allreduce_bands_at(tp) if tp > 1 else ()
        if bands:
            ring = 2.0 * (tp - 1) / tp
            row_bytes = m.hidden_size * m.dtype_bytes
            scale = (hw.comm_efficiency or DEFAULT_COMM) / eff.comm
            self._comm_bands = tuple(
                (
                    b.max_bytes / row_bytes,
                    2.0 * m.num_layers * b.latency,
                    2.0
                    * m.num_layers
                    * ring
                    * row_bytes
                    / (hw.interconnect_bandwidth * b.efficiency)
                    * scale,
                )
                for b in bands
            )

    def _with(self, **changes: Any) -> CostModel:
        """This cost model with some of its construction arguments changed (expert parallelism
        as asked, kept for a later DP group)."""
        args: dict[str, Any] = dict(
            model=self.model,
            hardware=self.hardware,
            tp=self.tp,
            efficiency=self.efficiency,
            expert_parallel=self._expert_parallel_flag,
            dp=self.dp,
            all2all=self.all2all,
            expert_load=self.expert_load,
            pipeline=self.pipeline,
        )
        return CostModel(**{**args, **changes})

    def with_efficiency(self, efficiency: Efficiency) -> CostModel:
        return self._with(efficiency=efficiency)

    def with_expert_parallel(self, on: bool = True) -> CostModel:
        return self._with(expert_parallel=on)

    def with_data_parallel(self, dp: int, all2all: str = "allgather_reducescatter") -> CostModel:
        return self._with(dp=dp, all2all=all2all)

    def with_expert_load(self, load: ExpertLoad) -> CostModel:
        return self._with(expert_load=load)

    def with_pipeline(self, pp: int, network: str = "auto") -> CostModel:
        """This model's steps split over ``pp`` stages (vLLM's ``--pipeline-parallel-size``),
        joined by ``network``, "auto": NVLink in one NVLink domain, else InfiniBand (pipeline.py)."""
        return self._with(
            pipeline=Pipeline.of(self.model, self.hardware, self.tp, pp, network) if pp > 1 else None
        )

    def pipeline_split(
        self, work: float, num_tokens: int, num_logits: int
    ) -> tuple[tuple[float, ...], float]:
        """A step's forward pass (``work`` seconds on one TP shard of the whole model) on the
        pipeline's stages, the LM head over ``num_logits`` on the last, and the send between two
        stages (pipeline.py)."""
        pipe = self.pipeline
        assert pipe is not None
        head = self._linear(num_tokens, num_logits) - self._linear(num_tokens, 0) if num_logits else 0.0
        return pipe.stage_times(work, head), pipe.send_time(num_tokens)

    @property
    def fullest_stage(self) -> tuple[ModelSpec, float, int]:
        """What one GPU of the pipeline stage with the most layers holds, for its memory: that
        stage's model (``ModelSpec.pipeline_stage``), its share of the redundant experts' bytes,
        and the stages (the whole model, all of them and 1 without pipeline parallelism)."""
        if self.pipeline is None:
            return self.model, self.redundant_expert_bytes, 1
        pp = self.pipeline.pp
        stage = self.model.pipeline_stage(pp)
        return stage, self.redundant_expert_bytes * stage.num_layers / self.model.num_layers, pp

    @property
    def redundant_expert_bytes(self) -> float:
        """Weight bytes per GPU that EPLB's redundant experts add (each rank holds
        ``(E + R) / ep`` experts): memory the KV cache does not get."""
        redundant = self.expert_load.redundant or 0
        m = self.model
        if not redundant:
            return 0.0
        return redundant * m.expert_params * m.expert_bytes_per_param * m.num_moe_layers / (self.tp * self.dp)

    def _busiest_factor(self, num_tokens: int) -> float:
        """How much more the busiest EP rank routes than under uniform routing, at
        ``num_tokens`` tokens in the group (1 with uniform routing)."""
        load = self.expert_load
        if (load.is_uniform and not load.eplb) or num_tokens <= 0:
            return 1.0
        m = self.model
        rows = num_tokens * m.experts_per_token
        group = self.tp * self.dp
        return busiest_rank_rows(rows, load, m.num_experts, group) / busiest_rank_rows(
            rows, ExpertLoad(), m.num_experts, group
        )

    @property
    def format_curve(self) -> GemmCurve | None:
        """The weights' format's own GEMM curve when the dense GEMMs are priced on it
        (``GemmCurve.format_curves``), else None."""
        return self._format_curve

    @property
    def windowed(self) -> bool:
        """Whether the model has sliding-window layers: its attention then depends on each
        request's context, not on the batch's sums alone (``iteration_time``'s ``window``)."""
        return self._window > 0

    # ---- the formula --------------------------------------------------------------------
    # The formula in three pieces, each written once for Python numbers and numpy arrays.
    def _linear(self, num_tokens: int, num_logits: int) -> float:
        """The GEMMs of one iteration; memoised (a run sees few distinct token counts)."""
        key = (num_tokens, num_logits)
        t = self._linear_cache.get(key)
        if t is None:
            t = self._linear_uncached(int(num_tokens), int(num_logits))
            if self.efficiency.per_logit:
                t += int(num_logits) * self.efficiency.per_logit
            self._linear_cache[key] = t
        return t

    def _linear_uncached(self, num_tokens: int, num_logits: int) -> float:
        eff = self.efficiency
        experts = self._experts(num_tokens) if self.model.is_moe else 0.0
        if self._table is not None:  # measured times (their rows carry any quantization kernel)
            # The KV writes and MLA's projections, unless the MLA module rows price the block:
            # they time both.
            kv_writes = mla = 0.0
            if self._mla_block is None:
                kv_writes = num_tokens * self._kv_bytes_per_token / self._byte_rate
                mla = self._mla_projections(num_tokens) if self._mla is not None else 0.0
            return (
                self._table.layers(num_tokens)
                + kv_writes
                + self._table.lm_head(num_logits)
                + experts
                + mla
                + num_tokens * eff.per_token
            )
        if eff.tile_m <= 1 and eff.sharpness == math.inf and eff.gemm_latency == 0.0:
            # The plain roofline: every GEMM in one max (the model before the fitted curves).
            if self._groups is not None:
                compute = (
                    num_tokens * self._groups.layer_compute_s
                    + num_logits * self._lm_head_flops_per_logit / self._flops_rate
                )
            elif self._gemm_flops_rate != self._flops_rate:
                compute = (
                    num_tokens * self._linear_flops_per_token / self._gemm_flops_rate
                    + num_logits * self._lm_head_flops_per_logit / self._flops_rate
                )
            else:
                compute = (
                    num_tokens * self._linear_flops_per_token + num_logits * self._lm_head_flops_per_logit
                ) / self._flops_rate
            return (
                max(compute, (self._weight_bytes + num_tokens * self._kv_bytes_per_token) / self._byte_rate)
                + experts
                + num_tokens * eff.per_token
            )
        if self._quant_bytes_per_token:
            experts += num_tokens * self._quant_bytes_per_token / self._gemm_byte_rate
        if self._format_curve is not None:  # before the bf16 wave form, which takes the bf16 rate
            return self._linear_format(num_tokens, num_logits) + experts
        if eff.tile_n:
            return self._linear_waves(num_tokens, num_logits) + experts
        p = eff.sharpness
        if self._mla is not None:
            experts += self._mla_projections(num_tokens)
        if self._groups is not None:  # each group at its format's rates (group_terms.py)
            layers = join(
                padded_tokens(num_tokens, eff.tile_m) * self._groups.layer_compute_s,
                self._groups.layer_weight_s
                + num_tokens * (self._act_bytes_per_token + self._kv_bytes_per_token) / self._gemm_byte_rate,
                p,
            )
        else:
            layers = join(
                padded_tokens(num_tokens, eff.tile_m) * self._linear_flops_per_token / self._gemm_flops_rate,
                (
                    self._layer_weight_bytes
                    + num_tokens * (self._act_bytes_per_token + self._kv_bytes_per_token)
                )
                / self._gemm_byte_rate,
                p,
            )
        head = self._head(num_logits)
        return layers + self._num_gemms * eff.gemm_latency + head + experts + num_tokens * eff.per_token

    def _head(self, num_logits: int) -> float:
        """The LM head (bf16, at the GPU's own curve) in one join; 0 without logits."""
        if not num_logits:
            return 0.0
        eff = self.efficiency
        return (
            join(
                padded_tokens(num_logits, eff.tile_m) * self._lm_head_flops_per_logit / self._flops_rate,
                (self._lm_head_bytes + num_logits * self._lm_head_act_bytes) / self._byte_rate,
                eff.sharpness,
            )
            + eff.gemm_latency
        )

    def _linear_format(self, num_tokens: int, num_logits: int) -> float:
        """The dense GEMMs on their format's own curve (``GemmCurve.format_curves``), each on its
        own (N, K) in the curve's wave form with its own launch; the KV writes shared among them
        as the layer join adds them to its bytes; the LM head as ``_head``."""
        m, hw, curve = self.model, self.hardware, self._format_curve
        assert curve is not None
        kv_write = num_tokens * self._kv_bytes_per_token / sum(c for _, _, c in self._dense_gemms)
        layers = 0.0
        for i, (n, k, count) in enumerate(self._dense_gemms):
            own, peak, weight_bytes = curve, self._gemm_peak, m.weight_bytes_per_param
            if self._dense_gemm_groups:  # a group kept in another format: that format's curve
                fmt = get_precision(group_dtype(m, self._dense_gemm_groups[i]))
                if fmt.bytes != weight_bytes:
                    assert hw.gemm is not None
                    own = hw.gemm.curve_for(fmt.name) or hw.gemm  # bf16: the GPU's own curve
                    peak, weight_bytes = hw.peak_for(fmt.compute), fmt.bytes
            layers += count * curve_gemm_time(
                num_tokens, n, k, own, peak, hw.memory_bandwidth, hw.sms,
                weight_bytes, m.dtype_bytes, kv_write,
            )  # fmt: skip
        if self._mla is not None:
            layers += self._mla_projections(num_tokens)
        return layers + self._head(num_logits) + num_tokens * self.efficiency.per_token

    def _mla_projections(self, num_tokens: int) -> float:
        """MLA's attention projections as their own join (``_init_mla_projections``); beside the
        format's own curve, plus the block's fitted time per new token (``_init_formats``)."""
        eff = self.efficiency
        if self._groups is not None:  # o_proj and the other projections each at their format's rates
            compute = padded_tokens(num_tokens, eff.tile_m) * self._groups.mla_compute_s
            memory = (
                self._groups.mla_weight_s + num_tokens * self._mla_act_bytes_per_token / self._gemm_byte_rate
            )
        else:
            compute = (
                padded_tokens(num_tokens, eff.tile_m) * self._mla_flops_per_token / self._gemm_flops_rate
            )
            memory = (
                self._mla_weight_bytes + num_tokens * self._mla_act_bytes_per_token
            ) / self._gemm_byte_rate
        return join(compute, memory, eff.sharpness) / self._mla_factor + num_tokens * self._mla_per_token

    def mla_fixed_time(self, shape: BatchShape) -> float:
        """The MLA block's time beside its projections and attention rates (0 without a fitted
        ``hardware.MlaKernel``, and with the measured MLA rows, whose module time
        ``attention_time`` gives whole): each path's fixed time per layer and per-request terms
        (``_mla_prefill_path``, ``_mla_decode_path``)."""
        if self._mla_block is not None:
            return 0.0
        return (self._mla_prefill_path(shape.num_prefills) if shape.prefill_kv_tokens else 0.0) + (
            self._mla_decode_path(shape.num_decodes, shape.decode_kv_tokens)
            if shape.decode_kv_tokens
            else 0.0
        )

    def _mla_prefill_path(self, num_prefills: Any) -> Any:
        """The MLA prefill path's time beside its projections and attention rates, all layers: its
        fixed time and a time per prefill chunk (and per chunk and head)."""
        return self._mla_prefill_fixed + num_prefills * self._mla_per_prefill

    def _mla_decode_path(self, num_decodes: Any, decode_kv: Any) -> Any:
        """The MLA decode path's time beside its projections and attention rates, all layers: its
        fixed time, a time per decode (and per decode and head; past the kernel's knee, a share of
        it), a time per token of the decodes' mean context (``BatchShape.num_decodes``: the
        requests decoding one token)."""
        if isinstance(num_decodes, np.ndarray):
            n = np.maximum(num_decodes, 1)
        elif num_decodes < 1:  # decode KV comes only with decodes: a shape built without its counts
            raise ValueError(f"a batch shape with decode KV ({decode_kv}) and num_decodes {num_decodes}")
        else:
            n = num_decodes
        per_request = n
        if self._mla_knee:  # past the knee each decode adds ``decode_beyond`` of one
            beyond = (
                np.maximum(n - self._mla_knee, 0) if isinstance(n, np.ndarray) else max(n - self._mla_knee, 0)
            )
            per_request = n - beyond + beyond * self._mla_beyond
        return (
            self._mla_decode_fixed
            + per_request * self._mla_per_decode
            + decode_kv / n * self._mla_per_context_token
        )

    def _mla_table_time(
        self,
        num_tokens: Any,
        prefill_pairs: Any,
        prefill_kv: Any,
        decode_kv: Any,
        num_prefills: Any,
        num_decodes: Any,
    ) -> Any:
        """The MLA block of every layer from the measured module rows (``aisim_mla_table.py``):
        the prefill part at (chunks, new prefill tokens / chunks), plus the catalog's prefill
        attention over the pairs and KV beyond those equal prompts' own (earlier context,
        unequal chunks); the decode part at (decodes, their mean context). Decode arrays as
        ``_iteration_time``'s (the prefill part then absent)."""
        table = self._mla_block
        assert table is not None
        layers = self.model.num_layers
        t = 0.0
        tokens = num_tokens - num_decodes  # the prefill chunks' (and verifications') new tokens
        if prefill_kv and tokens > 0:
            chunks = max(num_prefills, 1)  # speculative verifications alone: taken as one chunk
            q = tokens / chunks
            t = layers * table.prefill(chunks, tokens)
            extra_pairs = max(prefill_pairs - chunks * q * (q + 1) / 2, 0.0)
            extra_kv = max(prefill_kv - tokens, 0)
            if extra_kv or extra_pairs > 0.5:  # equal prompts' own pairs, up to rounding
                t += self._attention(extra_pairs, extra_kv, self._prefill_rates, self._prefill_pair_flops)
        if isinstance(decode_kv, np.ndarray) or decode_kv:
            if num_decodes < 1:  # decode KV comes only with decodes: a shape built without its counts
                raise ValueError(f"a batch shape with decode KV ({decode_kv}) and num_decodes {num_decodes}")
            t = t + layers * table.decode(num_decodes, decode_kv / num_decodes)
        return t

    def _experts(self, num_tokens: int) -> float:
        """The routed experts of every MoE layer (``moe.py``): each expert sliced over the TP
        ranks, or whole on ``1 / tp`` of them with ``expert_parallel``; the fused MoE kernel's
        rates and fixed time per layer (``hardware.MoeKernel``). With data-parallel attention
        the experts' ranks are the dp x tp of the group and see every DP rank's tokens, each
        batch padded to this one (the group's largest), plus the layer's exchange
        (``moe_comm.py``)."""
        if num_tokens <= 0:
            return 0.0
        m = self.model
        table = self._moe_table
        if table is not None and table.priced:  # measured: the whole fused kernel
            # (uniform rows: with uneven routing the busiest rank's share of more tokens)
            layer = table.seconds(num_tokens * self.dp * self._busiest_factor(num_tokens * self.dp))
            if self.dp > 1:
                layer += self.exchange_time(num_tokens)
            return m.num_moe_layers * layer
        group = self.tp * self.dp
        flops, moved = grouped_gemm_parts(
            num_tokens * self.dp,
            m.num_experts,
            m.experts_per_token,
            m.hidden_size,
            m.moe_intermediate_size,
            weight_bytes=m.expert_bytes_per_param,
            act_bytes=m.dtype_bytes,
            tile_m=self._moe_tile_m,
            moe_tp=1 if self.expert_parallel else group,
            ep=group if self.expert_parallel else 1,
            load=self.expert_load,
        )
        layer = (
            join(flops / self._moe_rate, moved / self._moe_byte_rate, self._moe_sharpness) + self._moe_fixed
        )
        if self._moe_row_element:  # the routed rows moved whole on each rank (EP: its mean share)
            routed = num_tokens * self.dp * m.experts_per_token / (group if self.expert_parallel else 1)
            if self.expert_parallel:
                routed *= self._busiest_factor(num_tokens * self.dp)
            layer += routed * m.hidden_size * self._moe_row_element
        if self.dp > 1:
            layer += self.exchange_time(num_tokens)
        return m.num_moe_layers * layer

    def exchange_time(self, num_tokens: int, extend: bool = False) -> float:
        """One MoE layer's token exchange (dispatch and combine) when every DP rank holds
        ``num_tokens`` tokens; 0 without data-parallel attention. ``extend``: some rank of the
        group runs a prompt (SGLang's DeepEP auto mode then runs its normal kernels)."""
        m, hw = self.model, self.hardware
        fallback = LinkFit(hw.allreduce_latency_at(self.tp * self.dp), hw.comm_efficiency or DEFAULT_COMM)
        backend = self.all2all
        if backend == AUTO:
            backend = "deepep_high_throughput" if extend else "deepep_low_latency"
        return exchange_time(
            backend,
            hw,
            fallback,
            tokens=num_tokens,
            dp=self.dp,
            tp=self.tp,
            hidden=m.hidden_size,
            k=m.experts_per_token,
            num_experts=m.num_experts,
            act_bytes=m.dtype_bytes,
            receive_factor=self._busiest_factor(num_tokens * self.dp),
        )

    def _prefill_exchange(self, num_tokens: int) -> float:
        """What a step with a prompt in it adds under SGLang's DeepEP auto mode: every MoE
        layer's normal exchange in place of the low-latency one ``_linear`` carries."""
        t = self._prefill_exchange_cache.get(num_tokens)
        if t is None:
            n = int(num_tokens)
            t = self.model.num_moe_layers * (self.exchange_time(n, True) - self.exchange_time(n))
            self._prefill_exchange_cache[num_tokens] = t
        return t

    def _gemm(self, rows: int, n: float, k: float, extra_bytes: float) -> float:
        """One GEMM in the wave form (gemm.py): ``rows`` x K times K x N, plus ``extra_bytes``."""
        eff, hw = self.efficiency, self.hardware
        flops = wave_flops(
            padded_tokens(rows, eff.tile_m), n, k, eff.tile_m, eff.tile_n, hw.sms, eff.wave_alpha
        )
        moved = (n * k + rows * (k + n)) * self.model.dtype_bytes + extra_bytes
        return (
            join(float(flops) / self._flops_rate, moved / self._byte_rate, eff.sharpness) + eff.gemm_latency
        )

    def _linear_waves(self, num_tokens: int, num_logits: int) -> float:
        """Each GEMM priced on its own (N, K): tiles, waves over the SMs, its own join. The KV
        writes go with the QKV projection, as the layer form adds them to the layer's bytes."""
        m = self.model
        kv_write = num_tokens * self._kv_bytes_per_token / m.num_layers
        layer = 0.0
        for i, (n, k) in enumerate(self._gemm_shapes):
            layer += self._gemm(num_tokens, n, k, kv_write if i == 0 else 0.0)
        head = self._gemm(num_logits, m.vocab_size / self.tp, m.hidden_size, 0.0) if num_logits else 0.0
        return m.num_layers * layer + head + num_tokens * self.efficiency.per_token

    def _attention(self, pairs: Any, kv_tokens: Any, rates: tuple[float, float], pair_flops: float) -> Any:
        compute = pairs * pair_flops / rates[0]
        memory = kv_tokens * self._kv_bytes_per_token / rates[1]
        if isinstance(kv_tokens, np.ndarray):
            return np.maximum(compute, memory)
        # ``max(compute, memory)`` spelled out (the same float): the builtin parses its
        # arguments as keywords, ~750 instructions a call, twice per stepped iteration.
        return memory if memory > compute else compute

    def _comm(self, num_tokens: Any) -> Any:
        if not self._comm_bands:
            return self._comm_fixed + num_tokens * self._comm_per_token
        if isinstance(num_tokens, np.ndarray):
            last = len(self._comm_bands) - 1
            conds = [num_tokens <= top for top, _, _ in self._comm_bands[:last]]
            return np.select(
                conds,
                [f + num_tokens * t for _, f, t in self._comm_bands[:last]],
                self._comm_bands[last][1] + num_tokens * self._comm_bands[last][2],
            )
        band = next((b for b in self._comm_bands if num_tokens <= b[0]), self._comm_bands[-1])
        return band[1] + num_tokens * band[2]

    def _iteration_time(
        self,
        num_tokens: Any,
        num_logits: Any,
        prefill_pairs: Any,
        prefill_kv: Any,
        decode_kv: Any,
        num_prefills: Any,
        num_decodes: Any,
    ) -> Any:
        """``iteration_time`` from ``BatchShape``'s fields, in its order (numpy arrays for the
        decode fields of a vectorised decode run)."""
        # ``_linear``'s memo read here, the call only on a miss, and ``_comm`` memoised: every
        # priced iteration comes here, a call costs ~650 instructions, and a run sees few
        # distinct token counts (the memos hit nearly always).
        linear = self._linear_cache.get((num_tokens, num_logits))
        if linear is None:
            linear = self._linear(num_tokens, num_logits)
        comm = self._comm_cache.get(num_tokens)
        if comm is None:
            comm = self._comm_cache[num_tokens] = self._comm(num_tokens)
        if self._auto_exchange and num_prefills:
            linear = linear + self._prefill_exchange(num_tokens)
        if self._mla_block is not None:  # the whole MLA block from the measured module rows
            mla = self._mla_table_time(
                num_tokens, prefill_pairs, prefill_kv, decode_kv, num_prefills, num_decodes
            )
            return linear + mla + comm + self.efficiency.overhead
        prefill = self._attention(prefill_pairs, prefill_kv, self._prefill_rates, self._prefill_pair_flops)
        # A decode's query attends to each of its KV tokens once: pairs == KV tokens.
        decode = self._attention(decode_kv, decode_kv, self._decode_rates, self._decode_pair_flops)
        if self._mla is not None:  # the MLA block's time per path run (decode arrays: > 0)
            linear = linear + (self._mla_prefill_path(num_prefills) if prefill_kv else 0.0)
            if isinstance(decode_kv, np.ndarray) or decode_kv:
                linear = linear + self._mla_decode_path(num_decodes, decode_kv)
        return linear + prefill + decode + comm + self.efficiency.overhead

    def linear_time(self, num_tokens: int, num_logits: int = 0) -> float:
        """Seconds the GEMMs of ``num_tokens`` new tokens take (the LM head for ``num_logits``)."""
        return self._linear(num_tokens, num_logits)

    def decode_step_times(self, num_decodes: int, num_context_tokens: int, num_steps: int) -> list[float]:
        """``decode_run_times`` as a Python list, cheaper for a few steps; the same floats
        (``_attention`` is inlined with its operations in the same order)."""
        n = num_decodes
        comm = self._comm_cache.get(n)  # as ``_iteration_time`` reads it
        if comm is None:
            comm = self._comm_cache[n] = self._comm(n)
        overhead = self.efficiency.overhead
        pair_flops, kv_bytes = self._decode_pair_flops, self._kv_bytes_per_token
        flops_rate, byte_rate = self._decode_rates
        if self._mla_block is not None:  # as ``_iteration_time``: the measured MLA block, per step
            linear = self._linear(n, n)
            return [
                linear + self._mla_table_time(n, 0, 0, kv, 0, n) + comm + overhead
                for kv in range(num_context_tokens, num_context_tokens + n * num_steps, n)
            ]
        if self._mla is not None:  # as ``_iteration_time``: the decode path's time, per step
            linear = self._linear(n, n) + 0.0  # + the (absent) prefill path's fixed time
            prefill = self._attention(0, 0, self._prefill_rates, self._prefill_pair_flops)
            return [
                linear
                + self._mla_decode_path(n, kv)
                + prefill
                + max(kv * pair_flops / flops_rate, kv * kv_bytes / byte_rate)
                + comm
                + overhead
                for kv in range(num_context_tokens, num_context_tokens + n * num_steps, n)
            ]
        head = self._decode_head_cache.get(n)
        if head is None:
            head = self._linear(n, n) + self._attention(0, 0, self._prefill_rates, self._prefill_pair_flops)
            self._decode_head_cache[n] = head
        stop = num_context_tokens + n * num_steps
        # Both sides are kv times a constant, each rounded twice, so where one constant leads
        # by more than rounding can close (1e-9 against ~1e-16) that side is the max at every
        # kv (at kv 0 both are 0.0): chosen once per call, each step one expression, the same
        # operations in the same order (a loop's test and append per step showed in SGLang's runs).
        if kv_bytes * flops_rate > pair_flops * byte_rate * _CLEAR_LEAD:
            return [
                head + kv * kv_bytes / byte_rate + comm + overhead
                for kv in range(num_context_tokens, stop, n)
            ]
        if pair_flops * byte_rate > kv_bytes * flops_rate * _CLEAR_LEAD:
            return [
                head + kv * pair_flops / flops_rate + comm + overhead
                for kv in range(num_context_tokens, stop, n)
            ]
        times = []
        for kv in range(num_context_tokens, stop, n):
            compute = kv * pair_flops / flops_rate
            memory = kv * kv_bytes / byte_rate
            # ``max(compute, memory)`` spelled out, as in ``_attention``: once per step.
            times.append(head + (memory if memory > compute else compute) + comm + overhead)
        return times

    def iteration_time(self, shape: BatchShape, window: WindowShape | None = None) -> float:
        """Predicted seconds for one iteration of this batch shape. A model with sliding-window
        layers takes the batch's window-bounded aggregates too (``window.py``); without them its
        sliding layers are priced as full attention (an upper bound). With data-parallel
        attention every DP rank runs this batch (``group_time`` for unequal ones)."""
        if shape.num_tokens == 0:
            return 0.0
        if self._window:
            return self._rank_time(shape, window, shape.num_tokens, bool(shape.num_prefills))
        return self._iteration_time(
            shape.num_tokens,
            shape.num_logits,
            shape.prefill_pairs,
            shape.prefill_kv_tokens,
            shape.decode_kv_tokens,
            shape.num_prefills,
            shape.num_decodes,
        )

    def shape_time(
        self,
        num_tokens: int,
        num_logits: int,
        prefill_pairs: int,
        prefill_kv_tokens: int,
        decode_kv_tokens: int,
        num_prefills: int,
        num_decodes: int,
    ) -> float:
        """``iteration_time(BatchShape(...))`` of these fields (no window aggregates), without
        building the shape: a frozen dataclass takes ~2,500 instructions to construct, and the
        chunk runs price one iteration per loop turn."""
        if num_tokens == 0:
            return 0.0
        if self._window:
            shape = BatchShape(
                num_tokens,
                num_logits,
                prefill_pairs,
                prefill_kv_tokens,
                decode_kv_tokens,
                num_prefills,
                num_decodes,
            )
            return self._rank_time(shape, None, num_tokens, bool(num_prefills))
        # The arguments passed on as they are: a call through ``*fields`` goes through C (a
        # tuple and a new interpreter frame), per priced iteration of every chunk run.
        return self._iteration_time(
            num_tokens,
            num_logits,
            prefill_pairs,
            prefill_kv_tokens,
            decode_kv_tokens,
            num_prefills,
            num_decodes,
        )

    def attention_time(self, shape: BatchShape, window: WindowShape | None = None) -> float:
        """The prefill and decode attention parts of ``iteration_time`` alone (with the measured
        MLA rows, the whole MLA block: its projections, attention and fixed terms)."""
        if self._mla_block is not None:
            return self._mla_table_time(
                shape.num_tokens, shape.prefill_pairs, shape.prefill_kv_tokens, shape.decode_kv_tokens,
                shape.num_prefills, shape.num_decodes,
            )  # fmt: skip
        if not self._window:
            prefill = self._attention(
                shape.prefill_pairs, shape.prefill_kv_tokens, self._prefill_rates, self._prefill_pair_flops
            )
            decode = self._attention(
                shape.decode_kv_tokens, shape.decode_kv_tokens, self._decode_rates, self._decode_pair_flops
            )
            return prefill + decode
        if window is None:  # no window aggregates: the sliding layers read everything
            window = WindowShape(shape.prefill_pairs, shape.prefill_kv_tokens, shape.decode_kv_tokens)
        full, sliding = self._full_share, self._sliding_share
        prefill = self._attention(
            shape.prefill_pairs * full + window.prefill_pairs * sliding,
            shape.prefill_kv_tokens * full + window.prefill_kv_tokens * sliding,
            self._prefill_rates,
            self._prefill_pair_flops,
        )
        decode_kv = shape.decode_kv_tokens * full + window.decode_kv_tokens * sliding
        return prefill + self._attention(decode_kv, decode_kv, self._decode_rates, self._decode_pair_flops)

    def _rank_time(
        self, shape: BatchShape | None, window: WindowShape | None, padded_tokens: int, extend: bool = False
    ) -> float:
        """One rank's iteration with its GEMMs over ``padded_tokens`` rows (the DP group's
        largest batch) and attention over its own requests; ``None``: a dummy batch.
        ``extend``: some rank of the group runs a prompt (``_prefill_exchange``)."""
        exchange = self._prefill_exchange(padded_tokens) if extend and self._auto_exchange else 0.0
        if shape is None:
            return (
                self._linear(padded_tokens, 0)
                + exchange
                + self._comm(padded_tokens)
                + self.efficiency.overhead
            )
        return (
            self._linear(padded_tokens, shape.num_logits)
            + exchange
            + self.mla_fixed_time(shape)
            + self.attention_time(shape, window)
            + self._comm(padded_tokens)
            + self.efficiency.overhead
        )

    def group_time(
        self, shapes: list[BatchShape | None], windows: list[WindowShape | None] | None = None
    ) -> float:
        """One lockstep step of a data-parallel group: rank i runs ``shapes[i]`` (None: idle,
        a dummy batch of one token, as vLLM's DP engines run). Every MoE layer waits for every
        rank, so the step takes the slowest rank's time; each rank's GEMMs run on the largest
        batch, to which vLLM pads all ranks (CUDA graphs, vllm/v1/worker/dp_utils.py)."""
        padded = max([s.num_tokens for s in shapes if s is not None] + [1])
        if windows is None:
            windows = [None] * len(shapes)
        # SGLang's ranks agree on one mode: extend when any rank extends (dp_attn.py:291@v0.5.23)
        extend = any(s is not None and s.num_prefills for s in shapes)
        return max(self._rank_time(s, w, padded, extend) for s, w in zip(shapes, windows, strict=True))

    def decode_run_times(self, num_decodes: int, num_context_tokens: int, num_steps: int) -> np.ndarray:
        """Durations of ``num_steps`` decode iterations; the summed context grows by
        ``num_decodes`` per step (each decode adds its token)."""
        decode_kv = num_context_tokens + num_decodes * np.arange(num_steps, dtype=np.int64)
        n = num_decodes
        return self._iteration_time(n, n, 0, 0, decode_kv, 0, n)

    def swap_time(self, num_tokens: int) -> float:
        """Seconds to copy ``num_tokens`` tokens of KV between GPU and host over PCIe, per shard
        (each GPU moves its own shard in parallel). The iteration that needs them waits."""
        return num_tokens * self._kv_bytes_per_token / self.hardware.pcie_bandwidth

    # ---- readable helpers ---------------------------------------------------------------
    def prefill_time(self, num_tokens: int, num_context_tokens: int = 0) -> float:
        return self.iteration_time(BatchShape.of([(num_tokens, num_context_tokens)], []))

    def decode_time(self, batch_size: int, context_len: int) -> float:
        """One decode iteration of ``batch_size`` requests each holding ``context_len`` tokens."""
        return self.iteration_time(BatchShape.of([], [context_len] * batch_size))

    def roofline(self, shape: BatchShape, window: WindowShape | None = None) -> Roofline:
        """The iteration's work at peak rates (each GEMM at its format's rate, the routed experts'
        FLOPs without padding and the bytes of the experts the batch touches; a sliding layer's
        attention over its window, as ``attention_time``)."""
        hw = self.hardware
        kv = self._kv_bytes_per_token
        m = self.model
        lin_f = (
            shape.num_tokens * self._linear_flops_per_token + shape.num_logits * self._lm_head_flops_per_logit
        )
        if self._mla is not None:  # the MLA projections, priced apart (``_mla_projections``)
            lin_f += shape.num_tokens * self._mla_flops_per_token
        lin_b = self._weight_bytes + shape.num_tokens * kv
        lin_c = lin_f / hw.peak_flops
        if self._groups is not None:
            lin_c = (
                shape.num_tokens * self._groups.peak_s
                + shape.num_logits * self._lm_head_flops_per_logit / hw.peak_flops
            )
        elif m.is_moe or m.weight_dtype:
            lin_c = (
                shape.num_tokens
                * (self._linear_flops_per_token + self._mla_flops_per_token)
                / self._gemm_peak
                + shape.num_logits * self._lm_head_flops_per_logit / hw.peak_flops
            )
        if m.is_moe and shape.num_tokens:
            # This rank's share of every DP rank's tokens (dp 1: all of them on 1/tp of each expert)
            params = m.expert_params / (self.tp * self.dp)
            tokens = shape.num_tokens * self.dp
            expert_f = 2.0 * tokens * m.experts_per_token * params * m.num_moe_layers
            load = self.expert_load
            if self.expert_parallel and not (load.is_uniform and not load.eplb):
                # the busiest rank's share of a large batch (expert_load.py), not the mean
                expert_f *= 1.0 + steady_imbalance(load, m.num_experts, self.tp * self.dp)
            touched = touched_experts(tokens, m.num_experts, m.experts_per_token)
            lin_f += expert_f
            lin_c += expert_f / self._moe_peak
            lin_b += touched * params * m.expert_bytes_per_param * m.num_moe_layers
        pairs, pre_kv, dec_kv = shape.prefill_pairs, shape.prefill_kv_tokens, shape.decode_kv_tokens
        if self._window and window is not None:
            full, sliding = self._full_share, self._sliding_share
            pairs = pairs * full + window.prefill_pairs * sliding
            pre_kv = pre_kv * full + window.prefill_kv_tokens * sliding
            dec_kv = dec_kv * full + window.decode_kv_tokens * sliding
        pre_f = pairs * self._prefill_pair_flops
        pre_b = pre_kv * kv
        dec_f = dec_kv * self._decode_pair_flops
        dec_b = dec_kv * kv
        comm = 0.0
        if self.tp > 1 and shape.num_tokens:
            comm = self._comm(shape.num_tokens)
        if self.dp > 1 and shape.num_tokens:
            comm += m.num_moe_layers * self.exchange_time(shape.num_tokens)
        return Roofline(
            compute_s=(lin_c, pre_f / hw.peak_flops, dec_f / hw.peak_flops),
            memory_s=(
                lin_b / hw.memory_bandwidth,
                pre_b / hw.memory_bandwidth,
                dec_b / hw.memory_bandwidth,
            ),
            comm_s=comm,
            flops=lin_f + pre_f + dec_f,
            bytes=lin_b + pre_b + dec_b,
        )


def _gemm_io_per_token(m: ModelSpec, tp: int) -> float:
    """Elements one token's row reads (K) and writes (N) across one layer's four GEMMs, per shard."""
    d = m.dim_per_head
    q = m.num_heads * d / tp
    kv = m.kv_heads_per_shard(tp) * d
    inter = m.intermediate_size / tp
    up = (2 if m.gated_mlp else 1) * inter
    return (m.hidden_size + q + 2 * kv) + (q + m.hidden_size) + (m.hidden_size + up) + (inter + m.hidden_size)


def _mla_io_per_token(m: ModelSpec, tp: int) -> float:
    """Elements one token's row reads and writes across one layer's MLA projections, per shard."""
    h = m.hidden_size
    heads = m.num_heads / tp
    qk = heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    q = (h + m.q_lora_rank + m.q_lora_rank + qk) if m.q_lora_rank else (h + qk)
    kv = (h + m.kv_lora_rank + m.qk_rope_head_dim) + (
        m.kv_lora_rank + heads * (m.qk_nope_head_dim + m.v_head_dim)
    )
    return q + kv + heads * m.v_head_dim + h


def _gemm_fields(eff: Efficiency) -> tuple:
    """The fields of an ``Efficiency`` that set its GEMM curve."""
    return (eff.compute, eff.memory, eff.sharpness, eff.tile_m, eff.tile_n, eff.wave_alpha, eff.gemm_latency)


def _dense_gemms(m: ModelSpec, tp: int) -> tuple[tuple[float, float, int], ...]:
    """(N, K, launches over all layers) of a GQA model's dense GEMMs on one shard: the attention
    projections, the dense layers' MLPs, the MoE layers' shared experts and routers (the routed
    experts are priced in ``CostModel._experts``); each layer's shapes as ``gemm_shapes``."""
    h, layers, moe = m.hidden_size, m.num_layers, m.num_moe_layers
    q = m.num_heads * m.dim_per_head / tp
    kv = m.kv_heads_per_shard(tp) * m.dim_per_head
    qkv, out, up, down = gemm_shapes(h, q, kv, m.intermediate_size / tp, m.gated_mlp)
    # MLA's projections are priced with its block (``CostModel._mla_projections``)
    shapes: list[tuple[float, float, int]] = [] if m.is_mla else [(*qkv, layers), (*out, layers)]
    if layers > moe:
        shapes += [(*up, layers - moe), (*down, layers - moe)]
    if moe and m.shared_intermediate_size:
        *_, shared_up, shared_down = gemm_shapes(h, q, kv, m.shared_intermediate_size / tp, m.gated_mlp)
        shapes += [(*shared_up, moe), (*shared_down, moe)]
    if moe:
        shapes.append((m.num_experts, h, moe))  # the router, replicated on every rank
    return tuple(shapes)


def _dense_gemm_groups(m: ModelSpec) -> tuple[str, ...]:
    """The group (module_formats.py) of each entry of ``_dense_gemms``, in its order."""
    groups: list[str] = [] if m.is_mla else ["attention", "attention"]
    moe = m.num_moe_layers
    if m.num_layers > moe:
        groups += ["dense_mlp", "dense_mlp"]
    if moe and m.shared_intermediate_size:
        groups += ["shared_experts", "shared_experts"]
    if moe:
        groups.append("router")
    return tuple(groups)


def _dense_inputs_per_token(m: ModelSpec, tp: int) -> float:
    """Input elements (K) of one token's row across every layer's dense GEMMs, per shard: the
    attention projections, the dense MLPs and the shared experts (the routed experts' own
    quantization is in the fused MoE kernel's fitted figures)."""
    h = m.hidden_size
    heads = m.num_heads / tp
    if m.is_mla:
        q = (h + m.q_lora_rank) if m.q_lora_rank else h
        attention = q + (h + m.kv_lora_rank) + heads * m.v_head_dim
    else:
        attention = h + heads * m.dim_per_head
    moe = m.num_moe_layers
    shared = m.shared_intermediate_size / tp
    return (
        m.num_layers * attention
        + (m.num_layers - moe) * (h + m.intermediate_size / tp)
        + moe * ((h + shared) if shared else 0.0)
    )


def _dense_io_per_token(m: ModelSpec, tp: int) -> float:
    """``_gemm_io_per_token`` summed over the layers of an MoE or MLA model: its attention
    projections, the dense MLPs of its dense layers and the shared experts of its MoE layers
    (the routed experts' rows are priced in ``CostModel._experts``)."""
    h = m.hidden_size
    if m.is_mla:
        attention = _mla_io_per_token(m, tp)
    else:
        d = m.dim_per_head
        qw = m.num_heads * d / tp
        attention = (h + qw + 2 * m.kv_heads_per_shard(tp) * d) + (qw + h)

    def mlp(inter: float) -> float:
        return (h + (2 if m.gated_mlp else 1) * inter) + (inter + h) if inter else 0.0

    moe = m.num_moe_layers
    shared = m.shared_intermediate_size / tp
    return (
        m.num_layers * attention
        + (m.num_layers - moe) * mlp(m.intermediate_size / tp)
        + moe * (mlp(shared) + h + m.num_experts)  # the router reads hidden, writes E logits
    )
