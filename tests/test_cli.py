"""The command line: its outputs, its JSON shapes, and one clear line for every bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tailserve.cli import main

RUN_KEYS = {
    "config", "num_requests", "num_finished", "num_rejected", "num_preemptions", "num_iterations",
    "duration_s", "metrics", "throughput",
}  # fmt: skip
STAT_KEYS = {"mean", "p50", "p90", "p99", "max"}


def test_compare_with_no_arguments_prints_table_and_paragraph(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "Llama-3-70B on A100-80GB, TP 4, calibration seed" in out
    for label in (
        "orca",
        "vllm-v0",
        "vllm (default budget 2048)",
        "vllm:max_num_batched_tokens=8192",
        "sarathi",
        "sglang",
        "tgi",
        "trtllm",
    ):
        assert label in out
    assert "TTFT p99" in out and "stall for" in out
    # TensorRT-LLM without chunked prefill: 8,192 prompt tokens + a decode exceed max_num_tokens.
    assert "trtllm never lets the long prompt join the running decodes" in " ".join(out.split())


def test_compare_json_shape(tmp_path, capsys):
    out = tmp_path / "cmp.json"
    assert main(["compare", "--policies", "orca,vllm:max_num_batched_tokens=512", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["label"] for r in data["runs"]] == ["orca", "vllm:max_num_batched_tokens=512"]
    for run in data["runs"]:
        assert set(run) >= RUN_KEYS
        assert set(run["metrics"]) == {"ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s"}
        for m in run["metrics"].values():
            assert set(m) == STAT_KEYS
        assert set(run["throughput"]) >= {"requests_per_s", "output_tokens_per_s"}
    assert data["runs"][1]["config"]["policy_flags"]["max_num_batched_tokens"] == 512


def test_simulate_takes_engine_flag_names_and_writes_json_and_iteration_log(tmp_path, capsys):
    out, log = tmp_path / "run.json", tmp_path / "it.jsonl"
    argv = [
        "simulate", "--model", "Llama-3-8B", "--hardware", "H100-SXM", "--policy", "vllm",
        "--max-num-batched-tokens", "512", "--no-enable-chunked-prefill", "--max-model-len", "8192",
        "--workload", "chat", "--num-requests", "40", "--rate", "5", "--seed", "7",
        "--json", str(out), "--iterations", str(log),
    ]  # fmt: skip
    # 512 < max_model_len with chunking disabled is the engine's own error.
    assert main(argv) == 2
    assert "chunked prefill" in capsys.readouterr().err
    argv.remove("--no-enable-chunked-prefill")
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert set(data) >= RUN_KEYS
    assert data["num_requests"] == 40 and data["num_finished"] == 40
    assert data["config"]["policy_flags"]["max_num_batched_tokens"] == 512
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == data["num_iterations"]
    assert {"start", "duration", "num_prefill_tokens", "num_decode_tokens", "batch_size", "kv_usage"} <= set(
        rows[0]
    )
    assert max(r["num_prefill_tokens"] + r["num_decode_tokens"] for r in rows) <= 512


def test_same_seed_same_json(tmp_path):
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for p in paths:
        argv = ["simulate", "--model", "Mistral-7B", "--hardware", "L40S", "--workload", "random",
                "--input-len", "lognormal:mean=600,sigma=0.7", "--arrival", "gamma:0.5", "--rate", "8",
                "--num-requests", "80", "--seed", "11", "--json", str(p)]  # fmt: skip
        assert main(argv) == 0
    a, b = (json.loads(p.read_text()) for p in paths)
    assert a == b


def test_cost_json(tmp_path):
    out = tmp_path / "cost.json"
    assert (
        main(
            ["cost", "--calibration", "seed", "--prefill", "4096", "--decode", "10x1024", "--json", str(out)]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert set(data) == {"prefill_s", "decode_s", "weight_formats"}
    assert set(data["weight_formats"].values()) == {"bf16"}  # Llama-3-70B as released: every group bf16
    assert data["prefill_s"] == pytest.approx(0.120, rel=0.05)
    assert data["decode_s"] == pytest.approx(0.018, rel=0.05)


def test_trace_replay_with_rate_scale_and_max_requests(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(f"2023-11-16 18:15:{10 + i:02d}.0000000,{300 + 10 * i},{20 + i}\n" for i in range(30))
    )
    out = tmp_path / "r.json"
    argv = ["simulate", "--model", "Llama-3-8B", "--hardware", "H100-SXM", "--trace", str(trace),
            "--rate-scale", "2", "--max-requests", "12", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["num_requests"] == 12 and data["num_finished"] == 12
    assert data["duration_s"] < 11 / 2 + 1.0  # 11 one-second gaps replayed twice as fast


BAD = [
    (["simulate", "--model", "gpt-9"], "unknown model 'gpt-9'; known:"),
    (["simulate", "--hardware", "TPU"], "unknown hardware 'TPU'; known:"),
    (["simulate", "--policy", "fifo"], "unknown policy 'fifo'; known: static, orca, vllm"),
    (
        ["simulate", "--policy", "vllm", "--max-num-batchd-tokens", "4"],
        "unrecognized argument --max-num-batchd-tokens",
    ),
    (["simulate", "--model", "Llama-3-70B", "--hardware", "L4", "--tp", "1"], "does not fit on L4 at TP 1"),
    (["simulate", "--workload", "chat", "--rate", "-3"], "--rate must be > 0"),
    (["compare", "--policies", "orca,vllm:max_num_batched_tokens=lots"], "not a valid int"),
    (["cost", "--decode", "10by1024"], "expected BATCHxCONTEXT"),
    (["simulate", "--calibration", "prefill:4096"], "calibration point"),
    (["simulate", "--trace", "/nonexistent/trace.csv"], "no such trace file"),
    (["simulate", "--model", "Llama-3-70B", "--tp", "3"], "not divisible by --tp 3"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a[1:3]) for a, _ in BAD])
def test_bad_input_is_one_clear_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("tailserve: error:")]
    assert len(errors) == 1 and message in errors[0], err
    assert not any("Traceback" in line for line in err)


def test_malformed_trace_line_names_file_and_line(tmp_path, capsys):
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n{"timestamp": 5\n'
    )
    assert main(["simulate", "--trace", str(trace)]) == 2
    assert f"{trace}:2:" in capsys.readouterr().err


def test_console_script_runs_without_torch():
    code = "import sys, tailserve.cli; sys.exit(tailserve.cli.main(['cost']))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # The simulator never imports torch.
    check = "import sys, tailserve.cli, tailserve.sim.run; print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", check], capture_output=True, text=True).stdout.strip()
        == "False"
    )


def test_cache_aware_sglang_policy_says_it_runs_as_fcfs(capsys):
    assert main(["simulate", "--policy", "sglang", "--schedule-policy", "lpm"]) == 0
    assert "no radix cache yet" in capsys.readouterr().err  # no token identities in hol


def test_policies_command_lists_every_engine_with_device_defaults(capsys):
    assert main(["policies", "--hardware", "H100-SXM"]) == 0
    out = capsys.readouterr().out
    for name in ("static", "orca", "vllm-v0", "vllm", "sarathi", "sglang", "tgi"):
        assert f"│ {name} " in out
    assert "max_num_batched_tokens=8192" in out and "chunked_prefill_size=8192" in out
    assert "waiting_served_ratio=0.3" in out


def test_prefix_workloads_show_the_cache_at_work(tmp_path, capsys):
    out = tmp_path / "pc.json"
    argv = ["compare", "--workload", "multi-turn", "--num-sessions", "12", "--turns", "2:4", "--rate", "1",
            "--model", "Llama-3-8B", "--hardware", "H100-SXM",
            "--policies", "vllm,vllm:enable_prefix_caching=false", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    warm, cold = json.loads(out.read_text())["runs"]
    assert warm["prefix_cache"]["hit_rate_tokens"] > 0.5 and "prefix_cache" not in cold
    assert warm["metrics"]["ttft_s"]["mean"] < cold["metrics"]["ttft_s"]["mean"]
    assert "prefix hit" in capsys.readouterr().out
    assert main(["simulate", "--workload", "multi-turn", "--turns", "5:2"]) == 2
