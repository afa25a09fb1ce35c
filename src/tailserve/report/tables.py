"""Terminal tables (rich) for runs, cost predictions, calibrations and the catalogs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tailserve.executors.simulated.cost_model import Roofline
from tailserve.executors.simulated.deployment import BuiltCostModel
from tailserve.executors.simulated.hardware import ENGINE_NAMES, HARDWARE
from tailserve.executors.simulated.models import MODELS
from tailserve.executors.simulated.module_formats import group_dtypes
from tailserve.executors.simulated.precision import gemm_format
from tailserve.sim.run_file import RunResult
from tailserve.sim.workload_spec import WorkloadSpec

# Wide enough for the comparison table when the output is a file or a pipe.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 150)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:,.0f}" if value >= 0.1 else f"{value * 1e3:,.1f}"


def deployment_line(built: BuiltCostModel) -> str:
    cm = built.cost_model
    cal = built.calibration
    prefix = next((p for p in ("gemm:", "vidur:", "aisim:") if cal.startswith(p)), "")
    if prefix or cal.endswith(".json"):  # a source: its file's name
        cal = prefix + Path(cal[len(prefix) :]).name
    elif len(cal) >= 24:
        cal = "measured points"
    dp = f" x DP {cm.dp}" if cm.dp > 1 else ""  # data-parallel attention ranks
    if cm.pipeline is not None:
        dp += f" x PP {cm.pipeline.pp}"
    # vLLM's kernels are the catalog's own: named only when another engine's set priced it
    kernels = f", {ENGINE_NAMES[built.kernels]} kernels" if built.kernels != "vllm" else ""
    return f"{cm.model.name} on {cm.hardware.name}, TP {cm.tp}{dp}, calibration {cal}{kernels}"


LABEL_WIDTH = 48  # characters of a policy label per line in a table


def wrap_label(label: str, width: int = LABEL_WIDTH) -> str:
    """A policy label on lines of at most ``width``, broken after its commas (between flags)
    rather than mid-word: ``vllm:max_num_batched_tokens=512,`` / ``max_num_seqs=64``. A single
    flag longer than the width is left to the table to fold."""
    if len(label) <= width:
        return label
    pieces = [p + "," for p in label.split(",")]
    pieces[-1] = pieces[-1][:-1]
    lines = [""]
    for piece in pieces:
        if lines[-1] and len(lines[-1]) + len(piece) > width:
            lines.append("")
        lines[-1] += piece
    return "\n".join(lines)


def print_runs(
    runs: list[RunResult],
    summaries: list[dict[str, Any]],
    built: BuiltCostModel,
    workload: WorkloadSpec,
) -> None:
    table = Table(title=f"{deployment_line(built)} — {workload.label}", title_justify="left")
    table.add_column("policy", overflow="fold", max_width=LABEL_WIDTH)
    for name in ("TTFT p50", "TTFT p99", "ITL p99", "ITL max", "TPOT p99"):
        table.add_column(f"{name}\nms", justify="right", no_wrap=True)
    table.add_column("output\ntok/s", justify="right", no_wrap=True)
    table.add_column("req/s", justify="right", no_wrap=True)
    table.add_column("preempt", justify="right", no_wrap=True)
    table.add_column("done/rej", justify="right", no_wrap=True)
    show_goodput = any("goodput" in s for s in summaries)
    if show_goodput:
        table.add_column("goodput\nreq/s", justify="right")
    show_prefix = any("prefix_cache" in s for s in summaries)
    if show_prefix:
        table.add_column("prefix hit\n% tokens", justify="right", no_wrap=True)
    for run, s in zip(runs, summaries):
        m = s["metrics"]
        row = [
            wrap_label(run.label),
            _ms(m["ttft_s"]["p50"]),
            _ms(m["ttft_s"]["p99"]),
            _ms(m["itl_s"]["p99"]),
            _ms(m["itl_s"]["max"]),
            _ms(m["tpot_s"]["p99"]),
            f"{s['throughput']['output_tokens_per_s']:,.0f}",
            f"{s['throughput']['requests_per_s']:.2f}",
            str(s["num_preemptions"]),
            f"{s['num_finished']}/{s['num_rejected']}",
        ]
        if show_goodput:
            row.append(f"{s['goodput']['requests_per_s']:.2f}" if "goodput" in s else "-")
        if show_prefix:
            row.append(f"{s['prefix_cache']['hit_rate_tokens'] * 100:.1f}" if "prefix_cache" in s else "off")
        table.add_row(*row)
    console.print(table)


def print_cost(
    built: BuiltCostModel,
    prefill: int,
    prefill_context: int,
    batch: int,
    ctx: int,
    result: dict[str, Any],
    prefill_roof: Roofline,
    decode_roof: Roofline,
) -> None:
    table = Table(title=deployment_line(built), title_justify="left")
    table.add_column("iteration")
    table.add_column("predicted ms", justify="right")
    table.add_column("roofline limit ms", justify="right")
    table.add_column("bound by")
    for name, value, roof in (
        (
            f"prefill {prefill} tokens" + (f" @ {prefill_context} cached" if prefill_context else ""),
            result["prefill_s"],
            prefill_roof,
        ),
        (f"decode {batch} x {ctx} context", result["decode_s"], decode_roof),
    ):
        bound = "compute" if sum(roof.compute_s) >= sum(roof.memory_s) else "memory"
        table.add_row(name, f"{value * 1e3:.2f}", f"{roof.limit_s * 1e3:.2f}", bound)
    console.print(table)
    e = built.cost_model.efficiency
    # With measured times (aisim:FILE) the efficiencies price what the tables do not.
    measured = ""
    if built.cost_model.hardware.gemm_table:
        parts = built.cost_model.table_parts
        named = ", ".join(parts[:-1]) + f" and {parts[-1]}" if len(parts) > 1 else parts[0]
        rest = "the rest" if "MLA block" in parts else "attention and the rest"
        measured = f" ({rest}; the {named} from the measured tables)"
    console.print(
        f"efficiency: compute {e.compute:.3g}, memory {e.memory:.3g}, comm {e.comm:.3g}, overhead {e.overhead * 1e3:.2f} ms{measured}"
    )
    m = built.cost_model.model
    if m.module_dtypes:  # a checkpoint that keeps some groups in another format: say which
        formats = ", ".join(f"{g} {f}" for g, f in group_dtypes(m).items())
        console.print(f"weight formats by group: {formats}")
    fc = built.cost_model.format_curve
    if fc is not None:
        fmt = built.cost_model.model.weight_dtype
        curve = gemm_format(fmt)  # fp8_static runs fp8's dense GEMM kernel: say whose curve
        where = "their own curve" if curve == fmt else f"{curve}'s curve"
        console.print(
            f"{fmt} GEMMs on {where}: compute {fc.compute:.3g} of the "
            f"format's peak, memory {fc.memory:.3g}, tile {fc.tile_m} x {fc.tile_n or '-'}, "
            f"launch {fc.gemm_latency * 1e6:.2f} us"
        )


def print_calibration(built: BuiltCostModel) -> None:
    fit = built.fit
    if fit is None:
        console.print("no calibration (roofline with default efficiencies)")
        return
    table = Table(title=f"calibration of {deployment_line(built)}", title_justify="left")
    table.add_column("point")
    table.add_column("measured ms", justify="right")
    table.add_column("fitted ms", justify="right")
    for point, predicted in zip(fit.points, fit.predicted):
        table.add_row(str(point), f"{point.seconds * 1e3:.2f}", f"{predicted * 1e3:.2f}")
    console.print(table)
    e = fit.efficiency
    console.print(
        f"fitted: compute efficiency {e.compute:.3g}, memory efficiency {e.memory:.3g}, overhead {e.overhead * 1e3:.2f} ms"
    )
    for w in fit.warnings:
        console.print(f"warning: {w}")


def print_policies(hardware, max_model_len: int) -> None:
    from dataclasses import fields

    from tailserve.policies.registry import POLICIES

    table = Table(
        title=f"policies and their engines' defaults on {hardware.name} (max_model_len {max_model_len:,})",
        title_justify="left",
    )
    table.add_column("policy", no_wrap=True)
    table.add_column("what it models")
    table.add_column("flags = defaults")
    for name, cls in POLICIES.items():
        config = cls.default_config(hardware.device_info, max_model_len)
        flags = [f"{f.name}={getattr(config, f.name)}" for f in fields(config)]
        flags.append(f"block_size={cls.default_block_size}")
        flags.append(f"gpu_memory_utilization={cls.default_gpu_memory_utilization}")
        table.add_row(name, cls.summary, "\n".join(flags))
    console.print(table)


def _model_formats(m: Any) -> str:
    """weights / routed experts (=: as the weights) / KV cache, as stored (16-bit shown as bf16)."""
    base = "fp32" if m.dtype_bytes == 4 else "bf16"
    weights = m.weight_dtype or base
    experts = "-"
    if m.is_moe:
        experts = "=" if (m.expert_dtype or weights) == weights else m.expert_dtype
    kept = "*" if m.module_dtypes else ""  # groups the checkpoint keeps in another format
    return f"{weights}/{experts}/{m.kv_dtype or base}{kept}"


def _model_attention(m: Any) -> str:
    kind = (
        f"MLA {m.kv_lora_rank}+{m.qk_rope_head_dim}"
        if m.is_mla
        else "GQA"
        if m.num_kv_heads < m.num_heads
        else "MHA"
    )
    if m.num_sliding_layers:
        kind += f" {m.num_sliding_layers}xSW{m.sliding_window}"
    return kind


def _model_experts(m: Any) -> str:
    if not m.is_moe:
        return "-"
    return f"{m.num_experts}/{m.experts_per_token}" + (" +s" if m.shared_intermediate_size else "")


def print_models() -> None:
    table = Table(
        title="models (any HF config.json path works too; experts: routed/per token, +s: a shared expert; "
        "formats: weights/experts (=: same)/KV cache, *: some layers in another format (cost lists them); 18xSW128: 18 layers attend to the last 128 tokens)",
        title_justify="left",
    )
    columns = (
        "name", "total B", "active B", "layers", "hidden", "heads/kv", "attention", "experts", "formats",
        "context", "KV MB/tok",
    )  # fmt: skip
    for col in columns:
        left = col in ("name", "attention", "experts", "formats")
        table.add_column(col, justify="left" if left else "right", no_wrap=True)
    for m in MODELS.values():
        table.add_row(
            m.name,
            f"{m.num_params / 1e9:.1f}",
            f"{m.num_active_params / 1e9:.1f}",
            str(m.num_layers),
            str(m.hidden_size),
            f"{m.num_heads}/{m.num_kv_heads}",
            _model_attention(m),
            _model_experts(m),
            _model_formats(m),
            f"{m.max_position_embeddings:,}",
            f"{m.kv_bytes_per_token() / 1e6:.3f}",
        )
    console.print(table)


def print_hardware() -> None:
    table = Table(
        title="hardware (dense tensor-core peaks, no sparsity; -: no such unit, weight-only kernels at bf16)",
        title_justify="left",
    )
    columns = (
        "name", "bf16 TFLOP/s", "FP8", "FP4", "HBM TB/s", "memory GiB", "GPU link GB/s", "PCIe GB/s", "--kernels sets",
    )  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col in ("name", "--kernels sets") else "right")
    for h in HARDWARE.values():
        own = dict(h.peak_flops_by_dtype)
        table.add_row(
            h.name,
            f"{h.peak_flops / 1e12:.0f}",
            f"{own['fp8'] / 1e12:.0f}" if "fp8" in own else "-",
            f"{own['fp4'] / 1e12:.0f}" if "fp4" in own else "-",
            f"{h.memory_bandwidth / 1e12:.2f}",
            f"{h.memory_gib:.1f}",
            f"{h.interconnect_bandwidth / 1e9:.0f}",
            f"{h.pcie_bandwidth / 1e9:.0f}",
            # vLLM's are every entry's own curves (fitted or generic); others only where fitted
            ", ".join(["vllm", *(k.engine for k in h.engine_kernels)]),
        )
    console.print(table)
