"""The simulated deployment ``bench --predict`` predicts for (its ``--predict-*`` defaults are
read from here), kept apart from the simulation so the CLI reads it without importing that."""

from __future__ import annotations

from dataclasses import dataclass

from tailserve.executors.simulated.deployment import Deployment
from tailserve.llm.engine_args import EngineArgs

_SERVE = EngineArgs(executor="sim")


@dataclass(frozen=True, slots=True)
class PredictSpec:
    """The simulated deployment to predict for; by default the one ``tailserve serve --executor
    sim`` runs by default."""

    model: str = _SERVE.sim_model
    hardware: str = _SERVE.hardware
    tp: int = _SERVE.tensor_parallel_size
    calibration: str = _SERVE.calibration
    policy: str = _SERVE.policy  # a spec as ``tailserve compare`` takes one: NAME[:flag=value...]

    def __post_init__(self) -> None:
        # Names resolved as Deployment resolves them, so the label and the JSON carry the
        # catalog's spelling whatever the user typed (ValueError for an unknown name).
        names = Deployment(self.model, self.hardware, self.tp, self.calibration)
        object.__setattr__(self, "model", names.model)
        object.__setattr__(self, "hardware", names.hardware)
        object.__setattr__(self, "calibration", names.calibration)

    @property
    def label(self) -> str:
        return f"{self.model} on {self.hardware} x{self.tp}, {self.policy}, calibration {self.calibration}"
