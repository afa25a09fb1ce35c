"""How many intra-op threads the torch executor runs, and how they wait.

Three facts of a CPU shared with other work decide it:

- **The cores this process may use** are the fewest of its CPU affinity
  (``os.sched_getaffinity``) and its cgroup's CPU quota (``cpu.max`` under cgroup v2,
  ``cpu.cfs_quota_us / cpu.cfs_period_us`` under v1). ``os.cpu_count()`` counts the host's.
- **An OpenMP parallel region is as slow as its slowest thread.** When another process holds one
  of the cores, the thread that shares it finishes its share of every matmul a time slice late
  while the others wait at the barrier. With GNU OpenMP's default waiting (spin ~300,000 times,
  milliseconds, before sleeping) the waiting threads also burn the CPU the late one needs.
  Measured on the 2-core machine with other jobs running (load average ~6), a tiny-model decode
  step at batch 64 took 290-570 ms with 2 spinning threads, 53-73 ms with 2 passively waiting
  ones and 70-76 ms with 1 thread.
- **A thread that sleeps at once makes every region pay a wake-up.** A decode step opens a few
  dozen regions a few microseconds of Python apart; on the 2-core VM a region after a 20 us gap
  took a median 56-64 us with sleeping (passive) threads and 8-10 us with threads that spin a
  while first (``benchmarks/engine_handoff.py`` (since removed; at daf5455)), and W ran 1.09-1.11x faster on the quiet machine
  (``benchmarks/engine_threads.py`` (since removed; at daf5455)). So waiting threads spin ``SPIN_COUNT`` times (GNU OpenMP's
  ``GOMP_SPINCOUNT``: 30,000 covered gaps of 0.3 ms and not of 1 ms on this machine) and
  then sleep: short enough to sleep through the time between steps and on a loaded machine,
  where the controller below has dropped to one thread anyway.
- **The machine's load changes while the engine runs**, so the thread count is revisited: every
  ``interval_s`` of stepping the controller reads how much CPU other processes used
  (``/proc/stat`` busy time minus this process's own) and runs on the cores they leave free, at
  least one. It drops at once when others take a core (a late thread costs ~10x) and climbs back
  only after two windows in a row leave a core free (flapping costs a thread-pool resize each
  time). Because a local client's CPU use (a benchmark streaming tokens) follows the engine's own
  output and reads like a competitor's, a count held down while the next core is not wholly
  taken is probed upward now and then and kept only if its own steps ran faster at the same
  batch shapes (``thread_policy.py``: the decision, its reasons and its measurements).

``threads=N`` (``LLM(threads=N)``, ``--threads``), or else ``OMP_NUM_THREADS``, fixes the count
and turns the adaptation off. A fixed count of two threads on a loaded machine waits better
passively (``OMP_WAIT_POLICY=PASSIVE``: decode steps at batch 64 took 26-28 ms against 44-59 ms
with the bounded spin at load ~3.5-4).

**Pinning** (``pin=True`` or ``TAILSERVE_PIN_THREADS=1``, off by default; ``affinity.py``): with a
fixed count, or an adaptive one while it runs on every core it may use, OpenMP thread ``t`` is
held on core ``t`` of its affinity, as vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` does. The stepping
thread (the team's slot 0) is pinned only for the duration of a step and gets its own mask back
after it, so threads and processes it starts later do not inherit one core. With
fewer threads than cores (others took a core) nothing is pinned: which core another process uses
is not known, and the kernel's scheduler moves an unpinned thread off it.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tailserve.executors.pytorch.thread_policy import Shape, StepTimes, ThreadState, decide

log = logging.getLogger(__name__)

# GNU OpenMP reads its wait setting once, when torch loads it: a thread that waits for the next
# parallel region spins this many times, then sleeps (see the module docstring).
SPIN_COUNT = 30_000
_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def set_openmp_wait_policy() -> str:
    """Load torch with ``GOMP_SPINCOUNT=SPIN_COUNT`` unless the user chose a wait setting; the
    variable is removed again afterwards, so child processes (a peer engine in a benchmark) keep
    their own defaults. Returns what happened, for the engine's description."""
    chosen = [v for v in _WAIT_VARIABLES if v in os.environ]
    if chosen:
        return f"OpenMP wait as set ({', '.join(f'{v}={os.environ[v]}' for v in chosen)})"
    if "torch" in sys.modules:
        return "OpenMP wait: torch's default (torch was imported before tailserve)"
    os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    try:
        import torch  # noqa: F401  (loads libgomp, which reads the variable now)
    finally:
        os.environ.pop("GOMP_SPINCOUNT", None)
    return f"OpenMP wait: spin {SPIN_COUNT:,}, then sleep"


def cgroup_cpu_quota(
    root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup")
) -> float | None:
    """The CPU quota of this process's cgroup in cores (``200000 100000`` -> 2.0), the tightest
    along its path; None when unlimited or unreadable."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        _hierarchy, controllers, path = line.split(":", 2)
        rel = Path(path.lstrip("/"))
        candidates = [rel, *rel.parents]
        if controllers == "":  # cgroup v2
            for p in candidates:
                q = _read_v2(root / p / "cpu.max")
                if q is not None:
                    quotas.append(q)
        elif "cpu" in controllers.split(","):  # cgroup v1
            base = root / controllers if (root / controllers).is_dir() else root / "cpu"
            for p in candidates:
                q = _read_v1(base / p)
                if q is not None:
                    quotas.append(q)
    return min(quotas) if quotas else None


def _read_v2(path: Path) -> float | None:
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return int(quota) / int(period)


def _read_v1(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def available_cores() -> int:
    """Cores this process may run on: its affinity, capped by the cgroup quota (rounded down,
    at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, math.floor(quota + 1e-9)))
    return max(1, cores)


def allowed_cpus() -> list[int]:
    """The CPU ids this thread may run on, in order (``range(cpu_count)`` where unknown)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


PIN_DEFAULT = False


def pin_from_env() -> bool:
    return os.environ.get("TAILSERVE_PIN_THREADS", "1" if PIN_DEFAULT else "0") not in ("0", "")


def omp_num_threads() -> int | None:
    """``OMP_NUM_THREADS`` when it names a positive count (a fixed choice), else None."""
    raw = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


@dataclass(slots=True)
class CpuSample:
    wall: float  # seconds, monotonic
    machine_busy: float  # seconds of busy CPU on the whole machine (all cores)
    own: float  # CPU seconds of this process (all its threads)


def read_sample() -> CpuSample | None:
    """Busy time from ``/proc/stat`` (user, nice, system, irq, softirq, steal) and this process's
    CPU time; None where ``/proc/stat`` does not exist."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]
    busy = ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6] + ticks[7]  # not idle, iowait
    hz = os.sysconf("SC_CLK_TCK")
    t = os.times()
    return CpuSample(time.monotonic(), busy / hz, t.user + t.system)


class ThreadController:
    """Sets torch's intra-op threads at construction and, when adaptive, once per ``interval_s``
    from the cores other processes leave free. ``tick()`` is called before every step; between
    windows it costs one clock read."""

    def __init__(
        self,
        threads: int | None = None,
        *,
        max_threads: int | None = None,
        interval_s: float = 0.5,
        set_threads=None,
        sample=read_sample,
        pin: bool | None = None,
        pinner=None,
        clock=time.monotonic,
        step_clock=time.perf_counter,
    ) -> None:
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        if threads is None:
            threads = omp_num_threads()  # the user's choice, as torch honours it
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self.max_threads = max_threads or available_cores()
        self.adaptive = threads is None
        self.threads = threads if threads is not None else self.max_threads
        self.state = ThreadState(self.threads, self.max_threads)
        self.steps = StepTimes()  # this process's step times per thread count and batch shape
        self._step_clock = step_clock  # times each step for the upward probe (thread_policy.py)
        self._step_start: float | None = None
        self.interval_s = interval_s
        self.num_changes = 0
        # seconds spent at each thread count (closed intervals; ``seconds_at`` adds the open one)
        self._seconds_at: dict[int, float] = {}
        self._clock = clock
        self._since = clock()
        self._set_threads = set_threads
        self._sample = sample
        self._last = sample() if self.adaptive else None
        if self._last is None:
            self.adaptive = False
        set_threads(self.threads)
        self.pin = pin_from_env() if pin is None else pin
        self._pin_team = pinner
        if self.pin and pinner is None:
            self.pin = self._load_pinner()
            if not self.pin:
                log.warning(
                    "pinning OpenMP threads was asked for but is unavailable here; they stay unpinned"
                )
        self._cpus = allowed_cpus()
        self._pinned: dict[int, tuple[int, ...]] = {}  # stepping thread -> cores its team holds
        self._restore: set[int] | None = None  # the stepping thread's mask while it is pinned

    @property
    def label(self) -> str:
        how = "adaptive" if self.adaptive else "fixed"
        return f"{self.threads} of {self.max_threads} threads ({how}{', pinned' if self.pin else ''})"

    def pinned_cores(self) -> tuple[int, ...] | None:
        """The cores the team should hold now, one each (the first of the allowed ones): a fixed
        count always, an adaptive one while it runs on every core it may use; else None."""
        if not self.pin or self.threads < 2 or len(self._cpus) < self.threads:
            return None
        if self.adaptive and self.threads < self.max_threads:
            return None  # others hold a core: the scheduler keeps unpinned threads off it
        return tuple(self._cpus[: self.threads])

    def begin_step(self) -> None:
        """Before a step: revisit the thread count, then (pinning) hold each OpenMP thread on its
        core, re-pinning the team when the count changed."""
        self.tick()
        if self.pin:
            self._pin_for_step()
        self._step_start = self._step_clock()

    def _pin_for_step(self) -> None:
        want = self.pinned_cores()
        me = threading.get_ident()
        have = self._pinned.get(me)
        if want is None and have is None:
            return
        own = os.sched_getaffinity(0)  # slot 0 is this thread: what it gets back
        try:
            if want != have:
                if want is not None:
                    self._pin_team([[c] for c in want])
                    self._pinned[me] = want
                else:
                    self._free_team(len(have))
                    del self._pinned[me]
            if want is not None:
                os.sched_setaffinity(0, {want[0]})
                self._restore = own
        except (OSError, ValueError) as e:  # a mask the kernel refuses, a smaller team
            log.warning("pinning OpenMP threads failed, running unpinned (%s)", e)
            self.pin = False
            os.sched_setaffinity(0, own)

    def set_pinning(self, on: bool) -> None:
        """Turn pinning on or off between steps (a benchmark's A/B in one process), from the
        stepping thread: turning it off frees the slots this thread's team holds."""
        have = self._pinned.pop(threading.get_ident(), None)
        if have is not None:
            self._free_team(len(have))
        if on and self._pin_team is None:
            on = self._load_pinner()
        self.pin = on

    def _load_pinner(self) -> bool:
        """Take ``affinity.pin_team`` as the pinner (its C compiled here on first use); whether
        it is available on this machine."""
        from tailserve.executors.pytorch import affinity

        self._pin_team = affinity.pin_team
        return affinity.available()

    def _free_team(self, size: int) -> None:
        """Every slot of this thread's team of ``size`` may run on every allowed core again; this
        thread (slot 0) keeps its own mask."""
        own = os.sched_getaffinity(0)
        self._pin_team([list(self._cpus)] * size)
        os.sched_setaffinity(0, own)

    def end_step(self, shape: Shape | None = None) -> None:
        """After a step: its time is recorded under ``shape`` (``thread_policy.step_shape``; None:
        not recorded, e.g. a step that failed), and the stepping thread gets its own mask back."""
        if shape is not None and self.adaptive and self._step_start is not None:
            self.steps.add(self.threads, shape, self._step_clock() - self._step_start)
        self._step_start = None
        if self._restore is not None:
            os.sched_setaffinity(0, self._restore)
            self._restore = None

    def tick(self) -> None:
        if not self.adaptive:
            return
        now = time.monotonic()
        if now - self._last.wall < self.interval_s:
            return
        sample = self._sample()
        if sample is not None:
            self.update_from(sample)

    def update_from(self, sample: CpuSample) -> None:
        """Close the window that started at the previous sample."""
        last = self._last
        self._last = sample
        wall = sample.wall - last.wall
        if wall <= 0:
            return
        others = max(0.0, (sample.machine_busy - last.machine_busy) - (sample.own - last.own)) / wall
        self.update(others)

    def update(self, others_cores: float) -> None:
        """Close a window in which other processes kept ``others_cores`` cores busy: the
        decision with this window's step-time ratio (``thread_policy.decide``)."""
        window = self.steps.close_window(others_cores)
        self.state = decide(self.state, window)
        log.debug(
            "thread window: others %.2f cores, step ratio %s: %d -> %d threads (%s)", others_cores,
            "-" if window.ratio is None else f"{window.ratio:.2f}", self.threads, self.state.threads,
            "probe" if self.state.probing else "held" if self.state.proven_load is not None else "load",
        )  # fmt: skip
        if self.state.threads != self.threads:
            self._apply(self.state.threads)

    def seconds_at(self) -> dict[int, float]:
        """Wall seconds spent at each thread count since construction: what a benchmark reports
        to show whether the adaptation ran it on fewer cores than it had."""
        out = dict(self._seconds_at)
        out[self.threads] = out.get(self.threads, 0.0) + self._clock() - self._since
        return out

    def _apply(self, threads: int) -> None:
        now = self._clock()
        self._seconds_at[self.threads] = self._seconds_at.get(self.threads, 0.0) + now - self._since
        self._since = now
        self.threads = threads
        self.num_changes += 1
        self._set_threads(threads)
