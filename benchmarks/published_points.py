"""The simulator against end-to-end figures others measured on real GPUs (docs/fidelity.md).

vLLM's nightly latency benchmark (buildkite vllm/performance-benchmark build 9515, "Latency
tests"): ``benchmark_latency`` with 32 input tokens, 128 output tokens, a fixed batch of 8, on one
H200 node; the figure is the mean end-to-end latency of one batch. Here: 8 requests of 32 prompt
tokens and 128 outputs arrive together, ``vllm`` (V1 defaults for the H200), uncalibrated model;
the batch's latency is the last finish.

Single-request decode speed (``vllm bench serve --max-concurrency 1``, fixed lengths, EOS
ignored): one request alone, the figure is its TPOT (time per output token after the first),
mean of (E2E - TTFT) / (output - 1):

- A100-40GB, Llama-3.1-8B-Instruct bf16, vLLM 0.23.0, 1,024 input / 128 output tokens: "about
  75 tokens/sec" at concurrency 1, i.e. 13.3 ms per token (johnmusgrave.com, "vLLM
  throughput-latency sweep on NVIDIA A100"; the figure is rounded by its author).
- H100-80GB-HBM3, Llama-3.1-8B-Instruct fp16, vLLM 0.21.0, concurrency 1: TPOT p50 6.48 ms
  (yobitelcomm.github.io/bench, recipe "concurrency sweep", workload ``llm.inference.chatbot-short``,
  whose lengths the page does not give: simulated as 128 input / 128 output tokens; at batch 1
  the decode step is the weight read, so the context length barely moves it).

    python benchmarks/published_points.py [--variant catalog|waves|bands|both]

``--variant`` prices the points with the candidate forms that are not the default (hardware.py:
the H100's per-GEMM wave curve, the NCCL all-reduce bands, the GEMM tile choice of
tile_choice.py on the A100 and H100 curves; docs/fidelity.md).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from rich.console import Console
from rich.table import Table

from tailserve.assemble import BuildOptions, build_engine
from tailserve.core.request import Request
from tailserve.core.source import ListSource
from tailserve.executors.simulated.cost_model import CostModel, Efficiency
from tailserve.executors.simulated.hardware import (
    A100_ALLREDUCE_BANDS,
    A100_GEMM_TILES,
    A100_TILE_SCALES,
    H100_ALLREDUCE_BANDS,
    H100_GEMM_TILES,
    H100_GEMM_WAVES,
    H100_TILE_SCALES,
    TILE_CHOICE_TILES,
    Hardware,
    get_hardware,
)
from tailserve.executors.simulated.models import get_model
from tailserve.executors.simulated.tile_choice import TileChoiceCostModel
from tailserve.sim.deployment import BuiltCostModel, Deployment, build_cost_model

# (label, model, GPU, TP, batch, input, output, measured ms, source); batch latency points
POINTS = (
    ("vLLM nightly latency_llama70B_tp4", "Llama-3-70B", "H200", 4, 8, 32, 128, 2077.53, "buildkite vllm/performance-benchmark #9515"),
    ("vLLM nightly latency_llama8B_tp1", "Llama-3.1-8B", "H200", 1, 8, 32, 128, 833.421, "buildkite vllm/performance-benchmark #9515"),
)  # fmt: skip


# (label, model, GPU, TP, input, output, measured TPOT ms, source); concurrency-1 decode points
TPOT_POINTS = (
    ("vLLM 0.23 bench serve, concurrency 1", "Llama-3.1-8B", "A100-40GB", 1, 1024, 128, 1000 / 75, "johnmusgrave.com vLLM throughput-latency sweep on A100"),
    ("vLLM 0.21 chatbot-short, concurrency 1", "Llama-3.1-8B", "H100-SXM", 1, 128, 128, 6.48, "yobitelcomm.github.io/bench concurrency-sweep recipe"),
)  # fmt: skip


def generic(model: str, gpu: str, tp: int) -> CostModel:
    """The cost model before the fitted curves: generic efficiencies, one 8 us all-reduce latency."""
    hw = replace(
        get_hardware(gpu), gemm=None, allreduce_latency_by_tp=(), comm_efficiency=None, allreduce_bands=()
    )
    return CostModel(get_model(model), hw, tp)


def batch_latency(cm: CostModel, batch: int, n_in: int, n_out: int) -> tuple[float, float, int]:
    """(the batch's latency, its mean decode step, the number of iterations)."""
    reqs = [Request(f"r{i}", n_in, n_out, 0.0) for i in range(batch)]
    options = BuildOptions(shares_prefixes=False, cpu_swap=False)
    built = BuiltCostModel(cm, "none")  # an uncalibrated cost model made here
    engine = build_engine(built, "vllm", "sim", options, source=ListSource(reqs)).engine
    engine.run()
    decode = [d for d, p in zip(engine.log.duration, engine.log.num_prefill_tokens) if p == 0]
    return max(r.finish_time for r in reqs), sum(decode) / len(decode), len(engine.log.duration)


def variant_hardware(gpu: str, variant: str) -> Hardware:
    hw = get_hardware(gpu)
    hopper = hw.name in ("H100-SXM", "H200")
    if variant in ("waves", "both") and hopper:
        hw = replace(hw, gemm=H100_GEMM_WAVES)
    if variant in ("bands", "both") and (hopper or hw.name.startswith("A100")):
        hw = replace(hw, allreduce_bands=H100_ALLREDUCE_BANDS if hopper else A100_ALLREDUCE_BANDS)
    return hw


def tile_choice_model(model: str, gpu: str, tp: int) -> CostModel:
    """The tile-choice candidate (tile_choice.py) with the GPU's fitted curve and factors."""
    hw = get_hardware(gpu)
    hopper = hw.name in ("H100-SXM", "H200")
    if not (hopper or hw.name.startswith("A100")):
        return CostModel(get_model(model), hw, tp)
    curve, scales = (H100_GEMM_TILES, H100_TILE_SCALES) if hopper else (A100_GEMM_TILES, A100_TILE_SCALES)
    hw = replace(hw, gemm=curve)
    return TileChoiceCostModel(
        get_model(model), hw, tp, Efficiency.for_hardware(hw), TILE_CHOICE_TILES, scales
    )


def lone_tpot(cm: CostModel, n_in: int, n_out: int) -> float:
    """TPOT of one request running alone: (E2E - TTFT) / (output - 1)."""
    req = Request("r0", n_in, n_out, 0.0)
    options = BuildOptions(shares_prefixes=False, cpu_swap=False)
    build_engine(BuiltCostModel(cm, "none"), "vllm", "sim", options, source=ListSource([req])).engine.run()
    return (req.token_times[-1] - req.token_times[0]) / (n_out - 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=("catalog", "waves", "bands", "both", "tiles"), default="catalog")
    variant = ap.parse_args().variant

    def model_for(model: str, gpu: str, tp: int) -> CostModel:
        if variant == "catalog":
            return build_cost_model(Deployment(model, gpu, tp, "none")).cost_model
        if variant == "tiles":
            return tile_choice_model(model, gpu, tp)
        return CostModel(get_model(model), variant_hardware(gpu, variant), tp)

    table = Table(title=f"published end-to-end points (uncalibrated, {variant})", title_justify="left")
    cols = (
        "point",
        "model / GPU / TP",
        "measured ms",
        "predicted ms",
        "error",
        "decode step ms",
        "implied overhead ms",
        "generic ms",
        "generic error",
    )
    for col in cols:
        table.add_column(col, justify="right" if "ms" in col or col == "error" else "left")
    for label, model, gpu, tp, batch, n_in, n_out, ms, _source in POINTS:
        cm = model_for(model, gpu, tp)
        t, step, iters = batch_latency(cm, batch, n_in, n_out)
        g, _, _ = batch_latency(generic(model, gpu, tp), batch, n_in, n_out)
        # The per-iteration overhead that would make the prediction exact (time is linear in it
        # and the schedule does not depend on it: every request arrives at 0).
        implied = cm.efficiency.overhead + (ms * 1e-3 - t) / iters
        table.add_row(
            label, f"{model} / {gpu} / {tp}", f"{ms:,.1f}", f"{t * 1e3:,.1f}", f"{t * 1e3 / ms - 1:+.1%}",
            f"{step * 1e3:.2f}", f"{implied * 1e3:.2f}", f"{g * 1e3:,.1f}", f"{g * 1e3 / ms - 1:+.1%}",
        )  # fmt: skip
    Console(width=160).print(table)
    tpot = Table(title=f"single-request TPOT (uncalibrated, {variant})", title_justify="left")
    for col in (
        "point",
        "model / GPU / TP",
        "in / out",
        "measured ms",
        "predicted ms",
        "error",
        "implied overhead ms",
        "generic ms",
        "generic error",
    ):
        tpot.add_column(col, justify="left" if col in ("point", "model / GPU / TP") else "right")
    for label, model, gpu, tp, n_in, n_out, ms, _source in TPOT_POINTS:
        cm = model_for(model, gpu, tp)
        t = lone_tpot(cm, n_in, n_out) * 1e3
        implied = cm.efficiency.overhead * 1e3 + ms - t  # one iteration per output token
        g = lone_tpot(generic(model, gpu, tp), n_in, n_out) * 1e3
        tpot.add_row(
            label, f"{model} / {gpu} / {tp}", f"{n_in} / {n_out}", f"{ms:.2f}", f"{t:.2f}", f"{t / ms - 1:+.1%}",
            f"{implied:.2f}", f"{g:.2f}", f"{g / ms - 1:+.1%}",
        )  # fmt: skip
    Console(width=160).print(tpot)
    print("sources: " + "; ".join(sorted({p[-1] for p in (*POINTS, *TPOT_POINTS)})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
