"""Predicted iteration times for the ``slo`` policy: the engine's own cost model, a calibrated
one corrected by measured times, or one learned from the iterations the engine ran.

The cost model is the one the engine was assembled with (``SloPolicy.bind_cost_model``, called
through ``executors/simulated/cost_binding.py``):

- An exact one (the simulator's, calibrated however the deployment was, and the stand-in
  server's real-time simulator): a prediction is ``CostModel.iteration_time``
  of the batch shape, which is what the iteration will take.
- An estimate (the real PyTorch executor built with ``--calibration FILE`` from ``tailserve
  calibrate --executor torch``): the cost model's prediction times a correction, the
  ``RATIO_QUANTILE`` quantile of the ratio of measured period to prediction over the last
  ``RATIO_WINDOW`` iterations (1 until ``MIN_RATIO_OBSERVATIONS``), so it predicts from the first
  iteration and follows the machine's present speed (other load, thread count) without losing
  the calibrated shape. A quantile above the median because the policy fills each iteration to
  its TBT slack: with a median correction half the iterations would overrun it.
- None (the real executor without a calibration): a linear model ``a + b*tokens +
  c*prefill_pairs + d*decode_kv_tokens`` fitted by least squares to the measured periods,
  refitted every ``REFIT_EVERY`` iterations. Until ``MIN_OBSERVATIONS`` iterations were seen it
  predicts 0, so the policy schedules like one without deadlines until it knows its machine.

A period is one iteration's start to the next's: what a request actually waits.

A batch is described by running aggregates (``BatchLoad``), so the policy can price "this batch
plus one more chunk" cheaply while it builds the batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from tailserve.core.scheduler_output import SchedulerOutput
from tailserve.executors.simulated.cost_model import BatchShape, CostModel

MIN_OBSERVATIONS = 16
REFIT_EVERY = 32
MAX_OBSERVATIONS = 4096  # the fit keeps the most recent iterations
RATIO_WINDOW = 64  # iterations the calibrated model's correction is the median over
MIN_RATIO_OBSERVATIONS = 4
RATIO_QUANTILE = 0.9


@dataclass(slots=True)
class BatchLoad:
    """The cost model's aggregates of a batch being built (see ``BatchShape``)."""

    num_tokens: int = 0
    num_logits: int = 0
    prefill_pairs: int = 0
    prefill_kv_tokens: int = 0
    decode_kv_tokens: int = 0
    num_prefills: int = 0
    num_decodes: int = 0

    def add_decodes(self, num_decodes: int, num_context_tokens: int) -> None:
        """``num_decodes`` decodes whose contexts sum to ``num_context_tokens``: one call for a
        batch of them (a call per decode per iteration showed)."""
        self.num_tokens += num_decodes
        self.num_logits += num_decodes
        self.decode_kv_tokens += num_context_tokens + num_decodes
        self.num_decodes += num_decodes

    def add_chunk(self, num_new_tokens: int, num_context_tokens: int, samples: bool) -> None:
        (
            self.num_tokens,
            self.num_logits,
            self.prefill_pairs,
            self.prefill_kv_tokens,
            self.decode_kv_tokens,
            self.num_prefills,
            self.num_decodes,
        ) = self.fields_with(num_new_tokens, num_context_tokens, samples)

    def fields_with(
        self, num_new_tokens: int, num_context_tokens: int, samples: bool
    ) -> tuple[int, int, int, int, int, int, int]:
        """The aggregates with one more scheduled entry (``BatchShape``'s fields, in its order):
        one new token is a decode, more a prefill chunk; ``samples``: it yields a token."""
        q, c = num_new_tokens, num_context_tokens
        if q == 1:
            return (
                self.num_tokens + 1,
                self.num_logits + samples,
                self.prefill_pairs,
                self.prefill_kv_tokens,
                self.decode_kv_tokens + c + 1,
                self.num_prefills,
                self.num_decodes + 1,
            )
        return (
            self.num_tokens + q,
            self.num_logits + samples,
            self.prefill_pairs + q * c + q * (q + 1) // 2,
            self.prefill_kv_tokens + q + c,
            self.decode_kv_tokens,
            self.num_prefills + 1,
            self.num_decodes,
        )

    def with_chunk(self, num_new_tokens: int, num_context_tokens: int, samples: bool) -> BatchShape:
        return BatchShape(*self.fields_with(num_new_tokens, num_context_tokens, samples))

    def shape(self) -> BatchShape:
        return BatchShape(
            self.num_tokens,
            self.num_logits,
            self.prefill_pairs,
            self.prefill_kv_tokens,
            self.decode_kv_tokens,
            self.num_prefills,
            self.num_decodes,
        )

    @staticmethod
    def of(out: SchedulerOutput) -> BatchLoad:
        load = BatchLoad()
        for s in out.scheduled:
            samples = s.num_context_tokens + s.num_new_tokens == s.request.num_tokens
            load.add_chunk(s.num_new_tokens, s.num_context_tokens, samples)
        return load


_NO_LOAD = BatchLoad()  # an empty batch, read only (``prefill_time``)


class Predictor:
    def __init__(self, cost_model: CostModel | None = None, exact: bool = True) -> None:
        self.cost_model = cost_model
        self.exact = exact and cost_model is not None  # predictions are the iteration times
        # ``chunk_time``'s way in; any other model (a test's) is asked ``iteration_time``.
        self._shape_time = cost_model.shape_time if isinstance(cost_model, CostModel) else None
        self._ratios: deque[float] = deque(maxlen=RATIO_WINDOW)
        self._scale = 1.0
        self._rows: list[tuple[float, float, float, float]] = []
        self._times: list[float] = []
        self._coef: np.ndarray | None = None
        self._since_fit = 0

    @property
    def source(self) -> str:
        if self.cost_model is not None and self.exact:
            return "cost model"
        if self.cost_model is not None:
            return (
                f"calibrated cost model x {self._scale:.3f} (p{RATIO_QUANTILE * 100:g} of the last "
                f"{len(self._ratios)} measured/predicted)"
            )
        return f"fit to {len(self._times)} measured iterations" if self._coef is not None else "none yet"

    def time(self, shape: BatchShape) -> float:
        """Predicted seconds for one iteration of this batch shape."""
        if shape.num_tokens == 0:
            return 0.0
        if self.cost_model is not None:
            return self.cost_model.iteration_time(shape) * self._scale
        coef = self._coef
        if coef is None:
            return 0.0
        x = (1.0, shape.num_tokens, shape.prefill_pairs, shape.decode_kv_tokens)
        return max(0.0, float(coef[0] * x[0] + coef[1] * x[1] + coef[2] * x[2] + coef[3] * x[3]))

    def chunk_time(
        self, load: BatchLoad, num_new_tokens: int, num_context_tokens: int, samples: bool
    ) -> float:
        """``time(load.with_chunk(...))`` from the aggregates themselves: no ``BatchShape`` built
        (~2,500 instructions) for each of the ~10 chunks ``max_chunk`` prices per prefill of
        every iteration (``BatchLoad.fields_with``, the same ints)."""
        shape_time = self._shape_time
        if shape_time is None:
            return self.time(load.with_chunk(num_new_tokens, num_context_tokens, samples))
        fields = load.fields_with(num_new_tokens, num_context_tokens, samples)
        time = shape_time(*fields)
        return 0.0 if fields[0] == 0 else time * self._scale

    def prefill_time(self, num_tokens: int, num_context_tokens: int = 0) -> float:
        """One iteration prefilling ``num_tokens`` tokens after ``num_context_tokens`` alone."""
        return self.chunk_time(_NO_LOAD, num_tokens, num_context_tokens, True)

    def max_chunk(
        self, load: BatchLoad, num_context_tokens: int, num_wanted: int, limit_s: float, samples_last: bool
    ) -> int:
        """The most tokens (<= ``num_wanted``) a prefill chunk after ``num_context_tokens`` can
        have so that the batch ``load`` plus it is predicted within ``limit_s``; 0 if none.
        Iteration time grows with the chunk, so a bisection finds it."""
        if num_wanted <= 0:
            return 0
        chunk_time = self.chunk_time
        if chunk_time(load, num_wanted, num_context_tokens, samples_last) <= limit_s:
            return num_wanted
        lo, hi = 0, num_wanted  # lo fits (0 tokens trivially), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if chunk_time(load, mid, num_context_tokens, False) <= limit_s:
                lo = mid
            else:
                hi = mid
        return lo

    def observe(self, shape: BatchShape, duration: float) -> None:
        """A measured iteration (unused with an exact cost model)."""
        if self.exact or shape.num_tokens == 0 or not duration > 0:
            return
        if self.cost_model is not None:
            predicted = self.cost_model.iteration_time(shape)
            if predicted > 0:
                self._ratios.append(duration / predicted)
                if len(self._ratios) >= MIN_RATIO_OBSERVATIONS:
                    self._scale = float(np.quantile(self._ratios, RATIO_QUANTILE))
            return
        self._rows.append(
            (1.0, float(shape.num_tokens), float(shape.prefill_pairs), float(shape.decode_kv_tokens))
        )
        self._times.append(duration)
        if len(self._times) > MAX_OBSERVATIONS:
            del self._rows[: len(self._rows) - MAX_OBSERVATIONS]
            del self._times[: len(self._times) - MAX_OBSERVATIONS]
        self._since_fit += 1
        if len(self._times) >= MIN_OBSERVATIONS and (self._coef is None or self._since_fit >= REFIT_EVERY):
            self._fit()

    def _fit(self) -> None:
        x = np.asarray(self._rows)
        y = np.asarray(self._times)
        # Columns on their own scales (pairs reach 1e7), so the solve is well conditioned;
        # non-negative terms: a longer batch never predicts faster.
        scale = np.maximum(np.abs(x).max(axis=0), 1.0)
        coef, *_ = np.linalg.lstsq(x / scale, y, rcond=None)
        self._coef = np.maximum(coef, 0.0) / scale
        self._since_fit = 0
