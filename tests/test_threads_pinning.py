"""Pinning torch's OpenMP threads one per core (executors/pytorch/affinity.py, threads.py): the
controller's rules with a recording pinner, and the real pinning on torch's own thread pool."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from tailserve.executors.pytorch.threads import CpuSample, ThreadController, allowed_cpus

TWO_CPUS = len(allowed_cpus()) >= 2
needs_two = pytest.mark.skipif(not TWO_CPUS, reason="needs two CPUs in this process's affinity")


class Pins:
    def __init__(self) -> None:
        self.calls: list[list[list[int]]] = []

    def __call__(self, cpu_sets: list[list[int]]) -> list[int]:
        self.calls.append(cpu_sets)
        return list(range(len(cpu_sets)))


@needs_two
def test_fixed_threads_pin_once_and_the_stepping_thread_gets_its_mask_back(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    pins, before = Pins(), os.sched_getaffinity(0)
    c = ThreadController(2, max_threads=2, set_threads=lambda n: None, pin=True, pinner=pins)
    cpus = allowed_cpus()
    assert c.label == "2 of 2 threads (fixed, pinned)"
    for _ in range(3):
        c.begin_step()
        assert os.sched_getaffinity(0) == {cpus[0]}  # slot 0 is this thread, pinned for the step
        c.end_step()
        assert os.sched_getaffinity(0) == before
    assert pins.calls == [[[cpus[0]], [cpus[1]]]]  # once, not per step


@needs_two
def test_adaptive_threads_unpin_when_others_take_a_core_and_pin_again_after(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    pins, t, busy, own = Pins(), [0.0], [0.0], [0.0]

    def sample() -> CpuSample:
        return CpuSample(t[0], busy[0], own[0])

    def window(others: float) -> None:
        t[0] += 1.0
        busy[0] += others + 2.0
        own[0] += 2.0

    c = ThreadController(max_threads=2, set_threads=lambda n: None, sample=sample, pin=True, pinner=pins)
    cpus = allowed_cpus()
    c.begin_step()
    c.end_step()
    window(others=1.0)  # another process keeps a core busy
    c.begin_step()
    assert c.threads == 1 and c.pinned_cores() is None
    assert os.sched_getaffinity(0) != {cpus[0]}  # not pinned during this step
    c.end_step()
    for _ in range(2):  # two free windows: back to two threads
        window(others=0.0)
        c.begin_step()
        c.end_step()
    assert c.threads == 2
    every = list(cpus)
    assert pins.calls == [[[cpus[0]], [cpus[1]]], [every, every], [[cpus[0]], [cpus[1]]]]


def test_no_pinning_by_default_and_nothing_pinned_at_one_thread(monkeypatch) -> None:
    monkeypatch.delenv("TAILSERVE_PIN_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    pins = Pins()
    c = ThreadController(1, max_threads=2, set_threads=lambda n: None, pinner=pins)
    assert not c.pin and "pinned" not in c.label
    c = ThreadController(1, max_threads=2, set_threads=lambda n: None, pin=True, pinner=pins)
    c.begin_step()
    c.end_step()
    assert pins.calls == []


@needs_two
def test_pin_team_pins_torch_own_openmp_threads() -> None:
    import torch

    from tailserve.executors.pytorch import affinity

    if not affinity.available():
        pytest.skip(f"pinning unavailable here: {affinity._failed}")
    cpus, own = allowed_cpus(), os.sched_getaffinity(0)
    saved = torch.get_num_threads()
    result: dict[str, object] = {}

    def work() -> None:  # a fresh thread: its own OpenMP pool, as an engine thread has
        torch.set_num_threads(2)
        a = torch.randn(512, 512)
        for _ in range(3):
            a @ a  # torch's team of two exists now
        tasks = {int(p.name) for p in Path("/proc/self/task").iterdir()}
        tids = affinity.pin_team([[cpus[0]], [cpus[1]]])
        result["new_threads"] = set(tids) - tasks
        a @ a
        result["team"] = affinity.team_affinity(2)
        result["tids"] = tids
        affinity.pin_team([list(cpus), list(cpus)])
        os.sched_setaffinity(0, own)

    th = threading.Thread(target=work)
    th.start()
    th.join()
    torch.set_num_threads(saved)
    assert result["new_threads"] == set()  # the same libgomp, the same pool threads as torch's
    assert [tid for tid, _ in result["team"]] == result["tids"]
    assert [mask for _, mask in result["team"]] == [{cpus[0]}, {cpus[1]}]
