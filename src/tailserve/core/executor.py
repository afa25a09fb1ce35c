"""The executor contract: run one ``SchedulerOutput``, report how long it took and what it sampled."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tailserve.core.scheduler_output import SchedulerOutput


@dataclass(slots=True)
class StepResult:
    duration: float  # seconds the iteration took (predicted by a cost model, or measured)
    # Sampled token per request id; None for executors that produce no real tokens.
    token_ids: dict[str, int] | None = None
    # Requests that hit a stop condition (EOS, stop string) with this iteration's token.
    stopped: set[str] = field(default_factory=set)
    # Speculative decoding: which of a stopped request's tokens this step is the stop (0: the
    # first; absent: the first), when a step samples several tokens for it.
    stop_index: dict[str, int] = field(default_factory=dict)
    # Speculative decoding: draft tokens accepted per request that verified drafts this step
    # (vLLM's rejection sampler: the request samples 1 + accepted tokens); None without drafts.
    num_accepted: dict[str, int] | None = None
    # Seconds of ``duration`` spent on the host (scheduling, input preparation, output
    # processing), which vLLM's async scheduling overlaps with the previous step's forward pass.
    host_time: float = 0.0
    # Pipeline parallelism: the forward pass's seconds on each stage, and the send between two
    # stages (the simulated executor's, executors/simulated/pipeline.py); None: one stage.
    stages: tuple[float, ...] | None = None
    stage_send: float = 0.0


_new = object.__new__


def step_result(duration: float) -> StepResult:
    """``StepResult(duration)``, the same object built without the class call (~4,000
    instructions: the dataclass's ``__init__`` entered from C, a ``set`` and a ``dict`` made by
    their factories): the simulator makes one per stepped iteration. Every field is set, the set
    and the dict new ones (``tests/test_speed_paths.py`` compares the two)."""
    result = _new(StepResult)
    result.duration = duration
    result.token_ids = None
    result.stopped = set()
    result.stop_index = {}
    result.num_accepted = None
    result.host_time = 0.0
    result.stages = None
    result.stage_send = 0.0
    return result


class Executor(Protocol):
    # True for an executor that owns KV tensors and reads each scheduled request's block table
    # (``ScheduledRequest.block_ids``); the engine asks the scheduler for the tables only then,
    # so the simulator pays nothing for them. A wrapper forwards its inner executor's answer.
    needs_block_ids: bool
    # Nothing else: a cost model for a policy that predicts iteration times is bound to the
    # policy by whoever assembles the engine (``executors/simulated/cost_binding.py``), and the
    # simulator's fast paths are its own driver around the engine (``.../simulated/driver.py``).

    def execute(self, out: SchedulerOutput) -> StepResult: ...
