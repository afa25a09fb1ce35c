"""Write a randomly initialised model directory in exactly Hugging Face's format — nothing downloaded.

A directory holds ``config.json``, ``generation_config.json``, ``model.safetensors`` and a byte-level
BPE tokenizer (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``) trained
with the ``tokenizers`` library on the English-like corpus the package ships
(``tailserve/data/corpus.txt``). ``transformers``' ``AutoModelForCausalLM`` and ``AutoTokenizer``
load it unchanged, so the same weights can be checked against Hugging Face's own model.

Weights are initialised like Hugging Face's ``_init_weights``: every matrix normal(0, 0.02), RMSNorm
weights one; biases are drawn too (Hugging Face zeroes them) so a model that ignored them would
be caught. Same preset, overrides and seed -> identical bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tailserve.executors.pytorch.loader import DTYPES, ModelConfig, expected_tensor_shapes

# The MoE presets' shared shapes (Mixtral's layout; the Qwen3-MoE preset adds its own fields).
_TINY_MOE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 8192,
    "max_position_embeddings": 2048,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}

# Shapes only; head_dim defaults to hidden_size // num_attention_heads.
PRESETS: dict[str, dict[str, Any]] = {
    # The peer-engine reference model (../shared/reference/peer-engines-cpu.md): 20,976,128 params.
    "tiny": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 8192,
        "max_position_embeddings": 2048,
    },
    # Large enough that compute, not Python, dominates on a CPU: 101,468,928 params.
    "small": {
        "hidden_size": 768,
        "intermediate_size": 2304,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "vocab_size": 12288,
        "max_position_embeddings": 4096,
    },
    # Mixtral layout: every layer a sparse MoE block of 8 experts, 2 per token: 1,886,784 params.
    "tiny-moe": _TINY_MOE,
    # Qwen3-MoE layout: q/k norms, 8 experts of 64, top-2 renormalised, layer 1 dense.
    "tiny-qwen3-moe": {
        **_TINY_MOE,
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
    },
}
# The architecture a preset is written as unless one is given.
PRESET_ARCHITECTURES = {"tiny-moe": "mixtral", "tiny-qwen3-moe": "qwen3_moe"}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
MOE_ARCHITECTURES = ("mixtral", "qwen3_moe")
# MoE fields a dense preset written as a MoE architecture gets (a MoE preset sets its own).
_MOE_DEFAULTS: dict[str, Any] = {
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": None,  # Qwen3-MoE; None: intermediate_size
    "norm_topk_prob": False,  # Qwen3-MoE (Mixtral always renormalises)
    "decoder_sparse_step": 1,  # Qwen3-MoE
    "mlp_only_layers": [],  # Qwen3-MoE
}
_DEFAULTS: dict[str, Any] = {
    "head_dim": None,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "attention_bias": False,  # Llama only; Qwen2 always has q/k/v biases
    "mlp_bias": False,  # Llama only
    "sliding_window": None,  # Mistral / Qwen2
}
INITIALIZER_RANGE = 0.02
# Token ids fixed by the tokenizer's training order; the chat template uses ChatML markers.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID, IM_END_ID = 1, 2, 4
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus.txt"


def model_config(
    preset: str = "tiny", architecture: str | None = None, dtype: str = "bfloat16", **overrides: Any
) -> ModelConfig:
    """The ``ModelConfig`` that ``init_model`` with the same arguments writes (``architecture``
    None: the preset's, ``PRESET_ARCHITECTURES``, else llama)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    architecture = architecture or PRESET_ARCHITECTURES.get(preset, "llama")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; known: {', '.join(ARCHITECTURES)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    moe = architecture in MOE_ARCHITECTURES
    if not moe and preset in PRESET_ARCHITECTURES:
        raise ValueError(f"preset {preset!r} is a mixture-of-experts model: use a MoE architecture")
    fields = {**PRESETS[preset], **_DEFAULTS}
    if moe:
        fields = {**_MOE_DEFAULTS, **fields}
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"unknown config field(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    fields.update(overrides)
    _check_types(fields)
    if fields["num_attention_heads"] % fields["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if fields["head_dim"] is None:
        if fields["hidden_size"] % fields["num_attention_heads"]:
            raise ValueError("hidden_size must be divisible by num_attention_heads (or give head_dim)")
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if fields["head_dim"] % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {fields['head_dim']}")
    model_type = architecture
    if model_type != "llama" and (fields["attention_bias"] or fields["mlp_bias"]):
        raise ValueError("attention_bias and mlp_bias are Llama options (Qwen2 always has q/k/v biases)")
    if model_type == "llama" and fields["sliding_window"] is not None:
        raise ValueError("sliding_window is a Mistral / Qwen2 option")
    attention_bias = model_type == "qwen2" or fields["attention_bias"]
    moe_fields: dict[str, Any] = {}
    if moe:
        moe_fields = _moe_fields(model_type, fields)
    return ModelConfig(
        architecture=ARCHITECTURES[architecture],
        model_type=model_type,
        vocab_size=fields["vocab_size"],
        hidden_size=fields["hidden_size"],
        intermediate_size=fields["intermediate_size"],
        num_hidden_layers=fields["num_hidden_layers"],
        num_attention_heads=fields["num_attention_heads"],
        num_key_value_heads=fields["num_key_value_heads"],
        head_dim=fields["head_dim"],
        rms_norm_eps=float(fields["rms_norm_eps"]),
        rope_theta=float(fields["rope_theta"]),
        rope_scaling=dict(fields["rope_scaling"]) if fields["rope_scaling"] else None,
        max_position_embeddings=fields["max_position_embeddings"],
        tie_word_embeddings=fields["tie_word_embeddings"],
        attention_bias=attention_bias,
        bos_token_id=BOS_ID,
        eos_token_ids=(EOS_ID, IM_END_ID),
        torch_dtype=dtype,
        name=preset,
        o_proj_bias=model_type == "llama" and attention_bias,
        mlp_bias=fields["mlp_bias"],
        sliding_window=fields["sliding_window"],
        qk_norm=model_type == "qwen3_moe",
        **moe_fields,
    )


def _moe_fields(model_type: str, fields: dict[str, Any]) -> dict[str, Any]:
    """A MoE ``ModelConfig``'s expert fields from the preset's (checked as the loader checks them)."""
    experts, top_k, layers = (
        fields["num_local_experts"],
        fields["num_experts_per_tok"],
        fields["num_hidden_layers"],
    )
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok {top_k} is more than num_local_experts {experts}")
    if model_type == "mixtral":
        extra = {k for k in ("moe_intermediate_size", "norm_topk_prob", "mlp_only_layers") if fields[k]}
        if extra or fields["decoder_sparse_step"] != 1:
            raise ValueError(
                "moe_intermediate_size, norm_topk_prob, decoder_sparse_step and mlp_only_layers are Qwen3-MoE options"
            )
        return {
            "num_experts": experts,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": fields["intermediate_size"],
            "norm_topk_prob": True,
            "moe_layers": tuple(range(layers)),
        }
    dense, step = fields["mlp_only_layers"], fields["decoder_sparse_step"]
    if not all(isinstance(i, int) and 0 <= i < layers for i in dense):
        raise ValueError(f"mlp_only_layers must be layer indices below {layers}, got {dense!r}")
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": fields["moe_intermediate_size"] or fields["intermediate_size"],
        "norm_topk_prob": fields["norm_topk_prob"],
        "moe_layers": tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
    }


def _check_types(fields: dict[str, Any]) -> None:
    def positive_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    for key, value in fields.items():
        if key in ("rms_norm_eps", "rope_theta"):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
            expected = "a positive number"
        elif key == "mlp_only_layers":
            ok = isinstance(value, list) and all(positive_int(v) or v == 0 for v in value)
            expected = "a list of layer indices"
        elif key in ("tie_word_embeddings", "attention_bias", "mlp_bias", "norm_topk_prob"):
            ok, expected = isinstance(value, bool), "true or false"
        elif key == "rope_scaling":
            ok = value is None or (isinstance(value, dict) and isinstance(value.get("rope_type"), str))
            expected = 'null or an object with "rope_type"'
        elif key in ("head_dim", "sliding_window", "moe_intermediate_size"):
            ok, expected = value is None or positive_int(value), "a positive integer or null"
        else:
            ok, expected = positive_int(value), "a positive integer"
        if not ok:
            raise ValueError(f"{key} must be {expected}, got {value!r}")


def config_json(config: ModelConfig) -> dict[str, Any]:
    """``config.json`` with Hugging Face's keys, readable by transformers 4.x and 5.x alike."""
    rope_parameters = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling:
        rope_parameters = {**config.rope_scaling, "rope_theta": config.rope_theta}
    out: dict[str, Any] = {
        "architectures": [config.architecture],
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": INITIALIZER_RANGE,
        "rms_norm_eps": config.rms_norm_eps,
        # transformers 5.x reads rope_parameters; 4.x reads rope_theta and rope_scaling.
        "rope_parameters": rope_parameters,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "attention_dropout": 0.0,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": EOS_ID,
        "use_cache": True,
        "torch_dtype": config.torch_dtype,
        "dtype": config.torch_dtype,
    }
    if config.model_type == "llama":
        out["attention_bias"] = config.attention_bias
        out["mlp_bias"] = config.mlp_bias
    else:
        out["sliding_window"] = config.sliding_window
    if config.model_type == "qwen2":
        out["use_sliding_window"] = config.sliding_window is not None
        out["max_window_layers"] = 0 if config.sliding_window is not None else config.num_hidden_layers
    if config.model_type == "mixtral":
        out["num_local_experts"] = config.num_experts
        out["num_experts_per_tok"] = config.num_experts_per_tok
        out["router_jitter_noise"] = 0.0
    if config.model_type == "qwen3_moe":
        dense = [i for i in range(config.num_hidden_layers) if i not in config.moe_layers]
        out["attention_bias"] = config.attention_bias
        out["use_sliding_window"] = config.sliding_window is not None
        out["num_experts"] = config.num_experts
        out["num_experts_per_tok"] = config.num_experts_per_tok
        out["moe_intermediate_size"] = config.moe_intermediate_size
        out["norm_topk_prob"] = config.norm_topk_prob
        out["decoder_sparse_step"] = 1
        out["mlp_only_layers"] = dense  # every other layer sparse at step 1
    return out


def random_state_dict(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Hugging Face-style random weights in ``config.torch_dtype``, drawn in a fixed order."""
    generator = torch.Generator().manual_seed(seed)
    dtype = DTYPES[config.torch_dtype]
    state: dict[str, torch.Tensor] = {}
    for name, shape in expected_tensor_shapes(config).items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape)
        else:
            tensor = torch.empty(shape).normal_(0.0, INITIALIZER_RANGE, generator=generator)
        state[name] = tensor.to(dtype).contiguous()
    return state


def train_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE (GPT-2 / Llama-3 style) with ``vocab_size`` tokens, trained on the corpus."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size must be >= {minimum} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(CORPUS)], trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"vocab_size {vocab_size}: the shipped corpus supports at most {tokenizer.get_vocab_size()} tokens"
        )
    # Prepend BOS like Llama 3's tokenizer.json does; the post-processor is what adds it, for us and for HF.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL_TOKENS[BOS_ID]} $A",
        pair=f"{SPECIAL_TOKENS[BOS_ID]} $A {SPECIAL_TOKENS[BOS_ID]} $B",
        special_tokens=[(SPECIAL_TOKENS[BOS_ID], BOS_ID)],
    )
    return tokenizer


def _tokenizer_files(config: ModelConfig) -> dict[str, dict[str, Any]]:
    added = {
        str(i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL_TOKENS)
    }
    names = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **names,
        "pad_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }
    special_tokens_map = {**names, "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}
    return {"tokenizer_config.json": tokenizer_config, "special_tokens_map.json": special_tokens_map}


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def init_model(
    out_dir: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    dtype: str = "bfloat16",
    architecture: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a random model of ``preset`` (with config ``overrides``) to ``out_dir``; return the path.

    ``out_dir`` must be missing or empty. Raises ``ValueError`` for an unknown preset, architecture,
    dtype or config field, or a shape the architecture cannot have.
    """
    config = model_config(preset, architecture, dtype, **overrides)
    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: already exists and is not an empty directory")
    tokenizer = train_tokenizer(config.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config_json(config))
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)},
    )
    save_file(random_state_dict(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    for name, payload in _tokenizer_files(config).items():
        _write_json(out / name, payload)
    return out


def cache_dir() -> Path:
    """Where default models live: ``$TAILSERVE_CACHE/models``, else ``~/.cache/tailserve/models``."""
    base = os.environ.get("TAILSERVE_CACHE")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "tailserve") / "models"


def default_model_dir(preset: str = "tiny") -> Path:
    """The cached model of ``preset`` (seed 0, bfloat16, Llama), created on first use.

    Safe when several processes race: each writes a private temporary directory and renames it into
    place; the first rename wins and the others discard their copy. A directory at the final path is
    therefore always complete.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    final = cache_dir() / preset
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=final.parent))
    try:
        init_model(tmp, preset)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
