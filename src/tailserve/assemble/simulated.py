"""The simulated executors' half of assembly: KV blocks sized from the catalog GPU's memory the
way vLLM sizes them, and the cost-model executor (virtual time) or its real-time pacing."""

from __future__ import annotations

from typing import Any

from tailserve.assemble.scheduler import SchedulerParts, build_scheduler
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.kv_capacity import KV_SIZE_FLAGS, KVCapacity, KVSizeFlags, kv_capacity
from tailserve.policies.registry import PolicySpec, get_policy_cls


def policy_kv_capacity(
    cost_model: CostModel, spec: PolicySpec, config: Any, max_model_len: int
) -> KVCapacity:
    """KV blocks a policy's engine gets on the simulated deployment (its block size and memory
    fraction, activation reserve for its largest batch, its drafter's weights and KV layers:
    ``Policy.drafter_memory``); ValueError, with vLLM's message, when
    one full-length sequence would not fit."""
    cls = get_policy_cls(spec.name)
    hardware = cost_model.hardware
    model, extra_weights, pp = cost_model.fullest_stage  # each stage's GPUs: its layers' weights and KV
    sized = KVSizeFlags.of(spec.engine_flags)
    capacity = kv_capacity(
        model,
        hardware,
        cost_model.tp,
        spec.engine_flags.get("gpu_memory_utilization", cls.default_gpu_memory_utilization),
        spec.engine_flags.get("block_size", cls.default_block_size),
        cls.profile_tokens(config, max_model_len),
        # the running-request limit, for a hybrid sliding-window model's KV (kv_capacity.py)
        getattr(config, "max_num_seqs", None) or getattr(config, "max_running_requests", None) or 0,
        cost_model.dp,
        of_free_memory=cls.memory_fraction_of_free,
        drafter=cls.drafter_memory(config),
        sized=sized,
        extra_weights=extra_weights,
        pp=pp,
    )
    if capacity.num_tokens < max_model_len and sized is not None:
        given = ", ".join(f"{k}={v}" for k, v in spec.engine_flags.items() if k in KV_SIZE_FLAGS)
        raise ValueError(
            f"{given} holds {capacity.num_tokens} KV tokens, fewer than one sequence of the context length "
            f"({max_model_len}): give a context length (vLLM --max-model-len, SGLang --context-length, "
            "TensorRT-LLM --max_seq_len) at most that, or a larger cache"
        )
    if capacity.num_tokens < max_model_len:
        raise ValueError(
            f"The model's max seq len ({max_model_len}) is larger than the maximum number of tokens "
            f"that can be stored in KV cache ({capacity.num_tokens}) for {model.name} on "
            f"{hardware.name} at TP {cost_model.tp}{f' x DP {cost_model.dp}' if cost_model.dp > 1 else ''}"
            f"{f' x PP {cost_model.pipeline.pp}' if cost_model.pipeline is not None else ''}. Try increasing gpu_memory_utilization or "
            "decreasing max_model_len."
        )
    return capacity


def simulated_scheduler(
    cost_model: CostModel,
    spec: PolicySpec,
    max_model_len: int,
    *,
    shares_prefixes: bool,
    cpu_swap: bool,
    synchronous: str = "",
) -> SchedulerParts:
    """``synchronous``: why the executor steps only synchronously (``build_scheduler``)."""
    return build_scheduler(
        spec,
        cost_model.hardware.device_info,
        max_model_len,
        lambda config: policy_kv_capacity(cost_model, spec, config, max_model_len),
        shares_prefixes=shares_prefixes,
        cpu_swap=cpu_swap,
        synchronous=synchronous,
        # vLLM's CPUOffloadingSpec keeps every rank's shard of a block, or one copy where the
        # ranks replicate it (MLA under TP: ``replicated_layout``, kv_offload/cpu/spec.py:106-110@v0.32.0)
        host_copies=1 if cost_model.model.is_mla else cost_model.tp,
    )
