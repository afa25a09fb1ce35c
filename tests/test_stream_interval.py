"""``stream_interval``: the chunks a streaming client receives (vLLM and SGLang count tokens,
TensorRT-LLM iterations), the client's ITL in simulate / bench --predict / explain, the engine's
own ITL beside it, lint and tune's command lines."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import trtllm_line_read_back
from tailserve.bench.datasets import BenchRequest
from tailserve.bench.predict import PredictSpec, simulate
from tailserve.core.device import DeviceInfo
from tailserve.core.engine import EngineOptions
from tailserve.core.stream_interval import Chunker, StreamInterval
from tailserve.engines.flag_spec import SCHEDULING
from tailserve.engines.lint import lint
from tailserve.engines.translate import translate
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.metrics.attribution import explain_run
from tailserve.metrics.summary import summarize
from tailserve.policies.registry import PolicySpec, get_policy_cls, parse_policy_list
from tailserve.sim.run import run_policy
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.tune.commands import command_line
from tailserve.workloads.lengths import Uniform

H100 = DeviceInfo("H100-SXM", 80.0)
WORKLOAD = WorkloadSpec(
    "random", num_requests=120, rate=20.0, seed=3, input_len=Uniform(100, 2000), output_len=Uniform(2, 200)
)


# ---- the rule -----------------------------------------------------------------------------------
def test_tokens_first_at_once_then_at_least_n_unsent_and_the_last_at_finish():
    times = [float(t) for t in range(10)]  # ten steps of one token
    assert StreamInterval(4).chunk_times(times) == [0.0, 4.0, 8.0, 9.0]
    assert StreamInterval(1).chunk_times(times) == times
    assert StreamInterval(4).chunk_times([5.0]) == [5.0]


def test_a_step_of_several_tokens_can_pass_a_multiple_without_landing_on_it():
    # speculative steps of 3 tokens: after the first (3 tokens, sent at once) 3, 6 unsent -> sent
    times = [0.0] * 3 + [1.0] * 3 + [2.0] * 3 + [3.0] * 3
    assert StreamInterval(4).chunk_times(times) == [0.0, 2.0, 3.0]
    # interval 1: one chunk per step, not per token (vllm bench times one gap per chunk)
    assert StreamInterval(1).chunk_times(times) == [0.0, 1.0, 2.0, 3.0]


def test_iterations_count_steps_not_tokens():
    times = [0.0] * 2 + [1.0] * 2 + [2.0] * 2 + [3.0] * 2 + [4.0]  # 5 steps
    assert StreamInterval(2, "iterations").chunk_times(times) == [0.0, 1.0, 3.0, 4.0]
    assert StreamInterval(2, "tokens").chunk_times(times) == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_a_request_asks_for_its_own_interval_as_each_engine_takes_it():
    assert StreamInterval(4, per_request="max").for_request(2).every == 4  # vLLM clamps up
    assert StreamInterval(4, per_request="max").for_request(8).every == 8
    assert StreamInterval(4, per_request="replace").for_request(2).every == 2  # SGLang: the request's
    assert StreamInterval(4, "iterations", "ignore").for_request(8).every == 4  # TensorRT-LLM: none
    assert StreamInterval(4).for_request(None).every == 4


def test_the_policies_declare_their_engines_rules():
    def rule(name, n):
        cls = get_policy_cls(name)
        return cls(cls.default_config(H100, 8192, stream_interval=n)).stream_interval()

    assert rule("vllm", 4) == StreamInterval(4, "tokens", "max")
    assert rule("sglang", 4) == StreamInterval(4, "tokens", "replace")
    assert rule("trtllm", 4) == StreamInterval(4, "iterations", "ignore")
    tgi = get_policy_cls("tgi")
    assert tgi(tgi.default_config(H100, 8192)).stream_interval() == StreamInterval(per_request="ignore")


@pytest.mark.parametrize("name", ["vllm", "sglang", "trtllm"])
def test_an_interval_below_one_is_refused(name):
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        get_policy_cls(name).default_config(H100, 8192, stream_interval=0)
    with pytest.raises(ValueError, match="stream_interval must be an integer >= 1"):
        StreamInterval(0)


def test_an_abort_sends_what_is_held_and_a_step_without_tokens_sends_nothing():
    c = Chunker(StreamInterval(4))
    assert c.take(1, finished=False)  # the first token at once
    assert not c.take(1, finished=False)
    assert not c.take(0, finished=False)
    assert c.take(0, finished=True)  # finished (or aborted): what is held goes out


# ---- the simulated run --------------------------------------------------------------------------
def _run(policy: str, **options):
    built = build_cost_model(Deployment("Llama-3-8B", "H100-SXM", 1, "none"))
    (spec,) = parse_policy_list(policy)
    return run_policy(built, spec, WorkloadBuilder(WORKLOAD), options=EngineOptions(**options))


@pytest.mark.parametrize("policy", ["vllm", "sglang", "trtllm"])
def test_the_interval_changes_the_clients_itl_only(policy):
    plain = _run(policy).summary()
    chunked_run = _run(f"{policy}:stream_interval=8")
    chunked = chunked_run.summary()
    for name in ("ttft_s", "tpot_s", "e2e_s", "queue_s"):
        assert chunked["metrics"][name] == plain["metrics"][name]
    # the engine's own gaps are what the plain run calls its ITL
    assert chunked["stream"]["engine_itl_s"] == plain["metrics"]["itl_s"]
    assert chunked["stream"]["every"] == 8 and "stream" not in plain
    assert chunked["metrics"]["itl_s"]["p50"] > 5 * plain["metrics"]["itl_s"]["p50"]
    assert any("stream_interval=8" in note for note in chunked_run.notes)
    # the run file carries the rule, so a saved run summarizes the same
    assert chunked_run.stream.every == 8


def test_a_streamed_store_gives_the_same_numbers_as_the_requests():
    kept = _run("vllm:stream_interval=5")
    streamed = _run("vllm:stream_interval=5", stream_finished=True)
    assert streamed.finished is not None and streamed.finished.stream.every == 5
    a, b = kept.summary(), streamed.summary()
    assert a["metrics"] == b["metrics"] and a["stream"] == b["stream"]


def test_without_the_rule_the_summary_would_be_the_engines_itl():
    # the check above is not vacuous: summarizing the same requests without the rule differs
    run = _run("vllm:stream_interval=8")
    assert summarize(run.requests)["metrics"]["itl_s"] != run.summary()["metrics"]["itl_s"]


def test_bench_predict_times_chunks():
    requests = [BenchRequest(list(range(200)), 200, 40) for _ in range(6)]
    sent = np.arange(6) * 0.5
    spec = PredictSpec("Llama-3-8B", "H100-SXM", 1, "none", "vllm:stream_interval=8")
    results, _, _ = simulate(requests, sent, spec, None)
    for r in results:
        # 40 tokens: the first, then after 8, 16, 24, 32 and the last: 6 chunks, 5 gaps
        assert r.output_tokens == 40 and len(r.itl) == 5
    plain, _, _ = simulate(requests, sent, PredictSpec("Llama-3-8B", "H100-SXM", 1, "none", "vllm"), None)
    assert all(len(r.itl) == 39 for r in plain)


def test_explain_names_the_interval_with_the_clients_figures():
    run = _run("vllm:stream_interval=8", record_batches=True)
    text = explain_run(run).summary
    assert "stream_interval=8 (tokens)" in text and "a client's ITL is the gap between chunks" in text
    plain = _run("vllm", record_batches=True)
    assert "Streaming holds tokens back" not in explain_run(plain).summary


# ---- lint and tune's lines ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "line",
    [
        "vllm serve M --stream-interval 4",
        "python -m sglang.launch_server --model-path M --stream-interval 4",
    ],
)
def test_lint_takes_the_flag_into_the_simulation(line):
    rows = {r.flag: r for r in lint(line).rows}
    assert rows["--stream-interval"].verdict == SCHEDULING
    assert translate(lint(line), H100).spec.flags["stream_interval"] == 4


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_tunes_line_reads_back_to_the_interval(name):
    spec = PolicySpec.make(name, {"stream_interval": 6})
    line = command_line(spec, Deployment.of("Llama-3-8B", "H100", 1), None, H100, 8192)
    assert "--stream-interval 6" in line
    assert translate(lint(line), H100).spec.flags["stream_interval"] == 6


def test_tunes_trtllm_options_file_reads_back_to_the_interval(tmp_path, monkeypatch):
    spec = PolicySpec.make("trtllm", {"stream_interval": 6})
    back = trtllm_line_read_back(spec, Deployment.of("Llama-3-8B", "H100", 1), H100, tmp_path, monkeypatch)
    assert back.spec.flags["stream_interval"] == 6
