"""A file of engine options that a launch line names, read as the engine reads it: TensorRT-LLM's
``--extra_llm_api_options FILE`` / ``--config FILE`` (its table: ``trtllm_options.py``).

Each key is one ``Row`` (shown ``FILE:KEY``): the table's verdict for the keys it has, ``other``
for the rest of the keys the engine's validation takes, ``unknown`` for a key it does not (the
engine refuses to start). Keys of the ``sections`` (``scheduler_config``, ``kv_cache_config``) are
read one by one; any other key is one row whatever it holds. A command-line flag the file also
sets becomes a no-op, and says which key won (``OptionsFile.overrides``). The path is read from
the current directory, as the engine would read it from its own. A file that is not there is a
warning on the flag's row (``unread``); a file that is not a YAML mapping is one line, a
``ValueError``, as a flag with a value of the wrong type is.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

import yaml

from tailserve.core.config_flags import base_kind, choices_of, convert, kind_name
from tailserve.engines.flag_spec import FATAL, NO_OP, NOT_MODELLED, OTHER, UNKNOWN, EngineVersion, Row


def with_options_file(
    rows: list[Row], version: EngineVersion, label: str
) -> tuple[list[Row], tuple[str, ...]]:
    """``rows`` (a line's flags) with the keys of the options file its flag names after them,
    the flags the file overrides turned no-op; and the paths that were not there."""
    options = version.options_file
    named = [
        i for i, row in enumerate(rows) if options and row.name == options.flag and row.verdict not in FATAL
    ]
    if options is None or not named:
        return rows, ()
    i = named[-1]  # click keeps the last of an option given twice
    flag = rows[i]
    path = Path(os.path.expanduser(str(flag.value)))
    if not path.is_file():
        rows = list(rows)
        rows[i] = Row(
            flag.flag, flag.name, flag.value, NOT_MODELLED,
            f"warning: {flag.value} is not there (looked from {os.getcwd()}): its options are not read; "
            f"{label} stops at start when it cannot open the file", flag.source,
        )  # fmt: skip
        return rows, (str(flag.value),)
    keys = [_row(f"{path.name}:{key}", key, value, version, label) for key, value in _items(path, version)]
    given = {row.name: row for row in keys if row.name is not None}
    out: list[Row] = []
    for row in rows:
        winner = given.get(options.overrides.get(row.name or ""))
        if winner is None or row.verdict in FATAL:
            out.append(row)
            continue
        out.append(
            Row(
                row.flag, row.name, row.value, NO_OP,
                f"overridden by {winner.flag} ({_text(winner.value)}): {label} applies the file over its flags",
                options.precedence, row.feeds,
            )
        )  # fmt: skip
        given[winner.name] = _over(winner, row)
    return out + [given.get(row.name, row) if row.name else row for row in keys], ()


def _over(winner: Row, flag: Row) -> Row:
    what = f"{winner.what} (wins over {flag.flag} {_text(flag.value)})"
    return Row(winner.flag, winner.name, winner.value, winner.verdict, what, winner.source, winner.feeds)


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _items(path: Path, version: EngineVersion) -> list[tuple[str, Any]]:
    """The file's keys by dotted path, in its order; ValueError (one line) for a file the engine
    cannot read as a mapping of options."""
    assert version.options_file is not None
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not YAML: {_problem(e)}") from None
    if not isinstance(data, dict):
        got = "nothing" if data is None else f"a {type(data).__name__}"
        raise ValueError(f"{path}: expected a mapping of LLM API options (key: value lines), got {got}")
    items: list[tuple[str, Any]] = []
    for key, value in data.items():
        key = str(key)
        if "." in key:
            # A dotted name at the top is no option of the engine's: quoted, it matches none.
            items.append((f"'{key}'", value))
        elif key not in version.options_file.sections:
            items.append((key, value))
        elif isinstance(value, dict):
            items += [(f"{key}.{sub}", v) for sub, v in value.items()]
        else:
            raise ValueError(f"{path}: {key} is a mapping of its own options ({key}: {{...}}), got {value!r}")
    return items


def _problem(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def _row(shown: str, key: str, value: Any, version: EngineVersion, label: str) -> Row:
    assert version.options_file is not None
    spec = version.options_file.spec(key)
    if spec is not None:
        typed = _typed(shown, spec.kind, value)
        return Row(shown, key, typed, spec.verdict, spec.what, spec.source, spec.feeds)
    known = version.known_keys()
    listed = f"{label}'s LLM API (engines/known/{version.known_name}-options.txt)"
    if key in known:
        return Row(
            shown, key, value, OTHER, "an LLM API option of no scheduling effect tailserve reads", listed
        )
    what = f"not an LLM API option of {label}: the engine refuses to start"
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
    what += f" (did you mean {close[0]}?)" if close else ""
    return Row(shown, None, value, UNKNOWN, what, version.options_file.refuses)


def _typed(shown: str, kind: Any, value: Any) -> Any:
    """A YAML value as the LLM API's pydantic field takes it (lax: "64" and 64.0 are 64); one
    line naming the key for one it refuses."""
    inner, optional = base_kind(kind)
    if value is None:
        if optional:
            return None
        raise ValueError(f"{shown}: needs a value ({kind_name(kind)})")
    if inner in (dict, list):
        if isinstance(value, inner):
            return value
        raise ValueError(f"{shown}: expected a {'mapping' if inner is dict else 'list'}, got {value!r}")
    if isinstance(value, str):
        try:
            return convert(value, inner)
        except ValueError as e:
            raise ValueError(f"{shown}: {e}") from None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if inner is bool and isinstance(value, bool):
        return value
    if inner is int and number and float(value).is_integer():
        return int(value)
    if inner is float and number:
        return float(value)
    choices = choices_of(inner)
    expected = f"one of {', '.join(choices)}" if choices else kind_name(inner)
    raise ValueError(f"{shown}: {value!r} is not {expected}")
