"""The HTML/PNG report (``report/html.py``, ``report/plots.py``) and ``--report`` on the CLI."""

from __future__ import annotations

import base64
import io
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from tailserve.cli import main
from tailserve.core.engine import EngineOptions
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.metrics.attribution import explain_run
from tailserve.policies.registry import parse_policy_list
from tailserve.report.html import SweepCurve, write_report
from tailserve.report.plots import _stairs, gantt_figure, save_png
from tailserve.sim.run import run_policy
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class _Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.srcs: list[str] = []
        self.headings: list[str] = []
        self._in_h = False

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.srcs.append(dict(attrs)["src"])
        self._in_h = tag in ("h1", "h2", "h3")

    def handle_data(self, data):
        if self._in_h:
            self.headings.append(data)

    def handle_endtag(self, tag):
        self._in_h = False


def _check_page(index: Path) -> _Images:
    """Every <img> is an embedded PNG or a file beside the page, and matplotlib can read it."""
    parser = _Images()
    parser.feed(index.read_text(encoding="utf-8"))
    assert parser.srcs
    for src in parser.srcs:
        if src.startswith("data:image/png;base64,"):
            data = base64.b64decode(src.split(",", 1)[1], validate=True)
        else:
            data = (index.parent / src).read_bytes()
        assert data.startswith(PNG_MAGIC)
        image = imread(io.BytesIO(data), format="png")
        assert image.shape[0] > 100 and image.shape[1] > 100
    for png in index.parent.glob("*.png"):
        assert imread(png).ndim == 3
    return parser


@pytest.fixture(scope="module")
def hol_runs():
    built = build_cost_model(Deployment())
    workload = WorkloadBuilder(WorkloadSpec("hol"))
    return [
        run_policy(built, spec, workload, options=EngineOptions(record_batches=True))
        for spec in parse_policy_list("orca,sarathi")
    ]


def test_report_renders_with_every_image(hol_runs, tmp_path):
    curves = [
        SweepCurve(
            "vllm", "chunk size (tokens)", [256, 512, 1024], {"p99 TTFT (ms)": [3.0, 2.0, None]}, best_x=512
        ),
        SweepCurve("sarathi", "chunk size (tokens)", [256, 512], {"p99 TTFT (ms)": [4.0, 2.5]}),
    ]
    explanations = [explain_run(r) for r in hol_runs]
    index = write_report(
        tmp_path / "rep", hol_runs, title="hol", sweep_curves=curves, explanation=explanations
    )
    assert index == tmp_path / "rep" / "index.html"
    page = _check_page(index)
    # Two CDFs, a timeline and a Gantt chart per run, one sweep figure.
    assert len(page.srcs) == 2 + 2 * len(hol_runs) + 1
    assert {"Summary", "Latency distributions", "Iteration timelines", "Slowest requests", "Sweeps"} <= set(
        page.headings
    )
    text = index.read_text()
    assert "The prefill of long-0 (8,192 tokens) stalled 10 decoding request(s)" in text  # orca's
    assert sorted(p.name for p in index.parent.glob("timeline_*.png")) == [
        "timeline_1_orca.png",
        "timeline_2_sarathi.png",
    ]


def test_gantt_without_batch_record_falls_back_to_queued_then_prefill(tmp_path):
    built = build_cost_model(Deployment())
    run = run_policy(built, parse_policy_list("vllm")[0], WorkloadBuilder(WorkloadSpec("hol")))
    assert run.batches is None
    fig = gantt_figure(run, num_requests=3)
    assert len(fig.axes[0].get_yticklabels()) == 3
    assert imread(save_png(fig, tmp_path / "g.png")).ndim == 3


def test_sweep_curve_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="2 values for 3 x values"):
        SweepCurve("vllm", "chunk", [1, 2, 3], {"p99": [1.0, 2.0]})
    with pytest.raises(ValueError, match="no x values"):
        SweepCurve("vllm", "chunk", [], {})


def test_report_into_a_file_is_an_error(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        write_report(target, [], title="x")


def test_timeline_steps_are_zero_only_while_idle():
    starts = np.array([0.0, 1.0, 3.0])
    ends = np.array([1.0, 2.0, 4.0])
    values, edges = _stairs(starts, ends, np.array([5.0, 6.0, 7.0]))
    assert edges.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert values.tolist() == [5.0, 6.0, 0.0, 7.0]  # idle between 2 and 3 s only


def test_cli_compare_report(tmp_path, capsys):
    assert main(["compare", "--policies", "orca,vllm", "--report", str(tmp_path / "cmp")]) == 0
    page = _check_page(tmp_path / "cmp" / "index.html")
    assert len(page.srcs) == 2 + 2 * 2
    assert "report:" in capsys.readouterr().err
