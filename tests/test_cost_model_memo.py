"""``CostModel._iteration_time`` reads ``_linear`` and ``_comm`` through memos (the simulator
prices every iteration there): a memo's hit returns the float the uncached pieces give, summed in
the same order, for a TP 1 model (no all-reduce) and for banded all-reduce lines (TP 8)."""

from __future__ import annotations

import pytest

from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model


@pytest.mark.parametrize(("model", "gpu", "tp"), [("Llama-3-8B", "A100-80GB", 1), ("Llama-3-70B", "B200", 8)])
def test_memoised_pieces_give_the_uncached_sum(model: str, gpu: str, tp: int) -> None:
    cm = CostModel(get_model(model), get_hardware(gpu), tp)
    shapes = [
        (512, 21, 9_000_000, 1_500, 40_000, 1, 20),  # a chunk beside decodes
        (20, 20, 0, 0, 30_000, 0, 20),  # decodes alone
        (15, 0, 120, 15, 0, 1, 0),  # a small chunk alone (a band edge at TP 8)
        (16, 1, 136, 16, 0, 1, 0),
        (3_000, 1, 4_501_500, 3_000, 0, 1, 0),
    ]
    for _ in range(2):  # the first pass fills the memos, the second reads them
        for tokens, logits, pairs, prefill_kv, decode_kv, prefills, decodes in shapes:
            expected = (
                cm._linear_uncached(tokens, logits)
                + cm._attention(pairs, prefill_kv, cm._prefill_rates, cm._prefill_pair_flops)
                + cm._attention(decode_kv, decode_kv, cm._decode_rates, cm._decode_pair_flops)
                + cm._comm(tokens)
                + cm.efficiency.overhead
            )
            got = cm._iteration_time(tokens, logits, pairs, prefill_kv, decode_kv, prefills, decodes)
            assert got == expected  # bit for bit
