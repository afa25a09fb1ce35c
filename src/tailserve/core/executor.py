"""The executor contract: run one ``SchedulerOutput``, report how long it took and what it sampled."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from tailserve.core.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from tailserve.executors.simulated.cost_model import CostModel


@dataclass(slots=True)
class StepResult:
    duration: float  # seconds the iteration took (predicted by a cost model, or measured)
    # Sampled token per request id; None for executors that produce no real tokens.
    token_ids: dict[str, int] | None = None
    # Requests that hit a stop condition (EOS, stop string) with this iteration's token.
    stopped: set[str] = field(default_factory=set)


class Executor(Protocol):
    # True for an executor that owns KV tensors and reads each scheduled request's block table
    # (``ScheduledRequest.block_ids``); the engine asks the scheduler for the tables only then,
    # so the simulator pays nothing for them. A wrapper forwards its inner executor's answer.
    needs_block_ids: bool
    # The cost model that prices this executor's iterations, for a policy that predicts them
    # (``slo``): the simulators' own, whose predictions *are* their iteration times
    # (``cost_model_exact``), or the real executor's calibration (``--calibration FILE``), an
    # estimate to correct from measured times; None when there is none. Wrappers forward both.
    cost_model: CostModel | None
    cost_model_exact: bool

    def execute(self, out: SchedulerOutput) -> StepResult: ...


@runtime_checkable
class DecodeRunExecutor(Executor, Protocol):
    """An executor whose iteration time depends only on the batch shape can predict a whole run
    of identical decode-only iterations at once (the simulator's exact fast path). The engine
    takes the decode fast path exactly for executors that implement this protocol
    (``isinstance``; ``SimExecutor`` does), never for a wrapper that hides it."""

    def decode_step_duration(self, num_decodes: int, num_context_tokens: int) -> float:
        """One such iteration; equal bit for bit to ``execute`` of that batch."""
        ...

    def decode_step_durations(self, num_decodes: int, num_context_tokens: int, num_steps: int) -> list[float]:
        """``decode_run_durations`` as a list (cheaper for a few steps); the same floats."""
        ...

    def decode_run_durations(self, num_decodes: int, num_context_tokens: int, num_steps: int) -> np.ndarray:
        """Durations (seconds) of ``num_steps`` decode iterations of ``num_decodes`` requests whose
        summed attention context is ``num_context_tokens`` in the first step and grows by
        ``num_decodes`` each step. Must equal step-by-step ``execute`` bit for bit."""
        ...
