"""Streaming finished requests into arrays (``EngineOptions(stream_finished=True)``) changes no
number of the summary, keeps no Request object, and refuses what needs the requests."""

from __future__ import annotations

import json

import pytest

from tailserve.core import finished_store
from tailserve.core.engine import EngineOptions
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.metrics.summary import Slo
from tailserve.policies.registry import parse_policy_list
from tailserve.sim.run import run_policy
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.workloads.lengths import LogNormal


def _run(policy: str, workload: WorkloadSpec, stream: bool):
    built = build_cost_model(Deployment("Llama-3-8B", "A100-80GB", 1, "none"))
    spec = parse_policy_list(policy)[0]
    return run_policy(built, spec, WorkloadBuilder(workload), options=EngineOptions(stream_finished=stream))


WORKLOAD = WorkloadSpec(
    "random",
    num_requests=150,
    rate=30.0,
    seed=5,
    input_len=LogNormal(1200, 1.0, 7000),
    output_len=LogNormal(150, 1.0, 1200),
)


@pytest.mark.parametrize(
    "policy",
    [
        "vllm",
        "sarathi:chunk_size=512,gpu_memory_utilization=0.25",  # preemptions
        "sglang:gpu_memory_utilization=0.25",  # retractions
        "tgi",
        "vllm-v0:preemption_mode=swap,gpu_memory_utilization=0.25",
    ],
)
def test_streamed_summary_equals_the_summary_of_the_requests(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(finished_store, "FLUSH_TOKENS", 500)  # several gap chunks in a small run
    slo = Slo(ttft=0.5, tpot=0.05)
    plain = _run(policy, WORKLOAD, stream=False)
    streamed = _run(policy, WORKLOAD, stream=True)
    assert streamed.requests == [] and streamed.finished is not None
    assert len(streamed.finished.gaps._chunks) > 1
    a, b = plain.summary(slo), streamed.summary(slo)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert json.dumps(b, sort_keys=True) == json.dumps(streamed.summary(slo), sort_keys=True)  # again
    assert list(plain.log.start) == list(streamed.log.start)
    assert list(plain.log.num_used_blocks) == list(streamed.log.num_used_blocks)


def test_streamed_prefix_cache_summary_and_rejections() -> None:
    workload = WorkloadSpec("shared-prefix", num_requests=120, rate=20.0, seed=3)
    for policy in ("vllm", "sglang"):
        plain = _run(policy, workload, stream=False)
        streamed = _run(policy, workload, stream=True)
        assert plain.summary()["prefix_cache"]["hit_rate_tokens"] > 0
        assert json.dumps(plain.summary(), sort_keys=True) == json.dumps(streamed.summary(), sort_keys=True)
    # Too long for the context: rejected at arrival, counted the same way.
    long = WorkloadSpec("random", num_requests=20, rate=5.0, seed=1, input_len=LogNormal(6000, 0.8, 30000))
    plain, streamed = _run("vllm", long, stream=False), _run("vllm", long, stream=True)
    assert plain.summary()["num_rejected"] > 0
    assert json.dumps(plain.summary(), sort_keys=True) == json.dumps(streamed.summary(), sort_keys=True)


def test_streamed_run_cannot_be_saved() -> None:
    streamed = _run("vllm", WorkloadSpec("random", num_requests=10, seed=2), stream=True)
    with pytest.raises(ValueError, match="--stream-metrics"):
        streamed.to_json()


def test_iterator_source_hands_out_what_a_list_source_does() -> None:
    from tailserve.core.request import Request
    from tailserve.core.source import ListSource
    from tailserve.core.stream_source import IteratorSource

    def make() -> list[Request]:
        return [Request(f"r{i}", 10 + i, 5, 0.5 * (i // 2)) for i in range(9)]

    lazy, eager = IteratorSource(iter(make())), ListSource(make())
    for now in (0.0, 0.7, 1.0, 3.9, 10.0):
        assert lazy.next_arrival_time() == eager.next_arrival_time()
        assert [r.request_id for r in lazy.pop_arrived(now)] == [r.request_id for r in eager.pop_arrived(now)]
    assert lazy.exhausted and lazy.num_requests == 9
    backwards = IteratorSource(iter([Request("a", 1, 1, 2.0), Request("b", 1, 1, 1.0)]))
    with pytest.raises(ValueError, match="arrival order"):
        backwards.pop_arrived(5.0)


def test_simulate_stream_metrics_writes_the_same_json(tmp_path, capsys) -> None:
    from tailserve.cli import main

    argv = ["simulate", "--policy", "sarathi", "--workload", "random", "--num-requests", "80", "--rate", "20"]
    assert main([*argv, "--json", str(tmp_path / "a.json")]) == 0
    assert main([*argv, "--stream-metrics", "--json", str(tmp_path / "b.json")]) == 0
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()
    capsys.readouterr()
    assert main([*argv, "--stream-metrics", "--explain"]) == 2
    assert "--stream-metrics keeps no requests" in capsys.readouterr().err
