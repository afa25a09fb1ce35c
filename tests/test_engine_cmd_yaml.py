"""``trtllm-serve ... --extra_llm_api_options FILE`` (alias ``--config``) read key by key as
TensorRT-LLM 1.2.1 reads it (the file over the flags, unknown keys refused, a missing or broken
file), its keys mapped onto the ``trtllm`` policy like the same settings typed by hand, and
``--engine-cmd`` for ``compare`` (several lines) and ``tune`` (one line, swept from there)."""

from __future__ import annotations

import json
import shlex

import pytest

from tailserve.cli import main
from tailserve.engines.flag_spec import DEPLOYMENT, NO_OP, NOT_MODELLED, OTHER, SCHEDULING, UNKNOWN
from tailserve.engines.lint import lint
from tailserve.engines.translate import translate
from tailserve.engines.trtllm_flags import TRTLLM_1_2_1
from tailserve.executors.simulated.deployment import Deployment
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.policies.registry import PolicySpec, get_policy_cls
from tailserve.tune.commands import command_line

H100 = get_hardware("H100").device_info
OPTIONS = """\
max_batch_size: 128
enable_chunked_prefill: true
scheduler_config:
  capacity_scheduler_policy: MAX_UTILIZATION
  context_chunking_policy: EQUAL_PROGRESS
  dynamic_batch_config: {enable_batch_size_tuning: true, enable_max_num_tokens_tuning: false,
                         dynamic_batch_moving_average_window: 128}
kv_cache_config:
  enable_block_reuse: false
  tokens_per_block: 64
  free_gpu_memory_fraction: 0.85
  max_tokens: 200000
disable_overlap_scheduler: true
cuda_graph_config: {enable_padding: true}
build_config: {max_batch_size: 8}
print_iter_log: true
"""


def write(tmp_path, text, name="opts.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def rows(report):
    return {row.flag: row for row in report.rows}


def test_each_yaml_key_is_a_row_with_its_verdict_and_source(tmp_path):
    path = write(tmp_path, OPTIONS)
    report = lint(f"trtllm-serve M --extra_llm_api_options {path}")
    got = rows(report)
    assert got["--extra_llm_api_options"].verdict == OTHER
    expected = {
        "max_batch_size": (SCHEDULING, 128),
        "enable_chunked_prefill": (SCHEDULING, True),
        "scheduler_config.capacity_scheduler_policy": (SCHEDULING, "MAX_UTILIZATION"),
        "scheduler_config.context_chunking_policy": (SCHEDULING, "EQUAL_PROGRESS"),
        "scheduler_config.dynamic_batch_config": (NO_OP, None),  # TensorRT backend only
        "kv_cache_config.enable_block_reuse": (SCHEDULING, False),
        "kv_cache_config.tokens_per_block": (DEPLOYMENT, 64),
        # the trtllm policy's gpu_memory_utilization, applied to what weights and activations leave
        "kv_cache_config.free_gpu_memory_fraction": (DEPLOYMENT, 0.85),
        "kv_cache_config.max_tokens": (DEPLOYMENT, 200000),
        "disable_overlap_scheduler": (SCHEDULING, True),  # the overlap scheduler off (trtllm_overlap.py)
        "cuda_graph_config": (OTHER, None),
        "build_config": (NO_OP, None),  # dropped by launch_server for the PyTorch backend
        "print_iter_log": (OTHER, True),  # an LLM API option, no scheduling effect
    }
    for key, (verdict, value) in expected.items():
        row = got[f"opts.yaml:{key}"]
        assert row.verdict == verdict, key
        assert value is None or row.value == value, key
        assert "@" in row.source or "#" in row.source or key == "print_iter_log", key
    assert "engines/known/trtllm-1.2.1-options.txt" in got["opts.yaml:print_iter_log"].source
    assert got["opts.yaml:scheduler_config.capacity_scheduler_policy"].source == (
        "tensorrt_llm/llmapi/llm_args.py@1.2 SchedulerConfig.capacity_scheduler_policy"
    )
    assert "launch_server" in got["opts.yaml:build_config"].source
    assert not report.refused and report.policy == "trtllm"


def test_the_file_wins_over_the_flags_it_also_sets(tmp_path):
    path = write(
        tmp_path,
        "max_batch_size: 128\nmodel: Qwen/Qwen3-8B\nkv_cache_config:\n  free_gpu_memory_fraction: 0.85\n",
    )
    line = f"trtllm-serve M --max_batch_size 64 --max_num_tokens 4096 --kv_cache_free_gpu_memory_fraction 0.8 --config {path}"
    report = lint(line)
    got = rows(report)
    flag = got["--max_batch_size"]
    assert flag.verdict == NO_OP and "overridden by opts.yaml:max_batch_size (128)" in flag.what
    assert "update_llm_args_with_extra_dict" in flag.source
    assert "(wins over --max_batch_size 64)" in got["opts.yaml:max_batch_size"].what
    assert got["--kv_cache_free_gpu_memory_fraction"].verdict == NO_OP
    assert got["--max_num_tokens"].verdict == SCHEDULING  # the file does not set it: the flag stands
    assert got["MODEL"].verdict == NO_OP and report.model == "Qwen/Qwen3-8B"
    assert report.values["max_batch_size"] == 128
    t = translate(report, H100)
    assert t.spec.flags == {"max_num_tokens": 4096, "max_batch_size": 128}
    assert t.deployment == {"model": "Qwen/Qwen3-8B"}
    # A kv_cache_config without free_gpu_memory_fraction leaves the flag's (merged key by key).
    path.write_text("kv_cache_config:\n  enable_block_reuse: false\n")
    kept = rows(lint(line))
    assert kept["--kv_cache_free_gpu_memory_fraction"].verdict == DEPLOYMENT
    assert kept["--max_batch_size"].verdict == SCHEDULING


def test_keys_the_llm_api_does_not_take_stop_the_engine(tmp_path, capsys):
    path = write(
        tmp_path,
        "max_num_tokns: 4096\nscheduler_config:\n  capacity_scheduler_polcy: MAX_UTILIZATION\n'kv_cache_config.max_tokens': 1\n",
    )
    report = lint(f"trtllm-serve M --config {path}")
    got = rows(report)
    top = got["opts.yaml:max_num_tokns"]
    assert top.verdict == UNKNOWN and "did you mean max_num_tokens?" in top.what
    assert 'extra="forbid"' in top.source
    nested = got["opts.yaml:scheduler_config.capacity_scheduler_polcy"]
    assert (
        nested.verdict == UNKNOWN
        and "did you mean scheduler_config.capacity_scheduler_policy?" in nested.what
    )
    assert got["opts.yaml:'kv_cache_config.max_tokens'"].verdict == UNKNOWN  # dotted at the top: no option
    assert report.refused
    assert main(["lint", f"trtllm-serve M --config {path}"]) == 1
    assert "would not start" in capsys.readouterr().out


def test_chunking_policy_does_nothing_without_chunked_prefill(tmp_path):
    path = write(tmp_path, "scheduler_config:\n  context_chunking_policy: EQUAL_PROGRESS\n")
    off = rows(lint(f"trtllm-serve M --config {path}"))["opts.yaml:scheduler_config.context_chunking_policy"]
    assert off.verdict == NO_OP and "scheduler.py@5f480b7a" in off.source
    on = rows(lint(f"trtllm-serve M --enable_chunked_prefill --config {path}"))
    assert on["opts.yaml:scheduler_config.context_chunking_policy"].verdict == SCHEDULING
    # The file's enable_chunked_prefill wins over the flag, for the rule too.
    path.write_text(
        "enable_chunked_prefill: false\nscheduler_config:\n  context_chunking_policy: EQUAL_PROGRESS\n"
    )
    over = rows(lint(f"trtllm-serve M --enable_chunked_prefill --config {path}"))
    assert over["opts.yaml:scheduler_config.context_chunking_policy"].verdict == NO_OP


def test_a_null_keeps_the_engine_default_and_ep_reads_against_tp_wherever_given(tmp_path):
    path = write(
        tmp_path,
        "moe_expert_parallel_size: 2\ntensor_parallel_size: 2\nscheduler_config:\n  context_chunking_policy: null\n",
    )
    t = translate(lint(f"trtllm-serve M --enable_chunked_prefill --config {path}"), H100)
    assert t.spec.flags == {"enable_chunked_prefill": True}
    assert t.deployment == {"model": "M", "expert_parallel": True, "tp": 2}
    assert translate(lint("trtllm-serve M --ep_size 2 --tp_size 2"), H100).deployment["expert_parallel"]


def test_a_missing_file_is_one_warning_row_and_one_error_line_to_simulate(tmp_path, capsys):
    line = f"trtllm-serve M --config {tmp_path / 'nothere.yaml'}"
    report = lint(line)
    row = rows(report)["--config"]
    assert row.verdict == NOT_MODELLED and row.what.startswith("warning: ") and "is not there" in row.what
    assert report.unread == (str(tmp_path / "nothere.yaml"),) and not report.refused
    assert main(["lint", line]) == 0
    capsys.readouterr()
    assert main(["simulate", "--engine-cmd", line.replace(" M ", " Llama-3-8B ")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "options file" in err and "nothere.yaml is not there" in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("scheduler_config: {capacity_scheduler_policy: MAX_UTILIZATION\n", "not YAML: expected ',' or '}'"),
        ("- max_batch_size: 8\n", "expected a mapping of LLM API options (key: value lines), got a list"),
        ("", "got nothing"),
        ("max_batch_size: lots\n", "opts.yaml:max_batch_size: 'lots' is not a valid int"),
        ("enable_chunked_prefill: 3\n", "opts.yaml:enable_chunked_prefill: 3 is not bool"),
        ("scheduler_config:\n  capacity_scheduler_policy: FASTEST\n", "'FASTEST' is not one of GUARANTEED_NO_EVICT"),
        ("scheduler_config: MAX_UTILIZATION\n", "scheduler_config is a mapping of its own options"),
    ],
)  # fmt: skip
def test_a_file_tailserve_cannot_read_is_one_line(tmp_path, capsys, text, message):
    path = write(tmp_path, text)
    assert main(["lint", f"trtllm-serve M --config {path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_simulate_with_the_yaml_equals_the_flags_typed_by_hand(tmp_path, capsys):
    path = write(
        tmp_path,
        "enable_chunked_prefill: true\nscheduler_config:\n  capacity_scheduler_policy: MAX_UTILIZATION\n"
        "  context_chunking_policy: EQUAL_PROGRESS\nkv_cache_config:\n  enable_block_reuse: false\n"
        "  tokens_per_block: 64\n  max_tokens: 100000\n",
    )
    workload = ["--hardware", "H100", "--workload", "chat", "--num-requests", "40"]
    line = f"trtllm-serve meta-llama/Meta-Llama-3-8B --max_num_tokens 2048 --config {path}"
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["simulate", *workload, "--engine-cmd", line, "--json", str(a)]) == 0
    err = capsys.readouterr().err
    assert "max_total_tokens=100000" in err  # the cap on KV tokens, as max_total_tokens
    by_hand = [
        "--model", "Llama-3-8B", "--policy", "trtllm", "--max-num-tokens", "2048",
        "--enable-chunked-prefill", "true", "--capacity-scheduler-policy", "MAX_UTILIZATION",
        "--context-chunking-policy", "EQUAL_PROGRESS", "--enable-block-reuse", "false", "--block-size", "64",
        "--max-total-tokens", "100000",
    ]  # fmt: skip
    assert main(["simulate", *workload, *by_hand, "--json", str(b)]) == 0
    assert json.loads(a.read_text()) == json.loads(b.read_text())


def test_the_yaml_tune_prints_reads_back_as_the_policy_it_tuned(tmp_path, monkeypatch):
    spec = PolicySpec.make(
        "trtllm",
        {
            "max_num_tokens": 2048,
            "enable_chunked_prefill": True,
            "capacity_scheduler_policy": "MAX_UTILIZATION",
        },
    )
    printed = command_line(spec, Deployment.of("Llama-3-8B", "H100", 2), None, H100, 8192)
    echo, _, launch = printed.partition(" && ")
    words = shlex.split(echo)  # echo 'YAML' > trtllm-options.yaml
    monkeypatch.chdir(tmp_path)
    write(tmp_path, words[1], words[3])
    t = translate(lint(launch), H100)
    cls = get_policy_cls("trtllm")
    assert cls.default_config(H100, 8192, **t.spec.flags) == cls.default_config(H100, 8192, **spec.flags)
    assert t.deployment == {"model": "meta-llama/Meta-Llama-3-8B", "tp": 2}


def test_compare_runs_each_engine_command_labelled_by_engine_and_version(tmp_path, capsys):
    workload = ["--hardware", "H100", "--workload", "chat", "--num-requests", "30"]
    vllm = "vllm serve meta-llama/Meta-Llama-3-8B --max-num-batched-tokens 1024"
    sglang = "python -m sglang.launch_server --model-path Llama-3-8B --chunked-prefill-size 2048"
    out = tmp_path / "compare.json"
    argv = ["compare", *workload, "--engine-cmd", vllm, "--engine-cmd", sglang, "--json", str(out)]
    assert main([*argv, "--engine-version", "vllm=0.11.0"]) == 0
    labels = [run["label"] for run in json.loads(out.read_text())["runs"]]
    assert labels[0].startswith("vLLM 0.11.0: vllm:") and "max_num_batched_tokens=1024" in labels[0]
    assert labels[1] == "SGLang 0.5.23: sglang:chunked_prefill_size=2048"
    err = capsys.readouterr().err
    assert err.count("engine command: ") == 2
    # Each line alone equals its policy typed by hand; --policies adds to the lines.
    assert main([*argv, "--policies", "sglang:chunked_prefill_size=2048"]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 3 and {k: v for k, v in runs[1].items() if k != "label"} == {
        k: v for k, v in runs[2].items() if k != "label"
    }


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--engine-cmd", "vllm serve Llama-3-8B -tp 2"], "the engine commands run different deployments"),
        (
            ["--engine-version", "vlm=0.11"],
            "expected V or ENGINE=V,... with ENGINE one of vllm, sglang, trtllm",
        ),
        (["--engine-version", "0.11"], "no table for SGLang 0.11"),
    ],
)
def test_compare_engine_commands_bad_input_is_one_line(extra, message, capsys):
    argv = [
        "compare",
        "--engine-cmd",
        "vllm serve Llama-3-8B",
        "--engine-cmd",
        "sglang serve --model Llama-3-8B",
    ]
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_tune_sweeps_an_engine_command_from_its_own_line(tmp_path, capsys):
    path = write(tmp_path, "scheduler_config:\n  capacity_scheduler_policy: MAX_UTILIZATION\n")
    line = f"trtllm-serve meta-llama/Meta-Llama-3-8B --max_num_tokens 4096 --enable_chunked_prefill --config {path}"
    out = tmp_path / "tune.json"
    argv = ["tune", "--hardware", "H100", "--num-requests", "60", "--chunk-sizes", "512,2048", "--no-resume"]
    argv += ["--out", str(tmp_path / "runs.jsonl"), "--engine-cmd", line, "--json", str(out)]
    assert main(argv) == 0
    (policy,) = json.loads(out.read_text())["policies"]
    assert policy["policy"].startswith("trtllm:max_num_tokens=4096,enable_chunked_prefill=True,")
    assert policy["knob"] == "max_num_tokens" and policy["capacity_at_size"] == 4096
    assert [p["size"] for p in policy["sweep"]] == [512, 2048, 4096]  # the line's own budget among them
    assert "trtllm-serve meta-llama/Meta-Llama-3-8B " in policy["command"]  # named as the line named it
    assert "MAX_UTILIZATION" in policy["command"]
    capsys.readouterr()
    assert main([*argv, "--policies", "vllm"]) == 2
    assert "--engine-cmd sets the one engine tune sweeps: drop --policies" in capsys.readouterr().err


def test_the_options_table_is_sourced_and_its_keys_known():
    options = TRTLLM_1_2_1.options_file
    assert options is not None
    known = TRTLLM_1_2_1.known_keys()
    for spec in options.keys:
        assert "@" in spec.source or "#" in spec.source, spec.name
    assert {
        "print_iter_log",
        "kv_cache_config.event_buffer_max_size",
        "scheduler_config.waiting_queue_policy",
    } <= known
    flags = {spec.name for spec in TRTLLM_1_2_1.flags} | {"model"}
    assert set(options.overrides) <= flags and set(options.overrides.values()) <= known


def test_attention_dp_makes_each_tp_rank_a_dp_rank(tmp_path, capsys):
    # TensorRT-LLM's enable_attention_dp (NVIDIA's MLPerf DeepSeek-R1: TP 8, EP 8, attention DP):
    # eight TP-1 attention ranks in lockstep, experts whole over the eight GPUs; without it, TP 8.
    path = write(
        tmp_path, "tensor_parallel_size: 8\nmoe_expert_parallel_size: 8\nenable_attention_dp: true\n"
    )
    t = translate(lint(f"trtllm-serve deepseek-ai/DeepSeek-R1 --config {path}"), H100)
    assert t.deployment == {"model": "deepseek-ai/DeepSeek-R1", "tp": 1, "dp": 8, "expert_parallel": True}
    assert not any("enable_attention_dp" in text for text in t.ignored)
    off = write(
        tmp_path,
        "tensor_parallel_size: 8\nmoe_expert_parallel_size: 8\nenable_attention_dp: false\n",
        "off.yaml",
    )
    assert translate(lint(f"trtllm-serve M --config {off}"), H100).deployment == {
        "model": "M",
        "tp": 8,
        "expert_parallel": True,
    }
    line = f"trtllm-serve deepseek-ai/DeepSeek-R1 --config {path}"
    assert (
        main(
            [
                "simulate",
                "--hardware",
                "B200",
                "--workload",
                "chat",
                "--num-requests",
                "8",
                "--engine-cmd",
                line,
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    assert "--tp 1" in out.err and "--dp 8" in out.err and "DP 8 x TP 1 in lockstep" in out.out


def test_the_tensorrt_backend_schedules_without_the_overlap_scheduler(tmp_path):
    # The C++ executor waits for step n before it schedules n+1 (trtllm_options.BACKEND_WHAT), so a
    # built engine's line runs the trtllm policy with its overlap scheduler off; pytorch keeps the
    # engine's default (unset); the file's backend wins over the flag's (serve.py applies it last).
    def flags(line: str) -> dict:
        return translate(lint(line)).spec.flags

    assert flags("trtllm-serve ENGINE --backend tensorrt") == {"disable_overlap_scheduler": True}
    assert flags("trtllm-serve ENGINE --backend trt") == {"disable_overlap_scheduler": True}
    assert flags("trtllm-serve M --backend pytorch") == {}
    assert flags("trtllm-serve M") == {}
    path = write(tmp_path, "backend: tensorrt\ndisable_overlap_scheduler: false\n")
    assert flags(f"trtllm-serve ENGINE --extra_llm_api_options {path}") == {"disable_overlap_scheduler": True}
    assert flags(f"trtllm-serve ENGINE --backend pytorch --extra_llm_api_options {path}") == {
        "disable_overlap_scheduler": True
    }
    assert rows(lint("trtllm-serve ENGINE --backend tensorrt"))["--backend"].verdict == SCHEDULING
