"""Sarathi-Serve's pipelined engine (``sarathi/engine/pipeline_parallel_llm_engine.py``).

With ``pipeline_parallel_size`` > 1 Sarathi-Serve runs its schedulers — ``sarathi``, and the
``vllm`` and ``orca`` baselines its paper measured against, each re-implemented in its code base —
in ``PipelineParallelLLMEngine`` (``Engine._step_paused``). Its rules, as its code does them:

- **At most ``pp`` micro-batches in flight** (``BaseScheduler.schedule``: an empty output while
  ``num_running_batches >= pipeline_parallel_size``; the count drops when a batch's outputs are
  processed, ``on_step_completed``). An empty schedule takes no slot.
- **Only paused requests are scheduled**: a request is RUNNING from its schedule to its batch's
  outputs, PAUSED after; every scheduler's running pass skips one that is not paused
  (``if not seq.is_paused(): continue``). So a prompt's next chunk waits for its previous chunk
  to come out of the last stage — unlike vLLM V1, whose computed tokens advance at scheduling
  (``vllm_pipeline.py``) — and the micro-batches in flight hold disjoint requests.
- **The schedule loop runs on events**: a batch's outputs processed, stage 1 done with a
  micro-batch (the ``microbatch_socket`` signal), and a 10 ms timer (``SCHEDULER_LOOP_DELAY``).
  A request arriving while a slot is free waits for the first of these; after a launch the loop
  runs again at the first event after that schedule began (``Engine._next_event``).
- **Outputs are applied by their own thread** (``_output_loop``) when a batch leaves the last
  stage, stamped then, whatever the schedule loop is doing.
- **A victim may be in flight**: preemption takes the tail of the running list, which may be a
  request whose batch has not returned; its outputs are dropped when they come
  (``on_step_completed``: "seq is preempted ... might still be executing"), and its blocks are
  free at once (``Scheduler.preempt_by_recompute``).

Sarathi-Serve has no swap (``vllm-v0``'s ``preemption_mode=swap`` is refused under stages) and
needs the layers divisible by the stages (``assemble/build.py`` refuses the rest).

vLLM V0's own pipeline parallelism (one scheduler per virtual engine, ``--pipeline-parallel-size``
in vLLM 0.5.1-0.10) is a different engine and is not simulated: ``vllm-v0`` under pipeline stages
is vLLM's policy as the Sarathi-Serve paper ran it, in this engine.
"""

from __future__ import annotations

from typing import Any

# ``SCHEDULER_LOOP_DELAY``: seconds between the schedule loop's timer wake-ups.
SCHEDULE_TICK = 0.01


class PausedPipeline:
    """The pipeline-parallel side of a policy that Sarathi-Serve's engine runs (its config has
    ``pipeline_parallel_size``): the engine loop, its queue depth and its timer."""

    pipeline_engine = "sarathi"
    schedule_tick = SCHEDULE_TICK
    config: Any  # the policy's config, which has pipeline_parallel_size

    def pipeline_parallel_size(self) -> int:
        return self.config.pipeline_parallel_size

    def max_concurrent_batches(self) -> int:
        return self.config.pipeline_parallel_size
