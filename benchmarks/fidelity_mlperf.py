"""MLPerf Inference v5.1 Server points, priced by the simulator (docs/fidelity.md, "MLPerf Inference
points"): held-out end-to-end checks at the published QPS, never fitted.

Each point is one closed-division Server result whose engine tailserve models (vLLM or
TensorRT-LLM) on a GPU and model of its catalog, read from mlcommons/inference_results_v5.1 at
commit ``RESULTS_COMMIT``: ``results/<system>/<benchmark>/Server/performance/run_1/
mlperf_log_summary.txt`` (scheduled and completed samples/s, completed tokens/s, TTFT and TPOT
percentiles), the system description (GPU, count, framework) and the submitter's engine flags.

Every submission runs one engine per GPU (TP 1: AMD's vLLM YAML ``tensor_parallel_size: 1`` with
``device_count: 8``; the TRT-LLM configs ``tensor_parallelism: 1``; Red Hat's one H100). A dense
model's replicas do not interact, so one replica is simulated at the scheduled rate divided by
the replica count, Poisson as LoadGen's Server scenario: exactly a random split over the replicas
(the harnesses balance by queue length, which can only lower the tails).

Lengths: every prompt's token count of the benchmark's sample set (``Dataset``: percentiles of
MLCommons' pickles as tabulated by openshift-psap/performance-dashboard); outputs the reference
answers' shape scaled to the submission's own mean (completed tokens/s / completed samples/s),
or the benchmark's cap where the model always reaches it. Each run is written as a tailserve JSONL
trace and replayed by ``tailserve simulate --trace`` with the submission's engine flags.

``--capacity`` also bisects for the highest rate per replica the simulation keeps VALID (both p99s
within the benchmark's limits): the simulator's MLPerf Server score against the published one.

``--offline N`` prices each system's Offline result too: N requests per replica at once, with the
flags the Offline run changed; its samples/s is the GPU's throughput ceiling, free of the Server
scenario's latency trade-offs.
DeepSeek-R1's answers run to 20,000 tokens: at a few thousand requests the run lasts as long as
its longest answer, so price it at the real run's count (``--points r1 --offline 26328``).

``--aisim-tables ENGINE=FILE,...`` prices each point's dense GEMMs and routed experts from
AISimulate's measured tables (``--calibration aisim:FILE``) of the engine whose kernels the point's
policy runs (``trtllm`` for TensorRT-LLM, ``vllm`` for vLLM and vLLM V0): FILE is that engine's
export, ``<peers>/aisimulate/bin/python -m benchmarks._aisim_tables --framework ENGINE --out FILE``
(an MLA model's attention block from the export's MLA module rows where it has them at the
point's heads, formats and KV dtype, else the catalog's terms; the note says which). A chosen point the tables cannot price
(no export for its engine, a GPU AISimulate did not time) is refused. ``--steps`` adds the simulated Server run's typical step (its iteration
log's tokens, requests and duration, each step weighted by the decodes it carries, as TPOT weighs
them): where the simulated server settles beside the step the measured run implies.

    python -m benchmarks.fidelity_mlperf [--span S] [--requests N] [--capacity] [--offline N] [--points NAME,...]
        [--aisim-tables ENGINE=FILE,...] [--steps] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks._common import cpu_line, save_results
from tailserve.cli.app import main as tailserve_main
from tailserve.executors.simulated import aisim_table
from tailserve.executors.simulated.deployment import kernel_engine
from tailserve.executors.simulated.hardware import KERNEL_ENGINES

RESULTS_REPO = "mlcommons/inference_results_v5.1"
RESULTS_COMMIT = "965182b03376a00fcae415c54e560e1c83937932"
# mlcommons/inference mlperf.conf (commit b66003e1): the Server scenario's p99 limits, seconds.
LIMITS = {"llama2-70b": (2.0, 0.200), "llama3_1-8b": (2.0, 0.100), "deepseek-r1": (2.0, 0.080)}


@dataclass(frozen=True)
class Dataset:
    """A benchmark's request lengths: the token count of every prompt of its sample set, as
    percentiles (0, 2, ..., 100), and the shape of its reference outputs (or None: every output
    is the benchmark's ``max_output``). The model's own output lengths differ from the reference
    answers', so the outputs are the reference shape scaled to each submission's measured mean."""

    name: str
    input_percentiles: tuple[int, ...]
    output_percentiles: tuple[int, ...] | None
    max_output: int
    source: str

    def sample(self, n: int, out_mean: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``n`` (input, output) lengths: inverse-CDF draws from the percentile tables."""
        grid = np.linspace(0.0, 1.0, len(self.input_percentiles))
        inputs = np.rint(np.interp(rng.random(n), grid, self.input_percentiles)).astype(int)
        if self.output_percentiles is None:
            return inputs, np.full(n, self.max_output)
        shape = np.interp(rng.random(n), grid, self.output_percentiles)
        scale = out_mean / shape.mean()
        for _ in range(20):  # the cap cuts the mean; rescale until the capped mean is the target
            outputs = np.clip(shape * scale, 1, self.max_output)
            scale *= out_mean / outputs.mean()
        return inputs, np.maximum(1, np.rint(np.clip(shape * scale, 1, self.max_output))).astype(int)


_DASHBOARD = "openshift-psap/performance-dashboard@7cd1065d mlperf-data/summaries/"
# Every prompt's token count of MLCommons' sample sets (input_length; output_length is the
# reference answer's), summarised here as percentiles 0, 2, ..., 100.
OPENORCA = Dataset(
    "OpenOrca (llama2-70b, 24,576 samples)",
    (48, 63, 71, 76, 81, 85, 89, 92, 96, 99, 102, 105, 108, 111, 114, 117, 120, 122, 126, 129, 132, 135, 139, 143, 148,
     152, 158, 164, 170, 178, 186, 194, 203, 211, 221, 232, 245, 259, 274, 291, 312, 337, 370, 414, 463, 519, 562, 598,
     632, 687, 1021),
    (3, 6, 11, 18, 24, 31, 38, 45, 53, 59, 67, 74, 80, 87, 94, 102, 110, 118, 127, 136, 146, 155, 164, 173, 181, 190,
     198, 206, 214, 222, 231, 239, 248, 258, 267, 276, 287, 298, 308, 321, 336, 353, 374, 395, 419, 449, 488, 535, 598,
     699, 1016),
    1024,  # mlcommons/inference language/llama2-70b/SUT.py max_new_tokens
    _DASHBOARD + "llama2-70b-99.csv (input mean 222.3, reference output mean 218.9)",
)  # fmt: skip
CNN_DAILYMAIL = Dataset(
    "CNN-DailyMail (llama3_1-8b, 13,368 samples)",
    (79, 273, 309, 342, 369, 391, 414, 435, 458, 479, 497, 515, 534, 553, 573, 594, 612, 631, 650, 669, 688, 704, 724,
     745, 763, 784, 804, 826, 848, 873, 898, 920, 946, 972, 997, 1025, 1057, 1090, 1127, 1165, 1206, 1245, 1298, 1352,
     1412, 1480, 1580, 1686, 1810, 1984, 2540),
    None,  # the csv's outputs are characters / 4, not tokens; the log's 129.0 tokens per sample is the cap
    128,  # mlcommons/inference language/llama3.1-8b/SUT_VLLM.py max_tokens
    _DASHBOARD + "llama3-1-8b-datacenter.csv (input mean 870.7)",
)  # fmt: skip
DEEPSEEK_R1 = Dataset(
    "DeepSeek-R1 mix (deepseek-r1, 4,388 samples)",
    (52, 83, 94, 105, 114, 124, 135, 147, 164, 190, 231, 346, 430, 542, 678, 759, 820, 841, 850, 857, 865, 873, 880,
     887, 893, 902, 909, 917, 926, 939, 952, 965, 981, 1000, 1021, 1037, 1057, 1078, 1098, 1119, 1141, 1164, 1194,
     1238, 1270, 1281, 1291, 1303, 1321, 1358, 3140),
    (209, 403, 471, 526, 578, 627, 670, 718, 759, 813, 867, 917, 969, 1036, 1098, 1157, 1240, 1319, 1396, 1503, 1598,
     1689, 1816, 1940, 2057, 2194, 2356, 2521, 2676, 2860, 3038, 3235, 3445, 3686, 3967, 4217, 4487, 4754, 5094, 5460,
     5950, 6482, 7105, 7725, 8672, 9477, 10942, 12887, 15554, 19114, 32768),
    20000,  # mlcommons/inference language/deepseek-r1 MAX_OSL; NVIDIA's generation_config.json max_output_len
    _DASHBOARD + "deepseek-r1.csv (tok_input_len mean 803.8, median 901.5, max 3,140; "
    "tok_ref_output_len mean 4,043.4, median 2,194)",
)  # fmt: skip


@dataclass(frozen=True)
class MLPerfPoint:
    name: str  # short key for --points
    label: str
    benchmark: str  # LoadGen's model name: the key of LIMITS
    system: str  # results/<system>/ in RESULTS_REPO
    gpu: str  # tailserve catalog name
    gpus: int
    tp: int
    model: str  # tailserve catalog name
    framework: str  # the system description's "framework"
    scheduled_qps: float
    completed_qps: float
    completed_tokens_per_s: float
    ttft_ms: tuple[float, float]  # measured p50, p99
    tpot_ms: tuple[float, float]
    mean_latency_s: float  # the summary's "Mean latency": first query to last token
    dataset: Dataset
    engine_flags: tuple[str, ...]  # the submission's engine as a tailserve policy and its flags
    source: str
    notes: str = ""
    # The same system's Offline result (all samples at once: the throughput ceiling) and the
    # flags its Offline run changed.
    offline_qps: float = 0.0
    offline_flags: tuple[str, ...] = ()
    offline_source: str = ""
    # Attention-DP ranks of one engine (TensorRT-LLM's enable_attention_dp: each of the TP ranks
    # runs attention for its own requests, the MoE layers span them): tailserve's DP engine of
    # ``dp`` ranks of TP ``tp`` that step together. 1: independent engines of TP ``tp``.
    dp: int = 1
    # ``tailserve simulate --calibration`` of every run ("": none, the catalog's curves); set by
    # ``with_tables`` (--aisim-tables), never in POINTS: the published points are held out.
    calibration: str = ""

    @property
    def replicas(self) -> int:
        """Independent engines: an MoE engine's DP ranks step together, so the unit simulated is
        the whole DP group."""
        return self.gpus // (self.tp * self.dp)

    @property
    def limits(self) -> tuple[float, float]:
        return LIMITS[self.benchmark]

    @property
    def out_mean(self) -> float:
        return self.completed_tokens_per_s / self.completed_qps

    @property
    def in_flight(self) -> float:
        """Requests in flight per replica by Little's law: scheduled rate x mean latency."""
        return self.scheduled_qps / self.replicas * self.mean_latency_s

    @property
    def policy(self) -> str:
        return self.engine_flags[self.engine_flags.index("--policy") + 1]

    @property
    def kernels(self) -> str:
        """The engine whose kernels price the point: its policy's (``--kernels auto``)."""
        return kernel_engine("auto", self.policy)


def _summary(submitter: str, system: str, bench: str) -> str:
    return (
        f"{RESULTS_REPO}@{RESULTS_COMMIT[:8]} "
        f"closed/{submitter}/results/{system}/{bench}/Server/performance/run_1/mlperf_log_summary.txt"
    )


# AMD's YAML: num_scheduler_steps 9 is vLLM V0's multi-step scheduling (V1 has none), so the
# engine is V0: prefill-first batches, chunked prefill off; swap_space 0 leaves recompute.
_AMD_VLLM = ("--policy", "vllm-v0", "--quantization", "fp8", "--max-num-batched-tokens", "40960",
             "--no-enable-chunked-prefill", "--block-size", "32", "--no-enable-prefix-caching",
             "--max-model-len", "2048", "--gpu-memory-utilization", "1.0", "--preemption-mode", "recompute",
             "--swap-space", "0")  # fmt: skip
# TRT-LLM's kvcache_free_gpu_mem_frac 0.9 is a fraction of the memory left after the weights and
# activations, which is how the trtllm policy applies --gpu-memory-utilization (kv_capacity.py).
# The two Llama-2-70B points run TensorRT engines (trtllm-build plugins, "TensorRT 10.x") under the
# C++ executor, not the PyTorch backend the trtllm policy follows by default: its loop
# (cpp/tensorrt_llm/executor/executorImpl.cpp, Executor::Impl::executionLoop@036a60f7) waits for
# step n (forwardSync), then fetches new requests and launches step n+1 (forwardAsync) -- no
# overlap scheduler (the engine backend's enable_trt_overlap was removed as giving no benefit).
_TRT_ENGINE_BACKEND = ("--disable-overlap-scheduler",)
_H200_TRTLLM = ("--policy", "trtllm", "--quantization", "fp8", "--kv-cache-dtype", "fp8", "--max-batch-size", "2048",
                "--max-num-tokens", "1536", "--capacity-scheduler-policy", "MAX_UTILIZATION",
                "--enable-chunked-prefill", "--context-chunking-policy", "FIRST_COME_FIRST_SERVED",
                "--block-size", "32", "--max-model-len", "2048", "--gpu-memory-utilization", "0.9",
                *_TRT_ENGINE_BACKEND)  # fmt: skip

# Red Hat's Llama-3.1-8B (code/llama3.1-8b/README.md, the H100 Server line) on vLLM 0.10.0: V1 scheduling
# synchronously (--async-scheduling was experimental and off by default until vLLM PR #27614, after
# 0.11: vllm/config/scheduler.py:138@v0.11.0, engines/vllm_flags.py's 0.11 table) and admitting on
# the first chunk's blocks (scheduler_reserve_full_isl came after 0.11, as the same table says), so
# the policy's 0.32 defaults for both are turned off here. The README's Offline line (LLM class)
# sets no long-prefill threshold: the offline flags put vLLM's default 0 back.
_REDHAT_VLLM = ("--policy", "vllm", "--quantization", "fp8", "--max-num-batched-tokens", "1024", "--max-num-seqs", "512",
                "--long-prefill-token-threshold", "256", "--block-size", "16", "--gpu-memory-utilization", "0.91",
                "--max-model-len", "131072", "--no-async-scheduling", "--no-scheduler-reserve-full-isl")  # fmt: skip

# NVIDIA's B200 Llama-2-70B (configs/B200-SXM-180GBx8/{Server,Offline}/llama2-70b.py): precision fp4
# (NVFP4 weights), FP8 KV, TP 1 on each GPU, gpu_batch_size 2048, max_num_tokens 3584, max_util,
# chunked context; kvcache_free_gpu_mem_frac 0.95 of what the weights and activations leave.
_B200_LLAMA = ("--policy", "trtllm", "--quantization", "nvfp4", "--kv-cache-dtype", "fp8", "--max-batch-size", "2048",
               "--max-num-tokens", "3584", "--capacity-scheduler-policy", "MAX_UTILIZATION",
               "--enable-chunked-prefill", "--context-chunking-policy", "FIRST_COME_FIRST_SERVED",
               "--block-size", "32", "--max-model-len", "2048", "--gpu-memory-utilization", "0.95",
               *_TRT_ENGINE_BACKEND)  # fmt: skip
# NVIDIA's DeepSeek-R1 (configs/<system>/Server/deepseek-r1.py): tensor_parallelism 8 with
# enable_attention_dp (8 attention ranks of TP 1, tailserve's --tp 1 --data-parallel-size 8),
# moe_expert_parallelism 8 (experts whole on each GPU, WIDEEP backend), precision fp4 (NVIDIA's
# NVFP4 checkpoint with the hf_quant_config.json the harness substitutes into it: MLA's projections
# and the routers bf16, everything else NVFP4; the catalog's DeepSeek-R1-FP4-v2), FP8 KV, gpu_batch_size 512 and max_num_tokens
# 3456 per attention rank, max_util, chunked context off, block reuse off (llmlib/config.py
# writes enable_block_reuse False), max_seq_len 3140 + 20000, kvcache_free_gpu_mem_frac 0.9 (of
# what the weights and activations leave). Decode CUDA graphs of 128/256/384/512 requests with
# cuda_graph_padding_enabled (the system configs' runtime flags as docs/fidelity.md read them; the
# configs are not in the store here: llmlib/config.py writes cuda_graph_padding_enabled and
# cuda_graph_batch_sizes into the extra YAML from those flags); attention_dp_config enable_balance with
# batching_wait_iters 3 and timeout_iters 9 (policies/trtllm_adp.py; docs/fidelity.md). No speculative
# decoding: llmlib/config.py's _generate_extra_config_yaml writes no speculative_config (MTP
# arrived with v6.0's interactive scenario).
_R1_TRTLLM = ("--policy", "trtllm", "--quantization", "nvfp4", "--kv-cache-dtype", "fp8", "--enable-expert-parallel",
              "--max-batch-size", "512", "--max-num-tokens", "3456", "--capacity-scheduler-policy", "MAX_UTILIZATION",
              "--no-enable-chunked-prefill", "--no-enable-block-reuse", "--block-size", "32",
              "--max-model-len", "23140", "--gpu-memory-utilization", "0.9", "--cuda-graph-padding-enabled",
              "--cuda-graph-batch-sizes", "128,256,384,512", "--attention-dp-enable-balance",
              "--attention-dp-batching-wait-iters", "3", "--attention-dp-timeout-iters", "9")  # fmt: skip

POINTS = (
    MLPerfPoint(
        "amd-mi300x", "AMD 8xMI300X vLLM", "llama2-70b", "8xMI300X_2xEPYC_9575F", "MI300X", 8, 1, "Llama-2-70B",
        "vLLM 0.9.0.2.dev108 (ROCm 6.4.1)", 83.90, 81.68, 24593.77, (875.07, 1914.65), (151.04, 193.38), 43.580, OPENORCA,
        (*_AMD_VLLM, "--max-num-seqs", "650"),
        _summary("AMD", "8xMI300X_2xEPYC_9575F", "llama2-70b-99")
        + "; flags: closed/AMD/code/llama2-70b-99.9/harness_llm/models/llama2-70b/server_mi300x.yaml",
        "AMD's vLLM fork: VLLM_LLAMA2_MLPERF_SCHED, decode batch held in 352-608, num_scheduler_steps 9",
        92.1544, ("--max-num-seqs", "1792", "--gpu-memory-utilization", "0.98"),
        "Offline/performance/run_1/mlperf_log_summary.txt; offline_mi300x.yaml",
    ),
    MLPerfPoint(
        "amd-mi325x", "AMD 8xMI325X vLLM", "llama2-70b", "8xMI325X_2xEPYC_9575F_1", "MI325X", 8, 1, "Llama-2-70B",
        "vLLM 0.9.0.2.dev108 (ROCm 6.4.1)", 109.52, 106.28, 32027.57, (825.23, 1755.26), (161.65, 198.31), 44.905, OPENORCA,
        (*_AMD_VLLM, "--max-num-seqs", "1024"),
        _summary("AMD", "8xMI325X_2xEPYC_9575F_1", "llama2-70b-99")
        + "; flags: closed/AMD/code/llama2-70b-99.9/harness_llm/models/llama2-70b/server_mi325x.yaml",
        "AMD's vLLM fork: VLLM_LLAMA2_MLPERF_SCHED, decode batch held in 512-832, num_scheduler_steps 9",
        114.7, ("--max-num-seqs", "2700", "--max-num-batched-tokens", "65536", "--gpu-memory-utilization", "0.98"),
        "Offline/performance/run_1/mlperf_log_summary.txt; offline_mi325x.yaml",
    ),
    MLPerfPoint(
        "cisco-h200", "Cisco 8xH200 TensorRT-LLM", "llama2-70b", "C885_H200x8_TRT", "H200", 8, 1, "Llama-2-70B",
        "TensorRT 10.10, CUDA 12.9", 114.23, 113.29, 33163.34, (358.56, 947.82), (172.93, 183.02), 49.821, OPENORCA,
        _H200_TRTLLM,
        _summary("Cisco", "C885_H200x8_TRT", "llama2-70b-99")
        + "; flags: closed/Cisco/configs/C885_H200x8/Server/llama2-70b.py (Custom harness, k_99, MaxP)",
        "FP8 weights and KV cache, gemm_swiglu_plugin fp8, batch_scheduler_policy max_util, chunked context",
        118.429, (), "Offline/performance/run_1/mlperf_log_summary.txt; configs/C885_H200x8/Offline/llama2-70b.py",
    ),
    MLPerfPoint(
        "redhat-h100", "Red Hat 1xH100 vLLM", "llama3_1-8b", "XE8640_4xH100_vLLM", "H100-SXM", 1, 1, "Llama-3.1-8B",
        "vLLM 0.10.0", 39.64, 39.56, 5103.99, (223.63, 1911.17), (23.64, 25.13), 3.318, CNN_DAILYMAIL,
        _REDHAT_VLLM,
        _summary("RedHat", "XE8640_4xH100_vLLM", "llama3.1-8b")
        + "; flags: closed/RedHat/code/llama3.1-8b/README.md (the Server scenario's vllm serve line)",
        "the system description says 1 accelerator (H100-SXM-80GB) despite the 4xH100 in its name",
        45.1334, ("--max-num-seqs", "1024", "--max-num-batched-tokens", "4096", "--kv-cache-dtype", "fp8",
                  "--long-prefill-token-threshold", "0"),
        "Offline/performance/run_1/mlperf_log_summary.txt; README.md (the H100 Offline line)",
    ),
    MLPerfPoint(
        "nvidia-b200-llama2", "NVIDIA 8xB200 TRT-LLM Llama-2-70B", "llama2-70b", "B200-SXM-180GBx8_TRT", "B200", 8, 1,
        "Llama-2-70B", "TensorRT 10.11, CUDA 12.9", 363.79, 361.30, 99123.04, (244.18, 436.32), (126.10, 132.37), 33.924,
        OPENORCA, _B200_LLAMA,
        _summary("NVIDIA", "B200-SXM-180GBx8_TRT", "llama2-70b-99")
        + "; flags: closed/NVIDIA/configs/B200-SXM-180GBx8/Server/llama2-70b.py (Custom harness, k_99, MaxP)",
        "NVFP4 weights, FP8 KV and context FMHA, fused MLP, norm_quant_fusion, max_util, chunked context",
        371.423, (), "Offline/performance/run_1/mlperf_log_summary.txt; configs/B200-SXM-180GBx8/Offline/llama2-70b.py",
    ),
    MLPerfPoint(
        "nvidia-b200-r1", "NVIDIA 8xB200 TRT-LLM DeepSeek-R1", "deepseek-r1", "B200-SXM-180GBx8_TRT", "B200", 8, 1,
        "DeepSeek-R1-FP4-v2", "TensorRT 10.11, CUDA 12.9", 5.02, 4.96, 18592.24, (685.86, 1695.86), (69.90, 72.18), 248.934,
        DEEPSEEK_R1, _R1_TRTLLM,
        _summary("NVIDIA", "B200-SXM-180GBx8_TRT", "deepseek-r1")
        + "; flags: closed/NVIDIA/configs/B200-SXM-180GBx8/Server/deepseek-r1.py (Custom harness, k_99, MaxP)",
        "NVFP4 experts, attention DP 8 x TP 1, EP 8 (WIDEEP), ADP balancing (wait 3-9 iterations), no MTP",
        8.93431, ("--max-num-tokens", "4608"),
        "Offline/performance/run_1/mlperf_log_summary.txt; configs/B200-SXM-180GBx8/Offline/deepseek-r1.py",
        dp=8,
    ),
    MLPerfPoint(
        "nvidia-gb200-r1", "NVIDIA GB200-NVL72 TRT-LLM DeepSeek-R1", "deepseek-r1", "GB200-NVL72_GB200-186GB_aarch64x72_TRT",
        "GB200", 72, 1, "DeepSeek-R1-FP4-v2", "TensorRT 10.11, CUDA 12.9", 45.06, 44.76, 167578.06, (641.44, 1245.96),
        (61.29, 64.45), 216.209, DEEPSEEK_R1, _R1_TRTLLM,
        _summary("NVIDIA", "GB200-NVL72_GB200-186GB_aarch64x72_TRT", "deepseek-r1")
        + "; flags: closed/NVIDIA/configs/GB200-NVL72_GB200-186GB_aarch64x72/Server/deepseek-r1.py",
        "9 engines of 8 GPUs (server_target_qps 5 x 9), the B200's flags, NVLink over all 72",
        77.995, ("--max-num-tokens", "4608"),
        "Offline/performance/run_1/mlperf_log_summary.txt; configs/GB200-NVL72_GB200-186GB_aarch64x72/Offline/deepseek-r1.py",
        dp=8,
    ),
)  # fmt: skip


@dataclass
class Predicted:
    rate: float  # per replica
    ttft_ms: tuple[float, float]
    tpot_ms: tuple[float, float]
    completed_qps: float  # all replicas: done / simulated span
    in_mean: float
    out_mean: float
    num_requests: int
    preemptions: int
    in_flight: float  # Little's law: rate x mean end-to-end latency, per replica
    valid: bool  # MLPerf's rule: both p99s within the limits
    raw: dict = field(repr=False, default_factory=dict)


def trace(point: MLPerfPoint, rate: float, n: int, seed: int) -> list[dict]:
    """``n`` requests, Poisson at ``rate``, lengths drawn from the benchmark's dataset."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    inputs, outputs = point.dataset.sample(n, point.out_mean, rng)
    return [
        {"arrival_time": float(t), "prompt_len": int(i), "max_tokens": int(o)}
        for t, i, o in zip(arrivals, inputs, outputs)
    ]


def step_summary(lines: list[dict]) -> dict:
    """The typical step of an iteration log (``simulate --iterations``), each step weighted by the
    decodes it carries as TPOT weighs them (docs/fidelity.md, r39): mean tokens, requests and ms."""
    w = np.array([it["num_decode_tokens"] for it in lines], dtype=float)
    tokens = [it["num_prefill_tokens"] + it["num_decode_tokens"] for it in lines]
    return {
        "tokens": round(float(np.average(tokens, weights=w)), 1),
        "requests": round(float(np.average([it["batch_size"] for it in lines], weights=w)), 1),
        "ms": round(float(np.average([it["duration"] for it in lines], weights=w)) * 1e3, 2),
    }


def _run(point: MLPerfPoint, requests: list[dict], flags: tuple[str, ...], steps: bool = False) -> dict:
    """``tailserve simulate --trace`` of one replica; its --json result (with ``steps``, the
    iteration log's ``step_summary`` under "steps")."""
    with tempfile.TemporaryDirectory() as tmp:
        path, out = Path(tmp) / "trace.jsonl", Path(tmp) / "run.json"
        log = Path(tmp) / "iterations.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in requests))
        argv = [
            "simulate", "--model", point.model, "--hardware", point.gpu, "--tp", str(point.tp),
            *(("--data-parallel-size", str(point.dp)) if point.dp > 1 else ()),
            "--trace", str(path), *flags,
            *(("--calibration", point.calibration) if point.calibration else ()),
            *(("--iterations", str(log)) if steps else ()), "--json", str(out),
        ]  # fmt: skip
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            rc = tailserve_main(argv)
        if rc != 0:
            raise RuntimeError(f"tailserve {' '.join(argv)} exited {rc}: {err.getvalue().strip()[-800:]}")
        raw = json.loads(out.read_text())
        if steps:
            raw["steps"] = step_summary([json.loads(line) for line in log.read_text().splitlines()])
        return raw


def simulate(point: MLPerfPoint, rate: float, n: int, seed: int = 0, steps: bool = False) -> Predicted:
    """One replica at ``rate`` requests/s for ``n`` requests, through ``tailserve simulate``
    (``steps``: its typical step under ``raw["steps"]``)."""
    requests = trace(point, rate, n, seed)
    raw = _run(point, requests, point.engine_flags, steps)
    m = raw["metrics"]
    ttft = (m["ttft_s"]["p50"] * 1e3, m["ttft_s"]["p99"] * 1e3)
    tpot = (m["tpot_s"]["p50"] * 1e3, m["tpot_s"]["p99"] * 1e3)
    lim_ttft, lim_tpot = point.limits
    return Predicted(
        rate,
        ttft,
        tpot,
        raw["throughput"]["requests_per_s"] * point.replicas,
        float(np.mean([r["prompt_len"] for r in requests])),
        float(np.mean([r["max_tokens"] for r in requests])),
        raw["num_finished"],
        raw["num_preemptions"],
        rate * m["e2e_s"]["mean"],
        ttft[1] <= lim_ttft * 1e3 and tpot[1] <= lim_tpot * 1e3,
        raw,
    )


def offline(point: MLPerfPoint, n: int, seed: int = 0) -> float:
    """Samples/s of all replicas when ``n`` requests per replica arrive at once (LoadGen's Offline
    scenario) with the Offline run's flags: the simulated throughput ceiling."""
    requests = [dict(r, arrival_time=0.0) for r in trace(point, 1.0, n, seed)]
    raw = _run(point, requests, (*point.engine_flags, *point.offline_flags))
    return raw["num_finished"] / raw["duration_s"] * point.replicas


def requests_for(rate: float, span_s: float) -> int:
    """Requests for ``span_s`` seconds of arrivals (LoadGen's runs last 600 s or more)."""
    return max(100, round(rate * span_s))


def capacity(point: MLPerfPoint, span_s: float, steps: int = 6) -> tuple[float, str]:
    """The highest rate (all replicas) the simulation keeps VALID, bisecting between 1/4 and 2x
    the published rate; with ">" or "<" where it lies outside those bounds."""
    published = point.scheduled_qps / point.replicas
    lo, hi = published / 4, published * 2
    if not simulate(point, lo, requests_for(lo, span_s)).valid:
        return lo * point.replicas, "<"
    if simulate(point, hi, requests_for(hi, span_s)).valid:
        return hi * point.replicas, ">"
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if simulate(point, mid, requests_for(mid, span_s)).valid else (lo, mid)
    return lo * point.replicas, ""


def _err(pred: float, meas: float) -> str:
    return f"{pred / meas - 1:+.0%}"


def _r(xs: tuple[float, ...]) -> list[float]:
    return [round(x, 2) for x in xs]


def select(names: str | None) -> tuple[MLPerfPoint, ...]:
    """The points ``names`` picks (comma-separated; each a point's name or any part of its name or
    label, any case: ``r1``, ``H200``), in POINTS' order; all when None; ValueError for a part
    that picks none."""
    if names is None:
        return POINTS
    parts = [n.strip().lower() for n in names.split(",") if n.strip()]
    if not parts:
        raise ValueError(f"--points {names!r} names no point; known: {', '.join(p.name for p in POINTS)}")
    picked = {part: [p for p in POINTS if part in f"{p.name} {p.label}".lower()] for part in parts}
    unknown = [part for part, hits in picked.items() if not hits]
    if unknown:
        raise ValueError(f"no point matches {', '.join(unknown)}; known: {', '.join(p.name for p in POINTS)}")
    return tuple(p for p in POINTS if any(p in hits for hits in picked.values()))


def parse_tables(text: str) -> dict[str, str]:
    """``--aisim-tables``' ``ENGINE=FILE,...`` as {engine: FILE}; ValueError for a part that is not
    ENGINE=FILE with one of tailserve's kernel engines, or an engine named twice."""
    tables: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        engine, eq, path = (x.strip() for x in part.partition("="))
        if not eq or not path or engine not in KERNEL_ENGINES:
            raise ValueError(
                f"--aisim-tables: {part!r} is not ENGINE=FILE with ENGINE one of {', '.join(KERNEL_ENGINES)}"
            )
        if engine in tables:
            raise ValueError(f"--aisim-tables: {engine} named twice")
        tables[engine] = path
    return tables


def table_source(tables: dict[str, str], engine: str, gpu: str, model: str, what: str) -> str:
    """``aisim:FILE`` of ``engine``'s export in ``tables`` for ``model`` on catalog GPU ``gpu``.
    ValueError, naming ``what``, where the tables cannot price it (no export for the engine, a GPU
    AISimulate did not time) or the export holds another engine's kernels (its ``framework``: what
    ``_aisim_tables.py --framework`` timed)."""
    path = tables.get(engine)
    if path is None:
        raise ValueError(f"{what} runs {engine}'s kernels: --aisim-tables has no {engine}=FILE")
    name = next((g for g, catalog in aisim_table.GPUS.items() if catalog == gpu), None)
    if name is None:
        raise ValueError(f"{what}: AISimulate's tables time no {gpu} GEMMs")
    # read here (once per process: the cost models built later reuse it) for whose kernels it holds
    framework = aisim_table.load_gemm_times(path, name).framework
    if framework != engine:
        raise ValueError(
            f"{what} runs {engine}'s kernels but {path} holds {framework}'s "
            f"(export with _aisim_tables.py --framework {engine})"
        )
    return f"{aisim_table.PREFIX}{path}"


def with_tables(points: tuple[MLPerfPoint, ...], tables: dict[str, str]) -> tuple[MLPerfPoint, ...]:
    """Each point priced from its own engine's export (``calibration`` ``aisim:FILE``)."""
    return tuple(
        replace(point, calibration=table_source(tables, point.kernels, point.gpu, point.model, point.name))
        for point in points
    )


def _point_table(title: str, columns: tuple[str, ...], *left: str) -> Table:
    """A table of the points: ``point`` (and ``left``) left-aligned, the figures right."""
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col, justify="left" if col == "point" or col in left else "right")
    return table


def run(
    span_s: float,
    requests: int | None,
    with_capacity: bool,
    offline_n: int,
    console: Console,
    points: tuple[MLPerfPoint, ...] = POINTS,
    steps: bool = False,
) -> dict:
    rows = []
    sources = sorted({p.calibration for p in points if p.calibration})
    how = (
        f"GEMMs, routed experts and MLA blocks from AISimulate's tables where they time them, {', '.join(sources)}"
        if sources
        else "uncalibrated"
    )
    columns = ("point", "QPS", "in / out", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms",
               "in flight", "sim req/s", "VALID")  # fmt: skip
    table = _point_table(
        f"MLPerf Inference v5.1 Server points at the published QPS ({how})", columns, "VALID"
    )
    for point in points:
        rate = point.scheduled_qps / point.replicas
        pred = simulate(point, rate, requests or requests_for(rate, span_s), steps=steps)
        row = {
            "point": point.label, "source": point.source, "replicas": point.replicas,
            "rate_per_replica": round(rate, 4), "policy": point.policy, "dp": point.dp,
            "measured": {"ttft_ms": point.ttft_ms, "tpot_ms": point.tpot_ms, "completed_qps": point.completed_qps,
                         "out_mean": round(point.out_mean, 1), "in_flight_per_replica": round(point.in_flight, 1)},
            "predicted": {"ttft_ms": _r(pred.ttft_ms), "tpot_ms": _r(pred.tpot_ms),
                          "completed_qps": round(pred.completed_qps, 2), "valid": pred.valid,
                          "requests": pred.num_requests, "preemptions": pred.preemptions,
                          "in_mean": round(pred.in_mean, 1), "out_mean": round(pred.out_mean, 1),
                          "in_flight_per_replica": round(pred.in_flight, 1)},
        }  # fmt: skip
        if point.calibration:  # only then: an uncalibrated run's JSON is as before
            row["calibration"] = point.calibration
        if steps:
            row["simulated_step"] = pred.raw["steps"]
        cells = [
            f"{p:,.1f} / {m:,.1f} ({_err(p, m)})"
            for p, m in zip((*pred.ttft_ms, *pred.tpot_ms), (*point.ttft_ms, *point.tpot_ms))
        ]
        table.add_row(
            point.label, f"{point.scheduled_qps:.2f}", f"{pred.in_mean:.0f} / {pred.out_mean:.0f}", *cells,
            f"{pred.in_flight:.0f} / {point.in_flight:.0f}", f"{pred.completed_qps:.2f}", "yes" if pred.valid else "no",
        )  # fmt: skip
        if offline_n:
            row["offline_qps"] = round(offline(point, offline_n), 2)
        if with_capacity:
            c, bound = capacity(point, span_s)
            row["capacity_qps"], row["capacity_bound"] = round(c, 2), bound
        rows.append(row)
    console.print(table)
    print(
        "cells: predicted / measured (error). in flight: requests per replica, rate x mean latency (Little's law), predicted / measured. "
        "sim req/s: completed over the simulated span, all replicas"
    )
    if offline_n:
        off = _point_table(
            f"Offline: {offline_n} requests per replica at once, samples/s",
            ("point", "published", "simulated", "error"),
        )
        for point, row in zip(points, rows):
            o = row["offline_qps"]
            off.add_row(point.label, f"{point.offline_qps:.2f}", f"{o:.2f}", _err(o, point.offline_qps))
        console.print(off)
    if with_capacity:
        cap = _point_table(
            "simulated Server score (highest VALID QPS) vs published",
            ("point", "published QPS", "simulated QPS", "error"),
        )
        for point, row in zip(points, rows):
            c = row["capacity_qps"]
            cap.add_row(
                point.label,
                f"{point.completed_qps:.2f}",
                f"{row['capacity_bound']}{c:.2f}",
                _err(c, point.completed_qps),
            )
        console.print(cap)
    if steps:
        st = _point_table(
            "the simulated Server run's typical step (weighted by decodes)",
            ("point", "tokens", "requests", "ms", "TPOT p50 measured ms"),
        )
        for point, row in zip(points, rows):
            t = row["simulated_step"]
            st.add_row(
                point.label,
                f"{t['tokens']:,.0f}",
                f"{t['requests']:,.0f}",
                f"{t['ms']:.1f}",
                f"{point.tpot_ms[0]:.1f}",
            )
        console.print(st)
    return {"results_repo": RESULTS_REPO, "results_commit": RESULTS_COMMIT, "span_s": span_s, "points": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--span",
        type=float,
        default=600.0,
        help="seconds of arrivals per run (default: %(default)s, LoadGen's minimum)",
    )
    ap.add_argument("--requests", type=int, help="requests per run at the published rate instead of --span")
    ap.add_argument("--capacity", action="store_true", help="also bisect for the highest VALID QPS")
    ap.add_argument(
        "--offline",
        type=int,
        default=0,
        metavar="N",
        help="also simulate the Offline scenario, N requests per replica",
    )
    ap.add_argument(
        "--points",
        metavar="NAME,...",
        help="only these points, by name or any part of name or label: "
        + ", ".join(p.name for p in POINTS)
        + " (default: all)",
    )
    ap.add_argument(
        "--aisim-tables",
        metavar="ENGINE=FILE,...",
        help="price each point's dense GEMMs from its engine's AISimulate export "
        "(--calibration aisim:FILE; ENGINE: trtllm, vllm, sglang)",
    )
    ap.add_argument(
        "--steps",
        action="store_true",
        help="also the simulated Server run's typical step (tokens, requests, ms; weighted by decodes)",
    )
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    try:
        points = select(args.points)
        if args.aisim_tables:
            points = with_tables(points, parse_tables(args.aisim_tables))
    except ValueError as e:
        ap.error(str(e))
    print(cpu_line())
    out = run(args.span, args.requests, args.capacity, args.offline, Console(width=220), points, args.steps)
    save_results(out, args.json, "fidelity_mlperf.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
