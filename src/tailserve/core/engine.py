"""``Engine.step()``: schedule, execute, update — the only loop, for every executor.

The clock is virtual for the simulator (it jumps by each iteration's predicted duration, or to
the next arrival when idle) and the wall clock for a real executor. A policy with vLLM's async
scheduling (``Policy.async_scheduling``) is stepped the way vLLM's engine core steps it with a
batch queue of two: schedule a step while the previous one runs, then apply the previous one's
outputs (``Engine._step_async``; virtual time only). The engine never knows which
executor it drives: the simulator's exact fast paths are a driver around it
(``executors/simulated/driver.py``), which uses ``end_run``, ``next_wake`` and ``add_arrivals``
(and, under async scheduling, ``in_flight`` and ``end_async_run``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tailserve.core.executor import Executor, StepResult
from tailserve.core.finished_store import FinishedStore
from tailserve.core.gc_pause import paused_gc
from tailserve.core.iteration_log import BatchRecord, IterationLog
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import SchedulerOutput
from tailserve.core.source import RequestSource


class VirtualClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start  # seconds

    def advance(self, duration: float) -> None:
        self.now += duration

    def advance_to(self, t: float) -> None:
        """The end of a run of iterations the fast paths summed from this clock's time (set,
        not added: the run's own sums are the exact times stepping would reach)."""
        self.now = t

    def wait_until(self, t: float) -> None:
        if t > self.now:
            self.now = t


class WallClock:
    """Seconds since construction, read fresh every time: requests arrive while the engine
    computes, so an iteration must start at the real time, not at the end of the previous one."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()

    @property
    def now(self) -> float:
        return time.monotonic() - self._t0

    def advance(self, duration: float) -> None:
        """The time already passed while the executor ran."""

    def wait_until(self, t: float) -> None:
        delay = t - self.now
        if delay > 0:
            time.sleep(delay)


class EngineStalledError(RuntimeError):
    """Unfinished requests, nothing schedulable and nothing left to wait for."""


@dataclass(frozen=True, slots=True)
class EngineOptions:
    # Exact skipping of determined runs of iterations: read by the simulator's driver
    # (``executors/simulated/driver.py``); the engine itself always steps.
    fast_forward: bool = True
    check_integrity: bool = False  # check KV and request invariants after every iteration
    record_batches: bool = False  # keep a BatchRecord (who ran with how many tokens), for explain
    # The per-iteration log is the simulator's output; a live engine that runs for days and
    # never reads it turns it off (~150 bytes an iteration otherwise).
    keep_iteration_log: bool = True
    # Bounded memory for very long runs: each finished request's numbers go into a
    # ``FinishedStore`` (arrays) and the Request object is dropped, the iteration log is kept in
    # typed arrays. ``Engine.requests`` is then empty; ``metrics.summary`` reads the store.
    stream_finished: bool = False


@dataclass(slots=True)
class InFlight:
    """A step launched under async scheduling whose outputs are not applied yet."""

    out: SchedulerOutput
    result: StepResult
    start: float  # seconds: its forward pass begins
    end: float  # seconds: its forward pass ends, and its outputs are known


@dataclass(slots=True)
class Queued:
    """A batch in the engine core's queue under pipeline parallelism, its outputs not applied
    yet; vLLM queues the empty batches of a pass that scheduled nothing too (``out`` None)."""

    out: SchedulerOutput | None
    result: StepResult | None
    end: float  # seconds: its last stage ends (an empty one: the batches before it are through)
    first: float = 0.0  # seconds: stage 1 is done with it (Sarathi-Serve's micro-batch signal)


class Engine:
    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        source: RequestSource,
        clock: VirtualClock | WallClock | None = None,
        options: EngineOptions = EngineOptions(),
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.source = source
        self.clock = clock if clock is not None else VirtualClock()
        self.options = options
        self.log = IterationLog(scheduler.kv_cache.num_blocks, compact=options.stream_finished)
        self.finished_store = (
            FinishedStore(stream=scheduler.policy.stream_interval()) if options.stream_finished else None
        )
        kv = scheduler.kv_cache
        self.batches = BatchRecord(kv.num_blocks, kv.block_size) if options.record_batches else None
        self.num_requests_seen = 0
        self._block_ids = executor.needs_block_ids
        self._last_step_finished = True
        self._async = scheduler.async_scheduling
        if self._async and not isinstance(self.clock, VirtualClock):
            raise ValueError("async scheduling is simulated in virtual time only (the simulated executor)")
        self._in_flight: InFlight | None = None
        self._device_free_at = self.clock.now  # async: when the last launched forward pass ends
        # Pipeline parallelism (the pipelined loops below): the batches in flight, newest first
        # (vLLM's batch queue, Sarathi-Serve's), and when each stage is next free.
        self._pp = scheduler.pipeline_parallel_size
        self._depth = scheduler.max_concurrent_batches
        self._queue: deque[Queued] = deque()
        # TensorRT-LLM's fetch wait under way (``_fetched``): [requests seen before, deadline]
        self._fetch_wait: list | None = None
        self._stage_free = [self.clock.now] * self._pp
        # The loop that runs the batches through the stages (``Policy.pipeline_engine``): vLLM's
        # batch queue, Sarathi-Serve's pipelined engine or TensorRT-LLM's micro-batch ring.
        policy = scheduler.policy
        self._pipelined = {
            "vllm": self._step_pipelined,
            "sarathi": self._step_paused,
            "trtllm": self._step_ring,
        }[policy.pipeline_engine]
        # Sarathi-Serve's: its timer, and when its schedule loop runs next after a launch (None:
        # at the next step). TensorRT-LLM's: the slots and the one whose turn it is.
        self._tick = policy.schedule_tick
        self._due: float | None = None
        self._slots: list[Queued | None] = [None] * self._depth if policy.pipeline_engine == "trtllm" else []
        self._slot = 0
        if self._pp > 1 and not isinstance(self.clock, VirtualClock):
            raise ValueError(
                "pipeline parallelism is simulated in virtual time only (the simulated executor)"
            )
        if scheduler.fetch_wait is not None and not isinstance(self.clock, VirtualClock):
            # A live engine takes its requests between steps: the wait would be a blind sleep.
            raise ValueError(
                "batch_wait_timeout_ms is simulated in virtual time only (simulate, tune): a served "
                "engine takes new requests between steps"
            )

    def step(self) -> bool:
        """Run one iteration (or wait for the next arrival); False once everything is done."""
        if self._pp > 1:
            return self._pipelined()
        if self._async:
            return self._step_async()
        if self.scheduler.fetch_wait is not None and not self._fetched():
            return True  # the fetch waits on past the cluster's next event
        pending = self.schedule_step()
        if pending is None:
            return self._idle()
        self.complete_step(pending, self.executor.execute(pending[0]))
        return True

    def schedule_step(self) -> tuple[SchedulerOutput, float, int, bool] | None:
        """An iteration's first half: arrivals added, the batch scheduled. Returns (the batch,
        its start, the KV blocks used before it ran, whether the policy aborted requests), or
        None when nothing was scheduled. ``step`` runs it, then the executor, then
        ``complete_step``; a driver that times several engines' batches together (the
        data-parallel group, cluster/dp_group.py) calls the halves itself."""
        if self._pp > 1:
            raise ValueError(
                "pipeline parallelism is not simulated for engines whose steps are timed together"
            )
        if self._async:
            raise ValueError(
                "async scheduling is not simulated for engines whose steps are timed together "
                "(an MoE model's data-parallel ranks, --dp)"
            )
        sched = self.scheduler
        start = self.clock.now
        self.add_arrivals(start)
        out, ended = self._schedule(start)
        if out.is_empty:
            self._last_step_finished = ended
            return None
        if self._block_ids:
            sched.add_block_ids(out)
        return out, start, sched.kv_cache.used_block_count(), ended

    def complete_step(self, pending: tuple[SchedulerOutput, float, int, bool], result: StepResult) -> None:
        """An iteration's second half: the clock moves by its duration, the scheduler updates."""
        out, start, num_used_blocks, ended = pending
        sched = self.scheduler
        self.clock.advance(result.duration)
        now = self.clock.now
        finished = sched.update(out, result, now)
        if self.options.keep_iteration_log:
            num_prefill, num_decode = out.token_counts()
            self.log.record(
                start,
                now - start,
                num_prefill,
                num_decode,
                len(out.scheduled),
                num_used_blocks,
                len(out.preempted) + len(out.swapped_out),
            )
        if self.batches is not None:
            self.batches.record(start, now - start, out, num_used_blocks, sched)
        self.finish_step(finished, now)
        self._last_step_finished |= ended
        if self.options.check_integrity:
            self.check_integrity()

    def _step_async(self) -> bool:
        """One step of vLLM's async scheduling (``EngineCore.step_with_batch_queue``, a queue of
        two): schedule this step, launch it, then wait for the previous step and apply its
        outputs (``Scheduler.update``), so each step is decided before the previous one's tokens
        are known (the policy's output placeholders). In virtual time: a step's host part
        (``StepResult.host_time``: scheduling, input preparation) starts when it is scheduled,
        its forward pass when the device is free and the host part is done, and the previous
        step's outputs arrive (its tokens stamped, the next step scheduled) when its forward
        pass ends. The first step of a busy stretch has nothing to wait for: the next one is
        scheduled once its host part is done."""
        sched = self.scheduler
        if sched.fetch_wait is not None and not self._fetched():
            return True  # the fetch waits on past the cluster's next event
        start = self.clock.now
        self.add_arrivals(start)
        out, ended = self._schedule(start)
        previous, self._in_flight = self._in_flight, None
        host = 0.0
        if out.is_empty:
            if previous is None:
                self._last_step_finished = ended
                return self._idle()
        else:
            num_used_blocks = sched.kv_cache.used_block_count()
            result = self.executor.execute(out)
            host = result.host_time
            begin = max(self._device_free_at, start + host)
            end = begin + (result.duration - host)
            self._device_free_at = end
            self._in_flight = InFlight(out, result, begin, end)
            self._record(out, begin, end, num_used_blocks)
        finished: list[Request] = []
        if previous is None:
            self.clock.advance(host)
            now = self.clock.now
        else:
            now = max(previous.end, start)  # (a fetch that waited may have outlasted it)
            self.clock.advance_to(now)  # type: ignore[union-attr]  # a VirtualClock (__init__)
            finished = sched.update(previous.out, previous.result, now)
        self.finish_step(finished, now)
        self._last_step_finished |= ended
        if self.options.check_integrity:
            self.check_integrity()
        return True

    def _fetched(self) -> bool:
        """TensorRT-LLM's request fetch with ``batch_wait_timeout_ms`` (``Scheduler.fetch_wait``,
        ``ExecutorRequestQueue._get_from_request_queue``), at a step's start: it takes the
        requests that have arrived (an idle engine blocks for the first); with fewer than
        ``max_batch_size`` it then waits, up to the timeout, until that many have. Decoding
        steps wait too. The clock ends where the step starts, the arrivals added; True then.
        False when the wait reached the source's horizon (a cluster's next event, where more
        requests may be routed here) unfinished: the next step goes on with the same fetch."""
        timeout, cap = self.scheduler.fetch_wait  # type: ignore[misc]
        source = self.source
        fetch = self._fetch_wait
        if fetch is None:
            fetch = self._fetch_wait = [self.num_requests_seen, None]  # (seen before, deadline)
        at_horizon = getattr(source, "horizon", None) is not None
        while True:
            now = self.clock.now
            self.add_arrivals(now)
            got = self.num_requests_seen - fetch[0]
            deadline = fetch[1]
            if deadline is None:
                if got == 0 and not self.scheduler.has_unfinished:
                    until = source.next_arrival_time()  # idle: block for the first
                    if until is None:
                        break  # nothing to fetch: the engine idles or ends
                else:
                    deadline = fetch[1] = now + timeout
            if deadline is not None:
                if got >= cap or now >= deadline:
                    break
                until = source.next_arrival_time()
                if until is None or until > deadline:
                    until = deadline
            if until <= now:  # the source's horizon, nothing arrived: the cluster routes first
                if at_horizon:
                    return False
                break
            self.clock.wait_until(until)
        self._fetch_wait = None
        return True

    def _step_pipelined(self) -> bool:
        """One call of vLLM's ``EngineCore.step_with_batch_queue`` under pipeline parallelism
        (``policies/vllm_pipeline.py``): schedule a batch while the queue has room (an empty one
        is queued too), and return at once unless the queue is full or nothing is left to
        schedule; then wait for the oldest batch and apply its outputs. In virtual time a
        batch's host part starts when it is scheduled, stage 1 when that is done, the stage is
        free and (async scheduling) the tokens its decodes continue from are back, and each
        later stage when the one before has sent its activations and the stage is free
        (``StepResult.stages``, ``stage_send``; the receiving stage takes the send after its
        previous batch, vLLM's ``irecv`` being posted in its own ``execute_model``): stage k works
        on one batch while stage k + 1 works on the batch before. An empty schedule with no batch in flight waits for the next
        arrival, where vLLM spins."""
        sched, queue = self.scheduler, self._queue
        start = self.clock.now
        self.add_arrivals(start)
        if sched.has_unfinished:
            out, ended = self._schedule(start)
            if out.is_empty:
                if all(q.out is None for q in queue):
                    queue.clear()
                    self._last_step_finished = ended
                    return self._idle()
                queue.appendleft(Queued(None, None, max(start, queue[0].end)))
            else:
                queue.appendleft(self._launch(out, start))
            self._last_step_finished |= ended
            if len(queue) < self._depth and (queue[0].out is not None or sched.has_unfinished):
                launched = queue[0].result
                if launched is not None:
                    self.clock.advance(launched.host_time)
                return True
        elif not queue:
            return self._idle()
        oldest = queue.pop()
        now = max(self.clock.now, oldest.end)
        self.clock.advance_to(now)  # type: ignore[union-attr]  # a VirtualClock (__init__)
        finished: list[Request] = []
        if oldest.out is not None:
            assert oldest.result is not None
            finished = sched.update(oldest.out, oldest.result, now)
        self.finish_step(finished, now)
        if self.options.check_integrity:
            self.check_integrity()
        return True

    def _step_paused(self) -> bool:
        """One pass of Sarathi-Serve's ``PipelineParallelLLMEngine`` (``policies/sarathi_pipeline.py``).
        Its output thread applies a batch's outputs when the batch leaves the last stage (stamped
        then, whatever the schedule loop is doing), which wakes the schedule loop. The schedule
        loop runs on events — an output, stage 1 done with a micro-batch, its 10 ms timer — and,
        with fewer than ``pp`` batches in flight, schedules (the requests of the batches in flight
        are not schedulable: ``Scheduler.batch_of``) and launches a batch through the stages as
        ``_launch`` times them; an empty schedule takes no slot. After a launch it runs again at
        the first event after that schedule began (at once if one came while it scheduled)."""
        sched, queue = self.scheduler, self._queue
        now = self.clock.now
        while queue and queue[-1].end <= now:  # out while the loop was scheduling
            self._returned(queue.pop(), at_end=True)
            self._due = None  # the output set the schedule event: the loop runs again at once
        self.add_arrivals(now)
        free_slot = len(queue) < self._depth
        if self._due is not None and self._due <= now:
            self._due = None  # the event the schedule loop waited for has come
        if free_slot and sched.has_unfinished and self._due is None:
            batch = self._schedule_launch(now)
            if batch is not None:
                queue.appendleft(batch)
                host = batch.result.host_time  # type: ignore[union-attr]  # launched
                self._due = max(self._next_event(now), now + host)
                self.clock.advance(host)
                return True
        if not queue:
            self._due = None
            return self._idle(self._tick)
        oldest = queue[-1]
        t = oldest.end
        if free_slot:
            due = self._due
            if due is not None and due < t:
                t = due
            wake = self.next_wake(now)  # an arrival, or the policy's wake-up
            if wake is not None and now < wake < t:
                seen = next_tick(wake, self._tick)  # seen at the schedule loop's next event
                for q in queue:
                    if wake <= q.first < seen:
                        seen = q.first
                if seen < t:
                    t = seen
        if t < oldest.end:
            self.clock.advance_to(max(t, now))  # type: ignore[union-attr]  # a VirtualClock (__init__)
            return True
        queue.pop()
        self._returned(oldest)
        self._due = None  # its output wakes the schedule loop
        return True

    def _next_event(self, start: float) -> float:
        """Sarathi-Serve's schedule loop, having begun a schedule at ``start``: the first event
        after it — a timer tick, stage 1 done with a batch in flight, a batch's outputs."""
        tick = self._tick
        t = next_tick(start, tick)
        if t <= start:
            t += tick
        for q in self._queue:
            if start < q.first < t:
                t = q.first
            if start < q.end < t:
                t = q.end
        return t

    def _step_ring(self) -> bool:
        """One iteration of TensorRT-LLM's ``PyExecutor._executor_loop_pp`` (1.2): fetch, schedule
        into this iteration's micro-batch slot — the requests of the batches in flight skipped
        (``inflight_req_ids``) — and launch it through the stages (``_launch``); then, if the next
        slot holds a batch (the oldest in flight), wait for it and apply its outputs; the slot
        turn moves on. An empty schedule leaves its slot empty and the loop goes on at once, so
        a request arriving while the engine waits on a batch is fetched only after it."""
        sched, slots = self.scheduler, self._slots
        now = self.clock.now
        self.add_arrivals(now)
        i = self._slot
        if sched.has_unfinished:
            batch = self._schedule_launch(now)
            if batch is not None:
                assert slots[i] is None  # its batch was applied at the turn before
                slots[i] = batch
                self.clock.advance(batch.result.host_time)  # type: ignore[union-attr]  # launched
        j = self._slot = (i + 1) % len(slots)
        oldest = slots[j]
        if oldest is None:
            if any(slots):  # a batch launched now, or others in flight
                return True  # the loop turns to the next slot at once
            return self._idle()  # nothing in flight: the fetch blocks for a request
        slots[j] = None
        self._returned(oldest)
        return True

    def _schedule_launch(self, now: float) -> Queued | None:
        """A paused-request pipelined engine's schedule at ``now`` (``_step_paused``,
        ``_step_ring``): the requests the policy aborted leave; unless it is empty, the batch is
        launched through the stages and its requests marked in flight (``Scheduler.launched``)."""
        out, ended = self._schedule(now)
        self._last_step_finished |= ended
        if out.is_empty:
            return None
        batch = self._launch(out, now)
        self.scheduler.launched(out)
        return batch

    def _schedule(self, now: float) -> tuple[SchedulerOutput, bool]:
        """The policy's batch at ``now``, and whether it aborted requests while scheduling (they
        have left: the source is told)."""
        finished = self.scheduler.finished
        num_left = len(finished)
        out = self.scheduler.schedule(now)
        if len(finished) == num_left:
            return out, False
        for request in finished[num_left:]:
            self.source.on_finish(request, now)
        return out, True

    def _returned(self, batch: Queued, at_end: bool = False) -> None:
        """A pipelined engine's batch is out of the last stage: its outputs applied, its requests
        schedulable again (``Scheduler.batch_of``). At the clock (moved to the batch's end if that
        is later: the loop waited for it), or ``at_end``: at the batch's end, the clock past it
        already (Sarathi-Serve's output thread, which does not wait for the schedule loop)."""
        sched = self.scheduler
        if at_end:
            now = batch.end
        else:
            now = max(self.clock.now, batch.end)
            self.clock.advance_to(now)  # type: ignore[union-attr]  # a VirtualClock (__init__)
        out = batch.out
        assert out is not None and batch.result is not None  # these loops queue no empty batch
        finished = sched.update(out, batch.result, now)
        sched.returned(out)
        self.finish_step(finished, now)
        if self.options.check_integrity:
            self.check_integrity()

    def _launch(self, out: SchedulerOutput, start: float) -> Queued:
        """Run ``out`` through the stages (every pipelined loop) and log it."""
        sched = self.scheduler
        num_used_blocks = sched.kv_cache.used_block_count()
        result = self.executor.execute(out)
        stages = result.stages
        if stages is None or len(stages) != self._pp:
            raise ValueError(
                f"the policy runs {self._pp} pipeline stages but the executor priced "
                f"{1 if stages is None else len(stages)} (give the deployment --pipeline-parallel-size {self._pp})"
            )
        t = start + result.host_time
        if sched.async_scheduling:
            # A decode continues from the token its step pp passes ago samples (the V2 model
            # runner's sampled-token ring): stage 1 waits for that step's end.
            mine = {s.request for s in out.scheduled}
            for q in self._queue:
                if (
                    q.out is not None
                    and q.end > t
                    and any(not s.partial and s.request in mine for s in q.out.scheduled)
                ):
                    t = q.end
        free = self._stage_free
        send = result.stage_send
        begin = t
        for k, seconds in enumerate(stages):
            if free[k] > t:
                t = free[k]
            if k:
                # The stage receives (and its TP ranks all-gather) the activations in its own
                # execute_model for this batch, after its previous batch: not overlapped.
                t += send
            else:
                begin = t
            t += seconds
            free[k] = t
        self._record(out, begin, t, num_used_blocks)
        return Queued(out, result, t, free[0])

    def _record(self, out: SchedulerOutput, begin: float, end: float, num_used_blocks: int) -> None:
        """A launched batch's row in the iteration log (and batch record) of the overlapped loops
        (``_step_async``, ``_launch``): its forward pass (a micro-batch's trip) from ``begin`` to ``end``."""
        if self.options.keep_iteration_log:
            num_prefill, num_decode = out.token_counts()
            self.log.record(
                begin,
                end - begin,
                num_prefill,
                num_decode,
                len(out.scheduled),
                num_used_blocks,
                len(out.preempted),
            )
        if self.batches is not None:
            self.batches.record(begin, end - begin, out, num_used_blocks, self.scheduler)

    @property
    def last_step_finished(self) -> bool:
        """Whether the last step (or run) finished or aborted a request: a waiting request
        may then be admitted, so the next iterations are not a repeat of the last."""
        return self._last_step_finished

    def end_run(self, finished: list[Request], end: float) -> None:
        """After a driver applied a run of iterations (``Scheduler.update_run``): the clock
        moves to the run's end, where the requests it completed finish."""
        assert isinstance(self.clock, VirtualClock), "the exact fast paths run in virtual time"
        self.clock.advance_to(end)
        if finished:
            self.scheduler.finish(finished, end)
        self.finish_step(finished, end)

    @property
    def in_flight(self) -> InFlight | None:
        """Async scheduling: the step launched and not yet applied (None otherwise, or idle)."""
        return self._in_flight

    def end_async_run(self, launched: InFlight, now: float, finished: list[Request]) -> None:
        """After a driver applied a run of async steps (``Scheduler.update_async_run``): the
        run's last step, ``launched``, stays in flight (the device busy until its end), and the
        clock moves to ``now``, the end of the step before it, whose outputs the run applied
        last and where the requests they completed finish."""
        self.keep_in_flight(launched)
        self.end_run(finished, now)

    def keep_in_flight(self, launched: InFlight) -> None:
        """A driver's run of async steps left ``launched`` running (the device busy until its
        end); the clock and the finishes are the driver's (``end_async_run``, or ``end_run``
        where a chain of runs finished its requests as it went)."""
        self._in_flight = launched
        self._device_free_at = launched.end

    def finish_step(self, finished: list[Request], now: float) -> None:
        for request in finished:
            self.source.on_finish(request, now)
        self._last_step_finished = bool(finished)
        if finished and self.finished_store is not None:
            self.finished_store.add(self.scheduler.pop_finished())

    def run(self, after_step: Callable[[], None] | None = None) -> None:
        """Step until every request has left the engine. ``after_step``: called after each step
        that ran (the simulator's driver takes its exact fast paths there)."""
        with paused_gc():
            if after_step is None:
                while self.step():
                    pass
            else:
                while self.step():
                    after_step()
        store, sched = self.finished_store, self.scheduler
        if store is not None and sched.finished:  # rejected at the last arrivals
            store.add(sched.pop_finished())

    def next_wake(self, now: float) -> float | None:
        """When the next thing outside the iterations happens: an arrival or the policy's own
        wake-up, whichever comes first; None when neither is known. A driver's run stops there."""
        wake = self.source.next_arrival_time()
        policy_wake = self.scheduler.next_wakeup(now)
        if policy_wake is not None and (wake is None or policy_wake < wake):
            wake = policy_wake
        fetch = self._fetch_wait
        if fetch is not None:  # a fetch stopped at a horizon ends by its deadline (now: not yet set)
            ends = fetch[1] if fetch[1] is not None else now
            if wake is None or ends < wake:
                wake = ends
        return wake

    def add_arrivals(self, now: float) -> None:
        """Add the requests that arrived by ``now`` (public: a driver's run adds them inside it)."""
        finished = self.scheduler.finished
        for request in self.source.pop_arrived(now):
            self.num_requests_seen += 1
            num_left = len(finished)
            self.scheduler.add_request(request, now)
            if len(finished) != num_left:
                # The arrival refused, or a waiting request it pushed out (SGLang's full queue
                # under priority scheduling): either has left.
                for done in finished[num_left:]:
                    self.source.on_finish(done, now)

    def _idle(self, tick: float = 0.0) -> bool:
        """Wait for the next arrival or policy wake-up (seen at the next ``tick`` of a schedule
        loop that wakes on a timer, Sarathi-Serve's pipelined engine); False once all is done."""
        sched = self.scheduler
        now = self.clock.now
        arrival = self.source.next_arrival_time()
        if arrival is not None and arrival <= now:
            return True  # released during this step (a closed-loop client): add it next step
        wakeup = sched.next_wakeup(now)
        wake = [t for t in (arrival, wakeup) if t is not None]
        if not wake:
            if sched.has_unfinished:
                raise EngineStalledError(
                    f"{len(sched.waiting)} waiting and {len(sched.running)} running requests, "
                    f"but the policy schedules nothing and no arrival is pending "
                    f"({sched.describe_policy()})"
                )
            return False
        t = min(wake)
        if tick:
            t = next_tick(t, tick)
        if t <= now and isinstance(self.clock, VirtualClock):
            # Arrivals up to now were already added: a wake-up now that schedules nothing
            # would repeat forever.
            raise EngineStalledError(
                f"the policy asked to be woken at t={t} but scheduled nothing at t={now} "
                f"({sched.describe_policy()})"
            )
        self.clock.wait_until(t)
        return True

    def check_integrity(self) -> None:
        """KV blocks conserved; finished requests hold none (but a P/D prefill side's, until
        sent); every request is somewhere."""
        sched = self.scheduler
        kv = sched.kv_cache
        kv.check_integrity()
        held = sched.held.requests if sched.held is not None else {}
        for request in sched.finished:
            if kv.num_held(request.request_id) and request.request_id not in held:
                raise AssertionError(f"finished request {request.request_id} still holds KV blocks")
            if not request.is_finished:
                raise AssertionError(f"request {request.request_id} left with status {request.status}")
        for request in sched.waiting:
            if request.is_finished:
                raise AssertionError(f"waiting request {request.request_id} is {request.status}")
        for request in sched.swapped:
            if not kv.is_swapped(request.request_id) or kv.num_held(request.request_id):
                raise AssertionError(f"swapped request {request.request_id} does not hold exactly CPU blocks")
        accounted = len(sched.finished) + sched.num_released
        for request in sched.loading:
            if request.is_finished or not kv.num_held(request.request_id):
                raise AssertionError(
                    f"loading request {request.request_id} holds no KV or is {request.status}"
                )
        accounted += len(sched.waiting) + len(sched.running) + len(sched.swapped) + len(sched.loading)
        if accounted != self.num_requests_seen:
            raise AssertionError(
                f"{self.num_requests_seen} requests entered but {accounted} are accounted for"
            )

    @property
    def requests(self) -> list[Request]:
        return self.scheduler.finished


def next_tick(t: float, tick: float) -> float:
    """A timer's first wake-up at or after ``t``, its wake-ups taken at whole multiples of
    ``tick`` seconds from the engine's start (a real timer thread drifts by its own work)."""
    return max(t, math.ceil(t / tick - 1e-9) * tick)
