"""Virtual Token Counter (Sheng et al., OSDI'24, "Fairness in Serving Large Language Models").

One counter per tenant, the weighted service it has received: every prefill token adds
``input_price / weight``, every generated token ``output_price / weight`` (the paper's
``w_p = 1``, ``w_q = 2``; weights from ``--tenant-weights a=2,b=1``, 1 for a tenant not named).
The scheduler admits next from the backlogged tenant (one with a waiting request) whose counter
is the smallest, its oldest request first.

Counter lift (the paper's Algorithm 2, ``MonitorStream``): when a tenant's queue goes from empty
to non-empty, its counter is raised to ``max(own, min over the other backlogged tenants)``, or,
when no other tenant is backlogged, to ``max(own, l)`` with ``l`` the counter of the last tenant
whose queue emptied — so a tenant cannot bank credit while idle and then monopolise the engine.
(The paper's artifact, ``slora/server/router/vtc_req_queue.py``, keeps only the first case.)

Bound (the paper's Theorem 4.4): between two tenants backlogged over an interval, the
difference of their weighted services is at most ``2 * max(w_p * L_input, w_q * M)``, with
``L_input`` the longest prompt and ``M`` the most tokens a running batch can hold (KV capacity).

What counts as served here: the tokens granted, when they are granted — a prefill chunk's tokens
at ``input_price`` when the chunk is scheduled (a prefix-cache hit is not computed, so not
charged; a recompute after preemption is computed again, so charged again), one decode token at
``output_price``. Without chunking or prefix hits this is the paper's accounting exactly.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

DEFAULT_INPUT_PRICE = 1.0  # w_p
DEFAULT_OUTPUT_PRICE = 2.0  # w_q
UNNAMED_TENANT = ""  # requests without a tenant id share one counter


def parse_tenant_weights(text: str) -> dict[str, float]:
    """``a=2,b=1`` -> {"a": 2.0, "b": 1.0}; ValueError naming the bad item. Items may also be
    separated by ``/`` or ``;`` (inside a ``policy:flag=value,...`` spec, where commas split flags)."""
    weights: dict[str, float] = {}
    for raw in re.split(r"[,;/]", text):
        item = raw.strip()
        if not item:
            continue
        name, eq, value = item.partition("=")
        name = name.strip()
        try:
            weight = float(value)
        except ValueError:
            weight = float("nan")
        if not eq or not name or not weight > 0 or weight == float("inf"):
            raise ValueError(
                f"--tenant-weights item {item!r} is not TENANT=WEIGHT with WEIGHT > 0, e.g. a=2,b=1"
            )
        if name in weights:
            raise ValueError(f"--tenant-weights names tenant {name!r} twice")
        weights[name] = weight
    return weights


@dataclass(slots=True)
class VirtualTokenCounter:
    weights: dict[str, float] = field(default_factory=dict)
    input_price: float = DEFAULT_INPUT_PRICE
    output_price: float = DEFAULT_OUTPUT_PRICE
    counters: dict[str, float] = field(default_factory=dict)
    last_left: float = 0.0  # counter of the last tenant whose queue emptied (the paper's l)

    def __post_init__(self) -> None:
        if not self.input_price >= 0 or not self.output_price >= 0:
            raise ValueError(f"VTC prices must be >= 0, got {self.input_price}, {self.output_price}")

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def on_backlogged(self, tenant: str, others: Iterable[str]) -> None:
        """``tenant``'s queue just went from empty to non-empty; ``others`` are the tenants
        that were already backlogged. Applies the counter lift."""
        floor = min((self.counter(t) for t in others if t != tenant), default=None)
        if floor is None:
            floor = self.last_left
        self.counters[tenant] = max(self.counter(tenant), floor)

    def on_idle(self, tenant: str) -> None:
        """``tenant``'s queue just emptied."""
        self.last_left = self.counter(tenant)

    def charge(self, tenant: str, num_prefill_tokens: int = 0, num_decode_tokens: int = 0) -> None:
        cost = num_prefill_tokens * self.input_price + num_decode_tokens * self.output_price
        if cost:
            self.counters[tenant] = self.counter(tenant) + cost / self.weight(tenant)

    def pick(self, tenants: Iterable[str]) -> str | None:
        """The tenant with the smallest counter (ties: the first given), None if none."""
        best: str | None = None
        best_value = 0.0
        for t in tenants:
            value = self.counter(t)
            if best is None or value < best_value:
                best, best_value = t, value
        return best

    def bound(self, max_input_len: int, max_batch_tokens: int) -> float:
        """The paper's bound on the weighted service difference of two backlogged tenants of
        weight 1: ``2 * max(w_p * L_input, w_q * M)``."""
        return 2.0 * max(self.input_price * max_input_len, self.output_price * max_batch_tokens)


def tenant_of(tenant_id: str | None) -> str:
    return tenant_id if tenant_id is not None else UNNAMED_TENANT
