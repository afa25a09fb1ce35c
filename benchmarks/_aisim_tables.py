"""Export AISimulate's bundled silicon tables (GEMM per format, fused MoE, vLLM's custom
all-reduce under CUDA graphs, vLLM's MLA attention modules, DeepEP's dispatch/combine under vLLM,
NCCL's all-gather / reduce-scatter) as JSON rows.

Runs in AISimulate's venv (pandas and pyarrow read its parquet files; tailserve's own environment
needs neither): ``<peers>/aisimulate/bin/python -m benchmarks._aisim_tables --out rows.json``.
For each GPU it takes vLLM's newest collected version of each table (``--framework trtllm`` or
``sglang``: that engine's GEMM and fused-MoE tables instead, and TensorRT-LLM's MLA modules with a
bf16 and an FP8 KV cache, nothing else); GEMM rows per format
from the newest version that timed the format's kernel; MoE rows are taken from every version
(each collected different shapes), the newest row for each shape winning. Only rows
with uniform ("balanced") routing are kept: that is what the cost model assumes. MLA module rows
are vLLM's default MLA backend on each GPU (``vllm/platforms/cuda.py``, ``_get_backend_priorities``:
FLASH_ATTN_MLA first on Hopper, FLASHINFER_MLA first on Blackwell); on Blackwell the prefill rows are
FLASH_ATTN's (vLLM picks the MLA prefill kernel apart from the decode backend, and the tables'
FLASHINFER_MLA prefill rows are all one-token prompts, which say nothing of prefill attention).
NCCL rows are the newest
collected NCCL version that has all-gather and reduce-scatter.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GEMM_KERNELS = {  # the format's kernel vLLM picks by default on these GPUs
    "bfloat16": "torch.nn.functional.linear",
    "fp8": "CutlassFP8ScaledMMLinearKernel",
    "fp8_block": "DeepGemmFp8BlockScaledMMKernel",
    "nvfp4": "FlashInferCuteDslNvFp4LinearKernel",
}
# Each engine's kernel per GEMM format (None: the one kernel its tables time for the format).
# TensorRT-LLM's tables time its PyTorch flow's linear layer (``torch_flow``; block-scaled FP8 on
# Blackwell: ``deepgemm``), one kernel per format. SGLang's: torch's linear for bf16,
# sgl-kernel's fp8_scaled_mm, DeepGEMM for block-scaled FP8 (SGLang's default where DeepGEMM is
# installed; 0.5.20 also times its Triton fallback) and FlashInfer's CuTe DSL NVFP4 kernel.
FRAMEWORK_GEMM_KERNELS: dict[str, dict[str, str | None]] = {
    "vllm": GEMM_KERNELS,
    "trtllm": {"bfloat16": None, "fp8": None, "fp8_block": None, "nvfp4": None},
    "sglang": {
        "bfloat16": "sglang_torch_linear",
        "fp8": "sglang_sgl_kernel_fp8_scaled_mm",
        "fp8_block": "sglang_deepgemm_gemm_nt_f8f8bf16",
        "nvfp4": "sglang_flashinfer_cutedsl_nvfp4",
    },
}
FRAMEWORKS = tuple(FRAMEWORK_GEMM_KERNELS)
# vLLM's first-choice MLA backend per GPU family (the table's kernel_source)
MLA_BACKENDS = {"h100_sxm": "FLASH_ATTN_MLA", "h200_sxm": "FLASH_ATTN_MLA"}
MLA_BACKEND_BLACKWELL = "FLASHINFER_MLA"
MLA_PREFILL_BLACKWELL = "FLASH_ATTN"
GPUS = ("a100_sxm", "h100_sxm", "h200_sxm", "b200_sxm", "gb200", "b300_sxm")


def _version_key(path: Path) -> tuple:
    parts = path.parent.name.replace("rc", ".").replace("post", ".").split(".")
    return tuple(int(p) if p.isdigit() else -1 for p in parts)


def systems_dir() -> Path:
    import aisimulate_core

    return Path(aisimulate_core.__file__).parent / "systems" / "data"


def _gemm(root: Path, gpu: str, framework: str) -> dict:
    """Each format's rows of the framework's kernel from the newest version that timed it
    (SGLang 0.5.20 dropped per-tensor FP8 on Hopper: 0.5.14's rows stand for it)."""
    import pandas as pd

    files = sorted((root / gpu / "gemm" / framework).glob("*/gemm_perf.parquet"), key=_version_key)
    frames = [pd.read_parquet(f) for f in files]
    rows: list = []
    versions: dict[str, str] = {}
    for dtype, kernel in FRAMEWORK_GEMM_KERNELS[framework].items():
        for f, d in reversed(list(zip(files, frames))):
            sel = d[d.gemm_dtype.eq(dtype) & (d.kernel_source.eq(kernel) if kernel else True)]
            if len(sel):
                rows += sel[["gemm_dtype", "m", "n", "k", "latency"]].values.tolist()
                versions[dtype] = f.parent.name
                break
    if not rows:
        return {}
    # one version for all formats: as before; several: per format
    names = set(versions.values())
    label = names.pop() if len(names) == 1 else ", ".join(f"{k} {v}" for k, v in versions.items())
    return {"gemm_version": label, "gemm": rows}


def export(gpus: tuple[str, ...], framework: str = "vllm") -> dict:
    import pandas as pd

    root = systems_dir()
    out: dict = {"source": str(root), "framework": framework, "gpus": {}}
    for gpu in gpus:
        entry: dict = _gemm(root, gpu, framework)
        moe_files = sorted((root / gpu / "moe" / framework).glob("*/moe_perf.parquet"), key=_version_key)
        frames = [pd.read_parquet(f).assign(order=i) for i, f in enumerate(moe_files)]
        if frames:
            d = pd.concat(frames)
            d = d[d.distribution.eq("balanced")]
            # One row per shape and kernel: a format's rows come from several kernels (Triton, CUTLASS,
            # TRT-LLM), which differ by up to 3x on one shape, so the kernel stays in the key.
            key = ["moe_dtype", "num_tokens", "hidden_size", "inter_size", "topk", "num_experts",
                   "moe_tp_size", "moe_ep_size", "kernel_source"]  # fmt: skip
            d = d.sort_values("order", kind="stable").groupby(key, as_index=False).last()
            entry["moe_versions"] = sorted({f.parent.name for f in moe_files})
            entry["moe"] = d[[*key, "latency"]].values.tolist()
        if framework == "trtllm":  # TensorRT-LLM's own MLA modules, bf16 and FP8 KV
            entry.update(_mla_trtllm(root, gpu))
        if framework != "vllm":  # the other engines' tables: GEMMs, fused MoE (and those MLA rows)
            out["gpus"][gpu] = entry
            continue
        comm_files = sorted(
            (root / gpu / "comm" / "vllm").glob("*/custom_allreduce_perf.parquet"), key=_version_key
        )
        if comm_files:
            d = pd.read_parquet(comm_files[-1])
            d = d[d.backend.eq("vllm_graph") & d.allreduce_dtype.eq("bfloat16")]
            entry["allreduce_version"] = comm_files[-1].parent.name
            entry["allreduce"] = d[["num_gpus", "message_size", "latency"]].values.tolist()
        entry.update(_mla(root, gpu))
        entry.update(_a2a(root, gpu))
        entry.update(_nccl(root, gpu))
        out["gpus"][gpu] = entry
    return out


def _mla(root: Path, gpu: str) -> dict:
    """vLLM's whole MLA attention block per layer (the q/kv down- and up-projections, the
    attention kernel, o_proj), bf16 KV cache, weights in bf16 or fp8_block, newest version."""
    import pandas as pd

    out: dict = {}
    for phase, length in (("context", "isl"), ("generation", "step")):
        backend = MLA_BACKENDS.get(
            gpu, MLA_PREFILL_BLACKWELL if phase == "context" else MLA_BACKEND_BLACKWELL
        )
        files = sorted(
            (root / gpu / "mla" / "vllm").glob(f"*/mla_{phase}_module_perf.parquet"), key=_version_key
        )
        if not files:
            continue
        d = pd.read_parquet(files[-1])
        d = d[d.kernel_source.eq(backend) & d.kv_cache_dtype.eq("bfloat16") & d.tp_size.eq(1)]
        d = d[d.gemm_type.isin(["bfloat16", "fp8_block"])]
        out[f"mla_{phase}_version"] = f"{files[-1].parent.name} {backend}"
        out[f"mla_{phase}"] = d[["gemm_type", "num_heads", "batch_size", length, "latency"]].values.tolist()
    return out


def _mla_trtllm(root: Path, gpu: str) -> dict:
    """TensorRT-LLM's whole MLA module per layer (its one ``default`` kernel set), TP 1 rows of
    heads 1-128, newest version: ``mla_{phase}`` with a bf16 KV cache, ``mla_{phase}_fp8kv`` with
    an FP8 one (TensorRT-LLM's DeepSeek deployments run FP8 KV), projections in bf16, fp8_block or
    nvfp4."""
    import pandas as pd

    out: dict = {}
    for phase, length in (("context", "isl"), ("generation", "step")):
        files = sorted(
            (root / gpu / "mla" / "trtllm").glob(f"*/mla_{phase}_module_perf.parquet"), key=_version_key
        )
        if not files:
            continue
        d = pd.read_parquet(files[-1])
        d = d[d.tp_size.eq(1) & d.gemm_type.isin(["bfloat16", "fp8_block", "nvfp4"])]
        out[f"mla_{phase}_version"] = files[-1].parent.name
        for kv, suffix in (("bfloat16", ""), ("fp8", "_fp8kv")):
            sel = d[d.kv_cache_dtype.eq(kv)]
            if len(sel):
                cols = ["gemm_type", "num_heads", "batch_size", length, "latency"]
                out[f"mla_{phase}{suffix}"] = sel[cols].values.tolist()
    return out


def _a2a(root: Path, gpu: str) -> dict:
    """DeepEP's dispatch and combine as vLLM runs them (high-throughput and low-latency modes),
    one node; latency in microseconds."""
    import pandas as pd

    files = sorted((root / gpu / "comm" / "vllm").glob("*/moe_a2a_perf.parquet"), key=_version_key)
    if not files:
        return {}
    d = pd.read_parquet(files[-1])
    d = d[d.comm_backend.isin(["deepep_ht", "deepep_ll"]) & d.node_num.eq(1)]
    cols = ["comm_backend", "phase", "ep_size", "hidden_size", "topk", "num_experts", "num_tokens", "latency"]
    return {"a2a_version": files[-1].parent.name, "a2a": d[cols].values.tolist()}


def _nccl(root: Path, gpu: str) -> dict:
    """NCCL all-gather and reduce-scatter (half precision), the newest version with both."""
    import pandas as pd

    files = sorted((root / gpu / "comm" / "nccl").glob("*/nccl_perf.parquet"), key=_version_key)
    for f in reversed(files):
        d = pd.read_parquet(f)
        d = d[d.op_name.isin(["all_gather", "reduce_scatter"]) & d.nccl_dtype.eq("half")]
        if set(d.op_name) == {"all_gather", "reduce_scatter"}:
            return {
                "nccl_version": f.parent.name,
                "nccl": d[["op_name", "num_gpus", "message_size", "latency"]].values.tolist(),
            }
    return {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default=",".join(GPUS))
    parser.add_argument("--framework", default="vllm", choices=FRAMEWORKS)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = export(tuple(g for g in args.gpus.split(",") if g), args.framework)
    Path(args.out).write_text(json.dumps(rows, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
