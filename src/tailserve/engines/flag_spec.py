"""What tailserve knows of one engine flag in one engine version, and the verdicts ``lint`` gives.

A table row (``FlagSpec``) says what the flag does for scheduling, whether tailserve simulates it,
and the engine source line (or issue) that says so. Verdicts that depend on other flags or on the
value (``--prefill-schedule-interval`` acts only with data parallelism) are ``Rule``s: functions
of the typed flags given, each with its own source. A file of options a flag names (TensorRT-LLM's
``--extra_llm_api_options`` YAML) has a table of its own keys (``OptionsFile``), and each key given
is one ``Row`` beside the flags'.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from tailserve.core.config_flags import convert

# The verdicts, in the order the table prints them. "scheduling" and "deployment" flags are
# taken into the simulation (when the chosen policy has the field: ``translate.py``);
# "no-op" is accepted by the engine and does nothing in that version; "not modelled" has a
# real effect tailserve does not simulate; "other" is an engine flag of no scheduling
# concern (--host); "refused" and "unknown" stop the engine at start (exit 1 from lint).
SCHEDULING = "scheduling"
DEPLOYMENT = "deployment"
NO_OP = "no-op"
NOT_MODELLED = "not modelled"
OTHER = "other"
REFUSED = "refused"
UNKNOWN = "unknown"
VERDICTS = (SCHEDULING, DEPLOYMENT, NO_OP, NOT_MODELLED, OTHER, REFUSED, UNKNOWN)
FATAL = (REFUSED, UNKNOWN)  # the engine would not start with this line


@functools.cache
def known_file(name: str) -> frozenset[str]:
    """The lines of ``known/NAME`` (option strings or keys, one a line: ``known/README.md``),
    read once per process (a launch line and its config file's keys read them per flag);
    empty where the file is not there."""
    path = resources.files("tailserve.engines").joinpath(f"known/{name}")
    if not path.is_file():
        return frozenset()
    return frozenset(line.strip() for line in path.read_text().splitlines() if line.strip())


@dataclass(frozen=True, slots=True)
class HumanInt:
    """The kind of an integer flag vLLM reads with ``human_readable_int``: ``25.6k`` is 25,600
    (k, m, g, t by 1000), ``2K`` 2,048 (K, M, G, T by 1024, whole numbers only); ``auto`` also
    takes ``auto`` / ``-1``, the engine's own choice (None)
    (vllm/utils/argparse_utils.py:29-96@v0.32.0)."""

    auto: bool = False

    def parse(self, text: str) -> int | None:
        value = text.strip()
        if self.auto and (value == "-1" or value.lower() == "auto"):
            return None
        match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
        if match is None:
            try:
                return convert(value, int)  # as every other int flag reads (8, 8.0, 1e3)
            except ValueError:
                extra = ", auto" if self.auto else ""
                raise ValueError(f"{text!r} is not a valid int (or 1k, 2K, ...{extra})") from None
        number, suffix = match.groups()
        if suffix.islower():
            return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
        if "." in number:
            raise ValueError(f"{text!r}: decimals are not allowed with a binary suffix ({suffix})")
        return int(number) * 1024 ** ("KMGT".index(suffix) + 1)


@dataclass(frozen=True, slots=True)
class FlagSpec:
    """One flag of one engine version. ``kind`` is ``int``, ``float``, ``bool``, ``str`` or a
    tuple of the accepted choices; ``target`` is the tailserve name it feeds (a policy config
    field, an engine-wide flag, or a ``Deployment`` field prefixed ``deployment.``), when that
    differs from the flag's own underscore name."""

    name: str  # underscore spelling, e.g. "max_num_batched_tokens"
    kind: Any
    verdict: str
    what: str
    source: str
    default: str = ""
    aliases: tuple[str, ...] = ()  # other option strings: "-tp", "--model"
    target: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"{self.name}: verdict {self.verdict!r} is not one of {VERDICTS}")

    @property
    def feeds(self) -> str:
        return self.target or self.name


@dataclass(frozen=True, slots=True)
class Row:
    """One flag of a line, or one key of an options file it names: as shown, its name (the
    table's underscore name or the key's dotted path; None when the engine has none), its typed
    value, verdict, what it does, where that is written, and the tailserve name it feeds
    (``FlagSpec.feeds``; "" for rows that feed nothing)."""

    flag: str
    name: str | None
    value: Any
    verdict: str
    what: str
    source: str
    feeds: str = ""


@dataclass(frozen=True, slots=True)
class OptionsFile:
    """A file of engine options that a flag names, read as the engine reads it: its keys' table
    (``keys``, by dotted path: ``scheduler_config.capacity_scheduler_policy``), the sections read
    key by key (the rest are one row each, whatever they hold), which command-line flags the file
    overrides and where the engine says so, and every key its validation takes
    (``known/ENGINE-VERSION-options.txt``)."""

    flag: str  # the table name of the flag that names the file
    keys: tuple[FlagSpec, ...]
    sections: tuple[str, ...]
    overrides: Mapping[str, str]  # command-line flag (table name) -> the key that wins over it
    precedence: str  # the engine source that applies the file over the flags
    refuses: str  # the engine source that refuses a key it does not know

    def spec(self, key: str) -> FlagSpec | None:
        return next((spec for spec in self.keys if spec.name == key), None)


@dataclass(frozen=True, slots=True)
class Finding:
    """A verdict a rule gives: on one or more given flags (replacing their table verdict), or
    on the line as a whole when ``flags`` is empty."""

    flags: tuple[str, ...]
    verdict: str
    what: str
    source: str


@dataclass(frozen=True, slots=True)
class Given:
    """The flags of a command line, typed, by their underscore names, and its environment, for
    the rules (each rule writes the engine's default it assumes beside the source that gives it)."""

    values: Mapping[str, Any]
    env: Mapping[str, str] = field(default_factory=dict)  # the line's environment (VLLM_USE_V1=0)

    def __contains__(self, name: str) -> bool:
        return name in self.values

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)


Rule = Callable[[Given], list[Finding]]


@dataclass(frozen=True, slots=True)
class EngineVersion:
    """One supported version of an engine: its flag table, rules, option strings and the
    tailserve policy that schedules like it.

    ``policy_for`` picks the policy from the typed flags and the environment (vLLM 0.8.5 falls
    back to its V0 engine for some flags); ``policy_defaults`` are the policy fields this
    version's scheduler behaves by that differ from the policy's own defaults (vLLM before 0.20
    admits on the first chunk's blocks: ``scheduler_reserve_full_isl=False``)."""

    engine: str  # "vllm", "sglang", "trtllm"
    version: str
    source: str  # where the table was read: a release tag or a commit
    flags: tuple[FlagSpec, ...]
    rules: tuple[Rule, ...] = ()
    policy: str = ""
    policy_for: Callable[[Given, Mapping[str, str]], tuple[str, str]] | None = None
    policy_defaults: Mapping[str, Any] = field(default_factory=dict)
    underscores: bool = True  # the parser accepts --a_b for --a-b (vLLM's FlexibleArgumentParser)
    abbrev: bool = True  # argparse's unique-prefix abbreviations (argparse's default)
    dashes: bool = True  # option names use dashes; TensorRT-LLM's click options use underscores
    positional: str = ""  # the source of a positional MODEL argument, when the entry point takes one
    # ``--json-flag.key V`` read as that flag's JSON (vLLM's FlexibleArgumentParser since 0.9,
    # vllm#18208): vllm/utils/argparse_utils.py:425-455@v0.32.0
    dotted_keys: bool = False
    # ``-O3`` / ``-O 3`` / ``-O=3``: the option vLLM reads them as (0.32: --optimization-level,
    # argparse_utils.py:358-368@v0.32.0; before it the -O alias of --compilation-config)
    short_o: str = ""
    # ``--config FILE.yaml``: a YAML of the flags, put before the line's, by which reader's rules
    # (config_file.py): "vllm" (0.11+), "vllm-0.8" (0.8.5's flat reader), "sglang"; "": none
    config_file: str = ""
    # flags of earlier versions this one's parser refuses: name -> (what happened, source)
    removed: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    options_file: OptionsFile | None = None  # a file of options one of its flags names
    # the version whose known/ lists this one reads, where they were not made for it (a table
    # that extends an earlier version's: the keys it adds are its own table's); "": its own
    known_as: str = ""

    @property
    def known_name(self) -> str:
        """``ENGINE-VERSION`` of the ``known/`` lists this version reads."""
        return f"{self.engine}-{self.known_as or self.version}"

    def spec(self, name: str) -> FlagSpec | None:
        return next((spec for spec in self.flags if spec.name == name), None)

    def known_options(self) -> frozenset[str]:
        """Every option string this version's parser takes (``known/ENGINE-VERSION.txt``, read
        from the engine's own parser or source, see ``known/README.md``) plus the
        table's own."""
        names = set(known_file(f"{self.known_name}.txt"))
        for spec in self.flags:
            names.add(self.option(spec.name))
            names.update(spec.aliases)
        return frozenset(names)

    def list_options(self) -> frozenset[str]:
        """The options that take several values (``--served-model-name a b``,
        ``--cudagraph-capture-sizes 1 2 4``): ``known/ENGINE-VERSION-lists.txt``, none without
        one (see ``known/README.md``)."""
        return known_file(f"{self.known_name}-lists.txt")

    def known_keys(self) -> frozenset[str]:
        """Every key of the options file the engine's validation takes
        (``known/ENGINE-VERSION-options.txt``), plus the file table's own."""
        if self.options_file is None:
            return frozenset()
        names = known_file(f"{self.known_name}-options.txt")
        return frozenset(names | {spec.name for spec in self.options_file.keys})

    def option(self, name: str) -> str:
        """A flag's option string as this engine spells it."""
        return "--" + (name.replace("_", "-") if self.dashes else name)

    def choose_policy(self, given: Given, env: Mapping[str, str]) -> tuple[str, str]:
        """(policy, why) for this command line."""
        if self.policy_for is not None:
            return self.policy_for(given, env)
        return self.policy, ""


def table(
    *specs: FlagSpec, replace: tuple[FlagSpec, ...] = (), drop: tuple[str, ...] = ()
) -> tuple[FlagSpec, ...]:
    """A version's table from a shared one: ``replace`` rows by name, ``drop`` names."""
    by_name = {s.name: s for s in specs if s.name not in drop}
    for spec in replace:
        by_name[spec.name] = spec
    return tuple(by_name.values())
