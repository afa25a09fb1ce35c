"""``--config FILE.yaml`` of vLLM and SGLang (``engines/config_file.py``): the file's keys read as
the engine's flags, before the line's, which win."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tailserve.cli import main
from tailserve.engines.lint import lint
from tailserve.engines.translate import translate
from tailserve.executors.simulated.hardware import get_hardware

H100 = get_hardware("h100").device_info
CONFIG = """\
model: meta-llama/Llama-3.1-8B
max-num-batched-tokens: 4096
max_num_seqs: 128
tensor-parallel-size: 2
enable-prefix-caching: false
async-scheduling: true
speculative-config:
  method: eagle3
  num_speculative_tokens: 3
  rejection_sample_method: synthetic
  synthetic_acceptance_length: 2.4
port: 8001
"""


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(CONFIG)
    return path


def _rows(report):
    return {row.flag: row for row in report.rows}


def test_the_files_keys_are_flags_and_the_line_wins(config):
    report = lint(f"vllm serve --config {config} --max-num-seqs 64")
    assert not report.refused and not report.unread
    rows = _rows(report)
    assert rows["serve.yaml:max-num-batched-tokens"].value == 4096
    assert rows["serve.yaml:max_num_seqs"].verdict == "no-op"
    assert "--max-num-seqs" in rows["serve.yaml:max_num_seqs"].what
    assert report.values["max_num_seqs"] == 64
    assert report.values["enable_prefix_caching"] is False and report.values["async_scheduling"] is True
    assert json.loads(report.values["speculative_config"])["method"] == "eagle3"
    assert report.model == "meta-llama/Llama-3.1-8B"


def test_a_positional_model_wins_over_the_files(config):
    report = lint(f"vllm serve org/other --config {config}")
    assert report.model == "org/other"
    assert _rows(report)["serve.yaml:model"].verdict == "no-op"


def test_the_file_simulates_as_the_same_flags_on_the_line(config):
    by_file = translate(lint(f"vllm serve --config {config} --max-num-seqs 64"), H100)
    line = (
        "vllm serve meta-llama/Llama-3.1-8B --max-num-batched-tokens 4096 --max-num-seqs 64 -tp 2 "
        "--no-enable-prefix-caching --async-scheduling --speculative-config "
        """'{"method": "eagle3", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic", """
        """"synthetic_acceptance_length": 2.4}'"""
    )
    by_line = translate(lint(line), H100)
    assert by_file.spec == by_line.spec and by_file.deployment == by_line.deployment


def test_false_is_the_no_spelling_and_lists_take_their_items(tmp_path):
    path = tmp_path / "c.yml"
    path.write_text("trust-remote-code: false\nallowed-origins: [a, b]\nmax-model-len: 32k\n")
    report = lint(f"vllm serve M --config {path}")
    assert not report.refused
    rows = _rows(report)
    assert rows["c.yml:trust-remote-code"].value is False  # read as --no-trust-remote-code
    assert rows["c.yml:allowed-origins"].value == "a"  # the rest are its items (one row: the flag)
    assert report.values["max_model_len"] == 32000


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        ("c.json", "{}", "reads a .yaml or .yml file"),
        ("c.yaml", "- a\n- b\n", "not a mapping of the engine's flags"),
        ("c.yaml", "a: [1,\n", "not YAML"),
        ("c.yaml", "max-num-seqs: lots\n", "is not a valid int"),
    ],
)
def test_a_bad_file_is_one_line(tmp_path, name, text, needle):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as error:
        lint(f"vllm serve M --config {path}")
    assert needle in str(error.value) and "\n" not in str(error.value)


def test_a_missing_file_is_a_warning_in_lint_and_stops_a_simulation(tmp_path, capsys):
    missing = tmp_path / "nothere.yaml"
    report = lint(f"vllm serve M --config {missing}")
    assert report.unread == (str(missing),) and not report.refused
    assert _rows(report)["--config"].what.startswith("warning:")
    with pytest.raises(ValueError, match="is not there"):
        translate(report, H100)
    rc = main(["simulate", "--hardware", "h100", "--engine-cmd", f"vllm serve M --config {missing}"])
    assert rc == 2 and "is not there" in capsys.readouterr().err


def test_an_unknown_key_is_what_vllm_refuses(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max-num-seqz: 8\n")
    report = lint(f"vllm serve M --config {path}")
    assert report.refused
    assert "did you mean --max-num-seqs?" in _rows(report)["c.yaml:max-num-seqz"].what


def test_sglang_reads_its_file_the_same_way(tmp_path):
    path = tmp_path / "sglang.yaml"
    path.write_text(
        "model-path: deepseek-ai/DeepSeek-V3\ntp-size: 8\nchunked-prefill-size: 4096\n"
        "enable-mixed-chunk: true\ndisable-overlap-schedule: false\nmax-running-requests: 256\n"
    )
    line = "python -m sglang.launch_server --config {} --max-running-requests 128"
    report = lint(line.format(path))
    assert not report.refused and report.model == "deepseek-ai/DeepSeek-V3"
    assert report.values["chunked_prefill_size"] == 4096 and report.values["enable_mixed_chunk"] is True
    assert "disable_overlap_schedule" not in report.values  # a store_true switch set false: nothing
    assert report.values["max_running_requests"] == 128
    by_file = translate(report, H100)
    by_line = translate(
        lint(
            "python -m sglang.launch_server --model-path deepseek-ai/DeepSeek-V3 --tp-size 8 "
            "--chunked-prefill-size 4096 --enable-mixed-chunk --max-running-requests 128"
        ),
        H100,
    )
    assert by_file.spec == by_line.spec and by_file.deployment == by_line.deployment
    path.write_text("tp_size: 8\n")  # SGLang's parser takes dashes only
    assert lint(line.format(path)).refused


def test_vllm_085_reads_only_true_switches_from_its_file(tmp_path):
    """0.8.5's flat reader (vllm/utils.py ``_load_config_file``) adds ``--key`` for true and
    nothing for false: a false switch in the file is a silent no-op of the engine, said so."""
    path = tmp_path / "c.yaml"
    path.write_text("max-num-seqs: 64\nenable-chunked-prefill: false\nenable-prefix-caching: true\n")
    report = lint(f"vllm serve M --config {path}", "0.8.5")
    assert not report.refused
    rows = _rows(report)
    assert rows["c.yaml:enable-chunked-prefill"].verdict == "no-op"
    assert "reads only true switches" in rows["c.yaml:enable-chunked-prefill"].what
    assert "enable_chunked_prefill" not in report.values  # the default stays
    assert report.values["max_num_seqs"] == 64 and report.values["enable_prefix_caching"] is True
