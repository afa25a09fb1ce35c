"""Read a Hugging Face model directory: ``config.json`` into a ``ModelConfig``, safetensors into tensors.

Only what a Llama-family decoder needs is read, and everything is checked on the way in, so a bad
directory fails here with a message naming the file and the problem — never later inside a matmul.
Tensor names stay exactly Hugging Face's (``model.layers.0.self_attn.q_proj.weight``, ...).

Every size is bounded too, well above any supported model (``LIMITS``): a config is read before
the weights, and what it claims sizes tables (RoPE is built for ``max_position_embeddings``
positions) and loops (one per layer) before a tensor is compared with it. Floats must be finite.

Config keys come in two generations and both are read: transformers 5.x writes RoPE as
``rope_parameters`` (``{"rope_type", "rope_theta", ...}``); older configs have a top-level
``rope_theta`` plus ``rope_scaling`` (with ``type`` or ``rope_type``). Either becomes
``rope_theta`` + ``rope_scaling`` (``None`` for plain RoPE, else a dict with ``rope_type``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

# architectures -> model_type; the model code implements exactly these.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
MOE_MODEL_TYPES = ("mixtral", "qwen3_moe")
# Mixture-of-experts families whose layouts the model does not implement (shared experts, grouped
# routing, biased routers, ...): refused by name rather than as an unknown architecture.
_OTHER_MOE = (
    "Qwen2MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "OlmoeForCausalLM",
    "GraniteMoeForCausalLM",
    "PhimoeForCausalLM",
    "JambaForCausalLM",
    "DbrxForCausalLM",
    "Glm4MoeForCausalLM",
    "GptOssForCausalLM",
    "Llama4ForCausalLM",
    "Qwen3NextForCausalLM",
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Largest accepted config values: several times the largest supported-architecture model's
# (Llama 3.1 405B: hidden 16,384, intermediate 53,248, 126 layers, 128 heads; vocabularies up to
# ~256k; the longest Llama-family contexts 4,194,304 positions), so a config past them is broken.
LIMITS = {
    "vocab_size": 2**24,
    "hidden_size": 2**16,
    "intermediate_size": 2**18,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 1024,
    "max_position_embeddings": 2**22,
    "sliding_window": 2**22,
    "original_max_position_embeddings": 2**22,
    # Mixture of experts: DeepSeek-V3 / Qwen3-MoE have 256 / 128 experts, 8 per token.
    "num_local_experts": 4096,
    "num_experts": 4096,
    "num_experts_per_tok": 4096,
    "moe_intermediate_size": 2**18,
    "decoder_sparse_step": 1024,
}
# Buffers some exporters save that the model recomputes; present or absent, they are ignored.
_HARMLESS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


class ModelLoadError(ValueError):
    """A model directory cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # a key of SUPPORTED_ARCHITECTURES
    model_type: str  # "llama" | "mistral" | "qwen2" | "mixtral" | "qwen3_moe"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # config's head_dim, else hidden_size // num_attention_heads
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None: plain RoPE; else {"rope_type": ..., other keys as HF}
    max_position_embeddings: int  # tokens
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections have a bias (Qwen2 always; Llama if attention_bias)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # config.json's eos_token_id merged with generation_config.json's
    torch_dtype: str  # "float32" | "bfloat16" | "float16", as stored
    name: str  # directory name, served as the model name
    o_proj_bias: bool = False  # Llama's attention_bias also puts a bias on o_proj; Qwen2's does not
    mlp_bias: bool = False  # Llama's mlp_bias: gate/up/down projections have a bias
    sliding_window: int | None = None  # tokens; None when every layer attends to the whole context
    # Mixture of experts (Mixtral, Qwen3-MoE); 0 / () for a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's; Mixtral's is intermediate_size
    norm_topk_prob: bool = False  # renormalise the top-k router weights (Mixtral always does)
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is the sparse MoE block
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE

    def moe_names(self, layer: int) -> tuple[str, tuple[str, str, str]]:
        """Layer ``layer``'s router weight name and the format of its expert (gate, up, down)
        weight names (``.format(e)``), as Hugging Face names them in this family."""
        p = f"model.layers.{layer}."
        if self.model_type == "mixtral":
            m = p + "block_sparse_moe."
            return m + "gate.weight", tuple(m + f"experts.{{}}.{w}.weight" for w in ("w1", "w3", "w2"))
        m = p + "mlp."
        return m + "gate.weight", tuple(m + f"experts.{{}}.{w}_proj.weight" for w in ("gate", "up", "down"))

    @property
    def num_params(self) -> int:
        """Parameters stored in the checkpoint (the tied lm_head counted once)."""
        total = 0
        for shape in expected_tensor_shapes(self).values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config holds, by Hugging Face name, in model order."""
    h, q_dim = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_dim, inter = config.num_key_value_heads * config.head_dim, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        for proj, out_dim in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
            shapes[f"{p}self_attn.{proj}.weight"] = (out_dim, h)
            if config.attention_bias:
                shapes[f"{p}self_attn.{proj}.bias"] = (out_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_dim)
        if config.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (config.head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if i in config.moe_layers:
            router, (gate, up, down) = config.moe_names(i)
            shapes[router] = (config.num_experts, h)
            e_inter = config.moe_intermediate_size
            for e in range(config.num_experts):
                shapes[gate.format(e)] = shapes[up.format(e)] = (e_inter, h)
                shapes[down.format(e)] = (h, e_inter)
            continue
        for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            shapes[f"{p}mlp.{proj}.weight"] = shape
            if config.mlp_bias:
                shapes[f"{p}mlp.{proj}.bias"] = (shape[0],)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


# ---- config --------------------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:  # ValueError: JSONDecodeError, huge ints
        raise ModelLoadError(f"{path}: not readable JSON ({e})") from None
    except RecursionError:
        raise ModelLoadError(f"{path}: not readable JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _model_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a model directory (it does not exist or is not a directory)")
    return path


class _Fields:
    """Typed access to one config file's keys, with errors that name the file and the key."""

    def __init__(self, raw: dict[str, Any], path: Path, prefix: str = "") -> None:
        self.raw, self.path, self.prefix = raw, path, prefix  # prefix: where ``raw`` sits

    def integer(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.raw.get(key, default)
        name = self.prefix + key
        if value is None:
            raise ModelLoadError(f"{self.path}: {name!r} is missing")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ModelLoadError(
                f"{self.path}: {name!r} must be an integer >= {minimum}, got {_shown(value)}"
            )
        maximum = LIMITS.get(key)
        if maximum is not None and value > maximum:
            raise ModelLoadError(
                f"{self.path}: {name!r} must be at most {maximum:,} (no supported model has more), "
                f"got {_shown(value)}"
            )
        return value

    def number(self, key: str, default: float | None = None, below: float = math.inf) -> float:
        """A finite number > 0 (and < ``below``)."""
        value = self.raw.get(key, default)
        if value is None:
            raise ModelLoadError(f"{self.path}: {self.prefix + key!r} is missing")
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not 0 < value < below
            or not math.isfinite(value)
        ):
            bound = f" below {below:g}" if below < math.inf else ""
            raise ModelLoadError(
                f"{self.path}: {self.prefix + key!r} must be a finite number > 0{bound}, got {_shown(value)}"
            )
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw.get(key, default)
        if not isinstance(value, bool):
            raise ModelLoadError(f"{self.path}: {key!r} must be true or false, got {value!r}")
        return value

    def token_ids(self, key: str) -> tuple[int, ...]:
        value = self.raw.get(key)
        values = [] if value is None else value if isinstance(value, list) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise ModelLoadError(f"{self.path}: {key!r} must be a token id or a list of them, got {value!r}")
        return tuple(values)


def _architecture(f: _Fields) -> tuple[str, str]:
    archs = f.raw.get("architectures")
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if not isinstance(archs, list) or not archs:
        raise ModelLoadError(f"{f.path}: 'architectures' is missing; supported: {supported}")
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch, SUPPORTED_ARCHITECTURES[arch]
    for arch in archs:
        if arch in _OTHER_MOE:
            raise ModelLoadError(
                f"{f.path}: mixture-of-experts architecture {arch} is not supported (its expert layout "
                "differs); supported MoE: MixtralForCausalLM, Qwen3MoeForCausalLM"
            )
    raise ModelLoadError(
        f"{f.path}: unsupported architecture {', '.join(map(str, archs))}; supported: {supported}"
    )


def _rope(f: _Fields) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalised rope_scaling) from either config generation."""
    params = f.raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ModelLoadError(f"{f.path}: 'rope_parameters' must be an object, got {params!r}")
        if "rope_theta" not in params and all(isinstance(v, dict) for v in params.values()):
            raise ModelLoadError(f"{f.path}: per-layer-type 'rope_parameters' are not supported")
        theta_source, scaling = _Fields(params, f.path, "rope_parameters."), dict(params)
    else:
        scaling = f.raw.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise ModelLoadError(f"{f.path}: 'rope_scaling' must be an object or null, got {scaling!r}")
        theta_source, scaling = f, dict(scaling or {})
    theta = theta_source.number("rope_theta", 10000.0)
    scaling.pop("rope_theta", None)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return theta, None
    # The keys rope.py reads for the types it implements (others are refused when the model is built).
    keys = _ROPE_KEYS.get(rope_type, ())
    where = "rope_parameters." if params is not None else "rope_scaling."
    source = _Fields(scaling, f.path, where)
    for key in keys:
        if key == "original_max_position_embeddings":
            source.integer(key)
        else:
            source.number(key)
    if rope_type == "llama3" and not scaling["low_freq_factor"] < scaling["high_freq_factor"]:
        raise ModelLoadError(
            f"{f.path}: llama3 rope scaling needs low_freq_factor < high_freq_factor, got "
            f"{scaling['low_freq_factor']} and {scaling['high_freq_factor']}"
        )
    return theta, {"rope_type": rope_type, **scaling}


_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def _shown(value: Any) -> str:
    """A config value for an error message, cut short."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _torch_dtype(f: _Fields, model_dir: Path) -> str:
    value = f.raw.get("dtype") or f.raw.get("torch_dtype")
    if value is None:
        # Not in the config: the checkpoint's own dtype is what is stored.
        files = _weight_files(model_dir)
        first = next(iter(sorted(set(files.values()))))
        with _open(first) as st:
            keys = list(st.keys())
            if not keys:
                raise ModelLoadError(f"{first}: holds no tensors")
            stored = st.get_slice(keys[0]).get_dtype()
        value = _SAFETENSORS_DTYPES.get(stored, stored)
    if value not in DTYPES:
        raise ModelLoadError(f"{f.path}: dtype {value!r} is not supported; supported: {', '.join(DTYPES)}")
    return value


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read and check ``config.json`` (and ``generation_config.json`` for EOS ids, if present)."""
    root = _model_dir(model_dir)
    f = _Fields(_read_json(root / "config.json"), root / "config.json")
    architecture, model_type = _architecture(f)
    if f.raw.get("quantization_config"):
        raise ModelLoadError(f"{f.path}: quantized checkpoints are not supported")
    hidden_act = f.raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ModelLoadError(f"{f.path}: hidden_act {hidden_act!r} is not supported (only silu, SwiGLU)")
    hidden_size = f.integer("hidden_size")
    num_heads = f.integer("num_attention_heads")
    num_kv_heads = f.integer("num_key_value_heads", num_heads)
    if num_heads % num_kv_heads:
        raise ModelLoadError(
            f"{f.path}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
        )
    if f.raw.get("head_dim") is None and hidden_size % num_heads:
        raise ModelLoadError(
            f"{f.path}: hidden_size {hidden_size} is not divisible by num_attention_heads {num_heads} "
            "and there is no head_dim"
        )
    head_dim = f.integer("head_dim", hidden_size // num_heads)
    rope_theta, rope_scaling = _rope(f)
    attention_bias = model_type == "qwen2" or (model_type != "mixtral" and f.flag("attention_bias", False))
    moe = _moe(f, model_type)
    num_layers = f.integer("num_hidden_layers")
    eos: list[int] = list(f.token_ids("eos_token_id"))
    gen_path = root / "generation_config.json"
    if gen_path.exists():
        eos += _Fields(_read_json(gen_path), gen_path).token_ids("eos_token_id")
    bos = f.token_ids("bos_token_id")
    return ModelConfig(
        architecture=architecture,
        model_type=model_type,
        vocab_size=f.integer("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=f.integer("intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=f.number("rms_norm_eps", 1e-6, below=1.0),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=f.integer("max_position_embeddings"),
        tie_word_embeddings=f.flag("tie_word_embeddings", False),
        attention_bias=attention_bias,
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        torch_dtype=_torch_dtype(f, root),
        name=root.resolve().name,
        o_proj_bias=model_type in ("llama", "qwen3_moe") and attention_bias,
        mlp_bias=model_type == "llama" and f.flag("mlp_bias", False),
        sliding_window=_sliding_window(f, model_type),
        qk_norm=model_type == "qwen3_moe",
        **_moe_layers(f, model_type, moe, num_layers),
    )


def _moe(f: _Fields, model_type: str) -> dict[str, Any]:
    """The expert counts, sizes and routing options of a MoE family's config.json (empty if dense)."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    # Mixtral names the count num_local_experts; Qwen3-MoE num_experts (transformers maps either).
    key = "num_experts" if "num_experts" in f.raw else "num_local_experts"
    num_experts = f.integer(key, 8 if model_type == "mixtral" else 128)
    top_k = f.integer("num_experts_per_tok", 2 if model_type == "mixtral" else 8)
    if top_k > num_experts:
        raise ModelLoadError(
            f"{f.path}: num_experts_per_tok {top_k} is more than the {num_experts} experts ({key})"
        )
    if model_type == "mixtral":
        return {"num_experts": num_experts, "num_experts_per_tok": top_k, "norm_topk_prob": True}
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": f.integer("moe_intermediate_size", 768),
        "norm_topk_prob": f.flag("norm_topk_prob", False),
    }


def _moe_layers(f: _Fields, model_type: str, moe: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """``moe`` plus the layers that are sparse: every Mixtral layer; Qwen3-MoE's (transformers'
    rule) those not in ``mlp_only_layers`` whose index + 1 is a multiple of ``decoder_sparse_step``."""
    if not moe:
        return {}
    if model_type == "mixtral":
        return {
            **moe,
            "moe_intermediate_size": f.integer("intermediate_size"),
            "moe_layers": tuple(range(num_layers)),
        }
    step = f.integer("decoder_sparse_step", 1)
    dense = f.raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in dense
    ):
        raise ModelLoadError(
            f"{f.path}: 'mlp_only_layers' must be a list of layer indices below {num_layers}, got {_shown(dense)}"
        )
    layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return {**moe, "moe_layers": layers}


def _sliding_window(f: _Fields, model_type: str) -> int | None:
    # Mistral applies sliding_window whenever set, and transformers' MistralConfig defaults it to
    # 4096 when the key is absent; Qwen2 applies it only with use_sliding_window.
    if model_type == "mistral" and "sliding_window" not in f.raw:
        return 4096
    if model_type == "llama" or f.raw.get("sliding_window") is None:
        return None
    if model_type in ("qwen2", "qwen3_moe") and not f.flag("use_sliding_window", False):
        return None
    return f.integer("sliding_window")


# ---- weights -------------------------------------------------------------------------------
def _open(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"{path}: not a readable safetensors file ({e})") from None


def _weight_files(root: Path) -> dict[str, Path]:
    """Tensor name -> the file holding it (for a single file: every name it holds)."""
    index = root / INDEX_FILE
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: 'weight_map' is missing or empty")
        files = {name: root / str(file) for name, file in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise ModelLoadError(f"{index}: names shard {path.name}, which is missing from {root}")
        return files
    single = root / SINGLE_FILE
    if single.is_file():
        with _open(single) as st:
            return dict.fromkeys(st.keys(), single)
    pickles = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
    if pickles:
        raise ModelLoadError(
            f"{root}: holds PyTorch pickle weights ({', '.join(pickles)}), which tailserve does not load "
            "(unpickling can run code); convert them to safetensors, e.g. "
            "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT) with transformers"
        )
    raise ModelLoadError(f"{root}: no {SINGLE_FILE} or {INDEX_FILE}")


def load_state_dict(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Every tensor ``config`` needs, by Hugging Face name, cast to ``dtype`` on ``device``.

    Raises ``ModelLoadError`` for a missing, unexpected or mis-shaped tensor, naming the tensor, the
    file and both shapes. Rotary ``inv_freq`` buffers, and ``lm_head.weight`` when the embeddings
    are tied, are ignored.

    A MoE checkpoint is read in either layout transformers reads: one tensor per expert and
    projection (what ``save_pretrained`` writes), or its in-memory form, each layer's experts
    fused into ``mlp.experts.gate_up_proj`` [experts, 2 * inter, hidden] and ``mlp.experts.down_proj``
    [experts, hidden, inter] with the router at ``mlp.gate.weight``; the latter is split into the
    former's names.
    """
    root = _model_dir(model_dir)
    files = _weight_files(root)
    canonical = expected_tensor_shapes(config)
    expected = canonical
    fused = bool(config.moe_layers) and _fused_name(config.moe_layers[0], "gate_up_proj") in files
    if fused:
        per_expert = {n for i in config.moe_layers for n in _moe_tensor_names(config, i)}
        expected = {n: s for n, s in canonical.items() if n not in per_expert} | _fused_shapes(config)
    missing = [name for name in expected if name not in files]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelLoadError(f"{root}: missing tensor(s) {shown} (config.json expects {len(expected)})")
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
    for name, path in files.items():
        if name not in expected and name not in ignorable and not _HARMLESS.search(name):
            raise ModelLoadError(
                f"{path}: unexpected tensor {name} (not part of a model with this config.json)"
            )
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    state: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with _open(path) as st:
            for name in names:
                sliced = st.get_slice(name)
                found = tuple(sliced.get_shape())
                if found != expected[name]:
                    raise ModelLoadError(
                        f"{path}: tensor {name} has shape {list(found)}, config.json implies {list(expected[name])}"
                    )
                stored = sliced.get_dtype()
                if stored not in _SAFETENSORS_DTYPES:
                    raise ModelLoadError(
                        f"{path}: tensor {name} is stored as {stored}; expected F32, BF16 or F16"
                    )
                state[name] = st.get_tensor(name).to(device=device, dtype=dtype)
    if fused:
        _split_fused_experts(config, state)
    return {name: state[name] for name in canonical}


def _fused_name(layer: int, what: str) -> str:
    return f"model.layers.{layer}.mlp." + ("gate.weight" if what == "gate" else f"experts.{what}")


def _moe_tensor_names(config: ModelConfig, layer: int) -> list[str]:
    router, formats = config.moe_names(layer)
    return [router] + [fmt.format(e) for e in range(config.num_experts) for fmt in formats]


def _fused_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    e, h, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {}
    for i in config.moe_layers:
        shapes[_fused_name(i, "gate")] = (e, h)
        shapes[_fused_name(i, "gate_up_proj")] = (e, 2 * inter, h)
        shapes[_fused_name(i, "down_proj")] = (e, h, inter)
    return shapes


def _split_fused_experts(config: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    """Fused expert tensors -> one per expert and projection (gate first in gate_up_proj, as
    transformers' ``chunk(2)`` reads it), in place."""
    inter = config.moe_intermediate_size
    for i in config.moe_layers:
        router, (gate, up, down) = config.moe_names(i)
        state[router] = state.pop(_fused_name(i, "gate"))
        gate_up, down_all = state.pop(_fused_name(i, "gate_up_proj")), state.pop(_fused_name(i, "down_proj"))
        for e in range(config.num_experts):
            state[gate.format(e)] = gate_up[e, :inter].contiguous()
            state[up.format(e)] = gate_up[e, inter:].contiguous()
            state[down.format(e)] = down_all[e].contiguous()
