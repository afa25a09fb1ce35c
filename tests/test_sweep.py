"""Sweeps: identical results serially, on a process pool and on Ray; resume from the results file;
searches driven side by side; errors come back as values."""

from __future__ import annotations

import json

import pytest

from tailserve.cli import main
from tailserve.core.engine import EngineOptions
from tailserve.executors.simulated.deployment import Deployment
from tailserve.policies.registry import PolicySpec
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.tune.sweep import ProcessBackend, ResultsFile, RunSpec, SerialBackend, Sweep, make_backend


def specs(rates=(2.0, 6.0), policies=("vllm", "sglang"), seed=0) -> list[RunSpec]:
    return [
        RunSpec(
            Deployment("Llama-3-8B", "H100-SXM", 1),
            WorkloadSpec("chat", num_requests=40, rate=rate, seed=seed),
            PolicySpec.make(name, {}),
        )
        for name in policies
        for rate in rates
    ]


@pytest.fixture(scope="module")
def serial_results():
    with Sweep(SerialBackend(), quiet=True) as sweep:
        return sweep.run(specs())


def test_process_pool_gives_the_serial_results(serial_results):
    with Sweep(ProcessBackend(2), quiet=True) as sweep:
        pooled = sweep.run(specs())
    assert [o.key for o in pooled] == [o.key for o in serial_results]
    assert [o.summary for o in pooled] == [o.summary for o in serial_results]
    assert all(o.run is None for o in pooled), "only summaries cross the process boundary"
    assert sweep.num_executed == 4


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_gives_the_serial_results(serial_results, local_ray):
    backend = make_backend(ray_address="auto")
    assert backend.workers == 2
    with Sweep(backend, quiet=True) as sweep:
        on_ray = sweep.run(specs())
    assert [o.summary for o in on_ray] == [o.summary for o in serial_results]
    assert local_ray.is_initialized(), "a Ray the caller started stays up"


def test_keys_name_what_decides_the_result():
    a, b = specs(rates=(2.0,), policies=("vllm",)), specs(rates=(2.0,), policies=("vllm",))
    assert a[0].key == b[0].key
    assert specs(rates=(2.0,), policies=("vllm",), seed=1)[0].key != a[0].key
    assert specs(rates=(2.5,), policies=("vllm",))[0].key != a[0].key
    flagged = RunSpec(a[0].deployment, a[0].workload, PolicySpec.make("vllm", {"max_num_seqs": 8}))
    assert flagged.key != a[0].key
    slow = RunSpec(a[0].deployment, a[0].workload, a[0].policy, options=EngineOptions(fast_forward=False))
    assert slow.key == a[0].key, "engine options change speed, not results"


def test_resume_skips_finished_runs(tmp_path, serial_results):
    path = tmp_path / "runs.jsonl"
    first = specs()[:3]
    with Sweep(SerialBackend(), ResultsFile(path), quiet=True) as sweep:
        sweep.run(first)
    assert sweep.num_executed == 3 and len(path.read_text().splitlines()) == 3

    # A sweep interrupted while writing leaves a partial last line: it is ignored.
    with path.open("a") as f:
        f.write('{"key": "abc", "lab')
    with Sweep(SerialBackend(), ResultsFile(path), quiet=True) as sweep:
        outcomes = sweep.run(specs())
    assert (sweep.num_executed, sweep.num_reused) == (1, 3)
    assert [o.reused for o in outcomes] == [True, True, True, False]
    assert [o.summary for o in outcomes] == [o.summary for o in serial_results]

    with Sweep(SerialBackend(), ResultsFile(path, resume=False), quiet=True) as sweep:
        sweep.run(specs()[:1])
    assert sweep.num_executed == 1 and len(path.read_text().splitlines()) == 1


def test_a_kept_run_is_not_held_after_the_caller_drops_it():
    import dataclasses
    import gc
    import weakref

    spec = dataclasses.replace(specs(rates=(2.0,), policies=("vllm",))[0], keep_run=True)
    with Sweep(SerialBackend(), quiet=True) as sweep:
        (outcome,) = sweep.run([spec])
        assert outcome.run is not None and len(outcome.run.requests) == 40
        kept = weakref.ref(outcome.run)
        del outcome
        gc.collect()
        # A long sweep of kept runs (a capacity table) must not pile every run up in memory.
        assert kept() is None, "the sweep still references a run its caller dropped"
        (again,) = sweep.run([spec])
        assert again.run is not None, "a kept run is run again, never read back as a summary"


def test_a_corrupt_results_file_is_an_error(tmp_path):
    path = tmp_path / "runs.jsonl"
    path.write_text("not json\n" + json.dumps({"key": "k", "label": "x", "summary": {}, "wall_s": 0}) + "\n")
    with pytest.raises(ValueError, match=r"runs.jsonl:1: not a results line"):
        ResultsFile(path)


def test_searches_run_side_by_side_and_share_runs():
    base = specs(rates=(2.0, 4.0, 8.0), policies=("vllm",))

    def search(order):
        seen = []
        for i in order:
            outcome = yield base[i]
            seen.append(outcome.summary["metrics"]["ttft_s"]["p99"])
        return seen

    with Sweep(SerialBackend(), quiet=True) as sweep:
        a, b = sweep.drive([search([0, 1]), search([1, 2, 0])])
    assert sweep.num_executed == 3, "a run two searches ask for runs once"
    assert a == [b[2], b[0]]


def test_a_bad_spec_comes_back_as_an_error_and_is_not_saved(tmp_path):
    bad = RunSpec(
        Deployment("Llama-3-70B", "L4", 1), WorkloadSpec("chat", num_requests=5), PolicySpec("vllm")
    )
    path = tmp_path / "runs.jsonl"
    with Sweep(SerialBackend(), ResultsFile(path), quiet=True) as sweep:
        (outcome,) = sweep.run([bad])
    assert outcome.error and "does not fit" in outcome.error
    assert not path.exists() or path.read_text() == ""


def test_bad_worker_count_is_a_clear_error(capsys):
    assert main(["compare", "--workers", "0"]) == 2
    assert "--workers must be >= 1" in capsys.readouterr().err


def test_compare_output_is_the_same_on_a_pool(capsys):
    args = ["compare", "--policies", "orca,vllm,sarathi", "--workload", "chat", "--num-requests", "30"]
    assert main([*args, "--workers", "1"]) == 0
    serial = capsys.readouterr().out
    assert main([*args, "--workers", "2"]) == 0
    assert capsys.readouterr().out == serial


def test_a_trace_is_keyed_by_its_file_not_the_path_spelling(tmp_path, monkeypatch):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"arrival_time": 0.0, "prompt_len": 10, "max_tokens": 2}) + "\n")
    monkeypatch.chdir(tmp_path)

    def key() -> str:
        return RunSpec(Deployment(), WorkloadSpec("trace", trace_path="t.jsonl"), PolicySpec("vllm")).key

    before = key()
    assert (
        RunSpec(Deployment(), WorkloadSpec("trace", trace_path=str(trace)), PolicySpec("vllm")).key == before
    )
    trace.write_text(
        trace.read_text() + json.dumps({"arrival_time": 1.0, "prompt_len": 10, "max_tokens": 2}) + "\n"
    )
    assert key() != before, "an edited trace does not match its old results"
