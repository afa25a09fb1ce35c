"""TensorRT-LLM's 1.3/1.4 ``scheduler_config`` keys in a ``trtllm-serve`` YAML: refused by 1.2.1
(the default table), read by the 1.4.0rc4 one (``trtllm_options.KEYS_1_4``), with the engine's
checks on their values and its 1.3 default for ``enable_prefix_aware_scheduling``."""

from __future__ import annotations

import pytest

from tailserve.core.device import DeviceInfo
from tailserve.engines.flag_spec import NO_OP, NOT_MODELLED, SCHEDULING, UNKNOWN
from tailserve.engines.lint import lint
from tailserve.engines.translate import translate
from tailserve.engines.trtllm_flags import TRTLLM_1_2_1, TRTLLM_1_4_0RC4
from tailserve.engines.trtllm_options import KEYS_1_4

H100 = DeviceInfo("H100-SXM", 80.0)
NEW = (
    "enable_prefix_aware_scheduling: true",
    "use_python_scheduler: false",
    "context_scheduling_policy: shortest_uncached_first",
    "context_starvation_iterations: 8",
    "gen_preemption: {}",
    "max_gen_init_admissions_per_pass: 4",
)


def _line(tmp_path, body: str, name: str = "x.yaml") -> str:
    path = tmp_path / name
    path.write_text(body)
    return f"trtllm-serve meta-llama/Llama-3.1-8B --enable_chunked_prefill --extra_llm_api_options {path}"


def _row(report, key: str):
    return next(row for row in report.rows if row.name == key or row.flag.endswith(f":{key}"))


def _scheduler(*lines: str) -> str:
    return "scheduler_config:\n" + "".join(f"  {line}\n" for line in lines)


@pytest.mark.parametrize("line", NEW)
def test_1_2_1_the_default_refuses_each_of_them(tmp_path, line):
    report = lint(_line(tmp_path, _scheduler(line)))
    assert report.version is TRTLLM_1_2_1
    key = "scheduler_config." + line.split(":")[0]
    assert _row(report, key).verdict == UNKNOWN and report.refused


def test_1_4_0rc4_reads_them_and_simulates_what_it_can(tmp_path):
    report = lint(_line(tmp_path, _scheduler(*NEW)), "1.4.0rc4")
    assert report.version is TRTLLM_1_4_0RC4 and not report.refused
    verdicts = {key: _row(report, f"scheduler_config.{key}").verdict for key in (
        "enable_prefix_aware_scheduling", "use_python_scheduler", "context_scheduling_policy",
        "context_starvation_iterations", "gen_preemption", "max_gen_init_admissions_per_pass",
    )}  # fmt: skip
    assert verdicts == {
        "enable_prefix_aware_scheduling": SCHEDULING,
        "use_python_scheduler": NO_OP,  # false: the C++ scheduler, the default
        "context_scheduling_policy": NOT_MODELLED,
        "context_starvation_iterations": NOT_MODELLED,
        "gen_preemption": NOT_MODELLED,
        "max_gen_init_admissions_per_pass": NOT_MODELLED,
    }
    t = translate(report, H100)
    assert t.spec.flags["enable_prefix_aware_scheduling"] is True
    assert any("context_scheduling_policy" in text for text in t.ignored)
    assert "not modelled" in _row(report, "scheduler_config.context_scheduling_policy").what


def test_1_4_0rc4_defaults_to_prefix_aware_and_false_turns_it_off(tmp_path):
    # SchedulerConfig.enable_prefix_aware_scheduling defaults to true from 1.3 (llm_args.py@0004396):
    # the table's policy default; 1.2.1 (no such option) leaves the policy's false.
    bare = _line(tmp_path, "{}\n")
    assert translate(lint(bare, "1.4.0rc4"), H100).spec.flags["enable_prefix_aware_scheduling"] is True
    assert "enable_prefix_aware_scheduling" not in translate(lint(bare), H100).spec.flags
    off = _line(tmp_path, _scheduler("enable_prefix_aware_scheduling: false"), "off.yaml")
    assert translate(lint(off, "1.4.0rc4"), H100).spec.flags["enable_prefix_aware_scheduling"] is False


def test_fcfs_is_a_no_op_and_prefix_aware_without_block_reuse_too(tmp_path):
    body = _scheduler("context_scheduling_policy: fcfs", "enable_prefix_aware_scheduling: true")
    body += "kv_cache_config:\n  enable_block_reuse: false\n"
    report = lint(_line(tmp_path, body), "1.4.0rc4")
    assert _row(report, "scheduler_config.context_scheduling_policy").verdict == NO_OP
    assert _row(report, "scheduler_config.enable_prefix_aware_scheduling").verdict == NO_OP


def test_a_context_order_the_engine_does_not_have_is_one_error_line(tmp_path):
    with pytest.raises(ValueError) as e:
        lint(_line(tmp_path, _scheduler("context_scheduling_policy: foo")), "1.4.0rc4")
    text = str(e.value)
    assert "\n" not in text
    assert (
        "scheduler_config.context_scheduling_policy: 'foo' is not one of fcfs, shortest_uncached_first"
        in text
    )


@pytest.mark.parametrize(
    "line", ["context_starvation_iterations: 0", "context_starvation_iterations: -3",
             "max_gen_init_admissions_per_pass: 0"],
)  # fmt: skip
def test_counts_must_be_positive_or_the_engine_does_not_start(tmp_path, line):
    # Annotated[int, Gt(gt=0)] | None (the 1.4.0rc4 reference page): pydantic refuses 0 and below.
    report = lint(_line(tmp_path, _scheduler(line)), "1.4.0rc4")
    assert report.refused
    with pytest.raises(ValueError) as e:
        translate(report, H100)
    text = str(e.value)
    assert "\n" not in text and "must be > 0 or null" in text and line.split(":")[0] in text


def test_null_counts_are_the_default(tmp_path):
    report = lint(_line(tmp_path, _scheduler("context_starvation_iterations: null")), "1.4.0rc4")
    assert not report.refused


def test_the_1_4_table_extends_1_2_1s_and_is_sourced():
    known = TRTLLM_1_4_0RC4.known_keys()
    assert TRTLLM_1_2_1.known_keys() < known  # 1.2.1's LLM API keys (not re-read for 1.4) and ...
    assert {spec.name for spec in KEYS_1_4} <= known  # ... SchedulerConfig's additions
    assert TRTLLM_1_4_0RC4.known_options() == TRTLLM_1_2_1.known_options()
    for spec in KEYS_1_4:
        assert "@" in spec.source or "#" in spec.source, spec.name
