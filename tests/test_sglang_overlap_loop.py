"""The r49 cuts to SGLang's overlap loop are exact: the decode batch's ``decode_head`` (each
decode samples) gives what the passes per request give, in overlap and synchronous SGLang; the
async run's counts for one-token slots held exactly (``exact_slots``) are the walks' they replace."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from tailserve.core.scheduler_output import SchedulerOutput
from tailserve.executors.simulated import async_decode_run
from tailserve.executors.simulated.async_decode_run import _long_need, _short_need, _skip_step
from tailserve.policies.sglang import SglangPolicy
from test_speed_paths import BURSTY, SPARSE, _assert_same, _async_fingerprint

RETRACTING = replace(BURSTY, seed=13, rate=40.0)
CASES = [
    ("sglang", BURSTY),
    ("sglang,disable_overlap_schedule=true", replace(BURSTY, seed=12)),
    ("sglang,gpu_memory_utilization=0.25,disable_radix_cache=true", RETRACTING),
    ("sglang,disable_overlap_schedule=true,gpu_memory_utilization=0.25", replace(RETRACTING, seed=14)),
    ("sglang,enable_mixed_chunk=true,chunked_prefill_size=512", replace(SPARSE, seed=8)),
]


@pytest.mark.parametrize("spec, workload", CASES)
def test_decode_head_changes_nothing(monkeypatch: pytest.MonkeyPatch, spec: str, workload) -> None:
    """Stepped with and without the head the policy vouches for: the same results (the head is
    what ``advance_scheduled`` / ``Scheduler.update`` and the pricing pass derive themselves)."""
    heads: list[tuple[int, int]] = []
    original = SglangPolicy._add_decodes

    def recording(self, sched, decodes, out, lag=None):
        original(self, sched, decodes, out, lag)
        if out.decode_head is not None:
            heads.append(out.decode_head)

    monkeypatch.setattr(SglangPolicy, "_add_decodes", recording)
    with_head, _ = _async_fingerprint(spec, workload, False)
    assert len(heads) > 20  # the decode turns said it

    def without(self, sched, decodes, out, lag=None):
        original(self, sched, decodes, out, lag)
        out.decode_head = None

    monkeypatch.setattr(SglangPolicy, "_add_decodes", without)
    plain, _ = _async_fingerprint(spec, workload, False)
    _assert_same(with_head, plain)


def test_the_head_is_what_the_batch_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each head names the batch's leading one-token decodes and their contexts; a mixed batch
    (chunks first) says none."""
    seen: list[SchedulerOutput] = []
    original = SglangPolicy._add_decodes

    def checking(self, sched, decodes, out, lag=None):
        chunks = len(out.scheduled)
        original(self, sched, decodes, out, lag)
        if chunks or not decodes:
            assert out.decode_head is None
            return
        m, context = out.decode_head
        assert m == len(decodes) == len(out.scheduled)
        assert context == sum(s.num_context_tokens for s in out.scheduled)
        assert all(s.num_new_tokens == 1 and not s.num_spec_tokens for s in out.scheduled)
        seen.append(out)

    monkeypatch.setattr(SglangPolicy, "_add_decodes", checking)
    _async_fingerprint(
        "sglang,enable_mixed_chunk=true,chunked_prefill_size=512", replace(SPARSE, seed=8), False
    )
    assert len(seen) > 20


def test_exact_slots_need_is_the_walks() -> None:
    """One-token slots held exactly (every ``f`` 0): the closed form is the running count's and
    numpy's, the free blocks cutting it anywhere."""
    rng = random.Random(3)
    for _ in range(3000):
        n, k = rng.randint(1, 60), rng.randint(1, 32)
        free = rng.randint(0, n * k + n)
        first_new = [0] * n
        ctx = [rng.randint(1, 5000) for _ in range(n)]
        expected = _long_need(ctx, first_new, 1, free, k)
        assert _short_need(first_new, 1, free, k, True) == expected
        assert _short_need(first_new, 1, free, k) == expected


class _Executor:
    """Host time and step durations that tell batches and contexts apart."""

    def decode_host_time(self, num_decodes: int) -> float:
        return 1e-4 * num_decodes

    def decode_step_duration(self, num_decodes: int, num_context: int) -> float:
        return 0.01 + 1e-3 * num_decodes + 1e-7 * num_context


def test_exact_slots_skip_step_is_the_walks() -> None:
    """The skipping step counted from the skipped requests alone is the walk over every one."""
    rng = random.Random(4)
    executor = _Executor()
    taken = 0
    for _ in range(3000):
        n, k = rng.randint(1, 60), rng.randint(0, 20)
        ctx = [rng.randint(1, 5000) for _ in range(n)]
        remaining = [k + rng.choice([0, 0, 1, 5, 40]) for _ in range(n)]
        free = rng.randint(0, n + 2)
        ends = [0.1 * (j + 1) for j in range(k)]
        args = (executor, remaining, ctx, list(ctx), k, 1, free, 0.0, 0.05, ends, None)
        step = _skip_step(*args)
        assert _skip_step(*args, True) == step
        taken += step is not None
    assert taken > 500


def test_a_wrong_exact_slots_count_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the checks above and the run's comparison with stepping catch: a skipping step that
    counts one context token too many."""
    original = async_decode_run._skip_step

    def off_by_one(executor, remaining, ctx_list, *rest):
        return original(executor, remaining, [c + 1 for c in ctx_list], *rest)

    monkeypatch.setattr(async_decode_run, "_skip_step", off_by_one)
    fast, _ = _async_fingerprint("sglang", SPARSE, True)
    slow, _ = _async_fingerprint("sglang", SPARSE, False)
    assert fast != slow


@pytest.mark.parametrize(
    "spec, workload",
    [
        ("sglang", SPARSE),
        ("sglang", BURSTY),
        ("vllm", replace(SPARSE, seed=5)),
        ("trtllm", replace(SPARSE, seed=6)),
    ],
)
def test_the_step_a_run_leaves_in_flight_is_the_engines(
    monkeypatch: pytest.MonkeyPatch, spec, workload
) -> None:
    """The items of the step a run leaves in flight hold what scheduling it would have given
    them, their contexts taken from before the run (``c + k - 1``; ``c + k`` past a skipping
    step): one token on its context, the computed tokens less the one in flight."""
    original = async_decode_run.advance_async_decode_run
    checked: list[int] = []

    def checking(engine):
        k = original(engine)
        if k:
            items = engine.in_flight.out.scheduled
            assert [s.request for s in items] == engine.scheduler.running
            for s in items:
                assert s.num_new_tokens == 1
                assert s.num_context_tokens == s.request.num_computed_tokens - 1
            checked.append(len(items))
        return k

    monkeypatch.setattr(async_decode_run, "advance_async_decode_run", checking)
    _async_fingerprint(spec, workload, True)
    assert len(checked) > 5  # calls (SGLang's chains take several runs in one)
