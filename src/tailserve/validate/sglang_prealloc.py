"""The SGLang decode server's pre-allocation turn against SGLang's own code.

SGLang's ``DecodePreallocQueue`` runs standalone (``drivers/sglang_prealloc.py``: its
``resume_retracted_reqs`` and ``pop_preallocated`` over a real ``TokenToKVPoolAllocator`` and
``DecodeReqToTokenPool``, the prefill-server side stubbed); here the same state goes through
tailserve's decode server (``policies/sglang_decode.py``: ``_resume_retracted``, then
``_pop_preallocated`` when nothing stays retracted). The state: a KV pool (page size 1), the
running batch (prompt + outputs in KV), requests in transfer and transferred (their prompt in
KV, a request slot each), retracted requests (KV on the host) and the pre-allocation queue,
with ``num_reserved_decode_tokens``, the running cap and the extra slots. Compared: which
retracted requests are restored and which queued requests are pre-allocated, in order.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

from tailserve.assemble import BuildOptions, build_engine
from tailserve.core.request import Request
from tailserve.core.scheduler_output import new_output
from tailserve.core.source import ListSource
from tailserve.executors.simulated.deployment import Deployment
from tailserve.policies.sglang_decode import SglangDecodePolicy

# [request id, prompt tokens, output tokens, max_new_tokens]
Row = list[Any]
_DEPLOYMENT = Deployment.of("Llama-3.1-8B", "H100")


@dataclass(frozen=True, slots=True)
class PreallocCase:
    capacity: int  # KV tokens (page size 1)
    num_reserved_decode_tokens: int
    max_running_requests: int
    extra_slots: int
    running: list[Row] = field(default_factory=list)
    transferring: list[Row] = field(default_factory=list)  # pre-allocated, KV not here yet
    arrived: list[Row] = field(default_factory=list)  # KV here, not running yet
    retracted: list[Row] = field(default_factory=list)
    queue: list[Row] = field(default_factory=list)  # waiting for pre-allocation
    seed: int | None = None
    # ``prefill_complete``: the queued requests whose prefill is not done yet (SGLang: their
    # receiver not ``waiting_for_input``), passed over by the pass; None: the ``early`` policy
    not_ready: list[str] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PreallocCase:
        return cls(**d)

    @property
    def max_context(self) -> int:
        rows = [*self.running, *self.transferring, *self.arrived, *self.retracted, *self.queue]
        return max([r[1] + max(r[2], 1) for r in rows] + [1])


@dataclass(frozen=True, slots=True)
class PreallocResult:
    resumed: list[str]
    preallocated: list[str]


def random_prealloc_case(seed: int) -> PreallocCase:
    """A decode server between turns: a pool of 2k-64k tokens with a running batch, requests in
    transfer and arrived holding their prompts, maybe retracted requests, and 0-10 queued; the
    reserve, the running cap and the extra slots drawn so that budgets, slots and the
    single-request term each bind in some cases; in 40% the ``prefill_complete`` policy with some
    queued requests' prefills not done (not ``waiting_for_input``)."""
    rng = random.Random(seed)
    capacity = rng.choice((2048, 4096, 8192, 16384, 65536))
    reserved = rng.choice((0, 16, 128, 512, 512, 1000))
    max_running = rng.choice((2, 4, 8, 16, 64))
    extra = rng.choice((0, 0, 1, 2 * max_running))
    free = capacity
    slots = max_running + extra
    n = [0]

    def rid() -> str:
        n[0] += 1
        return f"q{n[0]}"

    def prompt() -> int:
        return rng.choice(
            (rng.randint(1, 64), rng.randint(64, 1024), rng.randint(1024, max(1025, capacity // 3)))
        )

    def max_new(outputs: int = 0) -> int:
        return outputs + rng.choice((1, 16, 200, rng.randint(1, 3000), 6000))

    running, transferring, arrived, retracted, queue = [], [], [], [], []
    for _ in range(rng.randint(0, max_running)):
        p, o = prompt(), rng.randint(1, 300)
        if p + o > free // 2 or len(running) >= max_running or slots <= 0:
            continue
        free -= p + o
        slots -= 1
        running.append([rid(), p, o, max_new(o)])
    for target in (transferring, arrived):
        for _ in range(rng.randint(0, 3)):
            p = prompt()
            if p > free // 2 or slots <= 0:
                continue
            free -= p
            slots -= 1
            target.append([rid(), p, 1 if target is arrived else 0, max_new(1)])
    if rng.random() < 0.3:
        for _ in range(rng.randint(1, 3)):
            o = rng.randint(1, 400)
            retracted.append([rid(), prompt(), o, max_new(o)])
    for _ in range(rng.randint(0, 10)):
        p = prompt()
        if p + 1 > capacity:
            continue
        queue.append([rid(), p, 0, max_new()])
    not_ready = None
    if rng.random() < 0.4:  # prefill_complete: some queued requests' prefills still running
        not_ready = [row[0] for row in queue if rng.random() < 0.4]
    return PreallocCase(
        capacity, reserved, max_running, extra, running, transferring, arrived, retracted, queue, seed, not_ready
    )


def _request(row: Row) -> Request:
    request_id, prompt_len, outputs, max_new = row
    r = Request(request_id, prompt_len=prompt_len, max_tokens=max(max_new, outputs + 1), arrival_time=0.0)
    r.num_output_tokens = outputs
    return r


def run_tailserve_prealloc(case: PreallocCase) -> PreallocResult:
    flags = (
        f"sglang:disaggregation_mode=decode:disable_overlap_schedule=true"
        f":max_total_tokens={case.capacity}:max_model_len={min(case.capacity, max(case.max_context, 16))}"
        f":num_reserved_decode_tokens={case.num_reserved_decode_tokens}"
        f":max_running_requests={case.max_running_requests}"
        f":disaggregation_decode_extra_slots={case.extra_slots}"
    )
    if case.not_ready is not None:
        flags += ":disaggregation_decode_allocation_policy=prefill_complete"
    engine = build_engine(
        _DEPLOYMENT, flags, options=BuildOptions(pd_pair=True, shares_prefixes=False), source=ListSource([])
    ).engine
    assert engine is not None
    sched = engine.scheduler
    policy = sched.policy
    assert isinstance(policy, SglangDecodePolicy)
    policy.seconds_per_token = 0.0
    for row in case.running:
        r = _request(row)
        sched.allocate(r, r.prompt_len + r.num_output_tokens)
        r.num_computed_tokens = r.prompt_len + r.num_output_tokens - 1
        sched.admit(r, 0.0)
    for rows, held in ((case.transferring, policy.transferring), (case.arrived, None)):
        for row in rows:
            r = _request(row)
            sched.allocate(r, r.prompt_len)
            sched.loading.append(r)
            if held is not None:
                held[r.request_id] = r
            else:
                policy.arrived.append(r)
    for row in case.retracted:
        r = _request(row)
        sched.waiting.add_request(r)
        policy.retracted.append(r)
    for row in case.queue:
        sched.waiting.add_request(_request(row))
        if case.not_ready is not None and row[0] not in case.not_ready:
            policy.prefill_completed(row[0], 0.0)
    preallocated: list[str] = []
    policy.on_prealloc = lambda request, now: preallocated.append(request.request_id)
    before = {r.request_id for r in policy.retracted}
    policy._resume_retracted(sched, 0.0, new_output())
    resumed = [r.request_id for r in policy.arrived if r.request_id in before]
    if not policy.retracted:
        policy._pop_preallocated(sched, 0.0)
    return PreallocResult(resumed, preallocated)


def describe_prealloc_difference(ours: PreallocResult, theirs: PreallocResult) -> str | None:
    if ours == theirs:
        return None
    return (
        f"tailserve resumed {ours.resumed} pre-allocated {ours.preallocated}; "
        f"SGLang resumed {theirs.resumed} pre-allocated {theirs.preallocated}"
    )
