"""Print a benchmark result the way ``vllm bench serve`` does, and predicted beside measured."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
    "client_queue_time": ("Client Queue Time", "Client-side Queueing"),
}


def _line(label: str, value: Any) -> str:
    text = f"{value:<10.2f}" if isinstance(value, float) else f"{value!s:<10}"
    return f"{label:<40} {text}"


def _pword(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def print_result(
    result: dict[str, Any],
    *,
    metrics: Sequence[str],
    percentiles: Sequence[float],
    request_rate: float,
    max_concurrency: int | None,
    title: str = " Serving Benchmark Result ",
) -> None:
    lines = [f"{title:=^50}"]
    lines.append(_line("Successful requests:", result["completed"]))
    lines.append(_line("Failed requests:", result["failed"]))
    if max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", max_concurrency))
    if not math.isinf(request_rate):
        lines.append(_line("Request rate configured (RPS):", float(request_rate)))
    lines.append(_line("Benchmark duration (s):", float(result["duration"])))
    lines.append(_line("Total input tokens:", result["total_input_tokens"]))
    lines.append(_line("Total generated tokens:", result["total_output_tokens"]))
    lines.append(_line("Request throughput (req/s):", float(result["request_throughput"])))
    if result.get("request_goodput") is not None:
        lines.append(_line("Request goodput (req/s):", float(result["request_goodput"])))
    lines.append(_line("Output token throughput (tok/s):", float(result["output_throughput"])))
    lines.append(_line("Peak output token throughput (tok/s):", float(result["max_output_tokens_per_s"])))
    lines.append(_line("Peak concurrent requests:", float(result["max_concurrent_requests"])))
    lines.append(_line("Total token throughput (tok/s):", float(result["total_token_throughput"])))
    for name in metrics:
        short, header = HEADERS[name]
        lines.append(f"{header:-^50}")
        lines.append(_line(f"Mean {short} (ms):", float(result[f"mean_{name}_ms"])))
        lines.append(_line(f"Median {short} (ms):", float(result[f"median_{name}_ms"])))
        for p in percentiles:
            lines.append(_line(f"P{_pword(p)} {short} (ms):", float(result[f"p{_pword(p)}_{name}_ms"])))
    lines.append("=" * 50)
    print("\n".join(lines))


def comparison_rows(
    predicted: dict[str, Any], measured: dict[str, Any], metrics: Sequence[str], percentiles: Sequence[float]
) -> list[tuple[str, str, float | None, float | None]]:
    """(label, key, predicted, measured) for the side-by-side table."""
    rows: list[tuple[str, str, float | None, float | None]] = []
    for key, label in (
        ("completed", "completed requests"),
        ("duration", "duration (s)"),
        ("request_throughput", "requests/s"),
        ("output_throughput", "output tokens/s"),
    ):
        rows.append((label, key, predicted.get(key), measured.get(key)))
    for name in metrics:
        short = HEADERS[name][0]
        for stat in ("mean", "median", *(f"p{_pword(p)}" for p in percentiles)):
            key = f"{stat}_{name}_ms"
            rows.append((f"{short} {stat} (ms)", key, predicted.get(key), measured.get(key)))
    return rows


def print_comparison(
    predicted: dict[str, Any],
    measured: dict[str, Any],
    *,
    metrics: Sequence[str],
    percentiles: Sequence[float],
    title: str,
) -> None:
    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    table.add_column("predicted", justify="right")
    table.add_column("measured", justify="right")
    table.add_column("measured / predicted", justify="right")
    for label, _, p, m in comparison_rows(predicted, measured, metrics, percentiles):
        ratio = f"{m / p:.2f}" if p and m is not None else "-"
        table.add_row(label, _fmt(p), _fmt(m), ratio)
    Console().print(table)


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.2f}" if isinstance(value, float) else f"{value:,}"
