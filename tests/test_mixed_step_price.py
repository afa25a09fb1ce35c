"""A step mixing a prefill chunk with decodes is priced as one forward (docs/fidelity.md): the
decode beside a compute-bound chunk costs next to nothing, so chunked prefill spares the decoding
request the whole-prompt stall (Sarathi-Serve's argument; benchmarks/chunk_pricing.py compares
AISimulate, which prices a prefill pass plus a decode pass)."""

from __future__ import annotations

import json

import pytest

from tailserve.executors.simulated.cost_model import BatchShape
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.policies.registry import parse_policy_list
from tailserve.sim.run import run_policy
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec


@pytest.fixture(scope="module")
def built():
    return build_cost_model(Deployment("Llama-3-8B", "A100-80GB", 1, "none"))


def test_a_decode_beside_a_chunk_adds_a_row_not_a_pass(built):
    cm = built.cost_model
    chunk = cm.iteration_time(BatchShape.of([(511, 0)], []))
    decode = cm.iteration_time(BatchShape.of([], [200]))
    mixed = cm.iteration_time(BatchShape.of([(511, 0)], [200]))
    assert mixed > chunk
    # One forward: the weights are read once; a second pass would add the decode step's price.
    assert mixed - chunk < 0.05 * decode


def _end_to_end_of_decoder(built, tmp_path, budget: int) -> float:
    trace = tmp_path / "two.jsonl"
    trace.write_text(
        json.dumps({"arrival_time": 0.0, "prompt_len": 128, "max_tokens": 400})
        + "\n"
        + json.dumps({"arrival_time": 1.0, "prompt_len": 4096, "max_tokens": 2})
        + "\n"
    )
    flags = f"max_num_batched_tokens={budget},max_num_seqs=256,async_scheduling=false"
    run = run_policy(
        built,
        parse_policy_list(f"vllm:{flags}")[0],
        WorkloadBuilder(WorkloadSpec("trace", trace_path=str(trace))),
    )
    decoder = min(run.requests, key=lambda r: r.arrival_time)
    assert decoder.prompt_len == 128 and decoder.finish_time is not None
    return decoder.finish_time - decoder.arrival_time


def test_chunking_the_prompt_spares_the_decoding_request(built, tmp_path):
    whole = _end_to_end_of_decoder(built, tmp_path, 4096)
    chunked = _end_to_end_of_decoder(built, tmp_path, 512)
    # Its tokens ride in the chunks' steps instead of waiting out one 4,096-token step.
    assert chunked < whole - 0.03
