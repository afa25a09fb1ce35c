"""The simulator against end-to-end figures others measured on real GPUs (docs/fidelity.md).

vLLM's nightly latency benchmark (buildkite vllm/performance-benchmark build 9515, "Latency
tests"): ``benchmark_latency`` with 32 input tokens, 128 output tokens, a fixed batch of 8, on one
H200 node; the figure is the mean end-to-end latency of one batch. Here: 8 requests of 32 prompt
tokens and 128 outputs arrive together, ``vllm`` (V1 defaults for the H200), uncalibrated model;
the batch's latency is the last finish.

    python benchmarks/published_points.py
"""

from __future__ import annotations

from dataclasses import replace

from rich.console import Console
from rich.table import Table

from tailserve.assemble import BuildOptions, build_engine
from tailserve.core.request import Request
from tailserve.core.source import ListSource
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.sim.deployment import BuiltCostModel, Deployment, build_cost_model

# (label, model, GPU, TP, batch, input, output, measured ms, source)
POINTS = (
    ("vLLM nightly latency_llama70B_tp4", "Llama-3-70B", "H200", 4, 8, 32, 128, 2077.53, "buildkite vllm/performance-benchmark #9515"),
    ("vLLM nightly latency_llama8B_tp1", "Llama-3.1-8B", "H200", 1, 8, 32, 128, 833.421, "buildkite vllm/performance-benchmark #9515"),
)  # fmt: skip


def generic(model: str, gpu: str, tp: int) -> CostModel:
    """The cost model before the fitted curves: generic efficiencies, one 8 us all-reduce latency."""
    hw = replace(get_hardware(gpu), gemm=None, allreduce_latency_by_tp=(), comm_efficiency=None)
    return CostModel(get_model(model), hw, tp)


def batch_latency(cm: CostModel, batch: int, n_in: int, n_out: int) -> tuple[float, float]:
    reqs = [Request(f"r{i}", n_in, n_out, 0.0) for i in range(batch)]
    options = BuildOptions(shares_prefixes=False, cpu_swap=False)
    built = BuiltCostModel(cm, "none")  # an uncalibrated cost model made here
    engine = build_engine(built, "vllm", "sim", options, source=ListSource(reqs)).engine
    engine.run()
    decode = [d for d, p in zip(engine.log.duration, engine.log.num_prefill_tokens) if p == 0]
    return max(r.finish_time for r in reqs), sum(decode) / len(decode)


def main() -> int:
    table = Table(title="published end-to-end points (uncalibrated defaults)", title_justify="left")
    cols = (
        "point",
        "model / GPU / TP",
        "measured ms",
        "predicted ms",
        "error",
        "decode step ms",
        "generic ms",
        "generic error",
    )
    for col in cols:
        table.add_column(col, justify="right" if "ms" in col or col == "error" else "left")
    for label, model, gpu, tp, batch, n_in, n_out, ms, _source in POINTS:
        cm = build_cost_model(Deployment(model, gpu, tp, "none")).cost_model
        t, step = batch_latency(cm, batch, n_in, n_out)
        g, _ = batch_latency(generic(model, gpu, tp), batch, n_in, n_out)
        table.add_row(
            label, f"{model} / {gpu} / {tp}", f"{ms:,.1f}", f"{t * 1e3:,.1f}", f"{t * 1e3 / ms - 1:+.1%}",
            f"{step * 1e3:.2f}", f"{g * 1e3:,.1f}", f"{g * 1e3 / ms - 1:+.1%}",
        )  # fmt: skip
    Console(width=160).print(table)
    print("source: " + "; ".join(sorted({p[-1] for p in POINTS})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
