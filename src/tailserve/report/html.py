"""One self-contained HTML report: the runs' summary table, the explanation, and the figures.

``write_report`` writes each figure as a PNG into the report folder and embeds the same bytes
in ``index.html`` as base64, so the page opens from disk (or as a lone attachment) with every
image. Other commands (``tune``) add their sweeps through ``sweep_curves``.
"""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure

from tailserve.metrics.attribution import CAUSE_SHORT, TTFT_CAUSES, RunExplanation
from tailserve.report.plots import (
    SweepCurve,
    cdf_figure,
    gantt_figure,
    save_png,
    sweep_figure,
    timeline_figure,
)
from tailserve.sim.run_file import RunResult

__all__ = ["SweepCurve", "write_report"]

_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1200px; margin: 2em auto; color: #222; }
table { border-collapse: collapse; font-size: 0.9em; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
figure { margin: 1.5em 0; } img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 0.9em; color: #555; } .summary { background: #f6f6f6; padding: 0.8em; }
"""


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")[:40] or "run"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:,.1f}"


class _Page:
    def __init__(self, out_dir: Path, title: str) -> None:
        self.out_dir = out_dir
        self.parts = [
            "<!doctype html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
            f"<h1>{html.escape(title)}</h1>",
        ]

    def add(self, markup: str) -> None:
        self.parts.append(markup)

    def text(self, tag: str, text: str, cls: str = "") -> None:
        attr = f' class="{cls}"' if cls else ""
        self.parts.append(f"<{tag}{attr}>{html.escape(text)}</{tag}>")

    def figure(self, fig: Figure, name: str, caption: str) -> None:
        path = save_png(fig, self.out_dir / f"{name}.png")
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        self.parts.append(
            f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(caption)}">'
            f"<figcaption>{html.escape(caption)} ({html.escape(path.name)})</figcaption></figure>"
        )

    def table(self, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
        self.parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")

    def write(self) -> Path:
        self.parts.append("</body></html>")
        path = self.out_dir / "index.html"
        path.write_text("\n".join(self.parts) + "\n", encoding="utf-8")
        return path


def _summary_rows(runs: Sequence[RunResult]) -> list[list[str]]:
    rows = []
    for run in runs:
        s = run.summary()
        m = s["metrics"]
        rows.append(
            [
                run.label,
                _ms(m["ttft_s"]["p50"]),
                _ms(m["ttft_s"]["p99"]),
                _ms(m["itl_s"]["p99"]),
                _ms(m["itl_s"]["max"]),
                _ms(m["tpot_s"]["p99"]),
                f"{s['throughput']['output_tokens_per_s']:,.0f}",
                str(s["num_preemptions"]),
                f"{s['num_finished']}/{s['num_requests']}",
            ]
        )
    return rows


def _explanation(page: _Page, x: RunExplanation, top: int = 10) -> None:
    page.text("h3", x.label)
    page.text("p", x.summary, "summary")
    causes = [c for c in TTFT_CAUSES if any(b.components[c] > 0 for b in x.ttft[:top])]
    rows = []
    for b in x.ttft[:top]:
        blockers = ", ".join(f"{bl.request_id} ({bl.prompt_len:,} tok)" for bl in b.blockers[:2])
        rows.append(
            [b.request_id, f"{b.prompt_len:,}", _ms(b.seconds)]
            + [_ms(b.components[c]) for c in causes]
            + [str(b.num_prefill_chunks), blockers or "-"]
        )
    header = ["request", "prompt tokens", "TTFT ms"] + [f"{CAUSE_SHORT[c]} (ms)" for c in causes]
    page.table([*header, "prefill iterations", "top blockers"], rows)


def write_report(
    out_dir: str | Path,
    runs: list[RunResult],
    *,
    title: str,
    sweep_curves: list[SweepCurve] | None = None,
    explanation: RunExplanation | Sequence[RunExplanation] | None = None,
    capacity: tuple[Sequence[str], Sequence[Sequence[str]], Sequence[str]] | None = None,
) -> Path:
    """Write PNGs and ``index.html`` into ``out_dir`` (created if missing); returns the page.
    ``capacity`` (``tailserve tune``): a table's header and rows, and the lines under it."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--report {out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    explanations = [explanation] if isinstance(explanation, RunExplanation) else list(explanation or [])
    page = _Page(out, title)
    if runs:
        config = runs[0].config
        page.text(
            "p",
            f"{config.get('model')} on {config.get('hardware')}, TP {config.get('tp')}, calibration "
            f"{config.get('calibration')}; workload: {config.get('workload')}.",
        )
    if capacity is not None:
        header, rows, lines = capacity
        page.text("h2", "Capacity")
        page.table(header, rows)
        for line in lines:
            page.text("p", line)
    if runs:
        page.text("h2", "Summary")
        header = ["policy", "TTFT p50 ms", "TTFT p99 ms", "ITL p99 ms", "ITL max ms", "TPOT p99 ms"]
        page.table([*header, "output tok/s", "preemptions", "finished"], _summary_rows(runs))
    if explanations:
        page.text("h2", "Why: TTFT and stalls attributed to causes")
        for x in explanations:
            _explanation(page, x)
    if runs:
        page.text("h2", "Latency distributions")
        page.figure(cdf_figure(runs, "ttft"), "ttft_cdf", "TTFT CDF per policy")
        page.figure(cdf_figure(runs, "tbt"), "tbt_cdf", "Time-between-tokens CDF per policy")
        page.text("h2", "Iteration timelines")
        for i, run in enumerate(runs):
            page.figure(
                timeline_figure(run),
                f"timeline_{i + 1}_{_slug(run.label)}",
                f"{run.label}: tokens per iteration, iteration time and KV usage over time",
            )
        page.text("h2", "Slowest requests")
        for i, run in enumerate(runs):
            page.figure(
                gantt_figure(run),
                f"gantt_{i + 1}_{_slug(run.label)}",
                f"{run.label}: the slowest requests by TTFT, arrival to first token by cause, then decoding",
            )
    if sweep_curves:
        page.text("h2", "Sweeps")
        by_x: dict[str, list[SweepCurve]] = {}
        for c in sweep_curves:
            by_x.setdefault(c.x_name, []).append(c)
        for i, (x_name, curves) in enumerate(by_x.items()):
            page.figure(sweep_figure(curves), f"sweep_{i + 1}_{_slug(x_name)}", f"metrics over {x_name}")
    return page.write()
