"""The engines' own schedulers, each in its peer venv, behind a JSON-lines subprocess.

Venvs come from ``scripts/setup-peers.sh`` under ``$TAILSERVE_PEERS`` (default ``.peers`` in
the repository). A driver process stays up for many workloads: importing vLLM takes ~10 s.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import TracebackType

from tailserve.validate.trace import StepRecord
from tailserve.validate.workload import Workload

DRIVERS = Path(__file__).parent / "drivers"
# engine name -> (venv name, driver script)
ENGINES: dict[str, tuple[str, str]] = {
    "vllm": ("vllm", "vllm_v1.py"),
    "vllm-v0": ("vllm-v0", "vllm_v0.py"),
    "sglang": ("sglang", "sglang_policy.py"),
    "sglang-adder": ("sglang", "sglang_adder.py"),
    "sglang-prealloc": ("sglang", "sglang_prealloc.py"),
}


class PeerError(RuntimeError):
    """A peer venv is missing, its driver failed to start, or it could not run a workload."""


def peers_dir() -> Path:
    env = os.environ.get("TAILSERVE_PEERS")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[3]  # src/tailserve/validate -> repository root
    return repo / ".peers"


def peer_python(engine: str) -> Path | None:
    """The python of the engine's peer venv, or None when it is not set up."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    venv = peers_dir() / ENGINES[engine][0]
    python = venv / "bin" / "python"
    return python if python.exists() else None


class PeerDriver:
    """One long-lived driver process: ``run(workload)`` returns the engine's step trace."""

    def __init__(self, engine: str, hash_seed: int | None = None) -> None:
        python = peer_python(engine)
        if python is None:
            raise PeerError(
                f"no {engine} peer venv under {peers_dir()}: run scripts/setup-peers.sh {ENGINES[engine][0]}"
            )
        env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1")
        if hash_seed is not None:
            # The engine iterates some sets of request ids (vLLM's finished requests, the sends
            # reported in one step): their order follows the process's string hash seed.
            env["PYTHONHASHSEED"] = str(hash_seed)
        self.engine = engine
        self._proc = subprocess.Popen(
            [str(python), str(DRIVERS / ENGINES[engine][1])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        hello = self._read()
        if not hello.get("ready"):
            raise PeerError(f"{engine} driver did not start: {hello}")
        self.version: str = hello.get("version", "?")

    def _read(self) -> dict:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            code = self._proc.poll()
            raise PeerError(f"{self.engine} driver exited (code {code}) without answering")
        return json.loads(line)

    def run_raw(self, payload: dict) -> dict:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(payload) + "\n")
        self._proc.stdin.flush()
        reply = self._read()
        if "error" in reply:
            raise PeerError(f"{self.engine} driver: {reply['error']}")
        return reply

    def run(self, workload: Workload) -> list[StepRecord]:
        reply = self.run_raw(workload.to_dict())
        return [StepRecord.from_dict(s) for s in reply["steps"]]

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> PeerDriver:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
