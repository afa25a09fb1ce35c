"""The cost model's dense-GEMM constants when a checkpoint keeps some groups of linear layers in
another format (``ModelSpec.module_dtypes``, ``module_formats.py``).

With one format the layer join is ``join(pad(tokens) * flops / rate, (weights + tokens * io) /
byte_rate)``. With several, each group's FLOPs run at its own format's tensor-core rate and its
weights stream at its own size (and its format's fitted memory factor): the join's compute term
is ``pad(tokens) * sum_g flops_g / rate_g`` and its weight term ``sum_g bytes_g / byte_rate_g``,
one join still (the groups' GEMMs of a layer overlap no more than one format's do). It reduces to
the one-format expression when every group shares a format. The activations and KV writes stay
at the quantized format's byte rate, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from tailserve.executors.simulated.hardware import Hardware
from tailserve.executors.simulated.model_spec import ModelSpec
from tailserve.executors.simulated.module_formats import group_dtype, group_params
from tailserve.executors.simulated.precision import get_precision

DENSE_GROUPS = ("attention", "mla", "dense_mlp", "shared_experts", "router")
MLA_BLOCK_GROUPS = ("attention", "mla")  # an MLA layer's projections, priced with its block


@dataclass(frozen=True, slots=True)
class FormatRates:
    peak: float  # FLOP/s of the format's tensor-core math at 100%
    flops_rate: float  # FLOP/s a GEMM in this format reaches (efficiency and fitted factor)
    byte_rate: float  # bytes/s its weights stream at


def format_rates(fmt: str, hw: Hardware, compute_eff: float, byte_rate: float) -> FormatRates:
    """A weight format's rates as ``CostModel._init_formats`` sets the quantized one's."""
    prec = get_precision(fmt)
    fc, fm = hw.gemm.factors_for(prec.name) if hw.gemm else (1.0, 1.0)
    peak = hw.peak_for(prec.compute)
    return FormatRates(peak, peak * compute_eff * fc, byte_rate * fm)


@dataclass(frozen=True, slots=True)
class GroupTerms:
    """Seconds per token and seconds of weight reads of the dense GEMMs, summed over groups."""

    layer_compute_s: float  # per token: the layer join's groups at their rates
    layer_weight_s: float  # the layer join's weights at their byte rates
    layer_weight_bytes: float
    mla_compute_s: float  # per token: MLA's projections (0 unless priced with the MLA block)
    mla_weight_s: float
    mla_weight_bytes: float
    peak_s: float  # per token: every dense group at its format's peak (the roofline)
    quantized_inputs: float  # input elements per token of the groups in the quantized format

    @staticmethod
    def of(
        m: ModelSpec, hw: Hardware, tp: int, compute_eff: float, byte_rate: float, mla_apart: bool
    ) -> GroupTerms:
        params = group_params(m, tp)
        # the format whose kernels quantize their inputs (GemmCurve.quant_bytes): the weights'
        quantized = get_precision(m.weight_dtype).name if m.weight_dtype else ""
        inputs = dense_inputs_by_group(m, tp)
        sums = {"layer": [0.0, 0.0, 0.0], "mla": [0.0, 0.0, 0.0]}
        peak_s = quantized_inputs = 0.0
        for g in DENSE_GROUPS:
            if not params[g]:
                continue
            fmt = group_dtype(m, g)
            rates = format_rates(fmt, hw, compute_eff, byte_rate)
            weight_bytes = params[g] * get_precision(fmt).bytes
            part = sums["mla" if mla_apart and g in MLA_BLOCK_GROUPS else "layer"]
            part[0] += 2.0 * params[g] / rates.flops_rate
            part[1] += weight_bytes / rates.byte_rate
            part[2] += weight_bytes
            peak_s += 2.0 * params[g] / rates.peak
            if fmt == quantized:
                quantized_inputs += inputs[g]
        return GroupTerms(*sums["layer"], *sums["mla"], peak_s, quantized_inputs)


def dense_inputs_by_group(m: ModelSpec, tp: int) -> dict[str, float]:
    """Input elements (K) of one token's row across every layer's dense GEMMs per group, per shard
    (``cost_model._dense_inputs_per_token`` split by group; the router's are not counted there
    either: its input is not quantized by the kernels that quantize the others')."""
    h, layers, moe = m.hidden_size, m.num_layers, m.num_moe_layers
    heads = m.num_heads / tp
    if m.is_mla:
        attention = layers * heads * m.v_head_dim
        q = (h + m.q_lora_rank) if m.q_lora_rank else h
        mla = layers * (q + h + m.kv_lora_rank)
    else:
        attention, mla = layers * (h + heads * m.dim_per_head), 0.0
    shared = m.shared_intermediate_size / tp
    return {
        "attention": attention,
        "mla": mla,
        "dense_mlp": (layers - moe) * (h + m.intermediate_size / tp),
        "shared_experts": moe * ((h + shared) if shared else 0.0),
        "router": 0.0,
    }
