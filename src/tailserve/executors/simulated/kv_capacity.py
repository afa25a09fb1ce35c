"""KV-cache capacity the way vLLM sizes it, per tensor-parallel shard.

blocks = (memory x gpu_memory_utilization - weights - activation reserve) / bytes per block

TensorRT-LLM (``of_free_memory``) takes its fraction of what is left instead:

blocks = (memory - weights - activation reserve) x free_gpu_memory_fraction / bytes per block

(``KvCacheCreator`` in ``tensorrt_llm/_torch/pyexecutor/_util.py``: ``estimate_max_tokens``
profiles a forward of ``max_num_tokens``, takes the peak, torch and non-torch, as
``peak_memory``, and ``_cal_max_tokens`` / ``_cal_max_memory`` size the pool as
``(total_gpu_memory - peak_memory + allocated_bytes) * fraction``, ``allocated_bytes`` being
the temporary KV of the profiling run, given back).

A speculative drafter on the GPU (``drafter``, a ``drafter_memory.DrafterMemory`` from the
policy's ``drafter_memory`` hook) is loaded before the pool is sized, so its weights are added to
the target's, and its attention layers hold KV for every token, added to each token's bytes:
vLLM's and SGLang's one draft layer, TensorRT-LLM's MTP / EAGLE-3 layers run inside the target
(``_get_kv_size_per_token``: the draft layers' cache size per token is added).

vLLM measures the activation peak with a profiling forward pass of ``max_num_batched_tokens``
tokens; here it is estimated from the model's shapes, plus a fixed reserve for the CUDA context,
CUDA graphs and communication buffers.

A model with both sliding-window and full-attention layers (gpt-oss, Gemma 2/3) is sized as
vLLM's hybrid KV cache manager sizes it (vllm/v1/core/kv_cache_utils.py,
``_get_kv_cache_groups_uniform_page_size`` and ``get_kv_cache_config_from_groups``): the layers
of each kind are grouped ``group_size`` at a time (the smaller kind's count, or the larger's when
it is under 1.5 times the smaller), and one pool of pages, each ``block_size`` tokens of
``group_size`` layers, serves every group. A full-attention group holds all of a request's
tokens; a sliding group only the blocks its window covers (``SlidingWindowManager`` frees the
others). tailserve's KV managers count one block table per request, so they are given the
pool as the full-attention groups see it: one manager block is a page in each full group, and
the sliding groups' pages are set aside for ``max_num_seqs`` running requests at their window
(``ceil((window - 1) / block_size) + 1`` pages each, the most a decoding request holds). When
that leaves less than an even split over all groups (vLLM's "GPU KV cache size" line), the even
split, which is exact for requests no longer than the window. Either way the manager never
admits more than the pool holds. (A prefill chunk briefly holds window + chunk tokens in the
sliding groups; not set aside.) A model whose every layer slides is sized as a dense one: its
requests are charged all their tokens, where vLLM keeps only the window (conservative).

Flags that size the cache outright (``KVSizeFlags``) replace or cap the memory fraction's figure:
vLLM's ``kv_cache_memory_bytes`` (the cache's bytes) and ``num_gpu_blocks_override`` (its
blocks), SGLang's ``max_total_tokens`` and TensorRT-LLM's ``kv_cache_config.max_tokens`` (at
most that many tokens).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tailserve.executors.simulated.drafter_memory import DrafterMemory
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
    usable_gib: float  # memory x gpu_memory_utilization (TensorRT-LLM's rule: the whole memory)
    weights_gib: float
    activation_gib: float
    kv_gib: float

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True, slots=True)
class KVSizeFlags:
    """Engine flags that size the KV cache outright instead of the memory fraction: vLLM's
    ``--kv-cache-memory-bytes`` (the cache's bytes per GPU, gpu_memory_utilization then unused:
    vllm/v1/worker/gpu_worker.py:649-670@v0.32.0) and ``--num-gpu-blocks-override`` (this many
    blocks: kv_cache_utils.py ``may_override_num_blocks``); SGLang's ``--max-total-tokens`` and
    TensorRT-LLM's ``kv_cache_config.max_tokens`` (at most this many tokens: the smaller of it and
    what memory gives, kv_cache_configurator.py ``_apply_token_constraints``@v0.5.23,
    ``KvCacheConfig.max_tokens``)."""

    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    max_total_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("kv_cache_memory_bytes", "num_gpu_blocks_override", "max_total_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    @classmethod
    def of(cls, engine_flags: Mapping[str, Any]) -> KVSizeFlags | None:
        """The ones ``engine_flags`` set; None when none is."""
        given = {name: engine_flags[name] for name in KV_SIZE_FLAGS if engine_flags.get(name) is not None}
        return cls(**given) if given else None

    def blocks(self, num_blocks: int, block_size: int) -> int:
        """The cache's blocks given what memory (or ``kv_cache_memory_bytes``) gives."""
        if self.num_gpu_blocks_override is not None:
            num_blocks = self.num_gpu_blocks_override
        if self.max_total_tokens is not None:
            num_blocks = min(num_blocks, self.max_total_tokens // block_size)
        return num_blocks


KV_SIZE_FLAGS = ("kv_cache_memory_bytes", "num_gpu_blocks_override", "max_total_tokens")


def activation_reserve_bytes(model: ModelSpec, tp: int, max_num_batched_tokens: int) -> float:
    # Peak of one forward over the budget: residual stream, q/k/v/o and the MLP's gate and up
    # projections (sharded), each token once, in the model's dtype.
    per_token = 6 * model.hidden_size + 3 * model.intermediate_size / tp
    return max_num_batched_tokens * per_token * model.dtype_bytes + NON_TORCH_RESERVE_GIB * GIB


def hybrid_groups(model: ModelSpec) -> tuple[int, int, int]:
    """(group_size, full-attention groups, sliding groups) of vLLM's hybrid KV cache manager."""
    full, sliding = model.num_full_layers, model.num_sliding_layers
    group_size = min(full, sliding)
    if max(full, sliding) < 1.5 * group_size:
        group_size = max(full, sliding)  # pad the smaller kind instead (gpt-oss-20b + EAGLE)
    return group_size, math.ceil(full / group_size), math.ceil(sliding / group_size)


def hybrid_pool_pages(model: ModelSpec, tp: int, kv_bytes: float, block_size: int) -> int:
    """Pages of ``block_size`` tokens x ``group_size`` layers that ``kv_bytes`` hold."""
    page = block_size * model.kv_bytes_per_token(tp) / model.num_layers * hybrid_groups(model)[0]
    return math.floor(kv_bytes / page)


def hybrid_manager_blocks(
    model: ModelSpec, pool_pages: int, block_size: int, max_num_seqs: int
) -> tuple[int, int, int]:
    """(manager blocks, full groups, sliding groups) for a hybrid model's pool (module doc)."""
    _, full_groups, sliding_groups = hybrid_groups(model)
    even = pool_pages // (full_groups + sliding_groups)
    window_pages = math.ceil((model.sliding_window - 1) / block_size) + 1
    reserved = (pool_pages - max_num_seqs * sliding_groups * window_pages) // full_groups
    return max(even, reserved if max_num_seqs > 0 else 0), full_groups, sliding_groups


def kv_capacity(
    model: ModelSpec,
    hardware: Hardware,
    tp: int,
    gpu_memory_utilization: float,
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int = 0,
    dp: int = 1,
    *,
    of_free_memory: bool = False,
    drafter: DrafterMemory | None = None,
    sized: KVSizeFlags | None = None,
    extra_weights: float = 0.0,
    pp: int = 1,
) -> KVCapacity:
    """``max_num_seqs``: the engine's limit on running requests, for a hybrid sliding-window
    model's set-aside (0: unknown, the even split). ``dp``: data-parallel attention ranks, over
    which an MoE model's experts are spread (each rank's KV holds its own requests).
    ``of_free_memory``: the fraction is of the memory left after weights and activations
    (TensorRT-LLM's ``free_gpu_memory_fraction``), not of the whole (vLLM's).
    ``drafter``: a speculative drafter loaded beside the target, its weights per GPU off the
    memory and its KV layers' bytes added to every token's (SGLang sizes one cell of target +
    draft layers: ``pool_configurator.py:259-314@v0.5.23``); None: no drafter counted.
    ``sized``: the engine flags that set the cache's size outright (``KVSizeFlags``).
    ``extra_weights``: bytes per GPU loaded beside the model's own (EPLB's redundant experts).
    ``pp``: the pipeline stages ``model`` is one of (``ModelSpec.pipeline_stage``), for the
    message."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    draft_weights = drafter.weight_bytes(model, tp, dp) if drafter is not None else 0.0
    weights = model.weight_bytes_per_shard(tp, dp) + draft_weights + extra_weights
    activation = activation_reserve_bytes(model, tp, max_num_batched_tokens)
    if of_free_memory:
        usable = hardware.memory_bytes
        kv = (usable - weights - activation) * gpu_memory_utilization
    else:
        usable = hardware.memory_bytes * gpu_memory_utilization
        kv = usable - weights - activation
    per_token = model.kv_bytes_per_token(tp)
    if drafter is not None:
        per_token += drafter.kv_bytes_per_token(model, tp)
    per_block = block_size * per_token
    if sized is not None and sized.kv_cache_memory_bytes is not None:
        kv = float(sized.kv_cache_memory_bytes)  # vLLM: this, whatever the memory fraction leaves
        if kv < per_block:
            raise ValueError(
                f"kv_cache_memory_bytes={sized.kv_cache_memory_bytes} holds no {block_size}-token block of "
                f"{model.name} at TP {tp} ({per_block:,.0f} bytes each)"
            )
    if kv < per_block:
        need = weights + activation
        # The smallest TP (a divisor of the head count, as vLLM requires) that leaves room for KV.
        fits = [
            t
            for t in range(tp + 1, model.num_heads + 1)
            if model.num_heads % t == 0
            and (hardware.memory_bytes if of_free_memory else usable)
            - model.weight_bytes_per_shard(t, dp)
            - activation_reserve_bytes(model, t, max_num_batched_tokens)
            > per_block * 64
        ]
        hint = ""
        if fits:
            hint = f"; the minimum is TP {fits[0]}, try --tp {fits[0]}"
            if fits[0] > 8:
                hint += f" ({model.num_heads} heads divide by {fits[0]}; more GPUs than one 8-GPU node)"
        domain = hardware.nvlink_domain
        if pp == 1 and (not fits or fits[0] > domain):
            # Across nodes vLLM's way is TP inside a node (a whole NVLink domain where the heads
            # split that way), pipeline stages over the nodes.
            node_tp = domain if model.num_heads % domain == 0 else tp
            room = (hardware.memory_bytes if of_free_memory else usable) - activation_reserve_bytes(
                model, node_tp, max_num_batched_tokens
            )
            candidates = ((p, model.pipeline_stage(p)) for p in range(2, min(model.num_layers, 16) + 1))
            stages = [
                p
                for p, stage in candidates
                if room
                - stage.weight_bytes_per_shard(node_tp, dp)
                - (extra_weights + draft_weights) * stage.num_layers / model.num_layers
                > per_block * 64
            ]
            if stages:
                hint += (
                    f"; or split the layers over nodes: --tp {node_tp} --pipeline-parallel-size {stages[0]}"
                )
        shape = f"TP {tp}{f' x DP {dp}' if dp > 1 else ''}{f' x PP {pp}' if pp > 1 else ''}"
        raise ValueError(
            f"{model.name} does not fit on {hardware.name} at {shape}: weights {weights / GIB:.1f} GiB "
            f"+ activations {activation / GIB:.1f} GiB per GPU need {need / GIB:.1f} GiB, but "
            + (
                f"{hardware.memory_gib:.1f} GiB is there{hint}"
                if of_free_memory
                else f"{gpu_memory_utilization:.2f} x {hardware.memory_gib:.1f} GiB = {usable / GIB:.1f} GiB "
                f"is usable{hint}"
            )
        )
    num_blocks = math.floor(kv / per_block)
    if model.num_sliding_layers and model.num_full_layers:
        target_kv = kv * model.kv_bytes_per_token(tp) / per_token  # the drafter's share aside
        num_blocks = hybrid_manager_blocks(
            model, hybrid_pool_pages(model, tp, target_kv, block_size), block_size, max_num_seqs
        )[0]
    if sized is not None:
        overridden = sized.blocks(num_blocks, block_size)
        if overridden != num_blocks:
            num_blocks, kv = overridden, overridden * per_block  # what the cache then holds
    return KVCapacity(
        num_blocks=num_blocks,
        block_size=block_size,
        kv_bytes_per_token=per_token,
        memory_gib=hardware.memory_gib,
        usable_gib=usable / GIB,
        weights_gib=weights / GIB,
        activation_gib=activation / GIB,
        kv_gib=kv / GIB,
    )
