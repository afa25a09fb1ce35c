"""Behaviour of the ``sglang`` policy against ``shared/reference/policies.md`` §3 (SGLang 0.5.23).

Most tests drive the policy through ``Scheduler.schedule`` / ``Scheduler.update`` with a KV cache
of page size 1 sized by hand, so every grant, victim, queue position and ratio is a number the
rules determine. The whole-run tests use the simulated executor with ``check_integrity=True``.
"""

from __future__ import annotations

import random

import pytest

from helpers import grants as _grants
from helpers import ids as _ids
from helpers import running_request as _running
from helpers import scheduler_for
from helpers import step as _step
from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.core.source import ListSource
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.driver import SimDriver
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.policies.sglang import (
    ABORT_REASON,
    NEVER_FITS_REASON,
    SglangConfig,
    SglangPolicy,
    auto_max_running_requests,
)

# ---- helpers ------------------------------------------------------------------------------


def _sglang(num_blocks: int, max_model_len: int = 4096, **cfg) -> Scheduler:
    return scheduler_for(SglangPolicy(SglangConfig(**cfg)), num_blocks, 1, max_model_len)


def _add(
    sched: Scheduler, rid: str, prompt: int, max_tokens: int, now: float = 0.0, priority: int = 0
) -> Request:
    request = Request(rid, prompt, max_tokens, now, priority=priority)
    assert sched.add_request(request, now)
    return request




def _ratio_constants(conservativeness: float = 1.0) -> tuple[float, float, float]:
    init = min(0.7 * conservativeness, 1.0)
    floor = min(init * 0.14, 1.0)
    return init, floor, (init - floor) / 600


# ---- prefill first --------------------------------------------------------------------------


def test_a_new_prompt_gets_a_prefill_only_iteration_and_the_decodes_wait():
    sched = _sglang(1000)
    policy: SglangPolicy = sched.policy
    _add(sched, "a", 10, 5)
    out = _step(sched)
    assert _grants(out) == [("a", 10, 0)] and out.num_admitted == 1
    assert _grants(_step(sched)) == [("a", 1, 10)]
    ratio = policy.new_token_ratio

    _add(sched, "b", 8, 3)
    out = _step(sched)
    assert _grants(out) == [("b", 8, 0)]  # no decode of "a" in this iteration
    assert policy.new_token_ratio == ratio  # only decode iterations decay the ratio
    assert _grants(_step(sched)) == [("a", 1, 11), ("b", 1, 8)]


def test_mixed_chunk_lets_the_decodes_ride_along():
    sched = _sglang(1000, enable_mixed_chunk=True)
    _add(sched, "a", 10, 5)
    _step(sched)
    _step(sched)
    _add(sched, "b", 8, 3)
    assert _grants(_step(sched)) == [("b", 8, 0), ("a", 1, 11)]


def test_every_chunk_of_a_long_prompt_stalls_the_decodes():
    sched = _sglang(1000, chunked_prefill_size=8)
    _add(sched, "a", 6, 50)
    _step(sched)
    assert _grants(_step(sched)) == [("a", 1, 6)]
    _add(sched, "b", 20, 5)
    assert _grants(_step(sched)) == [("b", 8, 0)]
    assert _grants(_step(sched)) == [("b", 8, 8)]
    assert _grants(_step(sched)) == [("b", 4, 16)]  # last chunk: "b" samples its first token
    assert _grants(_step(sched)) == [("a", 1, 7), ("b", 1, 20)]


def test_mixed_chunk_decodes_take_their_share_of_the_chunk():
    sched = _sglang(1000, chunked_prefill_size=8, enable_mixed_chunk=True)
    _add(sched, "a", 6, 50)
    _step(sched)
    _step(sched)
    _add(sched, "b", 20, 5)
    # One running decode: chunks of 8 - 1 = 7, each with the decode of "a".
    assert _grants(_step(sched)) == [("b", 7, 0), ("a", 1, 7)]
    assert _grants(_step(sched)) == [("b", 7, 7), ("a", 1, 8)]
    assert _grants(_step(sched)) == [("b", 6, 14), ("a", 1, 9)]
    assert _grants(_step(sched)) == [("a", 1, 10), ("b", 1, 20)]


def test_only_one_chunked_request_at_a_time():
    sched = _sglang(1000, chunked_prefill_size=8)
    policy: SglangPolicy = sched.policy
    b = _add(sched, "b", 20, 4)
    c = _add(sched, "c", 20, 4)
    assert _grants(_step(sched)) == [("b", 8, 0)]  # the chunk budget is spent
    assert policy.chunked is b and _ids(sched.waiting) == ["c"]
    assert _grants(_step(sched)) == [("b", 8, 8)]  # "c" fits the KV budget but gets no chunk
    # "b" finishes its prompt with 4 tokens; the 4 left start "c", the new chunked request.
    out = _step(sched)
    assert _grants(out) == [("b", 4, 16), ("c", 4, 0)] and out.num_admitted == 1
    assert policy.chunked is c
    assert _grants(_step(sched)) == [("c", 8, 4)]  # "b" waits: prefill first
    assert _grants(_step(sched)) == [("c", 8, 12)]
    assert policy.chunked is None
    assert _grants(_step(sched)) == [("b", 1, 20), ("c", 1, 20)]


def test_the_continuing_chunk_is_capped_by_the_kv_budget():
    sched = _sglang(40, chunked_prefill_size=16)
    policy: SglangPolicy = sched.policy
    x = Request("x", 30, 2, 0.0)
    x.num_computed_tokens = 8  # a chunked prompt, 8 tokens in
    x.status = RequestStatus.RUNNING
    sched.allocate(x, 8)
    sched.running.append(x)
    policy.chunked = x
    _running(sched, "r", 5, 1, 31)  # reserves (31 - 1) x 0.7 = 21 of the 27 free slots
    # Next chunk: min(22 left, 16 chunk, int(27 - 21) = 6).
    assert _grants(sched.schedule(0.0)) == [("x", 6, 8)]


def test_the_last_chunk_reserves_the_outputs():
    sched = _sglang(70, chunked_prefill_size=8)
    _add(sched, "b", 12, 50)
    assert _grants(_step(sched)) == [("b", 8, 0)]
    _add(sched, "c", 3, 5)  # needs 3 + 5 + 1 = 9
    # The last chunk charges 4 + 1 + 50: 62 free - 55 = 7 left, so "c" gets NO_TOKEN.
    assert _grants(_step(sched)) == [("b", 4, 8)]
    assert _ids(sched.waiting) == ["c"]


# ---- admission ------------------------------------------------------------------------------


def test_no_token_stops_the_walk_and_freezes_admission():
    sched = _sglang(100)
    policy: SglangPolicy = sched.policy
    _add(sched, "r", 40, 20)
    assert _grants(_step(sched)) == [("r", 40, 0)]
    _add(sched, "h", 40, 10)
    _add(sched, "s", 5, 5)
    # remaining_total = 60 free - 19 x 0.7 = 46.7; "h" needs 40 + 10 + 1 = 51 -> NO_TOKEN. "s"
    # (needs 11) would fit but is never tried: head-of-line blocking.
    assert _grants(_step(sched)) == [("r", 1, 40)]
    assert _ids(sched.waiting) == ["h", "s"]
    assert policy.batch_is_full
    assert _grants(_step(sched)) == [("r", 1, 41)]  # no retry while the flag is set


def test_a_finish_in_a_decode_unblocks_admission_one_iteration_later():
    sched = _sglang(100)
    _add(sched, "r1", 30, 3)
    _add(sched, "r2", 10, 40)
    assert _grants(_step(sched)) == [("r1", 30, 0), ("r2", 10, 0)]
    _add(sched, "h", 45, 10)  # needs 56; 60 free - 41 x 0.7 = 31.3 left -> NO_TOKEN
    assert _grants(_step(sched)) == [("r1", 1, 30), ("r2", 1, 10)]
    out = _step(sched)
    assert _grants(out) == [("r1", 1, 31), ("r2", 1, 11)]
    assert sched.finished[-1].request_id == "r1"
    # SGLang clears batch_is_full while filtering "r1" out of this decode, so "h" waits one more.
    assert _grants(_step(sched)) == [("r2", 1, 12)]
    assert _grants(_step(sched)) == [("h", 45, 0)]


def test_when_the_last_running_request_finishes_the_blocked_head_is_admitted_at_once():
    sched = _sglang(100)
    _add(sched, "r", 40, 3)
    _step(sched)
    _add(sched, "h", 40, 30)  # needs 71; 60 free - 2 x 0.7 = 58.6 left -> NO_TOKEN
    assert _grants(_step(sched)) == [("r", 1, 40)]
    assert _grants(_step(sched)) == [("r", 1, 41)]  # "r" finishes
    # Nothing is left to decode once "r" is filtered out, which clears batch_is_full: the
    # same turn retries the prefill (an empty iteration here would stall the engine).
    assert _grants(_step(sched)) == [("h", 40, 0)]


def test_without_chunking_the_first_prompt_may_exceed_max_prefill_tokens():
    sched = _sglang(1000, chunked_prefill_size=-1, max_prefill_tokens=10)
    _add(sched, "a", 15, 2)
    _add(sched, "b", 3, 2)
    assert _grants(_step(sched)) == [("a", 15, 0)]

    sched = _sglang(1000, chunked_prefill_size=-1, max_prefill_tokens=10)
    _add(sched, "a", 6, 2)
    _add(sched, "b", 4, 2)  # 4 >= the 4 input tokens left: refused, and the walk stops
    _add(sched, "c", 1, 2)
    assert _grants(_step(sched)) == [("a", 6, 0)]
    assert _grants(_step(sched)) == [("b", 4, 0), ("c", 1, 0)]


def test_max_running_requests_caps_admission():
    sched = _sglang(1000, max_running_requests=2)
    for rid in "abc":
        _add(sched, rid, 5, 3)
    assert _grants(_step(sched)) == [("a", 5, 0), ("b", 5, 0)]
    assert sched.policy.batch_is_full
    assert _grants(_step(sched)) == [("a", 1, 5), ("b", 1, 5)]


def test_max_running_requests_auto_follows_sglang():
    assert auto_max_running_requests(1000, 4096) == 500  # capped at half the tokens
    assert auto_max_running_requests(16384, 4096) == 2048
    assert auto_max_running_requests(100_000, 4096) == 4096
    sched = _sglang(1000)
    _add(sched, "a", 5, 3)
    _step(sched)
    assert sched.policy.max_running_requests(sched) == 500


@pytest.mark.parametrize(("max_tokens", "accepted"), [(3, True), (4, False)])
def test_a_request_that_cannot_fit_an_idle_engine_is_rejected_at_arrival(max_tokens, accepted):
    sched = _sglang(20)
    big = Request("big", 15, max_tokens, 0.0)  # needs 15 + max_tokens + 1 < 20 slots
    assert sched.add_request(big, 0.0) is accepted
    if not accepted:
        assert big.status is RequestStatus.FINISHED_REJECTED and "clip max_new_tokens" in big.status_reason


def test_a_waiting_request_that_outgrew_an_idle_engine_is_aborted_not_stalled():
    sched = _sglang(20)
    grown = Request("grown", 15, 5, 0.0)  # e.g. retracted after its outputs raised its need
    grown.enqueue_time = 0.0
    sched.waiting.append(grown)
    _add(sched, "small", 3, 3)
    assert _grants(_step(sched)) == [("small", 3, 0)]
    assert grown.status is RequestStatus.FINISHED_ABORTED and grown.status_reason == NEVER_FITS_REASON


@pytest.mark.parametrize(
    ("flags", "admitted"),
    [
        ({}, True),  # running "r" reserved at 19 x 0.7
        ({"assume_ignore_eos": True}, False),  # at 19 x 1.0: 21 needed, 21 left, not < 21
        # SGLang's ignore_eos admission without a radix cache simulates the finishes instead.
        ({"assume_ignore_eos": True, "disable_radix_cache": True}, True),
    ],
)
def test_ignore_eos_reservations(flags, admitted):
    sched = _sglang(50, **flags)
    _add(sched, "r", 10, 20)
    _step(sched)
    _add(sched, "n", 10, 10)
    out = _step(sched)
    assert _grants(out) == ([("n", 10, 0)] if admitted else [("r", 1, 10)])


# ---- retraction and new_token_ratio ---------------------------------------------------------


def test_retraction_takes_fewest_outputs_then_longest_prompt_to_the_tail():
    sched = _sglang(11)
    policy: SglangPolicy = sched.policy
    a = _running(sched, "a", 2, 2, 30)
    b = _running(sched, "b", 3, 1, 100)
    c = _running(sched, "c", 2, 1, 100)
    d = _running(sched, "d", 1, 1, 20)
    e = _running(sched, "e", 1, 2, 29)
    _add(sched, "w", 2, 1)
    assert sched.kv_cache.num_free_blocks == 0  # 5 decodes need 5 slots
    out = sched.schedule(5.0)
    # Keep order (outputs, -prompt) descending: e, a, d, c, b. Retract from the end: "b"
    # (frees 3, 4 still needed), then "c" (frees 2): 5 free for 3 decodes.
    assert _ids(out.preempted) == ["b", "c"]
    assert _grants(out) == [("a", 1, 3), ("d", 1, 1), ("e", 1, 2)]
    assert _ids(sched.running) == ["a", "d", "e"]
    assert _ids(sched.waiting) == ["w", "b", "c"]  # the tail, behind the request that waited
    assert b.num_computed_tokens == 0 and b.status is RequestStatus.PREEMPTED
    assert b.enqueue_time == 5.0 and b.num_preemptions == 1 and sched.num_preemptions == 2
    # (outputs 2 + 1 + 2 + 20 x 3) / (max_tokens 30 + 20 + 29 + 1)
    assert policy.new_token_ratio == 65 / 80 and policy.new_token_ratio > policy.init_new_token_ratio
    assert not policy.batch_is_full
    assert (
        a.num_output_tokens == 2
        and c.num_computed_tokens == 0
        and d.num_preemptions == e.num_preemptions == 0
    )


@pytest.mark.parametrize(("retraction_policy", "victim"), [("length", "c"), ("priority", "a")])
def test_priority_retraction_takes_the_least_urgent_first(retraction_policy, victim):
    sched = _sglang(9, retraction_policy=retraction_policy)
    _running(sched, "a", 2, 3, 10, priority=0)  # most outputs, least urgent
    _running(sched, "b", 2, 1, 10, priority=5)
    _running(sched, "c", 3, 1, 10, priority=5)  # fewest outputs, longest prompt
    assert _ids(sched.schedule(0.0).preempted) == [victim]


def test_the_last_request_is_aborted_when_even_it_cannot_fit():
    sched = _sglang(10, chunked_prefill_size=8)
    policy: SglangPolicy = sched.policy
    x = Request("x", 20, 2, 0.0)
    x.num_computed_tokens = 7  # a chunked prompt holding 7 slots
    x.status = RequestStatus.RUNNING
    sched.allocate(x, 7)
    sched.running.append(x)
    policy.chunked = x
    a = _running(sched, "a", 3, 1, 5)  # holds 3: nothing is free for the chunk or the decode
    out = sched.schedule(1.0)
    assert a.status is RequestStatus.FINISHED_ABORTED and a.status_reason == ABORT_REASON
    assert policy.new_token_ratio == 0.0  # no request kept
    assert _grants(out) == [("x", 3, 7)]  # the freed slots go to the chunk at once


def test_new_token_ratio_decays_per_decode_step_and_a_run_matches_single_steps():
    init, floor, decay = _ratio_constants(0.3)
    sched = _sglang(1000, schedule_conservativeness=0.3)
    policy: SglangPolicy = sched.policy
    _add(sched, "a", 5, 900)
    _step(sched)  # prefill: no decay
    assert policy.new_token_ratio == init
    _step(sched)
    assert policy.new_token_ratio == init - decay
    for _ in range(49):
        _step(sched)

    other = _sglang(1000, schedule_conservativeness=0.3)
    other.policy.on_decode_run(other, 50)
    assert other.policy.new_token_ratio == policy.new_token_ratio  # bit for bit
    other.policy.on_decode_run(other, 700)
    expected = init
    for _ in range(750):
        expected = max(expected - decay, floor)
    assert other.policy.new_token_ratio == expected == floor


# ---- priorities -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "order"),
    [
        ({}, ["p0", "p5a", "p1", "p5b"]),
        ({"enable_priority_scheduling": True}, ["p5a", "p5b", "p1", "p0"]),
        (
            {"enable_priority_scheduling": True, "schedule_low_priority_values_first": True},
            ["p0", "p1", "p5a", "p5b"],
        ),
        # Without a radix cache every match is 0: lpm keeps the queue and ignores priorities...
        ({"enable_priority_scheduling": True, "schedule_policy": "lpm"}, ["p0", "p5a", "p1", "p5b"]),
        # ...unless the cache is disabled, when SGLang falls back to fcfs.
        (
            {"enable_priority_scheduling": True, "schedule_policy": "lpm", "disable_radix_cache": True},
            ["p5a", "p5b", "p1", "p0"],
        ),
    ],
)
def test_waiting_order(flags, order):
    sched = _sglang(1000, **flags)
    for t, (rid, priority) in enumerate([("p0", 0), ("p5a", 5), ("p1", 1), ("p5b", 5)]):
        _add(sched, rid, 4, 2, now=float(t), priority=priority)
    assert [g[0] for g in _grants(_step(sched, 4.0))] == order


def test_longest_output_first_and_seeded_random():
    sched = _sglang(1000, schedule_policy="lof")
    for rid, max_tokens in [("s", 2), ("l", 9), ("m", 5)]:
        _add(sched, rid, 4, max_tokens)
    assert [g[0] for g in _grants(_step(sched))] == ["l", "m", "s"]

    def order(seed: int) -> list[str]:
        sched = _sglang(1000, schedule_policy="random", random_seed=seed)
        for i in range(8):
            _add(sched, f"r{i}", 4, 2)
        return [g[0] for g in _grants(_step(sched))]

    assert order(0) == order(0)
    assert order(0) != order(1)
    assert sorted(order(0)) == [f"r{i}" for i in range(8)]


@pytest.mark.parametrize(
    ("priority", "num_blocks", "prompt", "max_tokens", "preempts"),
    [
        (11, 1000, 10, 5, True),
        (10, 1000, 10, 5, False),  # the gap must exceed the threshold
        # SGLang's estimate of what "h" needs is its outputs alone (its fill ids are empty until
        # the walk first looks at it: tests/test_sglang_priority.py): 25 - (49 free - r's ~26.6
        # reserved) is covered by r's reservation; with r's 11 slots freed, 30 + 25 + 1 < 60 fit.
        (11, 60, 30, 25, True),
    ],
)
def test_priority_preemption_needs_a_gap_above_the_threshold_and_enough_tokens(
    priority, num_blocks, prompt, max_tokens, preempts
):
    sched = _sglang(num_blocks, enable_priority_scheduling=True, max_running_requests=1)
    r = _add(sched, "r", 10, 40, priority=0)
    _step(sched)
    _step(sched)
    _add(sched, "h", prompt, max_tokens, now=1.0, priority=priority)
    out = _step(sched, 2.0)
    if preempts:
        assert _grants(out) == [("h", prompt, 0)] and _ids(out.preempted) == ["r"]
        assert _ids(sched.waiting) == ["r"] and r.num_computed_tokens == 0 and r.enqueue_time == 2.0
    else:
        assert _grants(out) == [("r", 1, 11)] and not out.preempted
        assert _ids(sched.waiting) == ["h"]


# ---- defaults and validation ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("hardware", "chunk"),
    [
        ("A100-40GB", 4096),
        ("A100-80GB", 8192),
        ("H100-SXM", 8192),
        ("H200", 8192),
        ("L4", 4096),
        ("MI300X", 16384),
    ],
)
def test_chunked_prefill_size_defaults_by_gpu_memory(hardware, chunk):
    config = SglangPolicy.default_config(get_hardware(hardware).device_info, 8192)
    assert config.chunked_prefill_size == chunk
    assert config.max_prefill_tokens == 16384 and config.schedule_policy == "fcfs"
    assert SglangPolicy.profile_tokens(config, 8192) == chunk
    off = SglangPolicy.default_config(get_hardware(hardware).device_info, 8192, chunked_prefill_size=-1)
    assert not off.chunking and SglangPolicy.profile_tokens(off, 8192) == 16384


def test_config_validation():
    with pytest.raises(ValueError, match="fcfs"):
        SglangConfig(schedule_policy="priority")  # a parser choice no scheduler enum holds
    with pytest.raises(ValueError, match="requires the radix cache"):
        SglangConfig(schedule_policy="shortest-prefill-first", disable_radix_cache=True)
    with pytest.raises(ValueError, match="length"):
        SglangConfig(retraction_policy="newest")
    with pytest.raises(ValueError, match="0"):
        SglangConfig(max_running_requests=0)


# ---- whole runs -----------------------------------------------------------------------------


def _workload(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    t = 0.0
    requests = []
    for i in range(n):
        t += rng.expovariate(40.0)
        prompt, max_tokens = rng.randint(20, 400), rng.randint(5, 300)
        requests.append(Request(f"r{i}", prompt, max_tokens, t, priority=rng.randint(0, 20)))
    return requests


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"chunked_prefill_size": 64, "enable_mixed_chunk": True},
        {"enable_priority_scheduling": True, "max_running_requests": 8, "retraction_policy": "priority"},
        {"schedule_policy": "hrrn", "chunked_prefill_size": 64},
        {"schedule_policy": "shortest-prefill-first", "chunked_prefill_size": 64},
    ],
)
def test_whole_runs_finish_with_retractions_and_the_fast_path_is_exact(flags):
    token_times = []
    for fast in (False, True):
        sched = _sglang(1000, **flags)
        executor = SimExecutor(CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1), block_size=1)
        options = EngineOptions(fast_forward=fast, check_integrity=True)
        engine = Engine(sched, executor, ListSource(_workload(30, 1)), options=options)
        SimDriver(engine).run()
        assert len(engine.requests) == 30
        assert all(r.status is RequestStatus.FINISHED_LENGTH for r in engine.requests)
        assert all(r.num_output_tokens == r.max_tokens for r in engine.requests)
        assert sched.num_preemptions > 0
        token_times.append({r.request_id: r.token_times for r in engine.requests})
    assert token_times[0] == token_times[1]
