"""Which generator and which tailserve policy go with each engine's differential run."""

from __future__ import annotations

from collections.abc import Callable

from tailserve.validate.generate import random_vllm_workload
from tailserve.validate.tailserve_side import run_tailserve
from tailserve.validate.trace import StepRecord
from tailserve.validate.workload import Workload

ENGINE_LABELS = {"vllm": "vLLM"}


def generator_for(engine: str) -> Callable[[int], Workload]:
    if engine == "vllm":
        return random_vllm_workload
    raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINE_LABELS)}")


def tailserve_runner(engine: str) -> Callable[[Workload], list[StepRecord]]:
    if engine == "vllm":
        return run_tailserve
    raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINE_LABELS)}")
