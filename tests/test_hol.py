"""The seed essay's head-of-line scenario: one 8,192-token prompt joins ten decoding requests."""

from __future__ import annotations

import numpy as np
import pytest

from tailserve.core.engine import EngineOptions
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.policies.registry import parse_policy_list
from tailserve.sim.run import run_policy
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec


def _short_gaps(run) -> np.ndarray:
    shorts = [r for r in run.requests if r.request_id.startswith("short-")]
    assert len(shorts) == 10
    return np.concatenate([np.diff(r.token_times) for r in shorts])


@pytest.fixture(scope="module", params=["seed", "none"])
def built(request):
    return build_cost_model(Deployment("Llama-3-70B", "A100-80GB", 4, request.param))


def _run(built, policy: str):
    spec = parse_policy_list(policy)[0]
    return run_policy(
        built, spec, WorkloadBuilder(WorkloadSpec("hol")), options=EngineOptions(check_integrity=True)
    )


def test_orca_stalls_every_decode_for_the_whole_prefill(built):
    run = _run(built, "orca")
    assert all(r.is_finished and r.finish_reason == "length" for r in run.requests)
    prefill = built.cost_model.prefill_time(8192)
    step = built.cost_model.decode_time(10, 600)
    gaps = _short_gaps(run)
    # Every short request waits out the whole 8,192-token prefill once...
    for r in run.requests:
        if r.request_id.startswith("short-"):
            assert np.diff(r.token_times).max() >= prefill
    # ...which is many normal decode steps long.
    assert gaps.max() >= 5 * step


def test_vllm_chunking_bounds_the_stall_to_a_few_chunk_iterations(built):
    run = _run(built, "vllm:max_num_batched_tokens=512")
    cm = built.cost_model
    from tailserve.executors.simulated.cost_model import BatchShape

    # One chunk iteration: 502 prompt tokens over up to 8,192 cached ones plus ten decodes.
    chunk_iteration = cm.iteration_time(BatchShape.of([(502, 8192 - 502)], [800] * 10))
    gaps = _short_gaps(run)
    assert gaps.max() <= 2 * chunk_iteration
    assert gaps.max() < cm.prefill_time(8192) / 3
    long = next(r for r in run.requests if r.request_id == "long-0")
    # The long prompt took ceil(8192 / (512 - 10)) = 17 chunk iterations, visible in the log.
    chunked = [n for n in run.log.num_prefill_tokens if n >= 400]
    assert len(chunked) >= 16
    assert long.token_times[0] - long.arrival_time >= 16 * cm.prefill_time(502)


def test_compare_default_paragraph_names_the_contrast(capsys):
    from tailserve.cli import main

    assert main(["compare"]) == 0
    out = capsys.readouterr().out
    assert "orca" in out and "sarathi" in out and "sglang" in out and "tgi" in out
    assert "stall for" in out and "x smaller" in out
