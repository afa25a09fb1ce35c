"""Which groups of linear layers a quantized checkpoint leaves unquantized, from its list of
excluded modules, matched as the engines match them.

The lists and their matching rules:

- modelopt (``hf_quant_config.json`` ``quantization.exclude_modules``, or ``config.json``
  ``quantization_config.ignore`` with ``quant_method`` modelopt): shell globs.
  TensorRT-LLM ``QuantConfig.is_module_excluded_from_quantization`` (fnmatchcase;
  tensorrt_llm/models/modeling_utils.py @27712aa7); vLLM ``ModelOptQuantConfigBase.is_layer_excluded``
  (exact, substring of the module path, fnmatch; model_executor/layers/quantization/modelopt.py:187-221
  @vllm 0.32.0). A pattern naming a parent module excludes its children (vLLM's substring rule).
- compressed-tensors (``quantization_config.ignore``): an exact module name, or a regex after
  ``re:`` matched from the start (vLLM ``is_equal_or_regex_match``,
  quantization/utils/config_utils.py:392-412 @0.32.0).
- fp8 / fbgemm_fp8 (``modules_to_not_convert``, vLLM's ``ignored_layers``): exact names
  (``Fp8Config`` match mode "exact", quantization/fp8.py:117-119, 162-168 @0.32.0).
- awq (``modules_to_not_convert``): substrings of the module name (quantization/auto_awq.py:293-299).

A pattern in a style its list does not use (a ``re:`` regex in a glob list, a glob in an exact
list, regex syntax without ``re:``) is one ValueError line: matched as the engines match it, it
would silently match nothing. A group excluded in some of its modules only (one layer's MLP) is
refused too: the cost model prices a group in one format. Patterns naming modules the cost model
does not price (embeddings, norms, the MTP layer) match nothing here and are fine.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import replace

from tailserve.executors.simulated.model_spec import ModelSpec
from tailserve.executors.simulated.module_formats import OVERRIDABLE, activation_dtype, group_params

STYLES = ("glob", "exact_or_regex", "exact", "substring")
_REGEX_ONLY = set("^$\\()+|{}")


# Per model_type: the MLP container, the router's name, the shared experts' and the experts'
# matrices (Hugging Face module names; DeepSeek / Qwen / Llama layouts when not listed).
_MOE_NAMES = {
    "mixtral": ("block_sparse_moe", "gate", "", ("w1", "w3", "w2")),
    "gpt_oss": ("mlp", "router", "", ("gate_up_proj", "down_proj")),
    "llama4": ("feed_forward", "router", "shared_expert", ("gate_proj", "up_proj", "down_proj")),
    "llama4_text": ("feed_forward", "router", "shared_expert", ("gate_proj", "up_proj", "down_proj")),
    "qwen2_moe": ("mlp", "gate", "shared_expert", ("gate_proj", "up_proj", "down_proj")),
}
_DEFAULT_MOE = ("mlp", "gate", "shared_experts", ("gate_proj", "up_proj", "down_proj"))
_MLP = ("gate_proj|gate_up_proj", "up_proj|gate_up_proj", "down_proj")


def group_modules(spec: ModelSpec, model_type: str) -> dict[str, list[tuple[str, ...]]]:
    """Each group's linear modules, every one as its alternative names (Hugging Face's, and the
    fused names the engines give it: TensorRT-LLM's ``fused_a``, vLLM's ``qkv_proj``)."""
    container, router, shared, expert_mats = _MOE_NAMES.get(model_type, _DEFAULT_MOE)
    dense_container = "feed_forward" if model_type.startswith("llama4") else "mlp"
    out: dict[str, list[tuple[str, ...]]] = {g: [] for g in OVERRIDABLE}
    moe_layers = set()
    if spec.is_moe:
        steps = range(spec.first_dense_layers, spec.num_layers)
        moe_layers = {i for i in steps if (i + 1) % spec.moe_layer_step == 0}

    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        attn = f"{p}.self_attn"
        if spec.is_mla:
            out["attention"].append((f"{attn}.o_proj",))
            q = ["q_a_proj|fused_a|fused_qkv_a_proj", "q_b_proj"] if spec.q_lora_rank else ["q_proj"]
            for leaf in (*q, "kv_a_proj_with_mqa|fused_a|fused_qkv_a_proj", "kv_b_proj"):
                out["mla"].append(tuple(f"{attn}.{n}" for n in leaf.split("|")))
        else:
            for leaf in ("q_proj|qkv_proj", "k_proj|qkv_proj", "v_proj|qkv_proj", "o_proj"):
                out["attention"].append(tuple(f"{attn}.{n}" for n in leaf.split("|")))
        if i in moe_layers:
            moe = f"{p}.{container}"
            out["router"].append((f"{moe}.{router}",))
            for e in sorted({0, spec.num_experts - 1}):
                for mat in expert_mats:
                    out["experts"].append((f"{moe}.experts.{e}.{mat}", f"{moe}.experts.{mat}"))
            if spec.shared_intermediate_size:
                for leaf in _MLP:
                    out["shared_experts"].append(tuple(f"{moe}.{shared}.{n}" for n in leaf.split("|")))
        else:  # a dense layer (DeepSeek's first ones, Maverick's off-step ones, a dense model's)
            for leaf in _MLP:
                out["dense_mlp"].append(tuple(f"{p}.{dense_container}.{n}" for n in leaf.split("|")))
    return out


def _matcher(patterns: list[str], style: str, where: str) -> Callable[[str], bool]:
    """A predicate on module names for ``patterns`` in ``style``; ValueError for a pattern the
    style cannot hold."""
    compiled: list[str | re.Pattern[str]] = []
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"{where}: entries must be module names, got {pattern!r}")
        if style == "exact_or_regex":
            if pattern.startswith("re:"):
                try:
                    compiled.append(re.compile(pattern[3:]))
                except re.error as error:
                    raise ValueError(f"{where}: {pattern!r} is not a valid regex ({error})") from None
                continue
            if set(pattern) & (set("*?[") | _REGEX_ONLY):
                raise ValueError(
                    f"{where}: {pattern!r} is neither a module name nor a 're:' regex (compressed-tensors matches those only)"
                )
        elif pattern.startswith("re:") or set(pattern) & _REGEX_ONLY:
            raise ValueError(f"{where}: {pattern!r} is a regex; this list is matched as {style} module names")
        elif style in ("exact", "substring") and set(pattern) & set("*?["):
            raise ValueError(f"{where}: {pattern!r} is a glob; this list is matched as {style} module names")
        compiled.append(pattern)

    def matches(name: str) -> bool:
        for pat in compiled:
            if isinstance(pat, re.Pattern):
                if pat.match(name):
                    return True
            elif style == "substring":
                if pat in name:
                    return True
            elif (
                name == pat
                or name.startswith(pat + ".")
                or (style == "glob" and fnmatch.fnmatchcase(name, pat))
            ):
                return True
        return False

    return matches


def apply_exclusions(spec: ModelSpec, model_type: str, patterns: object, style: str, where: str) -> ModelSpec:
    """``spec`` with the groups ``patterns`` exclude kept in the activation format
    (``module_dtypes``); ValueError (one line, naming ``where``) for a list it cannot read."""
    if style not in STYLES:
        raise ValueError(f"{where}: unknown match style {style!r}")
    if patterns is None:
        return spec
    if not isinstance(patterns, list):
        raise ValueError(f"{where} must be a list of module names, got {type(patterns).__name__}")
    matches = _matcher(patterns, style, where)
    kept: list[tuple[str, str]] = []
    params = group_params(spec, 1)
    for group, modules in group_modules(spec, model_type).items():
        if not modules or not params[group]:
            continue
        hit = [any(matches(n) for n in alternatives) for alternatives in modules]
        if all(hit):
            kept.append((group, activation_dtype(spec)))
        elif any(hit):
            example = next(alt[0] for alt, h in zip(modules, hit, strict=True) if h)
            raise ValueError(
                f"{where}: excludes {sum(hit)} of the {len(hit)} {group} modules (e.g. {example}); "
                "a group kept in two formats is not modelled"
            )
    return replace(spec, module_dtypes=tuple(kept)) if kept else spec
