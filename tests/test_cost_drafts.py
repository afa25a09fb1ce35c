"""``tailserve cost --drafts K``: a decode batch verifying K drafts each, priced as the simulated
executor prices that step, and its time per output token."""

from __future__ import annotations

import json

import pytest

from tailserve.cli import main
from tailserve.cli.cost import _price_drafts
from tailserve.core.request import Request
from tailserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.spec_decode import SpecDecoding, resolve_acceptance_rates


def test_the_priced_step_is_the_simulated_executors():
    cm = build_cost_model(Deployment("Llama-3-8B", "H100-SXM", 1, "none")).cost_model
    k, batch, ctx = 3, 8, 500
    priced = _price_drafts(cm, batch, ctx, k, "eagle3", 2.5)
    spec = SpecDecoding("eagle3", k, resolve_acceptance_rates(k, None, 2.5))
    scheduled = []
    for i in range(batch):
        r = Request(f"r{i}", 400, 200, 0.0)
        r.num_computed_tokens, r.num_output_tokens = ctx, ctx - 400 + 1
        scheduled.append(ScheduledRequest(r, 1 + k, ctx, num_spec_tokens=k))
    step = SimExecutor(cm, 16, spec).execute(SchedulerOutput(scheduled=scheduled, advanced=True))
    assert priced["step_s"] == pytest.approx(step.duration, rel=1e-12)
    assert priced["per_token_s"] == pytest.approx(priced["step_s"] / 2.5)


def test_cost_prints_and_writes_the_drafted_step(tmp_path, capsys):
    out = tmp_path / "c.json"
    argv = ["cost", "--model", "Llama-3-8B", "--hardware", "H100-SXM", "--decode", "16x1000"]
    assert main([*argv, "--drafts", "2", "--acceptance-length", "2.2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "drafts: 2 per request (mtp): a step verifying 3 tokens of each of the 16 decodes" in " ".join(
        text.split()
    )
    d = json.loads(out.read_text())["drafts"]
    assert d["acceptance_length"] == 2.2 and d["per_token_s"] == pytest.approx(d["step_s"] / 2.2)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--acceptance-length", "2"], "--acceptance-length prices --drafts K"),
        (["--drafts", "0"], "--drafts must be >= 1"),
        (["--drafts", "2", "--acceptance-length", "3.5"], "must be in [1, 3]"),
    ],
)
def test_bad_draft_options_are_one_line(capsys, extra, needle):
    try:
        rc = main(["cost", "--model", "Llama-3-8B", "--hardware", "H100-SXM", *extra])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err
