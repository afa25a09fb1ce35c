"""SGLang's waiting-queue order (``SchedulePolicy.calc_priority``, ``schedule_policy.py``), for
the ``sglang`` policy: ``fcfs`` (a priority sort with ``enable_priority_scheduling``), ``lof``,
``random``, and the cache-aware ``lpm`` and ``dfs-weight`` over the radix tree
(``policies/sglang_radix.py``). Checked against SGLang's own ``calc_priority`` by
``validate/sglang_order.py``.
"""

from __future__ import annotations

import random

from tailserve.core.queues import FCFSRequestQueue
from tailserve.core.request import Request
from tailserve.kv.radix import RadixCache, RadixNode
from tailserve.policies.sglang_adder import queued_at
from tailserve.policies.sglang_config import CACHE_AWARE_POLICIES, SglangConfig
from tailserve.policies.sglang_radix import SglangRadix

LPM_FALLBACK_WAITING = 128  # WAITING_QUEUE_PREFIX_MATCH_MAX: lpm falls back to fcfs above this
IN_BATCH_CHECK = 32  # IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD
IN_BATCH_DEPRIORITIZE = 32  # IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD


def calc_priority(
    cfg: SglangConfig, radix: SglangRadix, waiting: FCFSRequestQueue, rng: random.Random, now: float
) -> None:
    """Order ``waiting`` in place by ``schedule_policy`` (``SchedulePolicy.calc_priority``)."""
    policy = cfg.schedule_policy
    if policy in CACHE_AWARE_POLICIES:
        if cfg.disable_radix_cache:
            policy = "fcfs"
        elif policy == "lpm" and len(waiting) > LPM_FALLBACK_WAITING:
            # SGLang skips the matching above 128 waiting and keeps the queue as it is, with
            # no priority sort (``calc_priority`` tests the configured policy, not the active
            # one, for fcfs's priority sort).
            return
        elif radix.tree is None:
            return  # no request carries token identities: every match is 0, keep the queue
        else:
            ordered = (
                _lpm_order(cfg, radix, waiting, now) if policy == "lpm" else _dfs_weight_order(radix, waiting)
            )
            waiting.reorder(ordered)
            return
    sign = 1 if cfg.schedule_low_priority_values_first else -1
    if policy == "fcfs":
        if cfg.enable_priority_scheduling:
            waiting.sort(key=lambda r: (r.priority * sign, queued_at(r)))
    elif policy == "lof":
        if cfg.enable_priority_scheduling:
            waiting.sort(key=lambda r: (r.priority * sign, -r.max_tokens))
        else:
            waiting.sort(key=lambda r: -r.max_tokens)
    else:  # random
        ordered = list(waiting)
        rng.shuffle(ordered)
        waiting.reorder(ordered)


def _lpm_order(cfg: SglangConfig, radix: SglangRadix, waiting: FCFSRequestQueue, now: float) -> list[Request]:
    """Descending match length (stable: ties keep queue order; priorities ignored, as in
    SGLang), plus ``lpm_aging_rate`` tokens per second waited since (re)queueing.

    In-batch prefix caching (``_compute_prefix_matches``): a request whose cached match is
    at most ``IN_BATCH_CHECK`` tokens is matched against the earlier such requests of this
    queue; sharing at least ``IN_BATCH_DEPRIORITIZE`` tokens with one of them sends it to the
    back (one of them computes the prefix first, the rest hit it later); otherwise its
    tokens join that in-queue tree. Found by the SGLang differential (docs/validation.md)."""
    rate = cfg.lpm_aging_rate
    in_queue = RadixCache(page_size=1)
    scored = []
    for request in waiting:
        full = radix.full_match(request)
        deprioritized = False
        if full is not None and full.num_tokens <= IN_BATCH_CHECK:
            keys = radix.keys(request)
            if in_queue.match_prefix(keys).num_tokens >= IN_BATCH_DEPRIORITIZE:
                deprioritized = True
            else:
                in_queue.insert(keys, range(len(keys)))
        match = radix.match(request)
        score = match.num_tokens if match is not None else 0
        if rate:
            score += rate * max(now - queued_at(request), 0.0)
        scored.append((float("inf") if deprioritized else -score, request))
    scored.sort(key=lambda x: x[0])
    return [r for _, r in scored]


def _dfs_weight_order(radix: SglangRadix, waiting: FCFSRequestQueue) -> list[Request]:
    """SGLang's ``dfs-weight``: weight of a node = waiting requests matched in its subtree;
    walk from the root, heavier children first, a node's own requests after its subtree."""
    root = radix.tree.root
    by_node: dict[int, list[Request]] = {}
    weight: dict[int, int] = {}
    nodes = []
    for request in waiting:
        match = radix.full_match(request)  # uncapped, as SGLang's calc_priority matches
        node = match.node if match is not None else root
        by_node.setdefault(id(node), []).append(request)
        nodes.append(node)
    for node in nodes:  # after every match: later matches may split earlier nodes' paths
        while node is not None:
            weight[id(node)] = weight.get(id(node), 0) + 1
            node = node.parent
    ordered: list[Request] = []
    stack: list[tuple[RadixNode, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            ordered.extend(by_node.get(id(node), ()))
            continue
        stack.append((node, True))
        children = [c for c in node.children.values() if id(c) in weight]
        children.sort(key=lambda c: -weight[id(c)])
        stack.extend((c, False) for c in reversed(children))
    return ordered
