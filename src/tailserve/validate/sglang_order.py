"""The SGLang differential at the level that runs on CPU: one pass of waiting-queue ordering.

SGLang's ``Scheduler`` needs a model worker, so the driver (``drivers/sglang_policy.py``) runs
``SchedulePolicy.calc_priority`` over a real ``RadixCache``; here the same case goes through
tailserve's ``sglang`` policy (``sglang_priority.calc_priority`` over its radix tree). Compared:
the order of the waiting queue, each request's matched prefix length, and, for
shortest-prefill-first, the cap it puts on a continuing chunk (``shortest_prefill_chunk_limit``).
Both sides get the same scheduler state: the processed-tokens counter and each waiting request's
snapshot of it (``hrrn``), the running batch's routing keys (``routing-key``; tailserve's
``tenant_id``), and the tokens a retracted request had generated.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.kv.factory import make_kv_cache
from tailserve.policies.sglang import SglangConfig, SglangPolicy
from tailserve.policies.sglang_config import LARGE_QUEUE_FCFS_POLICIES
from tailserve.policies.sglang_order_work import shortest_prefill_chunk_limit
from tailserve.policies.sglang_priority import LPM_FALLBACK_WAITING
from tailserve.validate.workload import decode_tokens, encode_tokens

ORDER_POLICIES = ("fcfs", "lof", "lpm", "dfs-weight", "hrrn", "shortest-prefill-first", "routing-key")


@dataclass(frozen=True, slots=True)
class WaitingSpec:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int = 0
    queue_time: float = 0.0  # seconds; when it entered the waiting queue
    output_token_ids: list[int] = field(default_factory=list)  # generated before a retraction
    arrival_processed_tokens: int = 0  # the processed-tokens counter when it entered the queue
    routing_key: str | None = None  # SGLang's ``routing_key``, tailserve's ``tenant_id``

    def extras(self) -> bool:
        return (
            bool(self.output_token_ids) or self.arrival_processed_tokens != 0 or self.routing_key is not None
        )


@dataclass(frozen=True, slots=True)
class OrderCase:
    policy: str
    cached: list[list[int]]  # sequences already in the radix tree, inserted in this order
    waiting: list[WaitingSpec] = field(default_factory=list)
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    seed: int | None = None
    processed_tokens: int = 0  # the scheduler's counter at this pass
    running_keys: list[str | None] = field(default_factory=list)  # the running batch's routing keys
    # A chunked request continuing this pass: [tokens left to prefill, chunk budget, page size].
    chunk_probe: list[int] | None = None

    def __post_init__(self) -> None:
        if self.policy not in ORDER_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(ORDER_POLICIES)}, got {self.policy!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OrderCase:
        waiting = [WaitingSpec(**w) for w in d["waiting"]]
        return cls(**dict(d, waiting=waiting))

    def to_compact(self) -> dict[str, Any]:
        """``to_dict`` with token lists as runs and each waiting request as ``[id, prompt runs,
        max_tokens, priority, queue_time]``, then ``[output runs, arrival_processed_tokens,
        routing_key]`` where any is set (golden files)."""
        d = self.to_dict()
        d["cached"] = [encode_tokens(t) for t in self.cached]
        rows = []
        for w in self.waiting:
            row = [w.request_id, encode_tokens(w.prompt_token_ids), w.max_tokens, w.priority, w.queue_time]
            if w.extras():
                row += [encode_tokens(w.output_token_ids), w.arrival_processed_tokens, w.routing_key]
            rows.append(row)
        d["waiting"] = rows
        return d

    @classmethod
    def from_compact(cls, d: dict[str, Any]) -> OrderCase:
        cached = [decode_tokens(t) for t in d["cached"]]
        waiting = []
        for rid, p, m, pr, q, *extra in d["waiting"]:
            outputs, processed, key = extra or ([], 0, None)
            waiting.append(
                WaitingSpec(rid, decode_tokens(p), m, pr, q, decode_tokens(outputs), processed, key)
            )
        return cls(**dict(d, cached=cached, waiting=waiting))


@dataclass(frozen=True, slots=True)
class OrderResult:
    order: list[str]
    prefix_len: dict[str, int]
    chunk_limit: int | None = None  # shortest-prefill-first's cap on the probed chunk

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OrderResult:
        prefix_len = {k: int(v) for k, v in d["prefix_len"].items()}
        return cls(list(d["order"]), prefix_len, d.get("chunk_limit"))


def run_tailserve_order(case: OrderCase) -> OrderResult:
    config = SglangConfig(
        schedule_policy=case.policy,
        enable_priority_scheduling=case.enable_priority_scheduling,
        schedule_low_priority_values_first=case.schedule_low_priority_values_first,
        # One scheduling pass, as SGLang's standalone scheduler runs it: the overlap scheduler
        # (on by default in the engine, policies/sglang_overlap.py) is off here.
        disable_overlap_schedule=True,
    )
    policy = SglangPolicy(config)
    total = sum(len(s) for s in case.cached) + sum(
        len(w.prompt_token_ids) + w.max_tokens for w in case.waiting
    )
    kv = make_kv_cache(policy.kv_spec(), max(total * 4, 64), 1)
    sched = Scheduler(policy, kv, max_model_len=1 << 20)
    for tokens in case.cached:  # as if requests had computed them and left
        if not kv.warm(tokens):
            raise RuntimeError("tailserve's sglang policy got no radix cache")
    policy.processed.add(case.processed_tokens)
    for i, key in enumerate(case.running_keys):  # only their routing keys matter to the order
        sched.running.append(Request(f"running-{i}", 1, 1, 0.0, tenant_id=key))
    for w in case.waiting:
        outputs = list(w.output_token_ids)
        request = Request(
            w.request_id,
            len(w.prompt_token_ids),
            w.max_tokens,
            w.queue_time,
            priority=w.priority,
            tenant_id=w.routing_key,
            prompt_token_ids=list(w.prompt_token_ids),
            planned_output_token_ids=outputs or None,
        )
        request.num_output_tokens = len(outputs)  # a retracted request: prompt + outputs to recompute
        request.output_token_ids = outputs
        request.enqueue_time = w.queue_time
        policy.add_request(sched, request)
        if request.is_finished:
            raise RuntimeError(f"tailserve rejected {w.request_id}: {request.status_reason}")
        policy.processed.snapshot[w.request_id] = w.arrival_processed_tokens
    now = max((w.queue_time for w in case.waiting), default=0.0)
    prefix = policy.order_waiting(sched, now)
    order = [r.request_id for r in sched.waiting]
    prefix_len = {}
    matched = case.policy in ("dfs-weight", "shortest-prefill-first") or (
        case.policy in LARGE_QUEUE_FCFS_POLICIES and len(case.waiting) <= LPM_FALLBACK_WAITING
    )
    if matched:  # the pass matched the queue against the tree (see the driver)
        for r in sched.waiting:
            match = policy.match(r)
            prefix_len[r.request_id] = match.num_tokens if match is not None else 0
    chunk_limit = None
    if case.chunk_probe is not None and case.policy == "shortest-prefill-first":
        remaining, budget, page = case.chunk_probe
        capped = {r.request_id: min(prefix.get(r.request_id, 0), r.num_tokens - 1) for r in sched.waiting}
        chunk_limit = shortest_prefill_chunk_limit(remaining, sched.waiting, capped, budget, page)
    return OrderResult(order, prefix_len, chunk_limit)


def describe_difference(ours: OrderResult, theirs: OrderResult) -> str | None:
    if ours == theirs:
        return None
    lines = []
    if ours.order != theirs.order:
        lines.append(f"order: tailserve {ours.order} vs SGLang {theirs.order}")
    bad = {
        k: (ours.prefix_len.get(k), v) for k, v in theirs.prefix_len.items() if ours.prefix_len.get(k) != v
    }
    if bad:
        lines.append(f"prefix_len (tailserve, SGLang): {bad}")
    if ours.chunk_limit != theirs.chunk_limit:
        lines.append(f"chunk limit: tailserve {ours.chunk_limit} vs SGLang {theirs.chunk_limit}")
    return "; ".join(lines)


def random_order_case(seed: int) -> OrderCase:
    """Cached sequences built from a few shared stems; waiting requests that extend cached
    sequences, share stems among themselves (SGLang's in-batch dedup), or are new; some retracted
    with outputs (sometimes cached past the prompt); processed-tokens snapshots drawn from a few
    values (ties by request id); routing keys in the queue and the running batch; a chunk probe;
    sometimes more than 128 waiting (lpm and hrrn fall back to fcfs)."""
    rng = random.Random(seed)
    next_token = [rng.randrange(3, 20000)]

    def fresh(n: int) -> list[int]:
        out = list(range(next_token[0], next_token[0] + n))
        next_token[0] += n
        return out

    stems = [fresh(rng.choice((4, 16, 31, 32, 33, 40, 64, 100))) for _ in range(rng.randint(1, 4))]
    cached = []
    for _ in range(rng.randint(0, 5)):
        stem = rng.choice(stems)
        cached.append(stem[: rng.randint(1, len(stem))] + fresh(rng.randint(0, 40)))
    n = rng.randint(129, 136) if rng.random() < 0.05 else rng.randint(1, 16)
    processed = rng.choice((0, rng.randint(1, 64), rng.randint(64, 20000)))
    snapshots = [0, processed] + [rng.randint(0, processed) for _ in range(3)]
    keys = ["a", "b", "c", "", None]
    waiting = []
    retracted_cache = []
    for i in range(n):
        kind = rng.random()
        if kind < 0.35 and cached:
            base = rng.choice(cached)
            prompt = base[: rng.randint(1, len(base))]
        elif kind < 0.7:
            stem = rng.choice(stems)
            prompt = stem[: rng.randint(1, len(stem))]
        else:
            prompt = []
        prompt = prompt + fresh(rng.randint(0 if prompt else 1, 60))
        outputs = fresh(rng.randint(1, 24)) if rng.random() < 0.15 else []
        if outputs and rng.random() < 0.5:  # its prompt and some outputs were cached before
            retracted_cache.append(prompt + outputs[: rng.randint(0, len(outputs))])
        max_tokens = rng.choice((1, 8, 16, 64, 128, rng.randint(1, 200)))
        waiting.append(
            WaitingSpec(
                request_id=f"r{i:03d}",
                prompt_token_ids=prompt,
                max_tokens=max(max_tokens, len(outputs) + 1),
                priority=rng.randint(0, 3),
                queue_time=float(i // rng.choice((1, 1, 2, 3))),
                output_token_ids=outputs,
                arrival_processed_tokens=rng.choice(snapshots),
                routing_key=rng.choice(keys),
            )
        )
    probe = [
        rng.randint(1, 300),
        rng.choice((0, 1, 2, 16, 64, 256, rng.randint(0, 600))),
        rng.choice((1, 1, 4, 16)),
    ]
    return OrderCase(
        policy=rng.choice(ORDER_POLICIES),
        cached=cached + retracted_cache,
        waiting=waiting,
        enable_priority_scheduling=rng.random() < 0.4,
        schedule_low_priority_values_first=rng.random() < 0.5,
        seed=seed,
        processed_tokens=processed,
        running_keys=[rng.choice([*keys, "d"]) for _ in range(rng.randint(0, 6))],
        chunk_probe=probe,
    )
