"""The ``trtllm`` policy's flags (``TrtllmConfig``): TensorRT-LLM's own LLM-API names and defaults,
TensorRT-LLM 1.2 (the 1.2.1 release is the one on PyPI).

Where each comes from (``tensorrt_llm/llmapi/llm_args.py`` and ``tensorrt_llm/commands/serve.py``):

- ``max_batch_size`` 2048, ``max_num_tokens`` 8192: ``BaseLlmArgs`` / ``BuildConfig``, and
  ``trtllm-serve --max_batch_size / --max_num_tokens`` default to the same two numbers. ``None``
  (which the LLM API also accepts) means those defaults.
- ``SchedulerConfig``: ``capacity_scheduler_policy`` (GUARANTEED_NO_EVICT), ``context_chunking_policy``
  (None, which ``py_executor_creator.py`` turns into FIRST_COME_FIRST_SERVED when chunking is on:
  that is the default written here), ``waiting_queue_policy`` (``fcfs``, the only member of
  ``WaitingQueuePolicy`` in ``scheduler/waiting_queue.py`` at this version).
- ``enable_chunked_prefill`` False: ``BaseLlmArgs``.
- ``enable_block_reuse`` True: ``KvCacheConfig`` (``kv_cache_config.enable_block_reuse``).

``kv_cache_config.tokens_per_block`` (32) is the engine-wide ``block_size`` flag and
``kv_cache_config.free_gpu_memory_fraction`` (0.9) is ``gpu_memory_utilization``, applied as
TensorRT-LLM applies it: to the memory left after weights and activations (``kv_capacity.py``).

Kept apart from ``trtllm.py`` so the capacity and micro-batch schedulers
(``trtllm_capacity.py``, ``trtllm_microbatch.py``) read the choices without importing the policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
MAX_UTILIZATION = "MAX_UTILIZATION"
STATIC_BATCH = "STATIC_BATCH"
FIRST_COME_FIRST_SERVED = "FIRST_COME_FIRST_SERVED"
EQUAL_PROGRESS = "EQUAL_PROGRESS"

DEFAULT_MAX_BATCH_SIZE = 2048
DEFAULT_MAX_NUM_TOKENS = 8192


@dataclass(frozen=True, slots=True)
class TrtllmConfig:
    # requests in one forward, and requests active at once (fetched from the waiting queue);
    # none: 2048
    max_batch_size: int | None = DEFAULT_MAX_BATCH_SIZE
    # tokens in one forward (decodes + context chunks); none: 8192
    max_num_tokens: int | None = DEFAULT_MAX_NUM_TOKENS
    # scheduler_config.capacity_scheduler_policy: who may hold KV this step
    capacity_scheduler_policy: Literal["GUARANTEED_NO_EVICT", "MAX_UTILIZATION", "STATIC_BATCH"] = (
        GUARANTEED_NO_EVICT
    )
    # scheduler_config.context_chunking_policy: how the token budget is split among contexts
    context_chunking_policy: Literal["FIRST_COME_FIRST_SERVED", "EQUAL_PROGRESS"] = FIRST_COME_FIRST_SERVED
    enable_chunked_prefill: bool = False  # split contexts into tokens_per_block-aligned chunks
    enable_block_reuse: bool = True  # kv_cache_config.enable_block_reuse: prefix reuse of full blocks
    waiting_queue_policy: Literal["fcfs"] = "fcfs"  # scheduler_config.waiting_queue_policy

    def __post_init__(self) -> None:
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_num_tokens is not None and self.max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {self.max_num_tokens}")

    @property
    def batch_size(self) -> int:
        return DEFAULT_MAX_BATCH_SIZE if self.max_batch_size is None else self.max_batch_size

    @property
    def num_tokens(self) -> int:
        return DEFAULT_MAX_NUM_TOKENS if self.max_num_tokens is None else self.max_num_tokens
