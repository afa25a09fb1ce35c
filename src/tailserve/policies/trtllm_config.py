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
- ``disable_overlap_scheduler`` False: ``TorchLlmArgs``; unset here means the engine's choice
  (``trtllm_overlap.overlap_default``), resolved by ``TrtllmPolicy.default_config``.
- ``attention_dp_config`` (``TorchLlmArgs``, an ``AttentionDpConfig``): ``enable_balance`` False,
  ``timeout_iters`` 50, ``batching_wait_iters`` 10, here ``attention_dp_*`` (``trtllm_adp.py``).

- ``scheduler_config.enable_prefix_aware_scheduling`` (False): TensorRT-LLM 1.3's option, True
  by default there (``llm_args.py@0004396`` ``SchedulerConfig``); 1.2.1 has no such field and
  behaves as False, which tailserve keeps as its default (``trtllm_prefix_aware.py``).
- ``kv_cache_config.host_cache_size`` (None: no host pool) and
  ``secondary_offload_min_priority`` (None: 30): ``KvCacheConfig``; the pool is
  ``kv/secondary_pool.py``.

``kv_cache_config.tokens_per_block`` (32) is the engine-wide ``block_size`` flag and
``kv_cache_config.free_gpu_memory_fraction`` (0.9) is ``gpu_memory_utilization``, applied as
TensorRT-LLM applies it: to the memory left after weights and activations (``kv_capacity.py``).

Kept apart from ``trtllm.py`` so the capacity and micro-batch schedulers
(``trtllm_capacity.py``, ``trtllm_microbatch.py``) read the choices without importing the policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from tailserve.executors.simulated.drafter_memory import DrafterMemory
from tailserve.executors.simulated.spec_decode import SpecDecoding, resolve_acceptance_rates
from tailserve.kv.secondary_pool import DEFAULT_RETENTION_PRIORITY, DEFAULT_SECONDARY_OFFLOAD_MIN_PRIORITY
from tailserve.policies.trtllm_adp import DEFAULT_BATCHING_WAIT_ITERS, DEFAULT_TIMEOUT_ITERS

GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
MAX_UTILIZATION = "MAX_UTILIZATION"
STATIC_BATCH = "STATIC_BATCH"
FIRST_COME_FIRST_SERVED = "FIRST_COME_FIRST_SERVED"
EQUAL_PROGRESS = "EQUAL_PROGRESS"

DEFAULT_MAX_BATCH_SIZE = 2048
DEFAULT_MAX_NUM_TOKENS = 8192
# CudaGraphConfig.max_batch_size 0 means 128 (llm_args.py@1.2 CudaGraphConfig.validate_cuda_graph_config)
DEFAULT_CUDA_GRAPH_MAX_BATCH_SIZE = 128

# speculative_config.decoding_type -> tailserve's drafter (spec_decode.METHODS): both run inside the
# target model ("one-model"): MTP's module(s) and EAGLE-3's draft layer, one layer per draft.
DECODING_TYPES = {"MTP": "mtp", "Eagle3": "eagle3"}
# Fields of features off by default: a run file names them only when set (sim/run.py).
_WHEN_SET = {"recorded_when_set": True}


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
    # speculative_config.decoding_type: draft tokens verified each generation step (MTP: DeepSeek's
    # multi-token prediction modules; Eagle3: an EAGLE-3 draft layer), none: off
    decoding_type: Literal["MTP", "Eagle3"] | None = field(default=None, metadata=_WHEN_SET)
    # speculative_config.num_nextn_predict_layers (MTP): draft tokens per step
    num_nextn_predict_layers: int = field(default=0, metadata=_WHEN_SET)
    # speculative_config.max_draft_len (Eagle3): draft tokens per step
    max_draft_len: int = field(default=0, metadata=_WHEN_SET)
    # acceptance (tailserve's model, vLLM's synthetic sampler: spec_decode.py): per-position
    # unconditional rates, non-increasing, one per draft; 0.8,0.5 (0.8/0.5 in a policy spec)
    synthetic_acceptance_rates: tuple[float, ...] | None = field(default=None, metadata=_WHEN_SET)
    # or the mean acceptance length: 1 + accepted drafts per step, in [1, drafts + 1]
    synthetic_acceptance_length: float | None = field(default=None, metadata=_WHEN_SET)
    # cuda_graph_config.enable_padding: a generation-only step runs at the next captured batch size
    cuda_graph_padding_enabled: bool = field(default=False, metadata=_WHEN_SET)
    # cuda_graph_config.batch_sizes: the captured batch sizes (whole numbers); none: generated
    # from cuda_graph_max_batch_size as TensorRT-LLM 1.2 generates them
    cuda_graph_batch_sizes: tuple[int, ...] | None = field(default=None, metadata=_WHEN_SET)
    # cuda_graph_config.max_batch_size: the largest captured batch (0: 128, or max(batch_sizes))
    cuda_graph_max_batch_size: int = field(default=0, metadata=_WHEN_SET)
    # disable_overlap_scheduler (TorchLlmArgs): true schedules each step after the previous one's
    # tokens are known; false schedules step N+1 while step N runs (trtllm_overlap.py). none: as
    # TensorRT-LLM 1.2 decides, overlap on on a GPU (MTP and Eagle3 drafts keep it)
    disable_overlap_scheduler: bool | None = field(default=None, metadata=_WHEN_SET)
    # attention_dp_config.enable_balance: with attention DP, new contexts wait until every rank
    # has one (policies/trtllm_adp.py); no effect on a single engine
    attention_dp_enable_balance: bool = field(default=False, metadata=_WHEN_SET)
    # attention_dp_config.timeout_iters: steps contexts wait for every rank to have one
    attention_dp_timeout_iters: int = field(default=DEFAULT_TIMEOUT_ITERS, metadata=_WHEN_SET)
    # attention_dp_config.batching_wait_iters: steps contexts then wait while every rank decodes
    attention_dp_batching_wait_iters: int = field(default=DEFAULT_BATCHING_WAIT_ITERS, metadata=_WHEN_SET)
    # kv_cache_config.host_cache_size: bytes of host memory per GPU for a secondary KV block pool;
    # GPU blocks evicted from the reuse tree are offloaded there and onboarded when reused
    # (kv/secondary_pool.py, policies/trtllm_host_cache.py). none or 0: no pool
    host_cache_size: int | None = field(default=None, metadata=_WHEN_SET)
    # kv_cache_config.secondary_offload_min_priority: only blocks of at least this retention
    # priority are offloaded; none: 30. Every block here has the default priority, 35
    secondary_offload_min_priority: int | None = field(default=None, metadata=_WHEN_SET)
    # scheduler_config.enable_prefix_aware_scheduling (TensorRT-LLM 1.3+, whose default is true):
    # the micro-batch scheduler charges a context's first chunk only the prompt tokens its cached
    # prefix does not cover (policies/trtllm_prefix_aware.py). False here: 1.2.1, which has no
    # such option and charges every scheduled token
    enable_prefix_aware_scheduling: bool = field(default=False, metadata=_WHEN_SET)
    # batch_wait_timeout_iters (TorchLlmArgs): a step's contexts are held back, while generation
    # requests run, up to this many steps (policies/trtllm_batch_wait.py); 0: off
    batch_wait_timeout_iters: int = field(default=0, metadata=_WHEN_SET)
    # batch_wait_max_tokens_ratio: ... or until the step's tokens reach this share of
    # max_num_tokens, in [0, 1]; 0: off (either at 0 holds nothing)
    batch_wait_max_tokens_ratio: float = field(default=0.0, metadata=_WHEN_SET)
    # batch_wait_timeout_ms (TorchLlmArgs): every fetch of new requests, each engine-loop
    # iteration's first act, waits up to this long for max_batch_size of them when fewer came
    # (ExecutorRequestQueue._get_from_request_queue; core/engine.py Engine._fetched); 0: no wait
    batch_wait_timeout_ms: float = field(default=0.0, metadata=_WHEN_SET)
    # stream_interval (BaseLlmArgs): a streamed response on a request's first decoding
    # iteration, every N-th and its last (core/stream_interval.py): the client's ITL only
    stream_interval: int = field(default=1, metadata=_WHEN_SET)
    # pipeline_parallel_size (--pp_size), set from the deployment's stages (--pipeline-parallel-size):
    # PyExecutor runs _executor_loop_pp, pp micro-batch slots in turn, no overlap (trtllm_pipeline.py)
    pipeline_parallel_size: int = field(default=1, metadata=_WHEN_SET)

    def __post_init__(self) -> None:
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_num_tokens is not None and self.max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {self.max_num_tokens}")
        self._check_speculative()
        if self.attention_dp_enable_balance:  # AttentionDpConfig's validator checks them only then
            for name in ("attention_dp_timeout_iters", "attention_dp_batching_wait_iters"):
                if getattr(self, name) < 0:
                    raise ValueError(
                        f"{name} must be >= 0 with attention_dp_enable_balance, got {getattr(self, name)}"
                    )
        self._check_cuda_graphs()
        self._check_host_cache()
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.batch_wait_timeout_ms < 0:  # llm_args: "must be greater than or equal to 0"
            raise ValueError(f"batch_wait_timeout_ms must be >= 0, got {self.batch_wait_timeout_ms}")
        if self.batch_wait_timeout_iters < 0:
            raise ValueError(f"batch_wait_timeout_iters must be >= 0, got {self.batch_wait_timeout_iters}")
        if not 0 <= self.batch_wait_max_tokens_ratio <= 1:
            # py_executor.py's comment: "Value range: [0, 1] (0 disables)"
            raise ValueError(
                f"batch_wait_max_tokens_ratio must be in [0, 1], got {self.batch_wait_max_tokens_ratio}"
            )

    @property
    def batch_waiting(self) -> bool:
        """``enable_batch_waiting``: on when either knob is above 0 (it holds only when both are)."""
        return self.batch_wait_timeout_iters > 0 or self.batch_wait_max_tokens_ratio > 0

    def _check_host_cache(self) -> None:
        size = self.host_cache_size
        if size is not None and (isinstance(size, bool) or size != int(size) or size < 0):
            raise ValueError(f"host_cache_size must be a whole number of bytes >= 0, got {size!r}")
        if size and not self.enable_block_reuse:
            raise ValueError(
                "host_cache_size holds blocks evicted from the reuse tree: it needs "
                "kv_cache_config.enable_block_reuse (without it no block is offloaded)"
            )
        priority = self.secondary_offload_min_priority
        if priority is not None and (isinstance(priority, bool) or priority != int(priority)):
            raise ValueError(f"secondary_offload_min_priority must be a whole number, got {priority!r}")

    @property
    def offloads_to_host(self) -> bool:
        """Whether evicted blocks go to a host pool: one is sized, and the blocks' priority (the
        default 35: tailserve's requests set no retention config) reaches
        ``secondary_offload_min_priority`` (``LRUEvictionPolicy::getFreeBlock``: ``level >=
        mSecondaryOffloadMinPriority``)."""
        floor = self.secondary_offload_min_priority
        if floor is None:
            floor = DEFAULT_SECONDARY_OFFLOAD_MIN_PRIORITY
        return bool(self.host_cache_size) and floor <= DEFAULT_RETENTION_PRIORITY

    def _check_speculative(self) -> None:
        given = [
            name
            for name in ("synthetic_acceptance_rates", "synthetic_acceptance_length")
            if getattr(self, name) is not None
        ]
        if self.num_nextn_predict_layers < 0:
            raise ValueError(f"num_nextn_predict_layers must be >= 0, got {self.num_nextn_predict_layers}")
        if self.max_draft_len < 0:
            raise ValueError(f"max_draft_len must be >= 0, got {self.max_draft_len}")
        if self.decoding_type is None:
            extra = given + [n for n in ("num_nextn_predict_layers", "max_draft_len") if getattr(self, n)]
            if extra:
                raise ValueError(f"{extra[0]} needs decoding_type (one of {', '.join(DECODING_TYPES)})")
            return
        if self.decoding_type not in DECODING_TYPES:
            raise ValueError(
                f"decoding_type must be one of {', '.join(DECODING_TYPES)}, got {self.decoding_type!r} "
                "(Eagle, NGram, Draft/Target, Medusa, ... are not modelled)"
            )
        # MTPDecodingConfig: num_nextn_predict_layers (default 1) sets max_draft_len
        # (speculative/utils.py update_spec_config_from_model_config); EagleDecodingConfig needs
        # max_draft_len. The other one is refused, not ignored.
        if self.decoding_type == "MTP" and self.max_draft_len:
            raise ValueError("max_draft_len is Eagle3's; MTP's draft count is num_nextn_predict_layers")
        if self.decoding_type == "Eagle3" and self.num_nextn_predict_layers:
            raise ValueError("num_nextn_predict_layers is MTP's; Eagle3's draft count is max_draft_len")
        if self.decoding_type == "Eagle3" and not self.max_draft_len:
            raise ValueError("decoding_type Eagle3 needs max_draft_len >= 1")
        resolve_acceptance_rates(
            self.num_draft_tokens, self.synthetic_acceptance_rates, self.synthetic_acceptance_length
        )

    def _check_cuda_graphs(self) -> None:
        sizes = self.cuda_graph_batch_sizes
        if self.cuda_graph_max_batch_size < 0:
            raise ValueError(
                f"cuda_graph_max_batch_size must be non-negative, got {self.cuda_graph_max_batch_size}"
            )
        if sizes is None:
            return
        if not sizes or any(s != int(s) or s < 1 for s in sizes):
            raise ValueError(f"cuda_graph_batch_sizes must be whole numbers >= 1, got {list(sizes)}")
        if self.cuda_graph_max_batch_size and self.cuda_graph_max_batch_size != int(max(sizes)):
            raise ValueError(
                f"cuda_graph_max_batch_size ({self.cuda_graph_max_batch_size}) must equal "
                f"max(cuda_graph_batch_sizes) ({int(max(sizes))}) when both are given"
            )

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens per generation step (``max_draft_len``): MTP's ``num_nextn_predict_layers``
        (1 when not given, ``MTPDecodingConfig``'s default), Eagle3's ``max_draft_len``; 0 off."""
        if self.decoding_type == "MTP":
            return self.num_nextn_predict_layers or 1
        if self.decoding_type == "Eagle3":
            return self.max_draft_len
        return 0

    @property
    def num_extra_kv_tokens(self) -> int:
        """KV slots a one-model drafter holds past each request's tokens
        (``get_num_extra_kv_tokens``: ``max_draft_len - 1``; 0 without drafts)."""
        return max(self.num_draft_tokens - 1, 0)

    def speculative_decoding(self) -> SpecDecoding | None:
        """The drafter and its acceptance for the simulated executor (None without drafts)."""
        k = self.num_draft_tokens
        if not k:
            return None
        assert self.decoding_type is not None
        rates = resolve_acceptance_rates(k, self.synthetic_acceptance_rates, self.synthetic_acceptance_length)
        return SpecDecoding(DECODING_TYPES[self.decoding_type], k, rates)

    def drafter_memory(self) -> DrafterMemory | None:
        """The one-model drafter's weights and KV layers, both inside the target's engine, so
        loaded before ``KvCacheCreator`` profiles the peak memory the pool is sized from
        (``kv_capacity.py``). Read in TensorRT-LLM's 1.2 line (``_torch/models/``,
        ``_torch/speculative/``):

        - MTP: ``MTPDecodingConfig`` (``mtp_eagle_one_model`` True, ``use_mtp_vanilla`` False)
          is ``MTP_EAGLE_ONE_MODEL`` for a checkpoint with one MTP module (DeepSeek-V3/R1's
          ``num_nextn_predict_layers`` = 1), and ``MTPForCausalLM``
          (``modeling_speculative.py``) then builds one ``DeepseekV3MTP`` (``mtp_num_layers = 1
          if is_mtp_eagle_one_model()``), run once per draft: one decoder layer (an MoE layer:
          its index is past the dense ones) plus its ``eh_proj``, embedding and LM head shared
          with the target. Its KV, though, is sized for ``get_num_spec_layers`` =
          ``num_nextn_predict_layers`` (the draft count) layers (``speculative/utils.py``;
          later versions count one layer for MTP-Eagle). Vanilla MTP (one module per draft) is
          not modelled.
        - Eagle3: ``SpecDecOneEngineForCausalLM`` loads the EAGLE-3 draft model
          (``Eagle3ForCausalLM``, one decoder layer) inside the target; ``get_num_spec_layers``:
          its one layer of KV.
        """
        if self.decoding_type == "MTP":
            return DrafterMemory(
                1,
                self.num_draft_tokens,
                mtp_projection=True,
                source="tensorrt_llm/_torch/models/modeling_speculative.py MTPForCausalLM, "
                "_torch/speculative/utils.py get_num_spec_layers (1.2)",
            )
        if self.decoding_type == "Eagle3":
            return DrafterMemory(
                1,
                1,
                source="tensorrt_llm/_torch/models/modeling_speculative.py get_draft_model, "
                "_torch/speculative/utils.py get_num_spec_layers (1.2)",
            )
        return None

    def captured_batch_sizes(self) -> tuple[int, ...]:
        """The CUDA-graph batch sizes (ascending): given, or generated as TensorRT-LLM 1.2 does
        (``CudaGraphConfig._generate_cuda_graph_batch_sizes``): with padding 1, 2, 4 and the
        multiples of 8 to 128, without it 1-31, 32, 64, 128; then powers of two from 256 below the
        maximum; those up to the maximum, and the maximum itself."""
        if self.cuda_graph_batch_sizes is not None:
            return tuple(sorted({int(s) for s in self.cuda_graph_batch_sizes}))
        top = self.cuda_graph_max_batch_size or DEFAULT_CUDA_GRAPH_MAX_BATCH_SIZE
        if self.cuda_graph_padding_enabled:
            sizes = [1, 2, 4] + [8 * i for i in range(1, 17)]
        else:
            sizes = [*range(1, 32), 32, 64, 128]
        if top > 1:
            sizes += [2**i for i in range(8, math.ceil(math.log(top, 2)))]
        sizes = sorted({s for s in sizes if s <= top})
        if not sizes or sizes[-1] != top:
            sizes.append(top)
        return tuple(sizes)

    @property
    def batch_size(self) -> int:
        return DEFAULT_MAX_BATCH_SIZE if self.max_batch_size is None else self.max_batch_size

    @property
    def num_tokens(self) -> int:
        return DEFAULT_MAX_NUM_TOKENS if self.max_num_tokens is None else self.max_num_tokens
