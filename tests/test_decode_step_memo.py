"""``CostModel.decode_step_times`` reads its per-step constants (the GEMMs with the absent
prefill's attention, and the all-reduce) from memos per decode count: every step's float, on a
miss and on a hit, equals the step priced alone (``_iteration_time``, bit for bit) and the
vectorised run's (``decode_run_times``), for a TP 1 model and for banded all-reduce (TP 8)."""

from __future__ import annotations

import pytest

from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model


@pytest.mark.parametrize(("model", "gpu", "tp"), [("Llama-3-8B", "A100-80GB", 1), ("Llama-3-70B", "B200", 8)])
def test_memoised_decode_steps_equal_the_steps_priced_alone(model: str, gpu: str, tp: int) -> None:
    cm = CostModel(get_model(model), get_hardware(gpu), tp)
    runs = [(1, 100, 5), (20, 30_000, 12), (20, 35_000, 3), (37, 90_000, 20), (256, 2_000_000, 4)]
    for _ in range(2):  # the first pass fills the memos, the second reads them
        for n, context, steps in runs:
            got = cm.decode_step_times(n, context, steps)
            alone = [cm._iteration_time(n, n, 0, 0, context + j * n, 0, n) for j in range(steps)]
            assert got == alone  # bit for bit
            assert got == cm.decode_run_times(n, context, steps).tolist()
    assert set(cm._decode_head_cache) == {n for n, _, _ in runs}
