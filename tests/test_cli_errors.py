"""A new user's mistakes get one line each (never argparse's usage block), and empty work is an
error with its reason, not a table of dashes with exit status 0."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tailserve.cli import main
from test_server import micro_model, running_server  # noqa: F401  (fixture)


def _one_error_line(capsys: Any, argv: list[str], status: int = 2) -> str:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors exit from inside parse_known_args
        code = e.code
    assert code == status
    err = capsys.readouterr().err
    assert "usage:" not in err and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "--workload", "nope"], "argument --workload: invalid choice: 'nope'"),
        (["compare", "--rate", "fast"], "argument --rate: invalid float value: 'fast'"),
        (["run", "--dtype", "int3", "--prompts", "p.txt"], "invalid choice: 'int3'"),
        (["simulate", "--quiet"], "unrecognized argument --quiet"),
        (["serve", "--quiet"], "unrecognized argument --quiet"),
        (["run", "--prompts", "p.txt", "--quiet", "--bogus", "1"], "unrecognized argument --bogus"),
        (["cost", "--quiet"], "unrecognized argument --quiet"),
        (["simulate", "--max-num-batched-tokens"], "--max-num-batched-tokens needs a value (int)"),
        (
            ["simulate", "--policy", "sglang", "--chunked-prefill-size", "--schedule-policy", "lpm"],
            "--chunked-prefill-size needs a value",
        ),
        (["--model", "Llama-3-8B"], "name the command first, e.g. tailserve compare --model Llama-3-8B"),
        # The command named after the option moves to the front, once (the suggestion runs).
        (["--model", "Llama-3-8B", "compare"], "e.g. tailserve compare --model Llama-3-8B (commands:"),
        (["--rate", "2", "simulate", "--policy", "slo"], "e.g. tailserve simulate --policy slo --rate 2 ("),
        (["model"], "tailserve model needs a subcommand: init"),
        (["model", "init"], "the following arguments are required: --out"),
        (["nope"], "invalid choice: 'nope'"),
        # A workload option the workload does not read: refused, not silently ignored.
        (
            ["simulate", "--num-requests", "30"],
            "--num-requests is not used by the hol workload: hol is fixed",
        ),
        (["compare", "--workload", "random", "--turns", "2:3"], "--turns is not used by the random workload"),
        (["tune", "--workload", "chat", "--prefix-len", "64"], "it is read by shared-prefix"),
        (["simulate", "--trace", "t.csv", "--rate", "3"], "--rate is not used by the trace workload"),
        # vLLM's --dtype is not how a number format is chosen: the flags that are.
        (["cost", "--model", "DeepSeek-V3", "--dtype", "fp8"], "--quantization fp8"),
        (["simulate", "--dtype=fp8"], "--kv-cache-dtype fp8"),
    ],
)
def test_mistakes_are_one_line_without_usage(argv, message, capsys):
    assert message in _one_error_line(capsys, argv)


@pytest.mark.parametrize(
    ("config", "message"), [(None, "not a model directory"), ("{broken", "config.json: not readable JSON")]
)
def test_serve_says_in_one_line_why_a_model_does_not_load(config, message, tmp_path, capsys):
    # docs/cli.md: a model that does not load is one error line, exit 2 (not a traceback, exit 1).
    model = tmp_path / "model"
    if config is not None:
        model.mkdir()
        (model / "config.json").write_text(config)
    line = _one_error_line(capsys, ["serve", "--model", str(model), "--port", "0"])
    assert message in line


def test_serve_never_starts_on_a_bad_policy_flag(capsys):
    # The check happens before the socket is bound or a model is loaded.
    line = _one_error_line(capsys, ["serve", "--policy", "tgi", "--max-num-batched-tokens", "512"])
    assert "unrecognized argument --max-num-batched-tokens" in line and "policy tgi" in line


@pytest.mark.parametrize("command", ["simulate", "serve", "run"])
def test_help_of_policy_commands_names_the_flag_convention(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "engine's own names" in out and "tailserve policies" in out


@pytest.mark.parametrize("command", ["simulate", "serve", "run"])
def test_help_of_policy_commands_lists_every_registered_policy(command, capsys):
    from tailserve.policies.registry import POLICIES

    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"{' | '.join(POLICIES)} (default: vllm)" in out and "slo" in POLICIES


# ---- empty work ---------------------------------------------------------------------------
@pytest.fixture
def header_only_trace(tmp_path: Path) -> Path:
    path = tmp_path / "empty.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    return path


def test_header_only_trace_is_an_error(header_only_trace, capsys):
    line = _one_error_line(capsys, ["simulate", "--trace", str(header_only_trace)])
    assert "no requests in it" in line
    line = _one_error_line(capsys, ["compare", "--workers", "1", "--trace", str(header_only_trace)])
    assert "no requests in it" in line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-requests", "0"], "--max-requests must be >= 1"),
        (["--workload", "multi-turn", "--num-sessions", "0"], "--num-sessions must be >= 1"),
        (["--workload", "shared-prefix", "--num-requests", "0"], "--num-requests must be >= 1"),
    ],
)
def test_empty_workloads_are_errors(argv, message, capsys, tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:10.0,100,10\n")
    argv = [*argv, "--trace", str(trace)] if "--max-requests" in argv else argv
    assert message in _one_error_line(capsys, ["simulate", *argv])


@pytest.fixture(scope="module")
def sim_server(micro_model: Path) -> Iterator[Any]:  # noqa: F811
    with running_server(micro_model, "sim") as running:
        yield running


def test_bench_fails_when_every_request_failed(sim_server, capsys):
    # Prompts longer than the server's context: every request is a 400.
    context = sim_server.engine.max_model_len
    argv = ["bench", "--base-url", sim_server.base_url, "--num-prompts", "3", "--no-progress"]
    argv += ["--random-input-len", str(context + 10), "--random-output-len", "4"]
    line = _one_error_line(capsys, argv)
    assert f"all 3 requests failed: HTTP 400: This model's maximum context length is {context} tokens" in line


# ---- small ones -----------------------------------------------------------------------------
def test_compare_table_wraps_labels_at_commas(capsys, monkeypatch):
    from tailserve.report.tables import wrap_label

    label = "vllm:max_num_batched_tokens=512,max_num_seqs=64,long_prefill_token_threshold=256"
    assert (
        wrap_label(label)
        == "vllm:max_num_batched_tokens=512,max_num_seqs=64,\nlong_prefill_token_threshold=256"
    )
    assert wrap_label("orca") == "orca"
    monkeypatch.setenv("COLUMNS", "160")
    assert main(["compare", "--workers", "1", "--policies", label]) == 0
    out = capsys.readouterr().out
    assert "│ vllm:max_num_batched_tokens=512,max_num_seqs=64, " in out
    assert "│ long_prefill_token_threshold=256 " in out  # whole flags on each line, none cut


def test_hol_on_a_short_context_model_warns(capsys):
    assert main(["simulate", "--model", "Llama-2-7B", "--hardware", "H100-SXM"]) == 0
    err = capsys.readouterr().err
    assert "note: hol's 8,192-token prompt is longer than Llama-2-7B's 4,096-token context" in err
    assert main(["simulate", "--model", "Llama-3.1-8B", "--hardware", "H100-SXM"]) == 0
    assert "longer than" not in capsys.readouterr().err


def test_bench_trace_is_cut_to_the_server_context(sim_server, tmp_path, capsys):
    # A trace recorded on a long-context deployment: the first prompt is longer than the server's
    # whole context. By default it is cut to fit and measured; --no-fit-context sends it as is.
    context = sim_server.engine.max_model_len
    trace = tmp_path / "long.jsonl"
    trace.write_text(
        f'{{"timestamp": 0, "input_length": {context + 100}, "output_length": 4, "hash_ids": [1, 2]}}\n'
        '{"timestamp": 10, "input_length": 20, "output_length": 4, "hash_ids": [3]}\n'
    )
    out = tmp_path / "r.json"
    argv = ["bench", "--base-url", sim_server.base_url, "--no-progress", "--dataset", "trace", str(trace)]
    assert main([*argv, "--request-rate", "50", "--json", str(out)]) == 0
    assert f"note: 1 of 2 trace requests cut to fit the server's {context:,}-token context" in (
        capsys.readouterr().err
    )
    data = json.loads(out.read_text())
    assert data["completed"] == 2 and data["total_input_tokens"] == context - 4 + 20
    line = _one_error_line(capsys, [*argv, "--request-rate", "50", "--no-fit-context", "--num-prompts", "1"])
    assert "all 1 requests failed: HTTP 400" in line
