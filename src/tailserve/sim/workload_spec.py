"""What workload to simulate (``WorkloadSpec``: the built-in workload or trace and its knobs,
each default once: the CLI reads them from here) and the ``--priorities`` mix."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from tailserve.workloads.arrivals import ArrivalSpec
from tailserve.workloads.lengths import Fixed, LengthDist

WORKLOADS = ("hol", "chat", "random", "shared-prefix", "multi-turn")


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    name: str = "hol"  # hol | chat | random | trace
    num_requests: int = 200
    rate: float = 4.0  # requests per second
    seed: int = 0
    input_len: LengthDist = field(default_factory=lambda: Fixed(1024))
    output_len: LengthDist = field(default_factory=lambda: Fixed(128))
    arrival: ArrivalSpec = field(default_factory=lambda: ArrivalSpec("poisson"))
    trace_path: str | None = None
    rate_scale: float = 1.0
    max_requests: int | None = None
    # (priority value, fraction of requests) pairs; empty = every request has priority 0.
    priorities: tuple[tuple[int, float], ...] = ()
    # (tenant, fraction of requests) pairs (``--tenants a=0.9,b=0.1``); empty = no tenant ids.
    tenants: tuple[tuple[str, float], ...] = ()
    # shared-prefix: system prompts, their length (tokens), the fraction of requests using one
    num_prefixes: int = 4
    prefix_len: int = 1024
    shared_fraction: float = 0.8
    # multi-turn: sessions (started at ``rate`` per second), turns per session, think time (s)
    num_sessions: int = 40
    turns: tuple[int, int] = (2, 6)
    think_time: float = 5.0
    system_prompt_len: int = 256

    def __post_init__(self) -> None:
        if self.name not in (*WORKLOADS, "trace"):
            raise ValueError(
                f"unknown workload {self.name!r}; known: {', '.join(WORKLOADS)} (or --trace PATH)"
            )
        if self.rate <= 0:
            raise ValueError(f"--rate must be > 0 requests/s, got {self.rate}")
        if self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        if self.rate_scale <= 0:
            raise ValueError(f"--rate-scale must be > 0, got {self.rate_scale}")
        if self.seed < 0:  # numpy's generators take none (its message named no flag)
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        # Empty work is an error, not a table of dashes with exit status 0.
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"--max-requests must be >= 1, got {self.max_requests}")
        if self.name == "multi-turn" and self.num_sessions < 1:
            raise ValueError(f"--num-sessions must be >= 1, got {self.num_sessions}")
        if self.priorities and (
            any(f < 0 for _, f in self.priorities) or abs(sum(f for _, f in self.priorities) - 1) > 1e-6
        ):
            raise ValueError(f"--priorities fractions must be >= 0 and sum to 1, got {self.priorities}")

    @property
    def label(self) -> str:
        if self.name == "trace":
            return f"trace {Path(self.trace_path or '').name} (rate x{self.rate_scale:g})"
        if self.name == "hol":
            return "hol (10 decoding requests + one 8,192-token prompt)"
        if self.name == "multi-turn":
            return f"multi-turn ({self.num_sessions} sessions at {self.rate:g}/s, seed {self.seed})"
        if self.name == "shared-prefix":
            return (
                f"shared-prefix ({self.num_requests} requests at {self.rate:g}/s, {self.num_prefixes} x "
                f"{self.prefix_len}-token prompts shared by {self.shared_fraction:.0%}, seed {self.seed})"
            )
        return f"{self.name} ({self.num_requests} requests at {self.rate:g}/s, seed {self.seed})"


def parse_priorities(text: str) -> tuple[tuple[int, float], ...]:
    """``0=0.8,10=0.2`` -> ((0, 0.8), (10, 0.2)): priority value = fraction of requests."""
    mix = []
    for item in text.split(","):
        value, eq, fraction = item.strip().partition("=")
        try:
            mix.append((int(value), float(fraction)))
        except ValueError:
            raise ValueError(
                f"--priorities item {item!r} is not PRIORITY=FRACTION, e.g. 0=0.8,10=0.2"
            ) from None
        if not eq or not math.isfinite(mix[-1][1]):  # NaN: numpy's "Total of weights must be finite"
            raise ValueError(f"--priorities item {item!r} is not PRIORITY=FRACTION, e.g. 0=0.8,10=0.2")
    return tuple(mix)
