"""Assemble an ``LLMEngine`` from a model directory and engine flags: the tokenizer and EOS ids
come from the directory; the scheduler, its KV cache and the executor (PyTorch, or the simulated
one paced in real time) from ``assemble.build_engine``, the same path the simulator takes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tailserve.assemble import BuildOptions, build_engine
from tailserve.core.engine import EngineOptions
from tailserve.llm.llm_engine import LLMEngine
from tailserve.policies.registry import PolicySpec
from tailserve.sim.deployment import Deployment, build_cost_model

DTYPES = ("float32", "bfloat16", "float16")


def build_llm_engine(
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
    threads: int | None = None,
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
    options = EngineOptions(fast_forward=False, check_integrity=check_integrity, keep_iteration_log=False)
    eos = tuple(dict.fromkeys((*config.eos_token_ids, *tokenizer.eos_token_ids)))
    name = served_model_name or config.name
    if executor == "sim":
        deployment = Deployment(
            model=sim_model, hardware=hardware, tp=tensor_parallel_size, calibration=calibration
        )
        cost_model = build_cost_model(deployment)
        built = build_engine(
            cost_model,
            spec,
            "realtime-sim",
            # A stand-in server keeps no CPU swap pool (as it always has); its placeholder
            # tokens avoid the tokenizer's EOS and special ids.
            BuildOptions(
                max_model_len=max_model_len,
                cpu_swap=False,
                seed=seed,
                eos_token_ids=eos,
                vocab_size=tokenizer.vocab_size,
            ),
        )
        engine = LLMEngine(
            built.scheduler,
            built.executor,
            tokenizer,
            name,
            eos_token_ids=(),
            options=options,
            description=f"{built.label} under {spec.label}",
        )
        # What bench --predict should simulate to predict this server (served in /v1/models).
        engine.deployment = {
            "model": cost_model.cost_model.model.name,
            "hardware": cost_model.cost_model.hardware.name,
            "tp": tensor_parallel_size,
            "calibration": deployment.calibration,
            "policy": spec.label,
        }
        return engine
    built = build_engine(
        Path(model),
        spec,
        "torch",
        BuildOptions(
            max_model_len=max_model_len,
            seed=seed,
            dtype=dtype,
            device=device,
            kv_cache_memory_gib=kv_cache_memory_gib,
            threads=threads,
            eos_token_ids=eos,
        ),
    )
    kv = built.kv_size
    return LLMEngine(
        built.scheduler,
        built.executor,
        tokenizer,
        name,
        eos_token_ids=eos,
        release=built.release,
        options=options,
        description=f"{name} ({built.label}) under {spec.label}; "
        f"KV cache {kv.num_blocks} blocks x {kv.block_size} tokens",
    )
