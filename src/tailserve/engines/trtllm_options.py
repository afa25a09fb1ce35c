"""TensorRT-LLM 1.2.1's ``--extra_llm_api_options`` / ``--config`` YAML: the LLM API options a
``trtllm-serve`` line reads from a file, key by key; and 1.4.0rc4's (``OPTIONS_FILE_1_4``): the
same with ``SchedulerConfig``'s 1.3/1.4 fields (``KEYS_1_4``), which 1.2.1 refuses.

Source: ``tensorrt_llm/llmapi/llm_args.py`` in a stored copy of the 1.2 line, cited
``llm_args.py@1.2`` (its ``SchedulerConfig`` has ``waiting_queue_policy``, its MTP option warns
of a change "in release 1.3", and ``update_llm_args_with_extra_dict`` has the ``kv_cache_config``
merge of TensorRT-LLM#9262; the copy's commit is not named by the store, so it was not checked
against the v1.2.1 tag), and ``tensorrt_llm/commands/serve.py`` at 00209af (how ``serve`` reads
the file).

How the engine reads the file (``serve``: ``yaml.safe_load``, then
``update_llm_args_with_extra_dict``): the file's top-level keys replace the command line's
(``llm_args | llm_args_dict``: ``max_batch_size: 128`` wins over ``--max_batch_size 64``, and a
``scheduler_config`` replaces the one ``serve`` built); ``kv_cache_config`` alone is merged key
by key first, so ``--kv_cache_free_gpu_memory_fraction`` survives a file that sets only
``kv_cache_config.enable_block_reuse`` and loses to one that sets ``free_gpu_memory_fraction``.
The merged options are validated by pydantic with ``extra="forbid"`` (``BaseLlmArgs``, and
``StrictBaseModel`` for the nested configs): a key the LLM API does not know stops the engine at
start. ``build_config`` is dropped for the PyTorch backend (``launch_server`` pops it).
"""

from __future__ import annotations

from typing import Literal

from tailserve.engines.flag_spec import (
    DEPLOYMENT,
    NO_OP,
    NOT_MODELLED,
    OTHER,
    REFUSED,
    SCHEDULING,
    Finding,
    FlagSpec,
    Given,
    OptionsFile,
)

ARGS = "tensorrt_llm/llmapi/llm_args.py@1.2"
SERVE = "tensorrt_llm/commands/serve.py@00209af"
# The runtime. "tensorrt"/"trt" runs a built engine under the C++ executor, whose loop waits for
# step n, fetches new requests, then launches step n+1 (cpp/tensorrt_llm/executor/executorImpl.cpp
# Executor::Impl::executionLoop@036a60f7): no overlap scheduler, so translate.py turns the trtllm
# policy's off. Its capacity and micro-batch schedulers are the C++ ones the PyTorch backend binds.
BACKEND_WHAT = (
    "the runtime: pytorch (the trtllm policy's), or tensorrt/trt, whose C++ executor schedules each step "
    "after the previous one (the overlap scheduler off)"
)
TENSORRT_BACKENDS = ("tensorrt", "trt")
MICRO = "tensorrt_llm/_torch/pyexecutor/scheduler/scheduler.py@5f480b7a"


def _field(cls: str, name: str) -> str:
    return f"{ARGS} {cls}.{name}"


def _llm(name: str) -> str:
    return _field("TorchLlmArgs" if name in _TORCH_ONLY else "BaseLlmArgs", name)


WAITING = "tensorrt_llm/_torch/pyexecutor/py_executor.py@1.2 PyExecutor._schedule, _waiting_requests"
_TORCH_ONLY = {
    "cuda_graph_config", "attention_dp_config", "disable_overlap_scheduler", "batch_wait_timeout_ms",
    "batch_wait_timeout_iters", "batch_wait_max_tokens_ratio", "stream_interval",
}  # fmt: skip
_CAPACITY = Literal["GUARANTEED_NO_EVICT", "MAX_UTILIZATION", "STATIC_BATCH"]
_CHUNKING = Literal["FIRST_COME_FIRST_SERVED", "EQUAL_PROGRESS"] | None

KEYS = (
    FlagSpec("model", str, DEPLOYMENT, "the model", _llm("model"), target="deployment.model"),
    FlagSpec("tensor_parallel_size", int, DEPLOYMENT, "tensor-parallel degree", _llm("tensor_parallel_size"),
             "1", target="deployment.tp"),
    FlagSpec("pipeline_parallel_size", int, NOT_MODELLED, "pipeline parallelism: tailserve simulates TP only",
             _llm("pipeline_parallel_size"), "1"),
    FlagSpec("moe_expert_parallel_size", int | None, DEPLOYMENT,
             "expert parallelism: = tensor_parallel_size splits experts whole over the TP ranks",
             _llm("moe_expert_parallel_size"), target="deployment.expert_parallel"),
    FlagSpec("enable_attention_dp", bool, DEPLOYMENT,
             "attention data parallelism: each of the tensor_parallel_size ranks runs attention and the dense "
             "layers for its own requests (Mapping: attention TP 1), the MoE layers over all of them: tailserve's "
             "DP engine of that many TP-1 ranks in lockstep", _llm("enable_attention_dp"), "false",
             target="deployment.dp_attention"),
    FlagSpec("attention_dp_config.enable_balance", bool, SCHEDULING,
             "with enable_attention_dp, new contexts wait until every attention-DP rank has one "
             "(policies/trtllm_adp.py)", _field("AttentionDpConfig", "enable_balance"), "false",
             target="attention_dp_enable_balance"),
    FlagSpec("attention_dp_config.timeout_iters", int, SCHEDULING,
             "steps contexts wait for every attention-DP rank to have one",
             _field("AttentionDpConfig", "timeout_iters"), "50", target="attention_dp_timeout_iters"),
    FlagSpec("attention_dp_config.batching_wait_iters", int, SCHEDULING,
             "steps contexts then wait while every attention-DP rank decodes",
             _field("AttentionDpConfig", "batching_wait_iters"), "10", target="attention_dp_batching_wait_iters"),
    FlagSpec("max_batch_size", int | None, SCHEDULING, "most requests the engine schedules at once",
             _llm("max_batch_size"), "2048"),
    FlagSpec("max_num_tokens", int | None, SCHEDULING, "batched input tokens per step", _llm("max_num_tokens"),
             "8192"),
    FlagSpec("max_seq_len", int | None, DEPLOYMENT, "context length (prompt + outputs)", _llm("max_seq_len"),
             "the model's", target="max_model_len"),
    FlagSpec("max_input_len", int | None, NOT_MODELLED,
             "longest prompt a paused request keeps (LlmRequest::pause); tailserve keeps all of it",
             _llm("max_input_len"), "1024"),
    FlagSpec("max_beam_width", int | None, NOT_MODELLED, "beam search width", _llm("max_beam_width"), "1"),
    FlagSpec("enable_chunked_prefill", bool, SCHEDULING, "split context (prefill) into chunks",
             _llm("enable_chunked_prefill"), "false"),
    FlagSpec("speculative_config", dict | None, SCHEDULING,
             "draft tokens verified each generation step: decoding_type MTP (num_nextn_predict_layers) and "
             "Eagle3 (max_draft_len) simulated, the acceptance from --acceptance-length (TensorRT-LLM has no "
             "setting for it; engines/speculative.py)", _llm("speculative_config")),
    FlagSpec("cuda_graph_config", dict | None, OTHER,
             "CUDA graphs for decode-only batches: the time of a step, not who is in it; the trtllm policy "
             "prices enable_padding under its flags cuda_graph_padding_enabled, cuda_graph_batch_sizes, "
             "cuda_graph_max_batch_size", _llm("cuda_graph_config")),
    FlagSpec("disable_overlap_scheduler", bool, SCHEDULING,
             "true schedules each step after the last one's tokens are known; the overlap scheduler (on unless "
             "this is true) schedules step N+1 while step N runs, hiding the host work "
             "(policies/trtllm_overlap.py)", _llm("disable_overlap_scheduler"), "false"),
    FlagSpec("batch_wait_timeout_ms", float, NOT_MODELLED,
             "holds new requests back up to this long to fill max_batch_size", _llm("batch_wait_timeout_ms"), "0"),
    FlagSpec("batch_wait_timeout_iters", int, SCHEDULING,
             "a step's contexts are held back, while generation requests run, up to this many steps "
             "(policies/trtllm_batch_wait.py)", f"{_llm('batch_wait_timeout_iters')}; {WAITING}", "0"),
    FlagSpec("batch_wait_max_tokens_ratio", float, SCHEDULING,
             "... or until the step's tokens (whole context prompts + 1 per generation) reach this fraction "
             "of max_num_tokens", f"{_llm('batch_wait_max_tokens_ratio')}; {WAITING}", "0"),
    FlagSpec("stream_interval", int, SCHEDULING, "a streamed response on a request's first decoding iteration, "
             "every N-th and its last: the client's ITL, not the engine's (core/stream_interval.py)",
             f"{_llm('stream_interval')}; PyExecutor._handle_responses", "1"),
    FlagSpec("backend", str, SCHEDULING, BACKEND_WHAT,
             f"{SERVE} launch_server (reads llm_args['backend'] after the file)", "pytorch",
             target="disable_overlap_scheduler"),
    FlagSpec("build_config", dict | None, NO_OP,
             "PyTorch backend: trtllm-serve drops build_config before the LLM is made; set max_batch_size and "
             "max_num_tokens at the top level", f'{SERVE} launch_server llm_args.pop("build_config")'),
    FlagSpec("scheduler_config.capacity_scheduler_policy", _CAPACITY, SCHEDULING,
             "who may hold KV this step: GUARANTEED_NO_EVICT reserves to completion, MAX_UTILIZATION pauses "
             "the last started", _field("SchedulerConfig", "capacity_scheduler_policy"), "GUARANTEED_NO_EVICT",
             target="capacity_scheduler_policy"),
    FlagSpec("scheduler_config.context_chunking_policy", _CHUNKING, SCHEDULING,
             "how the token budget is split among chunked contexts",
             _field("SchedulerConfig", "context_chunking_policy"), "FIRST_COME_FIRST_SERVED",
             target="context_chunking_policy"),
    FlagSpec("scheduler_config.dynamic_batch_config", dict | None, NO_OP,
             "TensorRT backend only: the PyTorch backend does not tune the batch",
             _field("SchedulerConfig", "dynamic_batch_config")),
    FlagSpec("scheduler_config.waiting_queue_policy", Literal["fcfs"], SCHEDULING, "the waiting queue's order",
             _field("SchedulerConfig", "waiting_queue_policy"), "fcfs", target="waiting_queue_policy"),
    FlagSpec("kv_cache_config.enable_block_reuse", bool, SCHEDULING, "prefix reuse of full KV blocks",
             _field("KvCacheConfig", "enable_block_reuse"), "true", target="enable_block_reuse"),
    FlagSpec("kv_cache_config.tokens_per_block", int, DEPLOYMENT, "tokens per KV block",
             _field("KvCacheConfig", "tokens_per_block"), "32", target="block_size"),
    FlagSpec("kv_cache_config.dtype", str, DEPLOYMENT, "KV cache number format (auto: the checkpoint's)",
             _field("KvCacheConfig", "dtype"), "auto", target="deployment.kv_cache_dtype"),
    FlagSpec("kv_cache_config.free_gpu_memory_fraction", float | None, DEPLOYMENT,
             "fraction of the memory left after weights and activations for the KV cache (the trtllm "
             "policy applies --gpu-memory-utilization so: kv_capacity.py)",
             _field("KvCacheConfig", "free_gpu_memory_fraction"), "0.9", target="gpu_memory_utilization"),
    FlagSpec("kv_cache_config.max_tokens", int | None, DEPLOYMENT,
             "caps the KV cache at this many tokens (the smaller of it and the memory fraction's)",
             _field("KvCacheConfig", "max_tokens"), target="max_total_tokens"),
    FlagSpec("kv_cache_config.enable_partial_reuse", bool, NOT_MODELLED,
             "reuse of partly matched blocks; tailserve reuses whole blocks only",
             _field("KvCacheConfig", "enable_partial_reuse"), "true"),
    FlagSpec("kv_cache_config.copy_on_partial_reuse", bool, NOT_MODELLED,
             "copies a partly matched block that is in use; tailserve reuses whole blocks only",
             _field("KvCacheConfig", "copy_on_partial_reuse"), "true"),
    FlagSpec("kv_cache_config.host_cache_size", int | None, SCHEDULING,
             "bytes of host memory per GPU for a secondary KV block pool: blocks evicted from the GPU are "
             "offloaded there and onboarded when a request reuses them (kv/secondary_pool.py)",
             _field("KvCacheConfig", "host_cache_size"), target="host_cache_size"),
    FlagSpec("kv_cache_config.secondary_offload_min_priority", int | None, SCHEDULING,
             "only blocks of at least this retention priority are offloaded to the host pool (every block "
             "has the default, 35, as no request sets a retention config)",
             _field("KvCacheConfig", "secondary_offload_min_priority"), "30",
             target="secondary_offload_min_priority"),
    FlagSpec("kv_cache_config.max_attention_window", list | None, NOT_MODELLED,
             "sliding-window attention: only the last tokens stay in the KV cache",
             _field("KvCacheConfig", "max_attention_window")),
)  # fmt: skip


# ---- TensorRT-LLM 1.3 / 1.4: SchedulerConfig's additions --------------------------------------
# The option and its wiring are read in the newest stored copy of the repository (commit 0004396,
# whose SchedulerConfig has use_python_scheduler and enable_prefix_aware_scheduling); the four
# 1.4 fields are on the 1.4.0rc4 reference page (signature and defaults) but in no stored source.
ARGS_MAIN = "tensorrt_llm/llmapi/llm_args.py@0004396"
UTIL_MAIN = "tensorrt_llm/_torch/pyexecutor/_util.py@0004396 create_py_executor_instance"
DOCS_1_4 = "nvidia.github.io/TensorRT-LLM/1.4.0rc4/llm-api/reference/SchedulerConfig.html"


def _docs(name: str) -> str:
    return f"{DOCS_1_4}#tensorrt_llm.llmapi.SchedulerConfig.{name}"


_NO_SOURCE = (
    "not modelled: only the 1.4.0rc4 reference page shows it; no stored TensorRT-LLM source implements it "
    f"(the newest stored SchedulerConfig, {ARGS_MAIN}, has no such field), so its rule is not known"
)
_CONTEXT_ORDER = Literal["fcfs", "shortest_uncached_first"]

KEYS_1_4 = (
    FlagSpec("scheduler_config.enable_prefix_aware_scheduling", bool, SCHEDULING,
             "the micro-batch scheduler charges a context's first chunk only the prompt tokens its cached prefix "
             "does not cover (policies/trtllm_prefix_aware.py; what it changes in admission and in the deferral of "
             "duplicate contexts is not modelled)",
             f"{ARGS_MAIN} SchedulerConfig.enable_prefix_aware_scheduling; {UTIL_MAIN} (to BindCapacityScheduler)",
             "true", target="enable_prefix_aware_scheduling"),
    FlagSpec("scheduler_config.use_python_scheduler", bool, NOT_MODELLED,
             "true schedules with the pure-Python SimpleUnifiedScheduler (one fused pass: "
             "_torch/pyexecutor/scheduler/design.md lists where it differs) instead of the C++ SimpleScheduler "
             "the trtllm policy follows", f"{ARGS_MAIN} SchedulerConfig.use_python_scheduler; {UTIL_MAIN}", "false"),
    FlagSpec("scheduler_config.context_scheduling_policy", _CONTEXT_ORDER, NOT_MODELLED,
             "the order pending contexts are admitted in: fcfs (arrival) or shortest_uncached_first (fewest prompt "
             f"tokens not covered by reusable KV first); {_NO_SOURCE}; the trtllm policy admits in arrival order",
             _docs("context_scheduling_policy"), "fcfs"),
    FlagSpec("scheduler_config.context_starvation_iterations", int | None, NOT_MODELLED,
             f"iterations a pending context may be passed over (> 0, or none); {_NO_SOURCE}",
             _docs("context_starvation_iterations")),
    FlagSpec("scheduler_config.gen_preemption", dict, NOT_MODELLED,
             f"GenPreemptionConfig: preemption of generation requests; {_NO_SOURCE} (nor its fields)",
             _docs("gen_preemption")),
    FlagSpec("scheduler_config.max_gen_init_admissions_per_pass", int | None, NOT_MODELLED,
             "disaggregated generation-init requests admitted per pass (> 0, or none): the trtllm policy has no "
             f"disaggregated serving; {_NO_SOURCE}", _docs("max_gen_init_admissions_per_pass")),
)  # fmt: skip


def positive_or_none_1_4(given: Given) -> list[Finding]:
    """``context_starvation_iterations`` and ``max_gen_init_admissions_per_pass`` are
    ``Annotated[int, Gt(gt=0)] | None`` (1.4.0rc4's ``SchedulerConfig``): pydantic refuses 0 and
    below, and the engine does not start."""
    found = []
    for key in (
        "scheduler_config.context_starvation_iterations",
        "scheduler_config.max_gen_init_admissions_per_pass",
    ):
        value = given.get(key)
        if value is not None and value <= 0:
            found.append(
                Finding(
                    (key,),
                    REFUSED,
                    f"{key} must be > 0 or null, got {value}: the engine refuses to start",
                    _docs(key.removeprefix("scheduler_config.")) + " (an int with Gt(gt=0), or None)",
                )
            )
    return found


def defaults_do_nothing_1_4(given: Given) -> list[Finding]:
    """The 1.4 keys set to what the engine (and tailserve) does anyway: arrival order, the C++
    scheduler; the prefix-aware charge without block reuse (no reuse tree, every estimate 0)."""
    found = []
    if given.get("scheduler_config.context_scheduling_policy") == "fcfs":
        found.append(
            Finding(("scheduler_config.context_scheduling_policy",), NO_OP,
                    "fcfs: contexts admitted in arrival order, the default (what the trtllm policy does)",
                    _docs("context_scheduling_policy"))
        )  # fmt: skip
    if given.get("scheduler_config.use_python_scheduler") is False:
        found.append(
            Finding(("scheduler_config.use_python_scheduler",), NO_OP,
                    "false: the C++ SimpleScheduler, the default (the one the trtllm policy follows)",
                    f"{ARGS_MAIN} SchedulerConfig.use_python_scheduler")
        )  # fmt: skip
    if given.get("scheduler_config.enable_prefix_aware_scheduling") and not given.get(
        "kv_cache_config.enable_block_reuse", True
    ):
        found.append(
            Finding(("scheduler_config.enable_prefix_aware_scheduling",), NO_OP,
                    "kv_cache_config.enable_block_reuse is false: no reuse tree, every estimate is 0",
                    "docs/source/features/kvcache.md (reusable-token estimates; reuse follows enable_block_reuse)")
        )  # fmt: skip
    return found


def chunking_policy_needs_chunking(given: Given) -> list[Finding]:
    """The chunking policy orders chunks: without chunked prefill the micro-batch scheduler is
    made with no chunk config and never reads it."""
    key = "scheduler_config.context_chunking_policy"
    if key not in given or given.get("enable_chunked_prefill", False):
        return []
    return [
        Finding(
            (key,),
            NO_OP,
            "enable_chunked_prefill is false: contexts run whole, there are no chunks to order",
            f"{MICRO} PyMicroBatchScheduler (ctx_chunk_config is None without chunked prefill)",
        )
    ]


def batch_wait_needs_both(given: Given) -> list[Finding]:
    """``_waiting_requests`` runs the contexts once ``count >= batch_wait_timeout_iters`` or
    ``tokens >= batch_wait_max_tokens_ratio x max_num_tokens``: either at 0 passes at once."""
    iters, ratio = "batch_wait_timeout_iters", "batch_wait_max_tokens_ratio"
    set_iters, set_ratio = given.get(iters, 0) > 0, given.get(ratio, 0) > 0
    if set_iters == set_ratio:
        return []
    other = ratio if set_iters else iters
    return [
        Finding(
            (iters if set_iters else ratio,),
            NO_OP,
            f"{other} is 0: its test (>= 0) always passes, so no context is ever held; set both above 0",
            WAITING,
        )
    ]


def balance_needs_attention_dp(given: Given) -> list[Finding]:
    """``_balance_adp_requests`` runs only with ``enable_attention_dp`` (``PyExecutor._schedule``)."""
    if given.get("enable_attention_dp", False):
        return []
    return [
        Finding(
            (key,),
            NO_OP,
            "enable_attention_dp is false: there are no attention-DP ranks to balance",
            "tensorrt_llm/_torch/pyexecutor/py_executor.py@1.2 PyExecutor._schedule "
            "(enable_attention_dp and attention_dp_enable_balance)",
        )
        for key in given.values
        if key.startswith("attention_dp_config.")
    ]


_OVERRIDES = {
    "model": "model",
    "tp_size": "tensor_parallel_size",
    "pp_size": "pipeline_parallel_size",
    "ep_size": "moe_expert_parallel_size",
    "max_batch_size": "max_batch_size",
    "max_num_tokens": "max_num_tokens",
    "max_seq_len": "max_seq_len",
    "max_beam_width": "max_beam_width",
    "enable_chunked_prefill": "enable_chunked_prefill",
    "backend": "backend",
    "kv_cache_free_gpu_memory_fraction": "kv_cache_config.free_gpu_memory_fraction",
}  # trtllm-serve's flag (table name) -> the LLM API option it sets (get_llm_args)
_SECTIONS = ("scheduler_config", "kv_cache_config", "attention_dp_config")
_PRECEDENCE = (
    f"{ARGS} update_llm_args_with_extra_dict (the file's keys over the flags'; kv_cache_config "
    "merged key by key, TensorRT-LLM#9262), from serve.py@00209af serve()"
)
_REFUSES = f'{ARGS} BaseLlmArgs model_config extra="forbid" (nested configs: StrictBaseModel)'

OPTIONS_FILE = OptionsFile("extra_llm_api_options", KEYS, _SECTIONS, _OVERRIDES, _PRECEDENCE, _REFUSES)
# 1.4.0rc4: 1.2.1's keys and SchedulerConfig's additions (trtllm_flags.TRTLLM_1_4_0RC4 says what
# else of 1.3/1.4 was not read).
OPTIONS_FILE_1_4 = OptionsFile(
    "extra_llm_api_options", KEYS + KEYS_1_4, _SECTIONS, _OVERRIDES, _PRECEDENCE, _REFUSES
)
