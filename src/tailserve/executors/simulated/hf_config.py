"""A ``ModelSpec`` from a Hugging Face ``config.json``, read per ``model_type``.

Each architecture family has its own small reader (``READERS``: model_type -> reader) that knows
which fields that family's config class defines and what they mean (Qwen v1's
``intermediate_size`` counts both halves of its gated MLP; phi's MLP has two matrices; gpt-oss
keeps its expert width in ``intermediate_size``; Llama 4's dense layers use
``intermediate_size_mlp``). An unknown ``model_type``, or a field a reader does not understand in
its family (an MoE field in a dense family, MLA ranks outside DeepSeek, a sliding-window pattern
where the family has none), is one ``ValueError`` line naming it — nothing is guessed.

Number formats come from ``quantization_config`` and ``torch_dtype`` (``checkpoint_formats.py``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tailserve.executors.simulated.checkpoint_formats import checkpoint_formats
from tailserve.executors.simulated.model_spec import ModelSpec
from tailserve.executors.simulated.quant_exclusions import apply_exclusions

Shape = dict[str, Any]

_MOE_KEYS = (
    "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "experts_per_token",
    "moe_intermediate_size", "n_shared_experts", "shared_expert_intermediate_size",
)  # fmt: skip
_MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
_SLIDING_KEYS = ("sliding_window", "sliding_window_pattern")


class _Fields:
    """One (text) config's fields, read by name; every error names the file and the field."""

    def __init__(self, raw: dict[str, Any], path: Path, model_type: str) -> None:
        self.raw, self.path, self.model_type = raw, path, model_type

    def fail(self, what: str) -> ValueError:
        return ValueError(f"{self.path}: {what} (model_type {self.model_type!r})")

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.raw.get(key)
        if value is None:
            if default is None:
                raise self.fail(f"missing {key}")
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
            raise self.fail(f"{key} must be an integer, got {value!r}")
        return int(value)

    def first_int(self, *keys: str, default: int | None = None) -> int:
        """The first of ``keys`` present (config classes with attribute aliases: Falcon's n_head)."""
        for key in keys:
            if self.has(key):
                return self.integer(key)
        if default is None:
            raise self.fail(f"missing {' / '.join(keys)}")
        return default

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(f"{key} must be true or false, got {value!r}")
        return value

    def refuse(self, keys: tuple[str, ...], why: str) -> None:
        """Fields this family's reader does not understand: an error, never ignored."""
        for key in keys:
            value = self.raw.get(key)
            if value not in (None, 0, [], False):
                raise self.fail(f"{key} = {value!r} is not understood here ({why})")

    def layer_types(self, num_layers: int, sliding: tuple[str, ...] = ()) -> int | None:
        """Sliding layers counted from ``layer_types`` (None: the config has none); any entry
        other than full attention or the family's sliding names is refused."""
        types = self.raw.get("layer_types")
        if types is None:
            return None
        if not isinstance(types, list) or len(types) != num_layers:
            raise self.fail(f"layer_types must list one type per layer ({num_layers})")
        for t in types:
            if t != "full_attention" and t not in sliding:
                raise self.fail(
                    f"layer_types entry {t!r} is not understood here "
                    f"(known: full_attention{''.join(', ' + s for s in sliding)})"
                )
        return sum(1 for t in types if t in sliding)


def _head_dim(f: _Fields, hidden: int, heads: int, key: str = "head_dim") -> int | None:
    """The config's head width, None when it is the default hidden // heads."""
    if not f.has(key):
        return None
    d = f.integer(key)
    return None if d == hidden // heads else d


def _gqa(f: _Fields, *, tie: bool, intermediate: str = "intermediate_size") -> Shape:
    """The fields every Llama-style decoder shares: GQA attention, one MLP width."""
    hidden, heads = f.integer("hidden_size"), f.integer("num_attention_heads")
    return {
        "hidden_size": hidden,
        "num_layers": f.integer("num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": f.integer("num_key_value_heads", heads),
        "intermediate_size": f.integer(intermediate),
        "vocab_size": f.integer("vocab_size"),
        "max_position_embeddings": f.integer("max_position_embeddings"),
        "head_dim": _head_dim(f, hidden, heads),
        "tie_word_embeddings": f.flag("tie_word_embeddings", tie),
    }


def _dense(f: _Fields, sliding: bool = False) -> None:
    f.refuse(_MOE_KEYS, "a dense family")
    f.refuse(_MLA_KEYS, "MLA is read for deepseek_v2 / deepseek_v3 / kimi_k2 only")
    if not sliding:
        f.refuse(_SLIDING_KEYS, "this family has no sliding-window layers")
        if f.has("layer_types"):
            f.layer_types(f.first_int("num_hidden_layers", "n_layer"))


def _window_all_layers(f: _Fields, shape: Shape, default: int | None) -> Shape:
    """Mistral / Mixtral / Phi-3: ``sliding_window`` applies to every layer when it is set and
    shorter than the context (MistralConfig's default when the key is absent: 4096)."""
    window = f.integer("sliding_window") if f.has("sliding_window") else default
    if "sliding_window" in f.raw and f.raw["sliding_window"] is None:
        window = None
    if window and window < shape["max_position_embeddings"]:
        shape.update(sliding_window=window, num_sliding_layers=shape["num_layers"])
    from_types = f.layer_types(shape["num_layers"], ("sliding_attention",))
    if from_types is not None and from_types != shape.get("num_sliding_layers", 0):
        raise f.fail("layer_types disagrees with sliding_window (which covers every layer or none)")
    return shape


# --- dense families ---------------------------------------------------------------------------


def _llama(f: _Fields) -> Shape:
    _dense(f)
    return _gqa(f, tie=False)


def _internlm2(f: _Fields) -> Shape:
    _dense(f)  # fused wqkv and w1/w3/w2: the same matrices as Llama's
    return _gqa(f, tie=False)


def _mistral(f: _Fields) -> Shape:
    _dense(f, sliding=True)
    f.refuse(("sliding_window_pattern",), "Mistral's window covers every layer")
    return _window_all_layers(f, _gqa(f, tie=False), default=4096)


def _phi3(f: _Fields) -> Shape:
    _dense(f, sliding=True)  # gate_up_proj fused: 2 x intermediate_size rows, gated
    f.refuse(("sliding_window_pattern",), "Phi-3's window covers every layer")
    return _window_all_layers(f, _gqa(f, tie=False), default=None)


def _qwen2(f: _Fields) -> Shape:
    """Qwen2 / Qwen2.5 / Qwen3: ``sliding_window`` only with ``use_sliding_window``, on the layers
    from ``max_window_layers`` on (transformers' Qwen2Config)."""
    _dense(f, sliding=True)
    shape = _gqa(f, tie=False)
    _qwen_window(f, shape)
    return shape


def _qwen_window(f: _Fields, shape: Shape) -> None:
    layers = shape["num_layers"]
    f.refuse(("sliding_window_pattern",), "Qwen's window covers the layers from max_window_layers")
    from_types = f.layer_types(layers, ("sliding_attention",))
    if f.flag("use_sliding_window", False) and f.has("sliding_window"):
        sliding = max(0, layers - f.integer("max_window_layers", 28))
        if from_types is not None and from_types != sliding:
            raise f.fail("layer_types disagrees with use_sliding_window / max_window_layers")
        if sliding:
            shape.update(sliding_window=f.integer("sliding_window"), num_sliding_layers=sliding)
    elif from_types:
        raise f.fail("layer_types has sliding layers but use_sliding_window is off")


def _qwen_v1(f: _Fields) -> Shape:
    """Qwen v1 (remote code QWenLMHeadModel): ``intermediate_size`` is w1 + w2 together, each half
    intermediate_size / 2 wide (gated, c_proj back); MHA with ``kv_channels`` per head;
    ``seq_length`` when ``max_position_embeddings`` is absent."""
    _dense(f)
    hidden, heads = f.integer("hidden_size"), f.integer("num_attention_heads")
    both = f.integer("intermediate_size")
    if both % 2:
        raise f.fail(f"intermediate_size {both} is odd; Qwen v1 counts both halves of its gated MLP")
    return {
        "hidden_size": hidden,
        "num_layers": f.integer("num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": heads,
        "intermediate_size": both // 2,
        "vocab_size": f.integer("vocab_size"),
        "max_position_embeddings": f.first_int("max_position_embeddings", "seq_length"),
        "head_dim": _head_dim(f, hidden, heads, "kv_channels"),
        "tie_word_embeddings": f.flag("tie_word_embeddings", False),
    }


def _phi(f: _Fields) -> Shape:
    """phi-1 / 1.5 / 2: fc1 -> gelu_new -> fc2 (two matrices); the partial rotary factor changes
    no matrix."""
    _dense(f)
    return {**_gqa(f, tie=False), "gated_mlp": False}


def _gemma(f: _Fields, *, default_window: int, pattern: Callable[[int], bool], **defaults: int) -> Shape:
    """Gemma 2 / 3: GeGLU (gated) MLP, tied embeddings, wide heads; local (sliding) layers from
    ``layer_types`` or, in older configs, the family's fixed pattern."""
    f.refuse(_MOE_KEYS, "a dense family")
    f.refuse(_MLA_KEYS, "MLA is read for deepseek_v2 / deepseek_v3 / kimi_k2 only")
    hidden, heads = f.integer("hidden_size"), f.integer("num_attention_heads")
    layers = f.integer("num_hidden_layers")
    shape = {
        "hidden_size": hidden,
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": f.integer("num_key_value_heads", heads),
        "intermediate_size": f.integer("intermediate_size"),
        "vocab_size": f.integer("vocab_size", defaults.get("vocab_size")),
        "max_position_embeddings": f.integer(
            "max_position_embeddings", defaults.get("max_position_embeddings")
        ),
        "head_dim": None,
        "tie_word_embeddings": f.flag("tie_word_embeddings", True),
    }
    d = f.integer("head_dim", 256)  # Gemma's config classes default head_dim to 256
    shape["head_dim"] = None if d == hidden // heads else d
    sliding = f.layer_types(layers, ("sliding_attention",))
    if sliding is None:
        sliding = sum(1 for i in range(layers) if pattern(i))
    window = f.integer("sliding_window", default_window)
    if sliding:
        shape.update(sliding_window=window, num_sliding_layers=sliding)
    return shape


def _gemma2(f: _Fields) -> Shape:
    f.refuse(("sliding_window_pattern",), "Gemma 2 alternates local and global layers")
    return _gemma(f, default_window=4096, pattern=lambda i: i % 2 == 0)


def _gemma3(f: _Fields) -> Shape:
    # Gemma3TextConfig's defaults (the published text configs leave several out): 5 local layers
    # to 1 global (layer i is local unless (i + 1) % 6 == 0), a 4,096-token window, 262,208
    # tokens, 131,072 positions.
    step = f.integer("sliding_window_pattern", 6)
    return _gemma(
        f,
        default_window=4096,
        pattern=lambda i: (i + 1) % step != 0,
        vocab_size=262_208,
        max_position_embeddings=131_072,
    )


def _falcon(f: _Fields) -> Shape:
    """Falcon: 2-matrix GELU MLP of ``ffn_hidden_size`` (default 4 x hidden); KV heads:
    ``num_kv_heads`` with the new decoder architecture, 1 with ``multi_query``, else all heads;
    embeddings tied unless the config says otherwise (vLLM's and transformers' default)."""
    _dense(f)
    f.refuse(("alibi",), "ALiBi Falcon (falcon-rw) has no KV-head grouping to read")
    hidden = f.integer("hidden_size")
    heads = f.first_int("num_attention_heads", "n_head")
    if f.flag("new_decoder_architecture", False):
        kv = f.first_int("num_kv_heads", "n_head_kv", default=heads)
    elif f.flag("multi_query", True):
        kv = 1
    else:
        kv = heads
    return {
        "hidden_size": hidden,
        "num_layers": f.first_int("num_hidden_layers", "n_layer"),
        "num_heads": heads,
        "num_kv_heads": kv,
        "intermediate_size": f.integer("ffn_hidden_size", 4 * hidden),
        "vocab_size": f.integer("vocab_size"),
        "max_position_embeddings": f.integer("max_position_embeddings", 2048),
        "gated_mlp": False,
        "tie_word_embeddings": f.flag("tie_word_embeddings", True),
    }


def _opt(f: _Fields) -> Shape:
    _dense(f)
    hidden = f.integer("hidden_size")
    if f.integer("word_embed_proj_dim", hidden) != hidden:
        raise f.fail("word_embed_proj_dim differs from hidden_size (OPT-350m's projection is not read)")
    heads = f.integer("num_attention_heads")
    return {
        "hidden_size": hidden,
        "num_layers": f.integer("num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": heads,
        "intermediate_size": f.integer("ffn_dim"),
        "vocab_size": f.integer("vocab_size"),
        "max_position_embeddings": f.integer("max_position_embeddings"),
        "gated_mlp": False,
        "tie_word_embeddings": f.flag("tie_word_embeddings", True),
    }


def _gpt2(f: _Fields) -> Shape:
    _dense(f)
    hidden, heads = f.integer("n_embd"), f.integer("n_head")
    return {
        "hidden_size": hidden,
        "num_layers": f.integer("n_layer"),
        "num_heads": heads,
        "num_kv_heads": heads,
        "intermediate_size": f.integer("n_inner", 4 * hidden),
        "vocab_size": f.integer("vocab_size"),
        "max_position_embeddings": f.integer("n_positions", 1024),
        "gated_mlp": False,
        "tie_word_embeddings": f.flag("tie_word_embeddings", True),
    }


def _gpt_neox(f: _Fields) -> Shape:
    _dense(f)
    heads = f.integer("num_attention_heads")
    return {**_gqa(f, tie=False), "num_kv_heads": heads, "head_dim": None, "gated_mlp": False}


# --- mixture-of-experts families --------------------------------------------------------------


def _moe_common(f: _Fields) -> None:
    f.refuse(_MLA_KEYS, "MLA is read for deepseek_v2 / deepseek_v3 / kimi_k2 only")


def _dense_prefix(f: _Fields, layers: int, key: str = "mlp_only_layers") -> int:
    """Qwen-MoE's ``mlp_only_layers``: read when it is the first k layers (a dense prefix)."""
    only = f.raw.get(key) or []
    if not isinstance(only, list) or sorted(only) != list(range(len(only))) or len(only) >= layers:
        raise f.fail(f"{key} {only!r} is not a dense prefix 0..k-1 (the only form read)")
    return len(only)


def _qwen_moe(f: _Fields, shared: bool) -> Shape:
    """Qwen2-MoE / Qwen3-MoE: ``num_experts`` routed experts of ``moe_intermediate_size``, top
    ``num_experts_per_tok``, on layers with (i + 1) % decoder_sparse_step == 0 outside
    ``mlp_only_layers`` (dense layers: ``intermediate_size``); Qwen2-MoE adds one shared expert of
    ``shared_expert_intermediate_size`` (its sigmoid gate is one row: not counted)."""
    _moe_common(f)
    f.refuse(("num_local_experts", "n_routed_experts", "n_shared_experts"), "Qwen-MoE names: num_experts")
    if not shared:
        f.refuse(("shared_expert_intermediate_size",), "Qwen3-MoE has no shared expert")
    shape = _gqa(f, tie=False)
    _qwen_window(f, shape)
    shape.update(
        num_experts=f.integer("num_experts"),
        experts_per_token=f.integer("num_experts_per_tok"),
        moe_intermediate_size=f.integer("moe_intermediate_size"),
        shared_intermediate_size=f.integer("shared_expert_intermediate_size") if shared else 0,
        first_dense_layers=_dense_prefix(f, shape["num_layers"]),
        moe_layer_step=f.integer("decoder_sparse_step", 1),
    )
    return shape


def _mixtral(f: _Fields) -> Shape:
    """Mixtral: every layer's MLP is ``num_local_experts`` experts of ``intermediate_size``."""
    _moe_common(f)
    f.refuse(("num_experts", "n_routed_experts", "moe_intermediate_size"), "Mixtral names: num_local_experts")
    f.refuse(("sliding_window_pattern",), "Mixtral's window covers every layer")
    shape = _window_all_layers(f, _gqa(f, tie=False), default=None)
    shape.update(
        num_experts=f.integer("num_local_experts"),
        experts_per_token=f.integer("num_experts_per_tok"),
        moe_intermediate_size=shape["intermediate_size"],
    )
    return shape


def _gpt_oss(f: _Fields) -> Shape:
    """gpt-oss: ``num_local_experts`` experts of ``intermediate_size`` (gate_up fused, SwiGLU),
    top ``num_experts_per_tok`` (older configs: ``experts_per_token``), no dense MLP and no shared
    expert; ``layer_types`` alternates sliding (``sliding_window`` tokens) and full attention."""
    _moe_common(f)
    f.refuse(("num_experts", "n_routed_experts", "moe_intermediate_size"), "gpt-oss names: num_local_experts")
    shape = _gqa(f, tie=False)
    layers = shape["num_layers"]
    sliding = f.layer_types(layers, ("sliding_attention",))
    if sliding is None:  # transformers' GptOssConfig default: even layers slide
        sliding = (layers + 1) // 2
    if sliding:
        shape.update(sliding_window=f.integer("sliding_window", 128), num_sliding_layers=sliding)
    shape.update(
        num_experts=f.integer("num_local_experts"),
        experts_per_token=f.first_int("num_experts_per_tok", "experts_per_token"),
        moe_intermediate_size=shape["intermediate_size"],
    )
    return shape


def _deepseek(f: _Fields) -> Shape:
    """DeepSeek-V2 / V3 (and Kimi K2, which ships V3's fields under model_type kimi_k2): MLA
    attention (``q_lora_rank`` null: one q matrix), ``first_k_dense_replace`` dense layers of
    ``intermediate_size``, then ``n_routed_experts`` experts of ``moe_intermediate_size`` (top
    ``num_experts_per_tok``) plus ``n_shared_experts`` shared ones of the same width. The
    multi-token-prediction layer (``num_nextn_predict_layers``) runs only for speculative decoding
    and is not counted."""
    f.refuse(("num_experts", "num_local_experts"), "DeepSeek names: n_routed_experts")
    if f.integer("moe_layer_freq", 1) != 1:
        raise f.fail("moe_layer_freq other than 1 is not read")
    hidden, heads = f.integer("hidden_size"), f.integer("num_attention_heads")
    moe = f.integer("moe_intermediate_size")
    return {
        "hidden_size": hidden,
        "num_layers": f.integer("num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": heads,
        "intermediate_size": f.integer("intermediate_size"),
        "vocab_size": f.integer("vocab_size"),
        "max_position_embeddings": f.integer("max_position_embeddings"),
        "tie_word_embeddings": f.flag("tie_word_embeddings", False),
        "num_experts": f.integer("n_routed_experts"),
        "experts_per_token": f.integer("num_experts_per_tok"),
        "moe_intermediate_size": moe,
        "shared_intermediate_size": f.integer("n_shared_experts") * moe,
        "first_dense_layers": f.integer("first_k_dense_replace", 0),
        "q_lora_rank": f.integer("q_lora_rank", 0),
        "kv_lora_rank": f.integer("kv_lora_rank"),
        "qk_nope_head_dim": f.integer("qk_nope_head_dim"),
        "qk_rope_head_dim": f.integer("qk_rope_head_dim"),
        "v_head_dim": f.integer("v_head_dim"),
    }


def _llama4(f: _Fields) -> Shape:
    """Llama 4 (text part): MoE layers every ``interleave_moe_layer_step`` (layer i when
    (i + 1) % step == 0, transformers' ``moe_layers``) with ``num_local_experts`` routed experts
    and one shared expert, all of ``intermediate_size``; the other layers a dense MLP of
    ``intermediate_size_mlp``. Chunked local attention (``attention_chunk_size``) is not
    recorded: priced as full attention."""
    _moe_common(f)
    f.refuse(("num_experts", "n_routed_experts", "moe_intermediate_size"), "Llama 4 names: num_local_experts")
    shape = _gqa(f, tie=False, intermediate="intermediate_size_mlp")
    layers, step = shape["num_layers"], f.integer("interleave_moe_layer_step", 1)
    listed = f.raw.get("moe_layers")
    if listed is not None and list(listed) != list(range(step - 1, layers, step)):
        raise f.fail("moe_layers is not every interleave_moe_layer_step-th layer (the only form read)")
    expert = f.integer("intermediate_size")
    shape.update(
        num_experts=f.integer("num_local_experts"),
        experts_per_token=f.integer("num_experts_per_tok"),
        moe_intermediate_size=expert,
        shared_intermediate_size=expert,
        moe_layer_step=step,
    )
    return shape


READERS: dict[str, Callable[[_Fields], Shape]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen2,
    "qwen2_moe": lambda f: _qwen_moe(f, shared=True),
    "qwen3_moe": lambda f: _qwen_moe(f, shared=False),
    "mixtral": _mixtral,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "kimi_k2": _deepseek,
    "gpt_oss": _gpt_oss,
    "llama4": _llama4,
    "llama4_text": _llama4,
    "phi": _phi,
    "phi3": _phi3,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "gemma3_text": _gemma3,
    "qwen": _qwen_v1,
    "internlm2": _internlm2,
    "falcon": _falcon,
    "opt": _opt,
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
}

# Families whose text model sits under ``text_config`` in the published (multimodal) config.
_NESTED = {"llama4": "llama4_text", "gemma3": "gemma3_text"}


def load_hf_config(path: str | Path) -> ModelSpec:
    """A ``ModelSpec`` from a Hugging Face ``config.json`` (or a directory holding one), read by
    its ``model_type``'s reader; ValueError (one line) for anything not understood."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"no config.json at {path}")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{p}: not UTF-8 text") from None
    except RecursionError:
        raise ValueError(f"{p}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # an integer of more than sys.get_int_max_str_digits() digits
        raise ValueError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p}: not a JSON object")
    for scope in (cfg, cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}):
        for key, value in scope.items():  # Python's json reads NaN and Infinity: no config has them
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{p}: {key} is {value}, not a number a model can have")
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in READERS:
        raise ValueError(f"{p}: model_type {model_type!r} is not supported; supported: {', '.join(READERS)}")
    text = cfg
    if model_type in _NESTED and isinstance(cfg.get("text_config"), dict):
        text = cfg["text_config"]
        inner = text.get("model_type", _NESTED[model_type])
        if inner != _NESTED[model_type]:
            raise ValueError(f"{p}: text_config model_type {inner!r} is not {_NESTED[model_type]!r}")
    f = _Fields(text, p, model_type)
    shape = READERS[model_type](f)
    top = cfg
    modelopt = _read_json(p.parent / "hf_quant_config.json")
    if modelopt is not None:
        # TensorRT-LLM and vLLM read a modelopt checkpoint's own hf_quant_config.json (NVIDIA's
        # MLPerf R1 substitutes a custom one): its quantization section replaces config.json's.
        top = {**cfg, "quantization_config": _modelopt_section(modelopt, p.parent / "hf_quant_config.json")}
    shape.update(checkpoint_formats(f.raw, top, bool(shape.get("num_experts")), f.fail))
    name = str(cfg.get("_name_or_path") or p.parent.name or model_type)
    try:
        spec = ModelSpec(name=name, **shape)
        exclusions = _exclusion_list(top.get("quantization_config") or f.raw.get("quantization_config"))
        if exclusions is not None:
            spec = apply_exclusions(spec, model_type, *exclusions)
        return spec
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from None


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError):
        raise ValueError(f"{path}: not valid JSON") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data


def _modelopt_section(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """hf_quant_config.json's ``quantization`` as a config.json ``quantization_config``."""
    q = data.get("quantization")
    if not isinstance(q, dict):
        raise ValueError(f"{path}: quantization must be an object")
    return {**q, "quant_method": "modelopt", "_exclude_modules": q.get("exclude_modules")}


def _exclusion_list(q: object) -> tuple[object, str, str] | None:
    """(patterns, match style, where) of a quantization config's list of modules left
    unquantized (quant_exclusions.py), None without one. gpt-oss's MXFP4 list is not read:
    its format is the experts' alone already (``checkpoint_formats``)."""
    if not isinstance(q, dict):
        return None
    method = str(q.get("quant_method", "")).lower()
    if method == "modelopt":
        if "_exclude_modules" in q:
            return q["_exclude_modules"], "glob", "hf_quant_config.json exclude_modules"
        return q.get("ignore"), "glob", "quantization_config ignore"
    if method == "compressed-tensors":
        return q.get("ignore"), "exact_or_regex", "quantization_config ignore"
    if method in ("fp8", "fbgemm_fp8"):
        key = "ignored_layers" if q.get("ignored_layers") else "modules_to_not_convert"
        return q.get(key), "exact", f"quantization_config {key}"
    if method == "awq":
        return q.get("modules_to_not_convert"), "substring", "quantization_config modules_to_not_convert"
    return None
