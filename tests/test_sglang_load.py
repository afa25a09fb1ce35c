"""SGLang 0.5.23's load and cadence knobs (``policies/sglang_load.py``): ``max_queued_requests``
(``scheduler.py:3552``), ``prefill_max_requests`` (``schedule_policy.py:1398``; also checked
against SGLang's own ``PrefillAdder`` by the prefill-pass differential) and
``prefill_decode_interval`` (``scheduler.py:1400``), with page-size-1 KV pools sized by hand."""

from __future__ import annotations

import random

import pytest

from helpers import grants as _grants
from helpers import ids as _ids
from helpers import running_request as _running
from helpers import scheduler_for, sim_run
from helpers import step as _step
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.policies.sglang import SglangConfig, SglangPolicy
from tailserve.policies.sglang_load import PUSHED_OUT, QUEUE_FULL


def _sglang(num_blocks: int, **cfg) -> Scheduler:
    return scheduler_for(SglangPolicy(SglangConfig(**cfg)), num_blocks, 1, 4096)


def _add(
    sched: Scheduler, rid: str, prompt: int, max_tokens: int, now: float = 0.0, priority: int = 0
) -> Request:
    request = Request(rid, prompt, max_tokens, now, priority=priority)
    sched.add_request(request, now)
    return request


# ---- max_queued_requests --------------------------------------------------------------------


def test_a_full_waiting_queue_refuses_the_arrival_with_503():
    sched = _sglang(1000, max_queued_requests=2)
    a, b = _add(sched, "a", 5, 3), _add(sched, "b", 5, 3)
    c = _add(sched, "c", 5, 3)
    assert c.status is RequestStatus.FINISHED_REJECTED and QUEUE_FULL in c.status_reason
    assert "max_queued_requests=2" in c.status_reason and "503" in c.status_reason
    assert _ids(sched.waiting) == ["a", "b"] and not a.is_finished and not b.is_finished
    _step(sched)  # a and b leave the queue for the running batch: room again
    d = _add(sched, "d", 5, 3, now=0.02)
    assert not d.is_finished and _ids(sched.waiting) == ["d"]


def test_zero_refuses_everything_and_none_refuses_nothing():
    sched = _sglang(1000, max_queued_requests=0)
    assert _add(sched, "a", 5, 3).status is RequestStatus.FINISHED_REJECTED
    sched = _sglang(1000)
    requests = [_add(sched, f"r{i}", 5, 3) for i in range(50)]
    assert not any(r.is_finished for r in requests)


@pytest.mark.parametrize(
    ("low_first", "priorities", "incoming", "pushed_out"),
    [
        # higher values more urgent: the least preferred is the lowest, the newest among equals
        (False, {"a": 1, "b": 1}, 5, "b"),
        (False, {"a": 1, "b": 3}, 5, "a"),
        (False, {"a": 1, "b": 1}, 1, None),  # not strictly more urgent: the arrival is refused
        # lower values more urgent
        (True, {"a": 1, "b": 3}, 0, "b"),
        (True, {"a": 3, "b": 3}, 3, None),
    ],
)
def test_under_priority_scheduling_a_more_urgent_arrival_pushes_out_the_least_preferred(
    low_first, priorities, incoming, pushed_out
):
    sched = _sglang(
        1000,
        max_queued_requests=2,
        enable_priority_scheduling=True,
        schedule_low_priority_values_first=low_first,
    )
    queued = {rid: _add(sched, rid, 5, 3, now=t, priority=p) for t, (rid, p) in enumerate(priorities.items())}
    c = _add(sched, "c", 5, 3, now=5.0, priority=incoming)
    if pushed_out is None:
        assert c.status is RequestStatus.FINISHED_REJECTED and QUEUE_FULL in c.status_reason
        assert not any(r.is_finished for r in queued.values())
        return
    victim = queued[pushed_out]
    assert victim.status is RequestStatus.FINISHED_REJECTED and PUSHED_OUT in victim.status_reason
    assert victim.finish_time == 5.0 and not c.is_finished
    assert sorted(_ids(sched.waiting)) == sorted(set(priorities) - {pushed_out} | {"c"})


def test_a_retracted_request_meeting_a_full_queue_is_aborted():
    # The retraction scenario of test_sglang.py: 11 slots, five decodes need five. The victims
    # "b" then "c" go back to the queue, which holds "w": "b" fills it, "c" finds it full.
    sched = _sglang(11, max_queued_requests=2)
    for rid, prompt, outputs, max_tokens in [
        ("a", 2, 2, 30), ("b", 3, 1, 100), ("c", 2, 1, 100), ("d", 1, 1, 20), ("e", 1, 2, 29),
    ]:  # fmt: skip
        _running(sched, rid, prompt, outputs, max_tokens)
    _add(sched, "w", 2, 1)
    out = sched.schedule(5.0)
    assert _ids(out.preempted) == ["b", "c"]
    c = next(r for r in out.preempted if r.request_id == "c")
    assert c.status is RequestStatus.FINISHED_ABORTED and QUEUE_FULL in c.status_reason
    assert _ids(sched.waiting) == ["w", "b"] and c in sched.finished
    assert sched.kv_cache.num_free_blocks == 2  # c's 2 slots freed once, b's 3: 5 - 3 decodes


def test_a_p_d_server_ignores_max_queued_requests():
    cfg = SglangConfig(max_queued_requests=1, disaggregation_mode="prefill", prefill_decode_interval=4)
    sched = scheduler_for(SglangPolicy(cfg), 1000, 1, 4096)
    assert not any(_add(sched, f"r{i}", 5, 3).is_finished for i in range(3))
    assert cfg.decode_interval == 0


# ---- prefill_max_requests ---------------------------------------------------------------------


def test_prefill_max_requests_caps_a_prefill_batch():
    sched = _sglang(1000, prefill_max_requests=2)
    for rid in "abc":
        _add(sched, rid, 5, 3)
    assert _grants(_step(sched)) == [("a", 5, 0), ("b", 5, 0)]
    assert not sched.policy.batch_is_full  # the cap ends the walk without freezing admission
    assert _grants(_step(sched, 0.01)) == [("c", 5, 0)]  # prefill first: a and b wait


@pytest.mark.parametrize(("limit", "second"), [(None, [("a", 4, 16), ("b", 5, 0)]), (1, [("a", 4, 16)])])
def test_the_continuing_chunk_counts_toward_prefill_max_requests(limit, second):
    sched = _sglang(1000, chunked_prefill_size=16, prefill_max_requests=limit)
    _add(sched, "a", 20, 3)
    _add(sched, "b", 5, 3)
    assert _grants(_step(sched)) == [("a", 16, 0)]  # the chunk spends the chunk budget
    assert _grants(_step(sched, 0.01)) == second


# ---- prefill_decode_interval ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "prefill_of_b_at"),
    [
        ({}, 1),
        ({"prefill_decode_interval": 2}, 3),  # two decode-only turns after a's prefill
        ({"prefill_decode_interval": 2, "prefill_decode_interval_min_bs": 2}, 1),  # one decodes: < 2
        ({"prefill_decode_interval": 2, "prefill_decode_interval_min_bs": 1}, 3),
    ],
)
def test_prefill_decode_interval_holds_the_next_prefill_back(flags, prefill_of_b_at):
    sched = _sglang(1000, **flags)
    _add(sched, "a", 5, 20)
    assert _grants(_step(sched)) == [("a", 5, 0)]
    _add(sched, "b", 6, 20, now=0.01)
    steps = [_grants(_step(sched, 0.01 * (i + 1))) for i in range(4)]
    first = next(i for i, g in enumerate(steps) if ("b", 6, 0) in g)
    assert first + 1 == prefill_of_b_at
    assert all(g == [("a", 1, 5 + i)] for i, g in enumerate(steps[:first]))


def test_a_turn_with_nothing_to_decode_spins_the_countdown_out():
    # "a" finishes with its prefill (one token): the deferred turn has nothing to run, so
    # SGLang's idle loop turns spin the countdown down and the prefill runs at once.
    sched = _sglang(1000, prefill_decode_interval=5)
    a = _add(sched, "a", 5, 1)
    _step(sched)
    assert a.status is RequestStatus.FINISHED_LENGTH
    _add(sched, "b", 6, 4, now=0.02)
    assert _grants(_step(sched, 0.02)) == [("b", 6, 0)]


def test_config_checks():
    for flags, text in [
        ({"max_queued_requests": -1}, "max_queued_requests must be >= 0"),
        ({"prefill_max_requests": 0}, "prefill_max_requests must be >= 1"),
        ({"prefill_decode_interval": -1}, "--prefill-decode-interval must be non-negative."),
        ({"prefill_decode_interval_min_bs": -2}, "--prefill-decode-interval-min-bs must be non-negative."),
    ]:
        with pytest.raises(ValueError, match=text):
            SglangConfig(**flags)


# ---- whole runs ---------------------------------------------------------------------------------


def _workload(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    t, requests = 0.0, []
    for i in range(n):
        t += rng.expovariate(80.0)
        requests.append(
            Request(f"r{i}", rng.randint(20, 400), rng.randint(5, 200), t, priority=rng.randint(0, 9))
        )
    return requests


LEFT = (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_REJECTED, RequestStatus.FINISHED_ABORTED)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(
    "flags",
    [
        {"max_queued_requests": 4},
        {"max_queued_requests": 3, "enable_priority_scheduling": True, "max_running_requests": 6},
        {"prefill_max_requests": 2, "chunked_prefill_size": 64},
        {"prefill_decode_interval": 3, "prefill_decode_interval_min_bs": 2},
        {"prefill_decode_interval": 4, "chunked_prefill_size": 64, "enable_mixed_chunk": True},
    ],
)
def test_whole_runs_end_every_request_and_the_fast_paths_change_nothing(flags, overlap):
    """Every request finishes or is refused with a reason, the KV pool checks out after every
    step (``check_integrity``), and the fast paths give the stepped run's tokens to the time."""
    runs = []
    for fast in (False, True):
        sched = _sglang(1500, disable_overlap_schedule=not overlap, **flags)
        engine = sim_run(sched, _workload(60, 3), fast)
        assert len(engine.requests) == 60
        assert all(r.status in LEFT for r in engine.requests)
        assert all(r.status_reason for r in engine.requests if r.status is not RequestStatus.FINISHED_LENGTH)
        assert sched.kv_cache.num_free_blocks == 1500  # no token ids: nothing cached, all freed
        runs.append({r.request_id: (r.status, r.token_times) for r in engine.requests})
    assert runs[0] == runs[1]
    if "max_queued_requests" in flags:  # the limit binds at this load
        assert any(status is not RequestStatus.FINISHED_LENGTH for status, _ in runs[0].values())


@pytest.mark.parametrize("interval", [0, 2])
def test_a_long_chunked_prompt_beside_a_decode_runs_alike_fast_and_stepped(interval):
    """Without ``check_integrity`` (which turns the lone-chunk run off): a chunk run must not
    skip the countdown each chunk starts while another request decodes."""
    runs = []
    for fast in (False, True):
        cfg = SglangConfig(
            chunked_prefill_size=64, prefill_decode_interval=interval, disable_overlap_schedule=True
        )
        sched = scheduler_for(SglangPolicy(cfg), 20000, 1, 8192)
        workload = [Request("d0", 30, 400, 0.0), Request("long", 3000, 5, 0.001)]
        engine = sim_run(sched, workload, fast, check_integrity=False)
        runs.append({r.request_id: r.token_times for r in engine.requests})
    assert runs[0] == runs[1]


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory: pytest.TempPathFactory):
    from server_helpers import MICRO
    from tailserve.executors.pytorch.init_model import init_model

    return init_model(tmp_path_factory.mktemp("models") / "micro", preset="tiny", dtype="float32", **MICRO)


def test_a_request_pushed_out_of_the_queue_is_reported_finished(micro_model):
    from tailserve.llm import LLMEngine, SamplingParams

    engine = LLMEngine.from_args(
        str(micro_model), executor="sim", hardware="H100-SXM", sim_model="Llama-3-8B", policy="sglang",
        policy_flags={"max_running_requests": "1", "max_queued_requests": "1", "enable_priority_scheduling": "true"},
    )  # fmt: skip
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    engine.add_request("a", "hello world", SamplingParams(max_tokens=20, ignore_eos=True))
    outputs = engine.step()
    engine.add_request("b", "hello world", params, priority=0)
    outputs += engine.step()
    engine.add_request("c", "hello world", params, priority=5)  # more urgent: b leaves the full queue
    while engine.has_unfinished_requests():
        outputs += engine.step()
    finished = {o.request_id: o.finish_reason for o in outputs if o.finished}
    assert finished == {"a": "length", "b": "abort", "c": "length"}
