"""vLLM's own argument forms, read as its ``FlexibleArgumentParser`` reads them: dotted keys of a
JSON flag, human-readable integers (``32k``), the ``-O3`` optimization level. A valid line must
not be called one the engine refuses."""

from __future__ import annotations

import json

import pytest

from tailserve.engines.flag_spec import HumanInt
from tailserve.engines.lint import lint
from tailserve.engines.translate import translate
from tailserve.executors.simulated.hardware import get_hardware

V3 = "vllm serve deepseek-ai/DeepSeek-V3 -tp 8"


def _row(report, name):
    return [row for row in report.rows if row.name == name]


# ---- dotted keys ------------------------------------------------------------------------------------
def test_dotted_keys_are_one_json_value_of_their_flag():
    report = lint(
        f"{V3} --speculative-config.method mtp --speculative-config.num_speculative_tokens=2 "
        "--hf-overrides.rope_scaling.factor 4.0 --hf-overrides.rope_scaling.type yarn --max-num-seqs 8"
    )
    assert not report.refused
    (spec,) = _row(report, "speculative_config")
    assert json.loads(spec.value) == {"method": "mtp", "num_speculative_tokens": 2}
    assert spec.flag == "--speculative-config.{method,num_speculative_tokens}"
    (hf,) = _row(report, "hf_overrides")
    assert json.loads(hf.value) == {"rope_scaling": {"factor": 4.0, "type": "yarn"}}
    assert report.values["max_num_seqs"] == 8


def test_dotted_keys_take_lists_human_ints_and_replace_an_earlier_json():
    report = lint(
        f"""{V3} --speculative-config '{{"method": "eagle3", "num_speculative_tokens": 5}}' """
        "--speculative-config.method=mtp --speculative-config.num_speculative_tokens 2 "
        "--speculative-config.synthetic_acceptance_rates+ 0.8,0.5 "
        "--hf-overrides.a 1k --hf-overrides.b 2K --hf-overrides.c 1.5K --hf-overrides.d+=x --hf-overrides.d+ y,z"
    )
    values = [json.loads(row.value) for row in _row(report, "speculative_config")]
    # vLLM appends the dotted keys as one more value after every flag: the last one wins
    assert values[-1] == {
        "method": "mtp",
        "num_speculative_tokens": 2,
        "synthetic_acceptance_rates": ["0.8", "0.5"],
    }
    assert json.loads(report.values["speculative_config"])["method"] == "mtp"
    (hf,) = _row(report, "hf_overrides")
    assert json.loads(hf.value) == {"a": 1000, "b": 2048, "c": "1.5K", "d": ["x", "y", "z"]}


def test_vllm_before_dotted_keys_refuses_them():
    report = lint(f"{V3} --speculative-config.method mtp", "0.8.5")
    assert report.refused
    assert lint(f"{V3} --speculative-config.method mtp", "0.11").refused is False


def test_a_dotted_key_without_its_value_is_one_line():
    with pytest.raises(ValueError, match=r"--speculative-config\.method needs a value"):
        lint(f"{V3} --speculative-config.method")


# ---- human-readable integers --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "value"),
    [("32768", 32768), ("32k", 32000), ("25.6k", 25600), ("32K", 32768), ("1M", 1 << 20), ("2g", 2 * 10**9)],
)
def test_human_ints_read_as_vllm_reads_them(text, value):
    assert HumanInt().parse(text) == value


def test_human_ints_refuse_what_vllm_refuses():
    with pytest.raises(ValueError, match="decimals are not allowed"):
        HumanInt().parse("1.5K")
    with pytest.raises(ValueError, match="not a valid int"):
        HumanInt().parse("lots")
    with pytest.raises(ValueError, match="not a valid int"):
        HumanInt().parse("auto")  # only the context length of 0.32 takes it
    assert HumanInt(auto=True).parse("auto") is None and HumanInt(auto=True).parse("-1") is None


def test_a_launch_line_with_32k_reads_and_simulates():
    line = f"{V3} --max-model-len 32k --max-num-batched-tokens 8K --max-num-seqs 256"
    report = lint(line)
    assert not report.refused
    assert report.values["max_model_len"] == 32000 and report.values["max_num_batched_tokens"] == 8192
    spec = translate(report, get_hardware("h200").device_info).spec
    assert spec.flags["max_num_batched_tokens"] == 8192 and spec.engine_flags["max_model_len"] == 32000
    auto = lint(f"{V3} --max-model-len auto")
    assert not auto.refused and auto.values["max_model_len"] is None  # the engine's own choice
    assert lint(f"{V3} --max-num-batched-tokens 8k", "0.11").values["max_num_batched_tokens"] == 8000
    with pytest.raises(ValueError, match="--max-num-batched-tokens: '8k' is not a valid int"):
        lint(f"{V3} --max-num-batched-tokens 8k", "0.8.5")  # before vllm#18968


# ---- -O3 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["0.32", "0.11", "0.8.5"])
@pytest.mark.parametrize("form", ["-O3", "-O 3", "-O=3"])
def test_the_optimization_level_is_a_flag(version, form):
    report = lint(f"{V3} {form} --max-num-seqs 64", version)
    assert not report.refused
    (row,) = [r for r in report.rows if r.flag.startswith("-O")]
    # 0.32: --optimization-level, no scheduling concern; 0.11: --compilation-config, not priced
    assert row.value == "3" and row.verdict == {"0.32": "other", "0.11": "not modelled"}.get(version, "other")
    assert report.values["max_num_seqs"] == 64


# ---- options that take several values ----------------------------------------------------------
@pytest.mark.parametrize(
    ("line", "version", "flag", "value"),
    [
        (f"{V3} --cudagraph-capture-sizes 1 2 4 8 --max-num-seqs 8", "0.32", "--cudagraph-capture-sizes", "1 2 4 8"),
        (f"{V3} --served-model-name r1 deepseek --max-num-seqs 8", "0.32", "--served-model-name", "r1 deepseek"),
        (f"{V3} --cuda-graph-sizes 1 2 4 --max-num-seqs 8", "0.11", "--cuda-graph-sizes", "1 2 4"),
        (
            "python -m sglang.launch_server --model-path M --cuda-graph-bs-decode 1 2 4 8 --max-running-requests 8",
            None, "--cuda-graph-bs-decode", "1 2 4 8",
        ),
    ],
)  # fmt: skip
def test_a_list_option_takes_its_words(line, version, flag, value):
    report = lint(line, version)
    assert not report.refused
    (row,) = [r for r in report.rows if r.flag == flag]
    assert row.value == value


def test_an_unknown_flag_is_one_problem_however_many_words_follow():
    report = lint(f"{V3} --cuda-graph-sizes 1 2 4 8")  # renamed before 0.32
    bad = [r for r in report.rows if r.verdict == "unknown"]
    assert report.refused and [r.flag for r in bad] == ["--cuda-graph-sizes"]
    assert bad[0].value == "1 2 4 8"


def test_a_scalar_flag_keeps_one_value():
    report = lint(f"{V3} --max-num-seqs 8 9")
    assert report.refused and any(r.flag == "9" and r.verdict == "unknown" for r in report.rows)


# ---- values the engine's config refuses ------------------------------------------------------------
def test_out_of_range_values_are_what_vllm_refuses():
    report = lint(f"{V3} --gpu-memory-utilization 2 --block-size 0 --max-num-seqs 0 --tensor-parallel-size 0")
    assert report.refused
    said = {c.flags[0]: c.what for c in report.conflicts}
    assert said["gpu_memory_utilization"].startswith("gpu_memory_utilization 2.0 must be > 0 and <= 1")
    assert set(said) >= {"block_size", "max_num_seqs", "tensor_parallel_size"}
    assert not lint(f"{V3} --gpu-memory-utilization 1 --block-size 16 --max-num-seqs 1").refused
    assert lint(f"{V3} --gpu-memory-utilization 1.5", "0.11").refused
    assert not lint(f"{V3} --gpu-memory-utilization 0.95", "0.8.5").refused
