"""``tailserve lint``: what each flag of an engine launch line does in the named engine version.

Every flag gets one verdict with its source (``flag_spec.VERDICTS``): from the version's table,
replaced by a rule's where one applies (``--prefill-schedule-interval 4`` without data
parallelism is a no-op); rules that stop the engine from starting are the line's conflicts. An
options file the line names (``trtllm-serve --config FILE``) adds one row per key after the
flags (``options_file.py``), and the rules see its values where it wins over a flag.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tailserve.core.config_flags import convert, kind_name
from tailserve.engines import sglang_flags, trtllm_flags, vllm_flags
from tailserve.engines.command import GivenFlag, Launch, parse_launch, read_flags
from tailserve.engines.config_file import with_config_file
from tailserve.engines.flag_spec import (
    DEPLOYMENT,
    FATAL,
    NO_OP,
    NOT_MODELLED,
    OTHER,
    REFUSED,
    UNKNOWN,
    EngineVersion,
    Finding,
    FlagSpec,
    Given,
    HumanInt,
    Row,
)
from tailserve.engines.options_file import with_options_file

CONFIG_PRECEDENCE = {
    "vllm": "vllm/utils/argparse_utils.py:479-567@v0.32.0 (_pull_args_from_config); "
    "vllm/utils.py:1383-1500@v0.8.5",
    "sglang": "sglang/srt/utils/server_args_config_parser.py@v0.5.23 (merge_config_with_args)",
}

VERSIONS: dict[str, tuple[EngineVersion, ...]] = {
    "vllm": vllm_flags.VERSIONS,
    "sglang": sglang_flags.VERSIONS,
    "trtllm": trtllm_flags.VERSIONS,
}
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}


@dataclass(frozen=True, slots=True)
class Report:
    engine: str
    version: EngineVersion
    launch: Launch
    model: str | None
    policy: str  # the tailserve policy that schedules like this engine version and line
    policy_why: str
    rows: tuple[Row, ...]
    conflicts: tuple[Finding, ...]
    unread: tuple[str, ...] = ()  # options files the line names that are not there

    @property
    def values(self) -> dict[str, Any]:
        """The typed value of each flag given, by its underscore name."""
        return {row.name: row.value for row in self.rows if row.name is not None and row.verdict not in FATAL}

    @property
    def refused(self) -> bool:
        """The engine would not start with this line (a conflict or a flag it does not take)."""
        return bool(self.conflicts) or any(row.verdict in FATAL for row in self.rows)


# The version read when none is named, where it is not the newest tailserve has: TensorRT-LLM
# 1.2.1, whose scheduler the trtllm policy follows (1.4.0rc4's table is partial).
DEFAULT_VERSIONS: dict[str, EngineVersion] = {"trtllm": trtllm_flags.DEFAULT}


def find_version(engine: str, version: str | None) -> EngineVersion:
    """The table of ``engine`` at ``version`` (None: the newest supported, or the engine's
    ``DEFAULT_VERSIONS`` entry)."""
    versions = VERSIONS[engine]
    if version is None:
        return DEFAULT_VERSIONS.get(engine, versions[-1])
    wanted = version.strip().lstrip("v")
    for known in versions:
        if known.version == wanted:
            return known
    for known in reversed(versions):  # "0.11": the newest 0.11.x tailserve has
        if known.version.startswith(wanted + "."):
            return known
    names = ", ".join(v.version for v in versions)
    raise ValueError(f"no table for {ENGINE_NAMES[engine]} {version}; tailserve reads {names}")


def lint(text: str, version: str | None = None) -> Report:
    """Read ``text`` as ``version`` of its engine (default: ``find_version``'s) would."""
    launch = parse_launch(text)
    table = find_version(launch.engine, version)
    positional, flags = read_flags(launch, table)
    label = f"{ENGINE_NAMES[launch.engine]} {table.version}"
    from_file, flags, config_unread, config_dropped = with_config_file(flags, launch, table)
    on_line = {flag.name for flag in flags if flag.name is not None}
    if positional and table.positional and launch.entry.endswith("serve"):
        on_line.add("model")  # ``vllm serve MODEL`` sets --model from its positional argument
    rows: list[Row] = []
    for i, word in enumerate(positional):
        if i == 0 and table.positional and launch.entry.endswith("serve"):
            rows.append(
                Row("MODEL", "model", word, DEPLOYMENT, "the model", table.positional, "deployment.model")
            )
        else:
            rows.append(Row(word, None, None, UNKNOWN, f"unexpected argument: {label} refuses it", label))
    for flag in from_file + flags:
        if flag.name in on_line and any(flag is f for f in from_file):
            rows.append(
                Row(flag.typed, flag.name, flag.value, NO_OP,
                    f"overridden by the command line's {_line_flag(flags, flag.name)}: {label} reads the line "
                    "over its --config file", CONFIG_PRECEDENCE[launch.engine])
            )  # fmt: skip
            continue
        if flag.option == "--config" and table.config_file and config_unread is None:
            rows.append(
                Row(flag.typed, flag.name, flag.value, OTHER,
                    "a YAML of the engine's flags: its keys are the rows shown FILE:key, the line's flags "
                    "win over them", CONFIG_PRECEDENCE[launch.engine])
            )  # fmt: skip
            continue
        if flag.option == "--config" and config_unread is not None:
            rows.append(
                Row(flag.typed, flag.name, flag.value, NOT_MODELLED,
                    f"warning: {flag.value} is not there (looked from {os.getcwd()}): its flags are not read; "
                    f"{label} stops at start when it cannot open the file", CONFIG_PRECEDENCE[launch.engine])
            )  # fmt: skip
            continue
        if flag.name is None:
            gone = table.removed.get(flag.typed.lstrip("-").replace("-", "_"))
            what = f"not a flag of {label}: the engine refuses to start"
            if gone is not None:
                rows.append(Row(flag.typed, None, flag.value, UNKNOWN, f"{what}; {gone[0]}", gone[1]))
            else:
                rows.append(
                    Row(flag.typed, None, flag.value, UNKNOWN, _with(what, flag.note), _known_source(table))
                )
            continue
        spec = table.spec(flag.name)
        if spec is None:
            value = (not flag.negated) if flag.value is None else flag.value
            what = "no scheduling effect tailserve reads"
            rows.append(
                Row(flag.typed, flag.name, value, OTHER, _with(what, flag.note), _known_source(table))
            )
            continue
        value = _typed(flag.typed, spec, flag.value, flag.negated)
        what = _with(spec.what, flag.note)
        rows.append(Row(flag.typed, spec.name, value, spec.verdict, what, spec.source, spec.feeds))
    for shown in config_dropped:  # a switch set false that the engine's reader drops
        rows.append(
            Row(shown, None, False, NO_OP,
                f"{label}'s --config reader reads only true switches: false is dropped (the default stays; "
                "give --no-X on the line)", CONFIG_PRECEDENCE[launch.engine])
        )  # fmt: skip
    rows, unread = with_options_file(rows, table, label)
    if config_unread is not None:
        unread = (*unread, config_unread)
    env = dict(launch.env)
    given = Given({row.name: row.value for row in rows if row.name and row.verdict not in FATAL}, env)
    conflicts: list[Finding] = []
    for rule in table.rules:
        for finding in rule(given):
            if finding.verdict == REFUSED or not finding.flags:
                conflicts.append(finding)
            else:
                rows = [_override(row, finding) for row in rows]
    policy, why = table.choose_policy(given, env)
    # The model the engine serves: the last one given that nothing overrode (a file's wins).
    models = [r.value for r in rows if r.feeds == "deployment.model" and r.verdict not in (NO_OP, *FATAL)]
    model = models[-1] if models else None
    return Report(launch.engine, table, launch, model, policy, why, tuple(rows), tuple(conflicts), unread)


def _line_flag(flags: list[GivenFlag], name: str | None) -> str:
    return next((flag.typed for flag in reversed(flags) if flag.name == name), "MODEL")


def _with(what: str, note: str) -> str:
    return f"{what} ({note})" if note else what


def _known_source(table: EngineVersion) -> str:
    return f"{ENGINE_NAMES[table.engine]} {table.version}'s parser (engines/known/{table.known_name}.txt)"


def _override(row: Row, finding: Finding) -> Row:
    if row.name != finding.flags[0]:
        return row
    return Row(row.flag, row.name, row.value, finding.verdict, finding.what, finding.source, row.feeds)


def _typed(typed: str, spec: FlagSpec, text: str | None, negated: bool) -> Any:
    """The flag's value as its type; a value of the wrong type is one line naming the flag."""
    if spec.kind is bool:
        if negated:
            return False
        if text is None:
            return True
    elif text is None:
        raise ValueError(f"{typed} needs a value ({_kind(spec.kind)})")
    choices = spec.kind if isinstance(spec.kind, tuple) else None
    try:
        if isinstance(spec.kind, HumanInt):
            return spec.kind.parse(text)
        return convert(text, str if choices else spec.kind, choices)
    except ValueError as e:
        raise ValueError(f"{typed}: {e}") from None


def _kind(kind: Any) -> str:
    if isinstance(kind, HumanInt):
        return "int"
    return f"one of {', '.join(kind)}" if isinstance(kind, tuple) else kind_name(kind)
