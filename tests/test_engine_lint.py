"""``tailserve lint`` and ``simulate --engine-cmd``: launch lines read as each engine version reads
them (forms, spellings, verdicts with sources, conflicts), and the mapping onto tailserve's policy
flags, checked against the same settings typed by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tailserve.cli import main
from tailserve.engines.command import parse_launch
from tailserve.engines.flag_spec import NO_OP, NOT_MODELLED, OTHER, SCHEDULING, UNKNOWN
from tailserve.engines.lint import VERSIONS, lint
from tailserve.engines.translate import translate
from tailserve.executors.simulated.hardware import get_hardware

DOCS = Path(__file__).resolve().parents[1] / "docs"
H100 = get_hardware("H100").device_info
B200 = get_hardware("B200").device_info


def rows(report):
    return {row.flag: row for row in report.rows}


# ---- launch lines ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "engine", "model"),
    [
        ("vllm serve meta-llama/Meta-Llama-3-8B --max-num-seqs 8", "vllm", "meta-llama/Meta-Llama-3-8B"),
        ("python -m vllm.entrypoints.openai.api_server --model Llama-3-8B", "vllm", "Llama-3-8B"),
        (
            "CUDA_VISIBLE_DEVICES=0,1 python3 -m sglang.launch_server --model-path Qwen/Qwen3-8B",
            "sglang",
            "Qwen/Qwen3-8B",
        ),
        ("sglang serve --model Qwen/Qwen3-8B", "sglang", "Qwen/Qwen3-8B"),
        (
            "trtllm-serve serve meta-llama/Llama-3.1-8B --max_batch_size 8",
            "trtllm",
            "meta-llama/Llama-3.1-8B",
        ),
        ("/usr/bin/trtllm-serve meta-llama/Llama-3.1-8B", "trtllm", "meta-llama/Llama-3.1-8B"),
        ("env VLLM_USE_V1=1 vllm serve \\\n  Llama-3-8B \\\n  --max-num-seqs 8", "vllm", "Llama-3-8B"),
    ],
)
def test_each_launch_form_names_its_engine_and_model(text, engine, model):
    report = lint(text)
    assert (report.engine, report.model) == (engine, model)


def test_flag_spellings_as_vllm_reads_them():
    report = lint(
        "vllm serve M --max_num_seqs=64 --max-num-batched-tokens=1e3 --no-enable-prefix-caching -tp 2"
    )
    assert report.values == {
        "model": "M", "max_num_seqs": 64, "max_num_batched_tokens": 1000,
        "enable_prefix_caching": False, "tensor_parallel_size": 2,
    }  # fmt: skip


def test_sglang_takes_abbreviations_and_refuses_underscores():
    got = rows(lint("python -m sglang.launch_server --model-path M --tp 2 --max_running_requests 8"))
    assert got["--tp"].value == 2 and "abbreviation of --tp-size" in got["--tp"].what
    assert got["--max_running_requests"].verdict == UNKNOWN
    assert "did you mean --max-running-requests?" in got["--max_running_requests"].what


def test_trtllm_takes_its_underscores_only():
    got = rows(lint("trtllm-serve M --max-batch-size 8 --tp_size 2"))
    assert (
        got["--max-batch-size"].verdict == UNKNOWN
        and "did you mean --max_batch_size?" in got["--max-batch-size"].what
    )
    assert got["--tp_size"].value == 2


def test_engine_flags_of_no_scheduling_concern_are_other():
    assert rows(lint("vllm serve M --host 0.0.0.0 --port 9000"))["--host"].verdict == OTHER


# ---- verdicts, each with its source ------------------------------------------------------------


def test_prefill_schedule_interval_does_nothing_without_data_parallelism():
    single = rows(lint("vllm serve M --prefill-schedule-interval 4"))["--prefill-schedule-interval"]
    assert single.verdict == NO_OP and "vllm#54627" in single.source and "core.py:2162" in single.source
    dp = rows(lint("vllm serve M --prefill-schedule-interval 4 -dp 2"))["--prefill-schedule-interval"]
    assert dp.verdict == SCHEDULING and dp.feeds == "prefill_schedule_interval"


def test_partial_prefill_limits_by_version():
    v11 = lint("vllm serve M --max-num-partial-prefills 1 --max-long-partial-prefills 1", "0.11.0")
    assert {r.verdict for r in v11.rows if r.flag.startswith("--max")} == {NO_OP}
    assert "vllm#49075" in rows(v11)["--max-num-partial-prefills"].source and not v11.refused
    refused = lint("vllm serve M --max-num-partial-prefills 4", "0.11")
    assert refused.refused and "api_server.py:209" in refused.conflicts[0].source
    gone = rows(lint("vllm serve M --max-num-partial-prefills 4"))["--max-num-partial-prefills"]
    assert gone.verdict == UNKNOWN and "removed in 0.27" in gone.what
    v0 = lint("vllm serve M --max-num-partial-prefills 4 --enable-chunked-prefill", "0.8.5")
    assert v0.policy == "vllm-v0" and not v0.refused


def test_swap_space_does_nothing_on_v1():
    assert rows(lint("vllm serve M --swap-space 8", "0.11.0"))["--swap-space"].verdict == NO_OP
    assert rows(lint("vllm serve M --swap-space 8", "0.8.5"))["--swap-space"].verdict == NO_OP
    assert (
        rows(lint("VLLM_USE_V1=0 vllm serve M --swap-space 8", "0.8.5"))["--swap-space"].verdict == SCHEDULING
    )


def test_vllm_0_8_5_v1_always_chunks_and_falls_back_to_v0_for_v0_flags():
    v1 = lint("vllm serve M --no-enable-chunked-prefill", "0.8.5")
    assert v1.policy == "vllm" and rows(v1)["--no-enable-chunked-prefill"].verdict == NO_OP
    v0 = lint("vllm serve M --scheduling-policy priority", "0.8.5")
    assert v0.policy == "vllm-v0" and "--scheduling-policy" in v0.policy_why
    assert rows(v0)["--scheduling-policy"].source.endswith("arg_utils.py:1323@v0.8.5")


def test_v0_flags_are_gone_after_0_8_5():
    for version in ("0.11.0", "0.32.0"):
        row = rows(lint("vllm serve M --preemption-mode swap", version))["--preemption-mode"]
        assert row.verdict == UNKNOWN and "V0 flag" in row.what


def test_sglang_no_ops():
    got = rows(lint(
        "python -m sglang.launch_server --model-path M --chunked-prefill-size -1 --enable-mixed-chunk "
        "--schedule-policy lpm --disable-radix-cache --disable-priority-preemption "
        "--priority-scheduling-preemption-threshold 5"
    ))  # fmt: skip
    for flag in ("--enable-mixed-chunk", "--schedule-policy", "--disable-priority-preemption",
                 "--priority-scheduling-preemption-threshold"):  # fmt: skip
        assert got[flag].verdict == NO_OP and "@v0.5.23" in got[flag].source, flag


@pytest.mark.parametrize("policy", ["hrrn", "shortest-prefill-first", "routing-key"])
def test_sglang_new_schedule_policies_are_simulated(policy):
    """SGLang 0.5.23's newer orders map to the ``sglang`` policy's ``schedule_policy``."""
    report = lint(f"python -m sglang.launch_server --model-path M --schedule-policy {policy}")
    assert rows(report)["--schedule-policy"].verdict == SCHEDULING and not report.refused
    spec = translate(report, H100).spec
    assert spec.label == f"sglang:schedule_policy={policy}" and not translate(report, H100).ignored


def test_sglang_hrrn_without_the_radix_cache_is_fcfs():
    got = rows(lint("sglang serve --model M --schedule-policy hrrn --disable-radix-cache"))
    assert (
        got["--schedule-policy"].verdict == NO_OP
        and "schedule_policy.py:338" in got["--schedule-policy"].source
    )


# ---- conflicts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "source"),
    [
        ("vllm serve M --max-num-batched-tokens 2048 --max-model-len 8192 --no-enable-chunked-prefill",
         "scheduler.py:315@v0.32.0"),
        ("vllm serve M --max-num-batched-tokens 32 --max-num-seqs 64", "scheduler.py:328@v0.32.0"),
        ("vllm serve M --max-num-active-seqs 128 --max-num-seqs 64", "scheduler.py:335@v0.32.0"),
        ("vllm serve M --long-prefill-token-threshold 9000 --max-model-len 8192", "scheduler.py:352@v0.32.0"),
        ("sglang serve --model M --enable-priority-scheduling --schedule-policy lpm", "validation_hook.py:282"),
        ("sglang serve --model M --retraction-policy priority", "validation_hook.py:303"),
        ("sglang serve --model M --chunked-prefill-size 1000 --page-size 64", "validation_hook.py:244"),
        ("sglang serve --model M --schedule-policy shortest-prefill-first --disable-radix-cache",
         "schedule_policy.py:333"),
        ("sglang serve --model M --schedule-policy priority", "schedule_policy.py:344"),
        ("sglang serve --model M --enable-priority-scheduling --schedule-policy hrrn", "validation_hook.py:282"),
    ],
)  # fmt: skip
def test_conflicts_stop_the_engine_and_cite_their_check(text, source):
    report = lint(text)
    assert report.refused and any(source in f.source for f in report.conflicts)


def test_lint_exit_status(capsys):
    assert main(["lint", "vllm serve M --max-num-seqs 64"]) == 0
    assert main(["lint", "vllm serve M --max-num-batched-tokens 32 --max-num-seqs 64"]) == 1
    out = capsys.readouterr().out
    assert "conflict" in out and "would not start" in out
    assert main(["lint", "vllm serve M --prefill-schedule-interval 2", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["flags"][1]["verdict"] == NO_OP and payload["refused"] is False


# ---- bad input: one line -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["lint", "llama-server -m model.gguf"], "not an engine launch line: 'llama-server -m model.gguf'"),
        (["lint", "vllm serve M --max-num-seqs lots"], "--max-num-seqs: 'lots' is not a valid int"),
        (["lint", "vllm serve M --max-num-seqs"], "--max-num-seqs needs a value (int)"),
        (["lint", "vllm serve M --scheduling-policy lifo"], "'lifo' is not one of fcfs, priority"),
        (["lint", "vllm serve 'M"], "cannot read the command line: No closing quotation"),
        (["lint", "vllm serve M", "--engine-version", "0.9"], "no table for vLLM 0.9; tailserve reads 0.8.5, 0.11.0, 0.32.0"),
        (["simulate", "--engine-cmd", "vllm serve Llama-3-8B", "--max-num-seqs", "8"], "--engine-cmd sets the policy"),
        (["simulate", "--engine-cmd", "vllm serve Llama-3-8B --max-num-sqes 8"], "did you mean --max-num-seqs?"),
        (["simulate", "--engine-cmd", "vllm serve Llama-3-8B -tp 2", "--tp", "4"], "--tp 4 and the engine command's TP 2"),
        (["simulate", "--engine-version", "0.11"], "--engine-version reads --engine-cmd"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err.split("engine command: ")[-1].strip()


# ---- the mapping onto tailserve ----------------------------------------------------------------


def test_translation_is_what_one_would_type():
    report = lint("vllm serve meta-llama/Meta-Llama-3-8B -tp 2 --max-num-batched-tokens 2048 --max-num-seqs 64 "
                  "--no-enable-prefix-caching --block-size 32 --stream-interval 4 --enforce-eager "
                  "--kv-cache-dtype fp8")  # fmt: skip
    t = translate(report, H100)
    assert t.spec.label == (
        "vllm:max_num_batched_tokens=2048,max_num_seqs=64,enable_prefix_caching=False,stream_interval=4,"
        "block_size=32"
    )
    assert t.deployment == {"model": "meta-llama/Meta-Llama-3-8B", "tp": 2, "kv_cache_dtype": "fp8"}
    assert t.ignored == ("--enforce-eager (not modelled)",)


def test_translation_carries_version_behaviour():
    # 0.11's V1 admits on the first chunk's blocks, and has no 160 GiB budget tier.
    # 0.11 (and 0.8.5) schedule synchronously unless told otherwise: pinned off.
    t = translate(lint("vllm serve M", "0.11.0"), B200)
    assert t.spec.flags == {
        "scheduler_reserve_full_isl": False,
        "async_scheduling": False,
        "max_num_batched_tokens": 8192,
        "max_num_seqs": 1024,
    }
    assert translate(lint("vllm serve M --async-scheduling", "0.11.0"), B200).spec.flags["async_scheduling"]
    assert translate(lint("vllm serve M", "0.8.5"), B200).spec.flags["async_scheduling"] is False
    # 0.32 schedules asynchronously unless told not to, which is the policy's own default
    # (none: as vLLM 0.32 decides), so nothing is set; the flags still map both ways.
    assert translate(lint("vllm serve M"), B200).spec.flags == {}
    assert translate(lint("vllm serve M --no-async-scheduling"), B200).spec.flags == {
        "async_scheduling": False
    }
    assert translate(lint("vllm serve M --async-scheduling"), B200).spec.flags == {"async_scheduling": True}
    dp = translate(lint("vllm serve M -dp 2"), B200)
    assert "async_scheduling" not in dp.spec.flags and not dp.ignored
    # Ray's executor has no async scheduling: vLLM 0.32 turns the default off, refuses it asked for.
    assert translate(lint("vllm serve M --distributed-executor-backend ray"), B200).spec.flags == {
        "async_scheduling": False
    }
    assert translate(lint("vllm serve M --distributed-executor-backend mp"), B200).spec.flags == {}
    refused = lint("vllm serve M --distributed-executor-backend ray --async-scheduling")
    assert refused.refused and "`ray` does not support async scheduling yet." in refused.conflicts[0].what
    sglang = translate(
        lint("sglang serve --model M --tp 4 --ep-size 4 --context-length 4096 --page-size 16"), H100
    )
    assert sglang.spec.label == "sglang:max_model_len=4096,block_size=16"
    assert sglang.deployment == {"model": "M", "tp": 4, "expert_parallel": True}


def test_fields_added_to_a_policy_are_picked_up(monkeypatch):
    """A scheduling flag the policy's config lacks is reported, not lost; once the config has
    the field (``async_scheduling`` was added this way), it passes through unchanged."""
    from dataclasses import fields, make_dataclass

    from tailserve.policies import registry
    from tailserve.policies.vllm import VllmConfig, VllmPolicy

    report = lint("vllm serve M --no-async-scheduling")
    assert translate(report).ignored == ()
    assert translate(report).spec.flags == {"async_scheduling": False}
    # Without the field (a config from before it), the flag is reported as not modelled.
    kept = [(f.name, f.type, f) for f in fields(VllmConfig) if f.name != "async_scheduling"]
    older = make_dataclass("WithoutAsync", kept, frozen=True)
    monkeypatch.setitem(registry.POLICIES, "vllm", type("OlderVllm", (VllmPolicy,), {"config_cls": older}))
    assert translate(report).ignored == ("--no-async-scheduling (not modelled by tailserve's vllm policy)",)


@pytest.mark.parametrize(
    ("engine_cmd", "by_hand"),
    [
        ("vllm serve meta-llama/Meta-Llama-3-8B --max-num-batched-tokens 512 --max-num-seqs 32 --prefill-schedule-interval 4",
         ["--model", "Llama-3-8B", "--policy", "vllm", "--max-num-batched-tokens", "512", "--max-num-seqs", "32"]),
        ("python -m sglang.launch_server --model-path Qwen/Qwen3-8B --chunked-prefill-size 1024 --schedule-policy lof",
         ["--model", "Qwen3-8B", "--policy", "sglang", "--chunked-prefill-size", "1024", "--schedule-policy", "lof"]),
    ],
)  # fmt: skip
def test_simulate_with_engine_cmd_equals_the_flags_typed_by_hand(engine_cmd, by_hand, tmp_path, capsys):
    workload = ["--hardware", "H100", "--workload", "chat", "--num-requests", "40"]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["simulate", *workload, "--engine-cmd", engine_cmd, "--json", str(a)]) == 0
    assert "engine command: " in capsys.readouterr().err
    assert main(["simulate", *workload, *by_hand, "--json", str(b)]) == 0
    assert json.loads(a.read_text()) == json.loads(b.read_text())


# ---- the tables themselves ---------------------------------------------------------------------


def test_every_row_and_known_list_is_sourced():
    for versions in VERSIONS.values():
        for version in versions:
            assert len(version.known_options()) > len(version.flags)
            for spec in version.flags:
                assert "@" in spec.source or "#" in spec.source, (version.version, spec.name)


def test_docs_list_every_flag_that_does_nothing():
    text = (DOCS / "policies.md").read_text()
    section = text[text.index("### Flags that do nothing") :]
    for versions in VERSIONS.values():
        for version in versions:
            for spec in version.flags:
                if spec.verdict == NO_OP:
                    assert f"`--{spec.name.replace('_', '-')}`" in section, spec.name
    for flag in ("--prefill-schedule-interval", "--enable-mixed-chunk", "--disable-priority-preemption"):
        assert f"`{flag}`" in section


def test_parse_launch_keeps_the_environment():
    launch = parse_launch("VLLM_USE_V1=0 vllm serve M")
    assert launch.env == (("VLLM_USE_V1", "0"),) and launch.words == ("M",)


def test_a_trtllm_serve_line_runs_the_trtllm_policy(capsys):
    line = "trtllm-serve Llama-3-8B --max_batch_size 64 --max_num_tokens 4096 --enable_chunked_prefill"
    assert main(["simulate", "--workload", "chat", "--num-requests", "20", "--engine-cmd", line]) == 0
    err = capsys.readouterr().err
    assert "--policy trtllm:max_batch_size=64,max_num_tokens=4096,enable_chunked_prefill=True" in err


@pytest.mark.parametrize(
    "line, shown",
    [
        ("vllm serve deepseek-v3 -dp 8 --enable-expert-parallel --all2all-backend deepep_low_latency",
         "--dp 8 --enable-expert-parallel --all2all-backend deepep_low_latency"),
        ("python -m sglang.launch_server --model-path deepseek-v3 --tp 8 --dp 8 --enable-dp-attention",
         "--tp 1 --dp 8"),
        ("python -m sglang.launch_server --model-path deepseek-v3 --tp 8 --attn-dp-size 4", "--tp 2 --dp 4"),
    ],
)  # fmt: skip
def test_data_parallel_lines_become_the_dp_engine(line, shown, capsys):
    argv = [
        "simulate",
        "--hardware",
        "H200",
        "--workload",
        "chat",
        "--num-requests",
        "8",
        "--engine-cmd",
        line,
    ]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert shown in out.err
    assert "in lockstep" in out.out


def test_sglang_attention_dp_must_divide_tp(capsys):
    line = "python -m sglang.launch_server --model-path deepseek-v3 --tp 8 --attn-dp-size 3"
    assert main(["simulate", "--hardware", "H200", "--engine-cmd", line]) == 2
    assert "attention DP size 3 does not divide TP size 8" in capsys.readouterr().err


# ---- vLLM's --kv-transfer-config ----------------------------------------------------------------


def _kv(config: dict) -> str:
    return f"vllm serve meta-llama/Llama-3.1-8B --kv-transfer-config '{json.dumps(config)}'"


def test_an_offloading_connector_line_simulates_the_cpu_tier_it_builds():
    """What --kv-offloading-size 200 builds, written out as a connector (cpu_bytes_to_use bytes):
    the same tier, its unmodelled keys named."""
    report = lint(
        _kv(
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": 200 * 2**30, "block_size": 64},
            }
        )
    )
    row = rows(report)["--kv-transfer-config"]
    assert row.verdict == SCHEDULING and "kv_offloading_size=200" in row.what and "block_size" in row.what
    t = translate(report, H100)
    assert t.spec.label == "vllm:kv_offloading_size=200.0" and not t.ignored
    same = translate(lint("vllm serve meta-llama/Llama-3.1-8B --kv-offloading-size 200"), H100)
    assert same.spec.label == t.spec.label


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}, "P/D decode instance"),
        (
            {
                "kv_connector": "NixlConnector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"kv_lease_duration": 60},
            },
            "not modelled: kv_lease_duration",
        ),
        ({"kv_connector": "NixlPushConnector", "kv_role": "kv_producer"}, "push mode"),
        ({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, "LMCacheConnectorV1"),
        ({"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}, "needs cpu_bytes_to_use"),
        (
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": 10, "spec_name": "X"},
            },
            "spec X",
        ),
    ],
)
def test_other_kv_connectors_are_said_for_what_they_are(config, says):
    report = lint(_kv(config))
    row = rows(report)["--kv-transfer-config"]
    assert row.verdict == NOT_MODELLED and says in row.what
    t = translate(report, H100)
    assert t.spec.label == "vllm" and any(i.startswith("--kv-transfer-config") for i in t.ignored)


def test_a_kv_transfer_config_that_is_not_an_object_is_said_not_read():
    row = rows(lint("vllm serve M --kv-transfer-config '[1]'"))["--kv-transfer-config"]
    assert row.verdict == NOT_MODELLED and "must be a JSON object" in row.what
