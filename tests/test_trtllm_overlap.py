"""TensorRT-LLM 1.2's overlap scheduler in the ``trtllm`` policy (``policies/trtllm_overlap.py``):
hand-worked steps with a fixed-cost executor, the default and its note, the flag's errors."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tailserve.assemble import BuildOptions, build_engine
from tailserve.core.device import DeviceInfo
from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.executor import StepResult
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import SchedulerOutput
from tailserve.core.source import ListSource
from tailserve.executors.simulated.deployment import Deployment
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.kv.paged import KVCacheManager
from tailserve.policies.registry import PolicySpec
from tailserve.policies.trtllm import TrtllmPolicy
from tailserve.policies.trtllm_config import TrtllmConfig

H100 = get_hardware("H100-SXM").device_info
FORWARD = 1.0  # seconds of forward pass per step
HOST = 0.25  # seconds of host work per step (scheduling, input preparation, responses)


@dataclass
class FixedExecutor:
    """Every step: ``HOST`` of host work then ``FORWARD`` of forward pass; records the steps."""

    needs_block_ids: bool = False
    steps: list[list[tuple[str, int]]] = field(default_factory=list)

    def execute(self, out: SchedulerOutput) -> StepResult:
        self.steps.append([(s.request.request_id, s.num_new_tokens) for s in out.scheduled])
        return StepResult(duration=HOST + FORWARD, host_time=HOST)


def _run(
    requests: list[Request], overlap: bool, num_blocks: int = 64, **flags
) -> tuple[Engine, FixedExecutor]:
    config = TrtllmConfig(disable_overlap_scheduler=not overlap, **flags)
    executor = FixedExecutor()
    engine = Engine(
        Scheduler(TrtllmPolicy(config), KVCacheManager(num_blocks, 4), 1024),
        executor,
        ListSource(requests),
        options=EngineOptions(check_integrity=True),
    )
    engine.run()
    return engine, executor


@dataclass
class AcceptingExecutor(FixedExecutor):
    """``FixedExecutor`` whose verifications accept every draft."""

    def execute(self, out: SchedulerOutput) -> StepResult:
        result = super().execute(out)
        result.num_accepted = {
            s.request.request_id: s.num_spec_tokens for s in out.scheduled if s.num_spec_tokens
        }
        return result


def _run_drafts(
    request: Request | list[Request], overlap: bool, num_blocks: int = 64, block_size: int = 4
) -> tuple[Engine, AcceptingExecutor]:
    """Two MTP drafts, every one accepted: a generation step commits 3 tokens."""
    config = TrtllmConfig(
        disable_overlap_scheduler=not overlap, decoding_type="MTP", num_nextn_predict_layers=2,
        synthetic_acceptance_length=3.0,
    )  # fmt: skip
    executor = AcceptingExecutor()
    engine = Engine(
        Scheduler(TrtllmPolicy(config), KVCacheManager(num_blocks, block_size), 1024),
        executor,
        ListSource(request if isinstance(request, list) else [request]),
        options=EngineOptions(check_integrity=True),
    )
    engine.run()
    return engine, executor


def _steps_of(executor: FixedExecutor, rid: str) -> list[int]:
    return [i for i, step in enumerate(executor.steps) if any(r == rid for r, _ in step)]


def test_a_max_tokens_finish_is_foreseen_and_its_tokens_arrive_a_step_late():
    """``GENERATION_TO_COMPLETE``: the step that yields the last token is the last one scheduled
    (no extra step), but its tokens are known only when the next step is launched."""
    sync, sync_exec = _run([Request("a", 8, 3, 0.0)], overlap=False)
    over, over_exec = _run([Request("a", 8, 3, 0.0)], overlap=True)
    assert sync_exec.steps == over_exec.steps == [[("a", 8)], [("a", 1)], [("a", 1)]]
    (a_sync,), (a_over,) = sync.requests, over.requests
    # Without overlap each step is host + forward after the last: tokens at 1.25, 2.5, 3.75.
    assert a_sync.token_times == pytest.approx([1.25, 2.5, 3.75])
    # With it the host part of step n+1 runs during step n's forward pass: steps end at 1.25,
    # 2.25, 3.25; the first token is stamped at its step's end, as every token is.
    assert a_over.token_times == pytest.approx([1.25, 2.25, 3.25])
    assert a_over.finish_time == pytest.approx(3.25)
    assert a_over.status.name == "FINISHED_LENGTH"


def _three() -> list[Request]:
    # a finishes after 2 tokens, c runs on, b waits for a's slot or blocks (fetch order a, c, b).
    return [Request("a", 8, 2, 0.0), Request("c", 4, 8, 0.0), Request("b", 8, 2, 0.0)]


def test_a_finished_requests_slot_comes_back_a_step_later():
    """``max_batch_size`` 2: b is fetched once a leaves the active list, when a's last outputs
    are processed (``_handle_responses``) — after the next step was scheduled under overlap."""
    _, sync_exec = _run(_three(), overlap=False, max_batch_size=2)
    _, over_exec = _run(_three(), overlap=True, max_batch_size=2)
    assert sync_exec.steps[:3] == [[("a", 8), ("c", 4)], [("a", 1), ("c", 1)], [("b", 8), ("c", 1)]]
    # Step 2 is scheduled while a's last step (1) runs: a sits it out (GENERATION_TO_COMPLETE)
    # but still holds its slot, so b starts in step 3.
    assert over_exec.steps[:4] == [
        [("a", 8), ("c", 4)], [("a", 1), ("c", 1)], [("c", 1)], [("b", 8), ("c", 1)]
    ]  # fmt: skip


def test_admission_waits_a_step_for_the_kv_of_a_finishing_request():
    """GUARANTEED_NO_EVICT with room for two: b is admitted once a's blocks are freed, which
    under overlap happens after the step that would have admitted it was scheduled; a sits
    that step out while still holding its reservation."""
    # 6 blocks of 4: a and c reserve blocks_for(8 + 2) = blocks_for(4 + 8) = 3 each.
    _, sync_exec = _run(_three(), overlap=False, num_blocks=6)
    _, over_exec = _run(_three(), overlap=True, num_blocks=6)
    assert _steps_of(sync_exec, "a") == _steps_of(over_exec, "a") == [0, 1]
    assert _steps_of(sync_exec, "b")[0] == 2
    assert over_exec.steps[2] == [("c", 1)] and _steps_of(over_exec, "b")[0] == 3


def test_a_freshly_prefilled_request_decodes_in_the_next_step():
    _, over_exec = _run([Request("a", 8, 3, 0.0), Request("b", 5, 3, 0.5)], overlap=True)
    # b arrives during step 0 (0..1.25): step 1 was scheduled at 0.25 without it, so it is
    # prefilled in step 2, and decodes in step 3 on its first token still in flight.
    assert over_exec.steps[0] == [("a", 8)]
    assert ("b", 5) in over_exec.steps[2]
    assert ("b", 1) in over_exec.steps[3]


def test_host_time_is_hidden_behind_the_forward_pass():
    """A lone decode stream: each step costs host + forward without overlap and only the
    forward pass with it (the first step pays its host part)."""
    sync, _ = _run([Request("a", 8, 10, 0.0)], overlap=False)
    over, _ = _run([Request("a", 8, 10, 0.0)], overlap=True)
    gaps = lambda r: [b - a for a, b in zip(r.token_times, r.token_times[1:])]  # noqa: E731
    assert gaps(sync.requests[0]) == pytest.approx([HOST + FORWARD] * 9)
    assert gaps(over.requests[0]) == pytest.approx([FORWARD] * 9)


# ---- the default, the note, the flag -------------------------------------------------------------


def test_overlap_is_tensorrt_llms_default_on_a_gpu_and_says_so():
    cpu = DeviceInfo("CPU", 2.0, vendor="cpu")
    on = TrtllmPolicy.default_config(H100, 8192)
    assert on.disable_overlap_scheduler is False and TrtllmPolicy(on).async_scheduling()
    note = TrtllmPolicy.default_notes(H100, on, {})
    assert len(note) == 1 and note[0].startswith("overlap scheduler on: TensorRT-LLM 1.2's default")
    assert "py_executor.py@5f480b7a" in note[0]
    assert not TrtllmPolicy(TrtllmPolicy.default_config(cpu, 8192)).async_scheduling()
    # MTP / Eagle3 one-model drafts keep it (support_overlap_scheduler), and the note says so.
    mtp = TrtllmPolicy.default_config(H100, 8192, decoding_type="MTP", synthetic_acceptance_length=1.5)
    assert mtp.disable_overlap_scheduler is False and TrtllmPolicy(mtp).async_scheduling()
    assert "kept with MTP/Eagle3 one-model drafts" in TrtllmPolicy.default_notes(H100, mtp, {})[0]
    # An explicit value wins and says nothing; a hand-made config has no overlap.
    for flag in (True, False):
        config = TrtllmPolicy.default_config(H100, 8192, disable_overlap_scheduler=flag)
        assert TrtllmPolicy(config).async_scheduling() is not flag
        assert TrtllmPolicy.default_notes(H100, config, {"disable_overlap_scheduler": flag}) == []
    assert not TrtllmPolicy(TrtllmConfig()).async_scheduling()


def test_the_flag_errors_are_one_line():
    built = Deployment("Llama-3-8B", "H100-SXM", 1)
    with pytest.raises(ValueError) as error:
        build_engine(
            built, "trtllm:disable_overlap_scheduler=false", "realtime-sim", BuildOptions(vocab_size=100)
        )
    assert "disable_overlap_scheduler=false needs the simulated executor" in str(error.value)
    assert "\n" not in str(error.value)


def test_a_simulated_run_overlaps_by_default_and_a_synchronous_executor_does_not():
    deployment = Deployment("Llama-3-8B", "H100-SXM", 1)
    built = build_engine(deployment, "trtllm", "sim")
    assert built.scheduler.async_scheduling
    assert len(built.notes) == 1 and built.notes[0].startswith("overlap scheduler on")
    off = build_engine(deployment, "trtllm:disable_overlap_scheduler=true", "sim")
    assert not off.scheduler.async_scheduling and off.notes == ()
    realtime = build_engine(deployment, "trtllm", "realtime-sim", BuildOptions(vocab_size=100))
    assert not realtime.scheduler.async_scheduling
    assert realtime.spec.flags == {"disable_overlap_scheduler": True}
    assert realtime.notes[0].startswith("overlap scheduler off: the real-time simulated executor")


def test_overlap_runs_fast_forwarded_equal_stepped_runs(monkeypatch):
    """The async decode run (async_decode_run.py) follows this policy's overlap exactly, and
    takes most of the steps."""
    from tailserve.executors.simulated import async_decode_run
    from tailserve.executors.simulated.deployment import build_cost_model
    from tailserve.sim.run import run_policy
    from tailserve.sim.workload_builder import WorkloadBuilder
    from tailserve.sim.workload_spec import WorkloadSpec

    built = build_cost_model(Deployment("Llama-3-8B", "H100-SXM", 1, "none"))
    workload = WorkloadSpec("chat", num_requests=80, rate=8.0, seed=5)
    skipped: list[int] = []
    original = async_decode_run.advance_async_decode_run

    def counting(engine: Engine) -> int:
        skipped.append(original(engine))
        return skipped[-1]

    monkeypatch.setattr(async_decode_run, "advance_async_decode_run", counting)
    runs = []
    for fast in (True, False):
        run = run_policy(
            built,
            PolicySpec.make("trtllm", {}),
            WorkloadBuilder(workload),
            options=EngineOptions(fast_forward=fast),
        )
        runs.append(([r.token_times for r in run.requests], run.log.num_decode_tokens))
    assert runs[0] == runs[1]
    assert sum(skipped) > len(runs[0][1]) // 2


def test_drafts_accepted_a_step_late_can_cost_one_dropped_step():
    """MTP with overlap (TensorRT-LLM 1.2's default): a step's accepted drafts are known when the
    next step is already launched, and ``willCompleteNextIteration`` assumes one token per step.
    Prompt 4, max_tokens 7, two drafts all accepted. Without overlap: context (1 token), then two
    steps of 3 (4, 7: done). With overlap step 3 is scheduled while step 2, which yields tokens
    5-7, runs: tokens known then are 4 (4 + 1 < 7), so it runs and its output is dropped."""
    sync, sync_exec = _run_drafts(Request("a", 4, 7, 0.0), overlap=False)
    over, over_exec = _run_drafts(Request("a", 4, 7, 0.0), overlap=True)
    assert sync_exec.steps == [[("a", 4)], [("a", 3)], [("a", 3)]]
    assert over_exec.steps == [[("a", 4)], [("a", 3)], [("a", 3)], [("a", 3)]]
    (a_sync,), (a_over,) = sync.requests, over.requests
    assert a_sync.num_output_tokens == a_over.num_output_tokens == 7
    # Tokens: 1 at each step's end, 3 per generation step; overlapped steps end every 1.0 s
    # after the first (host hidden), so tokens 5-7 come at 3.25, not 3.75.
    assert a_sync.token_times == pytest.approx([1.25] + [2.5] * 3 + [3.75] * 3)
    assert a_over.token_times == pytest.approx([1.25] + [2.25] * 3 + [3.25] * 3)
    assert a_over.status.name == "FINISHED_LENGTH"


def test_a_finish_by_one_token_is_foreseen_with_drafts():
    """max_tokens 5: after step 2 is launched 4 tokens are known (1 + 3), and 4 + 1 >= 5 marks
    the request GENERATION_TO_COMPLETE: step 3 is not scheduled; step 2 commits 1 of its 3."""
    over, over_exec = _run_drafts(Request("a", 4, 5, 0.0), overlap=True)
    assert over_exec.steps == [[("a", 4)], [("a", 3)], [("a", 3)]]
    (a,) = over.requests
    assert a.num_output_tokens == 5 and a.token_times == pytest.approx([1.25, 2.25, 2.25, 2.25, 3.25])


def test_the_reservation_holds_the_unrewound_drafts_of_the_step_in_flight():
    """Block size 1, two requests of prompt 4, max_tokens 6, two drafts (one extra slot). A
    generation step scheduled while the previous one runs takes its 1 + 2 slots past that step's
    2 drafts, not yet rewound: the last step of each allocates 10 + 1 + 3 = 14 slots, one past
    prompt + max_tokens + extra + drafts = 13. The reservation to completion counts the step in
    flight's drafts too (15 each), so with 27 blocks the second request waits for the first
    instead of running out of blocks mid-step (26 <= 27 would admit both, then need 28)."""
    requests = [Request("a", 4, 6, 0.0), Request("b", 4, 6, 0.0)]
    engine, executor = _run_drafts(requests, overlap=True, num_blocks=27, block_size=1)
    assert all(r.status.name == "FINISHED_LENGTH" and r.num_output_tokens == 6 for r in engine.requests)
    assert executor.steps[0] == [("a", 4)]  # b's 15 blocks do not fit beside a's
    assert min(_steps_of(executor, "b")) > max(_steps_of(executor, "a"))
