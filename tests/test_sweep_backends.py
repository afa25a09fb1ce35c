"""The sweep backends themselves: pool workers that start once and run many specs, a local Ray
started for one sweep (``--ray-address local``) with the serial results, the CPU count the
default pool takes, and bad Ray addresses as one line."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest

from tailserve.cli import main
from tailserve.executors.simulated.deployment import Deployment
from tailserve.policies.registry import PolicySpec
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.tune.backends import check_reachable, usable_cpus
from tailserve.tune.sweep import (
    ProcessBackend,
    ResultsFile,
    RunOutcome,
    RunSpec,
    SerialBackend,
    Sweep,
    make_backend,
)


def specs() -> list[RunSpec]:
    return [
        RunSpec(
            Deployment("Llama-3-8B", "H100-SXM", 1),
            WorkloadSpec("chat", num_requests=30, rate=4.0, seed=3),
            PolicySpec.make(name, flags),
        )
        for name, flags in [
            ("vllm", {"max_num_batched_tokens": 512}),
            ("sarathi", {"chunk_size": 256}),
            ("sglang", {}),
            ("vllm", {"max_num_seqs": 4}),
        ]
    ]


@dataclass(frozen=True)
class WhoRuns:
    """A spec whose outcome names the process that ran it."""

    index: int
    keep_run: bool = False

    @property
    def key(self) -> str:
        return f"who-{self.index}"

    def describe(self) -> dict[str, Any]:
        return {"who": self.index}

    def execute(self) -> RunOutcome:
        return RunOutcome(self.key, str(os.getpid()), {"index": self.index}, 0.0)


def test_pool_workers_start_once_and_run_many_specs_each():
    with Sweep(ProcessBackend(2), quiet=True) as sweep:
        outcomes = sweep.run([WhoRuns(i) for i in range(12)])
    assert [o.summary["index"] for o in outcomes] == list(range(12)), "outcomes come back in spec order"
    pids = {o.label for o in outcomes}
    assert len(pids) <= 2 and str(os.getpid()) not in pids


def test_each_run_reports_its_cpu_seconds_and_the_results_file_keeps_them(tmp_path):
    path = tmp_path / "runs.jsonl"
    with Sweep(SerialBackend(), ResultsFile(path), quiet=True) as sweep:
        outcomes = sweep.run(specs()[:1])
    assert outcomes[0].cpu_s > 0
    assert ResultsFile(path).get(outcomes[0].key).cpu_s == outcomes[0].cpu_s


def test_a_local_ray_started_for_the_sweep_gives_the_serial_results():
    ray = pytest.importorskip("ray", reason="ray is an optional dependency (tailserve[ray])")
    if ray.is_initialized():
        pytest.skip("another test left Ray running; this one starts its own")
    with Sweep(SerialBackend(), quiet=True) as sweep:
        serial = sweep.run(specs())
    backend = make_backend(2, "local")
    assert backend.workers == 2, "a local Ray of --workers CPUs"
    with Sweep(backend, quiet=True) as sweep:
        on_ray = sweep.run(specs())
    assert [(o.key, o.summary) for o in on_ray] == [(o.key, o.summary) for o in serial]
    assert all(o.cpu_s > 0 for o in on_ray)
    assert not ray.is_initialized(), "the Ray started for the sweep stops with it"


def test_the_default_pool_takes_the_usable_cpus():
    cpus = usable_cpus()
    assert 1 <= cpus <= (os.cpu_count() or 1)
    if hasattr(os, "sched_getaffinity"):
        assert cpus <= len(os.sched_getaffinity(0))
    backend = make_backend()
    try:
        assert backend.workers == cpus
        assert isinstance(backend, SerialBackend) == (cpus == 1)
    finally:
        backend.close()


def test_a_malformed_ray_address_is_named():
    with pytest.raises(ValueError, match=r"--ray-address 'head': expected local, auto, HOST:PORT"):
        check_reachable("head")


def test_an_unreachable_ray_address_is_one_line(capsys):
    pytest.importorskip("ray", reason="the address is checked once ray imports")
    # Port 1 on this machine: nothing listens there, so the connection is refused at once.
    argv = ["compare", "--policies", "vllm", "--ray-address", "127.0.0.1:1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1]
        == "tailserve: error: --ray-address 127.0.0.1:1: cannot reach 127.0.0.1:1 (Connection refused)"
    )
    assert not any("Traceback" in line for line in err)


def test_workers_with_a_running_ray_is_an_error(capsys):
    assert main(["compare", "--ray-address", "auto", "--workers", "2"]) == 2
    assert "--workers sizes the local pool or --ray-address local" in capsys.readouterr().err
