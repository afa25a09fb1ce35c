"""The real executor's half of assembly: load a Hugging Face model directory, size the KV cache
from the memory it is given (a fixed budget on CPU, vLLM's rule on CUDA), allocate the paged KV
tensors and the CPU swap space the scheduler's pool mirrors, and the ``TorchExecutor``.

Imported only when a torch engine is built, so the simulator never imports torch.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from tailserve.assemble.scheduler import GIB, SchedulerParts, build_scheduler
from tailserve.core.device import DeviceInfo
from tailserve.core.host_memory import cpu_memory_available
from tailserve.executors.pytorch.attention import CpuSwapSpace, PagedKVCache
from tailserve.executors.pytorch.backend import auto_dtype, backend_for
from tailserve.executors.pytorch.executor import TorchExecutor
from tailserve.executors.pytorch.loader import load_config, load_state_dict
from tailserve.executors.pytorch.model import LlamaModel
from tailserve.executors.pytorch.sampler import Sampler
from tailserve.executors.pytorch.threads import ThreadController
from tailserve.executors.simulated.kv_capacity import KV_SIZE_FLAGS
from tailserve.policies.registry import PolicySpec, get_policy_cls

DEFAULT_CPU_KV_CACHE_GIB = 2.0  # like the VLLM_CPU_KVCACHE_SPACE=2 our vLLM-CPU comparisons use
ACTIVATION_PROFILE_TOKENS = 8192  # the largest batch the CUDA activation reserve is sized for


@dataclass(frozen=True, slots=True)
class TorchKVSize:
    num_blocks: int
    block_size: int  # tokens per block
    kv_bytes_per_token: int
    kv_gib: float  # the budget the blocks were cut from


@dataclass(slots=True)
class TorchParts:
    parts: SchedulerParts
    executor: TorchExecutor
    label: str  # "21.0 M parameters, bfloat16, cpu"


def torch_parts(
    model_dir: str | Path,
    spec: PolicySpec,
    *,
    dtype: str,
    device: str,
    seed: int,
    max_model_len: int | None,
    kv_cache_memory_gib: float | None,
    eos_token_ids: tuple[int, ...],
    threads: int | None = None,
) -> TorchParts:
    sized = [name for name in KV_SIZE_FLAGS if spec.engine_flags.get(name) is not None]
    if sized:  # before loading anything
        raise ValueError(
            f"{sized[0]} sizes the simulated KV cache; the real executor's is kv_cache_memory_gib "
            "(tailserve serve/run --kv-cache-memory-gib) or gpu_memory_utilization"
        )
    try:
        dev = torch.device(device)
    except RuntimeError as e:  # torch's message lists every device type it knows
        raise ValueError(f"--device {device!r}: not a torch device (cpu, cuda, cuda:N)") from e
    if dev.type != "cpu":
        # cuda has its own backend; another accelerator (mps, xpu) runs PyTorch's generic ops.
        module = getattr(torch, dev.type, None)
        # The device as given (cuda:7, not cuda): the user's value, which may name one of several.
        if module is None or not module.is_available():
            raise ValueError(
                f"--device {device!r} was asked for but torch.{dev.type}.is_available() is False"
            )
        count = getattr(module, "device_count", lambda: None)()
        if dev.index is not None and count is not None and dev.index >= count:
            raise ValueError(f"--device {device!r}: this machine has {count} {dev.type} device(s)")
    backend = backend_for(dev)  # a bad TAILSERVE_CPU_ISA is refused here, before loading
    if dtype == "auto":
        dtype, why = auto_dtype(dev)
        if why is not None:
            print(f"tailserve: {why}", file=sys.stderr, flush=True)
    torch_dtype = getattr(torch, dtype)
    config = load_config(model_dir)
    max_len = spec.engine_flags.get("max_model_len", max_model_len or config.max_position_embeddings)
    if max_len > config.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_len} exceeds the model's max_position_embeddings "
            f"({config.max_position_embeddings})"
        )
    state = load_state_dict(model_dir, config, torch_dtype, dev)
    lm = LlamaModel(config, state, torch_dtype, dev, backend)
    cls = get_policy_cls(spec.name)
    block_size = spec.engine_flags.get("block_size", cls.default_block_size)
    gmu = spec.engine_flags.get("gpu_memory_utilization", cls.default_gpu_memory_utilization)
    kv_bytes = kv_budget_bytes(lm, dev, gmu, kv_cache_memory_gib)
    device_info = DeviceInfo("CPU", kv_bytes / GIB, vendor="cpu") if dev.type == "cpu" else _cuda_info(dev)

    def size_kv(_config: object) -> TorchKVSize:
        num_blocks = int(kv_bytes // (block_size * lm.kv_bytes_per_token))
        if num_blocks * block_size < max_len:
            raise ValueError(
                f"The model's max seq len ({max_len}) is larger than the maximum number of tokens that "
                f"can be stored in KV cache ({num_blocks * block_size}). Increase kv_cache_memory_gib or "
                "gpu_memory_utilization, or decrease max_model_len."
            )
        return TorchKVSize(num_blocks, block_size, lm.kv_bytes_per_token, kv_bytes / GIB)

    # A live engine sees token ids, so prefix caching is always possible.
    # On CPU vLLM's own rule has async scheduling off; on a GPU the executor is what forbids it.
    parts = build_scheduler(
        spec, device_info, max_len, size_kv, shares_prefixes=True,
        synchronous="tailserve's real executor runs steps synchronously",
    )  # fmt: skip
    paged = PagedKVCache(
        config.num_hidden_layers,
        parts.kv_size.num_blocks,
        block_size,
        config.num_key_value_heads,
        config.head_dim,
        torch_dtype,
        dev,
    )
    if dev.type == "cpu":
        # Backed now rather than a page fault at a time while serving (~0.15 ms of a decode step
        # at batch 64 until the cache has been used once; docs/executor.md "r46").
        paged.populate()
    swap = None
    if parts.num_cpu_blocks:
        swap = CpuSwapSpace(config.num_hidden_layers, parts.num_cpu_blocks, paged)
    # CPU threads: the cores free of other work, or a fixed count (executors/pytorch/threads.py).
    controller = ThreadController(threads) if dev.type == "cpu" else None
    executor = TorchExecutor(lm, paged, Sampler(eos_token_ids, seed, dev), swap, controller)
    executor.warm_up()
    label = f"{lm.num_parameters / 1e6:.1f} M parameters, {dtype}, {dev}"
    if controller is not None:
        label += f", {controller.label}"
    label += f"; {backend.describe(torch_dtype, lm.norm_ops.fused, lm.head_dim)}"
    return TorchParts(parts, executor, label)


def kv_budget_bytes(lm: LlamaModel, dev: torch.device, gmu: float, kv_gib: float | None) -> float:
    if kv_gib is not None and not kv_gib > 0:  # NaN too: it fails every comparison
        raise ValueError(f"kv_cache_memory_gib must be positive, got {kv_gib}")
    if dev.type == "cpu":
        budget = (kv_gib if kv_gib is not None else DEFAULT_CPU_KV_CACHE_GIB) * GIB
        # An oversized cache would run the machine out of memory as its pages are backed (at
        # build, or as serving fills it where ``populate`` is refused): refuse it here instead.
        available = cpu_memory_available()
        if available is not None and budget > available:
            raise ValueError(
                f"the KV cache ({budget / GIB:.2f} GiB) is larger than the memory this machine has "
                f"available ({available / GIB:.2f} GiB, MemAvailable in /proc/meminfo); lower "
                "kv_cache_memory_gib (--kv-cache-memory-gib)"
            )
        return budget
    if kv_gib is not None:
        return kv_gib * GIB
    # vLLM's rule: gpu_memory_utilization of the device, minus what is in use (weights) and an
    # activation reserve for the largest batch.
    free, total = torch.cuda.mem_get_info(dev)
    cfg = lm.config
    activation = (
        ACTIVATION_PROFILE_TOKENS * (cfg.hidden_size * 6 + cfg.intermediate_size * 3) * lm.dtype.itemsize
    )
    budget = total * gmu - (total - free) - activation
    if budget <= 0:
        raise ValueError(f"no GPU memory left for the KV cache at gpu_memory_utilization={gmu}")
    return budget


def _cuda_info(dev: torch.device) -> DeviceInfo:
    props = torch.cuda.get_device_properties(dev)
    return DeviceInfo(props.name, props.total_memory / GIB)
