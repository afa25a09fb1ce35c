"""The CPU benchmarks say what they wait for, and for how long at most, before a long silent
phase: the quiet-machine gate when the machine is busy, and a bf16 GEMM measurement that takes
minutes on a CPU without a native bf16 matmul."""

from __future__ import annotations

import types
from typing import Any

import pytest


@pytest.fixture
def quiet() -> Any:
    from benchmarks import _common

    return _common


def _machine(monkeypatch: pytest.MonkeyPatch, quiet: Any, busy_cores: float) -> None:
    """A virtual clock (sleeping advances it) and a machine ``busy_cores`` busy all along."""
    clock = types.SimpleNamespace(t=0.0)

    def sleep(seconds: float) -> None:
        clock.t += seconds

    monkeypatch.setattr(quiet, "time", types.SimpleNamespace(monotonic=lambda: clock.t, sleep=sleep))
    monkeypatch.setattr(quiet, "machine_cpu", lambda: quiet.MachineCpu(busy_cores * clock.t, 0.0))


def test_a_busy_machine_is_waited_for_with_a_line_saying_so_first(quiet, monkeypatch, capsys):
    _machine(monkeypatch, quiet, busy_cores=1.5)
    record = quiet.gated(0.2, timeout_s=60.0)
    lines = capsys.readouterr().out.splitlines()
    assert not record["quiet"] and len(lines) == 2
    assert lines[0].startswith("waiting for a quiet machine before timing: 1.50 cores busy")
    assert "up to 56 s more" in lines[0]  # said after 4 s of the 60: the quickest wait is 3 s
    assert lines[1].startswith("warning: machine not quiet after 60 s")


def test_a_quiet_machine_is_timed_without_a_word(quiet, monkeypatch, capsys):
    _machine(monkeypatch, quiet, busy_cores=0.05)
    assert quiet.gated(0.2, timeout_s=60.0)["quiet"]
    assert capsys.readouterr().out == ""


@pytest.fixture
def roofline() -> Any:
    from benchmarks import _roofline

    return _roofline


def test_a_slow_first_matmul_announces_how_long_the_rest_takes(roofline, monkeypatch):
    said: list[str] = []
    monkeypatch.setattr(roofline, "SLOW_MATMUL_S", 0.0)
    assert roofline.measure_gemm_flops(n=64, reps=2, say=said.append) > 0
    assert len(said) == 1 and "the first 64^3 matmul took" in said[0] and "2 more to time" in said[0]
    monkeypatch.setattr(roofline, "SLOW_MATMUL_S", 1e9)
    roofline.measure_gemm_flops(n=64, reps=2, say=said.append)
    assert len(said) == 1


def test_the_gemm_notice_says_minutes_without_a_native_bf16_matmul(roofline, monkeypatch):
    from tailserve.executors.pytorch import cpu_backend

    # Without an engine kernel for bf16 (no compiler, TAILSERVE_CPU_KERNEL=0), PyTorch's own
    # bf16 matmul is timed: minutes on a CPU without avx512_bf16.
    monkeypatch.setattr(cpu_backend, "can_pack", lambda dtype, device: False)
    assert "4 matmuls of 2048^3" in roofline.gemm_notice("avx2")
    assert "no native bf16 matmul on this CPU, avx2: a minute or more each" in roofline.gemm_notice("avx2")
    assert "seconds in all" in roofline.gemm_notice("avx512_bf16")
    # With the engine's own bf16 kernel (the AVX2 one at avx2), that kernel is timed: seconds.
    monkeypatch.setattr(cpu_backend, "can_pack", lambda dtype, device: True)
    assert "seconds in all" in roofline.gemm_notice("avx2")
