"""Config dataclass fields set from text: the one converter behind every ``flag=value`` spelling
(``--max-num-seqs 64``, ``vllm:max_num_seqs=64``, ``prefix-aware:cache_threshold=0.5``).

Standard library only: the routing code shared with ``tailserve router`` imports it
(tests/test_layering.py), as do the policy registry and the command line.

The rules, by the field's annotation:

- ``bool``: ``1 true yes on`` / ``0 false no off``, any case.
- ``int``: an integer, or a number with no fractional part (``1e3`` is 1000, ``1.5`` is refused).
- ``float``: any float.
- ``X | None``: ``none``, ``null`` or the empty text unset it; anything else is an ``X``.
- ``Literal["a", "b"]`` or ``metadata={"choices": (...)}``: one of them.
- ``tuple[float, ...]``: floats separated by commas, slashes or spaces (``0.8,0.5``; in a
  ``name:flag=value`` policy spec, where commas separate policies, ``0.8/0.5``), brackets
  allowed (``[0.8, 0.5]``, vLLM's JSON spelling).
- anything else (``str``): the text itself.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

NONE_WORDS = ("none", "null", "")
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def field_kinds(cls: type) -> dict[str, Any]:
    """Each field of a config dataclass with its resolved annotation, in definition order."""
    return dict(_field_kinds(cls))


@functools.cache
def _field_kinds(cls: type) -> tuple[tuple[str, Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))


def field_choices(cls: type) -> dict[str, tuple[Any, ...]]:
    """The fields whose values are a fixed set: a ``Literal`` annotation or ``choices`` in the
    field's metadata."""
    kinds = field_kinds(cls)
    found: dict[str, tuple[Any, ...]] = {}
    for f in dataclasses.fields(cls):
        choices = f.metadata.get("choices") or choices_of(kinds[f.name])
        if choices:
            found[f.name] = tuple(choices)
    return found


def base_kind(kind: Any) -> tuple[Any, bool]:
    """``int | None`` -> (int, True); ``int`` -> (int, False)."""
    args = typing.get_args(kind)
    if type(None) in args and typing.get_origin(kind) is not typing.Literal:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True  # noqa: UP007
    return kind, False


def choices_of(kind: Any) -> tuple[Any, ...] | None:
    """A ``Literal``'s values (after ``| None``), else None."""
    kind, _ = base_kind(kind)
    return typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else None


def is_float_tuple(kind: Any) -> bool:
    """``tuple[float, ...]`` (after ``| None``)."""
    return number_tuple_item(kind) is float


def number_tuple_item(kind: Any) -> type | None:
    """``float`` for ``tuple[float, ...]``, ``int`` for ``tuple[int, ...]`` (after ``| None``);
    None for any other kind."""
    kind, _ = base_kind(kind)
    if typing.get_origin(kind) is not tuple:
        return None
    args = typing.get_args(kind)
    return args[0] if len(args) == 2 and args[1] is Ellipsis and args[0] in (int, float) else None


def kind_name(kind: Any) -> str:
    """``int``, ``float or none``, ``bool``, ``one of fcfs, lpm``: for messages and help."""
    inner, optional = base_kind(kind)
    choices = choices_of(inner)
    if is_float_tuple(inner):
        name = "floats (0.8,0.5 or 0.8/0.5)"
    elif number_tuple_item(inner) is int:
        name = "whole numbers (1,2,4 or 1/2/4)"
    else:
        name = f"one of {', '.join(map(str, choices))}" if choices else getattr(inner, "__name__", str(inner))
    return f"{name} or none" if optional else name


def _whole(text: str) -> int:
    """An int from ``8`` or ``8.0`` (a count written as a float); ValueError for ``2.5``."""
    number = float(text)
    if not number.is_integer():
        raise ValueError(text)
    return int(number)


def is_bool(kind: Any) -> bool:
    return base_kind(kind)[0] is bool


def convert(text: Any, kind: Any, choices: tuple[Any, ...] | None = None) -> Any:
    """``text`` as a value of ``kind``; a value that is not text is returned as it is (already
    typed, e.g. by argparse). A bad one raises ``ValueError("'x' is not a valid int")``; callers
    prefix what was being set."""
    if not isinstance(text, str):
        return text
    inner, optional = base_kind(kind)
    if optional and text.strip().lower() in NONE_WORDS:
        return None
    item = number_tuple_item(inner)
    if item is not None:
        parts = text.strip().strip("[]()").replace(",", " ").replace("/", " ").split()
        try:
            return tuple(float(part) for part in parts) if item is float else tuple(_whole(p) for p in parts)
        except ValueError:
            kind_text = "floats" if item is float else "whole numbers"
            raise ValueError(f"{text!r} is not a list of {kind_text}") from None
    choices = choices or choices_of(inner)
    if choices is not None:
        for choice in choices:
            if text == str(choice):
                return choice
        raise ValueError(f"{text!r} is not one of {', '.join(map(str, choices))}")
    try:
        if inner is bool:
            low = text.strip().lower()
            if low in TRUE_WORDS:
                return True
            if low in FALSE_WORDS:
                return False
            raise ValueError
        if inner is int:
            try:
                return int(text)
            except ValueError:
                number = float(text)  # 1e6 is fine for a count, 1.5 is not
                if not number.is_integer():
                    raise
                return int(number)
        if inner is float:
            return float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a valid {getattr(inner, '__name__', inner)}") from None
    return text
