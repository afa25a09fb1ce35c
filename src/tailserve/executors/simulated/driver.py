"""The simulator's loop around ``Engine``: a step, then the exact fast paths while one applies.

``Engine.step()`` is the only iteration and knows nothing of its executor. In virtual time,
though, long stretches of iterations are determined in advance — decodes repeating one batch
shape, a prompt chunked beside them, a prompt chunked alone — and the cost model can price them
all at once. ``SimDriver`` takes those stretches between steps (``decode_run.py`` with ``finish_run.py``,
``async_decode_run.py``, ``chunk_run.py``, ``prefill_run.py``), with results identical to plain stepping, when:

- ``EngineOptions.fast_forward`` is on (the default; ``--no-fast-forward`` steps everything);
- the policy signed the contracts (``fast_paths.FastPaths``; a policy without them is stepped);
- the engine runs one pipeline stage (every pipelined loop of ``Engine`` is stepped) and its fetch of new
  requests never waits (TensorRT-LLM's ``batch_wait_timeout_ms``: ``Engine._fetched``);
- the executor prices batch shapes alone: decode runs for any ``DecodeRunExecutor`` (not a
  ``SimExecutor`` of a sliding-window model, whose ``prices_shapes_alone`` is False), the chunk
  runs only for ``SimExecutor`` itself and without per-iteration records or checks (they price
  iterations from the cost model directly and record none);
- under vLLM's async scheduling (``Scheduler.async_scheduling``: each step scheduled before the
  previous one's outputs are applied; also TensorRT-LLM's and SGLang's overlap schedulers) only
  decode runs, by ``async_decode_run.py`` with that rule in closed form, for an
  ``AsyncDecodeRunExecutor``.

``run()`` is ``Engine.run`` with the fast paths after each step; a driver that steps the engine
itself (a cluster replica, advanced to the cluster's next event) calls ``fast_forward()`` after
each ``engine.step()``.
"""

from __future__ import annotations

from tailserve.core.engine import Engine
from tailserve.executors.simulated import async_decode_run, chunk_run, decode_run, prefill_run
from tailserve.executors.simulated.fast_paths import FastPaths


class SimDriver:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        options = engine.options
        policy = engine.scheduler.policy
        # Pipeline parallelism keeps several batches in flight through the stages (``Engine``'s
        # pipelined loops): no run has that rule, so every step is stepped.
        # So does TensorRT-LLM's fetch wait (``Engine._fetched``: every step may start late).
        stepped = engine.scheduler.pipeline_parallel_size > 1 or engine.scheduler.fetch_wait is not None
        fast = policy if options.fast_forward and isinstance(policy, FastPaths) and not stepped else None
        shapes_alone = getattr(engine.executor, "prices_shapes_alone", True)
        # Under async scheduling (vLLM's, or an overlap scheduler: TensorRT-LLM's, SGLang's)
        # outputs are applied a step late: only the async decode run has that rule; the
        # synchronous runs (decode, chunk, lone chunk) stay off.
        self._async = engine.scheduler.async_scheduling
        self._async_run_ok = (
            self._async
            and fast is not None
            and isinstance(engine.executor, async_decode_run.AsyncDecodeRunExecutor)
            and shapes_alone
        )
        self._decode_run_ok = (
            not self._async
            and fast is not None
            and isinstance(engine.executor, decode_run.DecodeRunExecutor)
            and shapes_alone
        )
        self._lone_run_ok = (
            not self._async
            and fast is not None
            and chunk_run.applies_to(engine.executor)
            and not options.record_batches
            and not options.check_integrity
        )
        self._chunk_run_ok = self._lone_run_ok and fast is not None and fast.chunk_run_budget() is not None

    def run(self) -> None:
        """Step until every request has left the engine, taking the fast paths between steps."""
        self.engine.run(after_step=self.fast_forward)

    def fast_forward(self) -> None:
        """Exact multi-iteration runs after a step, as long as one applies. A decode run leaves
        only decodes, so no chunk run can start after it; a chunk run that ends with the prompt's
        last chunk does too, so a decode run may follow it at once. A lone chunk run (SGLang's
        chunked request) stops before the prompt's last chunk, which steps."""
        engine = self.engine
        check = engine.options.check_integrity
        if self._async:
            # Module attributes, looked up per call, so a test can count the runs.
            if not (self._async_run_ok and async_decode_run.steady(engine)):
                return
            while async_decode_run.advance_async_decode_run(engine):
                if check:
                    engine.check_integrity()
                if not async_decode_run.steady_after_run(engine):
                    return
            return
        while True:
            decoded = False
            # Module attributes, looked up per call, so a test can count the runs.
            # After a run, ``steady_after_run``: a run keeps every request one token behind.
            while (
                self._decode_run_ok
                and (steady_after_run(engine) if decoded else steady(engine))
                and decode_run.advance_decode_run(engine)
            ):
                decoded = True
                if check:
                    engine.check_integrity()
            if decoded:
                return
            if self._chunk_run_ok and chunk_run.advance_chunk_run(engine):
                continue
            if not (self._lone_run_ok and prefill_run.advance_lone_chunk_run(engine)):
                return


def steady(engine: Engine) -> bool:
    """The next iterations repeat one decode-only iteration exactly: every running request is
    one token behind, and no waiting request can be admitted — none waits, or the last
    iteration was that same decode batch and admitted, preempted and finished nobody (free
    blocks only shrink while decoding, so a blocked head stays blocked)."""
    sched = engine.scheduler
    running = sched.running
    if not running or sched.swapped:
        return False
    # The O(1) test first: after most steps an arrival is already due.
    nxt = engine.source.next_arrival_time()
    if nxt is not None and nxt <= engine.clock.now:
        return False
    waiting = bool(sched.waiting)
    out = sched.last_output
    if waiting:
        if out is None or engine.last_step_finished or out.num_admitted or out.preempted:
            return False
        if out.padding or out.swapped_in or out.swapped_out or len(out.scheduled) != len(running):
            return False
    # Every request one token behind. Right after a step whose update found so (the clock
    # still at its time: any iteration or idle wait since moves it) the batch is not scanned
    # again: that scan of every request showed in each step that a decode run follows
    # (1.2% / 1.7% of the Sarathi / vLLM loop at 2,000 requests).
    if sched.one_behind_at != engine.clock.now:
        # Newest last: a prompt still being computed is found first from the end.
        for request in reversed(running):
            if request.prompt_len + request.num_output_tokens - request.num_computed_tokens != 1:
                return False
    if waiting:
        assert out is not None  # checked above
        for item in out.scheduled:
            if item.num_new_tokens != 1:
                return False
    policy = sched.policy
    assert isinstance(policy, FastPaths)  # the driver takes decode runs only for these
    return policy.can_fast_forward(sched)


def steady_after_run(engine: Engine) -> bool:
    """``steady`` right after a decode run, without its scans of the batch: the run gave every
    request it kept as many computed tokens as outputs (each is still one token behind), added
    nobody and left ``last_output`` (the step before it) as it was, so only the tests a run
    can change remain: requests left, an arrival came due, a request finished (with some
    waiting, one may now be admitted), the policy's own state."""
    sched = engine.scheduler
    if not sched.running:
        return False
    nxt = engine.source.next_arrival_time()
    if nxt is not None and nxt <= engine.clock.now:
        return False
    if sched.waiting and engine.last_step_finished:
        return False
    policy = sched.policy
    assert isinstance(policy, FastPaths)
    return policy.can_fast_forward(sched)
