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

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

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
FETCH = (
    "tensorrt_llm/_torch/pyexecutor/executor_request_queue.py ExecutorRequestQueue._get_from_request_queue "
    "(NVIDIA/TensorRT-LLM@a98a906)"
)
_TORCH_ONLY = {
    "cuda_graph_config", "attention_dp_config", "disable_overlap_scheduler", "batch_wait_timeout_ms",
    "batch_wait_timeout_iters", "batch_wait_max_tokens_ratio", "stream_interval", "moe_config",
}  # fmt: skip
_CAPACITY = Literal["GUARANTEED_NO_EVICT", "MAX_UTILIZATION", "STATIC_BATCH"]
_CHUNKING = Literal["FIRST_COME_FIRST_SERVED", "EQUAL_PROGRESS"] | None

# ---- MoeConfig and its load balancer (EPLB) ---------------------------------------------------
# MoeConfig's fields in the 1.2 line (a StrictBaseModel: any other key stops the engine), and
# MoeLoadBalancerConfig's, whether given inline (a mapping) or as the path of a YAML file of them
# (TorchLlmArgs.validate_load_balancer opens it from the engine's directory).
MOE_CONFIG_KEYS = (
    "backend",
    "max_num_tokens",
    "load_balancer",
    "disable_finalize_fusion",
    "use_low_precision_moe_combine",
)
LOAD_BALANCER_KEYS = ("num_slots", "initial_global_assignments", "layer_updates_per_iter")
LOAD_BALANCER = "tensorrt_llm/_torch/modules/fused_moe/moe_load_balancer.py maybe_create_moe_load_balancer"
WIDE_EP = "examples/wide_ep/README.md (num_slots, layer_updates_per_iter)"
MOE_CONFIG_WHAT = (
    "MoeConfig: its load_balancer (inline, or the path of a YAML of num_slots, layer_updates_per_iter, "
    "initial_global_assignments) is EPLB when it balances by load, online (layer_updates_per_iter > 0) or offline "
    "(initial_global_assignments from recorded load), with expert parallelism: tailserve --enable-eplb "
    "--num-redundant-experts (num_slots - the model's experts); backend, max_num_tokens and the rest not priced"
)


@dataclass(frozen=True, slots=True)
class LoadBalancer:
    """``moe_config.load_balancer`` as TensorRT-LLM reads it: its ``num_slots``, whether it
    moves experts while serving (``layer_updates_per_iter`` > 0) or starts from a placement of
    recorded load (``initial_global_assignments``), and the file it was read from (None inline)."""

    num_slots: int | None
    online: bool
    offline: bool
    path: str | None = None


class LoadBalancerFileMissing(ValueError):
    """The load balancer's YAML file is not there (the engine stops: "MoE load balancer config
    file not found")."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


def load_balancer(moe_config: Any) -> LoadBalancer | None:
    """The load balancer of a file's ``moe_config`` (None: none given); ValueError (one line,
    the engine's reason) for one it refuses, ``LoadBalancerFileMissing`` for a path not there."""
    if not isinstance(moe_config, dict):
        raise ValueError(f"moe_config: expected a mapping, got {moe_config!r}")
    unknown = [key for key in moe_config if key not in MOE_CONFIG_KEYS]
    if unknown:
        raise ValueError(
            f"moe_config.{unknown[0]} is not a MoeConfig option (StrictBaseModel: extra forbidden)"
        )
    value = moe_config.get("load_balancer")
    if value is None:
        return None
    path = None
    if isinstance(value, str):
        path = value
        if not Path(os.path.expanduser(path)).is_file():
            raise LoadBalancerFileMissing(path)
        try:
            value = yaml.safe_load(Path(os.path.expanduser(path)).read_text())
        except yaml.YAMLError:
            value = None
        if not isinstance(value, dict):
            raise ValueError(f"Failed to load MoE load balancer config file: {path} (not a YAML mapping)")
    if not isinstance(value, dict):
        raise ValueError(f"moe_config.load_balancer: expected a mapping or a file path, got {value!r}")
    where = f"MoE load balancer config file: {path}" if path else f"MoE load balancer config: {value}"
    unknown = [key for key in value if key not in LOAD_BALANCER_KEYS]
    if unknown:
        raise ValueError(f"Failed to load {where} ({unknown[0]}: extra inputs are not permitted)")
    slots, updates = value.get("num_slots"), value.get("layer_updates_per_iter", 0)
    for name, number in (("num_slots", slots), ("layer_updates_per_iter", updates)):
        if number is not None and (isinstance(number, bool) or not isinstance(number, int)):
            raise ValueError(f"Failed to load {where} ({name} must be an integer, got {number!r})")
    return LoadBalancer(slots, (updates or 0) > 0, bool(value.get("initial_global_assignments")), path)


def moe_load_balancer_rule(given: Given) -> list[Finding]:
    """What TensorRT-LLM makes of ``moe_config.load_balancer`` on this line: no balancer
    without expert parallelism (``maybe_create_moe_load_balancer`` makes one only when
    ``moe_ep_size > 1``; an unset ``moe_expert_parallel_size`` is 1) or with ``num_slots`` 0;
    its ``setup`` refuses no ``num_slots`` and slots that do not split over the EP ranks;
    ``layer_updates_per_iter`` 0 without ``initial_global_assignments`` is static routing on the
    default placement (rank r's slots hold experts r E/ep, r E/ep + 1, ... mod E: the redundant
    ones by index, not by load), which tailserve does not model."""
    if given.get("moe_config") is None:
        return []
    flags = ("moe_config",)
    try:
        balancer = load_balancer(given.get("moe_config"))
    except LoadBalancerFileMissing as e:
        return [Finding(flags, NOT_MODELLED, f"warning: the load balancer file {e.path} is not there (looked from "
                        f"{os.getcwd()}): not read; TensorRT-LLM stops at start (\"MoE load balancer config file not "
                        "found\")", _field("TorchLlmArgs", "validate_load_balancer"))]  # fmt: skip
    except ValueError as e:
        return [Finding(flags, REFUSED, f"{e}: the engine refuses to start", _REFUSES)]
    if balancer is None:
        return [Finding(flags, OTHER, "no load_balancer: the MoE kernels' settings, no scheduling effect tailserve "
                        "reads", _field("MoeConfig", "load_balancer"))]  # fmt: skip
    ep = given.get("moe_expert_parallel_size") or given.get("ep_size") or 1
    slots = balancer.num_slots
    if ep <= 1:
        return [Finding(flags, NO_OP, "no expert parallelism (moe_expert_parallel_size 1): TensorRT-LLM makes no load "
                        "balancer", f"{LOAD_BALANCER} (using_ep)")]  # fmt: skip
    if slots is None:
        return [Finding(flags, REFUSED, "`num_slots` cannot be None when calling setup().",
                        _field("MoeLoadBalancerConfig", "setup"))]  # fmt: skip
    if slots == 0:
        return [Finding(flags, NO_OP, "num_slots 0: MoE load balancing is disabled", WIDE_EP)]
    if slots % ep:
        return [Finding(flags, REFUSED, f"`num_slots` ({slots}) must be divisible by `ep_size` ({ep}).",
                        _field("MoeLoadBalancerConfig", "setup"))]  # fmt: skip
    if not (balancer.online or balancer.offline):
        return [Finding(flags, NOT_MODELLED, f"num_slots {slots} with layer_updates_per_iter 0 and no "
                        "initial_global_assignments: static routing on the default placement (rank r's slots hold "
                        "experts r*E/ep, r*E/ep + 1, ... mod E: the extra slots by index, not by load); tailserve "
                        "places redundant experts by load only (set layer_updates_per_iter > 0 for online EPLB)",
                        f"{LOAD_BALANCER} (is_static_routing); {WIDE_EP}")]  # fmt: skip
    how = "online (layer_updates_per_iter > 0)" if balancer.online else "offline (initial_global_assignments)"
    what = (
        f"EPLB, {how}: {slots} expert slots over {ep} EP ranks, simulated as --enable-eplb "
        "--num-redundant-experts (num_slots - the model's experts); moving the weights is not priced"
    )
    if balancer.path:
        what += f" (read from {balancer.path})"
    return [Finding(flags, DEPLOYMENT, what, f"{_field('MoeConfig', 'load_balancer')}; {WIDE_EP}")]


KEYS = (
    FlagSpec("model", str, DEPLOYMENT, "the model", _llm("model"), target="deployment.model"),
    FlagSpec("tensor_parallel_size", int, DEPLOYMENT, "tensor-parallel degree", _llm("tensor_parallel_size"),
             "1", target="deployment.tp"),
    FlagSpec("pipeline_parallel_size", int, DEPLOYMENT,
             "pipeline stages of tensor_parallel_size GPUs each (tailserve --pipeline-parallel-size)",
             _llm("pipeline_parallel_size"), "1", target="deployment.pp"),
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
    FlagSpec("moe_config", dict | None, DEPLOYMENT, MOE_CONFIG_WHAT,
             f"{_llm('moe_config')}; {_field('MoeConfig', 'load_balancer')}; {_field('TorchLlmArgs', 'validate_load_balancer')}",
             target="deployment.enable_eplb"),
    FlagSpec("cuda_graph_config", dict | None, OTHER,
             "CUDA graphs for decode-only batches: the time of a step, not who is in it; the trtllm policy "
             "prices enable_padding under its flags cuda_graph_padding_enabled, cuda_graph_batch_sizes, "
             "cuda_graph_max_batch_size", _llm("cuda_graph_config")),
    FlagSpec("disable_overlap_scheduler", bool, SCHEDULING,
             "true schedules each step after the last one's tokens are known; the overlap scheduler (on unless "
             "this is true) schedules step N+1 while step N runs, hiding the host work "
             "(policies/trtllm_overlap.py)", _llm("disable_overlap_scheduler"), "false"),
    FlagSpec("batch_wait_timeout_ms", float, SCHEDULING,
             "every step's fetch of new requests waits up to this long for max_batch_size of them (decoding "
             "steps too; Engine._fetched)", f"{_llm('batch_wait_timeout_ms')}; {FETCH}", "0"),
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


def pipeline_loop_rule(given: Given) -> list[Finding]:
    """Under ``pp_size`` > 1 the executor runs ``_executor_loop_pp`` (policies/trtllm_pipeline.py):
    it refuses a drafter at start-up, and never carries out MAX_UTILIZATION's pauses; tailserve
    refuses both, and ``batch_wait_timeout_ms``, which it does not simulate under stages."""
    key = "pp_size" if "pp_size" in given else "pipeline_parallel_size"
    if (given.get(key) or 1) <= 1:
        return []
    loop = "tensorrt_llm/_torch/pyexecutor/py_executor.py@1.2"
    found = []
    if given.get("speculative_config"):
        found.append(
            Finding(("speculative_config", key), REFUSED,
                    "Drafting is not supported for selected executor loop. Please disable disagg/pipeline "
                    "parallelism scheduler. (pipeline parallelism with a drafter: the engine refuses to start)",
                    f"{loop} PyExecutor.__init__")
        )  # fmt: skip
    if given.get("scheduler_config.capacity_scheduler_policy") == "MAX_UTILIZATION":
        found.append(
            Finding(("scheduler_config.capacity_scheduler_policy", key), NOT_MODELLED,
                    "MAX_UTILIZATION under pipeline parallelism: _executor_loop_pp never carries out its "
                    "pauses (no _pause_requests), so tailserve does not simulate it; GUARANTEED_NO_EVICT is",
                    f"{loop} _executor_loop_pp")
        )  # fmt: skip
    if given.get("batch_wait_timeout_ms"):
        found.append(
            Finding(("batch_wait_timeout_ms", key), NOT_MODELLED,
                    "batch_wait_timeout_ms under pipeline parallelism is not simulated",
                    f"{loop} _executor_loop_pp (_fetch_and_activate_new_requests)")
        )  # fmt: skip
    return found


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
