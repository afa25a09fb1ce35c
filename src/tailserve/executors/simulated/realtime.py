"""The simulated executor as a live stand-in: each iteration takes the cost model's predicted
time on the wall clock and samples placeholder tokens (never EOS), so a client sees a GPU
server's pace without a GPU."""

from __future__ import annotations

import random
import time

from tailserve.core.executor import StepResult
from tailserve.core.scheduler_output import SchedulerOutput
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.cuda_graph import CudaGraphPadding
from tailserve.executors.simulated.executor import SimExecutor

BUSY_GAP_S = 0.005  # a gap shorter than this between iterations is engine overhead, not idleness


class RealtimeSimExecutor:
    needs_block_ids = False

    def __init__(
        self,
        cost_model: CostModel,
        block_size: int,
        vocab_size: int,
        special_ids: set[int],
        seed: int,
        graph: CudaGraphPadding | None = None,
    ) -> None:
        self.sim = SimExecutor(cost_model, block_size, graph=graph)  # graph: TensorRT-LLM's padding
        self._rng = random.Random(seed)
        self._tokens = [t for t in range(min(vocab_size, 4096)) if t not in special_ids and t > 2]
        self._last_end = 0.0  # perf_counter time the previous iteration was due to end

    @property
    def cost_model(self) -> CostModel:
        return self.sim.cost_model

    def execute(self, out: SchedulerOutput) -> StepResult:
        t0 = time.perf_counter()
        # Back to back iterations start when the previous one was due to end, so the engine's own
        # Python time between them is absorbed instead of added to the simulated GPU's pace.
        start = self._last_end if t0 - self._last_end < BUSY_GAP_S else t0
        predicted = self.sim.execute(out).duration
        token_ids = {
            s.request.request_id: self._rng.choice(self._tokens)
            for s in out.scheduled
            if s.num_context_tokens + s.num_new_tokens == s.request.num_tokens
        }
        self._last_end = start + predicted
        delay = self._last_end - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return StepResult(predicted, token_ids)
