"""The ``slo`` policy's burst experiment (``tbt_late_fraction``, off by default): the late-gap
budget and the iteration that spends it, on hand-worked cases with test_slo_policy's linear
predicted iteration time (5 ms + 10 us a token)."""

from __future__ import annotations

import pytest
from tests.test_slo_policy import _decoding, _setup

from tailserve.core.request import Request
from tailserve.policies.slo_burst import BurstBudget
from tailserve.policies.slo_config import SloConfig


def test_the_budget_allows_late_gaps_up_to_its_fraction():
    budget = BurstBudget(0.01)
    assert not budget.allows(5)  # nothing accrued yet: 5 > 0.01 x 5
    budget.count(100, False, num_steps=10)  # a decode run: 1,000 gaps
    assert budget.allows(5)  # 5 <= 0.01 x 1,005
    budget.count(5, True)
    assert budget.late == 5 and budget.gaps == 1005
    assert not budget.allows(6)  # 11 > 0.01 x 1,011
    assert not BurstBudget(0.0).allows(0)


def test_the_fraction_is_checked():
    with pytest.raises(ValueError, match=r"tbt_late_fraction must be in \[0, 1\)"):
        SloConfig(2048, 256, tbt_late_fraction=1.0)


@pytest.mark.parametrize("fraction", [0.0, 0.01])
def test_an_overdue_queue_spends_the_budget_on_one_long_iteration(fraction):
    policy, sched = _setup(max_num_batched_tokens=8192, tbt_late_fraction=fraction)
    policy.burst.gaps = 1000
    _decoding(sched, "d", 100, last_token=0.43)  # due at 0.48: 40 ms of slack at 0.44
    # Interactive, due at 0.5 s; its prefill alone predicts 5 ms + 60 ms: at 0.44 the queue
    # ends at 0.505, past the deadline.
    sched.add_request(Request("p", 6000, 10, 0.0), 0.0)
    grants = {s.request.request_id: s.num_new_tokens for s in sched.schedule(0.44).scheduled}
    # Off: rule 2's 40 ms (0.48 - 0.44, a hair under 40 ms in floating point) ->
    # 5 ms + 10 us x (1 + q) < 40 ms, q = 3,498.
    # On: the TBT limit is dropped for this iteration, the whole prompt goes (cap 8,192) and
    # the decode's gap counts as late.
    assert grants == {"d": 1, "p": 6000 if fraction else 3498}
    assert policy.burst.late == (1 if fraction else 0)
