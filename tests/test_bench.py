"""``tailserve bench``: vLLM's metric math and JSON names, its datasets, its prediction, and a run
against a live ``tailserve serve`` on loopback that accounts for every request it sent."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tailserve.bench.client import RequestResult, send_times
from tailserve.bench.datasets import BenchRequest, random_requests, sharegpt_requests, trace_requests
from tailserve.bench.predict import PredictSpec, simulate
from tailserve.bench.result import compute_result, parse_goodput, parse_percentiles, peak_concurrency
from tailserve.bench.tokenizer import load_tokenizer
from tailserve.cli import main
from test_server import micro_model, running_server, sample, scrape, wait_idle  # noqa: F401  (fixture)

# The keys of `vllm bench serve --save-result` (without --save-detailed) for generative runs.
VLLM_KEYS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
    "total_token_throughput", "latencies", "queue_times", "max_output_tokens_per_s", "max_concurrent_requests",
    *(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl", "e2el")),
}  # fmt: skip


@pytest.fixture(scope="module")
def sim_server(micro_model: Path) -> Iterator[Any]:  # noqa: F811
    with running_server(micro_model, "sim") as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(micro_model: Path) -> Any:  # noqa: F811
    return load_tokenizer(micro_model)


# ---- metric math ----------------------------------------------------------------------------
def _result(start: float, ttft: float, itl: list[float], **kw: Any) -> RequestResult:
    return RequestResult(
        prompt_len=kw.pop("prompt_len", 10),
        success=kw.pop("success", True),
        output_tokens=kw.pop("output_tokens", len(itl) + 1),
        ttft=ttft,
        itl=itl,
        latency=ttft + sum(itl),
        start_time=start,
        **kw,
    )


def test_metrics_follow_vllm_definitions() -> None:
    results = [
        _result(0.0, 0.1, [0.02, 0.04]),  # 3 tokens: TPOT 0.03
        _result(0.5, 0.3, []),  # 1 token: no TPOT; TPOT 0 for goodput
        _result(0.6, 0.2, [0.05], success=False, error="boom"),
    ]
    r = compute_result(results, 2.0, percentiles=[50, 99.9], goodput={"ttft": 200, "tpot": 25})
    assert (r["completed"], r["failed"]) == (2, 1)
    assert r["total_input_tokens"] == 20 and r["total_output_tokens"] == 4
    assert r["request_throughput"] == pytest.approx(1.0) and r["output_throughput"] == pytest.approx(2.0)
    assert r["mean_ttft_ms"] == pytest.approx(200.0) and r["median_ttft_ms"] == pytest.approx(200.0)
    assert r["mean_tpot_ms"] == pytest.approx(30.0)  # only the 3-token request has one
    assert r["mean_itl_ms"] == pytest.approx(30.0) and r["p50_itl_ms"] == pytest.approx(30.0)
    assert r["mean_e2el_ms"] == pytest.approx((160 + 300) / 2)
    assert "p99.9_ttft_ms" in r and "p50_ttft_ms" in r
    # ttft <= 200 ms and tpot <= 25 ms: the first fails TPOT (30), the second fails TTFT (300).
    assert r["request_goodput"] == 0.0
    r2 = compute_result(results, 2.0, goodput={"ttft": 300})  # meeting the SLO exactly counts
    assert r2["request_goodput"] == pytest.approx(1.0)
    assert compute_result(results, 2.0)["request_goodput"] is None
    assert r["max_output_tokens_per_s"] == 4.0  # every token event falls in the first second
    assert r["max_concurrent_requests"] == 1  # [0, 0.16) and [0.5, 0.8) do not overlap


def test_peak_concurrency_counts_departures_first_on_ties() -> None:
    assert peak_concurrency([(0, 1), (1, 2), (2, 3)]) == 1
    assert peak_concurrency([(0, 2), (1, 3), (1.5, 1.6)]) == 3
    assert peak_concurrency([]) == 0


def test_goodput_and_percentile_flags_are_checked() -> None:
    assert parse_goodput(["ttft:200", "e2el:1500.5"]) == {"ttft": 200.0, "e2el": 1500.5}
    for bad in (["ttft"], ["itl:20"], ["tpot:-1"], ["ttft:fast"]):
        with pytest.raises(ValueError, match="KEY:MILLISECONDS"):
            parse_goodput(bad)
    assert parse_percentiles("50,99.9") == [50.0, 99.9]
    with pytest.raises(ValueError, match=r"0\.\.100"):
        parse_percentiles("101")


def test_send_times_match_vllm_schedule() -> None:
    reqs = [BenchRequest([1], 1, 1)] * 50
    times = send_times(reqs, 10.0, 0.5, seed=3)
    assert times[-1] == pytest.approx(50 / 10.0) and np.all(np.diff(times) >= 0)
    assert np.array_equal(times, send_times(reqs, 10.0, 0.5, seed=3))
    assert not np.any(send_times(reqs, math.inf, 1.0, seed=0))
    traced = [BenchRequest([1], 1, 1, arrival_time=t) for t in (0.0, 0.25, 2.0)]
    assert send_times(traced, math.inf, 1.0, seed=0).tolist() == [0.0, 0.25, 2.0]


# ---- datasets --------------------------------------------------------------------------------
def test_random_dataset_lengths_prefix_and_seed(tokenizer: Any) -> None:
    reqs = random_requests(40, tokenizer, input_len=100, output_len=20, range_ratio=0.5, prefix_len=8, seed=1)
    assert all(50 + 8 <= r.prompt_len <= 150 + 8 and len(r.prompt) == r.prompt_len for r in reqs)
    assert all(10 <= r.output_len <= 30 for r in reqs)
    assert len({tuple(r.prompt[:8]) for r in reqs}) == 1  # one shared prefix
    assert not set().union(*(set(r.prompt) for r in reqs)) & tokenizer.special_ids
    again = random_requests(
        40, tokenizer, input_len=100, output_len=20, range_ratio=0.5, prefix_len=8, seed=1
    )
    assert again == reqs
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(4, tokenizer, range_ratio=1.0)


def test_sharegpt_dataset_filters_and_oversamples(tmp_path: Path, tokenizer: Any) -> None:
    long_text = "word " * 40
    data = [
        {"conversations": [{"from": "human", "value": long_text}, {"from": "gpt", "value": long_text}]},
        {
            "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": long_text}]
        },  # too short
        {"conversations": [{"from": "human", "value": long_text}]},  # one turn only
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_requests(path, 3, tokenizer, seed=0)
    assert len(reqs) == 3 and all(r.prompt == long_text for r in reqs)
    assert reqs[0].prompt_len == len(tokenizer.encode(long_text))
    assert sharegpt_requests(path, 1, tokenizer, output_len=7)[0].output_len == 7
    path.write_text("{}")
    with pytest.raises(ValueError, match="JSON list"):
        sharegpt_requests(path, 1, tokenizer)


def test_trace_dataset_keeps_times_and_shares_prefix_blocks(tmp_path: Path, tokenizer: Any) -> None:
    path = tmp_path / "mooncake.jsonl"
    rows = [
        {"timestamp": 1000, "input_length": 20, "output_length": 3, "hash_ids": [7, 8]},
        {"timestamp": 1500, "input_length": 30, "output_length": 4, "hash_ids": [7, 9, 10]},
        {"timestamp": 4000, "input_length": 5, "output_length": 2, "hash_ids": []},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    reqs = trace_requests(path, tokenizer, block_size=8)
    assert [r.arrival_time for r in reqs] == [0.0, 0.5, 3.0]
    assert [len(r.prompt) for r in reqs] == [20, 30, 5] and [r.output_len for r in reqs] == [3, 4, 2]
    assert reqs[0].prompt[:8] == reqs[1].prompt[:8]  # hash 7 is the same block in both
    assert reqs[0].prompt[8:16] != reqs[1].prompt[8:16]
    assert trace_requests(path, tokenizer, rate_scale=2.0)[1].arrival_time == 0.25


# ---- prediction -------------------------------------------------------------------------------
def test_predict_honours_client_concurrency(tokenizer: Any) -> None:
    reqs = random_requests(6, tokenizer, input_len=64, output_len=8, seed=0)
    times = np.zeros(len(reqs))
    results, duration, _ = simulate(reqs, times, PredictSpec(policy="vllm"), max_concurrency=1)
    assert all(r.success and r.output_tokens == 8 for r in results)
    spans = sorted((r.start_time, r.start_time + r.latency) for r in results)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # one at a time
    assert results[-1].client_queue_time > 0 and duration >= spans[-1][1]
    free, _, _ = simulate(reqs, times, PredictSpec(policy="vllm"), max_concurrency=None)
    assert peak_concurrency([(r.start_time, r.start_time + r.latency) for r in free]) == 6


# ---- against a live server -----------------------------------------------------------------------
def test_bench_against_the_server_reports_every_request(sim_server: Any, tmp_path: Path, capsys) -> None:
    before = scrape(sim_server.base_url)
    out = tmp_path / "result.json"
    argv = ["bench", "--base-url", sim_server.base_url, "--num-prompts", "12", "--random-input-len", "32"]
    argv += [
        "--random-output-len",
        "6",
        "--request-rate",
        "100",
        "--burstiness",
        "0.5",
        "--goodput",
        "ttft:5000",
    ]
    argv += ["--json", str(out), "--no-progress", "--predict", "--predict-policy", "vllm"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "measured / predicted" in printed
    data = json.loads(out.read_text())
    assert set(data) >= VLLM_KEYS
    assert (data["completed"], data["failed"], data["num_prompts"]) == (12, 0, 12)
    assert data["total_output_tokens"] == 12 * 6 and data["total_input_tokens"] == 12 * 32
    assert data["model_id"] == "micro" and data["request_rate"] == 100.0
    assert data["predicted"]["completed"] == 12 and data["predicted"]["total_output_tokens"] == 72
    wait_idle(sim_server)
    after = scrape(sim_server.base_url)  # the server saw exactly what the client reports
    served = sample(after, "vllm:request_success_total", finished_reason="length")
    assert served - sample(before, "vllm:request_success_total", finished_reason="length") == 12
    assert (
        sample(after, "vllm:generation_tokens_total") - sample(before, "vllm:generation_tokens_total") == 72
    )


def test_bench_chat_with_concurrency_limit(sim_server: Any, tmp_path: Path) -> None:
    out = tmp_path / "chat.json"
    argv = [
        "bench",
        "--base-url",
        sim_server.base_url,
        "--endpoint",
        "/v1/chat/completions",
        "--num-prompts",
        "6",
    ]
    argv += ["--random-input-len", "16", "--random-output-len", "4", "--max-concurrency", "2"]
    argv += ["--json", str(out), "--no-progress", "--save-detailed"]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["completed"] == 6 and data["backend"] == "openai-chat" and data["max_concurrency"] == 2
    assert data["max_concurrent_requests"] <= 2
    assert data["output_lens"] == [4] * 6 and len(data["itls"]) == 6


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--goodput", "ttft"], "KEY:MILLISECONDS"),
        (["--dataset", "sharegpt"], "expected random, sharegpt PATH or trace PATH"),
        (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
        (["--dataset", "trace", "/nonexistent.jsonl"], "no such trace file"),
    ],
)
def test_bench_bad_input_is_one_line(sim_server: Any, argv: list[str], message: str, capsys) -> None:
    assert main(["bench", "--base-url", sim_server.base_url, "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tailserve: error:") and message in err


def test_bench_unreachable_server_is_one_line(capsys) -> None:
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--no-progress"]) == 2
    assert "cannot read http://127.0.0.1:9/v1/models" in capsys.readouterr().err


def test_predict_flags_given_win_over_a_sim_servers_deployment_even_at_their_defaults():
    # serve --executor sim --sim-model Llama-3-70B --tp 4, benched with --predict-model Llama-3-8B
    # --predict-tp 1: both values are the flags' defaults, and still what is predicted.
    from tailserve.bench.predict import spec_for_server
    from tailserve.cli.app import build_parser
    from tailserve.cli.bench import predict_overrides

    server = {"executor": "sim", "model": "Llama-3-70B", "hardware": "H100-SXM", "tp": 4, "policy": "vllm"}

    def predicted(*flags: str):
        args, _ = build_parser().parse_known_args(["bench", "--predict", *flags])
        return spec_for_server(predict_overrides(args), server)

    spec, warnings = predicted("--predict-model", "Llama-3-8B", "--predict-tp", "1")
    assert (spec.model, spec.hardware, spec.tp) == ("Llama-3-8B", "H100-SXM", 1)
    assert "not the server's own deployment" in warnings[0]
    spec, warnings = predicted()
    assert (spec.model, spec.tp) == ("Llama-3-70B", 4) and not warnings


# ---- streamed chunks ---------------------------------------------------------------------------
def test_tokens_per_chunk_and_what_is_said_of_them() -> None:
    from tailserve.bench.result import chunk_notes, tokens_per_chunk

    every = [_result(0.0, 0.1, [0.01] * 9, output_tokens=10)]  # ten tokens, ten chunks
    held = [_result(0.0, 0.1, [0.04, 0.04, 0.01], output_tokens=10)]  # 1, 4, 4, 1
    assert tokens_per_chunk(every) == 1.0 and tokens_per_chunk(held) == 2.5
    assert tokens_per_chunk([_result(0.0, 0.1, [], output_tokens=1)]) is None
    assert chunk_notes(1.0, 1.0) == []
    (said,) = chunk_notes(2.5, 2.5)
    assert "2.5 tokens per chunk" in said and "--stream-interval" in said
    assert "the prediction streams 1.0 tokens per chunk" in chunk_notes(2.5, 1.0)[1]


def test_bench_says_when_the_server_streams_chunks(micro_model: Path, tmp_path: Path, capsys) -> None:  # noqa: F811
    with running_server(micro_model, "sim", policy_flags={"stream_interval": "4"}) as server:
        argv = ["bench", "--base-url", server.base_url, "--num-prompts", "6", "--random-input-len", "32"]
        argv += ["--random-output-len", "9", "--request-rate", "50", "--no-progress", "--predict"]
        out = tmp_path / "r.json"
        assert main([*argv, "--predict-policy", "vllm", "--json", str(out)]) == 0
        said = capsys.readouterr().err
        assert "the server streamed 3.0 tokens per chunk" in said  # 9 tokens: 1, 4, 4
        assert "the prediction streams 1.0 tokens per chunk" in said
        assert json.loads(out.read_text())["mean_tokens_per_chunk"] == 3.0
        assert main([*argv, "--predict-policy", "vllm:stream_interval=4"]) == 0
        assert "the prediction streams" not in capsys.readouterr().err
