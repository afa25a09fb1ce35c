"""An engine's launch line, read as its own parser would: which engine, the model, each flag.

The forms: ``vllm serve MODEL``, ``python -m vllm.entrypoints.openai.api_server --model MODEL``,
``python -m sglang.launch_server --model-path MODEL``, ``sglang serve --model-path MODEL``,
``trtllm-serve [serve] MODEL``; environment assignments before them (``VLLM_USE_V1=0``, ``env
A=B``) are kept, shell line continuations joined. Flags: ``--a-b V``, ``--a-b=V``, a bare boolean,
``--no-a-b``; ``--a_b`` where the engine's parser takes it (vLLM) and unique-prefix abbreviations
(``--tp`` for SGLang's ``--tp-size``), since argparse accepts those unless told not to; vLLM's
dotted keys of a JSON flag (``--speculative-config.method mtp``, ``--x.key+ a,b``), merged into
one value of that flag after every other flag, as its ``FlexibleArgumentParser`` does.
"""

from __future__ import annotations

import difflib
import json
import re
import shlex
from dataclasses import dataclass
from typing import Any

from tailserve.engines.flag_spec import EngineVersion, HumanInt

# (engine, the words that start it) after any environment assignments and the interpreter.
_MODULES = {
    "vllm.entrypoints.openai.api_server": "vllm",
    "sglang.launch_server": "sglang",
}
FORMS = (
    "vllm serve MODEL",
    "python -m vllm.entrypoints.openai.api_server --model MODEL",
    "python -m sglang.launch_server --model-path MODEL",
    "sglang serve --model-path MODEL",
    "trtllm-serve MODEL",
)
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_NUMBER = re.compile(r"^-\d+(\.\d*)?([eE][+-]?\d+)?$")


@dataclass(frozen=True, slots=True)
class Launch:
    """The engine a line starts and the words after its entry point."""

    engine: str
    entry: str  # as typed, e.g. "python3 -m sglang.launch_server"
    env: tuple[tuple[str, str], ...]
    words: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class GivenFlag:
    """One flag as typed and as the engine reads it. ``name`` is the underscore name of the
    option the engine resolves it to (None when it resolves to none); ``value`` is the text
    given (None for a bare switch); ``negated`` for ``--no-X``."""

    typed: str  # the option as typed, without "=VALUE"
    option: str  # the engine's own spelling it resolves to ("" when unknown)
    name: str | None
    value: str | None
    negated: bool = False
    note: str = ""  # "abbreviation of --tp-size", "did you mean --max-num-seqs?"


def parse_launch(text: str) -> Launch:
    """The engine and the words after its entry point; ValueError (one line) for a line that
    starts no engine tailserve reads."""
    try:
        words = shlex.split(text.replace("\\\n", " "))
    except ValueError as e:
        raise ValueError(f"cannot read the command line: {e}") from None
    env: list[tuple[str, str]] = []
    i = 0
    while i < len(words) and (words[i] == "env" or _ENV.match(words[i])):
        if words[i] != "env":
            key, _, value = words[i].partition("=")
            env.append((key, value))
        i += 1
    rest = words[i:]
    head = rest[0].rsplit("/", 1)[-1] if rest else ""
    if head == "vllm" and rest[1:2] == ["serve"]:
        return Launch("vllm", "vllm serve", tuple(env), tuple(rest[2:]))
    if head == "sglang" and rest[1:2] == ["serve"]:
        return Launch("sglang", "sglang serve", tuple(env), tuple(rest[2:]))
    if head == "trtllm-serve":
        skip = 2 if rest[1:2] == ["serve"] else 1
        return Launch("trtllm", " ".join(rest[:skip]), tuple(env), tuple(rest[skip:]))
    if re.fullmatch(r"python(\d+(\.\d+)?)?", head) and rest[1:2] == ["-m"] and len(rest) > 2:
        engine = _MODULES.get(rest[2])
        if engine:
            return Launch(engine, " ".join(rest[:3]), tuple(env), tuple(rest[3:]))
    shown = " ".join(rest[:3]) or "an empty line"
    raise ValueError(f"not an engine launch line: {shown!r}; tailserve reads {', '.join(FORMS)}")


def read_flags(launch: Launch, version: EngineVersion) -> tuple[list[str], list[GivenFlag]]:
    """The positional words and the flags of ``launch`` as ``version``'s parser reads them."""
    known = version.known_options()
    several = version.list_options()
    names = _option_names(version)
    positional: list[str] = []
    flags: list[GivenFlag] = []
    dotted: dict[str, tuple[list[str], dict[str, Any]]] = {}  # base as typed -> (keys, merged)
    words = launch.words
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("-") or _NUMBER.match(word) or word == "-":
            positional.append(word)
            continue
        spaced = word == "-O" and i < len(words) and words[i] in ("0", "1", "2", "3")
        if version.short_o and (spaced or (word.startswith("-O") and word != "-O")):
            # vLLM's optimization level, ``-O3`` or ``-O 3``: rewritten before its parser runs
            level = words[i] if word == "-O" else word[3:] if word[2:3] == "=" else word[2:]
            i += word == "-O"
            option = version.short_o
            flags.append(GivenFlag(word, option, _name_of(option, names), level))
            continue
        typed, eq, inline = word.partition("=")
        if version.dotted_keys and "." in typed:
            # ``--x.a.b V``: the next word is its value whatever it looks like (vLLM takes it so)
            if not eq:
                if i >= len(words):
                    raise ValueError(f"{typed} needs a value")
                inline, i = words[i], i + 1
            base, _, path = typed.partition(".")
            keys, merged = dotted.setdefault(base, ([], {}))
            keys.append(path.removesuffix("+"))
            _merge(merged, path, inline)
            continue
        option, negated, note = _resolve(typed, known, version)
        name = _name_of(option, names)
        spec = version.spec(name) if name else None
        switch = negated or (spec is not None and spec.kind is bool)
        value: str | None = inline if eq else None
        if not eq and not switch and i < len(words) and not _is_option(words[i]):
            value = words[i]  # an unknown flag is read as taking a value, as most do
            i += 1
            if option in several or not option:
                # a list (argparse's nargs '+': every word up to the next option); an unknown
                # flag takes them too, one refusal rather than one per word
                while i < len(words) and not _is_option(words[i]):
                    value, i = f"{value} {words[i]}", i + 1
        flags.append(GivenFlag(typed, option, name, value, negated, note))
    for base, (keys, merged) in dotted.items():
        # After every other flag, as vLLM appends them: the dotted keys replace a whole JSON
        # value given for the same flag, wherever on the line it was.
        option, _, note = _resolve(base, known, version)
        name = _name_of(option, names)
        shown = f"{base}.{keys[0]}" if len(keys) == 1 else f"{base}.{{{','.join(dict.fromkeys(keys))}}}"
        flags.append(GivenFlag(shown, option, name, json.dumps(merged), False, note))
    return positional, flags


def _name_of(option: str, names: dict[str, str]) -> str | None:
    """The underscore name an option resolves to: the table's, else its own spelling's; None
    for an option the parser does not take ("")."""
    if not option:
        return None
    return names.get(option) or option.lstrip("-").replace("-", "_")


def _merge(merged: dict[str, Any], path: str, text: str) -> None:
    """One dotted key into ``merged``: its value JSON where it parses, else a human-readable
    integer (``1k``, ``2M``), else the text; ``key+`` appends the comma-separated items to a
    list (vLLM's ``FlexibleArgumentParser.parse_args``)."""
    value: Any
    if path.endswith("+"):
        path, value = path[:-1], text.split(",")
    else:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = _human_int(text)
    *parents, last = path.split(".")
    node = merged
    for key in parents:
        if not isinstance(node.get(key), dict):
            node[key] = {}  # a value given before is replaced, as vLLM's recursive update does
        node = node[key]
    if isinstance(value, list) and isinstance(node.get(last), list):
        node[last] = node[last] + value
    else:
        node[last] = value


def _human_int(text: str) -> Any:
    """``25.6k`` -> 25600, ``1K`` -> 1024 (vLLM's ``human_readable_int``); other text as it is,
    as vLLM keeps it when that parse fails."""
    try:
        return HumanInt().parse(text)
    except ValueError:
        return text


def _is_option(word: str) -> bool:
    return word.startswith("-") and not _NUMBER.match(word) and word != "-"


def _option_names(version: EngineVersion) -> dict[str, str]:
    """option string -> the table's underscore name, for the table's flags and their aliases."""
    found: dict[str, str] = {}
    for spec in version.flags:
        found[version.option(spec.name)] = spec.name
        for alias in spec.aliases:
            found[alias] = spec.name
    return found


def _resolve(typed: str, known: frozenset[str], version: EngineVersion) -> tuple[str, bool, str]:
    """(the option it resolves to or "", negated, note) as the engine's parser would."""
    option = typed
    if version.underscores and option.startswith("--"):
        option = "--" + option[2:].replace("_", "-")
    if option.startswith("--no-") and "--" + option[5:] in known:
        return "--" + option[5:], True, ""  # before the --no- spelling itself, which parsers list too
    if option in known:
        return option, False, ""
    if version.abbrev and option.startswith("--"):
        prefixed = sorted(k for k in known if k.startswith(option))
        if len(prefixed) == 1:
            return prefixed[0], False, f"abbreviation of {prefixed[0]}"
        if len(prefixed) > 1:
            return "", False, f"ambiguous: {', '.join(prefixed[:4])}"
    return "", False, _suggest(typed, known, version)


def _suggest(typed: str, known: frozenset[str], version: EngineVersion) -> str:
    """``did you mean --x?``: the engine's own spelling first (dashes or underscores), then the
    closest option."""
    other = "--" + (typed[2:].replace("_", "-") if version.dashes else typed[2:].replace("-", "_"))
    if other in known and other != typed:
        return f"did you mean {other}?"
    close = difflib.get_close_matches(other, sorted(known), n=1, cutoff=0.75)
    return f"did you mean {close[0]}?" if close else ""
