"""Policies by CLI name, and the ``name:flag=value,...`` syntax that selects one with its flags.

Flags use the engines' own names (``max_num_batched_tokens``; dashes work too). Besides each
policy's own flags, every spec accepts the engine-wide ``block_size``,
``gpu_memory_utilization`` and ``max_model_len``, and ``fairness=vtc`` (with ``tenant_weights``)
for the policies whose waiting queue VTC can order (``policies/fairness.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from tailserve.core.config_flags import convert, field_choices, field_kinds
from tailserve.core.policy import Policy
from tailserve.policies.orca import OrcaPolicy
from tailserve.policies.sarathi import SarathiPolicy
from tailserve.policies.sglang import SglangPolicy
from tailserve.policies.sglang_decode import SglangDecodePolicy
from tailserve.policies.sglang_prefill import SglangPrefillPolicy
from tailserve.policies.slo import SloPolicy
from tailserve.policies.static import StaticPolicy
from tailserve.policies.tgi import TgiPolicy
from tailserve.policies.trtllm import TrtllmPolicy
from tailserve.policies.vllm import VllmPolicy
from tailserve.policies.vllm_v0 import VllmV0Policy

POLICIES: dict[str, type[Policy]] = {
    p.name: p
    for p in (
        StaticPolicy,
        OrcaPolicy,
        VllmV0Policy,
        VllmPolicy,
        SarathiPolicy,
        SglangPolicy,
        TgiPolicy,
        TrtllmPolicy,
        SloPolicy,
    )
}

# Policies whose config selects another class of rules: SGLang's P/D servers
# (``disaggregation_mode``, set by the pair, ``cluster/sglang_pd.py``).
_MODE_CLASSES: dict[tuple[str, str], type[Policy]] = {
    ("sglang", "decode"): SglangDecodePolicy,
    ("sglang", "prefill"): SglangPrefillPolicy,
}


def make_policy(cls: type[Policy], config: Any) -> Policy:
    """The policy that runs ``config``: ``cls``, or the class its P/D mode selects."""
    mode = getattr(config, "disaggregation_mode", "null")
    return _MODE_CLASSES.get((cls.name, mode), cls)(config)


ENGINE_FLAGS: dict[str, type] = {
    "block_size": int,
    "gpu_memory_utilization": float,
    "max_model_len": int,
    "fairness": str,  # none | vtc (policies/fairness.py); slo has it as its own flag
    "tenant_weights": str,  # a=2,b=1
    # the KV cache's size outright (kv_capacity.KVSizeFlags): vLLM's two, SGLang's
    "kv_cache_memory_bytes": int,
    "num_gpu_blocks_override": int,
    "max_total_tokens": int,
}
# What the command line's help says of each (a policy's ``default_<flag>`` is its default).
ENGINE_FLAG_HELP: dict[str, str] = {
    "block_size": "tokens per KV cache block (page)",
    "gpu_memory_utilization": "fraction of each GPU's memory for weights, activations and the KV cache",
    "max_model_len": "context length, prompt and output",
    "fairness": "none | vtc: order the waiting queue by tenants' virtual token counters "
    "(policies/fairness.py; the policies that admit from an FCFS queue)",
    "tenant_weights": "fairness=vtc: the tenants' weights, e.g. a=2,b=1",
    "kv_cache_memory_bytes": "the KV cache's bytes per GPU, instead of what gpu_memory_utilization leaves (vLLM)",
    "num_gpu_blocks_override": "the KV cache's blocks, whatever the memory gives (vLLM)",
    "max_total_tokens": "at most this many KV tokens (SGLang; TensorRT-LLM's kv_cache_config.max_tokens)",
}
ENGINE_FLAG_DEFAULTS: dict[str, str] = {
    "max_model_len": "the model's",
    "fairness": "none",
    "tenant_weights": "equal",
    "kv_cache_memory_bytes": "from gpu_memory_utilization",
    "num_gpu_blocks_override": "from the memory",
    "max_total_tokens": "no cap",
}


# Other names users type for the same engines (after lower-casing and ``_`` -> ``-``).
_ALIASES = {
    "vllm-v1": "vllm",
    "v1": "vllm",
    "v0": "vllm-v0",
    "vllmv0": "vllm-v0",
    "sarathi-serve": "sarathi",
    "text-generation-inference": "tgi",
    "tensorrt-llm": "trtllm",
    "trt-llm": "trtllm",
}


# The policies simulated under pipeline stages (``--pipeline-parallel-size``), as their configs
# say (a ``pipeline_parallel_size`` field): vllm in vLLM V1's batch queue (vllm_pipeline.py),
# trtllm in TensorRT-LLM's PP loop (trtllm_pipeline.py), the rest in Sarathi-Serve's pipelined
# engine (sarathi_pipeline.py), whose ModelConfig refuses a layer count the stages do not divide.
PIPELINED_POLICIES = tuple(
    name
    for name, cls in POLICIES.items()
    if "pipeline_parallel_size" in {f.name for f in fields(cls.config_cls)}
)
SARATHI_ENGINE = tuple(name for name in PIPELINED_POLICIES if POLICIES[name].pipeline_engine == "sarathi")


def runs_under_stages(name: str, num_layers: int, pp: int) -> bool:
    """Whether the policy ``name`` runs on ``pp`` stages of a model of ``num_layers`` layers."""
    return name in PIPELINED_POLICIES and (name not in SARATHI_ENGINE or num_layers % pp == 0)


def under_stages(listed: str, num_layers: int, pp: int) -> list[str]:
    """The entries of a comma-separated policy list (``name[:flags]``) that run on ``pp``
    stages of a model of ``num_layers`` layers (``runs_under_stages``)."""
    return [e for e in listed.split(",") if runs_under_stages(e.split(":")[0], num_layers, pp)]


def resolve_policy_name(name: str) -> str:
    """The registry's name for any accepted spelling (any case, ``_`` for ``-``, a few aliases)."""
    key = name.strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return key


def get_policy_cls(name: str) -> type[Policy]:
    return POLICIES[resolve_policy_name(name)]


def policy_flags(cls: type[Policy]) -> dict[str, type]:
    """The policy's own flags with their Python types."""
    return field_kinds(cls.config_cls)


def _flag_value(key: str, value: Any, kind: Any, choices: tuple[Any, ...] | None = None) -> Any:
    try:
        return convert(value, kind, choices)
    except ValueError as e:
        raise ValueError(f"flag {key}: {e}") from None


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A policy name with the flags the user set (converted to their types)."""

    name: str
    flags: dict[str, Any] = field(default_factory=dict)  # the policy's own flags
    engine_flags: dict[str, Any] = field(default_factory=dict)  # block_size, ...

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", resolve_policy_name(self.name))
        # Checked here, where every spec is made (flags, --policies, --engine-cmd, serve, run):
        # downstream a block size of 0 divides by zero and a context of 0 shrinks the token
        # budget, so the error would name max_num_batched_tokens instead.
        for name in ("block_size", "max_model_len"):
            value = self.engine_flags.get(name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 token, got {value}")

    @property
    def label(self) -> str:
        items = {**self.flags, **self.engine_flags}
        if not items:
            return self.name
        return self.name + ":" + ",".join(f"{k}={_flag_text(v)}" for k, v in items.items())

    @staticmethod
    def make(name: str, flags: dict[str, Any]) -> PolicySpec:
        name = resolve_policy_name(name)
        cls = POLICIES[name]
        own = policy_flags(cls)
        choices = field_choices(cls.config_cls)
        mine: dict[str, Any] = {}
        engine: dict[str, Any] = {}
        for raw_key, value in flags.items():
            key = raw_key.replace("-", "_")
            if key in own:
                mine[key] = _flag_value(key, value, own[key], choices.get(key))
            elif key in ENGINE_FLAGS:
                engine[key] = _flag_value(key, value, ENGINE_FLAGS[key])
            else:
                valid = ", ".join([*own, *ENGINE_FLAGS])
                raise ValueError(f"policy {name} has no flag {raw_key!r}; valid: {valid}")
        return PolicySpec(name, mine, engine)


def _flag_text(value: Any) -> str:
    """A flag's value as a policy spec spells it (a list of floats ``0.7/0.4``: commas there
    separate policies)."""
    if isinstance(value, tuple):
        return "/".join(map(str, value))
    return str(value)


def parse_policy_list(text: str) -> list[PolicySpec]:
    """``orca,vllm:max_num_batched_tokens=512,max_num_seqs=64,vllm`` -> three specs.

    A comma-separated item ``name`` or ``name:k=v[:k=v]`` starts a policy; a bare ``k=v`` item
    adds a flag to the policy before it.
    """
    specs: list[tuple[str, dict[str, str]]] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        head, _, rest = item.partition(":")
        if "=" in head:
            if not specs:
                raise ValueError(f"flag {item!r} comes before any policy name in {text!r}")
            parts = [item]
        else:
            specs.append((head, {}))
            parts = [p for p in rest.split(":") if p] if rest else []
        for part in parts:
            key, eq, value = part.partition("=")
            if not eq or not key:
                raise ValueError(f"{part!r} in {text!r} is not flag=value")
            specs[-1][1][key.strip()] = value.strip()
    if not specs:
        raise ValueError(f"no policy in {text!r}; known: {', '.join(POLICIES)}")
    return [PolicySpec.make(name, flags) for name, flags in specs]
