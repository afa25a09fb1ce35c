"""The adaptive thread count's decision (executors/pytorch/thread_policy.py) with injected
readings: others' CPU use per window and the controller's own step times, no wall clock.

The worlds below are a 2-core host. A local client's CPU use follows the engine's output (it
reads more beside one engine thread than beside two); a competitor keeps a core busy whatever
the engine does. Figures are the shapes of r41's readings, not measurements."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from tailserve.executors.pytorch.thread_policy import (
    MIN_MATCHED,
    PROBE_AFTER,
    PROBE_AFTER_MAX,
    SPAN,
    StepTimes,
    ThreadState,
    Window,
    decide,
    load_target,
    step_shape,
)
from tailserve.executors.pytorch.threads import CpuSample, ThreadController


@dataclass
class World:
    """Others' use of the cores and one decode step's time, each by the engine's thread count."""

    others: dict[int, float]
    step_s: dict[int, float]


CLIENT = World(others={1: 0.8, 2: 0.55}, step_s={1: 0.010, 2: 0.006})  # two threads win
# A client that reads over 2/3 of a core beside two threads too: only the probe's hold keeps them.
HEAVY_CLIENT = World(others={1: 0.85, 2: 0.75}, step_s={1: 0.010, 2: 0.006})
COMPETITOR = World(others={1: 1.0, 2: 0.67}, step_s={1: 0.010, 2: 0.030})  # a core taken
QUIET = World(others={1: 0.0, 2: 0.0}, step_s={1: 0.010, 2: 0.006})


class Engine:
    """A ThreadController stepped through windows of a world, on fake clocks."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, record_steps: bool = True) -> None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        self.t = self.busy = self.own = self.step_t = 0.0
        self.record_steps = record_steps
        self.c = ThreadController(
            max_threads=2, set_threads=lambda n: None, sample=self.sample, pin=False,
            clock=lambda: self.t, step_clock=lambda: self.step_t,
        )  # fmt: skip
        self.history: list[int] = []

    def sample(self) -> CpuSample:
        return CpuSample(self.t, self.busy, self.own)

    def window(self, world: World, steps: int = 10, batch: int = 8) -> None:
        """One 0.5 s window: ``steps`` decode steps of ``batch`` rows at the current count, then
        the window's CPU readings."""
        n = self.c.threads
        for _ in range(steps):
            self.c.begin_step()
            self.step_t += world.step_s[n]
            self.c.end_step(step_shape([1] * batch, [100] * batch) if self.record_steps else None)
        self.t += 0.5
        self.busy += 0.5 * (world.others[n] + n)
        self.own += 0.5 * n
        self.c.update_from(self.sample())
        self.history.append(self.c.threads)

    def run(self, world: World, windows: int) -> list[int]:
        start = len(self.history)
        for _ in range(windows):
            self.window(world)
        return self.history[start:]


def test_the_load_rule_alone_is_bistable_beside_a_client() -> None:
    # The r41 defect: each count is the load rule's own choice under the reading it causes.
    assert load_target(CLIENT.others[1], 2) == 1
    assert load_target(CLIENT.others[2], 2) == 2


def _runs(history: list[int]) -> list[tuple[int, int]]:
    """(count, windows) for each run of equal counts."""
    return [(n, len(list(g))) for n, g in itertools.groupby(history)]


def test_without_step_times_a_burst_leaves_it_at_one_thread_beside_a_client(monkeypatch) -> None:
    e = Engine(monkeypatch, record_steps=False)
    e.run(COMPETITOR, 1)  # a burst of other work
    history = e.run(CLIENT, 300)
    # Probes cannot show a gain without step times: two threads only while a probe runs (extended
    # to 2 spans for want of matched steps), each given up, the waits between them doubling.
    runs = _runs(history)[:-1]  # the last run may be cut short
    assert all(k == 2 * SPAN for n, k in runs if n == 2)
    assert [k for n, k in runs if n == 1][:5] == [PROBE_AFTER - 1, 8, 16, 32, 64]


def test_a_probe_recovers_two_threads_beside_a_client(monkeypatch) -> None:
    e = Engine(monkeypatch)
    e.run(CLIENT, 3)
    assert e.c.threads == 2  # started at two: the client's reading there allows them
    e.run(COMPETITOR, 1)
    assert e.c.threads == 1  # a burst: dropped at once
    history = e.run(CLIENT, 200)
    # Probed after PROBE_AFTER windows at one thread, kept, and no flapping under the steady client.
    assert history[:PROBE_AFTER] == [1] * (PROBE_AFTER - 1) + [2]
    assert set(history[PROBE_AFTER - 1 :]) == {2}
    assert e.c.num_changes == 2  # the drop and the probe


def test_a_probe_holds_two_threads_beside_a_client_the_load_rule_would_drop_them_for(monkeypatch) -> None:
    assert load_target(HEAVY_CLIENT.others[2], 2) == 1
    e = Engine(monkeypatch)
    first = e.run(HEAVY_CLIENT, 200)
    assert first[: PROBE_AFTER + 1] == [1] * PROBE_AFTER + [2]  # dropped, then probed
    assert set(first[PROBE_AFTER:]) == {2} and e.c.num_changes == 2  # held: no flapping
    assert e.c.state.proven_load == pytest.approx(HEAVY_CLIENT.others[2])


def test_a_steady_competitor_drops_it_at_once_and_is_never_probed(monkeypatch) -> None:
    e = Engine(monkeypatch)
    history = e.run(COMPETITOR, 200)
    assert history[0] == 1 and set(history) == {1}
    assert e.c.num_changes == 1


def test_a_probe_beside_a_misread_competitor_goes_back_and_backs_off(monkeypatch) -> None:
    # A competitor that reads under a whole core at one thread: probed, two threads run slower,
    # so the count goes back after the probe's span and each next probe waits twice as long.
    world = World(others={1: 0.85, 2: 0.7}, step_s={1: 0.010, 2: 0.030})
    e = Engine(monkeypatch)
    history = e.run(world, 300)
    assert history[0] == 1
    runs = _runs(history)
    assert all(k == SPAN for n, k in runs[:-1] if n == 2)  # one span each
    waits = [k for n, k in runs[:-1] if n == 1]
    assert waits[:5] == [PROBE_AFTER, 8, 16, 32, 64] and set(waits[4:]) == {PROBE_AFTER_MAX}
    assert history.count(2) <= SPAN * 8  # a failed probe costs SPAN windows in PROBE_AFTER_MAX


def test_a_held_count_drops_at_once_when_a_competitor_joins(monkeypatch) -> None:
    e = Engine(monkeypatch)
    e.run(HEAVY_CLIENT, PROBE_AFTER + 5)
    assert e.c.state.proven_load is not None and e.c.threads == 2
    # A competitor beside two threads and the client reads no more than the client's proven 0.75
    # plus 1/3 (the host is saturated): the steps, slower than at one thread, drop it.
    both = World(others={1: 1.6, 2: 0.9}, step_s={1: 0.012, 2: 0.030})
    assert e.run(both, 1) == [1]
    assert set(e.run(both, 100)) == {1}  # and it stays down: a core is taken


def test_a_held_count_drops_at_once_on_a_load_rise_without_step_times() -> None:
    s = ThreadState(threads=2, max_threads=2, proven_load=0.5, held=10)
    s = decide(s, Window(others=0.7))
    assert s.threads == 2 and s.held == 11  # within the proven reading: held
    s = decide(s, Window(others=0.9))
    assert s.threads == 1 and s.proven_load is None  # 0.4 cores above it: dropped


def test_a_held_count_returns_to_the_load_rule_when_the_client_stops(monkeypatch) -> None:
    e = Engine(monkeypatch)
    e.run(HEAVY_CLIENT, PROBE_AFTER + SPAN + 2)
    assert e.c.state.proven_load is not None
    e.run(QUIET, 1)
    assert e.c.threads == 2 and e.c.state.proven_load is None
    assert e.run(COMPETITOR, 1) == [1]  # the load rule again: drops on the reading alone


def test_a_probe_extends_while_no_step_shape_matches_then_gives_up() -> None:
    s = ThreadState(threads=2, max_threads=2, probing=1)
    for _ in range(SPAN):
        s = decide(s, Window(others=0.6))
    assert s.threads == 2 and s.probing == SPAN + 1  # a span without matched steps: extended
    for _ in range(SPAN):
        s = decide(s, Window(others=0.6))
    assert s.threads == 1 and s.probing == 0 and s.probe_after == 2 * PROBE_AFTER


def test_a_probe_keeps_the_thread_on_the_span_s_total_time() -> None:
    # Three windows of decodes 1.3x slower and one with a prefill 0.5x: 2 s of work took less.
    s = ThreadState(threads=2, max_threads=2, probing=1)
    for w in [Window(0.7, 0.013, 0.010, 5)] * 3 + [Window(0.9, 0.210, 0.400, 6)]:
        s = decide(s, w)
    assert s.threads == 2 and s.probing == 0 and s.proven_load == pytest.approx(0.75)


def test_a_held_count_drops_after_a_slower_span_or_at_once_on_a_much_slower_window() -> None:
    assert load_target(0.7, 2) == 1  # the load rule alone would not hold two threads
    slower = Window(0.7, 0.012, 0.010, 5)
    s = ThreadState(threads=2, max_threads=2, proven_load=0.6, held=PROBE_AFTER, probe_after=PROBE_AFTER)
    for _ in range(SPAN - 1):
        s = decide(s, slower)
    assert s.threads == 2
    s = decide(s, slower)  # the span's steps ran 1.2x: dropped; held long, so probed again soon
    assert s.threads == 1 and s.probe_after == PROBE_AFTER
    short = ThreadState(threads=2, max_threads=2, proven_load=0.6, held=1, probe_after=16)
    s = decide(short, Window(0.7, 0.030, 0.010, 5))  # 3x in one window: at once
    assert s.threads == 1 and s.probe_after == 32


def test_step_shapes_are_exact_when_small_and_within_a_quarter_octave_above() -> None:
    assert step_shape([1, 1], [10, 20]) == (2, 2, 5)
    assert (
        step_shape([1] * 9, [300] * 9) == step_shape([1] * 8, [300] * 8) != step_shape([1] * 10, [300] * 10)
    )
    assert step_shape([1] * 8 + [1800], [0] * 9) == step_shape([1] * 7 + [1800], [0] * 8)
    assert step_shape([1] * 4 + [1800], [0] * 5) != step_shape([1] * 4 + [1200], [0] * 5)
    assert step_shape([64], [0]) == (1, 7 * 4 + 0, 0)  # one row of 64 tokens: 2**6, next bits 00


def test_step_times_ratio_weighs_steps_by_their_time_and_needs_matched_shapes() -> None:
    times = StepTimes(per_shape=4, max_shapes=5)
    decode, prefill, other = (
        step_shape([1, 1], [10, 20]),
        step_shape([512], [0]),
        step_shape([1, 1], [300, 400]),
    )
    for _ in range(3):
        times.add(1, decode, 0.010)
    times.add(1, prefill, 0.200)
    assert times.close_window(0.0).ratio is None  # nothing at one thread fewer
    for _ in range(MIN_MATCHED - 1):
        times.add(2, decode, 0.005)
    times.add(2, other, 0.005)  # a shape never seen at one thread: not matched
    assert times.close_window(0.0).ratio is None
    for _ in range(MIN_MATCHED):
        times.add(2, decode, 0.012)  # decodes 1.2x slower on two threads
    times.add(2, prefill, 0.110)  # the prefill 0.55x
    window = times.close_window(0.5)
    assert window.ratio == pytest.approx((3 * 0.012 + 0.110) / (3 * 0.010 + 0.200)) and window.others == 0.5
    times.add(1, step_shape([64], [0]), 0.1)  # a sixth key: the least recently run, (1, decode), is forgotten
    for _ in range(MIN_MATCHED):
        times.add(2, decode, 0.005)
    assert times.close_window(0.0).ratio is None
    assert times.recorded(2) == {decode: 4, other: 1, prefill: 1}


def test_the_torch_executor_times_each_step_at_its_shape(tmp_path, monkeypatch) -> None:
    from tailserve.llm import LLM, SamplingParams
    from torch_helpers import micro_model

    e = Engine(monkeypatch)
    llm = LLM(str(micro_model(tmp_path)), dtype="float32", kv_cache_memory_gib=0.002)
    llm.engine.stop_checker.inner.threads = e.c  # an adaptive controller on fake clocks
    prompts = [[1, *range(5, 5 + n)] for n in (7, 20)]
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=4, ignore_eos=True))
    recorded = e.c.steps.recorded(2)
    # One prefill step of both prompts (8 + 21 tokens), then three decode steps of two rows.
    assert recorded[step_shape([8, 21], [0, 0])] == 1
    assert sum(n for (rows, new, _), n in recorded.items() if rows == new == 2) == 3
