"""tailserve's ``vllm`` policy as one side of a P/D pair against vLLM 0.32's own scheduler with
its ``NixlConnector``, step for step (``--engine vllm-nixl``).

The golden file ``fixtures/differential/vllm_nixl.json`` holds vLLM's decisions for seeded random
workloads of a decode instance (``kv_consumer``: every prompt read from a remote prefill once
admitted) or a prefill instance (``kv_producer``: every finished request's KV kept until sent),
with a fake NIXL worker reporting each transfer ``transfer_steps`` later, recorded by ``python -m
benchmarks.differential --engine vllm-nixl --record-fixture``; replayed here without vLLM.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from tests.test_differential import live, vllm_driver  # noqa: F401  (the live driver fixture)

from tailserve.validate.generate import random_vllm_nixl_spec_workload, random_vllm_nixl_workload
from tailserve.validate.golden import check_entry, load_fixture
from tailserve.validate.tailserve_side import build_vllm_scheduler, run_tailserve
from tailserve.validate.trace import first_divergence
from tailserve.validate.workload import RequestSpec, SchedulerSpec, Workload, from_compact, to_compact

FIXTURE = Path(__file__).parent / "fixtures" / "differential" / "vllm_nixl.json"


@pytest.fixture(scope="module")
def golden() -> dict:
    return load_fixture(FIXTURE)


def test_golden_nixl_traces_are_step_identical(golden):
    assert golden["engine"] == "vllm-nixl" and golden["version"] == "0.32.0"
    entries = golden["workloads"]
    assert len(entries) >= 250
    mismatches = [m for i, e in enumerate(entries) if (m := check_entry(i, e, run_tailserve)) is not None]
    assert not mismatches, f"{len(mismatches)} of {len(entries)} differ; first:\n" + mismatches[0].describe()


def _observed(w: Workload) -> dict[str, int]:
    """What one replay went through: reads admitted, KV held by finished requests (sent or
    aborted mid-read), preemptions."""
    sched = build_vllm_scheduler(w.scheduler)
    seen = {"reads": 0, "held_steps": 0, "aborted_mid_read": 0, "preempted": 0, "deferred_frees": 0}
    free_sent, abort, detach = sched.free_sent, sched.abort_request, sched.kv_cache.detach

    def counting_detach(request_id: str, key: str) -> None:
        seen["deferred_frees"] += 1
        detach(request_id, key)

    sched.kv_cache.detach = counting_detach  # type: ignore[method-assign]

    def counting_free(now: float) -> None:
        seen["held_steps"] += bool(sched.held)
        free_sent(now)

    def counting_abort(request_id: str, reason: str, now: float):
        loading = any(r.request_id == request_id for r in sched.loading)
        request = abort(request_id, reason, now)
        seen["aborted_mid_read"] += loading and sched.held is not None and request_id in sched.held.requests
        return request

    sched.free_sent, sched.abort_request = counting_free, counting_abort  # type: ignore[method-assign]
    for step in run_tailserve(w, sched):
        seen["preempted"] += len(step.preempted)
    seen["reads"] = sum(r.kv_load is not None for r in sched.finished)
    return seen


def test_golden_nixl_covers_both_sides_and_their_waits(golden):
    """Both roles, queue policies and async scheduling on and off; reads reported from the
    admitting step to 20 steps later; decode instances whose reads are aborted in flight (their
    blocks held until the read is reported), preempted, and (async) freeing blocks only once
    the step in flight has run; prefill instances holding finished prompts until sent."""
    specs = [from_compact(e["workload"]) for e in golden["workloads"]]
    assert {w.scheduler.nixl_role for w in specs} == {"kv_consumer", "kv_producer"}
    assert {w.scheduler.scheduling_policy for w in specs} == {"fcfs", "priority"}
    assert {w.scheduler.async_scheduling for w in specs} == {True, False}
    assert {r.transfer_steps for w in specs for r in w.requests} >= {0, 1, 20}
    keys = ("reads", "held_steps", "aborted_mid_read", "preempted", "deferred_frees")
    totals = {
        (role, a): dict.fromkeys(keys, 0) for role in ("kv_consumer", "kv_producer") for a in (False, True)
    }
    for w in specs[:150]:
        for k, v in _observed(w).items():
            totals[w.scheduler.nixl_role, w.scheduler.async_scheduling][k] += v
    for a in (False, True):
        consumer, producer = totals["kv_consumer", a], totals["kv_producer", a]
        assert consumer["reads"] > 50 and consumer["aborted_mid_read"] > 0 and consumer["preempted"] > 0
        assert producer["held_steps"] > 50 and producer["reads"] == 0
        assert (consumer["deferred_frees"] > 0) == a and producer["deferred_frees"] == 0


def test_compact_workloads_carry_the_transfer_steps():
    w = random_vllm_nixl_workload(4)
    back = from_compact(to_compact(w))
    assert back == w and all(r.transfer_steps is not None for r in back.requests)


def test_a_nixl_workload_needs_transfer_steps_on_every_request_and_only_there():
    spec = SchedulerSpec(num_blocks=8, nixl_role="kv_consumer")
    r = RequestSpec("a", 0, [5, 6, 7], [8])
    with pytest.raises(ValueError, match="transfer_steps goes with nixl_role"):
        Workload(spec, [r])
    with pytest.raises(ValueError, match="transfer_steps goes with nixl_role"):
        Workload(replace(spec, nixl_role=None), [replace(r, transfer_steps=1)])
    with pytest.raises(ValueError, match="nixl_role must be"):
        SchedulerSpec(num_blocks=8, nixl_role="kv_both")
    with pytest.raises(ValueError, match="transfer_steps must be >= 0"):
        RequestSpec("a", 0, [5], [8], transfer_steps=-1)


@pytest.mark.differential
@live
def test_live_nixl_workloads_are_step_identical(vllm_driver):  # noqa: F811
    bad = []
    for seed in range(10_000, 10_100):
        w = random_vllm_nixl_workload(seed)
        div = first_divergence(run_tailserve(w), vllm_driver.run(w))
        if div is not None:
            bad.append(f"seed {seed}: {div.describe()}")
    assert not bad, f"{len(bad)} of 100 differ; first:\n{bad[0]}"


def test_loaded_requests_are_tried_in_the_order_their_reads_were_admitted():
    """vLLM's ``kv_holding_waiting`` under fcfs: requests whose reads are done wait in the order
    their reads were admitted, not the order they were done in. r, a and b are admitted to read
    in one pass (reads take no running slot); r takes the one slot; a's read is done 3 steps
    before b's, and when r leaves a goes first (tailserve put b first before: the last one done
    went to the queue's front)."""
    spec = SchedulerSpec(num_blocks=40, max_num_seqs=1, nixl_role="kv_consumer")
    r = RequestSpec("r", 0, list(range(10, 30)), list(range(100, 112)), transfer_steps=0)
    a = RequestSpec("a", 0, list(range(40, 60)), [200, 201], transfer_steps=2)
    b = RequestSpec("b", 0, list(range(60, 80)), [300, 301], transfer_steps=5)
    steps = run_tailserve(Workload(spec, [r, a, b]))
    assert [rid for s in steps for rid in s.admitted] == ["r", "a", "b"]
    assert steps[0].num_used_blocks == 6 and steps[13].admitted == ["a"]


def test_a_preempted_request_recomputing_its_outputs_reserves_kv_against_reads():
    """vLLM counts a preempted request recomputing prompt and outputs among its in-flight
    prefills (``_inflight_prefill_reserved_blocks``), so a read that would eat its blocks waits."""
    w = random_vllm_nixl_workload(218)
    w = replace(w, scheduler=replace(w.scheduler, async_scheduling=False))
    steps = run_tailserve(w)
    assert any(s.preempted == ["r06"] for s in steps)
    step62 = steps[62]
    assert step62.scheduled == [("r06", 1, 7)] and step62.num_used_blocks == 9  # r10's read waits


def _async(seed: int) -> Workload:
    w = random_vllm_nixl_workload(seed)
    return replace(w, scheduler=replace(w.scheduler, async_scheduling=True))


def test_async_decode_side_preempts_no_request_whose_step_is_in_flight():
    """vLLM's running pass on a decode instance with async scheduling: the victim's blocks would
    come back only after its step in flight ("a deferred free will not help"), so nobody is
    preempted, the request that needed a block waits and the pass ends (seed 26, step 44: r04)."""
    steps = run_tailserve(_async(26))
    assert steps[44].scheduled == [("r01", 1, 17)] and steps[44].preempted == []
    assert steps[45].num_used_blocks == 6  # r04 preempted one step later, its step done


def test_async_prefill_side_drops_a_preempted_requests_output_in_flight():
    """A prefill instance must hand over whole KV (``requires_kv_delivery``): the token a
    preempted request's step in flight samples is dropped, so it recomputes its prompt only and
    fits again at once (seed 20: r02, preempted at step 31, back at 32)."""
    steps = run_tailserve(_async(20))
    assert steps[31].preempted == ["r02"]
    assert steps[32].admitted == ["r02"] and steps[32].scheduled[-1] == ("r02", 4, 0)


# ---- the decode side with speculative decoding (``--engine vllm-nixl-spec``) -----------------

FIXTURE_SPEC = Path(__file__).parent / "fixtures" / "differential" / "vllm_nixl_spec.json"


def test_golden_nixl_spec_traces_are_step_identical():
    """Either side of the pair with drafts (EAGLE/MTP with lookahead slots, n-gram, ``ngram_gpu``
    under async scheduling), recorded by ``python -m benchmarks.differential --engine
    vllm-nixl-spec -k 300 --fixture-max-steps 200 --record-fixture ... --fixture-identical-only``
    (seed 459 differs in some runs only: vLLM frees the sends reported in one step in its hash
    order, docs/validation.md)."""
    golden = load_fixture(FIXTURE_SPEC)
    assert golden["engine"] == "vllm-nixl-spec" and golden["version"] == "0.32.0"
    entries = golden["workloads"]
    assert len(entries) >= 250
    specs = [from_compact(e["workload"]).scheduler for e in entries]
    assert {s.speculative_method for s in specs} == {"eagle", "ngram", "ngram_gpu"}
    assert {s.nixl_role for s in specs} == {"kv_consumer", "kv_producer"}
    assert {s.async_scheduling for s in specs} == {False, True}
    mismatches = [m for i, e in enumerate(entries) if (m := check_entry(i, e, run_tailserve)) is not None]
    assert not mismatches, f"{len(mismatches)} of {len(entries)} differ; first:\n" + mismatches[0].describe()


def test_a_read_prompt_is_padded_to_the_drafts_like_any_new_decode():
    """vLLM pads a new decode with one token left to 1 + k when it has KV of its own, a read
    prompt's included (``num_computed_tokens > 0``), not only a local hit (seed 2, k = 2: r00's
    whole prompt read, its last token recomputed with two placeholder drafts)."""
    steps = run_tailserve(random_vllm_nixl_spec_workload(2))
    assert steps[6].scheduled == [("r00", 3, 18)]


def test_a_read_is_admitted_only_with_room_for_the_drafts_step():
    """The reserve against a read counts each in-flight prefill's whole sequence plus a decode
    step's slots (1 + k + lookahead), and the read's own first decode step
    (``_spec_decode_step_blocks``); a read prompt scheduled in this pass stays an in-flight
    prefill until the pass ends. Seed 163 (n-gram, k = 4, 4-token blocks): r04's one-token read
    waits at step 8, as r01, read and scheduled in that pass, still counts."""
    steps = run_tailserve(random_vllm_nixl_spec_workload(163))
    assert steps[8].scheduled == [("r01", 5, 23)] and steps[8].num_used_blocks == 9


@pytest.mark.differential
@live
def test_a_prefill_side_frees_the_sends_of_one_step_in_the_engines_hash_order():
    """Seed 459 of ``vllm-nixl-spec``: r07's and r04's sends are reported in the same step, and
    vLLM frees their blocks in the order it iterates that set of request ids, which follows the
    driver process's string hash seed (``PeerDriver(hash_seed=...)``); tailserve frees them in
    release order. Under some hash seeds the two runs agree, under others they differ: what
    ``benchmarks.differential --recheck-hash-seeds`` reports as order-only."""
    from tailserve.validate.peers import PeerDriver

    w = random_vllm_nixl_spec_workload(459)
    ours = run_tailserve(w)
    agree = set()
    for hash_seed in range(6):
        with PeerDriver("vllm", hash_seed=hash_seed) as driver:
            agree.add(first_divergence(ours, driver.run(w)) is None)
        if len(agree) == 2:
            break
    assert agree == {True, False}
