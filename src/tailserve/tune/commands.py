"""The command line each engine takes for a tuned policy: vLLM ``EngineArgs``, SGLang
``ServerArgs``, TGI ``text-generation-launcher``, TensorRT-LLM's ``trtllm-serve`` with its
``--extra_llm_api_options`` YAML, Sarathi-Serve's config, ``tailserve serve``."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from tailserve.executors.simulated.deployment import Deployment
from tailserve.executors.simulated.models import HF_REPOS, get_model
from tailserve.policies.registry import PolicySpec, get_policy_cls
from tailserve.policies.sglang_spec import AUTO_NUM_STEPS


@dataclass(frozen=True, slots=True)
class _FormatFlags:
    """How an engine spells a deployment's formats and expert parallelism on its command line."""

    quantize: str  # online FP8 quantization
    kv_cache: str | None = None  # the KV cache's format, with FP8 spelled as ``kv_fp8``
    kv_fp8: str = ""
    expert_parallel: str | None = None  # ``{tp}`` becomes the TP degree


# tailserve's exchange names (vLLM's --all2all-backend) as SGLang's --deepep-mode
_SGLANG_DEEPEP = {
    "deepep_low_latency": "low_latency",
    "deepep_high_throughput": "normal",
    "deepep_auto": "auto",
}
ALL2ALL_DEFAULT = "allgather_reducescatter"

VLLM_FLAGS = _FormatFlags("--quantization", "--kv-cache-dtype", "fp8", "--enable-expert-parallel")
SGLANG_FLAGS = _FormatFlags("--quantization", "--kv-cache-dtype", "fp8_e4m3", "--ep-size {tp}")
TGI_FLAGS = _FormatFlags("--quantize")


# The engine-wide flags a spec may set (registry.ENGINE_FLAGS), in each engine's spelling; only
# those a spec sets are written (unset, the engine decides as the simulation did). TensorRT-LLM's
# go into its flags and YAML in ``_trtllm_command``.
_ENGINE_SPELLING = {
    "vllm": {
        "block_size": "--block-size",
        "gpu_memory_utilization": "--gpu-memory-utilization",
        "max_model_len": "--max-model-len",
        "kv_cache_memory_bytes": "--kv-cache-memory-bytes",
        "num_gpu_blocks_override": "--num-gpu-blocks-override",
    },
    "sglang": {
        "block_size": "--page-size",
        "gpu_memory_utilization": "--mem-fraction-static",
        "max_model_len": "--context-length",
        "max_total_tokens": "--max-total-tokens",
    },
}


def _engine_flags(spec: PolicySpec, engine: str) -> list[str]:
    spelling = _ENGINE_SPELLING[engine]
    return [f"{spelling[name]} {value:g}" if isinstance(value, float) else f"{spelling[name]} {value}"
            for name, value in spec.engine_flags.items() if name in spelling]  # fmt: skip


def _formats(deployment: Deployment, flags: _FormatFlags) -> list[str]:
    """Online FP8 quantization, an FP8 KV cache and expert parallelism in the engine's spelling.
    Other formats (block-scaled FP8, AWQ/GPTQ, MXFP4, NVFP4) come with their checkpoints, which
    the engines read from config.json: no flag."""
    parts = []
    if deployment.quantization == "fp8":
        parts.append(f"{flags.quantize} fp8")
    if flags.kv_cache and deployment.kv_cache_dtype == "fp8":
        parts.append(f"{flags.kv_cache} {flags.kv_fp8}")
    if flags.expert_parallel and deployment.expert_parallel:
        parts.append(flags.expert_parallel.format(tp=deployment.tp))
    return parts


def command_line(
    spec: PolicySpec, deployment: Deployment, model_id: str | None, device: Any, max_model_len: int
) -> str | None:
    """The engine's own command with this policy's budget flags (flag names from each engine's
    CLI: vLLM ``EngineArgs``, SGLang ``ServerArgs``, TGI ``text-generation-launcher``)."""
    cls = get_policy_cls(spec.name)
    config = cls.default_config(device, max_model_len, **spec.flags)
    model = model_id or HF_REPOS.get(get_model(deployment.model).name) or deployment.model
    tp = deployment.tp
    if spec.name in ("vllm", "vllm-v0"):
        parts = ["vllm serve", model]
        if spec.name == "vllm-v0":
            parts.insert(0, "VLLM_USE_V1=0")  # vLLM <= 0.10 still ships the V0 engine behind this
        if tp > 1:
            parts.append(f"--tensor-parallel-size {tp}")
        if deployment.pp > 1:  # the stages (engines/vllm_flags.py reads -pp back into the deployment)
            parts.append(f"--pipeline-parallel-size {deployment.pp}")
        if deployment.dp > 1:
            # vLLM's DP ranks of --tp GPUs each (an MoE model's in lockstep: tailserve's DP engine)
            parts.append(f"--data-parallel-size {deployment.dp}")
            if deployment.all2all_backend != ALL2ALL_DEFAULT:
                parts.append(f"--all2all-backend {deployment.all2all_backend}")
        parts += _formats(deployment, VLLM_FLAGS)
        if deployment.enable_eplb:
            # vLLM's EPLB: its redundant experts in --eplb-config (engines/vllm_flags.py reads it back)
            parts.append("--enable-eplb")
            if deployment.num_redundant_experts:
                eplb = {"num_redundant_experts": deployment.num_redundant_experts}
                parts.append(f"--eplb-config '{json.dumps(eplb)}'")
        parts += [
            f"--max-num-batched-tokens {config.max_num_batched_tokens}",
            f"--max-num-seqs {config.max_num_seqs}",
        ]
        if spec.name == "vllm-v0" and config.enable_chunked_prefill:
            parts.append("--enable-chunked-prefill")
        if spec.name == "vllm-v0" and config.preemption_mode != "auto":
            parts.append(f"--preemption-mode {config.preemption_mode}")
        if config.long_prefill_token_threshold:
            parts.append(f"--long-prefill-token-threshold {config.long_prefill_token_threshold}")
        if config.scheduling_policy != "fcfs":
            parts.append(f"--scheduling-policy {config.scheduling_policy}")
        if spec.name == "vllm" and spec.flags.get("async_scheduling") is not None:
            # Only when set: unset, vLLM 0.32 decides as the simulation did (on on a GPU).
            parts.append("--async-scheduling" if config.async_scheduling else "--no-async-scheduling")
        if spec.name == "vllm" and config.num_speculative_tokens:
            # The drafter's checkpoint ("model") is the user's; the synthetic acceptance rates
            # are the simulation's input, not a serving setting.
            speculative = {
                "method": config.speculative_method,
                "num_speculative_tokens": config.num_speculative_tokens,
            }
            parts.append(f"--speculative-config '{json.dumps(speculative)}'")
        if spec.name == "vllm" and config.kv_offloading_size:
            parts.append(f"--kv-offloading-size {config.kv_offloading_size:g}")  # the native CPU tier
        if spec.name == "vllm":
            parts += _vllm_032_flags(config)
        parts += _engine_flags(spec, "vllm")
        return " ".join(parts)
    if spec.name == "sglang":
        parts = ["python -m sglang.launch_server", f"--model-path {model}"]
        if deployment.data_parallel_group:
            # tailserve's DP engine of an MoE model is SGLang's DP attention: the TP group spans
            # every GPU, its attention split into dp ranks (engines/translate.py _attention_dp
            # reads it back so), the experts over all of them
            gpus = tp * deployment.dp
            parts += [f"--tp {gpus}", f"--dp {deployment.dp}", "--enable-dp-attention"]
            if deployment.expert_parallel:
                parts.append(f"--ep-size {gpus}")
            if deployment.all2all_backend in _SGLANG_DEEPEP:
                parts.append(
                    f"--moe-a2a-backend deepep --deepep-mode {_SGLANG_DEEPEP[deployment.all2all_backend]}"
                )
            # (the formats only: expert parallelism, and EPLB with it, are written here and below)
            parts += _formats(
                replace(deployment, expert_parallel=False, enable_eplb=False, num_redundant_experts=0),
                SGLANG_FLAGS,
            )
        else:
            if tp > 1:
                parts.append(f"--tp {tp}")
            if deployment.dp > 1:  # a dense model's replicas behind SGLang's round-robin controller
                parts.append(f"--dp {deployment.dp}")
            parts += _formats(deployment, SGLANG_FLAGS)
        if deployment.enable_eplb:
            parts.append("--enable-eplb")
            if deployment.num_redundant_experts:
                parts.append(f"--ep-num-redundant-experts {deployment.num_redundant_experts}")
        parts += [
            f"--chunked-prefill-size {config.chunked_prefill_size}",
            f"--schedule-policy {config.schedule_policy}",
        ]
        if config.enable_mixed_chunk:
            parts.append("--enable-mixed-chunk")
        if config.schedule_conservativeness != 1.0:
            parts.append(f"--schedule-conservativeness {config.schedule_conservativeness:g}")
        if config.enable_hierarchical_cache:  # SGLang's HiCache host tier, as simulated
            parts.append("--enable-hierarchical-cache")
            if config.hicache_size:
                parts.append(f"--hicache-size {config.hicache_size}")
            elif config.hicache_ratio is not None:
                parts.append(f"--hicache-ratio {config.hicache_ratio:g}")
            if config.hicache_write_policy != "write_through":
                parts.append(f"--hicache-write-policy {config.hicache_write_policy}")
        if spec.flags.get("disable_overlap_schedule"):
            # Only when asked: unset, SGLang overlaps on a GPU as the simulation did (spec v2 too).
            parts.append("--disable-overlap-schedule")
        if config.speculative_algorithm is not None:
            # The sizes as simulated, spelled out (SGLang's auto choice differs by architecture:
            # Llama's is a top-k 4 tree). The draft checkpoint (--speculative-draft-model-path,
            # not needed for NEXTN) is the user's; the synthetic acceptance is the simulation's.
            steps = config.speculative_num_steps or AUTO_NUM_STEPS
            parts += [
                f"--speculative-algorithm {config.speculative_algorithm}",
                f"--speculative-num-steps {steps}",
                "--speculative-eagle-topk 1",
                f"--speculative-num-draft-tokens {steps + 1}",
            ]
        for name in ("max_queued_requests", "prefill_max_requests", "prefill_decode_interval"):
            if (value := getattr(config, name)) is not None:
                parts.append(f"--{name.replace('_', '-')} {value}")
        if config.prefill_decode_interval_min_bs:
            parts.append(f"--prefill-decode-interval-min-bs {config.prefill_decode_interval_min_bs}")
        if config.stream_interval > 1:
            parts.append(f"--stream-interval {config.stream_interval}")
        parts += _engine_flags(spec, "sglang")
        return " ".join(parts)
    if spec.name == "tgi":
        parts = ["text-generation-launcher", f"--model-id {model}"]
        if tp > 1:
            parts.append(f"--num-shard {tp}")
        parts += _formats(deployment, TGI_FLAGS)
        parts += [
            f"--max-batch-prefill-tokens {config.max_batch_prefill_tokens}",
            f"--waiting-served-ratio {config.waiting_served_ratio:g}",
            f"--max-waiting-tokens {config.max_waiting_tokens}",
        ]
        return " ".join(parts)
    if spec.name == "trtllm":
        return _trtllm_command(spec, config, deployment, model)
    if spec.name == "slo":
        # tailserve's own scheduler: served by tailserve itself; the engines' closest flags are
        # the best-ranked engine's command above it.
        parts = ["tailserve serve --model MODEL_DIR --policy slo"]
        if config.slo_classes:
            parts.append(f"--slo-classes '{config.slo_classes}'")
        return " ".join(parts)
    if spec.name == "sarathi":
        # Sarathi-Serve is a research system configured through its flat config (its
        # ``create_flat_dataclass`` names: the class in snake case, then the field). Its
        # ParallelConfig defaults to 2 pipeline stages, so the stages are always written.
        return (
            f"sarathi-serve config: --scheduler_config_type SARATHI --sarathi_scheduler_config_chunk_size "
            f"{config.chunk_size} --sarathi_scheduler_config_max_num_seqs {config.max_num_seqs} "
            f"--parallel_config_tensor_parallel_size {deployment.tp} "
            f"--parallel_config_pipeline_parallel_size {deployment.pp}"
        )
    return None


def _vllm_032_flags(config: Any) -> list[str]:
    """vLLM 0.32's scheduling flags when set: the fair-share chunk floor, the admission limit below
    max_num_seqs, DP prefill balancing's interval, the API server's admission limits and its
    stream interval."""
    parts = []
    if config.long_prefill_token_threshold_adaptive:
        parts.append("--long-prefill-token-threshold-adaptive")
    if config.max_num_active_seqs is not None:
        parts.append(f"--max-num-active-seqs {config.max_num_active_seqs}")
    if config.prefill_schedule_interval > 1:
        parts.append(f"--prefill-schedule-interval {config.prefill_schedule_interval}")
    for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
        if (value := getattr(config, name)) is not None:
            parts.append(f"--{name.replace('_', '-')} {value}")
    if config.stream_interval > 1:
        parts.append(f"--stream-interval {config.stream_interval}")
    return parts


def _trtllm_command(spec: PolicySpec, config: Any, deployment: Deployment, model: str) -> str:
    """``trtllm-serve`` (``tensorrt_llm/commands/serve.py``: ``--tp_size``, ``--ep_size``,
    ``--max_batch_size``, ``--max_num_tokens``, ``--kv_cache_free_gpu_memory_fraction``,
    ``--extra_llm_api_options FILE``) and, written just before it, the YAML file of the LLM-API
    fields that have no flag of their own (``enable_chunked_prefill``, ``scheduler_config`` with
    ``enable_prefix_aware_scheduling`` when set,
    ``kv_cache_config`` with its ``host_cache_size`` when set, and when set ``speculative_config``, ``cuda_graph_config``,
    ``attention_dp_config``, ``disable_overlap_scheduler``, the ``batch_wait_*`` pair,
    ``stream_interval``, ``moe_config``'s load balancer for EPLB), in YAML's
    one-line form. Online FP8 quantization has no flag: the
    PyTorch backend reads quantized (ModelOpt) checkpoints."""
    kv = [f"enable_block_reuse: {str(config.enable_block_reuse).lower()}"]
    if "block_size" in spec.engine_flags:
        kv.append(f"tokens_per_block: {spec.engine_flags['block_size']}")
    if deployment.kv_cache_dtype == "fp8":
        kv.append("dtype: fp8")
    if "max_total_tokens" in spec.engine_flags:
        kv.append(f"max_tokens: {spec.engine_flags['max_total_tokens']}")
    if config.host_cache_size:  # the host KV pool, bytes per GPU (kv/secondary_pool.py)
        kv.append(f"host_cache_size: {int(config.host_cache_size)}")
    if config.secondary_offload_min_priority is not None:
        kv.append(f"secondary_offload_min_priority: {config.secondary_offload_min_priority}")
    scheduler = [f"capacity_scheduler_policy: {config.capacity_scheduler_policy}"]
    if config.enable_chunked_prefill:
        scheduler.append(f"context_chunking_policy: {config.context_chunking_policy}")
    if config.enable_prefix_aware_scheduling:  # a 1.3+ key (1.2.1 refuses it): only when asked for
        scheduler.append("enable_prefix_aware_scheduling: true")
    extra = ""
    if config.decoding_type is not None:
        # The drafter's checkpoint is the user's; the acceptance is the simulation's input.
        count = (
            f"num_nextn_predict_layers: {config.num_draft_tokens}"
            if config.decoding_type == "MTP"
            else f"max_draft_len: {config.num_draft_tokens}"
        )
        extra += f", speculative_config: {{decoding_type: {config.decoding_type}, {count}}}"
    if config.cuda_graph_padding_enabled:
        graphs = ["enable_padding: true"]
        if config.cuda_graph_batch_sizes is not None:
            graphs.append(f"batch_sizes: [{', '.join(str(s) for s in config.captured_batch_sizes())}]")
        elif config.cuda_graph_max_batch_size:
            graphs.append(f"max_batch_size: {config.cuda_graph_max_batch_size}")
        extra += f", cuda_graph_config: {{{', '.join(graphs)}}}"
    # tailserve's DP engine of TP-1 ranks is enable_attention_dp over tp_size = the ranks
    # (engines/translate.py _attention_dp reads it back so).
    attention_dp = deployment.dp > 1 and deployment.tp == 1
    if attention_dp:
        extra += ", enable_attention_dp: true"
    if config.attention_dp_enable_balance:
        extra += (
            f", attention_dp_config: {{enable_balance: true, timeout_iters: {config.attention_dp_timeout_iters}, "
            f"batching_wait_iters: {config.attention_dp_batching_wait_iters}}}"
        )
    if spec.flags.get("disable_overlap_scheduler"):  # asked for (its default, false, overlaps)
        extra += ", disable_overlap_scheduler: true"
    if config.batch_waiting:
        extra += (
            f", batch_wait_timeout_iters: {config.batch_wait_timeout_iters}, "
            f"batch_wait_max_tokens_ratio: {config.batch_wait_max_tokens_ratio:g}"
        )
    if config.batch_wait_timeout_ms:
        extra += f", batch_wait_timeout_ms: {config.batch_wait_timeout_ms:g}"
    if config.stream_interval > 1:
        extra += f", stream_interval: {config.stream_interval}"
    if deployment.enable_eplb:
        # EPLB: the model's experts plus the redundant ones as slots, moved while serving
        # (layer_updates_per_iter > 0: online EPLB; with 0 and no initial_global_assignments the
        # slots keep TensorRT-LLM's placement by index, engines/trtllm_options.py)
        slots = get_model(deployment.model).num_experts + deployment.num_redundant_experts
        extra += f", moe_config: {{load_balancer: {{num_slots: {slots}, layer_updates_per_iter: 1}}}}"
    yaml = (
        f"{{enable_chunked_prefill: {str(config.enable_chunked_prefill).lower()}, "
        f"scheduler_config: {{{', '.join(scheduler)}}}, kv_cache_config: {{{', '.join(kv)}}}{extra}}}"
    )
    parts = [f"echo '{yaml}' > trtllm-options.yaml &&", "trtllm-serve", model]
    tp_size = deployment.dp if attention_dp else deployment.tp
    if tp_size > 1:
        parts.append(f"--tp_size {tp_size}")
    if deployment.pp > 1:  # the stages (engines/trtllm_flags.py reads --pp_size back into the deployment)
        parts.append(f"--pp_size {deployment.pp}")
    if deployment.expert_parallel:
        parts.append(f"--ep_size {tp_size}")
    parts += [f"--max_batch_size {config.batch_size}", f"--max_num_tokens {config.num_tokens}"]
    if "gpu_memory_utilization" in spec.engine_flags:
        parts.append(f"--kv_cache_free_gpu_memory_fraction {spec.engine_flags['gpu_memory_utilization']:g}")
    if "max_model_len" in spec.engine_flags:
        parts.append(f"--max_seq_len {spec.engine_flags['max_model_len']}")
    parts.append("--extra_llm_api_options trtllm-options.yaml")
    return " ".join(parts)
