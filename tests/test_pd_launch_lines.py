"""A P/D pair from two launch lines (``simulate --prefill-engine-cmd L1 --decode-engine-cmd L2``
with ``--prefill-replicas`` / ``--decode-replicas``): each side's policy, flags and TP."""

from __future__ import annotations

import json

import pytest

from tailserve.cli import main

RUN = ["simulate", "--hardware", "H100-SXM", "--workload", "random", "--num-requests", "16", "--rate", "6",
       "--input-len", "300", "--output-len", "12"]  # fmt: skip
CONNECTOR = """ --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'"""
PREFILL = "vllm serve meta-llama/Llama-3.1-8B --max-num-batched-tokens 4096" + CONNECTOR
DECODE = "vllm serve meta-llama/Llama-3.1-8B --max-num-seqs 64" + CONNECTOR


def _main(argv):
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_the_pair_runs_each_sides_line_as_the_flags_typed_by_hand(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    pd = ["--prefill-replicas", "1", "--decode-replicas", "2"]
    rc = _main([*RUN, *pd, "--prefill-engine-cmd", PREFILL, "--decode-engine-cmd", DECODE, "--json", str(a)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "prefill engine command: vLLM 0.32.0: --policy vllm:max_num_batched_tokens=4096" in err
    assert "decode engine command: vLLM 0.32.0: --policy vllm:max_num_seqs=64" in err
    assert "kv-transfer-config" not in err  # what the pair itself stands for, not "not simulated"
    by_hand = [*RUN, "--model", "Llama-3.1-8B", *pd, "--prefill-policy", "vllm:max_num_batched_tokens=4096",
               "--decode-policy", "vllm:max_num_seqs=64", "--json", str(b)]  # fmt: skip
    assert _main(by_hand) == 0
    capsys.readouterr()
    ra, rb = json.loads(a.read_text()), json.loads(b.read_text())
    assert ra["metrics"] == rb["metrics"] and ra["label"] == rb["label"]


def test_the_sides_may_differ_in_tp(capsys):
    pd = ["--prefill-replicas", "1", "--decode-replicas", "1"]
    rc = _main([*RUN, *pd, "--prefill-engine-cmd", PREFILL, "--decode-engine-cmd", DECODE + " -tp 2"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "H100-SXM:tp1/tp2" in out.out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--prefill-replicas", "1", "--decode-replicas", "1", "--prefill-engine-cmd", PREFILL], "go together"),
        (["--prefill-engine-cmd", PREFILL, "--decode-engine-cmd", DECODE], "need --prefill-replicas and --decode-replicas"),
        (["--prefill-replicas", "1", "--decode-replicas", "1", "--prefill-engine-cmd", PREFILL, "--decode-engine-cmd",
          DECODE, "--engine-cmd", PREFILL], "--engine-cmd runs one engine"),
        (["--prefill-replicas", "1", "--decode-replicas", "1", "--prefill-engine-cmd", PREFILL, "--decode-engine-cmd",
          DECODE, "--prefill-policy", "sarathi"], "set the same policy: give one"),
        (["--prefill-replicas", "1", "--decode-replicas", "1", "--prefill-engine-cmd", PREFILL, "--decode-engine-cmd",
          "vllm serve meta-llama/Llama-3.1-70B -tp 4"], "serve different models"),
    ],
)  # fmt: skip
def test_a_pair_that_cannot_run_is_one_line(capsys, argv, needle):
    rc = _main([*RUN, *argv])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err


def test_a_sides_other_unsimulated_flags_are_still_said(capsys):
    pd = ["--prefill-replicas", "1", "--decode-replicas", "1"]
    rc = _main(
        [*RUN, *pd, "--prefill-engine-cmd", PREFILL, "--decode-engine-cmd", DECODE + " --enforce-eager"]
    )
    err = capsys.readouterr().err
    assert rc == 0, err
    decode_line = next(line for line in err.splitlines() if line.startswith("decode engine command"))
    assert decode_line.endswith("; not simulated: --enforce-eager (not modelled)")


def test_an_sglang_pair_from_its_two_lines(tmp_path, capsys):
    """SGLang's own pair (cluster/sglang_pd.py): the decode line's server flags reach its
    decode server, and the lines run as the same flags typed by hand."""
    line = "python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B"
    prefill = line + " --disaggregation-mode prefill"
    decode = line + " --disaggregation-mode decode --num-reserved-decode-tokens 128"
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    pd = ["--prefill-replicas", "1", "--decode-replicas", "1"]
    rc = _main([*RUN, *pd, "--prefill-engine-cmd", prefill, "--decode-engine-cmd", decode, "--json", str(a)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "--policy sglang:num_reserved_decode_tokens=128" in err
    assert "disaggregation-mode" not in err
    by_hand = [*RUN, "--model", "Llama-3.1-8B", *pd, "--prefill-policy", "sglang",
               "--decode-policy", "sglang:num_reserved_decode_tokens=128", "--json", str(b)]  # fmt: skip
    assert _main(by_hand) == 0
    capsys.readouterr()
    ra, rb = json.loads(a.read_text()), json.loads(b.read_text())
    assert ra["metrics"] == rb["metrics"]
    assert ra["metrics"]["ttft_s"]["p99"] > 0
