"""Handing a cost model to a policy that predicts iteration times (``slo``).

Whoever pairs a policy with a cost model binds it, once, before the first iteration: the
assembler for the simulated executors (their own cost model, whose predictions *are* their
iteration times), ``llm/builder.py`` for the real executor built with ``--calibration FILE`` (an
estimate to correct from measured times), and code that assembles an engine by hand. The
executor contract and the ``Policy`` base class carry no cost model: most policies never ask,
and a real executor has none of its own.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from tailserve.executors.simulated.cost_model import CostModel


@runtime_checkable
class PredictsIterations(Protocol):
    """A policy that prices its iterations with a cost model."""

    def bind_cost_model(self, cost_model: CostModel | None, exact: bool) -> None:
        """``cost_model`` prices this engine's iterations: exactly (``exact``: the simulators') or
        as an estimate (a calibrated real executor); None: there is none, learn one."""
        ...


def bind_cost_model(policy: object, cost_model: CostModel | None, exact: bool = True) -> None:
    """Give ``policy`` the cost model if it predicts iteration times; others ignore it."""
    if isinstance(policy, PredictsIterations):
        policy.bind_cost_model(cost_model, exact)
