"""The adaptive thread count's decision: a state, one window's readings, and a pure ``decide``.

``ThreadController`` (threads.py) closes a window every ``interval_s`` of stepping and hands
``decide`` what it saw: the cores other processes kept busy (``/proc/stat`` minus its own CPU)
and how fast its own steps ran against the same batch shapes one thread fewer (``StepTimes``).
Nothing here reads a clock or ``/proc``, so every path is tested with injected readings
(``tests/test_thread_policy.py``).

**The load rule (r41), kept.** A core counts as free when others used less than a third of it;
the count drops at once when others take a core (a thread sharing its core with another process
makes every parallel region a time slice late) and climbs one thread after two windows in a row
leave a core free.

**Why the load alone is not enough: a local client.** Others' use is read beside the engine, so
it cannot tell a competitor from a process whose CPU the engine's own output drives: a benchmark
client streaming tokens, ``tailserve bench``, the closed loop's calibration probes. On the 2-core
host such a client used over 2/3 of a core while the engine ran one thread, which the load rule
reads as a taken core, so once a burst dropped the count it stayed at one thread for good (r41
reported a head-of-line run at TTFT 2.1 s against ~80 ms). Raising the threshold is not the fix:
beside a synthetic competitor busy d of a core one thread already beat two from d = 0.3 for
decodes (docs/fidelity.md, "The probe's own CPU (r41)").

**A bounded upward probe.** Below the cores it may use, with the next core not wholly taken
(others below ``max - threads - PROBE_MARGIN`` cores: a process busy a whole core reads ~1.0 of
one and never gets probed), after ``probe_after`` windows the controller runs one thread more for
``SPAN`` windows (2 s) and compares its steps with the same shapes' times at the count it came
from. It keeps the extra thread only if steps got faster (their total time under ``KEEP_BELOW``
of the fewer-thread time), else goes back and waits twice as long before the next probe (up to
``PROBE_AFTER_MAX`` windows), so a misjudged competitor costs ``SPAN`` windows in
``PROBE_AFTER_MAX`` at most. A count kept by a probe is held against the mean load reading it was
proven under: it drops at once when others' use rises ``RISE`` cores above that reading (a
competitor joined) or a window's steps take ``DROP_NOW_AT`` times the fewer-thread time, and
after a span whose steps ran no faster (``DROP_AT``); it returns to the plain load rule once the
load alone allows the count. Steps are the ground truth here because the reading is not: on a
2-core host a competitor busy a whole core beside two busy engine threads gets a fair share of
two cores among three threads, so it can read as little as 2/3 of a core, what a client may read.

**Measured (r42, the 2-core EPYC VM beside another session's jobs, load average 1.1-4.3).** In
head-of-line runs (``tailserve serve`` + the closed loop's hol workload from a local client), the
run that stayed on two threads had TTFT p50 / p99 77 / 666 ms, one that stayed on one thread
185 / 1,224 ms; windows' median per-step ratios of two threads against one were 1.01-1.76 (few-row
decodes of the tiny model ran slower on two threads), hence the total-time ratio over 2 s spans.
On real steps with a synthetic client's reading (0.8 of a core beside one thread, 0.6 beside two;
the engine in-process, hol at its send times, starting at one thread) the probe ran after 4
windows: on a quiet machine (0.0 busy cores before) it kept two threads (window ratios 0.80, 0.80,
0.72); beside the other session's ~1 busy core it went back (1.34 .. 0.99), the answer it should
give there. Served runs with a real local client never reached the probe's zone here: others
read 0.0-0.5 of a core beside two threads, or 1.0-1.8 with the other session's jobs (and 1.0-1.1
with an output-driven burner of 0.72 core beside one thread, on a machine quiet just before).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, replace

FREE_BELOW = 1 / 3  # others' use of a core under which it counts as free (the r41 load rule)
RAISE_AFTER = 2  # windows in a row with a core free before one more thread
PROBE_MARGIN = 0.1  # a probe needs this much of the next core left by others
PROBE_AFTER = 4  # windows below the cores it may use before the first probe
PROBE_AFTER_MAX = 64  # the longest wait between probes (windows), after failed ones
# Windows a probe runs, and a held count's steps are judged over: 2 s, so the few long prefill
# steps of a mixed load (one every 2 s in the closed loop's hol) are in the sum beside the decodes.
SPAN = 4
KEEP_BELOW = 0.95  # a probe keeps its thread when its steps took under this share of the time
DROP_AT = 1.0  # a held count drops when its steps over a span take at least the fewer-thread time
DROP_NOW_AT = 2.5  # ... or at once when one window's do this (a late thread costs ~10x)
RISE = 1 / 3  # cores of others' use above the proven reading that drop a held count
MIN_MATCHED = 3  # steps matched to a recorded shape for a ratio


@dataclass(frozen=True, slots=True)
class Window:
    """What one window showed: the cores other processes kept busy, and its steps matched to a
    shape recorded at one thread fewer (``StepTimes``): their time, that time, how many."""

    others: float
    spent: float = 0.0
    before: float = 0.0
    matched: int = 0

    @property
    def ratio(self) -> float | None:
        return _ratio(self.spent, self.before, self.matched)


def _ratio(spent: float, before: float, matched: int) -> float | None:
    return spent / before if matched >= MIN_MATCHED and before > 0 else None


@dataclass(frozen=True, slots=True)
class ThreadState:
    threads: int
    max_threads: int
    raise_votes: int = 0  # windows in a row the load rule allowed one more thread
    below: int = 0  # windows in a row in the probe zone (a core not wholly taken)
    probe_after: int = PROBE_AFTER  # windows in the probe zone before the next probe
    probing: int = 0  # windows this probe has run (0: not probing)
    proven_load: float | None = None  # others' use under which a probe kept this count
    held: int = 0  # windows the probe-kept count has held
    # The current probe's or hold span's matched steps (``Window``'s sums) and others' use.
    spent: float = 0.0
    before: float = 0.0
    matched: int = 0
    others: float = 0.0


def load_target(others: float, max_threads: int) -> int:
    """The count the load rule picks: the cores others leave, a core free under a third used."""
    return max(1, min(max_threads, math.floor(max_threads - others + 1 - FREE_BELOW)))


def decide(s: ThreadState, w: Window) -> ThreadState:
    """The state after a window that ran at ``s.threads``."""
    target = load_target(w.others, s.max_threads)
    if s.probing:
        s = _add(s, w)
        if s.probing < SPAN or (s.matched < MIN_MATCHED and s.probing < 2 * SPAN):
            return replace(s, probing=s.probing + 1)
        ratio = _ratio(s.spent, s.before, s.matched)
        if ratio is not None and ratio < KEEP_BELOW:
            return _cleared(replace(s, probing=0, proven_load=s.others / s.probing, held=0))
        return _give_up(s, s.threads - 1, 2 * s.probe_after)
    if s.proven_load is not None:
        if target >= s.threads:  # the load alone allows it now
            return _cleared(replace(s, proven_load=None, held=0, raise_votes=0))
        # Held at least as long as it waited: conditions changed, the probe was not wrong.
        wait = PROBE_AFTER if s.held >= s.probe_after else 2 * s.probe_after
        ratio = w.ratio
        if w.others > s.proven_load + RISE or (ratio is not None and ratio >= DROP_NOW_AT):
            return _give_up(s, min(target, s.threads - 1), wait)
        s = replace(_add(s, w), held=s.held + 1)
        if s.held % SPAN:
            return s
        ratio = _ratio(s.spent, s.before, s.matched)
        if ratio is not None and ratio >= DROP_AT:
            return _give_up(s, min(target, s.threads - 1), wait)
        return _cleared(s)
    if target < s.threads:
        return replace(s, threads=target, raise_votes=0, below=0)
    if target > s.threads:
        if s.raise_votes + 1 >= RAISE_AFTER:
            return replace(s, threads=s.threads + 1, raise_votes=0, below=0)
        return replace(s, raise_votes=s.raise_votes + 1, below=0)
    if s.threads >= s.max_threads:
        return replace(s, raise_votes=0, below=0, probe_after=PROBE_AFTER)
    if w.others >= s.max_threads - s.threads - PROBE_MARGIN:  # the next core is taken
        return replace(s, raise_votes=0, below=0)
    if s.below + 1 >= s.probe_after:
        return replace(s, threads=s.threads + 1, raise_votes=0, below=0, probing=1)
    return replace(s, raise_votes=0, below=s.below + 1)


def _add(s: ThreadState, w: Window) -> ThreadState:
    return replace(
        s, spent=s.spent + w.spent, before=s.before + w.before, matched=s.matched + w.matched,
        others=s.others + w.others,
    )  # fmt: skip


def _cleared(s: ThreadState) -> ThreadState:
    return replace(s, spent=0.0, before=0.0, matched=0, others=0.0)


def _give_up(s: ThreadState, threads: int, wait: int) -> ThreadState:
    """Back to ``threads`` under the load rule, the next probe after ``wait`` windows (capped)."""
    return _cleared(
        replace(
            s, threads=max(1, threads), probing=0, proven_load=None, held=0, below=0, raise_votes=0,
            probe_after=min(PROBE_AFTER_MAX, wait),
        )
    )  # fmt: skip


Shape = tuple[int, int, int]


def _quarter_octave(n: int) -> int:
    """``n`` exactly below 8, else its power of two and the next two bits (within 25%)."""
    if n < 8:
        return n
    b = n.bit_length()
    return 4 * b + ((n >> (b - 3)) & 3)


def step_shape(num_new_tokens: list[int], num_context_tokens: list[int]) -> Shape:
    """A step's batch shape for comparing its time: its rows and its new tokens, each within a
    quarter octave (a prefill chunk's length varies with the decodes beside it), and its context
    within a factor of two (attention's share grows with it; decodes add a token a step)."""
    return (
        _quarter_octave(len(num_new_tokens)),
        _quarter_octave(sum(num_new_tokens)),
        sum(num_context_tokens).bit_length(),
    )


class StepTimes:
    """Recent step times per (thread count, shape), and the ratio ``Window.ratio`` reports: a
    window's matched steps' total time over the total of their shapes' median times at one
    thread fewer. Weighted by time, not a median of per-step ratios: one long prefill step
    (compute-bound, faster on more threads) counts for the many short decode steps (on the
    2-core VM, r42's head-of-line runs, a window's median per-step ratio of two threads against
    one was 1.01-1.76, while TTFT p50 halved on two) it outweighs in the requests' latency."""

    def __init__(self, per_shape: int = 8, max_shapes: int = 256) -> None:
        self.per_shape = per_shape
        self.max_shapes = max_shapes
        self._times: dict[tuple[int, Shape], deque[float]] = {}
        # this window's matched steps: their time, and their shapes' time at one thread fewer
        self._spent = self._before = 0.0
        self._matched = 0

    def add(self, threads: int, shape: Shape, seconds: float) -> None:
        fewer = self._times.get((threads - 1, shape))
        if fewer:
            self._spent += seconds
            self._before += statistics.median(fewer)
            self._matched += 1
        key = (threads, shape)
        times = self._times.pop(key, None)  # re-inserted last: the dict's order is recency
        if times is None:
            if len(self._times) >= self.max_shapes:
                del self._times[next(iter(self._times))]  # the least recently run shape
            times = deque(maxlen=self.per_shape)
        self._times[key] = times
        times.append(seconds)

    def recorded(self, threads: int) -> dict[Shape, int]:
        """How many recent times each shape holds at ``threads``."""
        return {shape: len(t) for (n, shape), t in self._times.items() if n == threads}

    def close_window(self, others: float) -> Window:
        """This window with ``others`` cores of other processes' use; starts the next."""
        window = Window(others, self._spent, self._before, self._matched)
        self._spent = self._before = 0.0
        self._matched = 0
        return window
