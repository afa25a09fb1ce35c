"""Every catalog model read from its own public config.json through ``load_hf_config`` gives the
catalog entry (same fields, same prices); one config per supported ``model_type``; parameter
counts against the published ones; unknown families refused in one line."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from tailserve.cli import main
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.hf_config import READERS
from tailserve.executors.simulated.models import MODELS, ModelSpec, load_hf_config

# The public config.json of each model (the fields that matter, copied as published; a few
# unrelated ones kept to show the reader ignores them).
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def _llama(
    hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, ctx: int, **extra: Any
) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "max_position_embeddings": ctx,
        "model_type": "llama",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "vocab_size": vocab,
        **extra,
    }


def _qwen3(hidden: int, inter: int, layers: int, heads: int, kv: int, **extra: Any) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "max_position_embeddings": 40960,
        "max_window_layers": layers,
        "model_type": "qwen3",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_sliding_window": False,
        "vocab_size": 151936,
        **extra,
    }


def _qwen3_moe(hidden: int, inter: int, moe: int, layers: int, heads: int) -> dict:
    return {
        **_qwen3(hidden, inter, layers, heads, 4),
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": moe,
        "norm_topk_prob": True,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }


def _qwen2(hidden: int, inter: int, layers: int, heads: int, kv: int, window_layers: int) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "max_position_embeddings": 32768,
        "max_window_layers": window_layers,
        "model_type": "qwen2",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_sliding_window": False,
        "vocab_size": 152064,
    }


def _gpt_oss(layers: int, experts: int) -> dict:
    return {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2880,
        "initial_context_length": 4096,
        "intermediate_size": 2880,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": layers,
        "num_key_value_heads": 8,
        "num_local_experts": experts,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 201088,
    }


def _llama4(experts: int, step: int, ctx: int, rope_factor: float) -> dict:
    return {
        "architectures": ["Llama4ForConditionalGeneration"],
        "model_type": "llama4",
        "text_config": {
            "attention_bias": False,
            "attention_chunk_size": 8192,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 5120,
            "interleave_moe_layer_step": step,
            "intermediate_size": 8192,
            "intermediate_size_mlp": 16384,
            "max_position_embeddings": ctx,
            "model_type": "llama4_text",
            "moe_layers": list(range(step - 1, 48, step)),
            "num_attention_heads": 40,
            "num_experts_per_tok": 1,
            "num_hidden_layers": 48,
            "num_key_value_heads": 8,
            "num_local_experts": experts,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "factor": rope_factor,
                "high_freq_factor": 1.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "rope_theta": 500000.0,
            "torch_dtype": "bfloat16",
            "use_qk_norm": True,
            "vocab_size": 202048,
        },
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vision_config": {"hidden_size": 1408, "num_hidden_layers": 34, "model_type": "llama4_vision_model"},
    }


_FP8_BLOCKS = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


def _deepseek(
    model_type: str, heads: int, experts: int, dense: int, vocab: int, ctx: int, **extra: Any
) -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "first_k_dense_replace": dense,
        "hidden_act": "silu",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "kv_lora_rank": 512,
        "max_position_embeddings": ctx,
        "model_type": model_type,
        "moe_intermediate_size": 2048,
        "moe_layer_freq": 1,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": heads,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 61,
        "num_key_value_heads": heads,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "quantization_config": _FP8_BLOCKS,
        "rms_norm_eps": 1e-06,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "v_head_dim": 128,
        "vocab_size": vocab,
        **extra,
    }


_DEEPSEEK_V3 = _deepseek(
    "deepseek_v3",
    128,
    256,
    3,
    129280,
    163840,
    n_group=8,
    topk_group=4,
    num_nextn_predict_layers=1,
    routed_scaling_factor=2.5,
)


def _r1_fp4_excluded(o_proj: bool) -> list[str]:
    """NVIDIA's R1 NVFP4 exclude_modules in the shape of MLPerf v5.1's hf_quant_config.json
    (mlcommons/inference_results_v5.1 closed/NVIDIA/code/deepseek-r1/tensorrt/hf_quant_config.json
    @965182b0: per layer its norms, fused_a, q_proj, q_b_proj, kv_a_layernorm, kv_b_proj; mlp.gate
    of the MoE layers; lm_head, embed_tokens, norm, the MTP layer "model.layers.61*"). ``o_proj``:
    the first checkpoint's WO_GEMM, bf16 (its README.md:34), written here as one more entry."""
    names = ["lm_head", "model.embed_tokens", "model.norm", "model.layers.61*"]
    for i in range(61):
        p = f"model.layers.{i}"
        names += [f"{p}.input_layernorm", f"{p}.post_attention_layernorm"]
        attn = ("fused_a", "q_proj", "q_b_proj", "kv_a_layernorm", "kv_b_proj") + (
            ("o_proj",) if o_proj else ()
        )
        names += [f"{p}.self_attn.{n}" for n in attn]
        if i >= 3:
            names.append(f"{p}.mlp.gate")
    return names


# The catalog entries whose format is in a hf_quant_config.json beside config.json.
HF_QUANT_CONFIGS = {
    name: {
        "producer": {"name": "modelopt", "version": "0.23.0"},
        "quantization": {
            "quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
            "exclude_modules": _r1_fp4_excluded(o_proj=name == "DeepSeek-R1-FP4"),
        },
    }
    for name in ("DeepSeek-R1-FP4", "DeepSeek-R1-FP4-v2")
}  # fmt: skip


CATALOG_CONFIGS: dict[str, dict] = {
    # meta-llama/Llama-2-*-hf, Meta-Llama-3-*, Llama-3.1-*
    "Llama-2-7B": _llama(4096, 11008, 32, 32, 32, 32000, 4096, torch_dtype="float16"),
    "Llama-2-13B": _llama(5120, 13824, 40, 40, 40, 32000, 4096, torch_dtype="float16"),
    "Llama-2-70B": _llama(8192, 28672, 80, 64, 8, 32000, 4096, torch_dtype="float16"),
    "Llama-3-8B": _llama(4096, 14336, 32, 32, 8, 128256, 8192, rope_theta=500000.0, torch_dtype="bfloat16"),
    "Llama-3-70B": _llama(8192, 28672, 80, 64, 8, 128256, 8192, rope_theta=500000.0, torch_dtype="bfloat16"),
    "Llama-3.1-8B": LLAMA_3_1_8B,
    "Llama-3.1-70B": {**LLAMA_3_1_8B, "hidden_size": 8192, "intermediate_size": 28672,
                      "num_attention_heads": 64, "num_hidden_layers": 80},
    # 01-ai/Yi-34B: a Llama architecture
    "Yi-34B": _llama(7168, 20480, 60, 56, 8, 64000, 4096, rope_theta=5000000.0, torch_dtype="bfloat16"),
    # mistralai/Mistral-7B-v0.1 (sliding_window: see test_mistral_window_is_read_but_not_in_the_catalog)
    "Mistral-7B": {
        "architectures": ["MistralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "vocab_size": 32000,
    },
    # Qwen/Qwen2.5-7B-Instruct, Qwen2.5-72B-Instruct
    "Qwen2.5-7B": _qwen2(3584, 18944, 28, 28, 4, 28),
    "Qwen2.5-72B": _qwen2(8192, 29568, 80, 64, 8, 70),
    # tiiuae/falcon-180B (tie_word_embeddings: see test_falcon_180b_config_ties_its_embeddings)
    "Falcon-180B": {
        "alibi": False, "architectures": ["FalconForCausalLM"], "bias": False, "hidden_size": 14848,
        "layer_norm_epsilon": 1e-05, "model_type": "falcon", "multi_query": True,
        "new_decoder_architecture": True, "num_attention_heads": 232, "num_hidden_layers": 80,
        "num_kv_heads": 8, "parallel_attn": True, "torch_dtype": "bfloat16", "vocab_size": 65024,
    },
    # facebook/opt-13b
    "OPT-13B": {
        "activation_function": "relu", "architectures": ["OPTForCausalLM"], "do_layer_norm_before": True,
        "ffn_dim": 20480, "hidden_size": 5120, "max_position_embeddings": 2048, "model_type": "opt",
        "num_attention_heads": 40, "num_hidden_layers": 40, "torch_dtype": "float16", "vocab_size": 50272,
        "word_embed_proj_dim": 5120,
    },
    # Qwen/Qwen3-8B, Qwen3-32B, Qwen3-30B-A3B, Qwen3-235B-A22B
    "Qwen3-8B": _qwen3(4096, 12288, 36, 32, 8),
    "Qwen3-32B": _qwen3(5120, 25600, 64, 64, 8),
    "Qwen3-30B-A3B": _qwen3_moe(2048, 6144, 768, 48, 32),
    "Qwen3-235B-A22B": _qwen3_moe(4096, 12288, 1536, 94, 64),
    # microsoft/phi-2
    "phi-2": {
        "architectures": ["PhiForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 50256,
        "embd_pdrop": 0.0, "eos_token_id": 50256, "hidden_act": "gelu_new", "hidden_size": 2560,
        "intermediate_size": 10240, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048,
        "model_type": "phi", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
        "partial_rotary_factor": 0.4, "qk_layernorm": False, "rope_scaling": None, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "float16", "vocab_size": 51200,
    },
    # Qwen/Qwen-72B (v1, remote code)
    "Qwen-72B": {
        "architectures": ["QWenLMHeadModel"], "attn_dropout_prob": 0.0, "bf16": False, "fp16": False,
        "fp32": False, "hidden_size": 8192, "intermediate_size": 49152, "kv_channels": 128,
        "layer_norm_epsilon": 1e-06, "max_position_embeddings": 32768, "model_type": "qwen", "no_bias": True,
        "num_attention_heads": 64, "num_hidden_layers": 80, "rotary_emb_base": 1000000, "rotary_pct": 1.0,
        "seq_length": 32768, "tie_word_embeddings": False, "use_dynamic_ntk": False, "use_logn_attn": False,
        "vocab_size": 152064,
    },
    # mistralai/Mixtral-8x7B-v0.1
    "Mixtral-8x7B": {
        "architectures": ["MixtralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
        "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "vocab_size": 32000,
    },
    # openai/gpt-oss-120b, gpt-oss-20b
    "gpt-oss-120b": _gpt_oss(36, 128),
    "gpt-oss-20b": _gpt_oss(24, 32),
    # meta-llama/Llama-4-Scout-17B-16E-Instruct, Llama-4-Maverick-17B-128E-Instruct
    "Llama-4-Scout-17B-16E": _llama4(16, 1, 10485760, 16.0),
    "Llama-4-Maverick-17B-128E": _llama4(128, 2, 1048576, 8.0),
    # deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Instruct
    "DeepSeek-V3": _DEEPSEEK_V3,
    # nvidia/DeepSeek-R1-FP4(-v2): DeepSeek-V3's config.json; the format in hf_quant_config.json
    "DeepSeek-R1-FP4": {k: v for k, v in _DEEPSEEK_V3.items() if k != "quantization_config"},
    "DeepSeek-R1-FP4-v2": {k: v for k, v in _DEEPSEEK_V3.items() if k != "quantization_config"},
    "Kimi-K2": _deepseek(
        "kimi_k2", 64, 384, 1, 163840, 131072, n_group=1, topk_group=1, num_nextn_predict_layers=0,
        routed_scaling_factor=2.827, rope_theta=50000.0,
    ),
}  # fmt: skip

# Where the published config and the (older, golden-corpus-pinned) catalog entry differ on a field
# the cost model does not price differently today: (field, value read from config.json).
KNOWN_DIFFERENCES = {
    # Mistral-7B-v0.1 attends over a 4,096-token window on every layer; the catalog entry predates
    # sliding-window fields (no pricing of windows yet: prefill/decode times are equal).
    "Mistral-7B": {"sliding_window": 4096, "num_sliding_layers": 32},
    # falcon-180B's config.json has no tie_word_embeddings: transformers and vLLM tie; the catalog
    # entry counts an untied LM head (0.97B more weight bytes, golden corpus kept as is).
    "Falcon-180B": {"tie_word_embeddings": True},
}


def _write(tmp_path: Path, cfg: dict, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


def _fields(spec: ModelSpec) -> dict[str, Any]:
    return {f.name: getattr(spec, f.name) for f in fields(spec) if f.name != "name"}


def test_every_catalog_model_has_its_config_here():
    assert sorted(CATALOG_CONFIGS) == sorted(MODELS)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_catalog_entry_is_its_own_config_json(tmp_path, name):
    if name in HF_QUANT_CONFIGS:
        _write(tmp_path, HF_QUANT_CONFIGS[name], "hf_quant_config.json")
    read = load_hf_config(_write(tmp_path, CATALOG_CONFIGS[name]))
    entry = MODELS[name]
    known = KNOWN_DIFFERENCES.get(name, {})
    for field, value in known.items():
        assert getattr(read, field) == value and getattr(entry, field) != value
    if known:
        read = replace(read, **{field: getattr(entry, field) for field in known})
    assert _fields(read) == _fields(entry)
    h200 = get_hardware("h200")
    a, b = CostModel(read, h200), CostModel(entry, h200)
    assert a.prefill_time(4096) == b.prefill_time(4096)
    assert a.prefill_time(2048, 8192) == b.prefill_time(2048, 8192)
    assert a.decode_time(32, 4096) == b.decode_time(32, 4096)
    assert read.kv_bytes_per_token() == entry.kv_bytes_per_token()


@pytest.mark.parametrize("name", sorted(KNOWN_DIFFERENCES))
def test_known_differences_do_not_change_the_step_times(tmp_path, name):
    read = load_hf_config(_write(tmp_path, CATALOG_CONFIGS[name]))
    h200 = get_hardware("h200")
    a, b = CostModel(read, h200, 8), CostModel(MODELS[name], h200, 8)
    assert a.prefill_time(4096) == b.prefill_time(4096)
    assert a.decode_time(32, 4096) == b.decode_time(32, 4096)


# Published parameter counts (billions): total, active. Our count leaves out norms, biases and
# position tables; "active" = the matrices one token multiplies through + embedding + LM head.
PUBLISHED = {
    "DeepSeek-V3": (671, 37),  # without the 14B MTP module (685B on the hub)
    "Kimi-K2": (1000, 32),  # "1T" on the model card (1.03T)
    "Qwen3-235B-A22B": (235, 22),
    "Qwen3-30B-A3B": (30.5, 3.3),
    "Qwen3-8B": (8.2, 8.2),
    "Qwen3-32B": (32.8, 32.8),
    "gpt-oss-120b": (116.83, 5.13),
    "gpt-oss-20b": (20.91, 3.61),
    "Mixtral-8x7B": (46.7, 12.9),
    "Llama-4-Scout-17B-16E": (109, 17),  # the card's 109B includes the vision encoder
    "Llama-4-Maverick-17B-128E": (400, 17),
    "phi-2": (2.7, 2.7),
    "Qwen-72B": (72, 72),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_the_published_ones(name):
    m = MODELS[name]
    total, active = PUBLISHED[name]
    mine_active = m.num_active_params
    if name.startswith("gpt-oss"):
        # OpenAI's active count leaves out the input embedding table (a lookup), keeps the LM head.
        mine_active -= m.vocab_size * m.hidden_size
    assert m.num_params / 1e9 == pytest.approx(total, rel=0.03)
    assert mine_active / 1e9 == pytest.approx(active, rel=0.03)


def test_phi2_and_qwen_v1_are_read_as_their_architectures(tmp_path):
    phi = load_hf_config(_write(tmp_path, CATALOG_CONFIGS["phi-2"]))
    assert not phi.gated_mlp and phi.num_params / 1e9 == pytest.approx(2.7, rel=0.03)
    qwen = load_hf_config(_write(tmp_path, CATALOG_CONFIGS["Qwen-72B"]))
    assert qwen.intermediate_size == 24576 and qwen.gated_mlp
    assert qwen.num_params / 1e9 == pytest.approx(72, rel=0.03)
    assert phi.dtype_bytes == 2 and qwen.num_kv_heads == 64


# One config per supported model_type that has no catalog entry, with its published size.
OTHER_FAMILIES: dict[str, tuple[dict, float, float]] = {
    # Qwen/Qwen1.5-MoE-A2.7B: 14.3B total, 2.7B active
    "qwen2_moe": ({
        "architectures": ["Qwen2MoeForCausalLM"], "decoder_sparse_step": 1, "hidden_size": 2048,
        "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
        "model_type": "qwen2_moe", "moe_intermediate_size": 1408, "norm_topk_prob": False,
        "num_attention_heads": 16, "num_experts": 60, "num_experts_per_tok": 4, "num_hidden_layers": 24,
        "num_key_value_heads": 16, "shared_expert_intermediate_size": 5632, "sliding_window": 32768,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
        "vocab_size": 151936,
    }, 14.3, 2.7),
    # deepseek-ai/DeepSeek-V2: 236B total, 21B active
    "deepseek_v2": ({
        "architectures": ["DeepseekV2ForCausalLM"], "first_k_dense_replace": 1, "hidden_size": 5120,
        "intermediate_size": 12288, "kv_lora_rank": 512, "max_position_embeddings": 163840,
        "model_type": "deepseek_v2", "moe_intermediate_size": 1536, "moe_layer_freq": 1, "n_group": 8,
        "n_routed_experts": 160, "n_shared_experts": 2, "num_attention_heads": 128, "num_experts_per_tok": 6,
        "num_hidden_layers": 60, "num_key_value_heads": 128, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "tie_word_embeddings": False, "topk_group": 3,
        "topk_method": "group_limited_greedy", "torch_dtype": "bfloat16", "v_head_dim": 128,
        "vocab_size": 102400,
    }, 236, 21),
    # microsoft/Phi-3-mini-4k-instruct: 3.8B
    "phi3": ({
        "architectures": ["Phi3ForCausalLM"], "hidden_act": "silu", "hidden_size": 3072,
        "intermediate_size": 8192, "max_position_embeddings": 4096, "model_type": "phi3",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
        "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "sliding_window": 2047, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32064,
    }, 3.8, 3.8),
    # google/gemma-2-9b: 9.24B
    "gemma2": ({
        "architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0,
        "cache_implementation": "hybrid", "final_logit_softcapping": 30.0, "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584,
        "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "gemma2",
        "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "sliding_window": 4096,
        "torch_dtype": "float32", "vocab_size": 256000,
    }, 9.24, 9.24),
    # google/gemma-3-27b-it (text part; the published text_config leaves vocab and context at
    # their defaults): 27B with a 0.4B vision encoder
    "gemma3": ({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {
            "head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
            "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
            "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "torch_dtype": "bfloat16",
        "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model", "num_hidden_layers": 27},
    }, 27.0, 27.0),
    # internlm/internlm2-chat-7b: 7.7B
    "internlm2": ({
        "architectures": ["InternLM2ForCausalLM"], "bias": False, "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "internlm2",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "rope_scaling": {"factor": 2.0, "type": "dynamic"}, "rope_theta": 1000000,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 92544,
    }, 7.7, 7.7),
    # openai-community/gpt2: 124M
    "gpt2": ({
        "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024, "vocab_size": 50257,
    }, 0.124, 0.124),
    # EleutherAI/gpt-neox-20b: 20.6B
    "gpt_neox": ({
        "architectures": ["GPTNeoXForCausalLM"], "hidden_act": "gelu_fast", "hidden_size": 6144,
        "intermediate_size": 24576, "max_position_embeddings": 2048, "model_type": "gpt_neox",
        "num_attention_heads": 64, "num_hidden_layers": 44, "rotary_pct": 0.25, "tie_word_embeddings": False,
        "torch_dtype": "float16", "use_parallel_residual": True, "vocab_size": 50432,
    }, 20.6, 20.6),
}  # fmt: skip


def test_every_model_type_is_tested():
    covered = {cfg["model_type"] for cfg in CATALOG_CONFIGS.values()} | set(OTHER_FAMILIES)
    # text-only spellings of the nested families read by the same readers
    covered |= {"llama4_text", "gemma3_text"}
    assert covered == set(READERS)


@pytest.mark.parametrize("model_type", sorted(OTHER_FAMILIES))
def test_other_families_are_read_to_their_published_size(tmp_path, model_type):
    cfg, total, active = OTHER_FAMILIES[model_type]
    m = load_hf_config(_write(tmp_path, cfg))
    assert m.num_params / 1e9 == pytest.approx(total, rel=0.03)
    assert m.num_active_params / 1e9 == pytest.approx(active, rel=0.03)
    cm = CostModel(m, get_hardware("h200"))
    assert cm.prefill_time(4096) > cm.decode_time(1, 4096) > 0


def test_family_specific_readings(tmp_path):
    read = {
        t: load_hf_config(_write(tmp_path, cfg, f"{t}.json")) for t, (cfg, _, _) in OTHER_FAMILIES.items()
    }
    assert read["qwen2_moe"].shared_intermediate_size == 5632 and read["qwen2_moe"].num_experts == 60
    v2 = read["deepseek_v2"]
    assert v2.is_mla and v2.shared_intermediate_size == 2 * 1536 and v2.first_dense_layers == 1
    assert (read["phi3"].sliding_window, read["phi3"].num_sliding_layers) == (2047, 32)
    assert (read["gemma2"].sliding_window, read["gemma2"].num_sliding_layers) == (4096, 21)
    assert read["gemma2"].tie_word_embeddings and read["gemma2"].dtype_bytes == 4
    g3 = read["gemma3"]
    assert (g3.sliding_window, g3.num_sliding_layers, g3.vocab_size) == (1024, 52, 262208)
    assert not read["gpt2"].gated_mlp and read["gpt2"].intermediate_size == 3072
    assert not read["gpt_neox"].gated_mlp and read["internlm2"].num_kv_heads == 8
    oss = MODELS["gpt-oss-120b"]
    assert (oss.expert_dtype, oss.weight_dtype, oss.num_sliding_layers) == ("mxfp4", "", 18)
    # The text-only spellings of the nested families read the same text fields.
    scout = CATALOG_CONFIGS["Llama-4-Scout-17B-16E"]
    flat = {**scout["text_config"], "tie_word_embeddings": False}
    assert _fields(load_hf_config(_write(tmp_path, flat))) == _fields(MODELS["Llama-4-Scout-17B-16E"])


def test_mistral_window_is_read(tmp_path):
    # transformers' MistralConfig applies a 4,096-token window when the key is absent; null: none.
    base = dict(CATALOG_CONFIGS["Mistral-7B"])
    del base["sliding_window"]
    assert load_hf_config(_write(tmp_path, base)).sliding_window == 4096
    assert load_hf_config(_write(tmp_path, {**base, "sliding_window": None})).num_sliding_layers == 0


@pytest.mark.parametrize(
    ("quantization", "torch_dtype", "expected"),
    [
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "bfloat16", ("fp8", "", "")),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True},
         "float16", ("int4", "", "")),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "float16", ("int8", "", "")),
        ({"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"},
                                        "input_activations": {"num_bits": 8, "type": "float"}}},
          "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "bfloat16", ("fp8_static", "", "fp8")),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "group_size": 128}}}},
         "bfloat16", ("int4", "", "")),
        ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
          "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16}}}},
         "bfloat16", ("nvfp4", "", "")),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8"}, "bfloat16",
         ("nvfp4", "", "fp8")),
    ],
)  # fmt: skip
def test_number_formats_from_quantization_config(tmp_path, quantization, torch_dtype, expected):
    cfg = {**LLAMA_3_1_8B, "quantization_config": quantization, "torch_dtype": torch_dtype}
    m = load_hf_config(_write(tmp_path, cfg))
    assert (m.weight_dtype, m.expert_dtype, m.kv_dtype) == expected


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({**LLAMA_3_1_8B, "model_type": "mamba"}, r"model_type 'mamba' is not supported; supported: llama, mistral"),
        ({k: v for k, v in LLAMA_3_1_8B.items() if k != "model_type"}, r"model_type None is not supported"),
        ({**LLAMA_3_1_8B, "num_local_experts": 8}, r"num_local_experts = 8 is not understood here \(a dense family\)"),
        ({**CATALOG_CONFIGS["Qwen-72B"], "num_experts": 4}, r"num_experts = 4 is not understood"),
        ({**LLAMA_3_1_8B, "kv_lora_rank": 512}, r"kv_lora_rank = 512 is not understood"),
        ({**LLAMA_3_1_8B, "sliding_window": 4096}, r"sliding_window = 4096 is not understood here"),
        ({**CATALOG_CONFIGS["DeepSeek-V3"], "moe_layer_freq": 2}, r"moe_layer_freq other than 1"),
        ({**CATALOG_CONFIGS["Mistral-7B"], "layer_types": ["full_attention"] * 32}, r"layer_types disagrees"),
        ({**CATALOG_CONFIGS["Qwen3-30B-A3B"], "mlp_only_layers": [3, 7]}, r"mlp_only_layers \[3, 7\] is not a dense prefix"),
        ({**CATALOG_CONFIGS["Qwen3-30B-A3B"], "shared_expert_intermediate_size": 512}, r"Qwen3-MoE has no shared expert"),
        ({**LLAMA_3_1_8B, "quantization_config": {"quant_method": "bitsandbytes"}}, r"quant_method 'bitsandbytes' is not read"),
        ({**LLAMA_3_1_8B, "quantization_config": {"quant_method": "mxfp4"}}, r"MXFP4 is read for the routed experts"),
        ({**LLAMA_3_1_8B, "torch_dtype": "float8_e4m3fn"}, r"torch_dtype 'float8_e4m3fn' is not read"),
        ({**LLAMA_3_1_8B, "hidden_size": "4096"}, r"hidden_size must be an integer"),
        ({**LLAMA_3_1_8B, "layer_types": ["sliding_attention"] * 32}, r"layer_types entry 'sliding_attention' is not understood"),
        ({k: v for k, v in CATALOG_CONFIGS["phi-2"].items() if k != "intermediate_size"}, r"missing intermediate_size"),
        ({**CATALOG_CONFIGS["Qwen-72B"], "intermediate_size": 49153}, r"intermediate_size 49153 is odd"),
    ],
)  # fmt: skip
def test_what_a_reader_does_not_understand_is_refused(tmp_path, cfg, message):
    with pytest.raises(ValueError, match=message) as err:
        load_hf_config(_write(tmp_path, cfg))
    assert "\n" not in str(err.value)


def test_unknown_model_type_is_one_cli_error_line(tmp_path, capsys):
    path = _write(tmp_path, {**LLAMA_3_1_8B, "model_type": "rwkv"})
    code = main(["cost", "--model", str(path), "--hardware", "h200"])
    assert code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "model_type 'rwkv' is not supported; supported: llama" in lines[0]


def test_a_catalog_config_prices_through_the_cli(tmp_path, capsys):
    path = _write(tmp_path, CATALOG_CONFIGS["gpt-oss-20b"])
    assert main(["cost", "--model", str(path), "--hardware", "h200"]) == 0
    assert "prefill" in capsys.readouterr().out


def test_models_command_lists_params_and_formats(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 5}
    assert set(MODELS) <= set(rows)
    cells = [c.strip() for c in rows["DeepSeek-V3"].split("│")[1:-1]]
    assert cells[1:3] == ["671.0", "37.6"] and "MLA 512+64" in cells and "fp8_block/=/bf16" in cells
    assert "256/8 +s" in cells
    oss = [c.strip() for c in rows["gpt-oss-120b"].split("│")[1:-1]]
    assert oss[1:3] == ["116.8", "5.7"] and "bf16/mxfp4/bf16" in oss and "GQA 18xSW128" in oss
    assert "bf16/-/bf16" in rows["Llama-3-8B"]
    assert "nvfp4/=/bf16*" in rows["DeepSeek-R1-FP4-v2"]  # *: groups kept in bf16


def test_hub_ids_of_catalog_models_resolve():
    from tailserve.executors.simulated.models import resolve_model_name

    assert resolve_model_name("deepseek-ai/DeepSeek-R1") == "DeepSeek-V3"
    # a same-shapes repository's bare name, as a user types it (MLPerf's deepseek-r1)
    assert resolve_model_name("DeepSeek-R1") == resolve_model_name("deepseek-r1-0528") == "DeepSeek-V3"
    with pytest.raises(ValueError, match="the same shapes as one: DeepSeek-R1, "):
        resolve_model_name("DeepSeek-R2")
    assert resolve_model_name("openai/gpt-oss-120b") == "gpt-oss-120b"
    assert resolve_model_name("mistralai/Mixtral-8x7B-Instruct-v0.1") == "Mixtral-8x7B"
    assert resolve_model_name("meta-llama/Llama-4-Scout-17B-16E-Instruct") == "Llama-4-Scout-17B-16E"
    assert resolve_model_name("moonshotai/Kimi-K2-Instruct") == "Kimi-K2"
    assert resolve_model_name("Qwen/Qwen3-235B-A22B") == "Qwen3-235B-A22B"
    assert resolve_model_name("Qwen/Qwen-72B-Chat") == "Qwen-72B"
