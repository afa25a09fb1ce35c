"""Routers by CLI name and the ``name:flag=value,...`` spec that builds one.

``make_router("prefix-aware:cache_threshold=0.5,balance_abs_threshold=32")``; dashes work for
underscores in names and flags. A bad name, flag or value is one ValueError line naming it.
"""

from __future__ import annotations

import typing
from dataclasses import fields
from typing import Any

from tailserve.cluster.prefix_routers import KvAwareRouter, PrefixAwareRouter
from tailserve.cluster.routers import (
    BaseRouter,
    LeastKvRouter,
    LeastRequestsRouter,
    PowerOfTwoRouter,
    RandomRouter,
    RoundRobinRouter,
    SessionRouter,
)

ROUTERS: dict[str, type[BaseRouter]] = {
    cls.name: cls
    for cls in (
        RoundRobinRouter,
        RandomRouter,
        LeastRequestsRouter,
        LeastKvRouter,
        PowerOfTwoRouter,
        SessionRouter,
        PrefixAwareRouter,
        KvAwareRouter,
    )
}

# The engines' own spellings of the same policies.
_ALIASES = {
    "rr": "round-robin",
    "cache-aware": "prefix-aware",
    "kv": "kv-aware",
    "least-loaded": "least-requests",
    "least-request": "least-requests",
    "power-of-2": "power-of-two",
    "p2c": "power-of-two",
    "session-affinity": "session",
}


def resolve_router_name(name: str) -> str:
    key = name.strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; known: {', '.join(ROUTERS)}")
    return key


def router_flags(name: str) -> dict[str, Any]:
    """The router's flags with their defaults."""
    cls = ROUTERS[resolve_router_name(name)]
    return {f.name: f.default for f in fields(cls.config_cls)}


def parse_router_spec(text: str) -> tuple[str, dict[str, Any]]:
    """``name[:flag=value,...]`` -> (canonical name, typed flags)."""
    head, _, rest = text.strip().partition(":")
    name = resolve_router_name(head)
    cls = ROUTERS[name]
    hints = typing.get_type_hints(cls.config_cls)
    known = {f.name for f in fields(cls.config_cls)}
    flags: dict[str, Any] = {}
    for part in (p.strip() for p in rest.replace(":", ",").split(",")):
        if not part:
            continue
        key, eq, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key:
            raise ValueError(f"router spec {text!r}: {part!r} is not flag=value")
        if key not in known:
            valid = ", ".join(sorted(known)) or "none"
            raise ValueError(f"router {name} has no flag {key!r}; valid: {valid}")
        flags[key] = _convert(name, key, value.strip(), hints[key])
    return name, flags


def make_router(text: str, **kwargs: Any) -> BaseRouter:
    """A router from its spec; ``kwargs`` go to the constructor (``kv_index=`` for kv-aware)."""
    name, flags = parse_router_spec(text)
    cls = ROUTERS[name]
    try:
        config = cls.config_cls(**flags)
    except (TypeError, ValueError) as e:
        raise ValueError(f"router {name}: {e}") from None
    return cls(config, **kwargs)


def _convert(router: str, key: str, text: str, kind: Any) -> Any:
    try:
        if kind is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            value = float(text)  # 1e6 is fine for a count, 1.5 is not
            if not value.is_integer():
                raise ValueError
            return int(value)
        if kind is float:
            return float(text)
    except ValueError:
        raise ValueError(
            f"router {router} flag {key}: {text!r} is not a valid {getattr(kind, '__name__', kind)}"
        ) from None
    return text
