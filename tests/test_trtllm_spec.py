"""The ``trtllm`` policy's draft tokens (``speculative_config``: MTP, Eagle3), worked by hand from
TensorRT-LLM's source: the micro-batch scheduler charges a generation request ``beam_width +
num_draft_tokens`` against ``max_num_tokens`` (``scheduler.py`` ``PyMicroBatchScheduler``), the KV
manager adds a slot per draft (``resource_manager.py`` ``prepare_resources``) and rewinds the
rejected ones, ``getNeededBlocksOneStep`` counts ``1 + draft tokens`` per step, and a request
advances by 1 + its accepted drafts.

KV blocks of 4 tokens; three drafts (MTP ``num_nextn_predict_layers=3``) unless a case says so.
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
from tailserve.policies.trtllm_capacity import blocks_one_step, remaining_blocks

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
    _step(sched, {"a": 2})  # verifies 1 + 3 at 4: samples 1 + 2, the third draft is rejected
    assert (a.num_computed_tokens, a.num_output_tokens) == (7, 4)
    # 4 + 1 + 3 = 8 slots were taken for the step (two blocks); they stay held.
    assert sched.kv_cache.num_held("a") == 2
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


def test_the_reservation_to_completion_holds_the_last_steps_drafts():
    # GUARANTEED_NO_EVICT: prompt 4 + max_tokens 8 = 12 tokens -> 3 blocks without drafts; with 3
    # drafts the last step may hold 15 slots -> 4 blocks (remaining_blocks' stated deviation).
    sched = _trt()
    a = _add(sched, "a", 4, 8)
    assert remaining_blocks(sched, a) == 3
    assert remaining_blocks(sched, a, 3) == 4
    # 5 blocks: a reserves 4, b's 4 do not fit beside it: b waits (head-of-line).
    sched = _trt(num_blocks=5)
    _add(sched, "a", 4, 8)
    _add(sched, "b", 4, 8)
    assert [g[0] for g in grants(_step(sched))] == ["a"]


def test_one_step_blocks_count_one_token_plus_the_drafts():
    # getNeededBlocksOneStep: tokensPerStep = 1 + draft tokens. At 4 computed (one block held),
    # the next step writes slots 5..8: one more block; at 5 computed (2 held), slots 6..9: one.
    sched = _trt()
    a = _add(sched, "a", 4, 20)
    _step(sched)
    assert blocks_one_step(sched, a, True, 3) == 1
    assert blocks_one_step(sched, a, True, 0) == 1  # 4 -> 5 opens a block either way
    _step(sched, {"a": 0})  # 5 computed, 2 blocks held (8 slots taken)
    assert blocks_one_step(sched, a, True, 3) == 1  # 9 slots: a third block
    assert blocks_one_step(sched, a, True, 0) == 0  # 6 slots: within the two held


def test_mtp_defaults_to_one_draft_and_eagle3_uses_max_draft_len():
    mtp = TrtllmPolicy.default_config(H100, 4096, decoding_type="MTP", synthetic_acceptance_length=1.5)
    assert mtp.num_draft_tokens == 1 and mtp.draft_kv_layers == 1
    eagle = TrtllmPolicy.default_config(
        H100, 4096, decoding_type="Eagle3", max_draft_len=4, synthetic_acceptance_length=2.0
    )
    spec = eagle.speculative_decoding()
    assert spec is not None and (spec.method, spec.num_speculative_tokens) == ("eagle3", 4)
    assert eagle.draft_kv_layers == 1
    three = TrtllmPolicy.default_config(H100, 4096, **PolicySpec.make("trtllm", MTP3).flags)
    assert three.num_draft_tokens == 3 and three.draft_kv_layers == 3


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
