"""Every policy and flag combination, under KV pressure: nothing lost, blocks conserved,
the fast path exact, the same seed the same result."""

from __future__ import annotations

import numpy as np
import pytest

from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.core.source import ListSource
from tailserve.executors.simulated.cost_binding import bind_cost_model
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.driver import SimDriver
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.kv.hashed import HashedKVCacheManager
from tailserve.kv.paged import KVCacheManager
from tailserve.policies.registry import POLICIES, parse_policy_list

SPECS = [
    "static:batch_size=4:max_wait=0.05",
    "orca:max_num_seqs=16",
    "vllm-v0",
    "vllm-v0:preemption_mode=swap",
    "vllm-v0:enable_chunked_prefill=true:max_num_batched_tokens=256",
    "vllm-v0:enable_chunked_prefill=true:max_num_batched_tokens=256:max_num_partial_prefills=2:long_prefill_token_threshold=200",
    "vllm-v0:scheduling_policy=priority",
    "vllm",
    "vllm:max_num_batched_tokens=128",
    "vllm:scheduling_policy=priority:long_prefill_token_threshold=100",
    # vLLM's own accounting: output placeholders (async), drafts, lookahead slots, rollbacks.
    "vllm:async_scheduling=true",
    "vllm:async_scheduling=true:scheduling_policy=priority:max_num_batched_tokens=128",
    "vllm:speculative_method=eagle3:num_speculative_tokens=3:synthetic_acceptance_length=2.4",
    "vllm:speculative_method=ngram:num_speculative_tokens=4:synthetic_acceptance_rates=0.9/0.6/0.3/0.1:scheduling_policy=priority",
    "vllm:async_scheduling=true:speculative_method=mtp:num_speculative_tokens=2:synthetic_acceptance_rates=0.7/0.4:max_num_batched_tokens=128",
    # pipeline parallelism: the engine core's batch queue of pp batches (pp + 1 with async
    # scheduling and its decode stagger), preempted requests' stale outputs in flight
    "vllm:pipeline_parallel_size=2:async_scheduling=false",
    "vllm:pipeline_parallel_size=3:scheduling_policy=priority:max_num_batched_tokens=128",
    "vllm:pipeline_parallel_size=4:long_prefill_token_threshold=64",
    "sarathi:chunk_size=128",
    "sarathi:enable_dynamic_chunking_schedule=true:low_chunk_size=64:high_chunk_size=256:chunk_schedule_stages=3:chunk_schedule_max_tokens=600",
    "sglang",  # SGLang's overlap scheduler on (its default)
    "sglang:disable_overlap_schedule=true",
    "sglang:chunked_prefill_size=128:enable_mixed_chunk=true",
    "sglang:schedule_policy=lof",
    "sglang:enable_priority_scheduling=true:priority_scheduling_preemption_threshold=1",
    "sglang:schedule_policy=hrrn:chunked_prefill_size=128",
    "sglang:schedule_policy=shortest-prefill-first:chunked_prefill_size=128:enable_mixed_chunk=true",
    "sglang:schedule_policy=routing-key",
    # SGLang's speculative decoding: decode slots held ahead, 1 + accepted drafts per step;
    # overlapped by default (spec v2: the commit a step late), and synchronous when asked.
    "sglang:speculative_algorithm=NEXTN:speculative_num_steps=3:synthetic_acceptance_length=2.5",
    "sglang:disable_overlap_schedule=true:speculative_algorithm=NEXTN:speculative_num_steps=3:synthetic_acceptance_length=2.5",
    "sglang:speculative_algorithm=EAGLE3:speculative_num_steps=2:synthetic_acceptance_rates=0.8/0.5:chunked_prefill_size=128:schedule_policy=lof",
    "tgi",
    "tgi:prefill_chunking=false:max_batch_prefill_tokens=1023",
    "trtllm",
    "trtllm:capacity_scheduler_policy=MAX_UTILIZATION",
    "trtllm:capacity_scheduler_policy=STATIC_BATCH:max_batch_size=8",
    "trtllm:enable_chunked_prefill=true:max_num_tokens=256",
    "trtllm:enable_chunked_prefill=true:context_chunking_policy=EQUAL_PROGRESS:max_num_tokens=256:capacity_scheduler_policy=MAX_UTILIZATION",
    "trtllm:max_num_tokens=600:capacity_scheduler_policy=MAX_UTILIZATION",
    # without the overlap scheduler (on by default on a GPU: trtllm_overlap.py)
    "trtllm:disable_overlap_scheduler=true:capacity_scheduler_policy=MAX_UTILIZATION",
    "trtllm:disable_overlap_scheduler=true:enable_chunked_prefill=true:max_num_tokens=256",
    # draft tokens (MTP, EAGLE-3) and CUDA-graph padding (its decode runs priced padded); drafts
    # keep the overlap scheduler on by default: the synchronous ones say so
    "trtllm:decoding_type=MTP:num_nextn_predict_layers=3:synthetic_acceptance_length=2.5",
    "trtllm:disable_overlap_scheduler=true:decoding_type=MTP:num_nextn_predict_layers=3:synthetic_acceptance_length=2.5",
    "trtllm:disable_overlap_scheduler=true:decoding_type=Eagle3:max_draft_len=2:synthetic_acceptance_rates=0.8/0.5:capacity_scheduler_policy=MAX_UTILIZATION:max_num_tokens=600",
    # overlap + drafts under KV pressure: the in-flight draft slots reserved to completion
    "trtllm:decoding_type=MTP:num_nextn_predict_layers=3:synthetic_acceptance_rates=0.9/0.6/0.3:max_batch_size=64",
    "trtllm:decoding_type=Eagle3:max_draft_len=2:synthetic_acceptance_rates=0.8/0.5:capacity_scheduler_policy=MAX_UTILIZATION:max_num_tokens=600",
    "trtllm:cuda_graph_padding_enabled=true:cuda_graph_max_batch_size=64",
    "trtllm:cuda_graph_padding_enabled=true:decoding_type=MTP:synthetic_acceptance_length=1.7:enable_chunked_prefill=true:max_num_tokens=256",
    "slo",
    "slo:slo_admission=reject:max_num_batched_tokens=256",
    "slo:fairness=vtc:tenant_weights=a=2",
]
MAX_MODEL_LEN = 1024
KV_TOKENS = 3072  # small enough that most policies must preempt, retract or queue


def _requests(seed: int, n: int = 60) -> list[Request]:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(0.02, n)
    prompts = rng.integers(16, 700, n)
    outputs = rng.integers(1, 300, n)
    return [
        Request(f"r{i}", int(p), int(min(o, MAX_MODEL_LEN - p)), float(t), priority=int(rng.integers(0, 3)))
        for i, (p, o, t) in enumerate(zip(prompts, outputs, np.cumsum(gaps)))
    ]


def _run(spec_text: str, seed: int, fast: bool) -> tuple[Engine, list[Request]]:
    spec = parse_policy_list(spec_text)[0]
    cls = POLICIES[spec.name]
    device = get_hardware("H100-SXM").device_info
    policy = cls(cls.default_config(device, MAX_MODEL_LEN, **spec.flags))
    block = cls.default_block_size
    kv = KVCacheManager(KV_TOKENS // block, block, num_cpu_blocks=2048 // block)
    requests = _requests(seed)
    return _run_engine(Scheduler(policy, kv, MAX_MODEL_LEN), block, requests, fast), requests


def _run_engine(sched: Scheduler, block: int, requests: list[Request], fast: bool) -> Engine:
    """Serve ``requests`` to the end on a simulated Llama-3-8B / H100, with integrity checks."""
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1).with_pipeline(
        sched.pipeline_parallel_size
    )
    bind_cost_model(sched.policy, cost)  # (slo) predicts with the simulator's cost model
    engine = Engine(
        sched,
        SimExecutor(
            cost, block, sched.policy.speculative_decoding(), seed=0, graph=sched.policy.cuda_graph_padding()
        ),
        ListSource(requests),
        options=EngineOptions(fast, check_integrity=True),
    )
    SimDriver(engine).run()
    return engine


def _fingerprint(requests: list[Request]) -> list:
    return [(r.request_id, r.status, r.num_preemptions, tuple(r.token_times)) for r in requests]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("seed", [1, 2])
def test_nothing_lost_blocks_conserved_fast_path_exact(spec, seed):
    engine, requests = _run(spec, seed, fast=True)
    sched = engine.scheduler
    assert not sched.waiting and not sched.running and not sched.swapped
    assert len(sched.finished) == len(requests)
    for r in requests:
        assert r.is_finished
        if r.status is RequestStatus.FINISHED_LENGTH:
            assert len(r.token_times) == r.max_tokens
            assert all(a <= b for a, b in zip(r.token_times, r.token_times[1:]))
            assert r.first_scheduled_time is not None and r.first_scheduled_time >= r.arrival_time
        else:
            assert r.status_reason, f"{r.request_id} ended {r.status} without a reason"
    kv = sched.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and not any(kv.block_tables.values())
    assert kv.num_free_cpu_blocks == kv.num_cpu_blocks
    _, stepped = _run(spec, seed, fast=False)
    assert _fingerprint(requests) == _fingerprint(stepped)


@pytest.mark.parametrize("spec", ["vllm", "sglang", "tgi", "vllm-v0:preemption_mode=swap", "sarathi"])
def test_same_seed_same_result(spec):
    assert _fingerprint(_run(spec, 5, True)[1]) == _fingerprint(_run(spec, 5, True)[1])


def test_pressure_is_real():
    preempting = {
        spec: sum(r.num_preemptions for r in _run(spec, 1, True)[1])
        for spec in ("vllm", "sglang", "sarathi:chunk_size=128")
    }
    assert all(n > 0 for n in preempting.values()), preempting


def test_every_registered_policy_is_covered():
    assert {parse_policy_list(s)[0].name for s in SPECS} == set(POLICIES)


CACHING_SPECS = [
    "vllm",
    "vllm:max_num_batched_tokens=128:scheduling_policy=priority",
    "vllm:async_scheduling=true:speculative_method=eagle:num_speculative_tokens=2:synthetic_acceptance_length=2.2",
    "vllm:speculative_method=ngram:num_speculative_tokens=3:synthetic_acceptance_rates=0.8/0.5/0.2",
    "vllm-v0:enable_prefix_caching=true",
    "vllm-v0:enable_prefix_caching=true:enable_chunked_prefill=true:max_num_batched_tokens=256",
    "vllm-v0:enable_prefix_caching=true:preemption_mode=swap",
    "trtllm",
    "trtllm:capacity_scheduler_policy=MAX_UTILIZATION:max_batch_size=16",
    "trtllm:disable_overlap_scheduler=true:capacity_scheduler_policy=MAX_UTILIZATION:max_batch_size=16",
    "trtllm:enable_chunked_prefill=true:max_num_tokens=128:context_chunking_policy=EQUAL_PROGRESS",
    "trtllm:decoding_type=MTP:num_nextn_predict_layers=2:synthetic_acceptance_length=2.2:capacity_scheduler_policy=MAX_UTILIZATION",
]


def _shared_requests(seed: int, n: int = 60) -> list[Request]:
    rng = np.random.default_rng(seed)
    prefixes = [[int(t) for t in rng.integers(0, 30000, int(rng.integers(16, 300)))] for _ in range(3)]
    out = []
    for i in range(n):
        ids = prefixes[int(rng.integers(0, 3))] + [
            int(t) for t in rng.integers(0, 30000, int(rng.integers(1, 300)))
        ]
        max_tokens = int(min(rng.integers(1, 200), MAX_MODEL_LEN - len(ids)))
        out.append(Request(f"r{i}", len(ids), max_tokens, i * 0.02, priority=i % 3, prompt_token_ids=ids))
    return out


def _run_cached(spec_text: str, seed: int, fast: bool) -> tuple[Engine, list[Request]]:
    spec = parse_policy_list(spec_text)[0]
    cls = POLICIES[spec.name]
    policy = cls(cls.default_config(get_hardware("H100-SXM").device_info, MAX_MODEL_LEN, **spec.flags))
    kv = HashedKVCacheManager(KV_TOKENS // 16, 16, num_cpu_blocks=128)
    requests = _shared_requests(seed)
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    bind_cost_model(policy, cost)  # (slo) predicts with the simulator's cost model
    engine = Engine(
        Scheduler(policy, kv, MAX_MODEL_LEN),
        SimExecutor(cost, 16, policy.speculative_decoding(), seed=0, graph=policy.cuda_graph_padding()),
        ListSource(requests),
        options=EngineOptions(fast, check_integrity=True),
    )
    SimDriver(engine).run()
    return engine, requests


@pytest.mark.parametrize("spec", CACHING_SPECS)
def test_prefix_caching_conserves_blocks_and_the_fast_path_is_exact(spec):
    engine, requests = _run_cached(spec, 4, True)
    assert all(r.is_finished and (r.finish_reason == "length" or r.status_reason) for r in requests)
    assert sum(r.num_cached_tokens for r in requests) > 0
    kv = engine.scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and kv.num_free_cpu_blocks == kv.num_cpu_blocks
    _, stepped = _run_cached(spec, 4, False)
    assert _fingerprint(requests) == _fingerprint(stepped)
