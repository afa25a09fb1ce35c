"""Speculative decoding on a launch line as the policy's fields.

The drafter and its draft count come from the line: vLLM's ``--speculative-config`` (JSON, or
its dotted keys), TensorRT-LLM's ``speculative_config`` (the options file), SGLang's
``--speculative-algorithm`` (its own flags, mapped by the table). What no real drafter states
is how many drafts the target accepts; the simulation needs it. It comes from the line where
the engine has a setting for it — vLLM's synthetic rejection sampler
(``"rejection_sample_method": "synthetic"`` with ``synthetic_acceptance_length`` or
``synthetic_acceptance_rates``, vLLM 0.32), SGLang's ``SGLANG_SIMULATE_ACC_LEN=L`` — and
otherwise from tailserve's ``--acceptance-length L``: the mean tokens per verification, the
bonus token included, which a running server reports (vLLM: ``1 +
vllm:spec_decode_num_accepted_tokens_total / vllm:spec_decode_num_drafts_total``). Given in both
places it is one error line, not a silent choice.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from tailserve.policies.vllm import VllmConfig

# The drafters the vllm policy runs: its config's own choices (executors/simulated/spec_decode.py).
METHODS: tuple[str, ...] = next(f for f in fields(VllmConfig) if f.name == "speculative_method").metadata[
    "choices"
]

# vLLM 0.32's MTP drafter names, each run as ``mtp`` (``MTPModelTypes``,
# vllm/config/speculative.py:39-67 and :1141-1145@v0.32.0; the old names are deprecated aliases).
VLLM_MTP_ALIASES = frozenset({
    "deepseek_mtp", "dots3_note_mtp", "mimo_mtp", "mimo_v2_mtp", "glm4_moe_mtp", "glm4_moe_lite_mtp",
    "glm_ocr_mtp", "ernie_mtp", "nemotron_h_mtp", "exaone_moe_mtp", "exaone4_5_mtp", "qwen3_next_mtp",
    "qwen4_exp_mtp", "qwen3_5_mtp", "longcat_flash_mtp", "bailing_hybrid_v3_mtp", "minimax_m3_mtp",
    "bailing_hybrid_mtp", "kimi_k3_mtp", "pangu_ultra_moe_mtp", "step3p5_mtp", "hy_v3_mtp", "hy_v4_mtp",
    "gemma4_mtp", "inkling_mtp", "glm5_next_mtp",
})  # fmt: skip
# The keys that decide what the scheduler and the cost model see; every other key of the config
# (the drafter's checkpoint, its TP, n-gram lookup sizes, ...) is listed as not simulated.
_VLLM_READ = frozenset({
    "method", "model", "num_speculative_tokens", "rejection_sample_method",
    "synthetic_acceptance_rates", "synthetic_acceptance_length",
})  # fmt: skip
# TensorRT-LLM's decoding types tailserve's trtllm policy drafts with (trtllm_config.DECODING_TYPES).
_TRTLLM_MODELLED = ("MTP", "Eagle3")
_TRTLLM_READ = frozenset({"decoding_type", "num_nextn_predict_layers", "max_draft_len"})
ACCEPTANCE_HOW = "--acceptance-length L (mean tokens per verification, the bonus token included)"


def vllm_fields(value: Any, acceptance_length: float | None) -> tuple[dict[str, Any], list[str]]:
    """vLLM's ``--speculative-config`` as the vllm policy's fields, and what it leaves out (one
    "--speculative-config ..." entry each). The drafter is resolved as vLLM 0.32's
    ``SpeculativeConfig.__post_init__`` does from the line alone: ``method``, else ``model``
    (``ngram``, a name with ``eagle-`` / ``eagle3`` in it), MTP's model-type names as ``mtp``.
    ValueError (one line) for a config vLLM refuses or one the simulation cannot run."""
    config = json_object(value, "--speculative-config")
    method = config.get("method")
    model = config.get("model")
    if method is None:
        if model is None:
            raise ValueError("--speculative-config gives neither a method nor a model (vLLM refuses it)")
        method = _vllm_method_from_model(str(model))
    method = str(method)
    if method == "[ngram]":
        method = "ngram"
    if method in VLLM_MTP_ALIASES:
        method = "mtp"
    if method not in METHODS:
        return {}, [
            f"--speculative-config (method {method}: not modelled; tailserve drafts with {', '.join(METHODS)})"
        ]
    k = config.get("num_speculative_tokens")
    if k is None:
        raise ValueError(
            f"--speculative-config: method {method} without num_speculative_tokens (vLLM reads a default "
            "from the drafter's checkpoint, which tailserve does not open): give it in the config"
        )
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer >= 1, got {k!r}")
    flags: dict[str, Any] = {"speculative_method": method, "num_speculative_tokens": k}
    rates = config.get("synthetic_acceptance_rates")
    length = config.get("synthetic_acceptance_length")
    if config.get("rejection_sample_method", "standard") == "synthetic":
        if rates is None and length is None:
            raise ValueError(
                "--speculative-config: rejection_sample_method='synthetic' requires exactly one of "
                "synthetic_acceptance_rates or synthetic_acceptance_length (vLLM refuses the line)"
            )
        if acceptance_length is not None:
            raise ValueError(
                "--acceptance-length and the line's synthetic acceptance both give the acceptance: give it once"
            )
        if rates is not None:
            flags["synthetic_acceptance_rates"] = _numbers(rates, "synthetic_acceptance_rates")
        if length is not None:
            flags["synthetic_acceptance_length"] = _number(length, "synthetic_acceptance_length")
        # neither, or both: the policy's check says so in vLLM's words
    elif rates is not None or length is not None:
        raise ValueError(
            "--speculative-config: synthetic_acceptance_rates / synthetic_acceptance_length are only valid "
            "with rejection_sample_method='synthetic' (vLLM refuses the line)"
        )
    elif acceptance_length is not None:
        flags["synthetic_acceptance_length"] = acceptance_length
    else:
        raise ValueError(
            f"--speculative-config ({method}, {k} drafts) needs an acceptance to simulate: give {ACCEPTANCE_HOW}, "
            'or add "rejection_sample_method": "synthetic", "synthetic_acceptance_length": L to the config'
        )
    left = sorted(set(config) - _VLLM_READ)
    if model is not None and method not in ("mtp", "ngram", "ngram_gpu"):
        left.insert(0, "model")  # EAGLE's own checkpoint: priced as one layer of the target
    ignored = [f"--speculative-config {', '.join(left)} (not modelled)"] if left else []
    return flags, ignored


def _vllm_method_from_model(model: str) -> str:
    """``method`` left out: vLLM's guess from the draft model's name (the checks it makes
    without opening the checkpoint; a model whose config names the method is ``draft_model``
    here)."""
    if model in ("ngram", "[ngram]"):
        return "ngram"
    name = model.lower()
    if "eagle-" in name:
        return "eagle"
    if "eagle3" in name:
        return "eagle3"
    return "draft_model"


def trtllm_fields(value: Any, acceptance_length: float | None) -> tuple[dict[str, Any], list[str]]:
    """TensorRT-LLM's ``speculative_config`` (the options file's mapping) as the trtllm policy's
    fields, and what it leaves out. TensorRT-LLM has no setting that fixes the acceptance, so
    it comes from ``--acceptance-length``."""
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a mapping, got {value!r}")
    kind = value.get("decoding_type")
    if kind not in _TRTLLM_MODELLED:
        return {}, [
            f"speculative_config (decoding_type {kind}: not modelled; tailserve drafts with "
            f"{', '.join(_TRTLLM_MODELLED)})"
        ]
    flags: dict[str, Any] = {"decoding_type": kind}
    left = sorted(set(value) - _TRTLLM_READ)
    if kind == "MTP":
        if value.get("num_nextn_predict_layers") is not None:
            flags["num_nextn_predict_layers"] = value["num_nextn_predict_layers"]
        if value.get("max_draft_len") is not None:
            left.insert(0, "max_draft_len")  # MTP's draft count is num_nextn_predict_layers
    else:
        if value.get("max_draft_len") is not None:
            flags["max_draft_len"] = value["max_draft_len"]
        if value.get("num_nextn_predict_layers") is not None:
            left.insert(0, "num_nextn_predict_layers")
    if acceptance_length is None:
        raise ValueError(
            f"speculative_config ({kind}) needs an acceptance to simulate, which TensorRT-LLM has no setting "
            f"for: give {ACCEPTANCE_HOW}"
        )
    flags["synthetic_acceptance_length"] = acceptance_length
    ignored = [f"speculative_config {', '.join(left)} (not modelled)"] if left else []
    return flags, ignored


def sglang_acceptance(env: dict[str, str], acceptance_length: float | None) -> float:
    """SGLang's own synthetic acceptance, ``SGLANG_SIMULATE_ACC_LEN=L`` before the line (tokens
    accepted per verification, the bonus token included: ``spec_utils.py:276``, ``:535-566``
    @v0.5.23, off when <= 0), or ``--acceptance-length``; one of them is needed."""
    text = env.get("SGLANG_SIMULATE_ACC_LEN")
    try:
        length = float(text) if text is not None else 0.0
    except ValueError:
        raise ValueError(f"SGLANG_SIMULATE_ACC_LEN={text!r} is not a number") from None
    if length > 0 and acceptance_length is not None:
        raise ValueError(
            "--acceptance-length and the line's SGLANG_SIMULATE_ACC_LEN both give the acceptance: give it once"
        )
    if length > 0:
        return length
    if acceptance_length is not None:
        return acceptance_length
    raise ValueError(
        f"--speculative-algorithm needs an acceptance to simulate: give {ACCEPTANCE_HOW}, or prefix the "
        "line with SGLang's SGLANG_SIMULATE_ACC_LEN=L"
    )


def json_object(value: Any, flag: str) -> dict[str, Any]:
    """A flag's JSON object as vLLM's parser reads it (a dict from dotted keys or a config file
    already); ValueError naming the flag otherwise."""
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(str(value))
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not JSON ({e.msg} at character {e.pos}): {value!r}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{flag} must be a JSON object, got {value!r}")
    return parsed


def _number(value: Any, name: str) -> float:
    """A number, or text of one (``key+ 0.8,0.5`` gives text; vLLM's config converts it)."""
    if not isinstance(value, bool) and isinstance(value, int | float | str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ValueError(f"--speculative-config: {name} must be a number, got {value!r}")


def _numbers(value: Any, name: str) -> tuple[float, ...]:
    if not isinstance(value, list):
        raise ValueError(f"--speculative-config: {name} must be a list of numbers, got {value!r}")
    return tuple(_number(v, name) for v in value)
