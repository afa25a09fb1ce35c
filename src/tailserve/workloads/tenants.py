"""Tenants: who sent each request, for fairness (``--fairness vtc``) and per-tenant SLO classes.

Two ways to make a multi-tenant workload:

- a **mix** (``--tenants a=0.9,b=0.1``): any workload's requests get a tenant drawn from the
  fractions as they arrive (``TenantSource``, its own seeded stream, so lengths and arrival
  times stay those of the workload);
- **per-tenant streams** (``--tenant-rates a=10,b=1``): each tenant its own Poisson process at
  its own rate (requests/s), lengths from the workload's distributions, merged by arrival time
  (``tenant_streams``) — so one tenant can send 10x its share while the other's traffic is
  exactly what it would be alone.

Traces carry a tenant in tailserve's JSONL (``tenant_id``); the server takes the OpenAI ``user``
field or an ``X-Tenant-Id`` header.
"""

from __future__ import annotations

import re

import numpy as np

from tailserve.core.request import Request
from tailserve.core.source import RequestSource
from tailserve.workloads.arrivals import poisson_arrivals
from tailserve.workloads.lengths import LengthDist
from tailserve.workloads.mix_source import MixSource

_TENANT = re.compile(r"^[A-Za-z0-9_.:@-]+$")


def _parse_pairs(text: str, flag: str, what: str, example: str) -> tuple[tuple[str, float], ...]:
    pairs: list[tuple[str, float]] = []
    for raw in text.split(","):
        item = raw.strip()
        name, eq, value = item.partition("=")
        name = name.strip()
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        if not eq or not _TENANT.match(name) or not number >= 0 or number == float("inf"):
            raise ValueError(f"{flag} item {item!r} is not TENANT={what} with {what} >= 0, e.g. {example}")
        if any(name == n for n, _ in pairs):
            raise ValueError(f"{flag} names tenant {name!r} twice")
        pairs.append((name, number))
    if not pairs or not sum(v for _, v in pairs) > 0:
        raise ValueError(f"{flag} needs a tenant with a positive {what}, e.g. {example}")
    return tuple(pairs)


def parse_tenant_mix(text: str) -> tuple[tuple[str, float], ...]:
    """``a=0.9,b=0.1`` -> (("a", 0.9), ("b", 0.1)); the fractions must sum to 1."""
    mix = _parse_pairs(text, "--tenants", "FRACTION", "a=0.9,b=0.1")
    if abs(sum(f for _, f in mix) - 1.0) > 1e-6:
        raise ValueError(f"--tenants fractions must sum to 1, got {sum(f for _, f in mix):g} in {text!r}")
    return mix


def parse_tenant_rates(text: str) -> tuple[tuple[str, float], ...]:
    """``a=10,b=1`` -> (("a", 10.0), ("b", 1.0)): requests/s per tenant."""
    return _parse_pairs(text, "--tenant-rates", "RATE", "a=10,b=1")


class TenantSource(MixSource):
    """Gives each arriving request a tenant drawn from a seeded mix (any workload)."""

    def __init__(self, source: RequestSource, mix: tuple[tuple[str, float], ...], seed: int) -> None:
        super().__init__(source, "tenant_id", mix, seed + 104729)


def tenant_streams(
    rates: tuple[tuple[str, float], ...],
    duration: float,
    input_len: LengthDist,
    output_len: LengthDist,
    seed: int = 0,
) -> list[Request]:
    """Each tenant's Poisson arrivals at its rate over ``duration`` seconds, merged by arrival
    time; ids ``<tenant>-<i>``. A tenant's requests depend only on its name, rate and the seed,
    so the same tenant alone (``rates`` of one) gets exactly the same requests."""
    if not duration > 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration}")
    out: list[Request] = []
    for name, rate in rates:
        if rate <= 0:
            continue
        # A stable per-tenant seed (not Python's salted hash): the same tenant, the same stream.
        tenant_seed = seed * 1_000_003 + sum((i + 1) * ord(c) for i, c in enumerate(name))
        rng = np.random.default_rng(tenant_seed)
        n = max(1, int(rng.poisson(rate * duration)))
        arrivals = poisson_arrivals(n, rate, rng)
        prompts = input_len.sample(n, rng)
        outputs = output_len.sample(n, rng)
        out.extend(
            Request(f"{name}-{i}", int(prompts[i]), int(outputs[i]), float(arrivals[i]), tenant_id=name)
            for i in range(n)
            if arrivals[i] <= duration
        )
    out.sort(key=lambda r: (r.arrival_time, r.request_id))
    return out
