"""A twin from a user's traffic: ``bench`` and ``router`` record every request as a tailserve
trace the simulator replays (token ids and what was measured as extra keys), and ``simulate``
compares its replay with the recording, whole and on the held-out later part."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router_helpers import running_router, sim_server
from tailserve.cli import main
from tailserve.core.request import Request
from tailserve.sim.twin import compare_replay
from tailserve.workloads.errors import TraceError
from tailserve.workloads.recorded import Measured, TraceRecorder, has_measured, load_measured, trace_line
from tailserve.workloads.traces import load_trace
from test_server import micro_model  # noqa: F401  (fixture)

ENGINE = {"hardware": "A40", "sim_model": "Llama-3-8B", "max_model_len": 2048}


@pytest.fixture(scope="module")
def backend(micro_model: Path) -> Iterator[Any]:  # noqa: F811
    with sim_server(str(micro_model), **ENGINE) as running:
        yield running


def _write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


# ---- the format ------------------------------------------------------------------------------
def test_tailserve_traces_take_token_ids_and_measured_figures(tmp_path: Path):
    line = trace_line(0.5, 3, 2, Measured(0.01, [0.02], 2, 0.03), [5, 6, 7])
    other = trace_line(0.1, 4, 1, Measured(error="HTTP 500"))
    path = _write(tmp_path / "r.jsonl", [line, other])
    requests = load_trace(path)
    assert [r.request_id for r in requests] == ["trace-1", "trace-0"]  # by arrival
    assert requests[1].prompt_token_ids == [5, 6, 7] and requests[0].prompt_token_ids is None
    pairs = load_measured(path)
    assert [m.error for _, m in pairs] == ["HTTP 500", ""]
    assert pairs[1][1].itl_s == [0.02] and pairs[1][1].latency_s == 0.03
    assert has_measured(path)
    bad = _write(tmp_path / "bad.jsonl", [{**line, "prompt_token_ids": [1, 2]}])
    with pytest.raises(TraceError, match=r"bad.jsonl:1: prompt_token_ids holds 2 ids, prompt_len is 3"):
        load_trace(bad)
    with pytest.raises(TraceError, match="measured must be an object"):
        load_trace(_write(tmp_path / "m.jsonl", [{**line, "measured": 3}]))
    plain = _write(tmp_path / "p.jsonl", [{"arrival_time": 0, "prompt_len": 3, "max_tokens": 2}])
    assert not has_measured(plain)
    with pytest.raises(TraceError, match="no measured figures"):
        load_measured(plain)


def test_recorder_counts_arrivals_from_the_first_request(tmp_path: Path):
    now = iter([10.0, 10.5, 12.0])
    recorder = TraceRecorder(tmp_path / "r.jsonl", clock=lambda: next(now))
    assert [recorder.arrived(), recorder.arrived(), recorder.arrived()] == [0.0, 0.5, 2.0]
    recorder.write(trace_line(2.0, 1, 1, Measured(0.1, [], 1, 0.1)))
    recorder.close()
    assert recorder.num_written == 1 and load_trace(tmp_path / "r.jsonl")[0].arrival_time == 2.0


def test_a_replay_equal_to_the_recording_has_no_error():
    recorded, replayed = [], []
    for i in range(10):
        arrival = 0.1 * i
        times = [arrival + 0.05 + 0.01 * k for k in range(4)]
        measured = Measured(0.05 + 0.02, [0.01] * 3, 4, times[-1] - arrival + 0.02)
        recorded.append((Request(f"trace-{i}", 8, 4, arrival), measured))
        r = Request(f"trace-{i}", 8, 4, arrival)
        r.token_times = times
        replayed.append(r)
    twin = compare_replay(recorded, replayed, overhead_s=0.02, held_out=0.3)  # 20 ms outside the engine
    for part in (twin.all, twin.held_out):
        for metric, value in part["recorded"].items():
            assert part["replayed"][metric] == pytest.approx(value), metric
    assert twin.held_out["recorded"]["requests"] == 3 and twin.split_arrival_s == pytest.approx(0.7)


# ---- recording live traffic --------------------------------------------------------------------
def test_bench_records_a_trace_simulate_replays_and_compares(
    backend: Any,
    micro_model: Path,  # noqa: F811
    tmp_path: Path,
    capsys,
    monkeypatch,
):
    monkeypatch.setenv("COLUMNS", "300")
    trace = tmp_path / "bench.jsonl"
    argv = ["bench", "--base-url", backend.base_url, "--tokenizer", str(micro_model), "--num-prompts", "12"]
    argv += ["--random-input-len", "200", "--random-output-len", "8", "--request-rate", "20", "--no-progress"]
    assert main([*argv, "--record-trace", str(trace)]) == 0
    pairs = load_measured(trace)
    assert len(pairs) == 12 and all(m.success and len(m.itl_s) == 7 for _, m in pairs)
    assert all(r.prompt_token_ids is not None and len(r.prompt_token_ids) == 200 for r, _ in pairs)
    assert pairs[0][0].arrival_time == 0.0 and pairs[-1][0].arrival_time > 0.3
    capsys.readouterr()
    out = tmp_path / "sim.json"
    argv = ["simulate", "--trace", str(trace), "--model", "Llama-3-8B", "--hardware", "A40"]
    assert main([*argv, "--max-model-len", "2048", "--held-out", "0.25", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "replayed vs recorded (12 requests)" in printed and "held out" in printed
    twin = json.loads(out.read_text())["twin"]
    assert twin["num_compared"] == 12 and twin["held_out"]["recorded"]["requests"] == 3
    # The backend simulates this deployment in real time: the replay is the same engine's.
    rec, rep = twin["all"]["recorded"], twin["all"]["replayed"]
    assert rep["itl_p50"] == pytest.approx(rec["itl_p50"], rel=0.5)


def test_router_records_what_passes_through(backend: Any, tmp_path: Path):
    trace = tmp_path / "router.jsonl"
    from tailserve.workloads.recorded import TraceRecorder

    recorder = TraceRecorder(trace)
    with running_router([backend.base_url], app_options={"recorder": recorder}) as router:
        url = f"{router.base_url}/v1/completions"
        stream = {"model": backend.engine.model_name, "prompt": list(range(10, 74)), "max_tokens": 5,
                  "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
        with httpx.stream("POST", url, json=stream, timeout=30) as response:
            assert response.status_code == 200 and "data: [DONE]" in response.read().decode()
        plain = {
            "model": backend.engine.model_name,
            "prompt": "hello there",
            "max_tokens": 3,
            "ignore_eos": True,
        }
        assert httpx.post(url, json=plain, timeout=30).status_code == 200
        bad = {"model": "no-such-model", "prompt": [1, 2, 3], "max_tokens": 2}
        assert httpx.post(url, json=bad, timeout=30).status_code == 400
    pairs = load_measured(trace)
    assert len(pairs) == 3
    by_len = {r.prompt_len: (r, m) for r, m in pairs}
    r, m = by_len[64]
    assert r.prompt_token_ids == list(range(10, 74)) and r.max_tokens == 5
    assert m.success and m.output_tokens == 5 and len(m.itl_s) == 4 and 0 < m.ttft_s <= m.latency_s
    text = [(r, m) for r, m in pairs if r.prompt_token_ids is None and m.success]
    assert len(text) == 1 and text[0][1].ttft_s is None and text[0][1].output_tokens == 3  # plain: no TTFT
    assert by_len[3][1].error.startswith("HTTP 400")


def test_the_twins_stall_causes_are_checked_against_the_recording(tmp_path: Path, capsys, monkeypatch):
    """A recording the simulator made of the essay's hol run: replayed, every stall is the same
    gap, and each one put on the long prompt's prefill is confirmed by the recorded times."""
    from tailserve.executors.simulated.deployment import Deployment, build_cost_model
    from tailserve.sim.run import run_policy
    from tailserve.sim.workload_builder import WorkloadBuilder
    from tailserve.sim.workload_spec import WorkloadSpec
    from tailserve.workloads.recorded import write_trace

    monkeypatch.setenv("COLUMNS", "300")
    built = build_cost_model(Deployment("Llama-3.1-8B", "H100", 1))
    from tailserve.policies.registry import PolicySpec

    policy = PolicySpec.make("vllm", {"max_num_batched_tokens": 8192})
    run = run_policy(built, policy, WorkloadBuilder(WorkloadSpec(name="hol")))
    lines = []
    for r in run.requests:
        t = r.token_times
        gaps = [b - a for a, b in itertools.pairwise(t)]
        measured = Measured(t[0] - r.arrival_time, gaps, len(t), t[-1] - r.arrival_time)
        lines.append(trace_line(r.arrival_time, r.prompt_len, r.max_tokens, measured))
    trace = tmp_path / "hol.jsonl"
    write_trace(trace, lines)
    long_id = f"trace-{len(lines) - 1}"  # the long prompt arrives last
    out = tmp_path / "twin.json"
    argv = ["simulate", "--trace", str(trace), "--model", "Llama-3.1-8B", "--hardware", "H100"]
    assert main([*argv, "--max-num-batched-tokens", "8192", "--explain", "--json", str(out)]) == 0
    assert "the recording's stalls" in capsys.readouterr().out
    twin = json.loads(out.read_text())["twin"]
    assert twin["all"]["replayed"]["itl_p99"] == pytest.approx(twin["all"]["recorded"]["itl_p99"], rel=1e-6)
    stalls = twin["stalls"]
    assert (
        stalls["num_stalls"] >= 10
        and stalls["num_confirmed"] == stalls["num_blamed_on_prefill"] == stalls["num_stalls"]
    )
    assert all(
        s["blockers"][0] == long_id and s["replayed_s"] == pytest.approx(s["measured_s"])
        for s in stalls["stalls"]
    )
