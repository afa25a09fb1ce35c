"""Speculative decoding on a launch line (``engines/speculative.py``): vLLM's
``--speculative-config`` (JSON or dotted keys), TensorRT-LLM's ``speculative_config``, SGLang's
``--speculative-algorithm``, each with its acceptance from the line or ``--acceptance-length``."""

from __future__ import annotations

import json

import pytest

from tailserve.cli import main
from tailserve.engines.lint import lint
from tailserve.engines.speculative import trtllm_fields, vllm_fields
from tailserve.engines.translate import translate
from tailserve.executors.simulated.deployment import Deployment
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.policies.registry import parse_policy_list
from tailserve.tune.commands import command_line

H200 = get_hardware("h200").device_info
V3 = "vllm serve deepseek-ai/DeepSeek-V3 -tp 8"


def _row(report, name):
    return [row for row in report.rows if row.name == name]


# ---- vLLM's config as the vllm policy's fields ---------------------------------------------------
@pytest.mark.parametrize(
    ("config", "method"),
    [
        ({"method": "mtp", "num_speculative_tokens": 2}, "mtp"),
        ({"method": "deepseek_mtp", "num_speculative_tokens": 1}, "mtp"),  # a deprecated alias
        ({"method": "[ngram]", "num_speculative_tokens": 4, "prompt_lookup_max": 4}, "ngram"),
        ({"model": "ngram", "num_speculative_tokens": 4}, "ngram"),
        ({"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "num_speculative_tokens": 3}, "eagle"),
        ({"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3}, "eagle3"),
        ({"method": "ngram_gpu", "num_speculative_tokens": 3}, "ngram_gpu"),
    ],
)
def test_the_drafter_is_resolved_as_vllm_resolves_it(config, method):
    flags, _ = vllm_fields(json.dumps(config), 2.0)
    assert flags["speculative_method"] == method
    assert flags["num_speculative_tokens"] == config["num_speculative_tokens"]
    assert flags["synthetic_acceptance_length"] == 2.0


def test_what_the_config_leaves_out_is_listed():
    _, ignored = vllm_fields(
        {"model": "yuhuili/EAGLE3-x", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}, 2.0
    )
    assert ignored == ["--speculative-config model, draft_tensor_parallel_size (not modelled)"]
    flags, ignored = vllm_fields({"model": "org/small-draft", "num_speculative_tokens": 3}, 2.0)
    assert flags == {} and "method draft_model: not modelled" in ignored[0]
    flags, ignored = vllm_fields({"method": "suffix"}, None)
    assert flags == {} and "method suffix: not modelled" in ignored[0]


def test_the_acceptance_comes_from_the_synthetic_sampler_or_the_option_once():
    synthetic = {"method": "eagle3", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic"}
    flags, _ = vllm_fields({**synthetic, "synthetic_acceptance_length": 2.2}, None)
    assert flags["synthetic_acceptance_length"] == 2.2
    flags, _ = vllm_fields({**synthetic, "synthetic_acceptance_rates": [0.8, "0.5"]}, None)
    assert flags["synthetic_acceptance_rates"] == (0.8, 0.5)
    with pytest.raises(ValueError, match="give it once"):
        vllm_fields({**synthetic, "synthetic_acceptance_length": 2.2}, 2.0)
    with pytest.raises(ValueError, match="requires exactly one of"):
        vllm_fields(synthetic, 2.0)
    with pytest.raises(ValueError, match="only valid with rejection_sample_method='synthetic'"):
        vllm_fields({"method": "mtp", "num_speculative_tokens": 2, "synthetic_acceptance_length": 2.2}, None)
    with pytest.raises(ValueError, match="needs an acceptance to simulate: give --acceptance-length L"):
        vllm_fields({"method": "mtp", "num_speculative_tokens": 2}, None)


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("{method: mtp}", "--speculative-config is not JSON"),
        ("[1, 2]", "must be a JSON object"),
        ({}, "neither a method nor a model"),
        ({"method": "mtp"}, "without num_speculative_tokens"),
        ({"method": "mtp", "num_speculative_tokens": 0}, "integer >= 1"),
        ({"method": "mtp", "num_speculative_tokens": 2.5}, "integer >= 1"),
        (
            {"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
             "synthetic_acceptance_rates": "0.8"},
            "must be a list of numbers",
        ),
    ],
)  # fmt: skip
def test_a_bad_config_is_one_line(value, needle):
    synthetic = isinstance(value, dict) and "rejection_sample_method" in value
    with pytest.raises(ValueError) as error:
        vllm_fields(value, None if synthetic else 2.0)
    assert needle in str(error.value) and "\n" not in str(error.value)


def test_tunes_vllm_line_reads_back_to_the_same_policy():
    """The line `tune` prints to paste, read back with the acceptance the simulation used, is
    the policy it tuned."""
    spec = parse_policy_list(
        "vllm:async_scheduling=true:speculative_method=eagle3:num_speculative_tokens=3"
        ":synthetic_acceptance_length=2.4:max_num_batched_tokens=2048"
    )[0]
    line = command_line(spec, Deployment("Llama-3-8B", "H200", 1), None, H200, 8192)
    assert line is not None and "synthetic" not in line
    back = translate(lint(line), H200, 2.4)
    assert back.speculates and not back.ignored
    for name in (
        "speculative_method",
        "num_speculative_tokens",
        "synthetic_acceptance_length",
        "async_scheduling",
    ):
        assert back.spec.flags[name] == spec.flags[name]


def test_an_engine_version_whose_policy_has_no_drafts_says_so():
    """vLLM 0.8.5 falls back to its V0 engine for some lines: that policy drafts nothing."""
    line = f'VLLM_USE_V1=0 {V3} --speculative-config \'{{"method": "ngram", "num_speculative_tokens": 3}}\''
    report = lint(line, "0.8.5")
    if report.policy == "vllm":
        pytest.skip("0.8.5 runs this line on V1")
    back = translate(report, H200, 2.0)
    assert not back.speculates
    assert any("--speculative-config (not modelled by tailserve's" in note for note in back.ignored)


# ---- TensorRT-LLM ----------------------------------------------------------------------------------
def test_trtllm_drafts_from_its_options_file(tmp_path):
    options = tmp_path / "extra.yaml"
    options.write_text(
        "speculative_config:\n  decoding_type: MTP\n  num_nextn_predict_layers: 3\n"
        "  use_relaxed_acceptance_for_thinking: true\n"
    )
    report = lint(f"trtllm-serve deepseek-ai/DeepSeek-R1 --tp_size 8 --config {options}")
    with pytest.raises(ValueError, match="TensorRT-LLM has no setting for"):
        translate(report, H200)
    back = translate(report, H200, 2.6)
    assert back.speculates
    assert back.spec.flags["decoding_type"] == "MTP" and back.spec.flags["num_nextn_predict_layers"] == 3
    assert back.spec.flags["synthetic_acceptance_length"] == 2.6
    assert "speculative_config use_relaxed_acceptance_for_thinking (not modelled)" in back.ignored


def test_trtllm_eagle3_and_the_types_it_does_not_model():
    flags, ignored = trtllm_fields(
        {"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model": "x"}, 2.0
    )
    assert flags == {"decoding_type": "Eagle3", "max_draft_len": 3, "synthetic_acceptance_length": 2.0}
    assert ignored == ["speculative_config speculative_model (not modelled)"]
    flags, ignored = trtllm_fields({"decoding_type": "NGram", "max_draft_len": 4}, None)
    assert flags == {} and "decoding_type NGram: not modelled" in ignored[0]
    with pytest.raises(ValueError, match="must be a mapping"):
        trtllm_fields("MTP", 2.0)


def test_tunes_trtllm_line_reads_back_to_the_same_policy(tmp_path, monkeypatch):
    spec = parse_policy_list(
        "trtllm:decoding_type=MTP:num_nextn_predict_layers=2:synthetic_acceptance_length=2.2"
    )[0]
    line = command_line(spec, Deployment.of("DeepSeek-V3", "H200", 8), None, H200, 8192)
    assert line is not None
    monkeypatch.chdir(tmp_path)  # the line writes its options file here first
    import subprocess

    setup, _, serve = line.partition(" && ")
    subprocess.run(setup, shell=True, check=True)
    back = translate(lint(serve), H200, 2.2)
    for name in ("decoding_type", "num_nextn_predict_layers", "synthetic_acceptance_length"):
        assert back.spec.flags[name] == spec.flags[name]


# ---- SGLang ----------------------------------------------------------------------------------------
SGLANG = (
    "python -m sglang.launch_server --model-path deepseek-ai/DeepSeek-V3 --tp 8 --speculative-algorithm NEXTN "
    "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
)


def test_sglang_takes_the_option_or_its_own_variable_once():
    assert translate(lint(SGLANG), H200, 2.6).spec.flags["synthetic_acceptance_length"] == 2.6
    assert (
        translate(lint(f"SGLANG_SIMULATE_ACC_LEN=2.8 {SGLANG}"), H200).spec.flags[
            "synthetic_acceptance_length"
        ]
        == 2.8
    )
    with pytest.raises(ValueError, match="give it once"):
        translate(lint(f"SGLANG_SIMULATE_ACC_LEN=2.8 {SGLANG}"), H200, 2.6)
    with pytest.raises(ValueError, match="--acceptance-length L"):
        translate(lint(SGLANG), H200)


# ---- the CLI ----------------------------------------------------------------------------------------
RUN = ["--hardware", "h200", "--workload", "random", "--num-requests", "12", "--rate", "4", "--input-len", "256",
       "--output-len", "32"]  # fmt: skip


def _main(argv):
    try:
        return main(argv)
    except SystemExit as e:  # argparse's own errors exit from inside parse_known_args
        return e.code


def _summary(tmp_path, capsys, *argv):
    out = tmp_path / "run.json"
    rc = _main(["simulate", *RUN, *argv, "--json", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    run = json.loads(out.read_text())
    return {k: run[k] for k in ("num_finished", "duration_s", "metrics", "throughput", "num_iterations")}, err


def test_simulate_a_speculating_line_as_its_policy(tmp_path, capsys):
    """The launch line with --acceptance-length runs what the equivalent --policy runs."""
    cmd = f"""{V3} --speculative-config '{{"method": "mtp", "num_speculative_tokens": 2}}'"""
    by_line, err = _summary(tmp_path, capsys, "--engine-cmd", cmd, "--acceptance-length", "2.4")
    assert (
        "--policy vllm:speculative_method=mtp,num_speculative_tokens=2,synthetic_acceptance_length=2.4" in err
    )
    by_policy, _ = _summary(
        tmp_path, capsys, "--model", "DeepSeek-V3", "--tp", "8",
        "--policy", "vllm:speculative_method=mtp:num_speculative_tokens=2:synthetic_acceptance_length=2.4",
    )  # fmt: skip
    assert by_line == by_policy
    plain, _ = _summary(tmp_path, capsys, "--engine-cmd", V3)
    assert plain != by_line  # the drafts change the run


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--acceptance-length", "2"], "--acceptance-length reads --engine-cmd"),
        (["--acceptance-length", "0.5", "--engine-cmd", V3], "expected a number >= 1"),
        (["--acceptance-length", "nan", "--engine-cmd", V3], "expected a number >= 1"),
        (["--acceptance-length", "2", "--engine-cmd", V3], "no engine command has drafts tailserve simulates"),
        (["--engine-cmd", f"{V3} --speculative-config.method mtp --speculative-config.num_speculative_tokens 2"],
         "needs an acceptance to simulate"),
    ],
)  # fmt: skip
def test_the_option_misused_is_one_line(capsys, argv, needle):
    rc = _main(["simulate", *RUN, *argv])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err


def test_compare_a_speculating_line_with_a_plain_one(capsys):
    cmd = f"{V3} --speculative-config.method mtp --speculative-config.num_speculative_tokens 1"
    rc = _main(["compare", *RUN, "--acceptance-length", "1.8", "--engine-cmd", cmd, "--engine-cmd", V3])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "speculative_method=mtp" in captured.out and "Traceback" not in captured.err
