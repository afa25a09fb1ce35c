"""The command line each engine takes for a tuned policy: vLLM ``EngineArgs``, SGLang
``ServerArgs``, TGI ``text-generation-launcher``, Sarathi-Serve's config, ``tailserve serve``."""

from __future__ import annotations

from typing import Any

from tailserve.executors.simulated.deployment import Deployment
from tailserve.executors.simulated.models import HF_REPOS, get_model
from tailserve.policies.registry import PolicySpec, get_policy_cls


def _formats(deployment: Deployment, quant_flag: str, kv_flag: str | None, kv_fp8: str) -> list[str]:
    """Online FP8 quantization and an FP8 KV cache in the engine's spelling. Other formats
    (block-scaled FP8, AWQ/GPTQ, MXFP4, NVFP4) come with their checkpoints, which the engines
    read from config.json: no flag."""
    parts = []
    if deployment.quantization == "fp8":
        parts.append(f"{quant_flag} fp8")
    if kv_flag and deployment.kv_cache_dtype == "fp8":
        parts.append(f"{kv_flag} {kv_fp8}")
    if deployment.expert_parallel and kv_flag:  # vLLM and SGLang name it alike
        parts.append("--enable-expert-parallel" if kv_fp8 == "fp8" else "--ep-size " + str(deployment.tp))
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
        parts += _formats(deployment, "--quantization", "--kv-cache-dtype", "fp8")
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
        return " ".join(parts)
    if spec.name == "sglang":
        parts = ["python -m sglang.launch_server", f"--model-path {model}"]
        if tp > 1:
            parts.append(f"--tp {tp}")
        parts += _formats(deployment, "--quantization", "--kv-cache-dtype", "fp8_e4m3")
        parts += [
            f"--chunked-prefill-size {config.chunked_prefill_size}",
            f"--schedule-policy {config.schedule_policy}",
        ]
        if config.enable_mixed_chunk:
            parts.append("--enable-mixed-chunk")
        if config.schedule_conservativeness != 1.0:
            parts.append(f"--schedule-conservativeness {config.schedule_conservativeness:g}")
        return " ".join(parts)
    if spec.name == "tgi":
        parts = ["text-generation-launcher", f"--model-id {model}"]
        if tp > 1:
            parts.append(f"--num-shard {tp}")
        parts += _formats(deployment, "--quantize", None, "")
        parts += [
            f"--max-batch-prefill-tokens {config.max_batch_prefill_tokens}",
            f"--waiting-served-ratio {config.waiting_served_ratio:g}",
            f"--max-waiting-tokens {config.max_waiting_tokens}",
        ]
        return " ".join(parts)
    if spec.name == "slo":
        # tailserve's own scheduler: served by tailserve itself; the engines' closest flags are
        # the best-ranked engine's command above it.
        parts = ["tailserve serve --model MODEL_DIR --policy slo"]
        if config.slo_classes:
            parts.append(f"--slo-classes '{config.slo_classes}'")
        return " ".join(parts)
    if spec.name == "sarathi":
        # Sarathi-Serve is a research system configured through its benchmark's flat config.
        return (
            f"sarathi-serve config: --sarathi_scheduler_chunk_size {config.chunk_size} "
            f"--replica_scheduler_max_batch_size {config.max_num_seqs}"
        )
    return None
