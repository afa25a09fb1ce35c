"""CPU thread choice for the torch executor (executors/pytorch/threads.py): cgroup quotas,
OMP_NUM_THREADS as a fixed choice, and the adaptive controller under other processes' load."""

from __future__ import annotations

from pathlib import Path

import pytest

from tailserve.executors.pytorch.threads import CpuSample, ThreadController, cgroup_cpu_quota


def _cgroup(tmp_path: Path, line: str) -> Path:
    f = tmp_path / "self_cgroup"
    f.write_text(line + "\n")
    return f


def test_cgroup_v2_quota_is_the_tightest_along_the_path(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "a" / "b" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path, _cgroup(tmp_path, "0::/a/b")) == 1.5


def test_cgroup_v1_quota_and_unlimited(tmp_path: Path) -> None:
    folder = tmp_path / "cpu" / "job"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_text("300000\n")
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path, _cgroup(tmp_path, "3:cpu,cpuacct:/job")) == 3.0  # via cpu/
    (tmp_path / "cpu,cpuacct").symlink_to(tmp_path / "cpu")
    assert cgroup_cpu_quota(tmp_path, _cgroup(tmp_path, "3:cpu,cpuacct:/job")) == 3.0
    (folder / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(tmp_path, _cgroup(tmp_path, "3:cpu,cpuacct:/job")) is None
    assert cgroup_cpu_quota(tmp_path, tmp_path / "missing") is None


class FakeCpu:
    """A machine of ``cores`` cores on which others use ``others`` cores and we use ``own``."""

    def __init__(self) -> None:
        self.t = self.busy = self.own_s = 0.0

    def advance(self, seconds: float, others: float, own: float) -> None:
        self.t += seconds
        self.busy += seconds * (others + own)
        self.own_s += seconds * own

    def sample(self) -> CpuSample:
        return CpuSample(self.t, self.busy, self.own_s)


def test_controller_drops_at_once_and_climbs_back_after_two_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpu, applied = FakeCpu(), []
    c = ThreadController(max_threads=4, set_threads=applied.append, sample=cpu.sample)
    assert c.adaptive and applied == [4]
    cpu.advance(1.0, others=2.0, own=2.0)
    c.update_from(cpu.sample())
    assert c.threads == 2  # two cores taken: drop at once
    cpu.advance(1.0, others=0.1, own=2.0)
    c.update_from(cpu.sample())
    assert c.threads == 2  # one quiet window is not enough
    cpu.advance(1.0, others=0.1, own=2.0)
    c.update_from(cpu.sample())
    assert c.threads == 3  # two in a row: one more thread
    cpu.advance(1.0, others=0.2, own=3.0)
    c.update_from(cpu.sample())
    cpu.advance(1.0, others=0.2, own=3.0)
    c.update_from(cpu.sample())
    assert c.threads == 4
    cpu.advance(1.0, others=9.0, own=1.0)
    c.update_from(cpu.sample())
    assert c.threads == 1  # never below one
    assert applied == [4, 2, 3, 4, 1]


def test_controller_counts_the_seconds_at_each_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpu, now = FakeCpu(), [100.0]
    c = ThreadController(max_threads=2, set_threads=lambda n: None, sample=cpu.sample, clock=lambda: now[0])
    now[0] += 3.0
    cpu.advance(3.0, others=1.0, own=1.0)
    c.update_from(cpu.sample())  # a core taken: one thread
    now[0] += 1.5
    assert c.seconds_at() == {2: 3.0, 1: 1.5}
    for _ in range(2):
        now[0] += 0.5
        cpu.advance(0.5, others=0.0, own=1.0)
        c.update_from(cpu.sample())
    now[0] += 2.0
    assert c.threads == 2 and c.seconds_at() == {2: 5.0, 1: 2.5}


def test_fixed_threads_and_omp_num_threads_turn_adaptation_off(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, applied = FakeCpu(), []
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    c = ThreadController(3, max_threads=4, set_threads=applied.append, sample=cpu.sample)
    assert not c.adaptive and c.label == "3 of 4 threads (fixed)"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    c = ThreadController(max_threads=4, set_threads=applied.append, sample=cpu.sample)
    assert not c.adaptive and c.threads == 1
    cpu.advance(5.0, others=0.0, own=1.0)
    c.tick()
    assert applied == [3, 1]
    with pytest.raises(ValueError, match="threads must be at least 1, got 0"):
        ThreadController(0, set_threads=applied.append)


def test_without_proc_stat_the_count_stays_fixed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    c = ThreadController(max_threads=2, set_threads=lambda n: None, sample=lambda: None)
    assert not c.adaptive and c.threads == 2
