"""SGLang's waiting-queue order (``SchedulePolicy.calc_priority``, ``schedule_policy.py``), for
the ``sglang`` policy: ``fcfs`` (a priority sort with ``enable_priority_scheduling``), ``lof``,
``random``, ``routing-key``, and the cache-aware ``lpm``, ``dfs-weight``, ``hrrn`` and
``shortest-prefill-first`` over the radix tree (``policies/sglang_radix.py``; the last two in
``sglang_order_work.py``). Checked against SGLang's own ``calc_priority`` by
``validate/sglang_order.py``.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

from tailserve.core.queues import FCFSRequestQueue
from tailserve.core.request import Request
from tailserve.kv.prefix import PrefixMatch
from tailserve.kv.radix import RadixCache, RadixNode
from tailserve.policies.sglang_adder import queued_at
from tailserve.policies.sglang_config import CACHE_AWARE_POLICIES, LARGE_QUEUE_FCFS_POLICIES, SglangConfig
from tailserve.policies.sglang_order_work import ProcessedTokens, hrrn_order, shortest_prefill_order
from tailserve.policies.sglang_radix import SglangRadix

LPM_FALLBACK_WAITING = 128  # WAITING_QUEUE_PREFIX_MATCH_MAX: lpm and hrrn fall back to fcfs above this
IN_BATCH_CHECK = 32  # IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD
IN_BATCH_DEPRIORITIZE = 32  # IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD


def calc_priority(
    cfg: SglangConfig,
    radix: SglangRadix,
    waiting: FCFSRequestQueue,
    rng: random.Random,
    now: float,
    running: Sequence[Request] = (),
    processed: ProcessedTokens | None = None,
) -> dict[str, int]:
    """Order ``waiting`` in place by ``schedule_policy`` (``SchedulePolicy.calc_priority``).
    ``running``: the running batch (``routing-key`` counts its keys); ``processed``: the
    scheduler's prefill-token counter and snapshots (``hrrn``). Returns each waiting request's
    uncapped radix match (SGLang's ``req.prefix_len``) where this pass matched the queue (a
    cache-aware policy outside its fallback, with a radix tree), else an empty dict."""
    policy = cfg.schedule_policy
    if policy in CACHE_AWARE_POLICIES:
        if cfg.disable_radix_cache:
            policy = "fcfs"
        elif policy in LARGE_QUEUE_FCFS_POLICIES and len(waiting) > LPM_FALLBACK_WAITING:
            # SGLang skips the matching above 128 waiting and keeps the queue as it is, with
            # no priority sort (``calc_priority`` tests the configured policy, not the active
            # one, for fcfs's priority sort).
            return {}
        elif policy in ("lpm", "dfs-weight"):
            if radix.tree is None:
                return {}  # no request carries token identities: every match is 0, keep the queue
            prefix: dict[str, int] = {}
            if policy == "lpm":
                ordered = _lpm_order(cfg, radix, waiting, now, prefix)
            else:
                ordered = _dfs_weight_order(radix, waiting, prefix)
            waiting.reorder(ordered)
            return prefix
        else:
            prefix, deprioritized = _match_queue(radix, waiting)
            matched = {r.request_id: min(prefix.get(r.request_id, 0), r.num_tokens - 1) for r in waiting}
            if policy == "hrrn":
                ordered = hrrn_order(waiting, matched, deprioritized, processed or ProcessedTokens())
            else:
                ordered = shortest_prefill_order(waiting, matched, deprioritized)
            waiting.reorder(ordered)
            return prefix
    sign = 1 if cfg.schedule_low_priority_values_first else -1
    if policy == "fcfs":
        if cfg.enable_priority_scheduling:
            waiting.sort(key=lambda r: (r.priority * sign, queued_at(r)))
    elif policy == "lof":
        if cfg.enable_priority_scheduling:
            waiting.sort(key=lambda r: (r.priority * sign, -r.max_tokens))
        else:
            waiting.sort(key=lambda r: -r.max_tokens)
    elif policy == "routing-key":
        _routing_key_sort(waiting, running)
    else:  # random
        ordered = list(waiting)
        rng.shuffle(ordered)
        waiting.reorder(ordered)
    return {}


def _routing_key_sort(waiting: FCFSRequestQueue, running: Sequence[Request]) -> None:
    """``_sort_by_routing_key``: requests whose routing key (tailserve's ``tenant_id``: the key a
    router groups a tenant's requests by, SGLang's ``X-SMG-Routing-Key`` header) is most common
    in the running batch first, ties by key; then the rest, by key (no key sorts as ""). Stable;
    the queue is kept when nothing running has a key."""
    counts = Counter(r.tenant_id for r in running if r.tenant_id)
    if not counts:
        return

    def key(request: Request) -> tuple[int, int, str]:
        k = request.tenant_id
        if k and k in counts:
            return (0, -counts[k], k)
        return (1, 0, k or "")

    waiting.sort(key=key)


def _deprioritize(
    in_queue: RadixCache, radix: SglangRadix, request: Request, full: PrefixMatch | None
) -> bool:
    """In-batch prefix caching (``_compute_prefix_matches``) for one request, in queue order: one
    whose cached match is at most ``IN_BATCH_CHECK`` tokens is matched against the earlier such
    requests of this queue; sharing at least ``IN_BATCH_DEPRIORITIZE`` tokens with one of them
    sends it to the back (one of them computes the prefix first, the rest hit it later);
    otherwise its tokens join that in-queue tree."""
    if full is None or full.num_tokens > IN_BATCH_CHECK:
        return False
    keys = radix.keys(request)
    if in_queue.match_prefix(keys).num_tokens >= IN_BATCH_DEPRIORITIZE:
        return True
    in_queue.insert(keys, range(len(keys)))
    return False


def _match_queue(radix: SglangRadix, waiting: FCFSRequestQueue) -> tuple[dict[str, int], set[str]]:
    """The cache-aware pass of ``hrrn`` and ``shortest-prefill-first``: one uncapped match per
    waiting request, as SGLang's ``match_kv_cache`` makes it, and the in-batch dedup. Without a
    radix tree (no request has token identities) every match is 0 and no two share a prefix."""
    prefix: dict[str, int] = {}
    deprioritized: set[str] = set()
    if radix.tree is None:
        return prefix, deprioritized
    in_queue = RadixCache(page_size=1)
    for request in waiting:
        full = radix.full_match(request)
        prefix[request.request_id] = full.num_tokens if full is not None else 0
        if _deprioritize(in_queue, radix, request, full):
            deprioritized.add(request.request_id)
    return prefix, deprioritized


def _lpm_order(
    cfg: SglangConfig, radix: SglangRadix, waiting: FCFSRequestQueue, now: float, prefix: dict[str, int]
) -> list[Request]:
    """Descending match length (stable: ties keep queue order; priorities ignored, as in
    SGLang), plus ``lpm_aging_rate`` tokens per second waited since (re)queueing; the in-batch
    dedup (``_deprioritize``, found by the SGLang differential: docs/validation.md) sends
    requests to the back. Fills ``prefix`` with each request's uncapped match."""
    rate = cfg.lpm_aging_rate
    in_queue = RadixCache(page_size=1)
    scored = []
    for request in waiting:
        full = radix.full_match(request)
        prefix[request.request_id] = full.num_tokens if full is not None else 0
        deprioritized = _deprioritize(in_queue, radix, request, full)
        match = radix.match(request)
        score = match.num_tokens if match is not None else 0
        if rate:
            score += rate * max(now - queued_at(request), 0.0)
        scored.append((float("inf") if deprioritized else -score, request))
    scored.sort(key=lambda x: x[0])
    return [r for _, r in scored]


def _dfs_weight_order(radix: SglangRadix, waiting: FCFSRequestQueue, prefix: dict[str, int]) -> list[Request]:
    """SGLang's ``dfs-weight``: weight of a node = waiting requests matched in its subtree;
    walk from the root, heavier children first, a node's own requests after its subtree. Fills
    ``prefix`` with each request's uncapped match."""
    root = radix.tree.root
    by_node: dict[int, list[Request]] = {}
    weight: dict[int, int] = {}
    nodes = []
    for request in waiting:
        match = radix.full_match(request)  # uncapped, as SGLang's calc_priority matches
        prefix[request.request_id] = match.num_tokens if match is not None else 0
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
