"""Routers by CLI name and the ``name:flag=value,...`` spec that builds one.

``make_router("prefix-aware:cache_threshold=0.5,balance_abs_threshold=32")``; dashes work for
underscores in names and flags. A bad name, flag or value is one ValueError line naming it.
"""

from __future__ import annotations

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
    VllmDpRouter,
)
from tailserve.core.config_flags import convert, field_choices, field_kinds

ROUTERS: dict[str, type[BaseRouter]] = {
    cls.name: cls
    for cls in (
        RoundRobinRouter,
        RandomRouter,
        LeastRequestsRouter,
        LeastKvRouter,
        VllmDpRouter,
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
    kinds = field_kinds(cls.config_cls)
    choices = field_choices(cls.config_cls)
    flags: dict[str, Any] = {}
    for part in (p.strip() for p in rest.replace(":", ",").split(",")):
        if not part:
            continue
        key, eq, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key:
            raise ValueError(f"router spec {text!r}: {part!r} is not flag=value")
        if key not in kinds:
            valid = ", ".join(sorted(kinds)) or "none"
            raise ValueError(f"router {name} has no flag {key!r}; valid: {valid}")
        try:
            flags[key] = convert(value.strip(), kinds[key], choices.get(key))
        except ValueError as e:
            raise ValueError(f"router {name} flag {key}: {e}") from None
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
