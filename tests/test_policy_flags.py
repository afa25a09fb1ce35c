"""Policy flags are generated from the registry's config dataclasses (cli/policy_flags.py): every
policy's group in every policy command's help, every field a flag with its default, values of
the field's type, a flag the chosen policy lacks one error line; one converter for all
(core/config_flags.py)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, replace
from typing import Any, Literal

import pytest

from tailserve.cli import main
from tailserve.cli.app import build_parser
from tailserve.cli.policy_flags import COMMAND_OWNS, PER_DEVICE, add_policy_flags, policy_flags_from
from tailserve.core.config_flags import convert
from tailserve.core.policy import Policy
from tailserve.policies.registry import ENGINE_FLAGS, POLICIES

COMMANDS = ("simulate", "serve", "run")


def _help(command: str, capsys: Any) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return " ".join(capsys.readouterr().out.split())


def _groups(command: str) -> dict[str, argparse._ArgumentGroup]:
    parser = build_parser().commands[command]
    return {g.title: g for g in parser._action_groups}


def _parse(*argv: str) -> dict[str, Any]:
    args, extra = build_parser().parse_known_args(list(argv))
    assert extra == []
    return policy_flags_from(args)


def _one_error_line(capsys: Any, argv: list[str]) -> str:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert "usage:" not in err and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_a_group_for_every_registered_policy(command, capsys):
    out = _help(command, capsys)
    for name, cls in POLICIES.items():
        assert f"{name} options: --policy {name}: {' '.join(cls.summary.split())}" in out
    assert "engine options:" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_every_config_field_is_a_flag_with_its_default(command):
    groups = _groups(command)
    for name, cls in POLICIES.items():
        shown = {a.option_strings[0]: a for a in groups[f"{name} options"]._group_actions}
        fields = dataclasses.fields(cls.config_cls)
        # A command's own option takes the flag's place: serve's --max-queued-requests answers
        # before any policy, the deployment's --pipeline-parallel-size prices the stages.
        fields = [
            f for f in fields if not (f.name in COMMAND_OWNS and "--" + f.name.replace("_", "-") not in shown)
        ]
        assert list(shown) == ["--" + f.name.replace("_", "-") for f in fields], name
        configs = [
            cls.default_config(_device(m), c) for m in (24.0, 80.0, 141.0, 192.0) for c in (4096, 131072)
        ]
        for f in fields:
            text = shown["--" + f.name.replace("_", "-")].help
            if text.endswith(f"(default: {PER_DEVICE})"):  # set by default_config from the GPU or context
                assert f.default is dataclasses.MISSING or any(
                    getattr(c, f.name) != f.default for c in configs
                )
            else:
                value = str(f.default).lower() if isinstance(f.default, bool) else f.default
                value = "none" if value is None else "''" if value == "" else value
                assert text.endswith(f"(default: {value})"), (name, f.name, text)


def _device(memory: float) -> Any:
    from tailserve.core.device import DeviceInfo

    return DeviceInfo("probe", memory)


def test_engine_wide_flags_show_each_policys_default(capsys):
    out = _help("simulate", capsys)
    assert (
        "--block-size INT tokens per KV cache block (page) (default: 16; sglang, tgi: 1; trtllm: 32)" in out
    )
    assert "(default: 0.9; vllm, slo: 0.92; sarathi: 0.8; sglang: 0.83; tgi: 1.0)" in out
    assert "--max-model-len INT" in out  # simulate's only way to set it
    groups = _groups("serve")  # serve has --max-model-len of its own: not listed twice
    assert all("--max-model-len" not in a.option_strings for a in groups["engine options"]._group_actions)
    assert set(ENGINE_FLAGS) - {"max_model_len"} <= {
        a.dest.split(":")[1] for a in groups["engine options"]._group_actions
    }


def test_a_shared_flag_is_one_option_listed_under_each_of_its_policies():
    parser = build_parser().commands["simulate"]
    real = [a for a in parser._actions if "--max-num-seqs" in a.option_strings]
    assert len(real) == 1 and real[0].default is argparse.SUPPRESS and real[0].help is argparse.SUPPRESS
    groups = _groups("simulate")
    listed = [
        t
        for t, g in groups.items()
        if any("--max-num-seqs" in a.option_strings and a.help != argparse.SUPPRESS for a in g._group_actions)
    ]
    assert listed == ["orca options", "vllm-v0 options", "vllm options", "sarathi options", "slo options"]
    usage = parser.format_usage()
    assert "--max-num-seqs" not in usage and "--policy" in usage  # the usage line stays short


def test_only_given_flags_reach_the_policy_in_the_order_given():
    assert _parse("simulate") == {}
    flags = _parse(
        "simulate", "--max-num-seqs", "64", "--block-size", "32", "--max-num-batched-tokens", "512"
    )
    assert list(flags.items()) == [("max_num_seqs", 64), ("block_size", 32), ("max_num_batched_tokens", 512)]


def test_values_convert_to_the_field_types():
    flags = _parse(
        "simulate", "--policy", "tgi", "--max-batch-size", "none", "--waiting-served-ratio", "1.2",
        "--no-prefill-chunking", "--max-concurrent-requests", "1e3", "--max-batch-total-tokens=4096",
        "--disable-radix-cache",
    )  # fmt: skip
    assert flags == {
        "max_batch_size": None,
        "waiting_served_ratio": 1.2,
        "prefill_chunking": False,
        "max_concurrent_requests": 1000,
        "max_batch_total_tokens": 4096,
        "disable_radix_cache": True,
    }
    assert type(flags["waiting_served_ratio"]) is float and type(flags["max_concurrent_requests"]) is int
    # bool words, underscores as in vLLM, an optional int given a number
    assert _parse("serve", "--enable-chunked-prefill", "off", "--max_num_seqs", "8") == {
        "enable_chunked_prefill": False,
        "max_num_seqs": 8,
    }
    assert _parse("run", "--prompts", "p", "--policy", "sglang", "--max-running-requests", "12") == {
        "max_running_requests": 12
    }


@pytest.mark.parametrize("command", [["simulate"], ["serve"], ["run", "--prompts", "p"]])
def test_policy_takes_the_spec_compare_takes(command):
    def parse(*argv: str) -> tuple[str, dict[str, Any]]:
        args, extra = build_parser().parse_known_args([*command, *argv])
        assert extra == []
        flags = policy_flags_from(args)  # sets args.policy to the spec's name
        return args.policy, flags

    assert parse("--policy", "sglang:chunked_prefill_size=512,block_size=1") == (
        "sglang",
        {"chunked_prefill_size": 512, "block_size": 1},
    )
    # The spec's flags and the options together; one flag given both ways must agree.
    assert parse("--policy", "vllm:max_num_seqs=64", "--max-num-batched-tokens", "512") == (
        "vllm",
        {"max_num_seqs": 64, "max_num_batched_tokens": 512},
    )
    assert parse("--policy", "vllm:max_num_seqs=64", "--max-num-seqs", "64")[1] == {"max_num_seqs": 64}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--policy", "sglang:nonexistent=1"],
            "policy sglang has no flag 'nonexistent'; valid: schedule_policy,",
        ),
        (["--policy", "vllm,sglang"], "--policy takes one policy, got 2 in 'vllm,sglang'"),
        (
            ["--policy", "vllm:max_num_seqs=64", "--max-num-seqs", "32"],
            "--policy vllm:max_num_seqs=64 sets max_num_seqs=64 and --max-num-seqs 32 differs",
        ),
        (["--policy", "trtllm:capacity_scheduler_policy=FOO"], "'FOO' is not one of GUARANTEED_NO_EVICT"),
        (["--policy", "nosuch:a=1"], "unknown policy 'nosuch'; known: static,"),
    ],
)
def test_a_bad_policy_spec_is_one_line(argv, message, capsys):
    assert message in _one_error_line(capsys, ["simulate", *argv])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-num-seqs", "lots"], "argument --max-num-seqs: 'lots' is not a valid int"),
        (["--max-num-seqs", "1.5"], "argument --max-num-seqs: '1.5' is not a valid int"),
        (["--watermark", "x"], "argument --watermark: 'x' is not a valid float"),
        (["--enable-chunked-prefill", "maybe"], "'maybe' is not a valid bool"),
        (["--no-enable-chunked-prefill", "true"], "policy flag --no-enable-chunked-prefill takes no value"),
        (["--max-num-seqs"], "policy flag --max-num-seqs needs a value (int), e.g. --max-num-seqs VALUE"),
        (
            ["--policy", "sglang", "--max-running-requests"],
            "--max-running-requests needs a value (int or none)",
        ),
    ],
)
def test_bad_values_are_one_line(argv, message, capsys):
    assert message in _one_error_line(capsys, ["simulate", *argv])


@pytest.mark.parametrize("command", [["simulate"], ["serve"], ["run", "--prompts", "p.txt"]])
def test_a_flag_the_policy_lacks_is_one_line_naming_the_policy_and_its_flags(command, capsys):
    line = _one_error_line(capsys, [*command, "--policy", "orca", "--chunk-size", "256"])
    assert line.startswith(
        "tailserve: error: unrecognized argument --chunk-size (a flag of sarathi, not of policy orca;"
    )
    assert "orca takes --max-num-seqs, --reserve-tokens;" in line
    assert "every policy takes --block-size, --gpu-memory-utilization" in line
    line = _one_error_line(
        capsys, [*command, "--policy", "static", "--max-num-seqs", "4", "--chunk-size", "8"]
    )
    assert (
        "unrecognized arguments --max-num-seqs, --chunk-size (flags of orca, vllm-v0, vllm, sarathi, slo"
        in line
    )


def test_an_unknown_flag_names_the_nearest_option(capsys):
    line = _one_error_line(capsys, ["simulate", "--chunked-prefil-size", "1024"])
    assert (
        line
        == "tailserve: error: unrecognized argument --chunked-prefil-size (did you mean --chunked-prefill-size?)"
    )
    assert (
        _one_error_line(capsys, ["compare", "--bogus"]) == "tailserve: error: unrecognized argument --bogus"
    )
    # A policy flag given to a command that takes a policy list says where it goes.
    line = _one_error_line(capsys, ["compare", "--chunk-size", "256"])
    assert line.endswith(
        "--chunk-size (a flag of sarathi: give it in --policies, e.g. sarathi:chunk_size=VALUE)"
    )
    line = _one_error_line(capsys, ["cost", "--no-enable-chunked-prefill"])
    assert line.endswith("(a flag of vllm-v0, vllm, trtllm; tailserve cost takes no policy flags)")


# ---- a policy added to the registry: its flags appear without any change to the CLI ----------
@dataclass(frozen=True)
class FakeConfig:
    budget: int = 7  # tokens per step
    ratio: float | None = None
    # how eagerly it admits
    mode: Literal["lazy", "eager"] = "lazy"
    flush: bool = False
    """whether every step flushes"""
    percent: float = 50.0  # a 50% share


class FakePolicy(Policy):
    name = "fake"
    summary = "a policy only this test registers"
    config_cls = FakeConfig

    @classmethod
    def default_config(cls, device: Any, max_model_len: int, **overrides: Any) -> FakeConfig:
        return replace(FakeConfig(), **overrides)

    def schedule(self, sched: Any, now: float) -> Any:
        raise NotImplementedError


@pytest.fixture
def fake_policy(monkeypatch):
    monkeypatch.setitem(POLICIES, "fake", FakePolicy)


def test_a_registered_policy_appears_with_its_flags(fake_policy, capsys):
    out = _help("simulate", capsys)
    assert "fake options: --policy fake: a policy only this test registers" in out
    assert "--budget INT tokens per step (default: 7)" in out
    assert "--ratio FLOAT|none (default: none)" in out
    assert "--mode {lazy,eager} how eagerly it admits (default: lazy)" in out
    assert "--flush, --no-flush whether every step flushes (default: false)" in out
    assert "--percent FLOAT a 50% share (default: 50.0)" in out
    assert "| slo | fake (default: vllm)" in out  # --policy's own help
    flags = _parse(
        "simulate", "--policy", "fake", "--budget", "9", "--ratio", "0.5", "--mode", "eager", "--flush"
    )
    assert flags == {"budget": 9, "ratio": 0.5, "mode": "eager", "flush": True}
    line = _one_error_line(capsys, ["simulate", "--policy", "fake", "--mode", "busy"])
    assert "argument --mode: 'busy' is not one of lazy, eager" in line
    line = _one_error_line(capsys, ["simulate", "--policy", "vllm", "--budget", "9"])
    assert "unrecognized argument --budget (a flag of fake, not of policy vllm;" in line


def test_two_policies_may_not_give_one_flag_two_types(monkeypatch):
    @dataclass(frozen=True)
    class Clash:
        max_num_seqs: str = "many"

    clash = type("ClashPolicy", (FakePolicy,), {"name": "clash", "config_cls": Clash})
    monkeypatch.setitem(POLICIES, "clash", clash)
    with pytest.raises(TypeError, match="flag max_num_seqs of clash is str, another policy's is int"):
        add_policy_flags(argparse.ArgumentParser(), "vllm")


# ---- the one converter ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "kind", "value"),
    [
        ("YES", bool, True),
        ("off", bool, False),
        ("12", int, 12),
        ("1e3", int, 1000),
        ("123456789012345678901", int, 123456789012345678901),
        ("0.25", float, 0.25),
        ("none", int | None, None),
        ("", float | None, None),
        ("3", int | None, 3),
        ("eager", Literal["lazy", "eager"], "eager"),
        ("fcfs", str, "fcfs"),
        (64, int, 64),  # already typed: as it is
    ],
)
def test_convert(text, kind, value):
    assert convert(text, kind) == value and type(convert(text, kind)) is type(value)


@pytest.mark.parametrize(
    ("text", "kind", "message"),
    [
        ("1.5", int, "'1.5' is not a valid int"),
        ("inf", int, "'inf' is not a valid int"),
        ("maybe", bool, "'maybe' is not a valid bool"),
        ("none", int, "'none' is not a valid int"),
        ("x", float | None, "'x' is not a valid float"),
        ("busy", Literal["lazy", "eager"], "'busy' is not one of lazy, eager"),
    ],
)
def test_convert_refuses(text, kind, message):
    with pytest.raises(ValueError, match=message):
        convert(text, kind)
    assert convert("b", str, choices=("a", "b")) == "b"


def test_the_command_line_is_parsed_once():
    # No hand parser beside argparse: one parse call in the whole CLI (cli/app.py's main).
    import ast
    from pathlib import Path

    import tailserve.cli

    calls = []
    for path in Path(tailserve.cli.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("parse_")
                and node.attr.endswith("args")
            ):
                calls.append(f"{path.name}: {node.attr}")
    assert calls == ["app.py: parse_known_args"]


def test_a_list_flag_shows_the_kind_of_its_items(capsys):
    # cuda_graph_batch_sizes holds whole batch sizes: INT,..., not FLOAT,...; rates stay floats.
    out = " ".join(_help("simulate", capsys).split())
    assert "--cuda-graph-batch-sizes INT,...|none" in out
    assert "--synthetic-acceptance-rates FLOAT,...|none" in out
    assert convert("128,256", tuple[int, ...] | None) == (128, 256)
    assert convert("8.0/16", tuple[int, ...]) == (8, 16)
    with pytest.raises(ValueError, match="is not a list of whole numbers"):
        convert("1,2.5", tuple[int, ...])
