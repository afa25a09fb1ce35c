"""TensorRT-LLM 1.3's prefix-aware token budget (``enable_prefix_aware_scheduling``,
``policies/trtllm_prefix_aware.py``): hand-worked cases, each failing without its rule, and the
default (1.2.1: off) unchanged."""

from __future__ import annotations

from helpers import grants, scheduler_for, step, token_request
from tailserve.core.device import DeviceInfo
from tailserve.core.scheduler import Scheduler
from tailserve.policies.registry import PolicySpec
from tailserve.policies.trtllm import TrtllmPolicy
from tailserve.policies.trtllm_config import TrtllmConfig
from tailserve.policies.trtllm_prefix_aware import (
    compute_tokens,
    equal_progress,
    first_come_first_served,
    reusable_tokens,
)
from tailserve.tune.commands import command_line

H100 = DeviceInfo("H100-SXM", 80.0)
BLOCK = 4
PREFIX = list(range(1, 9))  # two full blocks


def _trt(num_blocks: int = 100, **flags) -> Scheduler:
    flags.setdefault("disable_overlap_scheduler", True)  # each step's blocks stored at its end
    spec = PolicySpec.make("trtllm", flags)
    policy = TrtllmPolicy(TrtllmPolicy.default_config(H100, 4096, **spec.flags))
    return scheduler_for(policy, num_blocks, BLOCK, 4096)


# ---- the option --------------------------------------------------------------------------------


def test_off_by_default_as_1_2_1_and_set_by_its_engine_name():
    assert TrtllmConfig().enable_prefix_aware_scheduling is False
    assert TrtllmPolicy.default_config(H100, 4096).enable_prefix_aware_scheduling is False
    spec = PolicySpec.make("trtllm", {"enable_prefix_aware_scheduling": "true"})
    assert TrtllmPolicy.default_config(H100, 4096, **spec.flags).enable_prefix_aware_scheduling is True


# ---- the estimate ------------------------------------------------------------------------------


def test_the_estimate_is_the_cached_prefix_at_the_first_chunk_only():
    sched = _trt(enable_prefix_aware_scheduling=True)
    sched.add_request(token_request("c0", PREFIX, 1), 0.0)
    step(sched)  # c0 computes its 8 tokens: two full blocks stored, and it finishes
    b = token_request("b", [*PREFIX, 60, 61, 62, 63], 2)
    full = token_request("f", PREFIX, 2)  # all cached: one token is left to compute
    sched.add_request(b, 0.0)
    sched.add_request(full, 0.0)
    stats = sched.kv_cache.prefix_cache_stats
    lookups = stats.num_lookups
    reusable = reusable_tokens(sched)
    assert reusable(b) == 8
    assert reusable(full) == 4  # capped at (8 - 1) // 4 blocks, as the match at addSequence
    assert stats.num_lookups == lookups  # not counted as a lookup
    step(sched)
    assert sched.kv_cache.num_held("b")
    assert reusable(b) == 0  # past its first chunk


def test_compute_tokens_floor_is_one_without_chunking_zero_with():
    # microBatchScheduler.cpp: max(1, tokens - reusable) unchunked, max(0, chunk - reusable) chunked
    assert compute_tokens(12, 8, chunked=False) == 4
    assert compute_tokens(8, 8, chunked=False) == 1
    assert compute_tokens(8, 8, chunked=True) == 0
    assert compute_tokens(12, 0, chunked=True) == 12


# ---- the charge ----------------------------------------------------------------------------------


def test_without_chunking_a_first_chunk_is_charged_past_its_cached_prefix():
    # The mirror of test_trtllm's "charged the whole prompt" case: b (12 tokens, 8 cached) costs
    # 12 - 8 = 4 beside a's decode: 1 + 4 <= 12, so it runs this step.
    def run(**flags) -> list:
        sched = _trt(max_num_tokens=12, **flags)
        sched.add_request(token_request("c0", [*PREFIX, 9], 1), 0.0)
        sched.add_request(token_request("a", [50, 51, 52], 10), 0.0)
        step(sched)  # c0 (9 tokens) and a (3) fill 12; c0 finishes, its two blocks stay cached
        sched.add_request(token_request("b", [*PREFIX, 60, 61, 62, 63], 2), 0.0)
        return grants(step(sched))

    assert run() == [("a", 1, 3)]  # 1.2.1: 1 + 12 > 12
    assert run(enable_prefix_aware_scheduling=True) == [("b", 4, 8), ("a", 1, 3)]
    # no reuse tree, no estimate: as without the option
    assert run(enable_prefix_aware_scheduling=True, enable_block_reuse=False) == [("a", 1, 3)]


def test_with_chunking_two_contexts_share_a_budget_the_cached_prefix_no_longer_fills():
    # max_num_tokens 8. b: 12 tokens, 8 of them cached; d: 4 fresh tokens. 1.2.1: 12 + 4 > 8,
    # FIRST_COME_FIRST_SERVED gives b 8 (its last 4 past the prefix) and d nothing. Prefix-aware:
    # b costs 4 and d 4, 8 <= 8: all fit, both run whole.
    def run(**flags) -> list:
        sched = _trt(max_num_tokens=8, enable_chunked_prefill=True, **flags)
        sched.add_request(token_request("c0", PREFIX, 1), 0.0)
        step(sched)
        sched.add_request(token_request("b", [*PREFIX, 100, 101, 102, 103], 2), 0.0)
        sched.add_request(token_request("d", [50, 51, 52, 53], 2), 0.0)
        return grants(step(sched))

    assert run() == [("b", 4, 8)]
    assert run(enable_prefix_aware_scheduling=True) == [("b", 4, 8), ("d", 4, 0)]


def test_first_come_first_served_shares_the_budget_by_compute():
    # b: 12 left, 8 reusable (4 to compute) within capacity 7: whole, capacity 7 - 4 = 3; d: 4
    # fresh > 3: 3, rounded down to the unit, 0. Without the credit b took 7 -> 4, d 0.
    assert first_come_first_served([12, 4], [8, 0], 7, 4, 8) == [12, 0]
    # the uncached tokens (12) pass the budget (8): the chunk is the budget, not reusable + budget
    assert first_come_first_served([20], [8], 8, 4, 8) == [8]
    # two reusing contexts that both fit
    assert first_come_first_served([12, 12], [8, 8], 8, 4, 8) == [12, 12]


def test_equal_progress_charges_only_growth_past_the_reusable_tokens():
    # rounds of 4: b's chunk grows inside its 8 reusable tokens for free, d's costs 4 a round;
    # after two rounds the budget (8) is spent: [8, 8]. Without the credit: [4, 4].
    assert equal_progress([12, 8], [8, 0], 8, 4, 8) == [8, 8]
    assert equal_progress([12, 8], [0, 0], 8, 4, 8) == [4, 4]


def test_equal_progress_is_the_engines_policy_when_asked():
    sched = _trt(
        max_num_tokens=8, enable_chunked_prefill=True, context_chunking_policy="EQUAL_PROGRESS",
        enable_prefix_aware_scheduling=True,
    )  # fmt: skip
    sched.add_request(token_request("c0", PREFIX, 1), 0.0)
    step(sched)
    sched.add_request(token_request("b", [*PREFIX, *range(100, 108)], 2), 0.0)  # 16, 8 cached
    sched.add_request(token_request("d", list(range(50, 58)), 2), 0.0)  # 8 fresh
    # b 16 - 8 = 8 and d 8 pass 8: chunked. Rounds: b 4 (free), d 4; b 8 (free), d 8 (total 8).
    # b's chunk of 8 ends at its cached prefix's end + 8 (setPrepopulatedPromptLen): 8 tokens.
    assert grants(step(sched)) == [("b", 8, 8), ("d", 8, 0)]


# ---- stepped, and the tune command ------------------------------------------------------------


def test_prefix_aware_runs_are_stepped():
    # A waiting context's charge follows the reuse tree, which decodes change: no fast paths.
    assert _trt().policy.can_fast_forward(_trt()) is True
    sched = _trt(enable_prefix_aware_scheduling=True)
    assert sched.policy.can_fast_forward(sched) is False


def test_tune_writes_the_key_only_when_set():
    # A 1.3+ key: 1.2.1 refuses it, so the YAML names it only when the policy asked for it.
    from tailserve.executors.simulated.deployment import Deployment

    deployment = Deployment.of("Llama-3-8B", "H100-SXM", 1)
    plain = command_line(PolicySpec.make("trtllm", {}), deployment, None, H100, 8192)
    on = command_line(
        PolicySpec.make("trtllm", {"enable_prefix_aware_scheduling": True}), deployment, None, H100, 8192
    )
    assert plain is not None and on is not None
    assert "enable_prefix_aware_scheduling" not in plain
    assert (
        "scheduler_config: {capacity_scheduler_policy: GUARANTEED_NO_EVICT, enable_prefix_aware_scheduling: true}"
        in on
    )
