"""TensorRT-LLM's ``trtllm-serve`` flags, version 1.2.1.

Source: ``tensorrt_llm/commands/serve.py`` as stored at commit 00209af (its ``serve`` command's
click options and ``get_llm_args``), cited by option, since the PyPI package of 1.2.1 is a stub
that downloads the wheel from NVIDIA's own index and could not be read here; the stored copy
was not checked against the v1.2.1 tag. click takes the options exactly as declared: underscores
(``--max_batch_size``; ``--max-batch-size`` is refused), no abbreviations. The scheduler's own
policies (capacity scheduler, context chunking) are set in the YAML of ``--config`` /
``--extra_llm_api_options``, which ``lint`` reads key by key (``trtllm_options.py``: its table,
and how the file wins over these flags).
"""

from __future__ import annotations

from tailserve.engines.flag_spec import (
    DEPLOYMENT,
    NOT_MODELLED,
    OTHER,
    SCHEDULING,
    EngineVersion,
    FlagSpec,
)
from tailserve.engines.trtllm_options import BACKEND_WHAT as _BACKEND_WHAT
from tailserve.engines.trtllm_options import (
    OPTIONS_FILE,
    OPTIONS_FILE_1_4,
    balance_needs_attention_dp,
    batch_wait_needs_both,
    chunking_policy_needs_chunking,
    defaults_do_nothing_1_4,
    moe_load_balancer_rule,
    pipeline_loop_rule,
    positive_or_none_1_4,
)

V = "1.2.1"
SERVE = "tensorrt_llm/commands/serve.py@00209af"


def _opt(name: str) -> str:
    return f'{SERVE} @click.option("--{name}")'


TRTLLM_1_2_1 = EngineVersion(
    "trtllm", V, "TensorRT-LLM serve.py @00209af",
    (
        FlagSpec("tp_size", int, DEPLOYMENT, "tensor-parallel degree", _opt("tensor_parallel_size"), "1",
                 aliases=("--tensor_parallel_size",), target="deployment.tp"),
        FlagSpec("pp_size", int, DEPLOYMENT, "pipeline stages of tp_size GPUs each (tailserve --pipeline-parallel-size)",
                 _opt("pipeline_parallel_size"), "1", aliases=("--pipeline_parallel_size",), target="deployment.pp"),
        FlagSpec("ep_size", int, DEPLOYMENT, "expert parallelism: = tp_size splits experts whole over the TP ranks",
                 _opt("moe_expert_parallel_size"), aliases=("--moe_expert_parallel_size",),
                 target="deployment.expert_parallel"),
        FlagSpec("max_batch_size", int, SCHEDULING, "most requests the engine schedules at once",
                 _opt("max_batch_size"), "BuildConfig's"),
        FlagSpec("max_num_tokens", int, SCHEDULING, "batched input tokens per step", _opt("max_num_tokens"),
                 "BuildConfig's"),
        FlagSpec("max_seq_len", int, DEPLOYMENT, "context length (prompt + outputs)", _opt("max_seq_len"),
                 "the model's", target="max_model_len"),
        FlagSpec("enable_chunked_prefill", bool, SCHEDULING, "split context (prefill) into chunks",
                 _opt("enable_chunked_prefill"), "false"),
        FlagSpec("kv_cache_free_gpu_memory_fraction", float, DEPLOYMENT,
                 "fraction of the memory left after weights and activations for the KV cache (the trtllm "
                 "policy applies --gpu-memory-utilization so)", _opt("free_gpu_memory_fraction"), "0.9",
                 aliases=("--free_gpu_memory_fraction",), target="gpu_memory_utilization"),
        FlagSpec("backend", ("pytorch", "tensorrt", "trt", "_autodeploy"), SCHEDULING, _BACKEND_WHAT,
                 _opt("backend"), "pytorch", target="disable_overlap_scheduler"),
        FlagSpec("extra_llm_api_options", str, OTHER,
                 "a YAML of LLM API options (scheduler_config, kv_cache_config, ...): read, one row per key "
                 "below, each over the flag it sets", _opt("extra_llm_api_options"), aliases=("--config",)),
        FlagSpec("max_beam_width", int, NOT_MODELLED, "beam search width", _opt("max_beam_width")),
    ),
    rules=(chunking_policy_needs_chunking, balance_needs_attention_dp, batch_wait_needs_both, moe_load_balancer_rule,
           pipeline_loop_rule),
    policy="trtllm",
    positional=f'{SERVE} @click.argument("model")',
    underscores=False,
    abbrev=False,
    dashes=False,
    options_file=OPTIONS_FILE,
)  # fmt: skip

# TensorRT-LLM 1.4.0rc4, as far as it was read: 1.2.1's table (its serve flags and LLM API keys
# were not read again for 1.4) with SchedulerConfig's 1.3/1.4 fields (trtllm_options.KEYS_1_4),
# and the scheduler's 1.3 default that differs from the trtllm policy's (1.2.1's):
# enable_prefix_aware_scheduling true. A key 1.3/1.4 added elsewhere reads as unknown here, one
# they removed is still taken. Not the default version: lint and --engine-cmd read 1.2.1 unless
# --engine-version names this one.
TRTLLM_1_4_0RC4 = EngineVersion(
    "trtllm", "1.4.0rc4",
    "TensorRT-LLM 1.2.1's table (serve.py @00209af, llm_args.py of the 1.2 line) with SchedulerConfig's "
    "1.3/1.4 fields (llm_args.py @0004396, the 1.4.0rc4 reference page)",
    TRTLLM_1_2_1.flags,
    rules=(chunking_policy_needs_chunking, balance_needs_attention_dp, batch_wait_needs_both, pipeline_loop_rule, positive_or_none_1_4,
           defaults_do_nothing_1_4, moe_load_balancer_rule),
    policy="trtllm",
    policy_defaults={"enable_prefix_aware_scheduling": True},
    positional=TRTLLM_1_2_1.positional,
    underscores=False,
    abbrev=False,
    dashes=False,
    options_file=OPTIONS_FILE_1_4,
    known_as=V,
)  # fmt: skip

VERSIONS = (TRTLLM_1_2_1, TRTLLM_1_4_0RC4)
DEFAULT = TRTLLM_1_2_1  # the version the trtllm policy follows (lint's and --engine-cmd's default)
