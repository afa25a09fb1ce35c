"""The closed-loop benchmark's pieces that need no engine: its settings as flags and as the
simulator's policy, its workloads (seeded, token-id prompts, a trace the simulator reads), the
ranking and target arithmetic, and the SLO it puts at a workload's knee."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from benchmarks import _closed_loop_report as report
from benchmarks._closed_loop_engines import SETTINGS, Setting
from benchmarks._closed_loop_tune import knee_slo, slo_ratio, workload_trace
from benchmarks._closed_loop_workloads import hol, shared_prefix

from tailserve.policies.registry import parse_policy_list
from tailserve.workloads.traces import load_trace


def test_a_setting_is_the_same_flags_on_both_engines_and_in_the_simulator():
    off = Setting("x", 2048, 4, prefix_caching=False, chunked_prefill=False)
    assert off.flags() == [
        "--max-num-batched-tokens", "2048", "--max-num-seqs", "4",
        "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
    ]  # fmt: skip
    (spec,) = parse_policy_list(off.policy())
    assert spec.flags["max_num_batched_tokens"] == 2048 and spec.flags["max_num_seqs"] == 4
    assert spec.flags["enable_prefix_caching"] is False and spec.flags["enable_chunked_prefill"] is False
    assert len(SETTINGS) >= 6 and SETTINGS[0].budget == 2048  # the calibration's server: the default


def test_workloads_are_seeded_and_replayable(tmp_path: Path):
    a, b = hol(8192, 0, quick=False), hol(8192, 0, quick=False)
    assert [r.prompt for r in a.requests] == [r.prompt for r in b.requests] and list(a.times) == list(b.times)
    assert sum(r.prompt_len == 1800 for r in a.requests) == 4  # a long prompt every 2 s
    shared = shared_prefix(8192, 0, quick=True)
    prefixes = {tuple(r.prompt[:512]) for r in shared.requests}
    assert len(prefixes) <= 4 and len(shared.requests) == 16
    requests = load_trace(workload_trace(shared, tmp_path / "s.jsonl"))
    assert [r.prompt_token_ids for r in requests] == [r.prompt for r in shared.requests]


def test_ranking_and_targets():
    assert report.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert report.spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert math.isnan(report.spearman([1, 2], [1, 2]))
    # The measured tie (100 vs 102) is left out; of the other pairs one is ordered the other way.
    assert report.pairwise([1, 2, 3], [100, 102, 50]) == (0, 2)
    assert report.within_target("ttft_p99", 0.19) and not report.within_target("ttft_p50", 0.11)


def test_the_knee_slo_splits_the_budgets():
    cells = [
        {"predicted": {"ttft_p99": 1000.0, "itl_p99": 100.0}},
        {"predicted": {"ttft_p99": 1100.0, "itl_p99": 900.0}},
    ]
    ttft_s, itl_s = knee_slo(cells)
    assert ttft_s == pytest.approx(1.2) and itl_s == pytest.approx(0.3)
    assert (
        slo_ratio(cells[0]["predicted"], ttft_s, itl_s) < 1 < slo_ratio(cells[1]["predicted"], ttft_s, itl_s)
    )
