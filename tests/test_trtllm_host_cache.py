"""TensorRT-LLM's host KV pool (``kv_cache_config.host_cache_size``): the pool
(kv/secondary_pool.py), the trtllm policy's onboarding and copy time
(policies/trtllm_host_cache.py), its sizing and its YAML keys."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import grants, step, token_request
from tailserve.assemble.scheduler import build_scheduler
from tailserve.assemble.simulated import simulated_scheduler
from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.source import ListSource
from tailserve.engines.flag_spec import SCHEDULING
from tailserve.engines.lint import lint
from tailserve.engines.translate import translate
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.deployment import Deployment
from tailserve.executors.simulated.driver import SimDriver
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.kv.factory import make_kv_cache
from tailserve.kv.paged import KVCacheIntegrityError
from tailserve.kv.secondary_pool import SecondaryBlockPool, secondary_pool_blocks
from tailserve.policies.registry import PolicySpec
from tailserve.policies.trtllm import TrtllmPolicy
from tailserve.policies.trtllm_config import TrtllmConfig
from tailserve.tune.commands import command_line

SECONDS_PER_TOKEN = 1e-4  # a made-up host link: 100 us per token, so copies show in the clock
SYSTEM = list(range(1000, 1000 + 96))  # six full blocks of 16
H100 = get_hardware("H100-SXM")


# ---- the pool ------------------------------------------------------------------------------------
def test_offloads_take_the_front_slot_and_a_freed_slot_waits_at_the_back():
    pool = SecondaryBlockPool(3, 16, 1 << 20)
    pool.offload([1, 2, 3])
    assert len(pool) == 3 and pool.take_offloaded() == 3 and pool.take_offloaded() == 0
    pool.offload([4])  # full: the front slot's block (1, the oldest) is dropped
    assert 1 not in pool and {2, 3, 4} <= set(pool._slot_of) and pool.stats.num_evicted_blocks == 1
    pool.onboard([2])  # reused: its slot goes to the back, empty
    assert 2 not in pool and len(pool) == 2
    pool.offload([5])  # the front slot still holds 3: dropped, although an empty slot exists
    assert 3 not in pool and 5 in pool and pool.stats.num_evicted_blocks == 2
    pool.offload([6])  # then 4
    assert 4 not in pool
    pool.offload([7])  # now the empty slot is at the front: nothing dropped
    assert pool.stats.num_evicted_blocks == 3 and {5, 6, 7} == set(pool._slot_of)
    pool.offload([6])  # held already: not stored again
    assert pool.stats.num_offloaded_blocks == 7 and pool.take_offloaded() == 4
    assert pool.lookup([9, 5, 6, 8, 7], 1, 5) == 2 and pool.lookup([9, 5], 0, 2) == 0
    pool.check_integrity()


def test_pool_integrity_catches_a_broken_index():
    pool = SecondaryBlockPool(2, 16, 1 << 20)
    pool.offload([1])
    pool._slot_of[99] = 1
    with pytest.raises(KVCacheIntegrityError):
        pool.check_integrity()
    with pytest.raises(ValueError, match="holds no KV block"):
        SecondaryBlockPool(0, 32, 1000)


def test_size_is_bytes_per_gpu_over_the_ranks_own_bytes_per_block():
    # Llama-3-8B: 128 KiB of KV per token, 4 MiB per 32-token block on one GPU.
    assert secondary_pool_blocks(1 << 30, 128 * 1024, 32) == 256
    # TP 2: each rank holds half of every block, so the same bytes per GPU hold twice the blocks.
    assert secondary_pool_blocks(1 << 30, 64 * 1024, 32) == 512
    assert secondary_pool_blocks(4 * 1024 * 1024 - 1, 128 * 1024, 32) == 0

    def assembled(tp: int) -> int:
        cost = CostModel(get_model("Llama-3-8B"), H100, tp)
        parts = simulated_scheduler(
            cost, PolicySpec.make("trtllm", {"host_cache_size": 8 << 30, "max_model_len": 8192}), 8192,
            shares_prefixes=True, cpu_swap=True,
        )  # fmt: skip
        pool = parts.scheduler.kv_cache.secondary
        assert pool is not None and parts.scheduler.kv_cache.host is None  # not vLLM's tier
        return pool.num_blocks

    assert assembled(1) == 8 * 256 and assembled(2) == 2 * assembled(1)


def test_the_real_executor_has_no_host_pool():
    class Size:
        num_blocks, block_size, kv_bytes_per_token = 100, 32, 1024

    spec = PolicySpec.make("trtllm", {"host_cache_size": 1 << 30})
    with pytest.raises(ValueError, match="needs the simulated executor"):
        build_scheduler(spec, H100.device_info, 1024, lambda c: Size(), shares_prefixes=True)


def test_bad_sizes_and_reuse_off_are_refused():
    with pytest.raises(ValueError, match="whole number of bytes"):
        TrtllmConfig(host_cache_size=-1)
    with pytest.raises(ValueError, match="whole number of bytes"):
        TrtllmConfig(host_cache_size=1.5)
    with pytest.raises(ValueError, match="needs kv_cache_config\\.enable_block_reuse"):
        TrtllmConfig(host_cache_size=1 << 30, enable_block_reuse=False)
    assert not TrtllmConfig(host_cache_size=0).offloads_to_host  # 0: no pool, as in the engine


def test_a_min_priority_above_the_default_offloads_nothing():
    config = TrtllmConfig(host_cache_size=1 << 30, secondary_offload_min_priority=36)
    assert not config.offloads_to_host and TrtllmPolicy(config).kv_spec().host_cache_bytes == 0
    notes = TrtllmPolicy.default_notes(H100.device_info, config, {"disable_overlap_scheduler": True})
    assert any("no block is offloaded" in n for n in notes)
    assert TrtllmConfig(host_cache_size=1 << 30, secondary_offload_min_priority=35).offloads_to_host


# ---- the policy: offload on eviction, onboard on reuse -------------------------------------------
def _sched(num_blocks: int, host_blocks: int, host: bool = True, **kw) -> Scheduler:
    config = TrtllmConfig(host_cache_size=(1 << 30) if host else None, **kw)
    policy = TrtllmPolicy(config)
    if host:
        policy._host.seconds_per_token = SECONDS_PER_TOKEN
    kv = make_kv_cache(policy.kv_spec(), num_blocks, 16, num_host_blocks=host_blocks if host else 0)
    return Scheduler(policy, kv, 4096)


def _finish(sched: Scheduler, request: Request, now: float) -> float:
    sched.add_request(request, now)
    while not request.is_finished:
        step(sched, now)
        now += 0.01
    return now


def _evicting_run(host: bool):
    """a's prompt cached, then c's prompt evicts most of it from an 8-block GPU pool; b reuses a's."""
    sched = _sched(8, 16, host)
    now = _finish(sched, token_request("a", [*SYSTEM, 1], max_tokens=1), 0.0)
    now = _finish(sched, token_request("c", list(range(5000, 5100)), max_tokens=1), now)
    b = token_request("b", [*SYSTEM, 2], max_tokens=2)
    sched.add_request(b, now)
    return sched, b, now


def test_blocks_evicted_from_the_gpu_are_offloaded_and_onboarded_when_reused():
    sched, b, now = _evicting_run(True)
    kv = sched.kv_cache
    pool = kv.secondary
    # c's seven blocks took the two keyless free blocks and evicted five of a's six cached ones,
    # deepest first: those five are in the host pool, a's first block is still on the GPU.
    assert len(pool) == 5 and pool.stats.num_offloaded_blocks == 5
    assert kv.num_cached_prefix(kv._keys["b"]) == 1
    offloaded = pool.stats.num_offloaded_blocks
    out = step(sched, now)
    # 16 tokens hit on the GPU, 80 onboarded: the context starts at 96 and computes one token.
    assert grants(out) == [("b", 1, 96)] and b.num_cached_tokens == 96
    assert pool.stats.num_onboards == 1 and pool.stats.num_onboarded_tokens == 80
    # The onboarded blocks left the pool and are matchable on the GPU again.
    assert not any(k in pool for k in kv._keys["b"][:6]) and kv.num_cached_prefix(kv._keys["b"]) == 6
    # The forward waited for the longer direction: 80 tokens in, or c's evicted blocks out.
    out_tokens = (pool.stats.num_offloaded_blocks - offloaded) * 16
    assert out.kv_copy_time == pytest.approx(max(80, out_tokens) * SECONDS_PER_TOKEN)
    kv.check_integrity()


def test_without_the_pool_the_evicted_prefix_is_recomputed():
    sched, b, now = _evicting_run(False)
    assert sched.kv_cache.secondary is None
    out = step(sched, now)
    assert grants(out) == [("b", 81, 16)] and b.num_cached_tokens == 16 and out.kv_copy_time == 0.0


def test_the_reuse_rule_sees_blocks_in_host_memory():
    # findNewContextBlock walks the reuse tree, host blocks included: b's first new block is
    # its seventh, as if all six were on the GPU.
    sched, b, _ = _evicting_run(True)
    kv = sched.kv_cache
    assert sched.new_context_block(b) is None  # 97 tokens: six full blocks, all cached somewhere
    longer = token_request("longer", [*SYSTEM, *range(3000, 3020)], max_tokens=1)
    sched.add_request(longer, 0.0)
    assert sched.new_context_block(longer) == kv._keys["longer"][6]


# ---- whole runs --------------------------------------------------------------------------------
def _conversations(seed: int, n: int = 120) -> list[Request]:
    """Sessions whose turns extend their own history, arriving interleaved."""
    rng = np.random.default_rng(seed)
    history = [list(rng.integers(0, 30000, int(rng.integers(200, 600)))) for _ in range(12)]
    out = []
    for i in range(n):
        s = int(rng.integers(0, 12))
        history[s] = history[s] + list(rng.integers(0, 30000, int(rng.integers(10, 80))))
        ids = history[s][-1500:]
        out.append(Request(f"r{i}", len(ids), int(rng.integers(2, 60)), i * 0.03, prompt_token_ids=ids))
    return out


def _run(seed: int, host: bool, fast: bool = True, **flags) -> tuple[Engine, list[Request]]:
    config = TrtllmConfig(host_cache_size=(512 << 20) if host else None, **flags)
    policy = TrtllmPolicy(config)
    cost = CostModel(get_model("Llama-3-8B"), H100, 1)
    policy.bind_cost_model(cost, True)
    blocks = secondary_pool_blocks(512 << 20, cost.model.kv_bytes_per_token(1), 16) if host else 0
    kv = make_kv_cache(policy.kv_spec(), 200, 16, num_host_blocks=blocks)  # small: evicts
    sched = Scheduler(policy, kv, 4096)
    requests = _conversations(seed)
    engine = Engine(sched, SimExecutor(cost, 16), ListSource(requests), options=EngineOptions(fast, True))
    SimDriver(engine).run()
    return engine, requests


@pytest.mark.parametrize(
    "flags",
    [{}, {"disable_overlap_scheduler": False}, {"capacity_scheduler_policy": "MAX_UTILIZATION"},
     {"enable_chunked_prefill": True, "max_num_tokens": 512}],
    ids=["sync", "overlap", "max-utilization", "chunked"],
)  # fmt: skip
def test_every_request_finishes_and_blocks_are_conserved(flags):
    engine, requests = _run(5, True, **flags)  # check_integrity after every step (EngineOptions)
    kv = engine.scheduler.kv_cache
    assert all(r.finish_reason == "length" for r in requests)
    assert kv.num_free_blocks == kv.num_blocks
    stats = kv.secondary.stats
    assert stats.num_onboards > 0 and stats.num_offloaded_blocks > 0 and stats.copy_seconds > 0


def test_the_pool_raises_the_hit_rate_and_lowers_ttft_under_gpu_pressure():
    _, warm = _run(6, True)
    _, cold = _run(6, False)
    ttft = lambda rs: float(np.mean([r.token_times[0] - r.arrival_time for r in rs]))  # noqa: E731
    assert sum(r.num_cached_tokens for r in warm) > 1.3 * sum(r.num_cached_tokens for r in cold)
    assert ttft(warm) < ttft(cold)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_stepping_and_fast_paths_agree_with_the_pool(overlap):
    _, fast = _run(7, True, fast=True, disable_overlap_scheduler=not overlap)
    _, stepped = _run(7, True, fast=False, disable_overlap_scheduler=not overlap)
    assert [tuple(r.token_times) for r in fast] == [tuple(r.token_times) for r in stepped]


# ---- engine flags ------------------------------------------------------------------------------
def test_the_yaml_keys_map_onto_the_policy_and_tune_writes_them_back(tmp_path):
    path = tmp_path / "opts.yaml"
    path.write_text(
        "kv_cache_config:\n  host_cache_size: 68719476736\n  secondary_offload_min_priority: 30\n"
    )
    report = lint(f"trtllm-serve meta-llama/Llama-3.1-8B-Instruct --extra_llm_api_options {path}")
    rows = {row.flag: row for row in report.rows}
    assert rows["opts.yaml:kv_cache_config.host_cache_size"].verdict == SCHEDULING
    assert rows["opts.yaml:kv_cache_config.secondary_offload_min_priority"].verdict == SCHEDULING
    spec = translate(report).spec
    assert spec.flags["host_cache_size"] == 68719476736
    assert spec.flags["secondary_offload_min_priority"] == 30
    line = command_line(spec, Deployment("Llama-3-8B"), None, H100.device_info, 8192)
    assert "host_cache_size: 68719476736" in line and "secondary_offload_min_priority: 30" in line
    assert "host_cache_size" not in command_line(
        PolicySpec.make("trtllm", {}), Deployment("Llama-3-8B"), None, H100.device_info, 8192
    )
