"""The ``trtllm`` policy's draft tokens (``speculative_config``: MTP, Eagle3), worked by hand from
TensorRT-LLM's source: the micro-batch scheduler charges a generation request ``beam_width +
num_draft_tokens`` against ``max_num_tokens`` (``scheduler.py`` ``PyMicroBatchScheduler``), the KV
manager adds a slot per draft (``resource_manager.py`` ``prepare_resources``) and rewinds the
rejected ones, ``getNeededBlocksOneStep`` counts ``1 + draft tokens`` per step, and a request
advances by 1 + its accepted drafts.

KV blocks of 4 tokens; three drafts (MTP ``num_nextn_predict_layers=3``) unless a case says so,
so each request also holds ``num_extra_kv_tokens`` = 3 - 1 = 2 slots past its tokens
(``get_num_extra_kv_tokens``, added at its first context chunk).
"""

from __future__ import annotations

import pytest

from helpers import grants, scheduler_for
from tailserve.core.device import DeviceInfo
from tailserve.core.executor import StepResult
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.policies.registry import PolicySpec
from tailserve.policies.trtllm import TrtllmPolicy
from tailserve.policies.trtllm_capacity import NO_DRAFTS, DraftSlots, blocks_one_step, remaining_blocks

H100 = DeviceInfo("H100-SXM", 80.0)
BLOCK = 4
MTP3 = {"decoding_type": "MTP", "num_nextn_predict_layers": "3", "synthetic_acceptance_length": "2.5"}


def _trt(num_blocks: int = 100, **flags) -> Scheduler:
    spec = PolicySpec.make("trtllm", {**MTP3, **flags})
    policy = TrtllmPolicy(TrtllmPolicy.default_config(H100, 4096, **spec.flags))
    return scheduler_for(policy, num_blocks, BLOCK, 4096)


def _add(sched: Scheduler, rid: str, prompt: int, max_tokens: int) -> Request:
    request = Request(rid, prompt, max_tokens, 0.0)
    sched.add_request(request, 0.0)
    return request


def _step(sched: Scheduler, accepted: dict[str, int] | None = None, now: float = 0.0):
    out = sched.schedule(now)
    sched.update(out, StepResult(duration=0.01, num_accepted=accepted or {}), now + 0.01)
    return out


def test_a_generation_request_costs_one_token_plus_its_drafts_against_max_num_tokens():
    # 8 tokens: two generation requests of 1 + 3; the third waits (the walk ends at it).
    sched = _trt(max_num_tokens=8)
    for rid in "abc":
        _add(sched, rid, 4, 10)
    assert grants(_step(sched)) == [("a", 4, 0), ("b", 4, 0)]  # contexts: 4 + 4 = 8 tokens
    out = _step(sched)
    assert grants(out) == [("a", 4, 4), ("b", 4, 4)]  # c's prompt (4) does not fit beside them
    assert [s.num_spec_tokens for s in out.scheduled] == [3, 3]


def test_accepted_drafts_advance_the_request_and_rejected_ones_roll_back():
    sched = _trt()
    a = _add(sched, "a", 4, 20)
    _step(sched)  # the context: 4 computed, 1 output
    assert (a.num_computed_tokens, a.num_output_tokens) == (4, 1)
    assert sched.kv_cache.num_held("a") == 2  # 4 + 2 extra slots
    _step(sched, {"a": 2})  # verifies 1 + 3 at 4: samples 1 + 2, the third draft is rejected
    assert (a.num_computed_tokens, a.num_output_tokens) == (7, 4)
    # 4 + 2 + 1 + 3 = 10 slots were taken for the step (three blocks); they stay held.
    assert sched.kv_cache.num_held("a") == 3
    _step(sched, {"a": 0})  # all rejected: one token
    assert (a.num_computed_tokens, a.num_output_tokens) == (8, 5)
    assert len(a.token_times) == 5


def test_max_tokens_cuts_the_accepted_tokens_and_frees_the_blocks():
    sched = _trt()
    a = _add(sched, "a", 4, 3)
    _step(sched)
    _step(sched, {"a": 3})  # 1 + 3 sampled, but only 2 more outputs are wanted
    assert a.status is RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 3
    assert sched.kv_cache.num_held("a") == 0
    sched.kv_cache.check_integrity()


def test_the_reservation_to_completion_holds_the_drafters_slots():
    # GUARANTEED_NO_EVICT: prompt 4 + max_tokens 8 = 12 tokens -> 3 blocks without a drafter; with
    # 2 extra slots and the last step's 3 drafts 17 -> 5 blocks (remaining_blocks' deviation).
    sched = _trt()
    a = _add(sched, "a", 4, 8)
    assert remaining_blocks(sched, a, NO_DRAFTS) == 3
    assert remaining_blocks(sched, a, DraftSlots(3, 2)) == 5
    # 9 blocks: a reserves 5, b's 5 do not fit beside it: b waits (head-of-line).
    sched = _trt(num_blocks=9)
    _add(sched, "a", 4, 8)
    _add(sched, "b", 4, 8)
    assert [g[0] for g in grants(_step(sched))] == ["a"]


def test_one_step_blocks_count_the_extra_slots_one_token_and_the_drafts():
    # getNeededBlocksOneStep: tokensPerStep = 1 + draft tokens, past the slots held.
    slots = DraftSlots(3, 2)
    sched = _trt()
    a = _add(sched, "a", 4, 20)
    b = _add(sched, "b", 4, 20)
    assert blocks_one_step(sched, b, False, slots) == 2  # a first chunk: prompt 4 + 2 extra
    _step(sched)  # a and b: 4 computed, 6 slots (2 blocks) held each
    assert blocks_one_step(sched, a, True, slots) == 1  # 4 + 2 + 1 + 3 = 10 slots: a third block
    assert blocks_one_step(sched, a, True, NO_DRAFTS) == 0  # 5 slots: within the two held
    _step(sched, {"a": 0, "b": 0})  # 5 computed, 3 blocks (10 slots) held
    assert blocks_one_step(sched, a, True, slots) == 0  # 5 + 2 + 1 + 3 = 11: within 12


def test_mtp_defaults_to_one_draft_and_eagle3_uses_max_draft_len():
    mtp = TrtllmPolicy.default_config(H100, 4096, decoding_type="MTP", synthetic_acceptance_length=1.5)
    assert mtp.num_draft_tokens == 1 and mtp.drafter_memory().kv_layers == 1
    eagle = TrtllmPolicy.default_config(
        H100, 4096, decoding_type="Eagle3", max_draft_len=4, synthetic_acceptance_length=2.0
    )
    spec = eagle.speculative_decoding()
    assert spec is not None and (spec.method, spec.num_speculative_tokens) == ("eagle3", 4)
    assert eagle.drafter_memory().kv_layers == 1
    three = TrtllmPolicy.default_config(H100, 4096, **PolicySpec.make("trtllm", MTP3).flags)
    assert three.num_draft_tokens == 3 and three.drafter_memory().kv_layers == 3


@pytest.mark.parametrize(
    "flags, needle",
    [
        ({"decoding_type": "Eagle"}, "is not one of MTP, Eagle3"),
        ({"num_nextn_predict_layers": "2"}, "num_nextn_predict_layers needs decoding_type"),
        ({"synthetic_acceptance_length": "2"}, "synthetic_acceptance_length needs decoding_type"),
        ({"decoding_type": "Eagle3", "synthetic_acceptance_length": "2"}, "Eagle3 needs max_draft_len"),
        ({"decoding_type": "MTP", "max_draft_len": "2", "synthetic_acceptance_length": "2"}, "MTP's draft count"),
        ({"decoding_type": "MTP", "num_nextn_predict_layers": "2"}, "exactly one of"),
        ({"decoding_type": "MTP", "num_nextn_predict_layers": "2", "synthetic_acceptance_length": "4"},
         "synthetic_acceptance_length must be in [1, 3]"),
        ({"cuda_graph_batch_sizes": "1,2.5"}, "whole numbers"),
        ({"cuda_graph_batch_sizes": "1,8", "cuda_graph_max_batch_size": "16"}, "must equal max"),
    ],
)  # fmt: skip
def test_bad_speculative_and_graph_flags_are_one_line_errors(flags, needle):
    with pytest.raises(ValueError) as error:
        spec = PolicySpec.make("trtllm", flags)
        TrtllmPolicy.default_config(H100, 4096, **spec.flags)
    assert needle in str(error.value) and "\n" not in str(error.value)


def test_tune_writes_the_drafter_and_the_graphs_into_the_yaml():
    from tailserve.executors.simulated.deployment import Deployment
    from tailserve.tune.commands import command_line

    flags = {**MTP3, "cuda_graph_padding_enabled": "true", "cuda_graph_batch_sizes": "128,256"}
    spec = PolicySpec.make("trtllm", flags)
    line = command_line(spec, Deployment.of("DeepSeek-V3", "H200", 8), None, H100, 8192)
    assert (
        "speculative_config: {decoding_type: MTP, num_nextn_predict_layers: 3}, "
        "cuda_graph_config: {enable_padding: true, batch_sizes: [128, 256]}}'" in line
    )
    assert "synthetic" not in line  # the acceptance is the simulation's input, not a flag


def test_a_padded_graphs_dummy_requests_draft_too():
    """TensorRT-LLM's one-model drafter runs inside the padded CUDA graph: a generation-only
    step of 5 requests padded to 8 drafts for 8 (the trtllm policy's drafts run in vLLM's
    accounting, ``advanced``, whose pricing counts the dummies)."""
    from tailserve.executors.simulated import executor as sim_executor
    from tailserve.executors.simulated.deployment import Deployment, build_cost_model
    from tailserve.policies.registry import parse_policy_list
    from tailserve.sim.run import run_policy
    from tailserve.sim.workload_builder import WorkloadBuilder
    from tailserve.sim.workload_spec import WorkloadSpec
    from tailserve.workloads.lengths import parse_length

    seen: list[tuple[int, int]] = []  # (scheduled, num_padded) per generation-only step
    original = sim_executor.SimExecutor.drafts

    def spy(self, out, shape, num_padded=0):
        if num_padded:
            seen.append((len(out.scheduled), num_padded))
        return original(self, out, shape, num_padded)

    spec = parse_policy_list(
        "trtllm:decoding_type=MTP:num_nextn_predict_layers=2:synthetic_acceptance_length=2.0"
        ":cuda_graph_padding_enabled=true:cuda_graph_batch_sizes=8/16:disable_overlap_scheduler=true"
    )[0]
    work = WorkloadSpec(name="random", num_requests=5, rate=1000.0, input_len=parse_length("64"),
                        output_len=parse_length("12"))  # fmt: skip
    built = build_cost_model(Deployment("Llama-3-8B", "H100-SXM", 1, "none"))
    sim_executor.SimExecutor.drafts = spy
    try:
        run_policy(built, spec, WorkloadBuilder(work))
    finally:
        sim_executor.SimExecutor.drafts = original
    assert seen and all(n + pad == 8 for n, pad in seen)
