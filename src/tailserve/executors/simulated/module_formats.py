"""Per-module-group weight formats: which linear layers of a quantized checkpoint keep a higher
precision.

Real checkpoints do not quantize every linear layer. NVIDIA's DeepSeek-R1 NVFP4 checkpoint as
MLPerf v5.1 ran it leaves MLA's projections (``fused_a`` = q_a + kv_a, ``q_b_proj``,
``kv_b_proj``), the router (``mlp.gate``) and the LM head in bf16
(mlcommons/inference_results_v5.1 ``closed/NVIDIA/code/deepseek-r1/tensorrt/hf_quant_config.json``
lines 10-490 @965182b0); llm-compressor FP8 checkpoints list their routers and LM head in
``quantization_config.ignore``. A ``ModelSpec`` names such groups in ``module_dtypes``; every
other group takes the spec's ``weight_dtype`` (``expert_dtype`` for the routed experts), so
``--quantization`` moves the quantized groups and leaves the excluded ones where the checkpoint
keeps them.

The groups, as the cost model prices them:

- ``attention``: q, k, v, o of a GQA layer; an MLA layer's output projection ``o_proj``;
- ``mla``: an MLA layer's other projections (q_a, q_b, kv_a with the RoPE key, kv_b);
- ``dense_mlp``: the MLPs of dense layers (a dense model's every layer, DeepSeek's first three);
- ``experts``: the routed experts; ``shared_experts``: the always-on experts of MoE layers;
- ``router``: the MoE layers' gate (hidden x num_experts);
- ``lm_head``: always the activation format here (the engines' LM head of a quantized checkpoint is
  bf16 in every checkpoint read; a modelopt one that omits it from ``exclude_modules`` would
  have vLLM quantize it: not modelled).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tailserve.executors.simulated.precision import get_precision

if TYPE_CHECKING:
    from tailserve.executors.simulated.model_spec import ModelSpec

GROUPS = ("attention", "mla", "dense_mlp", "experts", "shared_experts", "router", "lm_head")
# The groups a checkpoint may keep in another format (the LM head is the activations' already).
OVERRIDABLE = GROUPS[:-1]


def check_module_dtypes(spec: ModelSpec) -> None:
    """ValueError naming the model and the entry for an unknown group or format, a group named
    twice, or a group the model does not have."""
    seen: set[str] = set()
    for entry in spec.module_dtypes:
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise ValueError(f"model {spec.name}: module_dtypes entries are (group, format), got {entry!r}")
        group, fmt = entry
        if group not in OVERRIDABLE:
            raise ValueError(
                f"model {spec.name}: module_dtypes group {group!r} unknown; known: {', '.join(OVERRIDABLE)}"
            )
        if group in seen:
            raise ValueError(f"model {spec.name}: module_dtypes names {group!r} twice")
        seen.add(group)
        try:
            get_precision(fmt)
        except ValueError as error:
            raise ValueError(f"model {spec.name}: module_dtypes {group}: {error}") from None
        if group_params(spec, 1)[group] == 0:
            raise ValueError(
                f"model {spec.name}: module_dtypes names {group!r}, which this model has none of"
            )


def activation_dtype(spec: ModelSpec) -> str:
    return "fp32" if spec.dtype_bytes == 4 else "bf16"


def group_dtype(spec: ModelSpec, group: str) -> str:
    """The format a group's weights are stored and multiplied in (``precision.py``'s names)."""
    override = dict(spec.module_dtypes).get(group)
    if override:
        return get_precision(override).name
    if group == "lm_head":
        return activation_dtype(spec)
    if group == "experts" and spec.expert_dtype:
        return get_precision(spec.expert_dtype).name
    return get_precision(spec.weight_dtype).name if spec.weight_dtype else activation_dtype(spec)


def group_dtypes(spec: ModelSpec) -> dict[str, str]:
    """Every group the model has, with its format (``tailserve cost --json``'s ``weight_formats``)."""
    params = group_params(spec, 1)
    return {g: group_dtype(spec, g) for g in GROUPS if params[g]}


def group_params(spec: ModelSpec, tp: int, dp: int = 1) -> dict[str, float]:
    """Parameters of each group on one GPU at TP ``tp`` (the routed experts over ``tp x dp``
    GPUs; MLA's down-projections whole on every rank, as ``ModelSpec.dense_matmul_params_per_shard``;
    the router sliced by ``tp`` as ``num_dense_matmul_params`` counts it). The groups other than
    ``experts`` and ``lm_head`` sum to ``dense_matmul_params_per_shard(tp)``."""
    m, h, layers = spec, spec.hidden_size, spec.num_layers
    moe = m.num_moe_layers
    if m.is_mla:
        o_proj = m.num_heads * m.v_head_dim * h
        attention = layers * o_proj / tp
        mla = layers * (m.attention_params_per_shard(tp) - o_proj / tp)
    else:
        attention, mla = layers * m.attention_params_per_layer / tp, 0.0
    return {
        "attention": attention,
        "mla": mla,
        "dense_mlp": (layers - moe) * m.dense_mlp_params / tp,
        "experts": m.num_expert_params / (tp * dp),
        "shared_experts": moe * 3 * h * m.shared_intermediate_size / tp,
        "router": moe * h * m.num_experts / tp,
        "lm_head": m.vocab_size * h / tp,
    }


def dense_bytes_per_shard(spec: ModelSpec, tp: int) -> float:
    """Bytes of the dense matrices (every group but the routed experts and the LM head) on one
    TP rank, each group at its own format."""
    params = group_params(spec, tp)
    return sum(
        params[g] * get_precision(group_dtype(spec, g)).bytes
        for g in GROUPS
        if g not in ("experts", "lm_head")
    )
