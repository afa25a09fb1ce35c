"""Report figures (matplotlib, drawn off-screen): latency CDFs, the iteration timeline, the
slowest requests as a Gantt chart, and sweep curves.

Figures are built on ``matplotlib.figure.Figure`` directly, never through pyplot, so no global
backend or figure registry is touched (safe in worker processes and tests); ``save_png`` renders
with the Agg canvas.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter, ScalarFormatter

from tailserve.metrics.attribution import CAUSE_TEXT, TTFT_CAUSES, Attributor, finished
from tailserve.metrics.summary import RequestLatencies
from tailserve.sim.run_file import RunResult

# One colour per cause, the same in every figure.
CAUSE_COLORS = {
    "queued_prefill": "#d62728",
    "kv_wait": "#9467bd",
    "decode_wait": "#bcbd22",
    "batched_prefill": "#ff7f0e",
    "batched_decode": "#17becf",
    "prefill": "#2ca02c",
    "preemption": "#8c564b",
    "kv_load": "#e377c2",
    "other": "#c7c7c7",
}
DECODE_COLOR = "#1f77b4"
PREFILL_COLOR = "#ff7f0e"


@dataclass(frozen=True)
class SweepCurve:
    """One policy's results over a swept setting: one line on every panel of ``sweep_figure``.

    ``y`` maps a metric name with its unit (e.g. ``"p99 TTFT (ms)"``) to one value per ``x``;
    None marks a point without a result. Curves with the same metric names share panels.
    """

    label: str  # the line's legend, e.g. "vllm"
    x_name: str  # the swept setting with its unit, e.g. "chunk size (tokens)"
    x: Sequence[float]
    y: dict[str, Sequence[float | None]] = field(default_factory=dict)
    best_x: float | None = None  # marked on every panel (e.g. the recommended setting)
    log_x: bool = True  # chunk sizes and budgets are swept in powers of two

    def __post_init__(self) -> None:
        if not self.x:
            raise ValueError(f"sweep curve {self.label!r} has no x values")
        for name, values in self.y.items():
            if len(values) != len(self.x):
                raise ValueError(
                    f"sweep curve {self.label!r}: {name!r} has {len(values)} values for {len(self.x)} x values"
                )


def save_png(fig: Figure, path: Path) -> Path:
    fig.savefig(path, format="png", dpi=110)
    return path


def _ms(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float64) * 1e3


def cdf_figure(runs: Sequence[RunResult], metric: str) -> Figure:
    """TTFT (``"ttft"``) or inter-token gap (``"tbt"``) distribution, one line per run, in ms:
    the CDF, and beside it the tail (the fraction above each value, log scale) where p99 lives."""
    fig = Figure(figsize=(11, 4.2), layout="tight")
    ax, tail = fig.subplots(1, 2)
    name = "TTFT" if metric == "ttft" else "time between tokens (TBT / ITL)"
    fig.suptitle(f"{name} per policy")
    unit = "TTFT (ms)" if metric == "ttft" else "gap between tokens (ms)"
    for run in runs:
        done = finished(run.requests)
        if metric == "ttft":
            values = np.array([r.token_times[0] - r.arrival_time for r in done])
        else:
            # the ITL the summary reports: between the chunks a client receives (a step's tokens
            # are one chunk; a stream interval holds several steps' back)
            values = RequestLatencies.of(done, run.stream).itl
        if not values.size:
            continue
        xs = np.sort(_ms(values))
        ys = np.arange(1, xs.size + 1) / xs.size
        ax.step(xs, ys, where="post", label=run.label)
        tail.step(xs, 1 - ys + 1 / xs.size, where="post", label=run.label)
    ax.set_title("cumulative distribution", fontsize=9)
    ax.set_ylabel("fraction of requests" if metric == "ttft" else "fraction of gaps")
    ax.set_ylim(0, 1.02)
    tail.set_title("tail: fraction at or above each value (p99 at 0.01)", fontsize=9)
    tail.set_yscale("log")
    tail.axhline(0.01, color="grey", lw=0.8, ls=":")
    for a in (ax, tail):
        a.set_xscale("log")
        a.xaxis.set_major_formatter(ScalarFormatter())
        a.xaxis.set_minor_formatter(NullFormatter())
        a.set_xlabel(f"{unit}, log scale")
        a.grid(True, which="both", alpha=0.3)
        if a.lines:
            a.legend(fontsize=7)
    return fig


def _stairs(starts: np.ndarray, ends: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Values and edges of a step curve: each iteration's value over it, 0 while the engine idles."""
    gap = starts[1:] > ends[:-1]
    seg_starts = np.concatenate([starts, ends[:-1][gap]])
    seg_values = np.concatenate([values, np.zeros(int(gap.sum()))])
    order = np.argsort(seg_starts, kind="stable")
    return seg_values[order], np.append(seg_starts[order], ends[-1])


def timeline_figure(run: RunResult) -> Figure:
    """Prefill and decode tokens per iteration, iteration time and KV usage over time, with
    preemptions marked: a whole long prefill in one iteration shows as a tall, wide block."""
    log = run.log
    fig = Figure(figsize=(11, 7), layout="tight")
    axes = fig.subplots(3, 1, sharex=True, height_ratios=[2, 1.4, 1])
    fig.suptitle(f"{run.label}: iteration timeline")
    if not len(log):
        axes[0].text(0.5, 0.5, "no iterations", ha="center", transform=axes[0].transAxes)
        return fig
    starts = np.asarray(log.start)
    ends = starts + np.asarray(log.duration)
    prefill = np.asarray(log.num_prefill_tokens, dtype=np.float64)
    decode = np.asarray(log.num_decode_tokens, dtype=np.float64)
    ax = axes[0]
    vals, edges = _stairs(starts, ends, decode + prefill)
    ax.stairs(vals, edges, fill=True, color=PREFILL_COLOR, alpha=0.8, label="prefill tokens")
    vals, edges = _stairs(starts, ends, decode)
    ax.stairs(vals, edges, fill=True, color=DECODE_COLOR, alpha=0.9, label="decode tokens")
    ax.set_yscale("symlog", linthresh=16)
    ax.set_ylabel("tokens per iteration")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title("tokens computed in each iteration (stacked: decode below, prefill above)", fontsize=9)
    ax = axes[1]
    vals, edges = _stairs(starts, ends, _ms(ends - starts))
    ax.stairs(vals, edges, color="black", lw=0.8)
    ax.set_ylabel("iteration time (ms)")
    ax.set_title("how long each iteration took: every decode in it waited that long", fontsize=9)
    ax = axes[2]
    usage = np.asarray(log.num_used_blocks, dtype=np.float64) / max(log.num_blocks, 1) * 100
    ax.step(starts, usage, where="post", color="#9467bd", label="KV cache in use")
    preempted = np.asarray(log.num_preemptions) > 0
    if preempted.any():
        ax.scatter(
            starts[preempted], usage[preempted], marker="v", color="#d62728", zorder=3, label="preemption"
        )
    ax.set_ylim(0, 105)
    ax.set_ylabel("KV usage (%)")
    ax.set_xlabel("time (s)")
    ax.legend(fontsize=8, loc="lower right")
    for a in axes:
        a.grid(True, alpha=0.3)
    return fig


def gantt_figure(run: RunResult, num_requests: int = 10) -> Figure:
    """The slowest requests by TTFT, one row each: arrival to first token coloured by cause (with
    a batch record; else queued, then prefill), then decoding to the last token."""
    done = sorted(finished(run.requests), key=lambda r: r.arrival_time - r.token_times[0])[:num_requests]
    fig = Figure(figsize=(11, 1.8 + 0.42 * max(len(done), 1)), layout="tight")
    ax = fig.add_subplot()
    fig.suptitle(f"{run.label}: the {len(done)} slowest requests by TTFT")
    attributor = (
        Attributor(run.requests, run.batches, run.config.get("policy", ""), run.config.get("policy_flags"))
        if run.batches
        else None
    )
    used: set[str] = set()
    for row, r in enumerate(reversed(done)):
        if attributor is not None:
            segments = attributor.ttft_segments(r)
        else:
            scheduled = r.first_scheduled_time if r.first_scheduled_time is not None else r.arrival_time
            segments = [(r.arrival_time, scheduled, "other"), (scheduled, r.token_times[0], "prefill")]
        for start, end, cause in segments:
            label = None if cause in used else CAUSE_TEXT[cause]
            used.add(cause)
            ax.barh(row, end - start, left=start, height=0.6, color=CAUSE_COLORS[cause], label=label)
        label = None if "decode" in used else "decoding (first to last token)"
        used.add("decode")
        ax.barh(
            row,
            r.token_times[-1] - r.token_times[0],
            left=r.token_times[0],
            height=0.25,
            color=DECODE_COLOR,
            label=label,
        )
    ax.set_yticks(range(len(done)))
    ax.set_yticklabels([f"{r.request_id} ({r.prompt_len:,} tok)" for r in reversed(done)], fontsize=8)
    ax.set_xlabel("time (s)")
    ax.grid(True, axis="x", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    order = [TTFT_CAUSES.index(c) if c in TTFT_CAUSES else len(TTFT_CAUSES) for c in _causes_of(labels)]
    ranked = sorted(zip(order, handles, labels), key=lambda x: x[0])
    ax.legend(
        [h for _, h, _ in ranked],
        [lab for _, _, lab in ranked],
        fontsize=7,
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        ncols=3,
        frameon=False,
    )
    return fig


def _causes_of(labels: list[str]) -> list[str]:
    by_text = {text: cause for cause, text in CAUSE_TEXT.items()}
    return [by_text.get(label, label) for label in labels]


def sweep_figure(curves: Sequence[SweepCurve]) -> Figure:
    """One panel per metric; one line per curve; the chosen x marked on each line."""
    metrics = list(dict.fromkeys(name for c in curves for name in c.y))
    fig = Figure(figsize=(5 * max(len(metrics), 1), 4), layout="tight")
    axes = fig.subplots(1, max(len(metrics), 1), squeeze=False)[0]
    x_names = sorted({c.x_name for c in curves})
    fig.suptitle(f"sweep over {', '.join(x_names)}")
    for ax, metric in zip(axes, metrics):
        for c in curves:
            if metric not in c.y:
                continue
            xs = np.asarray(c.x, dtype=np.float64)
            ys = np.array([np.nan if v is None else v for v in c.y[metric]], dtype=np.float64)
            (line,) = ax.plot(xs, ys, marker="o", ms=4, label=c.label)
            if c.best_x is not None and c.best_x in c.x:
                j = list(c.x).index(c.best_x)
                ax.plot([xs[j]], [ys[j]], marker="*", ms=14, color=line.get_color(), mec="black")
            if c.log_x:
                ax.set_xscale("log", base=2)
                ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_title(metric)
        ax.set_xlabel(" / ".join(x_names))
        ax.set_ylabel(metric)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return fig
