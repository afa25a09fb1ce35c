"""SLO classes: the TTFT and TBT targets a request is scheduled against, and which requests
belong to which class.

Syntax (``--slo-classes``, or the ``slo`` policy's ``slo_classes`` flag): classes separated by
spaces or ``;``, each ``NAME=ttft:TIME,tbt:TIME`` with optional selectors ``priority:P`` and
``tenant:T`` (repeatable), and optionally one item ``default=NAME``::

    interactive=ttft:500ms,tbt:50ms,priority:0 batch=ttft:30s,tbt:200ms,priority:1 default=batch

A request's class: the class naming its tenant, else the class naming its priority, else the
default class (``default=NAME``, or the first class). Times take ``ms`` or ``s``; a bare number
is milliseconds, as in ``--slo``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from tailserve.core.request import Request

DEFAULT_SLO_CLASSES = "interactive=ttft:500ms,tbt:50ms,priority:0 batch=ttft:30s,tbt:200ms,priority:1"


@dataclass(frozen=True, slots=True)
class SloClass:
    name: str
    ttft: float  # seconds from arrival to the first token
    tbt: float  # seconds between consecutive tokens
    priorities: tuple[int, ...] = ()
    tenants: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.ttft > 0 or not self.tbt > 0:
            raise ValueError(f"SLO class {self.name}: ttft and tbt must be > 0, got {self.ttft}, {self.tbt}")


@dataclass(frozen=True, slots=True)
class SloClasses:
    classes: tuple[SloClass, ...]
    default: str

    def __post_init__(self) -> None:
        names = [c.name for c in self.classes]
        if not names:
            raise ValueError("--slo-classes defines no class")
        if len(set(names)) != len(names):
            raise ValueError(f"--slo-classes names a class twice: {', '.join(names)}")
        if self.default not in names:
            raise ValueError(
                f"--slo-classes default={self.default!r} is not a class; known: {', '.join(names)}"
            )
        seen: dict[object, str] = {}
        for c in self.classes:
            for key in [*(("priority", p) for p in c.priorities), *(("tenant", t) for t in c.tenants)]:
                if key in seen:
                    raise ValueError(f"--slo-classes: {key[0]} {key[1]} is in both {seen[key]} and {c.name}")
                seen[key] = c.name

    def by_name(self, name: str) -> SloClass:
        for c in self.classes:
            if c.name == name:
                return c
        raise KeyError(name)

    def of(self, request: Request) -> SloClass:
        """The class a request is scheduled against (tenant, then priority, then default)."""
        if request.tenant_id is not None:
            for c in self.classes:
                if request.tenant_id in c.tenants:
                    return c
        for c in self.classes:
            if request.priority in c.priorities:
                return c
        return self.by_name(self.default)


_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_USAGE = "e.g. interactive=ttft:500ms,tbt:50ms,priority:0 batch=ttft:30s,tbt:200ms"


def parse_time(raw: str, where: str) -> float:
    """``500ms``, ``30s``, or a bare number of milliseconds -> seconds."""
    text = raw.strip().lower()
    try:
        if text.endswith("ms"):
            value = float(text[:-2]) / 1000
        elif text.endswith("s"):
            value = float(text[:-1])
        else:
            value = float(text) / 1000
    except ValueError:
        raise ValueError(f"--slo-classes {where}: {raw!r} is not a time like 500ms or 30s") from None
    if not value > 0 or math.isinf(value):
        raise ValueError(f"--slo-classes {where}: a target must be a finite time > 0, got {raw!r}")
    return value


def parse_slo_classes(text: str) -> SloClasses:
    items = [i for i in re.split(r"[\s;]+", text.strip()) if i]
    if not items:
        raise ValueError(f"--slo-classes is empty; {_USAGE}")
    classes: list[SloClass] = []
    default: str | None = None
    for item in items:
        name, eq, body = item.partition("=")
        if not eq or not name or not body:
            raise ValueError(f"--slo-classes item {item!r} is not NAME=ttft:TIME,tbt:TIME; {_USAGE}")
        if name == "default":
            default = body
            continue
        if not _NAME.match(name):
            raise ValueError(f"--slo-classes: {name!r} is not a class name (letters, digits, _ . -)")
        targets: dict[str, float] = {}
        priorities: list[int] = []
        tenants: list[str] = []
        for part in body.split(","):
            key, colon, value = part.partition(":")
            key = key.strip().lower()
            if not colon or not value.strip():
                raise ValueError(f"--slo-classes {name}: {part!r} is not KEY:VALUE; {_USAGE}")
            if key in ("ttft", "tbt"):
                if key in targets:
                    raise ValueError(f"--slo-classes {name}: {key} given twice")
                targets[key] = parse_time(value, f"{name} {key}")
            elif key == "priority":
                try:
                    priorities.append(int(value))
                except ValueError:
                    raise ValueError(f"--slo-classes {name}: priority {value!r} is not an integer") from None
            elif key == "tenant":
                tenants.append(value.strip())
            else:
                raise ValueError(
                    f"--slo-classes {name}: unknown key {key!r}; keys are ttft, tbt, priority, tenant"
                )
        missing = [k for k in ("ttft", "tbt") if k not in targets]
        if missing:
            raise ValueError(f"--slo-classes {name}: no {' and no '.join(missing)} target; {_USAGE}")
        classes.append(SloClass(name, targets["ttft"], targets["tbt"], tuple(priorities), tuple(tenants)))
    if not classes:
        raise ValueError(f"--slo-classes defines no class; {_USAGE}")
    return SloClasses(tuple(classes), default or classes[0].name)
