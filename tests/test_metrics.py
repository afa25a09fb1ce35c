"""Metric definitions (vLLM's serving benchmark) against hand-computed numbers."""

from __future__ import annotations

import numpy as np
import pytest

from tailserve.core.request import Request, RequestStatus
from tailserve.metrics.summary import RequestLatencies, Slo, stats, summarize


def _done(rid, arrival, scheduled, times, prompt=100):
    r = Request(rid, prompt, len(times), arrival)
    r.first_scheduled_time = scheduled
    r.token_times = list(times)
    r.num_output_tokens = len(times)
    r.status = RequestStatus.FINISHED_LENGTH
    r.finish_time = times[-1]
    return r


def _requests():
    a = _done("a", 0.0, 0.5, [1.0, 1.5, 2.5])  # ttft 1.0, e2e 2.5, tpot (2.5-1)/2 = 0.75
    b = _done("b", 1.0, 1.0, [1.2])  # ttft 0.2, one token: no tpot, no gap
    c = _done("c", 2.0, 3.0, [4.0, 4.1])  # ttft 2.0, e2e 2.1, tpot 0.1
    rej = Request("r", 10, 10, 3.0)
    rej.status = RequestStatus.FINISHED_REJECTED
    rej.status_reason = "too long"
    rej.finish_time = 3.0
    return [a, b, c, rej]


def test_per_request_definitions():
    lat = RequestLatencies.of(_requests())
    assert lat.ttft.tolist() == pytest.approx([1.0, 0.2, 2.0])
    assert lat.e2e.tolist() == pytest.approx([2.5, 0.2, 2.1])
    assert lat.queue.tolist() == pytest.approx([0.5, 0.0, 1.0])
    assert lat.tpot[0] == pytest.approx(0.75) and np.isnan(lat.tpot[1]) and lat.tpot[2] == pytest.approx(0.1)
    # ITL pools every gap of every request, never across requests.
    assert sorted(lat.itl.tolist()) == pytest.approx([0.1, 0.5, 1.0])


def test_summary_counts_throughput_and_percentiles():
    s = summarize(_requests())
    assert (s["num_requests"], s["num_finished"], s["num_rejected"]) == (4, 3, 1)
    # Duration: first arrival (0.0) to last finish (4.1).
    assert s["duration_s"] == pytest.approx(4.1)
    assert s["throughput"]["requests_per_s"] == pytest.approx(3 / 4.1)
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(6 / 4.1)
    ttft = s["metrics"]["ttft_s"]
    assert ttft["mean"] == pytest.approx((1.0 + 0.2 + 2.0) / 3)
    assert ttft["p50"] == pytest.approx(1.0)
    assert ttft["max"] == pytest.approx(2.0)
    # numpy's linear interpolation: p99 of [0.2, 1.0, 2.0] = 1.0 + 0.98 * (2.0 - 1.0)
    assert ttft["p99"] == pytest.approx(1.98)
    assert s["metrics"]["tpot_s"]["mean"] == pytest.approx((0.75 + 0.1) / 2)


def test_goodput_meets_slo_inclusively_and_single_token_tpot_is_zero():
    s = summarize(_requests(), Slo(ttft=1.0, tpot=0.1))
    # a: tpot 0.75 > 0.1 fails; b: ttft 0.2, one token (tpot 0) passes; c: ttft 2.0 fails.
    assert s["goodput"]["requests_per_s"] == pytest.approx(1 / 4.1)
    s = summarize(_requests(), Slo(ttft=2.0))
    assert s["goodput"]["requests_per_s"] == pytest.approx(3 / 4.1)  # 2.0 <= 2.0 counts


def test_stats_of_nothing_is_null():
    assert stats([]) == {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}


def test_negative_slo_is_rejected():
    with pytest.raises(ValueError, match="ttft"):
        Slo(ttft=-1)
