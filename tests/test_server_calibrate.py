"""``calibrate --from-server``: the server's histograms read as vLLM names them, the model chosen
from ``/v1/models`` (or one line listing them), and probes of a live ``tailserve serve`` that
give the server-side figures where it has them and a calibration file the simulator loads."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tailserve.cli import main
from tailserve.executors.simulated.calibration_files import read_calibration_file
from tailserve.executors.simulated.cost_model import BatchShape
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.executors.simulated.hardware import Hardware
from tailserve.executors.simulated.models import load_hf_config
from tailserve.fidelity import server_calibrate as sc
from tailserve.fidelity.server_metrics import DECODE, PREFILL, parse_histograms
from tailserve.fidelity.server_probe import ProbeError, Prompts, ServedModel, ServerProbe, choose_model
from tailserve.server.prometheus import ServerMetrics
from test_server import micro_model, running_server  # noqa: F401  (fixture)

CPU = Hardware("cpu", 50e9, 10e9, 16.0, 10e9, 10e9, vendor="cpu")


@pytest.fixture(scope="module")
def torch_server(micro_model: Path) -> Iterator[Any]:  # noqa: F811
    with running_server(micro_model, "torch") as running:
        yield running


# ---- histograms -----------------------------------------------------------------------------
VLLM_TEXT = """\
# HELP vllm:request_prefill_time_seconds Histogram of time spent in PREFILL phase for request.
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{engine="0",le="0.3",model_name="m"} 2.0
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 2.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 2.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 0.25
vllm:request_prefill_time_seconds_count{engine="1",model_name="m"} 1.0
vllm:request_prefill_time_seconds_sum{engine="1",model_name="m"} 0.05
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_histogram_totals_sum_engines_and_subtract():
    before = parse_histograms(VLLM_TEXT)
    assert before.totals == {"vllm:request_prefill_time_seconds": (pytest.approx(0.3), 3.0)}
    assert before.first(PREFILL) == "vllm:request_prefill_time_seconds"
    assert before.first(DECODE) is None
    after = parse_histograms(
        VLLM_TEXT.replace("} 0.25", "} 0.45").replace('"0",model_name="m"} 2.0', '"0",model_name="m"} 3.0')
    )
    total, count = after.delta(before, "vllm:request_prefill_time_seconds")
    assert total == pytest.approx(0.2) and count == 1


def test_tailserve_server_metrics_carry_the_names_probed():
    names = parse_histograms(ServerMetrics("m").render().decode()).totals
    assert "vllm:request_prefill_time_seconds" in names and "vllm:inter_token_latency_seconds" in names


# ---- the model to probe ----------------------------------------------------------------------
def test_choose_model_by_directory_name_or_served_name(tmp_path: Path):
    model_dir = tmp_path / "tiny"
    model_dir.mkdir()
    models = [ServedModel("tiny", str(model_dir), 2048), ServedModel("other", "/x/other", 4096)]
    assert choose_model(models, None, str(model_dir)).id == "tiny"  # its root
    assert choose_model(models, None, "tiny").id == "tiny"  # its id
    assert choose_model(models, "other", str(model_dir)).id == "other"  # named: wins
    with pytest.raises(ProbeError, match=r"serves tiny \(.*tiny\), other \(/x/other\).*--served-model"):
        choose_model(models, None, "Llama-3-8B")
    with pytest.raises(ProbeError, match="not 'nope'"):
        choose_model(models, "nope", "tiny")


def test_prompts_are_fresh_and_of_the_asked_length():
    ids = Prompts(True, 1024, seed=1)
    a, b = ids.make(100), ids.make(100)
    assert len(a) == 100 and a != b and all(10 <= t < 1024 for t in a)
    words = Prompts(False, 1024, seed=1, words_per_token=0.5).make(100)
    assert isinstance(words, str) and len(words.split()) == 50


def test_default_plan_stays_within_budget_and_context():
    plan = sc.default_plan(max_model_len=512, budget=2048, repeats=2, decode_tokens=16)
    assert plan.prefill_lens == (32, 128, 511) and max(c for _, c in plan.decode_shapes) + 8 < 512
    assert sc.default_plan(4096, 1024).prefill_lens == (32, 128, 512, 1024)
    assert plan.num_probes == (3 + len(plan.decode_shapes) + len(plan.mixed)) * 2
    assert sc.parse_decode_shapes("1x128, 16x512") == ((1, 128), (16, 512))
    with pytest.raises(ValueError, match="BATCHxCONTEXT"):
        sc.parse_decode_shapes("16,512")
    with pytest.raises(ValueError, match="prompt lengths"):
        sc.parse_prefill_lens("a,b")


def test_default_plan_adds_cached_context_and_mixed_probes_that_fit():
    plan = sc.default_plan(max_model_len=2048, budget=2048)
    assert plan.context_prefills == ((128, 512), (256, 1024), (512, 1024), (256, 1536))
    assert plan.mixed == ((4, 256, 128), (8, 256, 512), (16, 512, 256))
    shapes = len(plan.prefill_lens) + len(plan.decode_shapes) + len(plan.context_prefills) + len(plan.mixed)
    assert plan.num_probes == shapes * 3
    small = sc.default_plan(max_model_len=512, budget=256)
    assert small.context_prefills == () and small.mixed == ((4, 256, 128),)
    assert all(c % sc.CONTEXT_ALIGN == 0 for _, c in plan.context_prefills)
    assert sc.parse_context_prefills("256@1024, 64@128") == ((256, 1024), (64, 128))
    assert sc.parse_mixed("8x256+512") == ((8, 256, 512),)
    with pytest.raises(ValueError, match="multiple of 128"):
        sc.parse_context_prefills("256@1000")
    with pytest.raises(ValueError, match="NEW@CONTEXT"):
        sc.parse_context_prefills("256")
    with pytest.raises(ValueError, match="BxL\\+P"):
        sc.parse_mixed("8x256")


def test_thread_seconds_are_published_and_said():
    from tailserve.llm.llm_engine import EngineStats

    metrics = ServerMetrics("m")
    before = parse_histograms(metrics.render().decode())
    stats = EngineStats(0, 0, 0, 0.0, 0, 0, 0, 0, 0, cpu_thread_seconds=((1, 3.0), (2, 1.0)), cpu_threads=1)
    metrics.observe_stats(stats)
    after = parse_histograms(metrics.render().decode())
    assert after.threads_since(before) == {1: 3.0, 2: 1.0}
    assert "tailserve_cpu_threads" in metrics.render().decode()
    note = sc.threads_note(after.threads_since(before))
    assert note == "; the server's CPU executor ran 2 threads 25%, 1 thread 75% of the time"
    assert sc.threads_note({}) == "" and sc.threads_note(None) == ""


def test_the_host_is_timed_at_the_thread_count_the_server_ran_longest(monkeypatch):
    # A 2-core host with one core busy: the server ran one thread; two threads timing the peak
    # here would wait on the busy core and read a peak far below the server's own rate.
    import argparse

    import torch

    from tailserve.cli import calibrate
    from tailserve.fidelity import torch_calibrate

    seen: list[int] = []
    monkeypatch.setattr(
        torch_calibrate, "measure_host", lambda dtype: seen.append(torch.get_num_threads()) or CPU
    )
    before = torch.get_num_threads()
    args = argparse.Namespace(hardware="cpu", dtype="float32")
    assert calibrate._server_hardware(args, {1: 3.0, 2: 1.0}) is CPU
    assert calibrate._server_hardware(args, None) is CPU  # vLLM says nothing: torch's count
    assert seen == [1, before] and torch.get_num_threads() == before
    assert (
        calibrate._server_hardware(argparse.Namespace(hardware="H100", dtype="auto"), {1: 1.0}).name
        == "H100-SXM"
    )


# ---- a live server ---------------------------------------------------------------------------
def test_probes_read_the_servers_own_figures(torch_server: Any, micro_model: Path):  # noqa: F811
    probe = ServerProbe(torch_server.base_url, "micro", {})
    assert probe.accepts_token_ids(1024)  # tailserve takes token-id prompts as those tokens
    plan = sc.ProbePlan(prefill_lens=(16, 64), decode_shapes=((1, 40), (3, 40)), decode_tokens=8, repeats=2)
    # On a loaded host the server's figures can miss the 2 s a probe waits for them; the probe
    # then takes the client's (the fallback this test is not about). Up to three tries.
    for _ in range(3):
        seen: list[str] = []
        points = sc.probe_server(probe, Prompts(True, 1024), plan, progress=seen.append)
        if points[0].source != "client" and points[2].source != "client":
            break
    assert len(seen) == plan.num_probes
    prefill16, prefill64, decode1, decode3 = points
    # One request at a time: the server's histograms hold the figure, below the client's TTFT.
    assert prefill16.source == "vllm:request_prefill_time_seconds"
    assert prefill16.batch.num_tokens == 16 and prefill64.batch.num_tokens == 64
    assert 0 < prefill64.seconds <= prefill64.client_s
    assert decode1.source == "vllm:inter_token_latency_seconds"
    # Several streams at once: the client's median gap (the server's histogram mixes them).
    assert decode3.source == "client" and decode3.seconds == decode3.client_s
    assert decode3.batch == BatchShape.of([], [36 + 4] * 3)  # prompts of 36, 4 tokens in: the middle
    fit = sc.fit_points(load_hf_config(micro_model), CPU, 1, [p.measured() for p in points])
    assert len(fit.predicted) == 4 and all(p > 0 for p in fit.predicted)


def test_cached_context_and_mixed_probes_time_the_step_they_name(torch_server: Any):
    probe = ServerProbe(torch_server.base_url, "micro", {})
    plan = sc.ProbePlan(
        prefill_lens=(),
        decode_shapes=(),
        repeats=1,
        context_prefills=((16, 128),),
        mixed=((2, 40, 16),),
        mixed_decode_tokens=400,  # the micro model decodes in a few ms: still running when it ends
    )
    # On a loaded host a decode stream can end before the probe beside it does; the probe then
    # falls back to the client's figure (checked below). Up to three tries for the server's.
    for _ in range(3):
        context, mixed = sc.probe_server(probe, Prompts(True, 1024), plan)
        if mixed.source != "client":
            break
    # The 128 tokens sent before are served from the prefix cache: 16 new tokens over 128.
    assert context.batch == BatchShape.of([(16, 128)], []) and context.label == "prefill 16 at 128"
    assert context.source == "vllm:request_prefill_time_seconds" and 0 < context.seconds <= context.client_s
    # The probe shared its step with the two decodes (the server's histogram timed that step).
    assert mixed.batch.num_tokens == 16 + 2 and mixed.batch.prefill_kv_tokens == 16
    contexts = mixed.batch.decode_kv_tokens - 2  # decode_kv counts each decode's context + 1
    assert 2 * (40 + sc.MIXED_WARM_CHUNKS) <= contexts < 2 * (40 + 400)
    assert mixed.source == "vllm:request_prefill_time_seconds" and mixed.label.startswith(
        "prefill 16 beside 2 x"
    )


def test_a_server_without_prefix_caching_gives_no_cached_context_point(micro_model: Path):  # noqa: F811
    with running_server(micro_model, "torch", policy_flags={"enable_prefix_caching": "false"}) as running:
        probe = ServerProbe(running.base_url, "micro", {})
        plan = sc.ProbePlan(prefill_lens=(16,), decode_shapes=(), repeats=1, context_prefills=((16, 128),))
        points = sc.probe_server(probe, Prompts(True, 1024), plan)
    assert [p.label for p in points] == ["prefill 16"]
    fit = sc.fit_points(load_hf_config(micro_model), CPU, 1, [p.measured() for p in points])
    cal = sc.calibration_file("u", "micro", load_hf_config(micro_model), CPU, 1, plan, points, fit, True)
    assert "1 of 1 cached-context prefills dropped" in cal.source


def test_without_metrics_the_client_figures_are_fitted(torch_server: Any):
    probe = ServerProbe(torch_server.base_url, "micro", {})
    plan = sc.ProbePlan(prefill_lens=(16,), decode_shapes=((1, 20),), decode_tokens=6, repeats=1)
    points = sc.probe_server(probe, Prompts(True, 1024), plan, use_metrics=False)
    assert [p.source for p in points] == ["client", "client"]


def test_text_prompts_are_measured_by_the_servers_count(torch_server: Any):
    probe = ServerProbe(torch_server.base_url, "micro", {})
    timing = probe.stream(Prompts(False, 1024).make(30), 2)
    assert timing.prompt_tokens > 0 and timing.completion_tokens == 2 and len(timing.gaps_s) == 1


def test_cli_writes_a_calibration_file_simulate_loads(
    torch_server: Any,
    micro_model: Path,  # noqa: F811
    tmp_path: Path,
    capsys,
    monkeypatch,
):
    monkeypatch.setenv("COLUMNS", "400")  # rich wraps at the terminal's width
    out = tmp_path / "fitted.json"
    argv = ["calibrate", "--from-server", torch_server.base_url, "--model", str(micro_model)]
    argv += ["--hardware", "cpu", "--prefill", "16,64,128", "--decode", "1x40,2x40,4x64"]
    argv += ["--context-prefill", "", "--mixed", "2x40+16"]
    argv += ["--decode-tokens", "8", "--repeats", "1", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "--from-server" in printed and "prefill 128" in printed and f"wrote {out}" in printed
    cal = read_calibration_file(out)
    assert cal.hardware.name == "cpu" and len(cal.points) == 7 and "served model micro" in cal.source
    assert "0 cached-context prefill, 1 mixed and 3 decode shapes" in cal.source
    assert "the server's CPU executor ran" in cal.source
    built = build_cost_model(Deployment(str(micro_model), "H100", 1, str(out)))
    assert built.cost_model.hardware.name == "cpu"
    assert (
        main(
            [
                "simulate",
                "--model",
                str(micro_model),
                "--calibration",
                str(out),
                "--workload",
                "chat",
                "--num-requests",
                "5",
            ]
        )
        == 0
    )


def test_cli_names_the_served_models_on_a_mismatch(torch_server: Any, capsys):
    argv = [
        "calibrate",
        "--from-server",
        torch_server.base_url,
        "--model",
        "Llama-3-8B",
        "--hardware",
        "H100",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "it serves micro" in err[0] and "--served-model" in err[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_says_when_the_server_is_unreachable_or_not_openai(capsys):
    port = _free_port()
    argv = [
        "calibrate",
        "--from-server",
        f"http://127.0.0.1:{port}",
        "--model",
        "Llama-3-8B",
        "--hardware",
        "H100",
    ]
    assert main(argv) == 2
    assert "cannot reach the server at" in capsys.readouterr().err

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"detail": "no such route"}).encode()
            self.send_response(404)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        argv[2] = f"http://127.0.0.1:{httpd.server_address[1]}"
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "is not an OpenAI-compatible server: GET /v1/models answered 404" in err
    finally:
        httpd.shutdown()


def test_the_warm_up_streams_until_an_adaptive_server_has_settled():
    # tailserve's CPU executor revisits its thread count every 0.5 s of stepping and climbs back
    # only after two quiet windows: the warm-up streams for WARM_UP_S so the client's own start-up
    # CPU has left its windows before the first timed probe.
    calls: list[tuple[int, int]] = []

    class Probe:
        def stream(self, prompt, max_tokens):
            calls.append((len(prompt), max_tokens))

    ticks = iter(0.4 * k for k in range(100))
    sc.warm_up(Probe(), Prompts(True, 1024), clock=lambda: next(ticks))
    assert calls[0] == (64, 4)  # first-request costs
    assert calls[1:] == [(64, 64)] * 3  # 0.4, 0.8 and 1.2 s after the start; at 1.6 s it stops
    assert sc.WARM_UP_S == 1.5


def test_the_warm_up_waits_for_the_servers_figures_of_its_own_requests():
    # A server that records a request's figures just after its last byte: without waiting, the
    # first probe's scrape before it misses the warm-up's last request, counts it as its own and
    # falls back to the client's figure (seen in CI on a loaded host).
    from tailserve.fidelity.server_metrics import HistogramTotals

    class Probe:
        streamed = 0
        recorded = 0

        def stream(self, prompt, max_tokens):
            self.streamed += 1
            self.recorded = self.streamed - 1  # the last one lands on the next scrape

        def histograms(self):
            seen = self.recorded
            self.recorded = self.streamed
            return HistogramTotals({"vllm:request_prefill_time_seconds": (0.01 * seen, float(seen))})

    probe = Probe()
    ticks = iter(0.4 * k for k in range(100))
    sc.warm_up(probe, Prompts(True, 1024), clock=lambda: next(ticks), settle=True)
    assert probe.streamed == 4
    assert probe.histograms().totals["vllm:request_prefill_time_seconds"][1] == 4  # nothing late


def test_a_probe_builds_one_tls_context_for_all_its_clients(torch_server: Any, monkeypatch):
    # httpx builds a context (loading the CA bundle, ~30 ms of CPU) per client; a probe opens a
    # client per stream and per scrape, beside the engine it times.
    import httpx

    from tailserve.fidelity import server_probe

    made: list[int] = []
    real = httpx.create_ssl_context
    monkeypatch.setattr(httpx, "create_ssl_context", lambda *a, **k: made.append(1) or real(*a, **k))
    server_probe.ssl_context.cache_clear()
    probe = ServerProbe(torch_server.base_url, "micro", {})
    for _ in range(3):
        probe.histograms()
        probe.stream(Prompts(True, 1024).make(8), 2)
    assert len(made) == 1
    server_probe.ssl_context.cache_clear()


def test_a_probes_repeats_say_how_far_apart_they_ran() -> None:
    from tailserve.fidelity import server_calibrate as sc

    timing = sc.StreamTiming(0.01, (0.003,) * 8, 100, 9)
    server = [
        sc._Run((timing,), c, s, "vllm:inter_token_latency_seconds")
        for c, s in ((3.0, 2.8), (4.3, 4.15), (3.9, 3.86))
    ]
    point = sc._summarize_decode(
        [sc._Run(r.timings, r.client_s * 1e-3, r.server_s * 1e-3, r.source) for r in server], 1, 32
    )
    assert point.seconds == pytest.approx(3.86e-3) and point.source.startswith("vllm:")
    assert (point.low_s, point.high_s) == (pytest.approx(2.8e-3), pytest.approx(4.15e-3))
    assert point.spread == pytest.approx((4.15 - 2.8) / 3.86) and point.spread > sc.SPREAD_WARNING
    # One repeat without the server's figure: the client's, its spread from the client's repeats.
    mixed = [
        sc._Run(timing_run.timings, c * 1e-3, None if k == 0 else s * 1e-3, "vllm:x")
        for k, (timing_run, (c, s)) in enumerate(zip(server, ((3.0, 2.8), (3.1, 4.15), (3.2, 3.86))))
    ]
    point = sc._summarize_decode(mixed, 1, 32)
    assert point.source == "client" and point.seconds == pytest.approx(3.1e-3)
    assert point.spread == pytest.approx(0.2 / 3.1)
    one = sc.ProbedPoint(point.batch, 1e-3, 1e-3, "client", "decode 1 x 128")
    assert one.spread == 0.0
