"""Behaviour of the TGI v3 policy against ``shared/reference/policies.md`` §4.

Most tests drive the policy through ``Scheduler.schedule`` / ``Scheduler.update`` with a KV cache
of block size 1 (flashinfer), so every grant, reservation and queue position is a number the
rules determine by hand. One ``schedule`` call is one engine forward: a router turn that admits
is an admission forward followed by a decode forward. The whole-run tests use the simulated
executor with ``check_integrity=True``.
"""

from __future__ import annotations

import random

import pytest

from helpers import grants as _grants
from helpers import ids as _ids
from helpers import scheduler_for
from helpers import step as _step
from tailserve.core.device import DeviceInfo
from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import SchedulerOutput
from tailserve.core.source import ListSource
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.driver import SimDriver
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.policies.tgi import TgiConfig, TgiPolicy

H100 = DeviceInfo("H100-SXM", 80.0)


def _tgi(num_blocks: int = 1000, max_model_len: int = 4096, **cfg) -> Scheduler:
    return scheduler_for(TgiPolicy(TgiConfig(**cfg)), num_blocks, 1, max_model_len)


def _add(sched: Scheduler, rid: str, prompt: int, max_tokens: int, now: float = 0.0) -> Request:
    request = Request(rid, prompt, max_tokens, now)
    sched.add_request(request, now)
    assert request.status is RequestStatus.WAITING
    return request


def _engine(sched: Scheduler, requests: list[Request], fast_forward: bool = True) -> Engine:
    cost_model = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    return Engine(
        sched,
        SimExecutor(cost_model, block_size=1),
        ListSource(requests),
        options=EngineOptions(fast_forward=fast_forward, check_integrity=True),
    )


def _workload(seed: int, n: int, rate: float, max_prompt: int, max_out: int) -> list[Request]:
    rng = random.Random(seed)
    t = 0.0
    requests = []
    for i in range(n):
        t += rng.expovariate(rate)
        requests.append(Request(f"r{i}", rng.randint(1, max_prompt), rng.randint(1, max_out), t))
    return requests


# ---- admission: whole-lifetime reservation, FIFO, head-of-line blocking ---------------------


def test_admission_reserves_prompt_plus_max_tokens_and_stops_at_the_first_misfit():
    sched = _tgi(100, max_batch_prefill_tokens=1000)
    _add(sched, "a", 30, 21)  # reserves 30 + 21 - 1 = 50 tokens
    _add(sched, "b", 40, 21)  # 60: does not fit the 50 left
    _add(sched, "c", 5, 5)  # 9 would fit, but waits behind b
    out = _step(sched)
    assert _grants(out) == [("a", 30, 0)]
    assert out.num_admitted == 1
    assert sched.kv_cache.num_held("a") == 50
    assert sched.kv_cache.num_held("b") == 0  # the failed reservation left nothing behind
    assert _ids(sched.waiting) == ["b", "c"]

    # a decodes 20 more tokens; its reservation covers them, b and c keep waiting.
    for _ in range(19):
        out = _step(sched)
        assert _grants(out) == [("a", 1, out.scheduled[0].num_context_tokens)]
        assert sched.kv_cache.num_held("a") == 50
    assert _ids(sched.waiting) == ["b", "c"]
    _step(sched)
    assert sched.running == [] and sched.kv_cache.num_free_blocks == 100

    out = _step(sched)
    assert _grants(out) == [("b", 40, 0), ("c", 5, 0)]
    assert sched.kv_cache.num_held("b") == 60 and sched.kv_cache.num_held("c") == 9


def test_never_preempts_under_a_small_kv_cache_and_every_request_finishes():
    for chunking in (True, False):
        sched = _tgi(300, max_model_len=256, max_batch_prefill_tokens=255, prefill_chunking=chunking)
        requests = _workload(seed=7, n=60, rate=200.0, max_prompt=200, max_out=55)
        SimDriver(_engine(sched, requests)).run()
        assert len(sched.finished) == 60
        assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)
        assert all(r.num_output_tokens == r.max_tokens for r in requests)
        assert sched.num_preemptions == 0 and all(r.num_preemptions == 0 for r in requests)


# ---- chunking mode ------------------------------------------------------------------------


def test_chunking_admission_batches_the_new_chunk_with_the_running_batch_then_decodes():
    sched = _tgi(max_batch_prefill_tokens=64)
    _add(sched, "a", 10, 50)
    _add(sched, "b", 10, 50)
    assert _grants(_step(sched)) == [("a", 10, 0), ("b", 10, 0)]
    # Nobody waits: the router turn is just the decode forward.
    assert _grants(_step(sched)) == [("a", 1, 10), ("b", 1, 10)]

    _add(sched, "c", 100, 5)
    out = _step(sched)
    # One forward: a token for each running request and c's first chunk, 64 - 2 = 62 tokens.
    assert _grants(out) == [("a", 1, 11), ("b", 1, 11), ("c", 62, 0)]
    assert out.num_admitted == 1
    assert sched.kv_cache.num_held("c") == 104

    # The same turn's decode forward follows; d, arriving now, is not considered in it. c gets
    # the rest of its prompt (38 <= 64 - 2).
    _add(sched, "d", 5, 5)
    out = _step(sched)
    assert _grants(out) == [("a", 1, 12), ("b", 1, 12), ("c", 38, 62)]
    assert out.num_admitted == 0
    assert _ids(sched.waiting) == ["d"]

    # Next turn: d joins with the running batch in one forward.
    out = _step(sched)
    assert _grants(out) == [("a", 1, 13), ("b", 1, 13), ("c", 1, 100), ("d", 5, 0)]


def test_chunking_prefill_budget_is_max_batch_prefill_tokens_minus_current_tokens():
    sched = _tgi(max_batch_prefill_tokens=16)
    _add(sched, "a", 40, 3)
    assert _grants(_step(sched)) == [("a", 16, 0)]  # the first batch: a chunk of the budget
    _add(sched, "b", 4, 3)
    # a will feed 16 tokens next: 16 - 16 = 0 left, so b waits and a's next chunk runs.
    out = _step(sched)
    assert _grants(out) == [("a", 16, 16)]
    assert _ids(sched.waiting) == ["b"]
    # a's last chunk is 8 tokens: b gets in with the 8 left.
    out = _step(sched)
    assert _grants(out) == [("a", 8, 32), ("b", 4, 0)]
    assert sched.running[0].num_output_tokens == 1  # a's prompt is complete: first token


def test_chunk_continuation_walks_the_batch_in_reverse_newest_first():
    sched = _tgi(max_batch_prefill_tokens=10)
    _add(sched, "x", 2, 2)
    _add(sched, "b", 30, 2)
    assert _grants(_step(sched)) == [("x", 2, 0), ("b", 8, 0)]
    # Next chunks: budget 10 - (2 - 1) = 9, all to b. x finishes in this forward.
    assert _grants(_step(sched)) == [("x", 1, 2), ("b", 9, 8)]
    assert _ids(sched.running) == ["b"]
    _add(sched, "c", 20, 2)
    # b will feed 9: c's first chunk is the 1 token left.
    assert _grants(_step(sched)) == [("b", 9, 17), ("c", 1, 0)]
    # Both still prefill. Budget 10 - 1 = 9 walking from the end: c (newest) takes 9, the older b
    # gets the minimum of 1 although it has only 4 left.
    assert _grants(_step(sched)) == [("b", 1, 26), ("c", 9, 1)]
    assert _grants(_step(sched)) == [("b", 1, 27), ("c", 9, 10)]


# ---- legacy mode --------------------------------------------------------------------------


def test_legacy_new_batch_is_prefilled_alone_while_the_running_batch_waits():
    sched = _tgi(prefill_chunking=False, max_batch_prefill_tokens=64)
    _add(sched, "a", 10, 50)
    _add(sched, "b", 10, 50)
    assert _grants(_step(sched)) == [("a", 10, 0), ("b", 10, 0)]
    _add(sched, "c", 20, 5)
    # min_size = floor(2 x 0.3) = 0: c is admitted and prefilled alone (a decode stall).
    out = _step(sched)
    assert _grants(out) == [("c", 20, 0)]
    assert out.num_admitted == 1
    assert _grants(_step(sched)) == [("a", 1, 10), ("b", 1, 10), ("c", 1, 20)]


def _legacy_batch_of_four(**cfg) -> Scheduler:
    sched = _tgi(prefill_chunking=False, max_batch_prefill_tokens=64, **cfg)
    for rid in "abcd":
        _add(sched, rid, 4, 50)
    assert _grants(_step(sched)) == [("a", 4, 0), ("b", 4, 0), ("c", 4, 0), ("d", 4, 0)]
    return sched


def test_legacy_waiting_served_ratio_withholds_admission_until_enough_requests_wait():
    sched = _legacy_batch_of_four(waiting_served_ratio=0.5, max_waiting_tokens=100)
    _add(sched, "e", 4, 5)
    # min_size = floor(4 x 0.5) = 2 and only e waits: decode forwards only.
    for _ in range(3):
        out = _step(sched)
        assert _ids(s.request for s in out.scheduled) == ["a", "b", "c", "d"]
    _add(sched, "f", 4, 5)
    out = _step(sched)
    assert _grants(out) == [("e", 4, 0), ("f", 4, 0)]


def test_legacy_batch_smaller_than_min_size_goes_back_whole():
    # 4 x 53 tokens are reserved; 30 are left: e (reserving 8) fits, f (reserving 40) does not.
    sched = _legacy_batch_of_four(num_blocks=242, waiting_served_ratio=0.5, max_waiting_tokens=100)
    _add(sched, "e", 4, 5)
    _add(sched, "f", 36, 5)
    free = sched.kv_cache.num_free_blocks
    out = _step(sched)
    assert _ids(s.request for s in out.scheduled) == ["a", "b", "c", "d"]
    assert _ids(sched.waiting) == ["e", "f"]
    assert sched.kv_cache.num_held("e") == 0 and sched.kv_cache.num_free_blocks == free


def test_legacy_max_waiting_tokens_forces_admission_after_that_many_decodes():
    sched = _legacy_batch_of_four(waiting_served_ratio=0.5, max_waiting_tokens=3)
    _add(sched, "e", 4, 5)
    # The counter is 1 after the prefill and grows by one per decode forward: two decodes, then
    # min_size is dropped and e is prefilled alone.
    assert len(_step(sched).scheduled) == 4
    assert len(_step(sched).scheduled) == 4
    assert _grants(_step(sched)) == [("e", 4, 0)]
    # The admission restarts the counter at 1: the turn's decode forward, one more, then f.
    _add(sched, "f", 4, 5)
    assert len(_step(sched).scheduled) == 5
    assert len(_step(sched).scheduled) == 5
    assert _grants(_step(sched)) == [("f", 4, 0)]


def test_chunking_mode_ignores_waiting_served_ratio():
    sched = _tgi(waiting_served_ratio=10.0, max_waiting_tokens=1000, max_batch_prefill_tokens=64)
    for rid in "abcd":
        _add(sched, rid, 4, 50)
    _step(sched)
    _add(sched, "e", 4, 5)
    assert _grants(_step(sched))[-1] == ("e", 4, 0)


def test_legacy_max_batch_size_caps_the_first_batch_and_admission():
    sched = _tgi(prefill_chunking=False, max_batch_size=3, max_batch_prefill_tokens=64)
    for rid in "abcde":
        _add(sched, rid, 4, 50)
    assert _ids(s.request for s in _step(sched).scheduled) == ["a", "b", "c"]
    # max_size = 3 - 3 = 0: no admission until a request finishes.
    assert _ids(s.request for s in _step(sched).scheduled) == ["a", "b", "c"]
    assert _ids(sched.waiting) == ["d", "e"]


# ---- backpressure -------------------------------------------------------------------------


def test_max_concurrent_requests_rejects_the_excess_with_a_reason():
    sched = _tgi(max_concurrent_requests=2, max_batch_prefill_tokens=64)
    _add(sched, "a", 4, 2)
    _add(sched, "b", 4, 2)
    c = Request("c", 4, 2, 0.0)
    sched.add_request(c, 0.0)
    assert c.status is RequestStatus.FINISHED_REJECTED
    assert "overloaded" in c.status_reason
    assert c in sched.finished and c not in sched.waiting
    _step(sched)
    _step(sched)  # a and b finish
    d = _add(sched, "d", 4, 2)
    assert d in sched.waiting


# ---- whole runs and the fast path ---------------------------------------------------------


class _CountingTgi(TgiPolicy):
    """Counts ``schedule`` calls, i.e. iterations the engine did not fast-forward."""

    def __init__(self, config: TgiConfig) -> None:
        super().__init__(config)
        self.num_schedules = 0

    def schedule(self, sched: Scheduler, now: float) -> SchedulerOutput:
        self.num_schedules += 1
        return super().schedule(sched, now)


@pytest.mark.parametrize("chunking", [True, False], ids=["chunking", "legacy"])
def test_fast_path_gives_the_same_token_times_as_stepping(chunking):
    results = []
    for fast in (True, False):
        policy = _CountingTgi(
            TgiConfig(
                max_batch_prefill_tokens=511,
                prefill_chunking=chunking,
                waiting_served_ratio=1.2,
                max_waiting_tokens=8,
            )
        )
        sched = scheduler_for(policy, 2000, 1, 512)
        requests = _workload(seed=11, n=80, rate=40.0, max_prompt=400, max_out=100)
        SimDriver(_engine(sched, requests, fast_forward=fast)).run()
        assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)
        results.append(({r.request_id: r.token_times for r in requests}, policy.num_schedules))
    (fast_times, fast_calls), (slow_times, slow_calls) = results
    assert fast_times == slow_times
    assert fast_calls < slow_calls / 2  # the fast path really skipped decode runs


# ---- configuration ------------------------------------------------------------------------


def test_default_config_and_validation():
    cfg = TgiPolicy.default_config(H100, 8192)
    assert (cfg.waiting_served_ratio, cfg.max_waiting_tokens, cfg.max_batch_prefill_tokens) == (0.3, 20, 4096)
    assert (cfg.max_batch_total_tokens, cfg.max_batch_size, cfg.max_concurrent_requests) == (None, None, 128)
    assert cfg.prefill_chunking
    assert TgiPolicy.profile_tokens(cfg, 8192) == 4096
    assert TgiPolicy.default_config(H100, 2048).max_batch_prefill_tokens == 2048
    # Legacy mode needs the longest prompt to fit one prefill.
    assert TgiPolicy.default_config(H100, 8192, prefill_chunking=False).max_batch_prefill_tokens == 8191
    with pytest.raises(ValueError, match="max_input_tokens"):
        TgiPolicy.default_config(H100, 8192, prefill_chunking=False, max_batch_prefill_tokens=4096)
    with pytest.raises(ValueError, match="max_batch_total_tokens"):
        TgiConfig(max_batch_prefill_tokens=4096, max_batch_total_tokens=1000)
    assert TgiPolicy.default_config(H100, 4096, max_batch_total_tokens="9000").max_batch_total_tokens == 9000
    with pytest.raises(ValueError):
        TgiConfig(max_batch_size=0)
