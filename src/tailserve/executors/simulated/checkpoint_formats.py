"""A checkpoint's number formats, read from its config.json (``torch_dtype``,
``quantization_config``) or the ``hf_quant_config.json`` beside it, as vLLM 0.32 reads them:
the weights', the routed experts' and the KV cache's format (``precision.py``'s names). A
method, algorithm or combination not read here is refused in one line (``fail``), never
guessed. Every FP8 form is told apart by the kernel vLLM runs for it: ``fp8`` (dynamic
per-tensor activations), ``fp8_static`` (the checkpoint's static per-tensor activation scales:
FlashInfer's CUTLASS / TRT-LLM fused MoE), ``fp8_block`` (128 x 128 weight blocks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Shape = dict[str, Any]
Fail = Callable[[str], ValueError]  # one line naming the config and what is not read

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# quantization_config.quant_method values read (anything else is refused).
QUANT_METHODS = ("fp8", "fbgemm_fp8", "mxfp4", "awq", "gptq", "compressed-tensors", "modelopt")


def checkpoint_formats(raw: dict[str, Any], top: dict[str, Any], is_moe: bool, fail: Fail) -> Shape:
    """``dtype_bytes`` (torch_dtype / dtype: float32 -> 4, bfloat16 / float16 -> 2, absent -> 2)
    and the weight / expert / KV formats from ``quantization_config``."""
    dtype = raw.get("torch_dtype") or raw.get("dtype") or top.get("torch_dtype") or top.get("dtype")
    if dtype is not None and dtype not in _DTYPE_BYTES:
        raise fail(f"torch_dtype {dtype!r} is not read; known: {', '.join(_DTYPE_BYTES)}")
    out: Shape = {"dtype_bytes": _DTYPE_BYTES.get(dtype or "bfloat16", 2)}
    q = top.get("quantization_config") or raw.get("quantization_config")
    if not q:
        return out
    if not isinstance(q, dict):
        raise fail("quantization_config must be an object")
    method = str(q.get("quant_method", "")).lower()
    where = f"quantization_config quant_method {method!r}"
    if method in ("fp8", "fbgemm_fp8"):
        out["weight_dtype"] = _fp8_method(fail, q, method)
    elif method == "mxfp4":
        if not is_moe:
            raise fail(f"{where}: MXFP4 is read for the routed experts of an MoE model (gpt-oss)")
        out["expert_dtype"] = "mxfp4"  # gpt-oss: attention, router, embeddings stay bf16
    elif method in ("awq", "gptq"):
        bits = q.get("bits", q.get("w_bit"))
        if bits not in (4, 8):
            raise fail(f"{where}: bits {bits!r} is not read (4 or 8)")
        out["weight_dtype"] = "int4" if bits == 4 else "int8"
    elif method == "compressed-tensors":
        out.update(_compressed_tensors(fail, q))
    elif method == "modelopt":
        out.update(_modelopt(fail, q, where))
    else:
        raise fail(f"{where} is not read; read: {', '.join(QUANT_METHODS)}")
    return out


def _fp8_method(fail: Fail, q: dict[str, Any], method: str) -> str:
    """The ``fp8`` method's format (vLLM's ``Fp8Config``, quantization/fp8.py@v0.32.0): 128 x 128
    weight blocks (DeepSeek-V3, Kimi K2, Qwen3-FP8) -> fp8_block, whose activations are dynamic
    (:128-133 refuses static); per-tensor weights with ``activation_scheme`` static (AutoFP8)
    -> fp8_static, dynamic -> fp8 (the MoE layer's keys, :509-515). ``fbgemm_fp8`` (per-channel
    weights, dynamic per-token activations) -> fp8."""
    scheme = q.get("activation_scheme")
    if method == "fp8" and scheme is not None and scheme not in ("static", "dynamic"):
        raise fail(f"quantization_config activation_scheme {scheme!r} is not read (static, dynamic)")
    if q.get("weight_block_size"):
        if scheme == "static":
            raise fail("quantization_config: weight_block_size with activation_scheme 'static' is not "
                       "read (vLLM's block FP8 takes dynamic activations only)")  # fmt: skip
        return "fp8_block"
    return "fp8_static" if method == "fp8" and scheme == "static" else "fp8"


def _modelopt(fail: Fail, q: dict[str, Any], where: str) -> Shape:
    """A ModelOpt checkpoint (vLLM's modelopt.py@v0.32.0): ``quant_algo`` FP8 -> fp8_static
    (per-tensor weights and static activation scales, ``ModelOptFp8MoEMethod``'s keys,
    :495-501), NVFP4 -> nvfp4; the other algos are refused. The KV format: hf_quant_config.json's
    ``kv_cache_quant_algo`` (its ``quantization`` section, :331-332) or config.json's
    ``kv_cache_scheme`` of 8-bit float (:344-352); tailserve reads ``kv_cache_quant_algo`` in
    config.json too, as earlier exports wrote it there."""
    algo = str(q.get("quant_algo", "")).upper()
    if algo not in ("FP8", "NVFP4"):
        raise fail(f"{where}: quant_algo {algo!r} is not read (FP8, NVFP4)")
    out: Shape = {"weight_dtype": "fp8_static" if algo == "FP8" else "nvfp4"}
    kv_algo = str(q.get("kv_cache_quant_algo") or "").upper()
    scheme = q.get("kv_cache_scheme") if "_exclude_modules" not in q else None
    if kv_algo not in ("", "FP8"):
        raise fail(f"{where}: kv_cache_quant_algo {kv_algo!r} is not read (FP8)")
    if scheme is not None and not isinstance(scheme, dict):
        raise fail(f"{where}: kv_cache_scheme must be an object")
    if kv_algo == "FP8" or (scheme and (scheme.get("num_bits"), scheme.get("type")) == (8, "float")):
        out["kv_dtype"] = "fp8"
    return out


def _compressed_tensors(fail: Fail, q: dict[str, Any]) -> Shape:
    """llm-compressor checkpoints, when every config group quantizes weights the same way:
    8-bit float -> fp8 (``fp8_static`` with static per-tensor activations, ``fp8_block`` with
    block weights), 8-bit int -> int8, 4-bit int -> int4 (W4A16), 4-bit float in groups of 16 ->
    nvfp4; a ``kv_cache_scheme`` of 8-bit float -> fp8 KV."""
    groups = q.get("config_groups") or {}
    kinds = {
        (
            g.get("weights", {}).get("num_bits"),
            g.get("weights", {}).get("type"),
            g.get("weights", {}).get("group_size"),
            _ct_fp8_kind(fail, g),
        )
        for g in groups.values()
        if isinstance(g, dict)
    }
    if len(kinds) != 1:
        raise fail("compressed-tensors: config_groups must quantize every weight one way to be read")
    bits, kind, group, fp8_kind = kinds.pop()
    table = {(8, "float"): fp8_kind, (8, "int"): "int8", (4, "int"): "int4"}
    fmt = "nvfp4" if (bits, kind, group) == (4, "float", 16) else table.get((bits, kind))
    if fmt is None:
        raise fail(f"compressed-tensors: {bits}-bit {kind} weights (group {group}) are not read")
    out: Shape = {"weight_dtype": fmt}
    kv = q.get("kv_cache_scheme")
    if kv:
        if (kv.get("num_bits"), kv.get("type")) != (8, "float"):
            raise fail("compressed-tensors: only an 8-bit float kv_cache_scheme is read")
        out["kv_dtype"] = "fp8"
    return out


def _ct_fp8_kind(fail: Fail, group: dict[str, Any]) -> str:
    """An 8-bit float config group's FP8 format, as vLLM's compressed-tensors MoE method keys it
    (compressed_tensors_moe_w8a8_fp8.py:66-104@v0.32.0): block weights -> fp8_block; per-tensor
    weights with static per-tensor activations (``dynamic`` false, compressed-tensors' default;
    a strategy left out is inferred as its ``QuantizationArgs`` does, ``_strategy``) -> fp8_static; dynamic
    activations (or none: weight-only) -> fp8. Static activations with per-channel weights are
    refused, as vLLM refuses them for an MoE layer (:82-87)."""
    weights = group.get("weights") or {}
    if (weights.get("num_bits"), weights.get("type")) != (8, "float"):
        return ""
    acts = group.get("input_activations")
    w_strategy = _strategy(weights)
    if w_strategy == "block":
        return "fp8_block"
    if not isinstance(acts, dict) or acts.get("dynamic", False) is not False:
        return "fp8"
    a_strategy = _strategy(acts)
    if (w_strategy, a_strategy) != ("tensor", "tensor"):
        raise fail(f"compressed-tensors: static {a_strategy} activations with {w_strategy} FP8 weights "
                   "are not read (static activations: per-tensor weights and activations)")  # fmt: skip
    return "fp8_static"


def _strategy(args: dict[str, Any]) -> str:
    """A compressed-tensors ``QuantizationArgs`` strategy, inferred where left out as it infers it
    (quant_args.py:304-315@0.17.0): no group size -> tensor, -1 -> channel, > 0 -> group."""
    if args.get("strategy"):
        return str(args["strategy"]).lower()
    size = args.get("group_size")
    return "tensor" if size is None else "channel" if size == -1 else "group"
