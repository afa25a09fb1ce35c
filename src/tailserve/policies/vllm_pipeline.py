"""vLLM's scheduler under pipeline parallelism (``--pipeline-parallel-size``, vLLM 0.32).

The engine core keeps ``max_concurrent_batches`` steps in flight (``EngineCore.step_with_batch_queue``,
``vllm/config/vllm.py:577-587@v0.32.0``): ``pp`` without async scheduling, ``pp + 1`` with it on
the V2 model runner (vLLM 0.32's default on a GPU with Triton, and with it async scheduling stays
on under pipeline parallelism: ``config/vllm.py:1634-1644``; on the V1 model runner,
``VLLM_USE_V2_MODEL_RUNNER=0``, it is turned off). The scheduler itself changes little:

- Without async scheduling a request's computed tokens advance when it is scheduled, so a
  decode whose step is still in a pipeline stage wants no token (``num_new_tokens == 0``) and is
  skipped (``scheduler.py:755-760``: "PP>1 and we have already scheduled all prompt tokens but
  they are not finished yet"), while a prompt's next chunk can go into the next micro-batch at
  once: the batches in flight hold disjoint decodes.
- With async scheduling (output placeholders) a decode could be scheduled in every step; the V2
  model runner's sampled-token ring needs ``pp`` steps between a request's decodes, so
  ``AsyncScheduler._update_after_schedule`` makes a request that samples eligible again only
  ``pp`` scheduling passes later (``next_decode_eligible_step = current_step + decode_stagger``,
  ``async_scheduler.py:52-57``), and the running pass skips it until then (``scheduler.py:680-684``).
  ``current_step`` counts every ``schedule()`` call, the empty ones included.

``DecodeStagger`` is that last rule; the rest is the advanced pass (``vllm_async.py``) and the
engine's batch queue (``core/engine.py``, ``Engine._step_pipelined``).
"""

from __future__ import annotations

from tailserve.core.request import Request
from tailserve.core.scheduler_output import SchedulerOutput


def max_concurrent_batches(pipeline_parallel_size: int, async_scheduling: bool) -> int:
    """``VllmConfig.max_concurrent_batches`` on the V2 model runner: the engine core's batch queue."""
    if async_scheduling:
        return pipeline_parallel_size + 1 if pipeline_parallel_size > 1 else 2
    return pipeline_parallel_size


class DecodeStagger:
    """``AsyncScheduler``'s decode stagger (V2 model runner, async scheduling, ``pp`` > 1)."""

    __slots__ = ("eligible", "pp", "step")

    def __init__(self, pp: int) -> None:
        self.pp = pp
        self.step = 0  # vLLM's ``current_step``: scheduling passes so far
        self.eligible: dict[Request, int] = {}  # ``next_decode_eligible_step`` (0 when absent)

    def begin_pass(self) -> None:
        self.step += 1

    def waits(self, request: Request) -> bool:
        """The running pass skips ``request`` this pass (its last decode was under ``pp`` ago)."""
        return self.step < self.eligible.get(request, 0)

    def scheduled(self, out: SchedulerOutput) -> None:
        """After the pass (``advance_scheduled`` has marked the chunks): every request that will
        sample is eligible again ``pp`` passes on."""
        due = self.step + self.pp
        eligible = self.eligible
        for item in out.scheduled:
            if not item.partial:
                eligible[item.request] = due

    def forget(self, finished: list[Request]) -> None:
        eligible = self.eligible
        for request in finished:
            eligible.pop(request, None)
