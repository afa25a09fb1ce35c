"""Sarathi sorts its running batch by arrival only when the batch's last request is not the one
last known in arrival order (``SarathiPolicy._sorted_tail``): the decisions must be those of a
sort at every step, with preemptions (the victims leave the batch and come back), with an
earlier arrival admitted behind a later one, and with a request appended to the batch from
outside the policy."""

from __future__ import annotations

import random

import pytest

from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.core.source import ListSource
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.driver import SimDriver
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.kv.paged import KVCacheManager
from tailserve.policies.sarathi import SarathiConfig, SarathiPolicy


class _SortsEveryStep(SarathiPolicy):
    """The rule without the skip: the batch's order is never taken as known."""

    def schedule(self, sched, now):
        self._sorted_tail = None
        return super().schedule(sched, now)


def _requests(seed: int, n: int) -> list[Request]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(n):
        t += rng.expovariate(50.0)
        out.append(Request(f"r{i}", rng.randint(1, 600), rng.randint(1, 80), t))
    return out


def _run(policy_cls, requests: list[Request], fast_forward: bool):
    sched = Scheduler(policy_cls(SarathiConfig(chunk_size=256)), KVCacheManager(48, 16), 8192)
    orders = []
    schedule = sched.schedule

    def checked(now):
        out = schedule(now)
        arrivals = [r.arrival_time for r in sched.running]
        assert arrivals == sorted(arrivals)  # phase 3 appends only later arrivals
        orders.append([r.request_id for r in sched.running])
        return out

    sched.schedule = checked
    batch = [Request(r.request_id, r.prompt_len, r.max_tokens, r.arrival_time) for r in requests]
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    options = EngineOptions(fast_forward=fast_forward, check_integrity=True)
    engine = Engine(sched, SimExecutor(cost, 16), ListSource(batch), options=options)
    SimDriver(engine).run()
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in batch)
    assert sched.num_preemptions > 0  # victims left the batch and came back
    outcome = [(r.request_id, r.num_preemptions, tuple(r.token_times)) for r in batch]
    return orders, outcome, list(engine.log.start), list(engine.log.batch_size)


@pytest.mark.parametrize("seed", [11, 12, 13])
@pytest.mark.parametrize("fast_forward", [False, True])
def test_skipping_the_sort_decides_as_sorting_every_step(seed: int, fast_forward: bool) -> None:
    requests = _requests(seed, 50)
    assert _run(SarathiPolicy, requests, fast_forward) == _run(_SortsEveryStep, requests, fast_forward)


def test_a_request_appended_from_outside_is_sorted_into_place() -> None:
    kv = KVCacheManager(100, 16)
    sched = Scheduler(SarathiPolicy(SarathiConfig(chunk_size=64)), kv, 8192)
    late = Request("late", 8, 4, 1.0)
    assert sched.add_request(late, 1.0)
    sched.schedule(1.0)  # admits it: the batch's last request, known in arrival order
    assert [r.request_id for r in sched.running] == ["late"]
    early = Request("early", 8, 4, 0.5)
    early.num_computed_tokens = 8
    early.num_output_tokens = 1
    early.status = RequestStatus.RUNNING
    assert sched.allocate(early, 8)
    sched.running.append(early)  # as tests/helpers.running_request does
    out = sched.schedule(1.0)
    assert [r.request_id for r in sched.running] == ["early", "late"]
    assert [s.request.request_id for s in out.scheduled][:1] == ["early"]


@pytest.mark.parametrize("policy_cls", [SarathiPolicy, _SortsEveryStep])
def test_an_earlier_arrival_admitted_behind_the_tail_is_sorted_next_step(policy_cls) -> None:
    # Added to the waiting queue out of arrival order (a caller's own queue, not a trace's):
    # phase 3 admits it behind a later arrival, so the next step must sort again.
    sched = Scheduler(policy_cls(SarathiConfig(chunk_size=64)), KVCacheManager(100, 16), 8192)
    for rid, arrival in (("a", 0.0), ("b", 2.0)):
        assert sched.add_request(Request(rid, 8, 4, arrival), 2.0)
    sched.schedule(2.0)
    c = Request("c", 8, 4, 1.0)
    assert sched.add_request(c, 2.0)
    sched.schedule(2.0)  # admits c last
    assert [r.request_id for r in sched.running] == ["a", "b", "c"]
    sched.schedule(2.0)
    assert [r.request_id for r in sched.running] == ["a", "c", "b"]
