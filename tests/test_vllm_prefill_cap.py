"""vLLM 0.32's ``long_prefill_token_threshold_adaptive`` (``policies/vllm_prefill_cap.py``) and
``max_num_active_seqs``; both also checked step for step against vLLM's own scheduler by the
differential and its fixtures."""

from __future__ import annotations

import pytest

from helpers import grants, scheduler_for, step
from tailserve.core.device import DeviceInfo
from tailserve.core.request import Request
from tailserve.engines.flag_spec import NO_OP, SCHEDULING
from tailserve.engines.lint import lint
from tailserve.engines.translate import translate
from tailserve.executors.simulated.deployment import Deployment
from tailserve.policies.registry import PolicySpec, get_policy_cls
from tailserve.policies.vllm import VllmConfig, VllmPolicy
from tailserve.policies.vllm_prefill_cap import prefill_cap
from tailserve.tune.commands import command_line

H100 = DeviceInfo("H100-SXM", 80.0)


def test_the_cap_is_floored_at_a_fair_share_of_the_budget():
    cfg = VllmConfig(max_num_batched_tokens=512, max_num_seqs=8, long_prefill_token_threshold=64)
    adaptive = VllmConfig(
        max_num_batched_tokens=512, max_num_seqs=8, long_prefill_token_threshold=64,
        long_prefill_token_threshold_adaptive=True,
    )  # fmt: skip
    assert [prefill_cap(cfg, n) for n in (1, 2, 4, 16)] == [0, 64, 64, 64]
    # 512 // 2 = 256, 512 // 4 = 128, 512 // 16 = 32 < 64
    assert [prefill_cap(adaptive, n) for n in (1, 2, 4, 16)] == [0, 256, 128, 64]


def test_two_long_prompts_share_the_budget_instead_of_taking_the_threshold():
    for adaptive, chunks in ((False, [("a", 64, 0), ("b", 64, 0)]), (True, [("a", 256, 0), ("b", 256, 0)])):
        policy = VllmPolicy(
            VllmConfig(
                max_num_batched_tokens=512, max_num_seqs=8, long_prefill_token_threshold=64,
                long_prefill_token_threshold_adaptive=adaptive, async_scheduling=False,
            )
        )  # fmt: skip
        sched = scheduler_for(policy, 200, 16, 4096)
        for rid in "ab":
            sched.add_request(Request(rid, 1000, 4, 0.0), 0.0)
        assert grants(step(sched)) == chunks


def test_lint_maps_the_flag_and_says_it_needs_a_threshold():
    rows = {r.flag: r for r in lint("vllm serve M --long-prefill-token-threshold 256 "
                                    "--long-prefill-token-threshold-adaptive").rows}  # fmt: skip
    assert rows["--long-prefill-token-threshold-adaptive"].verdict == SCHEDULING
    line = "vllm serve M --long-prefill-token-threshold 256 --long-prefill-token-threshold-adaptive"
    assert translate(lint(line), H100).spec.flags["long_prefill_token_threshold_adaptive"] is True
    rows = {r.flag: r for r in lint("vllm serve M --long-prefill-token-threshold-adaptive").rows}
    assert rows["--long-prefill-token-threshold-adaptive"].verdict == NO_OP


def test_max_num_active_seqs_stops_admission_below_max_num_seqs():
    policy = VllmPolicy(
        VllmConfig(max_num_batched_tokens=512, max_num_seqs=8, max_num_active_seqs=2, async_scheduling=False)
    )
    sched = scheduler_for(policy, 200, 16, 4096)
    for rid in "abc":
        sched.add_request(Request(rid, 10, 4, 0.0), 0.0)
    assert [g[0] for g in grants(step(sched))] == ["a", "b"]
    for bad in (0, 9):
        try:
            VllmConfig(max_num_batched_tokens=512, max_num_seqs=8, max_num_active_seqs=bad)
        except ValueError as e:
            assert "max_num_active_seqs must be in [1, max_num_seqs = 8]" in str(e)
        else:
            raise AssertionError(bad)


@pytest.mark.parametrize(
    ("name", "flags", "dp"),
    [
        (
            "vllm",
            {
                "long_prefill_token_threshold": 256, "long_prefill_token_threshold_adaptive": True,
                "max_num_active_seqs": 64, "max_num_queued_reqs": 300, "max_num_queued_tokens": 34000,
            },
            1,
        ),
        ("vllm", {"prefill_schedule_interval": 4}, 2),
        (
            "sglang",
            {
                "max_queued_requests": 16, "prefill_max_requests": 8, "prefill_decode_interval": 4,
                "prefill_decode_interval_min_bs": 2,
            },
            1,
        ),
    ],
)  # fmt: skip
def test_tunes_command_line_reads_back_to_the_same_knobs(name, flags, dp):
    spec = PolicySpec.make(name, flags)
    model = "Qwen3-30B-A3B" if dp > 1 else "Llama-3-8B"
    line = command_line(
        spec, Deployment.of(model, "H100", 1, expert_parallel=dp > 1, dp=dp), None, H100, 8192
    )
    back = translate(lint(line), H100)
    cls = get_policy_cls(name)
    assert cls.default_config(H100, 8192, **back.spec.flags) == cls.default_config(H100, 8192, **flags)
