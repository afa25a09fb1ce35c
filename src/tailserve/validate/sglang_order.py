"""The SGLang differential at the level that runs on CPU: one pass of waiting-queue ordering.

SGLang's ``Scheduler`` needs a model worker, so the driver (``drivers/sglang_policy.py``) runs
``SchedulePolicy.calc_priority`` over a real ``RadixCache``; here the same case goes through
tailserve's ``sglang`` policy (``sglang_priority.calc_priority`` over its radix tree). Compared:
the order of the waiting queue and each request's matched prefix length.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.kv.factory import make_kv_cache
from tailserve.policies.sglang import SglangConfig, SglangPolicy
from tailserve.policies.sglang_priority import LPM_FALLBACK_WAITING
from tailserve.validate.workload import decode_tokens, encode_tokens

ORDER_POLICIES = ("fcfs", "lof", "lpm", "dfs-weight")


@dataclass(frozen=True, slots=True)
class WaitingSpec:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int = 0
    queue_time: float = 0.0  # seconds; when it entered the waiting queue


@dataclass(frozen=True, slots=True)
class OrderCase:
    policy: str
    cached: list[list[int]]  # sequences already in the radix tree, inserted in this order
    waiting: list[WaitingSpec] = field(default_factory=list)
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    seed: int | None = None

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
        max_tokens, priority, queue_time]`` (golden files)."""
        d = self.to_dict()
        d["cached"] = [encode_tokens(t) for t in self.cached]
        d["waiting"] = [
            [w.request_id, encode_tokens(w.prompt_token_ids), w.max_tokens, w.priority, w.queue_time]
            for w in self.waiting
        ]
        return d

    @classmethod
    def from_compact(cls, d: dict[str, Any]) -> OrderCase:
        cached = [decode_tokens(t) for t in d["cached"]]
        waiting = [WaitingSpec(rid, decode_tokens(p), m, pr, q) for rid, p, m, pr, q in d["waiting"]]
        return cls(**dict(d, cached=cached, waiting=waiting))


@dataclass(frozen=True, slots=True)
class OrderResult:
    order: list[str]
    prefix_len: dict[str, int]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OrderResult:
        return cls(list(d["order"]), {k: int(v) for k, v in d["prefix_len"].items()})


def run_tailserve_order(case: OrderCase) -> OrderResult:
    config = SglangConfig(
        schedule_policy=case.policy,
        enable_priority_scheduling=case.enable_priority_scheduling,
        schedule_low_priority_values_first=case.schedule_low_priority_values_first,
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
    for w in case.waiting:
        request = Request(
            w.request_id,
            len(w.prompt_token_ids),
            w.max_tokens,
            w.queue_time,
            priority=w.priority,
            prompt_token_ids=list(w.prompt_token_ids),
        )
        request.enqueue_time = w.queue_time
        policy.add_request(sched, request)
        if request.is_finished:
            raise RuntimeError(f"tailserve rejected {w.request_id}: {request.status_reason}")
    now = max((w.queue_time for w in case.waiting), default=0.0)
    policy.order_waiting(sched, now)
    order = [r.request_id for r in sched.waiting]
    prefix_len = {}
    matched = case.policy == "dfs-weight" or (
        case.policy == "lpm" and len(case.waiting) <= LPM_FALLBACK_WAITING
    )
    if matched:  # the pass matched the queue against the tree (see the driver)
        for r in sched.waiting:
            match = policy.match(r)
            prefix_len[r.request_id] = match.num_tokens if match is not None else 0
    return OrderResult(order, prefix_len)


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
    return "; ".join(lines)


def random_order_case(seed: int) -> OrderCase:
    """Cached sequences built from a few shared stems; waiting requests that extend cached
    sequences, share stems among themselves (SGLang's in-batch dedup), or are new; sometimes
    more than 128 of them (lpm falls back to fcfs)."""
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
    waiting = []
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
        waiting.append(
            WaitingSpec(
                request_id=f"r{i:03d}",
                prompt_token_ids=prompt,
                max_tokens=rng.choice((1, 8, 16, 64, 128, rng.randint(1, 200))),
                priority=rng.randint(0, 3),
                queue_time=float(i // rng.choice((1, 1, 2, 3))),
            )
        )
    return OrderCase(
        policy=rng.choice(ORDER_POLICIES),
        cached=cached,
        waiting=waiting,
        enable_priority_scheduling=rng.random() < 0.4,
        schedule_low_priority_values_first=rng.random() < 0.5,
        seed=seed,
    )
