"""KV-cache capacity the way vLLM sizes it, per tensor-parallel shard.

blocks = (memory x gpu_memory_utilization - weights - activation reserve) / bytes per block

vLLM measures the activation peak with a profiling forward pass of ``max_num_batched_tokens``
tokens; here it is estimated from the model's shapes, plus a fixed reserve for the CUDA context,
CUDA graphs and communication buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tailserve.executors.simulated.hardware import Hardware
from tailserve.executors.simulated.models import ModelSpec

GIB = 2**30
NON_TORCH_RESERVE_GIB = 1.0  # CUDA context, CUDA graphs, NCCL buffers


@dataclass(frozen=True, slots=True)
class KVCapacity:
    num_blocks: int
    block_size: int  # tokens per block
    kv_bytes_per_token: int  # per shard
    memory_gib: float
    usable_gib: float  # memory x gpu_memory_utilization
    weights_gib: float
    activation_gib: float
    kv_gib: float

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def activation_reserve_bytes(model: ModelSpec, tp: int, max_num_batched_tokens: int) -> float:
    # Peak of one forward over the budget: residual stream, q/k/v/o and the MLP's gate and up
    # projections (sharded), each token once, in the model's dtype.
    per_token = 6 * model.hidden_size + 3 * model.intermediate_size / tp
    return max_num_batched_tokens * per_token * model.dtype_bytes + NON_TORCH_RESERVE_GIB * GIB


def kv_capacity(
    model: ModelSpec,
    hardware: Hardware,
    tp: int,
    gpu_memory_utilization: float,
    block_size: int,
    max_num_batched_tokens: int,
) -> KVCapacity:
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    usable = hardware.memory_bytes * gpu_memory_utilization
    weights = model.weight_bytes_per_shard(tp)
    activation = activation_reserve_bytes(model, tp, max_num_batched_tokens)
    kv = usable - weights - activation
    per_block = block_size * model.kv_bytes_per_token(tp)
    if kv < per_block:
        need = weights + activation
        # The smallest TP (a divisor of the head count, as vLLM requires) that leaves room for KV.
        fits = [
            t
            for t in range(tp + 1, model.num_heads + 1)
            if model.num_heads % t == 0
            and usable
            - model.weight_bytes_per_shard(t)
            - activation_reserve_bytes(model, t, max_num_batched_tokens)
            > per_block * 64
        ]
        hint = ""
        if fits:
            hint = f"; the minimum is TP {fits[0]}, try --tp {fits[0]}"
            if fits[0] > 8:
                hint += f" ({model.num_heads} heads divide by {fits[0]}; more GPUs than one 8-GPU node)"
        raise ValueError(
            f"{model.name} does not fit on {hardware.name} at TP {tp}: weights {weights / GIB:.1f} GiB "
            f"+ activations {activation / GIB:.1f} GiB per GPU need {need / GIB:.1f} GiB, but "
            f"{gpu_memory_utilization:.2f} x {hardware.memory_gib:.1f} GiB = {usable / GIB:.1f} GiB "
            f"is usable{hint}"
        )
    return KVCapacity(
        num_blocks=math.floor(kv / per_block),
        block_size=block_size,
        kv_bytes_per_token=model.kv_bytes_per_token(tp),
        memory_gib=hardware.memory_gib,
        usable_gib=usable / GIB,
        weights_gib=weights / GIB,
        activation_gib=activation / GIB,
        kv_gib=kv / GIB,
    )
