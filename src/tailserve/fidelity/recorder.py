"""Record each iteration of a real engine: its batch shape and when its step started.

``ShapeRecorder`` wraps the executor inside an ``LLMEngine``. The time a step takes in a real
engine is more than the forward pass: scheduling, the update, stop checks and detokenization run
between two forward passes, and all of it is time a request waits. So the measured cost of an
iteration is its *period*: from its ``execute`` call to the next one's, when the engine went
straight on to the next (no idle wait between them); ``execute_s`` is the forward pass alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tailserve.core.executor import StepResult
from tailserve.core.scheduler_output import SchedulerOutput
from tailserve.executors.simulated.cost_model import BatchShape
from tailserve.executors.simulated.executor import batch_shape


@dataclass(slots=True)
class IterationRecord:
    shape: BatchShape
    start: float  # the recorder's timer at execute()
    execute_s: float  # the executor's own time
    period_s: float | None = None  # to the next execute(), when back to back; None otherwise


@dataclass
class ShapeRecorder:
    """An executor wrapper; ``mark_idle()`` before the engine waits, so the period is not
    counted across the wait."""

    inner: object
    timer: Callable[[], float] = time.perf_counter  # or CpuClock.now's source, time.thread_time
    records: list[IterationRecord] = field(default_factory=list)
    _idle: bool = True

    def execute(self, out: SchedulerOutput) -> StepResult:
        t0 = self.timer()
        if self.records and not self._idle and self.records[-1].period_s is None:
            self.records[-1].period_s = t0 - self.records[-1].start
        self._idle = False
        result = self.inner.execute(out)  # type: ignore[attr-defined]
        self.records.append(IterationRecord(batch_shape(out), t0, self.timer() - t0))
        return result

    def mark_idle(self) -> None:
        self._idle = True

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class CpuClock:
    """The engine's clock as this thread's CPU time, with idle waits skipped rather than slept.

    On a machine other processes share, wall time stretches by however much CPU they take; the
    thread's CPU time (one torch thread: the forward pass runs in it) is what a dedicated core
    would give. Waiting for an arrival costs no CPU, so ``wait_until`` jumps the clock instead.
    """

    def __init__(self) -> None:
        self._t0 = time.thread_time()
        self._skipped = 0.0

    @property
    def now(self) -> float:
        return time.thread_time() - self._t0 + self._skipped

    def advance(self, duration: float) -> None:
        """The time already passed while the executor ran."""

    def wait_until(self, t: float) -> None:
        gap = t - self.now
        if gap > 0:
            self._skipped += gap

    def timer(self) -> float:
        return self.now


def install(engine, cpu_clock: bool = False) -> ShapeRecorder:
    """Wrap an ``LLMEngine``'s executor (inside its stop checker) in a recorder; with
    ``cpu_clock`` the engine and the recorder read a ``CpuClock``."""
    checker = engine.stop_checker
    recorder = ShapeRecorder(checker.inner)
    if cpu_clock:
        clock = CpuClock()
        engine.engine.clock = clock
        recorder.timer = clock.timer
    checker.inner = recorder
    return recorder
