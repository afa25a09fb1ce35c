"""Nothing is written where the user did not ask: tune's resumable results go to the cache or
the report folder, benchmarks to a git-ignored folder, and no default is one machine's path."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tailserve.cli import main

REPO = Path(__file__).resolve().parents[1]
TUNE = [
    "tune", "--model", "Llama-3-8B", "--hardware", "H100-SXM", "--policies", "vllm",
    "--chunk-sizes", "512,2048", "--num-requests", "60", "--workers", "1", "--quiet",
]  # fmt: skip


def test_tune_keeps_its_results_in_the_cache_and_says_where(tmp_path, monkeypatch, capsys):
    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("TAILSERVE_CACHE", str(cache))
    assert main(TUNE) == 0
    assert list(work.iterdir()) == []  # nothing in the current directory
    (results,) = (cache / "tune").iterdir()
    err = capsys.readouterr().err
    assert f"results: {results}" in err and "0 runs to reuse" in err
    assert main(TUNE) == 0  # the same command finds the same file and resumes from it
    # 14 runs: capacity search and budget sweep; 1: the capacity replayed with twice the requests;
    # 3: the throughput ceiling's flood runs
    assert f"0 simulated, 18 reused from {results}" in capsys.readouterr().err
    assert main([*TUNE, "--num-requests", "61"]) == 0  # another workload: another file
    assert len(list((cache / "tune").iterdir())) == 2


# Every benchmark module (issue 11 moved their defaults; benchmarks/_common.py has the rule).
BENCHMARKS = sorted((REPO / "benchmarks").glob("*.py"))


def test_benchmarks_default_to_a_git_ignored_folder_and_no_machine_paths():
    assert len(BENCHMARKS) > 5
    for script in BENCHMARKS:
        text = script.read_text()
        assert "sys.path" not in text, f"{script.name}: a sys.path edit (benchmarks is a package)"
        assert not re.search(r"['\"]/(work|home|opt|root)/", text), f"{script.name}: an absolute path"
        assert 'HERE / "results"' not in text, f"{script.name}: writes into the committed results"
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "benchmarks/out/sim_speed.json"], cwd=REPO, capture_output=True
    )
    assert ignored.returncode == 0, "benchmarks/out/ must be git-ignored"


def test_benchmark_without_its_trace_says_where_to_get_it(tmp_path):
    missing = tmp_path / "azure_llm_2023_conv.csv"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.sim_speed", "--trace", str(missing)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"no trace at {missing}" in proc.stderr and "AzurePublicDataset" in proc.stderr


def test_vllm_benchmarks_look_for_the_peer_venv_under_tailserve_peers(tmp_path):
    code = "from benchmarks import _common; print(_common.peer_venv('vllm'))"
    env = {"PATH": "/usr/bin:/bin", "TAILSERVE_PEERS": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env)
    assert out.stdout.strip() == str(tmp_path / "vllm")
    env = {k: v for k, v in os.environ.items() if k != "TAILSERVE_PEERS"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env)
    assert out.stdout.strip() == str(REPO / ".peers" / "vllm")
