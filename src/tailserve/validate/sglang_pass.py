"""The SGLang differential one level up: a whole prefill pass (ordering, admission, chunking,
priority preemption) on a random scheduler state.

SGLang's ``PrefillAdder`` runs standalone (``drivers/sglang_adder.py``: its own ``SchedulePolicy``
and ``PrefillAdder`` over a real ``RadixCache`` and KV allocator, the ``Scheduler``'s walk written
out there); here the same state goes through tailserve's ``sglang`` policy
(``SglangPolicy.build_prefill``). The state: a KV pool, sequences cached in the radix tree, running
requests (their KV outside the tree), perhaps a chunked request part-way through its prompt, and
waiting requests (some retracted, with outputs; some with the match an earlier look left), plus
the flags and ``new_token_ratio``. Compared: the waiting queue after the pass, every admission
(extend and prefix tokens, in order), the chunked request, the priority-preemption victims and
``batch_is_full``.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.kv.factory import make_kv_cache
from tailserve.policies.sglang import SglangConfig, SglangPolicy
from tailserve.policies.sglang_config import SCHEDULE_POLICIES
from tailserve.validate.sglang_order import WaitingSpec
from tailserve.validate.workload import decode_tokens, encode_tokens

PASS_POLICIES = tuple(p for p in SCHEDULE_POLICIES if p != "random")  # random: two generators


@dataclass(frozen=True, slots=True)
class RunningSpec:
    """A decoding request (or, as ``PassCase.chunked``, one part-way through its prompt:
    ``computed`` tokens in KV, no outputs)."""

    request_id: str
    prompt_len: int
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    priority: int = 0
    queue_time: float = 0.0
    routing_key: str | None = None
    computed: int = 0


@dataclass(frozen=True, slots=True)
class PassWaiting(WaitingSpec):
    """A waiting request with what SGLang's last look at it left: ``req.prefix_len`` and the
    length of ``req.full_untruncated_fill_ids`` (0 and 0 if never looked at; priority
    preemption reads both)."""

    stale_prefix_len: int = 0
    stale_fill_len: int = 0


@dataclass(frozen=True, slots=True)
class PassCase:
    capacity: int  # KV slots (page size 1)
    schedule_policy: str
    new_token_ratio: float
    max_prefill_tokens: int
    chunked_prefill_size: int  # <= 0: no chunking
    max_running_requests: int
    enable_mixed_chunk: bool = False
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    disable_priority_preemption: bool = False
    disable_radix_cache: bool = False
    processed_tokens: int = 0
    cached: list[list[int]] = field(default_factory=list)
    running: list[RunningSpec] = field(default_factory=list)
    chunked: RunningSpec | None = None
    waiting: list[PassWaiting] = field(default_factory=list)
    seed: int | None = None
    prefill_max_requests: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_compact(self) -> dict[str, Any]:
        """``to_dict`` with every request as a row of its fields in order and every token list
        as runs (``encode_tokens``): golden files."""
        d = self.to_dict()
        d["cached"] = [encode_tokens(t) for t in self.cached]
        d["waiting"] = [_row(w, ("prompt_token_ids", "output_token_ids")) for w in self.waiting]
        d["running"] = [_row(r, ("output_token_ids",)) for r in self.running]
        return d

    @classmethod
    def from_compact(cls, d: dict[str, Any]) -> PassCase:
        d = dict(d, cached=[decode_tokens(t) for t in d["cached"]])
        d["waiting"] = [
            _unrow(PassWaiting, row, ("prompt_token_ids", "output_token_ids")) for row in d["waiting"]
        ]
        d["running"] = [_unrow(RunningSpec, row, ("output_token_ids",)) for row in d["running"]]
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PassCase:
        chunked = RunningSpec(**d["chunked"]) if d.get("chunked") else None
        running = [RunningSpec(**r) for r in d["running"]]
        waiting = [PassWaiting(**w) for w in d["waiting"]]
        return cls(**dict(d, running=running, chunked=chunked, waiting=waiting))

    @property
    def kind(self) -> str:
        """The policy, and whether priority preemption is on (counts per kind)."""
        preempts = self.enable_priority_scheduling and not self.disable_priority_preemption
        return f"{self.schedule_policy}{' +preemption' if preempts else ''}"


def _row(spec: Any, tokens: tuple[str, ...]) -> list[Any]:
    return [
        encode_tokens(v) if f.name in tokens else v for f in fields(spec) for v in [getattr(spec, f.name)]
    ]


def _unrow(cls: type, row: list[Any], tokens: tuple[str, ...]) -> dict[str, Any]:
    return {
        f.name: decode_tokens(v) if f.name in tokens else v for f, v in zip(fields(cls), row, strict=True)
    }


@dataclass(frozen=True, slots=True)
class PassResult:
    waiting: list[str]  # the waiting queue after the pass, victims left out
    can_run: list[list[Any]]  # [id, extend tokens, prefix tokens], in admission order
    new_chunked: str | None
    chunked: str | None  # the chunked request after the pass
    preempted: list[str]  # sorted
    batch_is_full: bool
    engine_fails: str | None = None  # why SGLang's own scheduler stops right after this pass

    @classmethod
    def from_engine(cls, d: dict[str, Any]) -> PassResult:
        """The driver's reply: the queue after the pass is its order less the admitted."""
        admitted = {c[0] for c in d["can_run"]}
        waiting = [rid for rid in d["order"] if rid not in admitted] if d["can_run"] else d["order"]
        return cls(
            waiting,
            [list(c) for c in d["can_run"]],
            d["new_chunked"],
            d["chunked"],
            list(d["preempted"]),
            bool(d["batch_is_full"]),
            d.get("engine_fails"),
        )


def _request(spec: RunningSpec | WaitingSpec, prompt: list[int] | None) -> Request:
    outputs = list(spec.output_token_ids)
    prompt_len = len(prompt) if prompt is not None else spec.prompt_len
    request = Request(
        spec.request_id,
        prompt_len,
        spec.max_tokens,
        spec.queue_time,
        priority=spec.priority,
        tenant_id=spec.routing_key,
        prompt_token_ids=prompt,
        planned_output_token_ids=(outputs or None) if prompt is not None else None,
    )
    request.num_output_tokens = len(outputs)
    request.output_token_ids = outputs
    request.enqueue_time = spec.queue_time
    return request


def run_tailserve_pass(case: PassCase) -> PassResult:
    config = SglangConfig(
        schedule_policy=case.schedule_policy,
        chunked_prefill_size=case.chunked_prefill_size,
        max_prefill_tokens=case.max_prefill_tokens,
        enable_mixed_chunk=case.enable_mixed_chunk,
        max_running_requests=case.max_running_requests,
        enable_priority_scheduling=case.enable_priority_scheduling,
        schedule_low_priority_values_first=case.schedule_low_priority_values_first,
        priority_scheduling_preemption_threshold=case.priority_scheduling_preemption_threshold,
        disable_priority_preemption=case.disable_priority_preemption,
        disable_radix_cache=case.disable_radix_cache,
        prefill_max_requests=case.prefill_max_requests,
        # One scheduling pass, as SGLang's standalone scheduler runs it: the overlap scheduler
        # (on by default in the engine, policies/sglang_overlap.py) is off here.
        disable_overlap_schedule=True,
    )
    policy = SglangPolicy(config)
    policy.new_token_ratio = case.new_token_ratio
    kv = make_kv_cache(policy.kv_spec(), case.capacity, 1)
    sched = Scheduler(policy, kv, max_model_len=1 << 30)
    if not case.disable_radix_cache:
        for tokens in case.cached:
            kv.warm(tokens)
    for spec in case.running:  # prompt + outputs in KV, no token identities: never in the tree
        request = _request(spec, None)
        request.num_computed_tokens = request.num_tokens
        if not sched.allocate(request, request.num_tokens):
            raise RuntimeError(f"running {spec.request_id} does not fit the KV pool")
        sched.admit(request, 0.0)
    if case.chunked is not None:
        request = _request(case.chunked, None)
        request.num_computed_tokens = case.chunked.computed
        if not sched.allocate(request, case.chunked.computed):
            raise RuntimeError(f"chunked {case.chunked.request_id} does not fit the KV pool")
        sched.admit(request, 0.0)
        policy.chunked = request
    policy.processed.add(case.processed_tokens)
    for w in case.waiting:
        request = _request(w, list(w.prompt_token_ids))
        policy.add_request(sched, request)
        if request.is_finished:
            raise RuntimeError(f"tailserve rejected {w.request_id}: {request.status_reason}")
        policy.processed.snapshot[w.request_id] = w.arrival_processed_tokens
        if w.stale_prefix_len:
            policy.sgl_prefix_len[w.request_id] = w.stale_prefix_len
        if w.stale_fill_len:
            policy.sgl_fill_len[w.request_id] = w.stale_fill_len
    now = max((w.queue_time for w in case.waiting), default=0.0)
    continuing = policy.chunked
    decoding = {id(r) for r in sched.running if r is not continuing}
    out = policy.build_prefill(sched, now)
    victims = {r.request_id for r in out.preempted}
    can_run = [
        [s.request.request_id, s.num_new_tokens, s.num_context_tokens]
        for s in out.scheduled
        if id(s.request) not in decoding  # mixed decodes ride along after the prefill batch
    ]
    chunked = policy.chunked
    new_chunked = chunked.request_id if chunked is not None and chunked is not continuing else None
    return PassResult(
        [r.request_id for r in sched.waiting if r.request_id not in victims],
        can_run,
        new_chunked,
        chunked.request_id if chunked is not None else None,
        sorted(victims),
        policy.batch_is_full,
    )


COMPARED = ("waiting", "can_run", "new_chunked", "chunked", "preempted", "batch_is_full")


def describe_pass_difference(ours: PassResult, theirs: PassResult) -> str | None:
    parts = []
    for name in COMPARED:
        a, b = getattr(ours, name), getattr(theirs, name)
        if a != b:
            parts.append(f"{name}: tailserve {a} vs SGLang {b}")
    if not parts:
        return None
    if theirs.engine_fails:
        # A state SGLang cannot run past: its batch does not fit the pool (tailserve cuts the
        # chunk to the slots there are), or a second chunked request (tailserve lets it wait).
        parts.insert(0, f"SGLang itself fails: {theirs.engine_fails}")
    return "; ".join(parts)


def random_pass_case(seed: int) -> PassCase:
    """A random scheduler state at the start of a prefill pass: a KV pool of 128-4096 slots,
    some of it cached (shared stems), running requests (priorities spread past the preemption
    threshold), maybe a chunked request part-way, and 1-12 waiting requests that share stems
    with the cache and each other; every waiting request fits an idle engine (tailserve refuses
    one that cannot at arrival; SGLang would clip its outputs)."""
    rng = random.Random(seed)
    next_token = [rng.randrange(3, 20000)]

    def fresh(n: int) -> list[int]:
        out = list(range(next_token[0], next_token[0] + n))
        next_token[0] += n
        return out

    capacity = rng.choice((128, 256, 512, 1024, 4096))
    chunk = rng.choice((-1, 16, 32, 64, 256, 4096))
    priority_on = rng.random() < 0.4
    disable_radix = rng.random() < 0.1
    policies = ("fcfs", "lof") if priority_on else PASS_POLICIES
    if disable_radix:
        policies = tuple(p for p in policies if p != "shortest-prefill-first")
    policy = rng.choice(policies)
    free = capacity
    stems = [fresh(rng.choice((4, 16, 32, 33, 40, 64))) for _ in range(rng.randint(1, 3))]
    cached = []
    for _ in range(rng.randint(0, 4)):
        tokens = rng.choice(stems)[: rng.randint(1, 64)] + fresh(rng.randint(0, 30))
        if len(tokens) < free // 3:
            cached.append(tokens)
            free -= len(tokens)
    levels = (0, 3, 11, 12, 25, 40)
    keys = ["a", "b", "c", None]
    running = []
    for i in range(rng.randint(0, 8)):
        prompt_len = rng.randint(1, max(1, capacity // 8))
        outputs = fresh(rng.randint(0, 40))
        if prompt_len + len(outputs) > free // 2:
            continue
        free -= prompt_len + len(outputs)
        max_tokens = len(outputs) + rng.choice((1, 16, 200, rng.randint(1, 600), 5000))
        running.append(
            RunningSpec(f"d{i}", prompt_len, max_tokens, outputs, rng.choice(levels), float(rng.randint(0, 9)),
                        rng.choice(keys))
        )  # fmt: skip
    chunked = None
    # shortest-prefill-first's own rules act on a continuing chunk: give it one more often
    if chunk > 0 and rng.random() < (0.8 if policy == "shortest-prefill-first" else 0.3):
        prompt_len = rng.randint(chunk + 1, chunk * 3 + 5)
        computed = rng.randint(1, prompt_len - 1)
        if computed < free // 2:
            free -= computed
            chunked = RunningSpec("c0", prompt_len, rng.choice((1, 64, 300)), priority=rng.choice(levels),
                                  queue_time=0.0, computed=computed)  # fmt: skip
    processed = rng.choice((0, rng.randint(1, 5000)))
    waiting = []
    for i in range(rng.randint(1, 12)):
        kind = rng.random()
        if kind < 0.35 and cached:
            base = rng.choice(cached)
            prompt = base[: rng.randint(1, len(base))]
        elif kind < 0.7:
            prompt = rng.choice(stems)[: rng.randint(1, 64)]
        else:
            prompt = []
        prompt = prompt + fresh(rng.randint(0 if prompt else 1, max(1, capacity // 6)))
        outputs = fresh(rng.randint(1, 20)) if rng.random() < 0.15 else []
        max_tokens = len(outputs) + rng.choice((1, 8, 64, 300, rng.randint(1, 800), 5000))
        if len(prompt) + len(outputs) + min(max_tokens, 4096) + 2 >= capacity:
            max_tokens = len(outputs) + 1  # fit an idle engine (see the docstring)
            if len(prompt) + len(outputs) + max_tokens + 2 >= capacity:
                continue
        look = rng.random()
        total = len(prompt) + len(outputs)
        if look < 0.2:  # walked in an earlier pass and not admitted
            fill, stale = total, rng.randint(0, total - 1)
        elif look < 0.3:  # retracted or preempted: the fill of its last admission, no prefix
            fill, stale = rng.randint(len(prompt), total), 0
        else:  # never looked at
            fill, stale = 0, 0
        waiting.append(
            PassWaiting(
                f"w{i:02d}", prompt, max_tokens, rng.choice(levels), float(rng.randint(0, 12)), outputs,
                rng.randint(0, processed), rng.choice(keys), stale, fill,
            )
        )  # fmt: skip
    return PassCase(
        capacity=capacity,
        schedule_policy=policy,
        new_token_ratio=round(rng.uniform(0.098, 1.0), 3),
        max_prefill_tokens=rng.choice((64, 256, 1024, 16384)),
        chunked_prefill_size=chunk,
        max_running_requests=rng.choice((1, 2, 4, 8, 16, 64)),
        enable_mixed_chunk=rng.random() < 0.3,
        enable_priority_scheduling=priority_on,
        schedule_low_priority_values_first=rng.random() < 0.5,
        priority_scheduling_preemption_threshold=rng.choice((0, 5, 10)),
        disable_priority_preemption=priority_on and rng.random() < 0.2,
        disable_radix_cache=disable_radix,
        processed_tokens=processed,
        cached=cached,
        running=running,
        chunked=chunked,
        waiting=waiting,
        seed=seed,
        # drawn last: the earlier draws, and so the workloads of earlier fixtures, are unchanged
        prefill_max_requests=rng.choice((None, None, None, 1, 2, 3, 5)),
    )
