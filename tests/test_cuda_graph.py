"""CUDA-graph padding (``executors/simulated/cuda_graph.py``): TensorRT-LLM 1.2's captured batch
sizes (``llm_args.py`` ``CudaGraphConfig._generate_cuda_graph_batch_sizes``) and a generation-only
step priced at the next captured size (``cuda_graph_runner.py``), worked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from tailserve.core.request import Request
from tailserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tailserve.executors.simulated.cost_model import BatchShape, CostModel
from tailserve.executors.simulated.cuda_graph import CudaGraphPadding, is_generation_only
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.policies.trtllm_config import TrtllmConfig

PADDED_128 = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128)


def test_captured_batch_sizes_are_tensorrt_llms():
    assert TrtllmConfig(cuda_graph_padding_enabled=True).captured_batch_sizes() == PADDED_128
    assert TrtllmConfig(
        cuda_graph_padding_enabled=True, cuda_graph_max_batch_size=512
    ).captured_batch_sizes() == (*PADDED_128, 256, 512)
    assert TrtllmConfig().captured_batch_sizes() == (*range(1, 33), 64, 128)
    assert TrtllmConfig(
        cuda_graph_max_batch_size=100, cuda_graph_padding_enabled=True
    ).captured_batch_sizes() == (
        *PADDED_128[:15],
        100,  # up to 96, then the maximum
    )
    given = TrtllmConfig(cuda_graph_batch_sizes=(512.0, 128.0, 256.0, 384.0))
    assert given.captured_batch_sizes() == (128, 256, 384, 512)


def test_a_batch_runs_at_the_next_captured_size_or_eagerly_past_the_largest():
    graph = CudaGraphPadding((128, 256, 384, 512))
    assert [graph.padded_batch(n) for n in (1, 128, 129, 156, 512, 513)] == [128, 128, 256, 256, 512, 513]
    # Dummies add tokens and logits (1 + drafts each), decodes for one-token steps, no KV.
    shape = BatchShape(5, 5, 0, 0, 500, 0, 5)
    assert CudaGraphPadding((8,)).pad(shape, 5) == BatchShape(8, 8, 0, 0, 500, 0, 8)
    assert CudaGraphPadding((8,), 4).pad(BatchShape(20, 20, 90, 520, 0, 0, 0), 5) == BatchShape(
        32, 32, 90, 520, 0, 0, 0
    )
    with pytest.raises(ValueError, match="ascending"):
        CudaGraphPadding((8, 4))


def _decode(rid: str, context: int) -> ScheduledRequest:
    request = Request(rid, 10, 100, 0.0)
    request.num_output_tokens = context - 10 + 1
    request.num_computed_tokens = context
    return ScheduledRequest(request, 1, context)


def test_a_generation_only_step_is_priced_padded_and_a_step_with_a_context_is_not():
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    padded = SimExecutor(cost, 16, graph=CudaGraphPadding((1, 2, 4, 8)))
    plain = SimExecutor(cost, 16)
    decodes = SchedulerOutput([_decode(str(i), 100) for i in range(5)])
    assert is_generation_only(decodes)
    kv = 5 * 101
    assert padded.execute(decodes).duration == cost._iteration_time(8, 8, 0, 0, kv, 0, 8)
    assert plain.execute(decodes).duration == cost._iteration_time(5, 5, 0, 0, kv, 0, 5)
    assert padded.execute(decodes).duration > plain.execute(decodes).duration
    context = ScheduledRequest(Request("c", 10, 100, 0.0), 10, 0)
    mixed = SchedulerOutput([*decodes.scheduled, context])
    assert not is_generation_only(mixed)
    assert padded.execute(mixed).duration == plain.execute(mixed).duration
    # A decode run (the fast path) prices each step as the stepped one would.
    run = padded.decode_run_durations(5, kv, 3)
    assert np.array_equal(run, [cost._iteration_time(8, 8, 0, 0, kv + 5 * j, 0, 8) for j in range(3)])
    assert padded.decode_step_durations(5, kv, 3) == run.tolist()
    assert padded.decode_step_duration(5, kv) == run[0]


def _dp_run(flags: dict[str, str]):
    from tailserve.cluster.build import workload_requests
    from tailserve.cluster.cluster import run_aggregated
    from tailserve.cluster.dp_group import LockstepStage, build_dp_stage
    from tailserve.cluster.replica import ReplicaSpec
    from tailserve.executors.simulated.deployment import Deployment
    from tailserve.policies.registry import PolicySpec
    from tailserve.sim.workload_builder import WorkloadBuilder
    from tailserve.sim.workload_spec import WorkloadSpec
    from tailserve.workloads.lengths import parse_length

    deployment = Deployment.of("Qwen3-30B-A3B", "H100-SXM", 1, expert_parallel=True, dp=2)
    spec = PolicySpec.make("trtllm", flags)
    work = WorkloadSpec(
        name="random", num_requests=24, rate=6.0, input_len=parse_length("300"), output_len=parse_length("30")
    )
    stage = build_dp_stage(deployment, spec, shares_prefixes=False)
    assert isinstance(stage, LockstepStage)
    run = run_aggregated(stage, workload_requests(WorkloadBuilder(work), [ReplicaSpec(deployment, spec)]))
    return stage, run


def test_attention_dp_ranks_replay_one_padded_size():
    # Graphs of 16 and 32: every decode-only group step runs at 16 or 32 requests per rank,
    # so each such step is at least as long as unpadded and the padded run ends later.
    plain_stage, _ = _dp_run({})
    padded_stage, padded = _dp_run({"cuda_graph_padding_enabled": "true", "cuda_graph_batch_sizes": "16,32"})
    assert all(r.is_finished for r in padded.requests)
    assert padded_stage.now > plain_stage.now
    decode_rows = lambda stage: [  # noqa: E731
        row for row in stage.replicas[0].engine.log.rows() if row["num_prefill_tokens"] == 0
    ]
    assert min(r["duration"] for r in decode_rows(padded_stage)) > min(
        r["duration"] for r in decode_rows(plain_stage)
    )


def test_drafts_in_an_attention_dp_engine_replay_the_padded_size_too():
    # MTP in the attention-DP group (tests/test_dp_drafts.py): a decode-only group step with
    # drafts still runs at a captured size, so it is longer than unpadded.
    drafts = {"decoding_type": "MTP", "synthetic_acceptance_length": "1.5"}
    plain_stage, _ = _dp_run(drafts)
    padded_stage, padded = _dp_run(
        {**drafts, "cuda_graph_padding_enabled": "true", "cuda_graph_batch_sizes": "16,32"}
    )
    assert all(r.is_finished for r in padded.requests)
    assert padded_stage.now > plain_stage.now


def test_the_real_time_executor_prices_a_generation_only_step_padded():
    # serve --executor sim with trtllm's padding: the real-time executor's step is the padded
    # price (8 for 5 decodes), as the virtual-time one's; unpadded without the flag.
    from tailserve.assemble import BuildOptions, build_engine
    from tailserve.executors.simulated.deployment import Deployment, build_cost_model
    from tailserve.executors.simulated.realtime import RealtimeSimExecutor

    built = build_cost_model(Deployment("Llama-3-8B", "H100-SXM", 1, "none"))
    flags = "trtllm:cuda_graph_padding_enabled=true:cuda_graph_batch_sizes=1/2/4/8"
    padded = build_engine(built, flags, "realtime-sim", BuildOptions(vocab_size=100)).executor
    plain = build_engine(built, "trtllm", "realtime-sim", BuildOptions(vocab_size=100)).executor
    assert isinstance(padded, RealtimeSimExecutor) and isinstance(plain, RealtimeSimExecutor)
    cost = padded.cost_model
    decodes = SchedulerOutput([_decode(str(i), 100) for i in range(5)])
    kv = 5 * 101
    assert padded.execute(decodes).duration == cost._iteration_time(8, 8, 0, 0, kv, 0, 8)
    assert plain.execute(decodes).duration == cost._iteration_time(5, 5, 0, 0, kv, 0, 5)
