"""SGLang 0.5.23's overlap scheduler in the ``sglang`` policy (``policies/sglang_overlap.py``):
hand-worked steps on a fixed-cost executor, invariants, the flag and its note."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from tailserve.core.device import DeviceInfo
from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.executor import StepResult
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import SchedulerOutput
from tailserve.core.source import ListSource
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.kv.factory import make_kv_cache
from tailserve.policies.sglang import SglangPolicy
from tailserve.policies.sglang_config import SglangConfig


@dataclass
class FixedExecutor:
    """Every step lasts ``duration`` seconds, ``host`` of them on the host (the part the
    overlap scheduler hides behind the previous step's forward pass)."""

    duration: float = 0.010
    host: float = 0.002
    needs_block_ids: bool = False

    def execute(self, out: SchedulerOutput) -> StepResult:
        return StepResult(duration=self.duration, host_time=self.host)


def _engine(requests: list[Request], overlap: bool, num_blocks: int = 4096, **flags) -> Engine:
    config = SglangConfig(
        disable_overlap_schedule=not overlap, disable_radix_cache=True, chunked_prefill_size=64, **flags
    )
    policy = SglangPolicy(config)
    kv = make_kv_cache(policy.kv_spec(), num_blocks, 1, 0, shares_prefixes=False)
    sched = Scheduler(policy, kv, 4096)
    return Engine(sched, FixedExecutor(), ListSource(requests), options=EngineOptions(check_integrity=True))


def _run(requests: list[Request], overlap: bool, **kw) -> Engine:
    engine = _engine(requests, overlap, **kw)
    engine.run()
    return engine


def test_overlap_hides_the_host_time_of_every_step_after_the_first():
    """One request, prompt 8, 4 outputs. Synchronous: 1 prefill (it samples the first token) +
    3 decodes of 10 ms, tokens at 10, 20, 30, 40 ms.
    Overlap: step 1's host part (2 ms) runs alone, then each forward pass (8 ms) follows the
    previous one back to back: tokens at 10, 18, 26; the last decode is never scheduled (its
    token is the in-flight step's, foreseen by length), so the same 4 tokens end at 34 ms."""
    sync = _run([Request("a", 8, 4, 0.0)], overlap=False).scheduler.finished[0]
    over = _run([Request("a", 8, 4, 0.0)], overlap=True).scheduler.finished[0]
    assert sync.token_times == pytest.approx([0.010, 0.020, 0.030, 0.040])
    assert over.token_times == pytest.approx([0.010, 0.018, 0.026, 0.034])
    assert over.finish_time == pytest.approx(0.034)


def test_a_finish_by_length_is_foreseen_and_not_decoded_again():
    """The step after the one that yields the last token does not include the request
    (``_reqs_finishing_inflight``): the request is scheduled exactly max_tokens - 1 decodes,
    as without overlap, and its KV (prompt + outputs - 1 slots: the last token is never
    written) comes back when the in-flight result is processed."""
    engine = _engine([Request("a", 8, 3, 0.0), Request("b", 8, 6, 0.0)], overlap=True)
    decodes = {"a": 0, "b": 0}
    while engine.step():
        flight = engine.in_flight
        if flight is not None:
            for s in flight.out.scheduled:
                if s.num_new_tokens == 1:
                    decodes[s.request.request_id] += 1
    assert decodes == {"a": 2, "b": 5}
    a = next(r for r in engine.scheduler.finished if r.request_id == "a")
    assert a.num_output_tokens == 3 and a.num_computed_tokens == 8 + 3 - 1
    assert engine.scheduler.kv_cache.num_used_blocks == 0


def test_admission_waits_for_the_result_and_its_prefill_for_the_device():
    """KV for one request at a time (a reserves its outputs; b's 40 + 4 + 1 slots do not fit
    beside it in 60): b waits for a. Synchronous (10 ms steps): a's tokens at 10..40 ms, b
    admitted at 40, first token at 50. Overlap (8 ms forward + 2 ms host): a's tokens at
    10, 18, 26, 34; the batch after a's last decode is decided at 26 while that decode runs and
    leaves a out (foreseen), so it is empty: the loop processes the in-flight result at 34 (a
    leaves, its KV comes back) and only then admits b, whose prefill pays its host part on an
    idle device (36..44)."""
    reqs = lambda: [Request("a", 40, 4, 0.0), Request("b", 40, 4, 0.001)]  # noqa: E731
    s = {r.request_id: r for r in _run(reqs(), overlap=False, num_blocks=60).scheduler.finished}
    o = {r.request_id: r for r in _run(reqs(), overlap=True, num_blocks=60).scheduler.finished}
    assert s["a"].finish_time == pytest.approx(0.040)
    assert s["b"].first_scheduled_time == pytest.approx(0.040)
    assert s["b"].token_times[0] == pytest.approx(0.050)
    assert o["a"].token_times == pytest.approx([0.010, 0.018, 0.026, 0.034])
    assert o["b"].first_scheduled_time == pytest.approx(0.034)
    assert o["b"].token_times[0] == pytest.approx(0.044)


def test_a_foreseen_finish_unblocks_admission_a_step_earlier_but_the_prefill_queues():
    """a (2 outputs) and b (8) run; c fits only once a leaves (75 slots). Synchronous: a
    finishes at 20 ms; the next decode clears ``batch_is_full`` (b alone, 20..30) and c is
    admitted at 30, first token at 40. Overlap: the batch decided at 10 ms (step 3) leaves a
    out, which clears the flag during that decode; at 18 ms a's result is processed (a leaves,
    KV back) and c is admitted into the next batch — but b's decode (step 3) holds the device
    until 26, so c's prefill runs 26..34: c's first token at 34, a's finish at 18."""
    reqs = lambda: [Request("a", 30, 2, 0.0), Request("b", 30, 8, 0.0), Request("c", 30, 2, 0.0005)]  # noqa: E731
    s = {r.request_id: r for r in _run(reqs(), overlap=False, num_blocks=75).scheduler.finished}
    o = {r.request_id: r for r in _run(reqs(), overlap=True, num_blocks=75).scheduler.finished}
    assert s["a"].finish_time == pytest.approx(0.020)
    assert s["c"].first_scheduled_time == pytest.approx(0.030)
    assert s["c"].token_times[0] == pytest.approx(0.040)
    assert o["a"].finish_time == pytest.approx(0.018)
    assert o["c"].first_scheduled_time == pytest.approx(0.018)
    assert o["c"].token_times[0] == pytest.approx(0.034)
    # b's step 4 (26..34) was c's prefill: b's token after 26 comes at 42
    assert o["b"].token_times[:4] == pytest.approx([0.010, 0.018, 0.026, 0.042])


def test_invariants_with_overlap_on_random_load_and_retraction():
    """Every request leaves; KV conserved after every step (check_integrity); retraction
    under pressure drops in-flight outputs and recomputes."""
    rng = random.Random(7)
    reqs = [Request(f"r{i}", rng.randint(4, 120), rng.randint(1, 60), i * 0.003) for i in range(80)]
    engine = _run(reqs, overlap=True, num_blocks=300, schedule_conservativeness=0.1)
    sched = engine.scheduler
    assert not sched.has_unfinished
    assert len(sched.finished) == 80
    assert sched.kv_cache.num_used_blocks == 0
    for r in sched.finished:
        if r.status.name == "FINISHED_LENGTH":
            assert r.num_output_tokens == r.max_tokens
            assert len(r.token_times) == r.max_tokens
    assert sched.num_preemptions > 0  # the case exercises retraction


def test_the_flag_default_and_note():
    h100 = get_hardware("H100-SXM").device_info
    cfg = SglangPolicy.default_config(h100, 4096)
    assert cfg.disable_overlap_schedule is False and SglangPolicy(cfg).async_scheduling()
    notes = SglangPolicy.default_notes(h100, cfg, {})
    assert any(n.startswith("sglang overlap scheduler on") for n in notes)
    off = SglangPolicy.default_config(h100, 4096, disable_overlap_schedule=True)
    assert not SglangPolicy(off).async_scheduling()
    assert SglangPolicy.default_notes(h100, off, {"disable_overlap_schedule": True}) == []
    # speculative decoding: overlapped too (spec v2), said so; off when asked, with SGLang's warning
    spec = SglangPolicy.default_config(
        h100, 4096, speculative_algorithm="EAGLE3", synthetic_acceptance_length=2.0
    )
    assert spec.disable_overlap_schedule is False and SglangPolicy(spec).async_scheduling()
    assert any(
        "overlap scheduler on with speculative decoding (spec v2)" in n
        for n in SglangPolicy.default_notes(h100, spec, {})
    )
    sync = SglangPolicy.default_config(
        h100,
        4096,
        speculative_algorithm="EAGLE3",
        synthetic_acceptance_length=2.0,
        disable_overlap_schedule=True,
    )
    assert not SglangPolicy(sync).async_scheduling()
    sync_notes = SglangPolicy.default_notes(h100, sync, {"disable_overlap_schedule": True})
    assert any("non-overlap (synchronous) spec v2" in n for n in sync_notes)
    # on a CPU SGLang turns overlap off for speculative decoding (speculative_hook.py:66-78)
    cpu = DeviceInfo("cpu", 64.0, vendor="cpu")
    on_cpu = SglangPolicy.default_config(
        cpu, 4096, speculative_algorithm="EAGLE3", synthetic_acceptance_length=2.0
    )
    assert on_cpu.disable_overlap_schedule is True
    # a config made directly (the differential harnesses): synchronous
    assert not SglangPolicy(SglangConfig()).async_scheduling()


def test_the_flag_errors_are_one_line():
    with pytest.raises(ValueError, match="disable_overlap_schedule must be true or false"):
        SglangConfig(disable_overlap_schedule="yes")  # type: ignore[arg-type]
    h100 = get_hardware("H100-SXM").device_info
    # spec v2 is simulated: an explicit false with drafts is SGLang's default, accepted
    config = SglangPolicy.default_config(
        h100,
        4096,
        disable_overlap_schedule=False,
        speculative_algorithm="EAGLE3",
        synthetic_acceptance_length=2.0,
    )
    assert SglangPolicy(config).async_scheduling()


def test_the_real_time_executor_turns_the_default_off_with_a_note_and_refuses_it_asked():
    from tailserve.assemble import BuildOptions, build_engine
    from tailserve.executors.simulated.deployment import Deployment

    deployment = Deployment("Llama-3-8B", "H100-SXM", 1, "none")
    built = build_engine(deployment, "sglang", "realtime-sim", BuildOptions(shares_prefixes=False))
    assert built.parts.config.disable_overlap_schedule is True
    assert built.parts.notes == (
        "sglang overlap scheduler off: the real-time simulated executor (serve --executor sim) runs steps "
        "synchronously (SGLang 0.5.23 would overlap here)",
    )
    with pytest.raises(ValueError, match="runs steps synchronously"):
        build_engine(
            deployment,
            "sglang:disable_overlap_schedule=false",
            "realtime-sim",
            BuildOptions(shares_prefixes=False),
        )
    sim = build_engine(deployment, "sglang", "sim", BuildOptions(shares_prefixes=False))
    assert sim.parts.config.disable_overlap_schedule is False and sim.parts.policy.async_scheduling()


def test_a_retracted_request_drops_its_in_flight_output():
    """SGLang skips the in-flight result of a retracted request (``req.is_retracted``): its
    outputs stay where they were when it was retracted, and it recomputes prompt + those."""
    rng = random.Random(7)
    reqs = [Request(f"r{i}", rng.randint(4, 120), rng.randint(1, 60), i * 0.003) for i in range(80)]
    engine = _engine(reqs, overlap=True, num_blocks=300, schedule_conservativeness=0.1)
    checked = 0
    while True:
        # A step schedules (retracting some, whose step is in flight) and then applies that step.
        before = {id(r): r.num_output_tokens for r in engine.scheduler.running}
        if not engine.step():
            break
        flight = engine.in_flight
        for r in flight.out.preempted if flight is not None else []:
            assert r.num_output_tokens == before[id(r)]
            checked += 1
    assert checked > 0
