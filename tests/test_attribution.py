"""TTFT and inter-token stall attribution (``metrics/attribution.py``) and ``tailserve explain``."""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest

from tailserve.cli import main
from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.iteration_log import BatchEntry, BatchRecord
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.core.source import ListSource
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.executors.simulated.driver import SimDriver
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.kv.paged import KVCacheManager
from tailserve.metrics.attribution import (
    BATCHED_PREFILL,
    DECODE_WAIT,
    KV_WAIT,
    PREEMPTION,
    PREFILL,
    QUEUED_PREFILL,
    Attributor,
    _Flat,
    explain,
    explain_run,
)
from tailserve.metrics.explain_text import remedy
from tailserve.policies.orca import OrcaConfig, OrcaPolicy
from tailserve.policies.registry import parse_policy_list
from tailserve.policies.vllm import VllmConfig, VllmPolicy
from tailserve.sim.run import run_policy
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.workloads.lengths import parse_length

ALL_POLICIES = "static,orca,vllm-v0,vllm-v0:preemption_mode=swap,vllm,sarathi,sglang,tgi"


def _sums_exactly(b) -> bool:
    return abs(sum(b.components.values()) - b.seconds) <= 1e-9 * b.seconds


def _engine_run(policy, requests: list[Request], num_blocks: int = 4096):
    kv = KVCacheManager(num_blocks, 16)
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    engine = Engine(
        Scheduler(policy, kv, 16384),
        SimExecutor(cost, 16),
        ListSource(requests),
        options=EngineOptions(record_batches=True, check_integrity=True),
    )
    SimDriver(engine).run()
    x = explain(
        engine.requests,
        engine.batches,
        policy=policy.name,
        policy_flags=asdict(policy.config),
        label=policy.name,
    )
    return engine, x


def _ttft(x, rid: str):
    return next(b for b in x.ttft if b.request_id == rid)


# ---- exact sums on real runs ------------------------------------------------------------------
@pytest.mark.parametrize("spec", parse_policy_list(ALL_POLICIES), ids=lambda s: s.label)
def test_components_are_non_negative_and_sum_to_ttft_and_gaps(spec):
    # A short, busy random workload on a small KV cache: queueing, KV waits and preemptions.
    built = build_cost_model(Deployment("Llama-3-8B", "A100-40GB", 1, "none"))
    workload = WorkloadSpec(
        "random",
        num_requests=40,
        rate=30.0,
        input_len=parse_length("uniform:64:3000"),
        output_len=parse_length("uniform:16:400"),
    )
    spec.engine_flags.setdefault("gpu_memory_utilization", 0.45)
    run = run_policy(built, spec, WorkloadBuilder(workload), options=EngineOptions(record_batches=True))
    x = explain_run(run, tbt_threshold=0.0)  # every gap is explained
    finished = [r for r in run.requests if r.status == RequestStatus.FINISHED_LENGTH]
    assert len(x.ttft) == len(finished) > 0
    for b in x.ttft:
        r = next(r for r in finished if r.request_id == b.request_id)
        assert b.seconds == pytest.approx(r.token_times[0] - r.arrival_time, rel=1e-12)
        assert min(b.components.values()) >= 0
        assert _sums_exactly(b), b
    assert len(x.stalls) == sum(len(r.token_times) - 1 for r in finished)
    for b in x.stalls:
        assert min(b.components.values()) >= 0
        assert _sums_exactly(b), b
    assert x.summary


def test_batch_record_is_the_same_with_and_without_the_decode_fast_path():
    def expanded(run):
        rows = []
        for e in run.batches.entries:
            for j, (s, d, u) in enumerate(zip(e.starts, e.durations, e.num_used_blocks)):
                ctx = tuple(c + j for c in e.num_context_tokens)
                rows.append((s, d, u, tuple(e.request_ids), tuple(e.num_new_tokens), ctx, tuple(e.preempted)))
        return rows

    built = build_cost_model(Deployment())
    workload = WorkloadBuilder(WorkloadSpec("chat", num_requests=30, rate=4))
    # SGLang's overlap scheduler (its default) has no fast path: its synchronous scheduler here.
    for spec in parse_policy_list("vllm,sglang:disable_overlap_schedule=true"):
        fast = run_policy(built, spec, workload, options=EngineOptions(record_batches=True))
        slow = run_policy(
            built, spec, workload, options=EngineOptions(record_batches=True, fast_forward=False)
        )
        assert len(fast.batches.entries) < len(slow.batches.entries)  # runs are stored compactly
        assert expanded(fast) == expanded(slow)
        assert fast.batches.iteration_log().rows().__next__() == next(fast.log.rows())
        assert len(fast.batches.iteration_log()) == len(fast.log)


def test_recording_is_off_by_default():
    built = build_cost_model(Deployment())
    run = run_policy(built, parse_policy_list("vllm")[0], WorkloadBuilder(WorkloadSpec("hol")))
    assert run.batches is None
    with pytest.raises(ValueError, match="no batch record"):
        explain_run(run)


# ---- hand-built scenarios name the right cause ------------------------------------------------
def test_hol_under_orca_names_the_long_prompt_as_the_stall_of_every_decode():
    built = build_cost_model(Deployment())
    run = run_policy(
        built,
        parse_policy_list("orca")[0],
        WorkloadBuilder(WorkloadSpec("hol")),
        options=EngineOptions(record_batches=True),
    )
    x = explain_run(run)
    assert len(x.stalls) == 10  # one stall per short request: the iteration the long prompt ran
    assert {b.request_id for b in x.stalls} == {f"short-{i}" for i in range(10)}
    for b in x.stalls:
        assert b.dominant == BATCHED_PREFILL
        assert (b.blockers[0].request_id, b.blockers[0].prompt_len) == ("long-0", 8192)
    assert "The prefill of long-0 (8,192 tokens) stalled 10 decoding request(s)" in x.summary
    assert "--max-num-batched-tokens" in x.summary  # chunked prefill, in vLLM's flag


def test_short_request_behind_a_long_prefill_is_charged_to_it_under_orca():
    long = Request("long", 8192, 4, 0.0)
    short = Request("short", 64, 4, 0.01)  # arrives while the long prompt's prefill runs
    _, x = _engine_run(OrcaPolicy(OrcaConfig()), [long, short])
    b = _ttft(x, "short")
    assert b.dominant == QUEUED_PREFILL
    assert (b.blockers[0].request_id, b.blockers[0].prompt_len) == ("long", 8192)
    # It waited from its arrival to the end of the long prefill iteration, all of it queued.
    assert b.components[QUEUED_PREFILL] == pytest.approx(long.token_times[0] - short.arrival_time)
    assert _sums_exactly(b)


def test_short_request_behind_a_long_prefill_under_vllm_fcfs_budget():
    long = Request("long", 8192, 4, 0.0)
    short = Request("short", 64, 4, 0.001)
    policy = VllmPolicy(VllmConfig(max_num_batched_tokens=2048, max_num_seqs=64, enable_prefix_caching=False))
    _, x = _engine_run(policy, [long, short])
    b = _ttft(x, "short")
    # The long prompt's chunks take the whole budget until its last one: FCFS head-of-line.
    assert b.dominant == QUEUED_PREFILL
    assert b.blockers[0].request_id == "long"
    assert long.token_times[0] - 0.01 < short.token_times[0]
    long_b = _ttft(x, "long")
    assert long_b.num_prefill_chunks == 4  # 8,192 tokens in 2,048-token chunks
    assert long_b.dominant == PREFILL


def test_kv_starved_request_waits_for_kv_memory():
    # Orca reserves prompt + max_tokens: 64 blocks each; 80 blocks hold one request at a time.
    a = Request("a", 512, 512, 0.0)
    b = Request("b", 512, 512, 0.001)
    _, x = _engine_run(OrcaPolicy(OrcaConfig()), [a, b], num_blocks=80)
    tb = _ttft(x, "b")
    assert tb.dominant == KV_WAIT
    assert tb.components[KV_WAIT] > 0.9 * tb.seconds
    assert b.token_times[0] > a.token_times[-1]  # it could only start when a left
    assert x.slow_ids == ["b"] and x.ttft_dominant == KV_WAIT
    assert "waiting for KV memory" in x.summary and "--gpu-memory-utilization" in x.summary


def test_preempted_request_gets_the_preemption_time_in_its_gap():
    # vLLM preempts the most recently admitted request when decodes run out of blocks.
    reqs = [Request("a", 64, 600, 0.0), Request("b", 64, 600, 0.0)]
    policy = VllmPolicy(VllmConfig(max_num_batched_tokens=2048, max_num_seqs=8, enable_prefix_caching=False))
    _, x = _engine_run(policy, reqs, num_blocks=60)
    victim = next(r for r in reqs if r.num_preemptions)
    stalls = [s for s in x.stalls if s.request_id == victim.request_id and s.num_preemptions]
    assert stalls, "the gap in which it was preempted is a stall"
    gap = stalls[0]
    assert gap.dominant == PREEMPTION
    assert gap.components[PREEMPTION] > 0.9 * gap.seconds
    assert _sums_exactly(gap)


# ---- exact values on a synthetic record -------------------------------------------------------
def _entry(start, ids, new, ctx, used=0, **kw) -> BatchEntry:
    return BatchEntry([start], [1.0], ids, new, ctx, [used], **kw)


def test_preemption_window_runs_until_the_recompute_catches_up():
    r = Request("r", 300, 2, 0.0)
    r.token_times = [5.0, 6.0]
    r.status = RequestStatus.FINISHED_LENGTH
    x = Request("x", 10, 10, 0.0)
    record = BatchRecord(1000, 16)
    record.entries = [
        _entry(0.0, ["r"], [100], [0]),  # r's first chunk
        _entry(1.0, ["x"], [1], [11], preempted=["r"]),  # r preempted: it had 100 tokens
        _entry(2.0, ["x"], [1], [12], waiting_head="r", num_waiting=1),
        _entry(3.0, ["r"], [200], [0]),  # recomputes 100, computes 100 new: half lost
        _entry(4.0, ["r"], [100], [200]),  # the rest of the prompt: first token at 5.0
        _entry(5.0, ["r"], [1], [300]),
    ]
    e = explain([r, x], record, policy="vllm", tbt_threshold=10.0)
    b = _ttft(e, "r")
    assert b.components[PREFILL] == pytest.approx(2.5)
    assert b.components[PREEMPTION] == pytest.approx(2.5)
    assert b.num_preemptions == 1 and b.num_prefill_chunks == 3
    assert _sums_exactly(b)


def test_kv_rule_uses_the_waiting_head_need_and_the_free_blocks():
    r = Request("r", 64, 8, 0.0)  # 4 prompt blocks; orca reserves 72 tokens = 5 blocks
    r.token_times = [3.0]
    r.status = RequestStatus.FINISHED_LENGTH
    record = BatchRecord(100, 16)
    record.entries = [
        _entry(0.0, ["x"], [1], [50], used=96, waiting_head="r", num_waiting=1),  # 4 free < 5
        _entry(1.0, ["x"], [1], [51], used=90, waiting_head="r", num_waiting=1),  # 10 free: policy
        _entry(2.0, ["r"], [64], [0], used=95),
    ]
    x = Request("x", 50, 3, 0.0)
    orca = explain([r, x], record, policy="orca")
    b = _ttft(orca, "r")
    assert b.components[KV_WAIT] == pytest.approx(1.0)
    assert b.components["decode_wait"] == pytest.approx(1.0)
    assert b.components[PREFILL] == pytest.approx(1.0)
    # vLLM needs only the prompt's 4 blocks: the first iteration was not a KV wait either.
    vllm = explain([r, x], record, policy="vllm")
    assert _ttft(vllm, "r").components[KV_WAIT] == 0.0


# ---- the command line -------------------------------------------------------------------------
def test_simulate_save_run_then_explain_offline(tmp_path, capsys):
    run_json = tmp_path / "run.json"
    assert main(["simulate", "--policy", "orca", "--explain", "--save-run", str(run_json)]) == 0
    printed = capsys.readouterr().out
    assert "slowest requests by TTFT" in printed and "long-0" in printed
    out = tmp_path / "x.json"
    assert main(["explain", str(run_json), "--top", "3", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len(data["ttft"]) == 11
    assert data["tbt_stalls"][0]["blockers"][0]["request_id"] == "long-0"
    for b in data["ttft"]:
        assert sum(b["components_s"].values()) == pytest.approx(b["seconds"], rel=1e-9)


def test_explain_rejects_files_that_are_not_saved_runs(tmp_path, capsys):
    summary = tmp_path / "summary.json"
    assert main(["simulate", "--policy", "vllm", "--json", str(summary)]) == 0
    capsys.readouterr()
    assert main(["explain", str(summary)]) == 2
    assert "not a run saved by tailserve simulate --save-run" in capsys.readouterr().err
    assert main(["explain", str(tmp_path / "missing.json")]) == 2
    assert main(["simulate", "--policy", "vllm", "--explain", "--tbt-threshold", "-1"]) == 2
    assert "--tbt-threshold must be >= 0" in capsys.readouterr().err


def test_vectorised_waiting_phase_matches_the_slice_by_slice_walk():
    # Drawing segments walks every slice; the breakdown takes the waiting phase at once.
    built = build_cost_model(Deployment("Llama-3-8B", "A100-40GB", 1, "none"))
    workload = WorkloadSpec("random", num_requests=60, rate=40.0, input_len=parse_length("uniform:64:3000"))
    for spec in parse_policy_list("vllm:gpu_memory_utilization=0.45,orca:gpu_memory_utilization=0.45"):
        run = run_policy(built, spec, WorkloadBuilder(workload), options=EngineOptions(record_batches=True))
        attributor = Attributor(run.requests, run.batches, spec.name, {})
        for r in run.requests:
            b = attributor.ttft(r)
            drawn = dict.fromkeys(b.components, 0.0)
            for start, end, cause in attributor.ttft_segments(r):
                drawn[cause] += end - start
            for cause, seconds in b.components.items():
                assert drawn[cause] == pytest.approx(seconds, rel=1e-9, abs=1e-12), (r.request_id, cause)


def test_summary_calls_a_growing_queue_overload():
    built = build_cost_model(Deployment("Llama-3-8B", "A100-40GB", 1, "none"))
    workload = WorkloadSpec(
        "random",
        num_requests=80,
        rate=40.0,
        input_len=parse_length("uniform:256:4096"),
        output_len=parse_length("512"),
    )
    run = run_policy(
        built,
        parse_policy_list("vllm")[0],
        WorkloadBuilder(workload),
        options=EngineOptions(record_batches=True),
    )
    summary = explain_run(run).summary
    assert "requests arrive faster than this deployment serves them" in summary
    assert "`--max-num-queued-tokens`" in summary  # the engine's own 503 valve is named
    light = run_policy(
        built,
        parse_policy_list("vllm")[0],
        WorkloadBuilder(WorkloadSpec("chat", num_requests=80, rate=1.0)),
        options=EngineOptions(record_batches=True),
    )
    assert "arrive faster" not in explain_run(light).summary


def test_flattened_iterations_telescope_where_they_touch():
    """An iteration whose end lands within rounding of the next start ends exactly there (the
    slices of an interval then add up exactly); a real gap stays; a decode run's iterations are
    laid out one per step, with their offsets."""
    record = BatchRecord(num_blocks=8, block_size=16)
    record.entries.append(BatchEntry([0.1], [0.2], ["a"], [5], [0], [1]))  # ends at 0.30000000000000004
    record.entries.append(BatchEntry([0.3, 0.5], [0.2, 0.1], ["a"], [1], [5], [1, 1]))  # a run
    record.entries.append(BatchEntry([0.7], [0.05], ["a"], [1], [7], [1]))  # 0.6 -> 0.7: a gap
    flat = _Flat(record)
    assert 0.1 + 0.2 != 0.3 and flat.ends[0] == 0.3  # touched: telescoped
    assert flat.ends[1] == 0.5 and flat.ends[2] == 0.6  # the run's own iterations
    assert flat.ends[3] == 0.75 and flat.end_arr.tolist() == flat.ends
    assert flat.entry_of == [0, 1, 1, 2] and flat.offset == [0, 0, 1, 0]
    assert flat.num_decode == [0, 1, 1] and flat.num_prefill == [5, 0, 0]


def test_tokens_one_step_yields_together_are_not_gaps():
    """Accepted drafts arrive with their step's token: a gap is between steps (vLLM's ITL counts
    one per streamed chunk), so the stall bound's median is a step's, not 0."""
    from types import SimpleNamespace

    from tailserve.metrics.attribution import pooled_gaps, stall_threshold

    steps = [0.0, 0.02, 0.02, 0.02, 0.04, 0.04, 0.06, 0.30, 0.30]  # 3 tokens, 2, 1, a stall, 2
    gaps = pooled_gaps([SimpleNamespace(token_times=steps)])
    assert list(gaps) == pytest.approx([0.02, 0.02, 0.02, 0.24])
    assert stall_threshold(gaps) == pytest.approx(max(float(np.percentile(gaps, 99)), 0.06))


def test_a_flag_that_holds_prompts_back_is_named_first_when_the_run_set_it():
    plain = remedy(DECODE_WAIT, "sglang")
    assert "--prefill-decode-interval" not in plain
    held = remedy(DECODE_WAIT, "sglang", {"prefill_decode_interval": 16})
    assert held.startswith("`--prefill-decode-interval 16` skips the prefill pass") and held.endswith(plain)
    both = {"batch_wait_timeout_iters": 20, "batch_wait_max_tokens_ratio": 0.9}
    assert "`batch_wait_timeout_iters: 20` with `batch_wait_max_tokens_ratio: 0.9`" in remedy(
        DECODE_WAIT, "trtllm", both
    )
    # one alone holds nothing in TensorRT-LLM 1.2 (policies/trtllm_batch_wait.py): not named
    assert "batch_wait" not in remedy(DECODE_WAIT, "trtllm", {"batch_wait_timeout_iters": 20})


def test_the_paragraph_says_how_many_were_refused_before_the_served_ones_times():
    built = build_cost_model(Deployment("Llama-3-8B", "A100-40GB", 1, "none"))
    workload = WorkloadSpec("chat", num_requests=120, rate=40.0)
    run = run_policy(
        built,
        parse_policy_list("vllm:max_num_queued_reqs=20")[0],
        WorkloadBuilder(workload),
        options=EngineOptions(record_batches=True),
    )
    refused = sum(r.status.name == "FINISHED_REJECTED" for r in run.requests)
    assert refused > 0
    summary = explain_run(run).summary
    assert summary.startswith(f"{refused:,} of 120 requests were refused at arrival (")
    assert "The engine is currently busy" in summary
    assert f"the times below are the {120 - refused:,} finished requests'" in summary
