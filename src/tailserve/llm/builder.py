"""Assemble an ``LLMEngine``: model directory, policy and its flags, KV cache sized from memory,
and the executor (PyTorch, or the simulated one paced in real time)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tailserve.core.device import DeviceInfo
from tailserve.core.engine import EngineOptions
from tailserve.core.kv_factory import make_kv_cache
from tailserve.core.scheduler import Scheduler
from tailserve.llm.llm_engine import LLMEngine
from tailserve.policies.registry import PolicySpec, get_policy_cls

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_CPU_KV_CACHE_GIB = 2.0  # like the VLLM_CPU_KVCACHE_SPACE=2 our vLLM-CPU comparisons use


def build_engine(
    model: str | Path | None = None,
    *,
    executor: str = "torch",
    policy: str = "vllm",
    policy_flags: dict[str, Any] | None = None,
    dtype: str = "bfloat16",
    device: str = "cpu",
    seed: int = 0,
    hardware: str = "H100-SXM",
    sim_model: str = "Llama-3-8B",
    tensor_parallel_size: int = 1,
    calibration: str = "auto",
    max_model_len: int | None = None,
    kv_cache_memory_gib: float | None = None,
    served_model_name: str | None = None,
    check_integrity: bool = False,
) -> LLMEngine:
    from tailserve.executors.pytorch.loader import load_config
    from tailserve.executors.pytorch.tokenizer import Tokenizer

    if executor not in ("torch", "sim"):
        raise ValueError(f"executor must be 'torch' or 'sim', got {executor!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if model is None:
        from tailserve.executors.pytorch.init_model import default_model_dir

        model = default_model_dir()
    config = load_config(model)
    tokenizer = Tokenizer.from_dir(model)
    spec = PolicySpec.make(policy, dict(policy_flags or {}))
    cls = get_policy_cls(policy)
    options = EngineOptions(fast_forward=False, check_integrity=check_integrity, keep_iteration_log=False)
    eos = tuple(dict.fromkeys((*config.eos_token_ids, *tokenizer.eos_token_ids)))
    name = served_model_name or config.name
    if executor == "sim":
        return _build_sim(
            spec,
            cls,
            tokenizer,
            name,
            eos,
            hardware,
            sim_model,
            tensor_parallel_size,
            calibration,
            max_model_len,
            seed,
            options,
        )
    return _build_torch(
        model,
        config,
        spec,
        cls,
        tokenizer,
        name,
        eos,
        dtype,
        device,
        seed,
        max_model_len,
        kv_cache_memory_gib,
        options,
    )


def _build_torch(
    model_dir, config, spec, cls, tokenizer, name, eos, dtype, device, seed, max_model_len, kv_gib, options
):
    import torch

    from tailserve.executors.pytorch.attention import CpuSwapSpace, PagedKVCache
    from tailserve.executors.pytorch.executor import TorchExecutor
    from tailserve.executors.pytorch.loader import load_state_dict
    from tailserve.executors.pytorch.model import LlamaModel
    from tailserve.executors.pytorch.sampler import Sampler

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch.cuda.is_available() is False")
    torch_dtype = getattr(torch, dtype)
    max_len = spec.engine_flags.get("max_model_len", max_model_len or config.max_position_embeddings)
    if max_len > config.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_len} exceeds the model's max_position_embeddings "
            f"({config.max_position_embeddings})"
        )
    state = load_state_dict(model_dir, config, torch_dtype, dev)
    lm = LlamaModel(config, state, torch_dtype, dev)
    block_size = spec.engine_flags.get("block_size", cls.default_block_size)
    kv_bytes = _kv_budget_bytes(lm, dev, spec, cls, kv_gib)
    device_info = DeviceInfo("CPU", kv_bytes / 2**30, vendor="cpu") if dev.type == "cpu" else _cuda_info(dev)
    policy_config = cls.default_config(device_info, max_len, **spec.flags)
    num_blocks = int(kv_bytes // (block_size * lm.kv_bytes_per_token))
    if num_blocks * block_size < max_len:
        raise ValueError(
            f"The model's max seq len ({max_len}) is larger than the maximum number of tokens that can "
            f"be stored in KV cache ({num_blocks * block_size}). Increase kv_cache_memory_gib or "
            "gpu_memory_utilization, or decrease max_model_len."
        )
    swap_gib = getattr(policy_config, "swap_space", 0.0)
    num_cpu_blocks = int(swap_gib * 2**30 // (block_size * lm.kv_bytes_per_token))
    kv_manager = make_kv_cache(policy_config, num_blocks, block_size, num_cpu_blocks, shares_prefixes=True)
    scheduler = Scheduler(cls(policy_config), kv_manager, max_len)
    paged = PagedKVCache(
        config.num_hidden_layers,
        num_blocks,
        block_size,
        config.num_key_value_heads,
        config.head_dim,
        torch_dtype,
        dev,
    )
    swap = None
    if num_cpu_blocks:
        swap = CpuSwapSpace(config.num_hidden_layers, num_cpu_blocks, paged)
    sampler = Sampler(eos, seed, dev)
    executor = TorchExecutor(lm, paged, sampler, swap)
    executor.warm_up()
    described = (
        f"{name} ({lm.num_parameters / 1e6:.1f} M parameters, {dtype}, {dev}) under {spec.label}; "
        f"KV cache {num_blocks} blocks x {block_size} tokens"
    )
    return LLMEngine(
        scheduler,
        executor,
        tokenizer,
        name,
        eos_token_ids=eos,
        release=executor.release,
        options=options,
        description=described,
    )


def _kv_budget_bytes(lm, dev, spec, cls, kv_gib: float | None) -> float:
    if kv_gib is not None:
        if kv_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be positive, got {kv_gib}")
        return kv_gib * 2**30
    if dev.type == "cpu":
        return DEFAULT_CPU_KV_CACHE_GIB * 2**30
    import torch

    # vLLM's rule: gpu_memory_utilization of the device, minus what is in use (weights) and an
    # activation reserve for the largest batch.
    free, total = torch.cuda.mem_get_info(dev)
    gmu = spec.engine_flags.get("gpu_memory_utilization", cls.default_gpu_memory_utilization)
    cfg = lm.config
    tokens = 8192
    activation = tokens * (cfg.hidden_size * 6 + cfg.intermediate_size * 3) * lm.dtype.itemsize
    budget = total * gmu - (total - free) - activation
    if budget <= 0:
        raise ValueError(f"no GPU memory left for the KV cache at gpu_memory_utilization={gmu}")
    return budget


def _cuda_info(dev) -> DeviceInfo:
    import torch

    props = torch.cuda.get_device_properties(dev)
    return DeviceInfo(props.name, props.total_memory / 2**30)


def _build_sim(
    spec, cls, tokenizer, name, eos, hardware, sim_model, tp, calibration, max_model_len, seed, options
):
    from tailserve.llm.realtime_sim import RealtimeSimExecutor
    from tailserve.simulation import Deployment, build_cost_model, policy_kv_capacity

    deployment = Deployment(model=sim_model, hardware=hardware, tp=tp, calibration=calibration)
    built = build_cost_model(deployment)
    cost_model = built.cost_model
    model_spec = cost_model.model
    max_len = spec.engine_flags.get("max_model_len", max_model_len or model_spec.max_position_embeddings)
    policy_config = cls.default_config(cost_model.hardware.device_info, max_len, **spec.flags)
    capacity = policy_kv_capacity(cost_model, spec, policy_config, max_len)
    block_size = capacity.block_size
    kv_manager = make_kv_cache(policy_config, capacity.num_blocks, block_size, 0, shares_prefixes=True)
    scheduler = Scheduler(cls(policy_config), kv_manager, max_len)
    executor = RealtimeSimExecutor(cost_model, block_size, tokenizer.vocab_size, set(eos), seed)
    described = f"simulated {model_spec.name} on {cost_model.hardware.name} x{tp} under {spec.label}"
    engine = LLMEngine(
        scheduler, executor, tokenizer, name, eos_token_ids=(), options=options, description=described
    )
    # What bench --predict should simulate to predict this server (served in /v1/models).
    engine.deployment = {
        "model": model_spec.name,
        "hardware": cost_model.hardware.name,
        "tp": tp,
        "calibration": deployment.calibration,
        "policy": spec.label,
    }
    return engine
