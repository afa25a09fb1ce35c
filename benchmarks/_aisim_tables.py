"""Export AISimulate's bundled silicon tables (GEMM per format, fused MoE, vLLM's custom
all-reduce under CUDA graphs) as JSON rows.

Runs in AISimulate's venv (pandas and pyarrow read its parquet files; tailserve's own environment
needs neither): ``<peers>/aisimulate/bin/python -m benchmarks._aisim_tables --out rows.json``.
For each GPU it takes vLLM's newest collected version of each table; MoE rows are taken from every
vLLM version (each collected different shapes), the newest row for each shape winning. Only rows
with uniform ("balanced") routing are kept: that is what the cost model assumes.
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
GPUS = ("a100_sxm", "h100_sxm", "h200_sxm", "b200_sxm", "gb200", "b300_sxm")


def _version_key(path: Path) -> tuple:
    parts = path.parent.name.replace("rc", ".").replace("post", ".").split(".")
    return tuple(int(p) if p.isdigit() else -1 for p in parts)


def systems_dir() -> Path:
    import aisimulate_core

    return Path(aisimulate_core.__file__).parent / "systems" / "data"


def export(gpus: tuple[str, ...]) -> dict:
    import pandas as pd

    root = systems_dir()
    out: dict = {"source": str(root), "gpus": {}}
    for gpu in gpus:
        entry: dict = {}
        gemm_files = sorted((root / gpu / "gemm" / "vllm").glob("*/gemm_perf.parquet"), key=_version_key)
        if gemm_files:
            d = pd.read_parquet(gemm_files[-1])
            keep = [d.gemm_dtype.eq(dt) & d.kernel_source.eq(k) for dt, k in GEMM_KERNELS.items()]
            mask = keep[0]
            for k in keep[1:]:
                mask |= k
            d = d[mask]
            entry["gemm_version"] = gemm_files[-1].parent.name
            entry["gemm"] = d[["gemm_dtype", "m", "n", "k", "latency"]].values.tolist()
        moe_files = sorted((root / gpu / "moe" / "vllm").glob("*/moe_perf.parquet"), key=_version_key)
        frames = [pd.read_parquet(f).assign(order=i) for i, f in enumerate(moe_files)]
        if frames:
            d = pd.concat(frames)
            d = d[d.distribution.eq("balanced")]
            key = ["moe_dtype", "num_tokens", "hidden_size", "inter_size", "topk", "num_experts",
                   "moe_tp_size", "moe_ep_size"]  # fmt: skip
            d = d.sort_values("order").groupby(key, as_index=False).last()
            entry["moe_versions"] = sorted({f.parent.name for f in moe_files})
            entry["moe"] = d[[*key, "kernel_source", "latency"]].values.tolist()
        comm_files = sorted(
            (root / gpu / "comm" / "vllm").glob("*/custom_allreduce_perf.parquet"), key=_version_key
        )
        if comm_files:
            d = pd.read_parquet(comm_files[-1])
            d = d[d.backend.eq("vllm_graph") & d.allreduce_dtype.eq("bfloat16")]
            entry["allreduce_version"] = comm_files[-1].parent.name
            entry["allreduce"] = d[["num_gpus", "message_size", "latency"]].values.tolist()
        out["gpus"][gpu] = entry
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default=",".join(GPUS))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = export(tuple(g for g in args.gpus.split(",") if g))
    Path(args.out).write_text(json.dumps(rows, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
