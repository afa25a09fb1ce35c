"""Every CLI input is bounded (issue 30, item 6): a hostile or broken trace or model config is one
error line and exit status 2, never a traceback, an overflow deep in the simulator, a 4 TB
allocation or a silently accepted NaN; and a trace is read only as far as ``--max-requests``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tailserve.cli import main
from tailserve.executors.pytorch.init_model import init_model
from tailserve.executors.pytorch.loader import ModelLoadError, load_config
from tailserve.workloads import traces
from tailserve.workloads.traces import load_trace

ROW = '{"arrival_time": 0, "prompt_len": 10, "max_tokens": 5}\n'
AZURE_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,10,5\n"


def _one_error_line(capsys: Any, argv: list[str]) -> str:
    """Exit status 2 and exactly one ``error:`` line, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    assert len(lines[0]) < 400, lines[0]  # a bad value is shown cut short
    return lines[0]


def _simulate(trace: Path, *extra: str) -> list[str]:
    return ["simulate", "--model", "Llama-3-8B", "--trace", str(trace), *extra]


# ---- traces ---------------------------------------------------------------------------------
TRACES = {
    # core/decode_run.py:72 (now executors/simulated/decode_run.py) overflowed converting an infinite gap to an int
    "arrival_time 1e308": (ROW + '{"arrival_time": 1e308, "prompt_len": 10, "max_tokens": 5}\n', ":2: arrival_time must be <="),
    # beyond 2^32 s a float loses the microseconds and the simulator's numbers go wrong silently
    "arrival_time 1e15": (ROW + '{"arrival_time": 1e15, "prompt_len": 10, "max_tokens": 5}\n', ":2: arrival_time must be <="),
    "mooncake timestamp 1e20 ms": (
        '{"timestamp": 0, "input_length": 10, "output_length": 5}\n'
        '{"timestamp": 1e20, "input_length": 10, "output_length": 5}\n',
        ":2: timestamp must be <=",
    ),
    "an integer too big for a float": (
        ROW + '{"arrival_time": ' + "9" * 400 + ', "prompt_len": 10, "max_tokens": 5}\n',
        ":2: arrival_time must be <=",
    ),
    "an integer of 5000 digits": (ROW + '{"arrival_time": ' + "9" * 5000 + "}\n", ":2: invalid JSON"),
    "a line nested 100,000 deep": (
        ROW + '{"arrival_time": 1, "prompt_len": 10, "max_tokens": 5, "tenant_id": '
        + "[" * 100_000 + "]" * 100_000 + "}\n",
        ":2: invalid JSON (nested too deeply)",
    ),
    "a first line nested 100,000 deep": ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}\n", ":1: invalid JSON (nested too deeply)"),
    "prompt_len 10**30": ('{"arrival_time": 0, "prompt_len": ' + str(10**30) + ', "max_tokens": 5}\n', ":1: prompt_len must be <= 16,777,216"),
    "priority 2**70": ('{"arrival_time": 0, "prompt_len": 1, "max_tokens": 5, "priority": ' + str(2**70) + "}\n", ":1: priority must be a 64-bit integer"),
    "not UTF-8 on line 3": (ROW + ROW + '{"arrival_time": 0, "tenant_id": "\xff"}\n', ":3: not UTF-8 text"),
    "a CSV field over 131,072 characters": (AZURE_HEAD + "2023-11-16 18:15:47.0,10," + "5" * 200_000 + "\n", ":3: malformed CSV (field larger than field limit"),
    "a quoted CSV field over 131,072 characters": (AZURE_HEAD + '2023-11-16 18:15:47.0,10,"' + "x" * 200_000 + '"\n', ":3: malformed CSV"),
    "Azure rows 8,000 years apart": (AZURE_HEAD + "9999-11-16 18:15:47.0,10,5\n", ":3: timestamp is"),
    "Azure token count of 100 digits": (AZURE_HEAD + "2023-11-16 18:15:47.0,10," + "9" * 100 + "\n", ":3: GeneratedTokens must be <= 16,777,216"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(TRACES))
def test_a_hostile_trace_is_one_line_naming_file_and_line(case: str, tmp_path: Path, capsys: Any) -> None:
    text, message = TRACES[case]
    path = tmp_path / ("t.csv" if text.startswith("TIMESTAMP") else "t.jsonl")
    path.write_bytes(text.encode("latin-1") if "\xff" in text else text.encode())
    line = _one_error_line(capsys, _simulate(path))
    assert f"{path}{message}" in line


def test_a_line_longer_than_the_limit_is_refused_without_reading_it_whole(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(traces, "MAX_LINE_BYTES", 4096)
    monkeypatch.setattr(traces, "_READ_BYTES", 1024)
    path = tmp_path / "t.jsonl"
    path.write_text(ROW + '{"arrival_time": 1, "tenant_id": "' + "x" * 100_000 + '"}\n')
    assert f"{path}:2: line is longer than 4,096 bytes" in _one_error_line(capsys, _simulate(path))


def test_rate_scale_that_stretches_arrivals_past_the_limit(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(ROW + '{"arrival_time": 10, "prompt_len": 10, "max_tokens": 5}\n')
    line = _one_error_line(capsys, _simulate(path, "--rate-scale", "1e-300"))
    assert "rate_scale 1e-300 puts trace-1 at 1e+301 s" in line
    with pytest.raises(ValueError, match="beyond"):
        load_trace(path, rate_scale=1e-300)


def test_arrival_times_up_to_the_limit_still_load(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    # Unix-epoch seconds (1.7e9) stay well inside the 2^32 s bound.
    path.write_text('{"arrival_time": 1700000000.123456, "prompt_len": 10, "max_tokens": 5}\n')
    assert load_trace(path)[0].arrival_time == 1700000000.123456
    path.write_text(f'{{"arrival_time": {2**32}, "prompt_len": 10, "max_tokens": 5}}\n')
    assert load_trace(path)[0].arrival_time == 2.0**32


def test_max_requests_reads_no_further_than_it_needs(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "t.jsonl"
    # Three good rows, then 10 MB that is not a trace at all (and not even one line): reading it
    # whole, as before, took it as line 4 and failed; a lazy reader never gets there.
    path.write_bytes((ROW * 3).encode() + b"x" * 10_000_000)
    assert main(_simulate(path, "--max-requests", "3")) == 0
    assert "3/0" in capsys.readouterr().out  # 3 finished, 0 dropped
    requests = load_trace(path, max_requests=3)
    assert [r.request_id for r in requests] == ["trace-0", "trace-1", "trace-2"]
    # Without the limit the whole file is read, and its fourth "line" is refused, named.
    assert f"{path}:4: line is longer than" in _one_error_line(capsys, _simulate(path))


# ---- model config.json ----------------------------------------------------------------------
BASE_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "dtype": "float32",
}
CONFIGS = {
    # tried to allocate a 4 TB RoPE table
    "max_position_embeddings 10**12": ({"max_position_embeddings": 10**12}, "'max_position_embeddings' must be at most 4,194,304"),
    # looped a billion times building the expected tensor names
    "num_hidden_layers 10**9": ({"num_hidden_layers": 10**9}, "'num_hidden_layers' must be at most 1,024"),
    "vocab_size 10**12": ({"vocab_size": 10**12}, "'vocab_size' must be at most"),
    "head_dim 10**6": ({"head_dim": 10**6}, "'head_dim' must be at most 1,024"),
    # accepted silently: every norm of the model then returned NaN
    "rms_norm_eps NaN": ({"rms_norm_eps": math.nan}, "'rms_norm_eps' must be a finite number > 0 below 1, got nan"),
    "rms_norm_eps Infinity": ({"rms_norm_eps": math.inf}, "'rms_norm_eps' must be a finite number"),
    "rms_norm_eps 5": ({"rms_norm_eps": 5.0}, "below 1"),
    "rope_theta Infinity": ({"rope_theta": math.inf}, "'rope_theta' must be a finite number > 0"),
    "rope_theta NaN in rope_parameters": ({"rope_parameters": {"rope_type": "default", "rope_theta": math.nan}}, "'rope_parameters.rope_theta' must be a finite"),
    # a KeyError traceback when the model was built
    "llama3 RoPE without factor": ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "'rope_parameters.factor' is missing"),
    "linear RoPE factor NaN": ({"rope_scaling": {"type": "linear", "factor": math.nan}}, "'rope_scaling.factor' must be a finite number"),
    "llama3 RoPE with low >= high": (
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}},
        "low_freq_factor < high_freq_factor",
    ),
    "llama3 original_max_position_embeddings 10**15": (
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 10**15}},
        "'rope_scaling.original_max_position_embeddings' must be at most",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CONFIGS))
def test_a_config_out_of_bounds_is_refused_naming_the_key(case: str, tmp_path: Path) -> None:
    change, message = CONFIGS[case]
    (tmp_path / "config.json").write_text(
        json.dumps({**BASE_CONFIG, **change})
    )  # NaN, Infinity as Python writes them
    with pytest.raises(
        ModelLoadError, match="^" + str(tmp_path / "config.json").replace(".", r"\.")
    ) as error:
        load_config(tmp_path)
    assert message in str(error.value)
    assert len(str(error.value)) < 300


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "not readable JSON (nested too deeply)"),
        ('{"vocab_size": ' + "9" * 5000 + "}", "not readable JSON (Exceeds the limit"),
    ],
    ids=["nested 100,000 deep", "an integer of 5000 digits"],
)
def test_a_hostile_config_file_is_not_readable_json(text: str, message: str, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ModelLoadError) as error:
        load_config(tmp_path)
    assert message in str(error.value)


def test_real_model_sizes_stay_accepted(tmp_path: Path) -> None:
    llama_3_1_405b = {
        "vocab_size": 128256,
        "hidden_size": 16384,
        "intermediate_size": 53248,
        "num_hidden_layers": 126,
        "num_attention_heads": 128,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    (tmp_path / "config.json").write_text(json.dumps({**BASE_CONFIG, **llama_3_1_405b}))
    assert load_config(tmp_path).num_hidden_layers == 126
    gradient_4m = {**BASE_CONFIG, "max_position_embeddings": 4194304}  # the longest Llama-family context
    (tmp_path / "config.json").write_text(json.dumps(gradient_4m))
    assert load_config(tmp_path).max_position_embeddings == 4194304


def test_run_with_a_4tb_config_is_one_line(tmp_path: Path, capsys: Any) -> None:
    model = init_model(tmp_path / "m", preset="tiny", dtype="float32", **{k: BASE_CONFIG[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings")})  # fmt: skip
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 10**12}))
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    line = _one_error_line(
        capsys, ["run", "--model", str(model), "--prompts", str(prompts), "--max-tokens", "2"]
    )
    assert "'max_position_embeddings' must be at most 4,194,304" in line


# ---- run --prompts --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,content,expected",
    [
        ("deep.jsonl", "[" * 100_000 + "]" * 100_000 + "\n", "nested too deeply"),
        ("bigint.jsonl", '{"prompt_token_ids": [' + "9" * 5000 + "]}\n", "not JSON"),
        ("binary.txt", b"\xff\xfe\x00hello\n", "not UTF-8"),
        ("empty.txt", "\n\n", "no prompts"),
    ],
)
def test_a_hostile_prompts_file_is_one_line(
    tmp_path: Path, capsys: Any, name: str, content: str | bytes, expected: str
) -> None:
    prompts = tmp_path / name
    if isinstance(content, bytes):
        prompts.write_bytes(content)
    else:
        prompts.write_text(content)
    line = _one_error_line(capsys, ["run", "--prompts", str(prompts), "--max-tokens", "2"])
    assert expected in line and name in line


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_the_simulator_refuses_a_config_with_a_non_finite_number(
    value: str, tmp_path: Path, capsys: Any
) -> None:
    cfg = {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512,
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg)[:-1] + f', "rms_norm_eps": {value}}}')
    line = _one_error_line(capsys, ["cost", "--model", str(path), "--hardware", "h100"])
    assert "rms_norm_eps" in line
