"""TensorRT-LLM 1.2's batch waiting (``policies/trtllm_batch_wait.py``: ``PyExecutor._schedule``
and ``_waiting_requests``), each case worked by hand; KV blocks of 4 tokens, the overlap
scheduler off so each step's outputs apply before the next."""

from __future__ import annotations

import random

import pytest

from helpers import grants, scheduler_for, sim_run, step, trtllm_line_read_back
from tailserve.core.device import DeviceInfo
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.engines.flag_spec import NO_OP, SCHEDULING
from tailserve.engines.lint import lint
from tailserve.engines.translate import translate
from tailserve.executors.simulated.deployment import Deployment
from tailserve.policies.registry import PolicySpec, get_policy_cls
from tailserve.policies.trtllm import TrtllmPolicy

H100 = DeviceInfo("H100-SXM", 80.0)


def _trt(**flags) -> Scheduler:
    flags = {"max_num_tokens": 100, "disable_overlap_scheduler": True, **flags}
    policy = TrtllmPolicy(TrtllmPolicy.default_config(H100, 4096, **PolicySpec.make("trtllm", flags).flags))
    return scheduler_for(policy, 200, 4, 4096)


def _add(sched: Scheduler, rid: str, prompt: int, max_tokens: int, now: float = 0.0) -> Request:
    request = Request(rid, prompt, max_tokens, now)
    sched.add_request(request, now)
    return request


def _first_context_step(sched: Scheduler, rid: str, steps: int = 6) -> int:
    """The step (1-based, after the arrival) whose batch runs ``rid``'s context."""
    for i in range(steps):
        if any(r == rid for r, _, _ in grants(step(sched, 0.01 * (i + 2)))):
            return i + 1
    raise AssertionError(f"{rid} never ran")


@pytest.mark.parametrize(
    ("flags", "runs_at"),
    [
        ({}, 1),
        # threshold 0.5 x 100 = 50 tokens; b's 20 + a's 1 = 21 < 50: held while the counter
        # is below 2 (steps 1, 2), run at step 3 when it reaches 2
        ({"batch_wait_timeout_iters": 2, "batch_wait_max_tokens_ratio": 0.5}, 3),
        ({"batch_wait_timeout_iters": 5, "batch_wait_max_tokens_ratio": 0.5}, 6),
        ({"batch_wait_timeout_iters": 2, "batch_wait_max_tokens_ratio": 0.2}, 1),  # 21 >= 20
        ({"batch_wait_timeout_iters": 4}, 1),  # ratio 0: tokens >= 0 always
        ({"batch_wait_max_tokens_ratio": 0.9}, 1),  # iters 0: count >= 0 always
    ],
)
def test_contexts_wait_for_tokens_or_iterations_while_generations_run(flags, runs_at):
    sched = _trt(**flags)
    _add(sched, "a", 8, 50)
    assert grants(step(sched, 0.0)) == [("a", 8, 0)]  # alone: no generation, no waiting
    _add(sched, "b", 20, 5, now=0.01)
    assert _first_context_step(sched, "b") == runs_at


def test_the_whole_prompt_counts_and_a_second_arrival_can_release_both():
    sched = _trt(batch_wait_timeout_iters=10, batch_wait_max_tokens_ratio=0.5)
    _add(sched, "a", 8, 50)
    step(sched, 0.0)
    _add(sched, "b", 20, 5, now=0.01)
    assert grants(step(sched, 0.02)) == [("a", 1, 8)]  # 21 tokens: held
    _add(sched, "c", 30, 5, now=0.025)
    out = step(sched, 0.03)  # 20 + 30 + 1 = 51 >= 50: both run with the generation
    assert grants(out) == [("b", 20, 0), ("c", 30, 0), ("a", 1, 9)]
    assert sched.policy._batch_wait.count == 0


def test_an_attention_dp_rank_does_not_wait():
    sched = _trt(batch_wait_timeout_iters=5, batch_wait_max_tokens_ratio=0.5)
    sched.policy.in_attention_dp = True
    _add(sched, "a", 8, 50)
    step(sched, 0.0)
    _add(sched, "b", 20, 5, now=0.01)
    assert _first_context_step(sched, "b") == 1


def test_bad_values_are_one_line_errors():
    for flags, needle in (
        ({"batch_wait_timeout_iters": -1}, "batch_wait_timeout_iters must be >= 0"),
        ({"batch_wait_max_tokens_ratio": 1.5}, "batch_wait_max_tokens_ratio must be in [0, 1]"),
    ):
        with pytest.raises(ValueError) as e:
            TrtllmPolicy.default_config(H100, 4096, **PolicySpec.make("trtllm", flags).flags)
        assert needle in str(e.value) and "\n" not in str(e.value)


def test_lint_reads_both_keys_and_flags_one_alone(tmp_path):
    path = tmp_path / "opts.yaml"
    path.write_text("batch_wait_timeout_iters: 20\nbatch_wait_max_tokens_ratio: 0.75\n")
    rows = {row.flag: row for row in lint(f"trtllm-serve M --config {path}").rows}
    assert rows["opts.yaml:batch_wait_timeout_iters"].verdict == SCHEDULING
    assert rows["opts.yaml:batch_wait_max_tokens_ratio"].verdict == SCHEDULING
    flags = translate(lint(f"trtllm-serve M --config {path}"), H100).spec.flags
    assert flags["batch_wait_timeout_iters"] == 20 and flags["batch_wait_max_tokens_ratio"] == 0.75
    path.write_text("batch_wait_timeout_iters: 20\n")
    rows = {row.flag: row for row in lint(f"trtllm-serve M --config {path}").rows}
    assert rows["opts.yaml:batch_wait_timeout_iters"].verdict == NO_OP
    assert "batch_wait_max_tokens_ratio is 0" in rows["opts.yaml:batch_wait_timeout_iters"].what


def test_tunes_command_line_writes_them_back(tmp_path, monkeypatch):
    flags = {"batch_wait_timeout_iters": 20, "batch_wait_max_tokens_ratio": 0.75}
    spec = PolicySpec.make("trtllm", flags)
    back = trtllm_line_read_back(spec, Deployment.of("Llama-3-8B", "H100", 1), H100, tmp_path, monkeypatch)
    cls = get_policy_cls("trtllm")
    assert cls.default_config(H100, 8192, **back.spec.flags) == cls.default_config(H100, 8192, **flags)


def _workload(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    t, requests = 0.0, []
    for i in range(n):
        t += rng.expovariate(30.0)
        requests.append(Request(f"r{i}", rng.randint(20, 600), rng.randint(5, 200), t))
    return requests


@pytest.mark.parametrize("overlap", [False, True])
def test_whole_runs_finish_and_the_fast_paths_change_nothing(overlap):
    waiting = {"batch_wait_timeout_iters": 8, "batch_wait_max_tokens_ratio": 0.5}
    runs = []
    for fast, flags in ((False, waiting), (True, waiting), (True, {})):
        flags = {**flags, "max_num_tokens": 2048, "disable_overlap_scheduler": not overlap}
        policy = TrtllmPolicy(
            TrtllmPolicy.default_config(H100, 4096, **PolicySpec.make("trtllm", flags).flags)
        )
        sched = scheduler_for(policy, 2000, 32, 4096)
        engine = sim_run(sched, _workload(50, 7), fast, block_size=32)
        assert all(r.status is RequestStatus.FINISHED_LENGTH for r in engine.requests)
        assert sched.kv_cache.num_free_blocks == 2000  # every block back
        runs.append({r.request_id: r.token_times for r in engine.requests})
    assert runs[0] == runs[1]
    assert runs[1] != runs[2]  # the waiting held contexts at this load


@pytest.mark.parametrize(("model", "expert_parallel"), [("Llama-3-8B", False), ("Qwen3-30B-A3B", True)])
def test_no_rank_of_an_attention_dp_engine_waits(model, expert_parallel):
    from tailserve.cluster.dp_group import build_dp_stage

    spec = PolicySpec.make("trtllm", {"batch_wait_timeout_iters": 8, "batch_wait_max_tokens_ratio": 0.5})
    stage = build_dp_stage(
        Deployment.of(model, "H100", 1, expert_parallel=expert_parallel, dp=2), spec, shares_prefixes=False
    )
    assert all(r.engine.scheduler.policy.in_attention_dp for r in stage.replicas)
