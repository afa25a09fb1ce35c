"""Bad values a user types get one error line naming the value, exit 2, before any work: never a
traceback, an error about a different flag, or a silent default (the QA audit's findings)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from server_helpers import MICRO
from tailserve.cli import main
from tailserve.executors.pytorch.init_model import init_model
from tailserve.llm.engine_args import EngineArgs
from test_cli_errors import _one_error_line

DEPLOYMENT = ["--model", "Llama-3-8B", "--hardware", "H100-SXM", "--tp", "1"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # A block size of 0 divided by zero in the KV sizing (a ZeroDivisionError traceback).
        (["simulate", *DEPLOYMENT, "--block-size", "0"], "block_size must be >= 1 token, got 0"),
        (["simulate", *DEPLOYMENT, "--policy", "vllm-v0", "--block-size", "0"], "block_size must be >= 1"),
        (
            ["compare", *DEPLOYMENT, "--workers", "1", "--policies", "vllm:block_size=0"],
            "block_size must be >= 1",
        ),
        # A context of 0 or less shrank the default budget: the error named max_num_batched_tokens.
        (["simulate", *DEPLOYMENT, "--max-model-len", "0"], "max_model_len must be >= 1 token, got 0"),
        (["simulate", *DEPLOYMENT, "--max-model-len", "-1"], "max_model_len must be >= 1 token, got -1"),
        # vLLM's default budget is derived from max_num_seqs: 0 was reported as the budget.
        (["simulate", *DEPLOYMENT, "--max-num-seqs", "0"], "max_num_seqs must be >= 1, got 0"),
        (["policies", "--max-model-len", "0"], "--max-model-len must be >= 1 token, got 0"),
        # An explicit empty policy list: an IndexError in compare's paragraph; tune ran its default.
        (["compare", *DEPLOYMENT, "--workers", "1", "--policies", ""], "no policy in ''"),
        (["tune", *DEPLOYMENT, "--workers", "1", "--workload", "chat", "--policies", ""], "no policy in ''"),
    ],
)
def test_bad_engine_values_name_themselves(argv, message, capsys):
    assert message in _one_error_line(capsys, argv)


@pytest.fixture(scope="module")
def micro_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "micro", preset="tiny", dtype="float32", **MICRO)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        # 0 read as "unset": run generated with the model's context, serve started.
        (["--max-model-len", "0"], "max_model_len must be >= 1 token, got 0"),
        (["--block-size", "0"], "block_size must be >= 1 token, got 0"),
        # NaN passed the <= 0 check and failed later as "cannot convert float NaN to integer".
        (["--kv-cache-memory-gib", "nan"], "kv_cache_memory_gib must be positive, got nan"),
    ],
)
def test_run_refuses_bad_engine_values(flags, message, micro_dir, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    argv = [
        "run",
        "--model",
        str(micro_dir),
        "--prompts",
        str(prompts),
        "--threads",
        "1",
        "--max-tokens",
        "2",
    ]
    assert message in _one_error_line(capsys, [*argv, *flags])


def test_engine_args_refuse_a_zero_context():
    with pytest.raises(ValueError, match="max_model_len must be >= 1 token, got 0"):
        EngineArgs(max_model_len=0)
    assert EngineArgs(max_model_len=None).max_model_len is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # A prefill of 0 or -5 tokens, or a negative cached context, was priced and printed, exit 0.
        (["cost", *DEPLOYMENT, "--prefill", "0"], "--prefill must be >= 1 token, got 0"),
        (["cost", *DEPLOYMENT, "--prefill", "-5"], "--prefill must be >= 1 token, got -5"),
        (["cost", *DEPLOYMENT, "--prefill-context", "-1"], "--prefill-context must be >= 0 tokens, got -1"),
        # NaN passed the >= 0 check: "No inter-token gap exceeded nan ms", exit 0.
        (["simulate", *DEPLOYMENT, "--explain", "--tbt-threshold", "nan"], "--tbt-threshold must be >= 0 ms"),
    ],
)
def test_bad_counts_are_refused_before_any_output(argv, message, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err  # no table first
    assert message in err and err.count("error:") == 1


def test_cost_checks_swap_before_printing_the_table(capsys):
    assert main(["cost", *DEPLOYMENT, "--swap", "-1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "tailserve: error: --swap must be >= 1 token, got -1" in err


def _trace(tmp_path: Path, *prompt_lens: int) -> str:
    rows = [f"2023-11-16 18:15:{10 + i}.0,{n},10" for i, n in enumerate(prompt_lens)]
    path = tmp_path / "t.csv"
    path.write_text("\n".join(["TIMESTAMP,ContextTokens,GeneratedTokens", *rows]) + "\n")
    return str(path)


@pytest.mark.parametrize("command", ["simulate", "compare"])
def test_a_trace_longer_than_the_context_everywhere_is_an_error(command, tmp_path, capsys):
    # Every prompt is longer than Llama-3-8B's 8,192 tokens: a table of dashes and exit 0 before.
    argv = [command, *DEPLOYMENT, "--trace", _trace(tmp_path, 200_000, 9_000)]
    argv += ["--workers", "1", "--policies", "vllm,sglang"] if command == "compare" else []
    line = _one_error_line(capsys, argv)
    assert "all 2 requests were rejected, nothing was served" in line
    assert "trace-0: This model's maximum context length is 8192 tokens" in line


def test_rejected_requests_are_said_with_the_reason(tmp_path, capsys):
    # One of two rejected: counted in done/rej as before, and now a note says why.
    assert main(["simulate", *DEPLOYMENT, "--trace", _trace(tmp_path, 200_000, 100)]) == 0
    out, err = capsys.readouterr()
    assert "1/1" in out
    assert "1 of 2 requests rejected (e.g. trace-0: This model's maximum context length is 8192" in err


@pytest.mark.parametrize(
    "flags", [["--plan-tps", "1,2"], ["--plan-policy", "sglang"], ["--plan-ep", "on"], ["--plan-dp", "2"]]
)
def test_tune_plan_options_need_a_gpu_budget(flags, capsys):
    # Without --gpus tune sweeps one replica: the --plan-* options were silently ignored.
    argv = ["tune", *DEPLOYMENT, "--workers", "1", "--workload", "chat", *flags]
    assert f"{flags[0]} plans a GPU budget: it needs --gpus N" in _one_error_line(capsys, argv)


def test_a_workload_larger_than_memory_is_refused_before_it_is_made(capsys):
    from tailserve.cli.options import check_workload_memory
    from tailserve.sim.workload_spec import WorkloadSpec

    # --num-requests 1e9 was killed by the OOM killer (exit 137, no message) while the requests
    # were made; now the estimate is compared with the memory available first.
    with pytest.raises(Exception, match=r"--num-requests 10,000,000: .* more than the 1.0 GiB available"):
        check_workload_memory(WorkloadSpec(name="random", num_requests=10_000_000), available=2**30)
    check_workload_memory(WorkloadSpec(name="random", num_requests=10_000_000), available=64 * 2**30)
    check_workload_memory(WorkloadSpec(name="random", num_requests=1000), available=1)  # small: not read
    with pytest.raises(Exception, match="--num-sessions 10,000,000"):
        check_workload_memory(WorkloadSpec(name="multi-turn", num_sessions=10_000_000), available=2**30)
    # No machine holds 10^12 requests (~500 TB): refused in one line, whatever this host has.
    line = _one_error_line(
        capsys, ["simulate", *DEPLOYMENT, "--workload", "random", "--num-requests", str(10**12)]
    )
    assert "--num-requests 1,000,000,000,000: its requests alone need" in line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # numpy's "expected non-negative integer", naming no flag.
        (
            ["compare", *DEPLOYMENT, "--workers", "1", "--workload", "chat", "--seed", "-1"],
            "--seed must be >= 0, got -1",
        ),
        # numpy's "Total of weights must be finite", naming no flag.
        (
            ["simulate", *DEPLOYMENT, "--workload", "chat", "--priorities", "0=nan"],
            "--priorities item '0=nan'",
        ),
        # NaN passed the >= 0 check and ran the cluster.
        (
            ["simulate", *DEPLOYMENT, "--replicas", "2", "--scrape-interval", "nan"],
            "scrape_interval must be >= 0 seconds, got nan",
        ),
    ],
)
def test_nan_and_negative_values_name_their_flag(argv, message, capsys):
    assert message in _one_error_line(capsys, argv)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        # Dropped before: every prompt ran with --max-tokens instead, exit 0.
        ('{"prompt": "a", "max_tokens": 3}', "p.jsonl:1: unknown key(s) 'max_tokens'"),
        ('{"prompt": "a", "temperature": 0.7}', "p.jsonl:1: unknown key(s) 'temperature'"),
        # Both given: the text won silently.
        ('{"prompt": "a", "prompt_token_ids": [1, 2]}', "p.jsonl:1: both 'prompt' and 'prompt_token_ids'"),
    ],
)
def test_run_refuses_prompt_file_keys_it_does_not_read(line, message, tmp_path):
    from tailserve.cli.run import PromptFileError, load_prompts

    path = tmp_path / "p.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(PromptFileError, match=re.escape(message)):
        load_prompts(path)
    path.write_text('{"prompt": "a"}\n{"prompt_token_ids": [1, 2]}\n')
    assert load_prompts(path) == ["a", [1, 2]]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # Each was found only after the work, when the file was written (the table printed first).
        (["simulate", *DEPLOYMENT, "--json", "{missing}/x.json"], "--json {missing}/x.json: no folder"),
        (
            ["simulate", *DEPLOYMENT, "--save-run", "{missing}/x.json"],
            "--save-run {missing}/x.json: no folder",
        ),
        (["simulate", *DEPLOYMENT, "--iterations", "{tmp}"], "--iterations {tmp}: is a directory"),
        (["cost", *DEPLOYMENT, "--json", "{missing}/x.json"], "--json {missing}/x.json: no folder"),
    ],
)
def test_output_files_are_checked_before_any_work(argv, message, tmp_path, capsys):
    fill = {"missing": str(tmp_path / "missing"), "tmp": str(tmp_path)}
    assert main([a.format(**fill) for a in argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message.format(**fill) in err and err.count("error:") == 1
    assert not (tmp_path / "missing").exists()  # nothing created


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # Probe options of --from-server were silently ignored by the other sources.
        (["calibrate", "prefill:4096=0.1", "--decode", "1x2"], "--decode is read with --from-server only"),
        (
            ["calibrate", "--from-trace", "t.jsonl", "--prefill", "5"],
            "--prefill is read with --from-server only",
        ),
        (
            ["calibrate", "--from-server", "http://x", "--no-prefix-caching"],
            "--no-prefix-caching is read with --from-trace",
        ),
    ],
)
def test_calibrate_refuses_options_its_source_ignores(argv, message, capsys):
    assert message in _one_error_line(capsys, argv)


def test_calibrate_torch_says_when_the_context_is_too_short(micro_dir, capsys):
    # A 512-token context: the grid's 512-token chunk rounded its prompt down to 0 tokens, and
    # the engine's "The prompt is empty" was the only message.
    argv = ["calibrate", "--executor", "torch", "--model", str(micro_dir), "--out", str(micro_dir / "c.json")]
    assert "context is too short for the profiling grid" in _one_error_line(capsys, argv)


@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_static", "fp32"])
def test_a_weights_only_format_is_not_a_kv_cache_format(capsys, fmt):
    line = _one_error_line(capsys, ["simulate", *DEPLOYMENT, "--kv-cache-dtype", fmt, "--workload", "hol"])
    assert f"--kv-cache-dtype {fmt}: not a KV cache format the engines store" in line


@pytest.mark.parametrize("fmt", ["fp8", "fp8_e5m2", "nvfp4", "int8", "bf16"])
def test_the_engines_kv_formats_are_taken(fmt):
    from tailserve.executors.simulated.deployment import Deployment

    assert Deployment.of("Llama-3-8B", "H100", 1, kv_cache_dtype=fmt).kv_cache_dtype


@pytest.mark.parametrize(
    ("command", "where", "message"),
    [
        # A file above the folder: the whole run was simulated before write_report failed.
        ("compare", "{file}/sub", "--report {file}/sub: '{file}' is a file, not a folder to write it in"),
        ("compare", "{file}", "--report {file}: exists and is not a directory"),
        ("simulate", "{file}/a/b", "--report {file}/a/b: '{file}' is a file"),
        ("tune", "{file}/sub", "--report {file}/sub: '{file}' is a file"),
    ],
)
def test_the_report_folder_is_checked_before_any_work(command, where, message, tmp_path, capsys):
    file = tmp_path / "f"
    file.write_text("")
    argv = [command, *DEPLOYMENT, "--workload", "chat", "--report", where.format(file=file)]
    argv += ["--workers", "1"] if command != "simulate" else []
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and message.format(file=file) in err and err.count("\n") == 1


def test_a_missing_report_folder_is_still_made(tmp_path):
    from tailserve.cli.base import check_report_dir

    check_report_dir(str(tmp_path / "a" / "b"))  # write_report creates it with its parents
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("command", ["tune", "compare"])
def test_a_bad_worker_count_is_the_only_line(command, capsys):
    # tune printed its "results: FILE (...)" line, then the error.
    assert main([command, *DEPLOYMENT, "--workload", "chat", "--workers", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "tailserve: error: --workers must be >= 1, got 0\n"


@pytest.mark.parametrize(
    ("available", "count", "message"),
    [
        # It said "device 'cuda' was asked for": not the cuda:7 typed.
        (False, 0, "--device 'cuda:7' was asked for but torch.cuda.is_available() is False"),
        (True, 1, "--device 'cuda:7': this machine has 1 cuda device(s)"),
    ],
)
def test_an_absent_gpu_is_named_as_given(available, count, message, monkeypatch, tmp_path):
    import torch

    from tailserve.assemble.pytorch import torch_parts
    from tailserve.policies.registry import PolicySpec

    # No real GPU is read: the check comes before anything is loaded (tmp_path holds no model).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    with pytest.raises(ValueError, match=re.escape(message)):
        torch_parts(
            tmp_path,
            PolicySpec("vllm"),
            dtype="auto",
            device="cuda:7",
            seed=0,
            max_model_len=None,
            kv_cache_memory_gib=None,
            eos_token_ids=(),
        )


def test_rejections_are_counted_by_their_reason(tmp_path, capsys):
    # SGLang refuses trace-1 (1,989 + 10 tokens) at admission, as its 2,000 KV slots are too few;
    # the paragraph called it "longer than max_model_len" with the two that are.
    policies = "sglang:max_total_tokens=2000:max_model_len=2000,vllm:max_model_len=2000"
    argv = ["compare", *DEPLOYMENT, "--workers", "1", "--policies", policies]
    assert main([*argv, "--trace", _trace(tmp_path, 9_000, 1_989, 100, 1_995)]) == 0
    out, err = capsys.readouterr()
    text = " ".join(out.split())  # the paragraph is wrapped
    assert "max_model_len=2000 3 (2 longer than max_model_len, 1 too large for the KV cache)" in text
    assert "(default budget 8192) 2 (longer than max_model_len)." in text
    assert "3 of 4 requests rejected: 2 longer than max_model_len (e.g. trace-0: " in err
    assert "; 1 too large for the KV cache (e.g. trace-1: prompt 1989 + max_tokens 10" in err


def test_lint_json_before_the_line_reads_the_line(tmp_path, capsys):
    import json

    # --json's optional OUT took the line: "the following arguments are required: COMMAND".
    line = "vllm serve /models/llama --max-num-seqs 4"
    assert main(["lint", "--json", line]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "/models/llama"
    out = tmp_path / "l.json"
    assert main(["lint", "--json", str(out), line]) == 0  # OUT, then the line: written to OUT
    assert json.loads(out.read_text())["model"] == "/models/llama"
    assert "no launch line: tailserve lint" in _one_error_line(capsys, ["lint", "--json"])
    assert "no launch line: tailserve lint" in _one_error_line(capsys, ["lint"])


def test_each_rejection_kind_matches_its_rejecters_message():
    """``rejection_kind`` matches the reason texts the rejecters write: a reworded message would
    fall into "other reason" silently, so the texts are looked up where they are written."""
    import inspect
    import re

    from tailserve.core import scheduler
    from tailserve.policies import sglang, sglang_load, slo_admit, tgi, trtllm, vllm_admission
    from tailserve.sim.run_file import REJECTION_KINDS

    modules = (scheduler, sglang, sglang_load, slo_admit, tgi, trtllm, vllm_admission)
    sources = " ".join(inspect.getsource(m) for m in modules)
    # the message is written across adjacent string literals: compare with them joined
    joined = re.sub(r'"\s*\n\s*f?"', "", sources)
    for text, kind in REJECTION_KINDS:
        assert text in joined, f"{kind!r}: no rejecter writes {text!r} any more"
