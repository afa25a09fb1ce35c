"""``BatchShape``'s counts (prefill chunks, decodes) agree with the batch each builder priced:
the executor's shapes with ``BatchShape.of``, the SLO policy's running load with the executor's,
the fast paths' shapes with plain stepping's, and a saved shape without them is inferred only
where its aggregates fix them."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from tailserve.core.engine import EngineOptions
from tailserve.core.request import Request
from tailserve.core.scheduler_output import PaddingSlot, ScheduledRequest, SchedulerOutput
from tailserve.executors.simulated.cost_model import BatchShape, CostModel
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.executors.simulated.executor import advanced_batch_shape, batch_shape
from tailserve.executors.simulated.saved_shape import infer_counts, shape_from_saved
from tailserve.fidelity.replay import from_json
from tailserve.policies.registry import parse_policy_list
from tailserve.policies.slo_predictor import BatchLoad
from tailserve.sim.run import run_policy
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.workloads.lengths import LogNormal


def _decoding(rid: str, prompt: int, outputs: int) -> Request:
    r = Request(rid, prompt, 100, 0.0)
    r.num_computed_tokens, r.num_output_tokens = prompt + outputs - 1, outputs
    return r


def test_executor_shape_counts_a_mixed_batch_like_batch_shape_of():
    finishing = Request("f", 200, 10, 0.0)
    partial = Request("p", 900, 10, 0.0)
    d1, d2 = _decoding("d1", 40, 6), _decoding("d2", 300, 2)
    out = SchedulerOutput(
        scheduled=[
            ScheduledRequest(partial, 256, 512),  # a chunk that does not finish its prompt
            ScheduledRequest(finishing, 72, 128),
            ScheduledRequest(d1, 1, 45),
            ScheduledRequest(d2, 1, 301),
        ],
        padding=[PaddingSlot(1, 20), PaddingSlot(64, 0)],
    )
    want = BatchShape.of([(256, 512), (72, 128), (64, 0)], [45, 301, 20])
    got = batch_shape(out)
    assert (got.num_prefills, got.num_decodes) == (3, 3)
    # The one difference: the partial chunk does not sample, ``of`` counts a logit per entry.
    assert got == replace(want, num_logits=want.num_logits - 1)
    without_padding = replace(out, padding=[])
    assert BatchLoad.of(without_padding).shape() == batch_shape(without_padding)


def test_advanced_shape_counts_a_speculative_decode_as_neither():
    """vLLM's accounting: a decode verifying 1 + s tokens is priced as a chunk (its pairs and KV)
    but is neither a prefill chunk nor a one-token decode; a prompt's chunk beside it is one."""
    verifying, plain, prompt = _decoding("v", 100, 4), _decoding("d", 50, 3), Request("p", 900, 10, 0.0)
    out = SchedulerOutput(
        scheduled=[
            ScheduledRequest(verifying, 4, 103, num_spec_tokens=3),
            ScheduledRequest(plain, 1, 52),
            ScheduledRequest(prompt, 256, 0, partial=True),
        ],
        advanced=True,
    )
    shape = advanced_batch_shape(out)
    assert (shape.num_prefills, shape.num_decodes, shape.num_logits) == (1, 1, 5)
    assert shape.prefill_kv_tokens == 107 + 256 and shape.decode_kv_tokens == 53


def _prefill_shapes(spec: str, workload: WorkloadSpec, fast: bool, monkeypatch) -> list[tuple]:
    """Every shape with a prefill chunk the run priced (decode-only runs price without a
    shape), in order."""
    seen: list[tuple] = []
    original = CostModel.iteration_time

    def recording(self, shape, window=None):
        if shape.prefill_kv_tokens:
            seen.append(tuple(getattr(shape, f) for f in BatchShape.__slots__))
        return original(self, shape, window)

    original_fields = CostModel.shape_time

    def recording_fields(self, *fields):
        # the chunk runs price a shape's fields without building it (CostModel.shape_time)
        if fields[3]:
            seen.append(tuple(fields))
        return original_fields(self, *fields)

    monkeypatch.setattr(CostModel, "iteration_time", recording)
    monkeypatch.setattr(CostModel, "shape_time", recording_fields)
    built = build_cost_model(Deployment("Llama-3-8B", "A100-80GB", 1, "none"))
    run_policy(
        built, parse_policy_list(spec)[0], WorkloadBuilder(workload), options=EngineOptions(fast_forward=fast)
    )
    monkeypatch.undo()
    return seen


@pytest.mark.parametrize(
    "spec, path",
    [
        ("sarathi:chunk_size=256", "chunk_run.advance_chunk_run"),
        (
            "sglang:disable_overlap_schedule=true,chunked_prefill_size=256",
            "prefill_run.advance_lone_chunk_run",
        ),
    ],
)
def test_fast_paths_count_like_plain_stepping(spec: str, path: str, monkeypatch) -> None:
    import importlib

    module_name, fn = path.split(".")
    module = importlib.import_module(f"tailserve.executors.simulated.{module_name}")
    steps: list[int] = []
    original = getattr(module, fn)

    def counting(engine):
        k = original(engine)
        steps.append(k)
        return k

    workload = WorkloadSpec(
        "random", num_requests=30, rate=6.0, seed=5, input_len=LogNormal(1800, 0.6, 6000),
        output_len=LogNormal(40, 0.8, 200),
    )  # fmt: skip
    slow = _prefill_shapes(spec, workload, False, monkeypatch)
    monkeypatch.setattr(module, fn, counting)
    fast = _prefill_shapes(spec, workload, True, monkeypatch)
    assert sum(steps) > 20  # the fast path priced many of the iterations
    assert fast == slow
    counts = {(s[-2], s[-1] > 0) for s in slow}
    assert (1, True) in counts or (1, False) in counts  # one chunk, with or without decodes


def test_calibration_shape_saves_and_infers_its_counts():
    mixed = BatchShape.of([(200, 128)], [300] * 7)
    assert shape_from_saved(asdict(mixed)) == mixed  # written from now on: saved as they are
    old = {k: v for k, v in asdict(mixed).items() if k not in ("num_prefills", "num_decodes")}
    assert shape_from_saved(old) == mixed  # one chunk beside decodes: the aggregates fix it
    for shape in (
        BatchShape.of([(512, 0)], []),
        BatchShape.of([(16, 0)] * 64, []),  # several prompts: every logit a prefill
        BatchShape.of([], [1000] * 32),
        BatchShape.of([(64, 4000)], []),
    ):
        saved = {k: v for k, v in asdict(shape).items() if k not in ("num_prefills", "num_decodes")}
        assert shape_from_saved(saved) == shape
    two = BatchShape.of([(100, 0), (50, 10)], [300] * 3)  # two chunks and decodes: ambiguous
    with pytest.raises(ValueError, match="does not fix how many prefill chunks"):
        infer_counts(*(getattr(two, k) for k in BatchShape.__slots__[:5]))
    with pytest.raises(ValueError, match="only one of"):
        shape_from_saved({k: v for k, v in asdict(two).items() if k != "num_decodes"})


def test_recorded_run_without_counts_is_read_with_them():
    """A run recorded before the counts (vLLM, chunked prefill): its mixed iterations each hold
    one chunk, which the aggregates fix; the third is 219 prompt tokens beside one decode."""
    body = json.loads((Path(__file__).parent / "fixtures/fidelity/run_vllm_tiny.json").read_text())
    assert all("num_decodes" not in it for it in body["iterations"])
    shapes = [r.shape for r in from_json(body).iterations]
    assert (shapes[2].num_prefills, shapes[2].num_decodes) == (1, 1)
    for s in shapes:
        if s.prefill_kv_tokens:
            q = s.num_tokens - s.num_decodes
            assert (
                s.num_prefills == 1
                and s.prefill_pairs == BatchShape.of([(q, s.prefill_kv_tokens - q)], []).prefill_pairs
            )
        else:
            assert (s.num_prefills, s.num_decodes) == (0, s.num_tokens)
