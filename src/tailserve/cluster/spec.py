"""``--cluster 2xH100-SXM:tp1,2xA100-80GB:tp2`` and ``--replicas N``: the replicas to build.

An item is ``[COUNTx]GPU[:tpN][:ppN]``; without a TP it takes the run's ``--tp`` (by default the
seed's TP 4 for Llama-3-70B on A100-80GB, 1 otherwise, as for every command), without a PP the
run's ``--pipeline-parallel-size``; the rest of the run's deployment (``--quantization``,
``--kv-cache-dtype``, expert parallelism, ``--kernels``, the routing) on every replica. Every replica runs the
run's model and policy. A bad item is one ValueError line naming it.
"""

from __future__ import annotations

import re
from dataclasses import replace

from tailserve.cluster.replica import ReplicaSpec
from tailserve.executors.simulated.deployment import Deployment
from tailserve.policies.registry import PolicySpec

_ITEM = re.compile(
    r"^(?:(?P<count>\d+)\s*[xX*]\s*)?(?P<gpu>[^:]+?)(?::\s*tp\s*=?\s*(?P<tp>\d+))?"
    r"(?::\s*pp\s*=?\s*(?P<pp>\d+))?$",
    re.IGNORECASE,
)

MAX_REPLICAS = 1024  # a typo guard, not a limit of the simulator


def parse_cluster(
    text: str,
    model: str,
    policy: PolicySpec,
    *,
    tp: int | None = None,
    calibration: str = "auto",
    pp: int = 1,
    pp_link: str = "auto",
    base: Deployment | None = None,
) -> list[ReplicaSpec]:
    """``base``: the run's deployment, whose number formats, expert parallelism, kernels and
    routing every replica keeps (an item sets only its GPU, TP and PP)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError(f"--cluster {text!r}: no replicas (expected e.g. 2xH100-SXM:tp1,2xA100-80GB:tp2)")
    specs: list[ReplicaSpec] = []
    for item in items:
        m = _ITEM.match(item)
        if m is None:
            raise ValueError(f"--cluster item {item!r} is not [COUNTx]GPU[:tpN][:ppN], e.g. 2xH100-SXM:tp1")
        count = int(m["count"]) if m["count"] else 1
        if count < 1:
            raise ValueError(f"--cluster item {item!r}: the count must be >= 1")
        item_tp = int(m["tp"]) if m["tp"] else tp
        item_pp = int(m["pp"]) if m["pp"] else pp
        try:
            # Without a TP anywhere, the same default as every command: the seed's TP 4 for
            # Llama-3-70B on A100-80GB, 1 otherwise.
            deployment = Deployment.of(
                model, m["gpu"].strip(), item_tp, calibration, pp=item_pp, pp_link=pp_link
            )
            if base is not None:
                deployment = replace(base, hardware=deployment.hardware, tp=deployment.tp, pp=item_pp)
        except ValueError as e:
            raise ValueError(f"--cluster item {item!r}: {e}") from None
        specs.extend(ReplicaSpec(deployment, policy) for _ in range(count))
    if len(specs) > MAX_REPLICAS:
        raise ValueError(f"--cluster {text!r}: {len(specs)} replicas, more than {MAX_REPLICAS}")
    return specs


def replicated(
    count: int, deployment: Deployment, policy: PolicySpec, flag: str = "--replicas"
) -> list[ReplicaSpec]:
    if count < 1:
        raise ValueError(f"{flag} must be >= 1, got {count}")
    if count > MAX_REPLICAS:
        raise ValueError(f"{flag} {count} is more than {MAX_REPLICAS}")
    return [ReplicaSpec(deployment, policy) for _ in range(count)]
