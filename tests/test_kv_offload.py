"""vLLM's native KV offloading (``--kv-offloading-size``): the CPU tier (kv/host_tier.py), the
scheduler's loads (policies/vllm_offload.py), its sizing and its flags."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import grants, step, token_request
from tailserve.assemble.scheduler import build_scheduler
from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.source import ListSource
from tailserve.engines.lint import lint
from tailserve.engines.translate import translate
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.driver import SimDriver
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.kv.factory import make_kv_cache
from tailserve.kv.host_tier import HostKVTier, host_tier_chunks
from tailserve.kv.paged import KVCacheIntegrityError
from tailserve.policies.registry import PolicySpec
from tailserve.policies.vllm import VllmConfig, VllmPolicy

SECONDS_PER_TOKEN = 1e-4  # a made-up host link: 100 us per token, so loads show in the clock


def _sched(
    num_blocks: int, host_blocks: int, async_scheduling: bool = False, budget: int = 2048, **kw
) -> Scheduler:
    config = VllmConfig(budget, 64, kv_offloading_size=1.0, async_scheduling=async_scheduling, **kw)
    policy = VllmPolicy(config)
    policy._offload.seconds_per_token = SECONDS_PER_TOKEN
    kv = make_kv_cache(policy.kv_spec(), num_blocks, 16, num_host_blocks=host_blocks)
    return Scheduler(policy, kv, 4096)


SYSTEM = list(range(1000, 1000 + 96))  # six full blocks


# ---- the tier ------------------------------------------------------------------------------------
def test_tier_evicts_least_recently_used_unpinned_chunks_and_skips_a_store_it_cannot_place():
    tier = HostKVTier(4, 16, 1.0)
    tier.store([1, 2, 3])
    tier.store([2, 4])  # 2 is there already: only 4 is new
    assert [k in tier for k in (1, 2, 3, 4)] == [True] * 4
    tier.store([5])  # full, and every chunk still pending (stored this pass): skipped
    assert 5 not in tier and tier.stats.num_skipped_blocks == 1
    tier.new_pass()  # their stores are done: evictable from now
    tier.store([5])  # full: the oldest (1) goes
    assert 1 not in tier and 5 in tier and tier.stats.num_evicted_blocks == 1
    tier.new_pass()
    tier.pin([2, 3, 4, 5])
    tier.store([6])  # every chunk pinned: skipped, nothing evicted
    assert 6 not in tier and tier.stats.num_skipped_blocks == 2 and len(tier) == 4
    tier.unpin([2, 3, 4, 5])
    tier.touch([3, 4])  # a finished request's chunks: its first (3) newest
    tier.store([7, 8])  # evicts the two oldest: 2, then 5
    assert 2 not in tier and 5 not in tier and {3, 4, 7, 8} <= set(tier._lru)
    tier.new_pass()
    tier.store([9])  # 4 is older than 3 (3 was touched last)
    assert 4 not in tier and 3 in tier
    tier.check_integrity()


def test_under_async_scheduling_a_store_stays_pending_a_pass_longer():
    """vLLM reads a step's store reports after the next step is scheduled: a chunk stored at a
    pass's end is neither found nor evictable in the pass after (``LRUCachePolicy.evict`` takes
    ready chunks only); a lookup that meets it is deferred (None: vLLM's ``HIT_PENDING``)."""
    tier = HostKVTier(1, 16, 1.0)
    tier.pending_passes = 1
    tier.store([1])
    tier.new_pass()
    assert tier.lookup([1], 0, 1) is None
    tier.store([2])  # 1 is still pending: nothing to evict
    assert 2 not in tier and 1 in tier
    tier.new_pass()
    assert tier.lookup([1], 0, 1) == 1
    tier.store([2])
    assert 2 in tier and 1 not in tier


def test_tier_lookup_counts_consecutive_chunks_from_the_start():
    tier = HostKVTier(8, 16, 1.0)
    tier.store([10, 11, 13])
    keys = [9, 10, 11, 12, 13]
    # Stored in this scheduling pass: still being stored until the next (vLLM's store jobs run
    # after it), so the lookup is deferred; a miss before any of them is a plain miss.
    assert tier.lookup(keys, 1, 5) is None
    assert tier.lookup(keys, 0, 5) == 0
    tier.new_pass()
    assert tier.lookup(keys, 1, 5) == 2  # 10, 11; 12 is missing
    assert tier.lookup(keys, 0, 5) == 0
    assert tier.lookup(keys, 4, 5) == 1


def test_a_finished_requests_failed_store_is_offered_once_more_in_the_pass_after():
    """vLLM's ``_build_store_jobs`` walks the requests that finished since the last pass after the
    scheduled ones: a store that found no room (every chunk pinned) is tried once more, and then
    ``on_request_finished`` makes the request's chunks newest, its first block newest of all."""
    tier = HostKVTier(2, 16, 1.0)
    tier.store([1, 2])
    tier.new_pass()
    tier.pin([1, 2])  # loads in flight hold both: nothing to evict
    keys, span, seen = [3, 4], [0, 2, 0], {}
    tier.offer(keys, span, 2, seen)
    tier.new_pass()
    assert 3 not in tier and span == [0, 2, 0]  # skipped; the index stays
    tier.finish(keys, span, 2, seen)
    tier.unpin([1, 2])
    tier.new_pass()  # the pass after the finish: its store jobs are made at its end
    assert 3 not in tier
    tier.new_pass()
    assert list(tier._lru) == [4, 3]
    tier.check_integrity()


def test_a_finished_requests_last_store_is_not_made_twice():
    """The offer a request made in the pass it finished in is stored at that pass's end; the
    finish offers only what is still unstored then (nothing), so a chunk evicted in between
    stays evicted."""
    tier = HostKVTier(1, 16, 1.0)
    span, seen = [0, 1, 0], {}
    tier.offer([3], span, 1, seen)
    tier.finish([3], span, 1, seen)
    tier.new_pass()
    assert 3 in tier and span[0] == 1
    tier.offer([5], [0, 1, 0], 1, {})
    tier.new_pass()  # 5's store evicts 3, then the finish offers nothing
    assert list(tier._lru) == [5]


def test_a_withdrawn_offer_is_not_stored():
    """A request preempted in the pass that offered its blocks gets no store job (vLLM builds
    them for the requests the pass scheduled)."""
    tier = HostKVTier(4, 16, 1.0)
    span = [0, 2, 0]
    tier.offer([1, 2], span, 2, {})
    tier.withdraw(span)
    tier.new_pass()
    assert len(tier) == 0 and span[0] == 0


def test_a_load_reported_done_unpins_its_chunks_before_its_request_is_scheduled():
    """vLLM's ``complete_load`` comes with the worker's report: the loaded chunks can be evicted
    again while their request waits for budget in ``kv_holding_waiting``."""
    config = VllmConfig(128, 64, kv_offloading_size=1.0)
    policy = VllmPolicy(config)
    policy._offload.seconds_per_token = SECONDS_PER_TOKEN
    sched = Scheduler(policy, make_kv_cache(policy.kv_spec(), 256, 16, num_host_blocks=64), 4096)
    sched.add_request(token_request("a", [*SYSTEM, 1], max_tokens=1), 0.0)
    step(sched)
    _evict_gpu(sched)
    b = token_request("b", [*SYSTEM, 2], max_tokens=2)
    sched.add_request(b, 1.0)
    sched.add_request(token_request("long", list(range(7000, 8000)), max_tokens=1), 1.0)
    step(sched, 1.0)  # b loads; long takes the budget, and will for its next seven steps
    assert sched.loading == [b] and sched.kv_cache.host._pins
    step(sched, 1.1)  # b's load (9.6 ms) is done and reported; no budget reaches b
    assert sched.loading == [b] and not sched.kv_cache.host._pins
    sched.kv_cache.check_integrity()


def test_tier_integrity_catches_a_pin_on_a_missing_chunk():
    tier = HostKVTier(2, 16, 1.0)
    tier.pin([42])
    with pytest.raises(KVCacheIntegrityError):
        tier.check_integrity()


def test_capacity_is_vllms_cpu_offloading_spec():
    # Llama-3-8B: 128 KiB of KV per token; a 16-token block is 2 MiB per copy.
    assert host_tier_chunks(64, 16 * 128 * 1024, 1) == 32768
    # TP 2 (GQA): each rank's half-block times two copies: the same chunks in the same GiB.
    assert host_tier_chunks(64, 16 * 64 * 1024, 2) == 32768
    # A chunk is rounded up to a 4 KiB page: 100 bytes still costs a page.
    assert host_tier_chunks(1, 100, 1) == (1 << 30) // 4096
    with pytest.raises(ValueError, match="holds no KV block"):
        HostKVTier(0, 16, 1e-9)


def test_assembled_tier_counts_replicated_mla_blocks_once():
    def blocks(model: str, tp: int, gpu: str = "H200") -> int:
        cost = CostModel(get_model(model), get_hardware(gpu), tp)
        from tailserve.assemble.simulated import simulated_scheduler

        parts = simulated_scheduler(
            cost, PolicySpec.make("vllm", {"kv_offloading_size": 100.0, "max_model_len": 8192}), 8192,
            shares_prefixes=True, cpu_swap=True,
        )  # fmt: skip
        tier = parts.scheduler.kv_cache.host
        assert tier is not None
        return tier.num_blocks

    # GQA: every rank's shard is kept, so TP leaves the chunk count unchanged.
    assert blocks("Llama-3-70B", 2) == blocks("Llama-3-70B", 4)
    # MLA is replicated on every rank: one copy, so a rank's (whole) block fits as many times at any TP.
    assert blocks("DeepSeek-R1-FP4", 8, "B200") == blocks("DeepSeek-R1-FP4", 4, "B200")


def test_the_real_executor_has_no_cpu_tier():
    class Size:
        num_blocks, block_size, kv_bytes_per_token = 100, 16, 1024

    spec = PolicySpec.make("vllm", {"kv_offloading_size": 4.0})
    with pytest.raises(ValueError, match="needs the simulated executor"):
        build_scheduler(
            spec, get_hardware("H100-SXM").device_info, 1024, lambda c: Size(), shares_prefixes=True
        )


def test_offloading_needs_prefix_caching():
    with pytest.raises(ValueError, match="needs prefix caching"):
        VllmConfig(2048, 64, kv_offloading_size=4.0, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="> 0 GiB"):
        VllmConfig(2048, 64, kv_offloading_size=0.0)


# ---- the scheduler's loads -----------------------------------------------------------------------
def _evict_gpu(sched: Scheduler) -> None:
    """Drop every cached block from the GPU pool (what pressure would do)."""
    sched.kv_cache.drop_cached()


def test_a_prefix_evicted_from_the_gpu_is_loaded_from_the_tier_and_not_recomputed():
    sched = _sched(64, 64)
    a = token_request("a", [*SYSTEM, 1, 2, 3], max_tokens=1)
    sched.add_request(a, 0.0)
    assert grants(step(sched)) == [("a", 99, 0)]
    assert a.is_finished
    tier = sched.kv_cache.host
    # Its six full prompt blocks are offered in its step and stored when that pass ends (vLLM
    # builds the store jobs last), i.e. as the next pass begins.
    assert len(tier) == 0
    tier.new_pass()
    assert len(tier) == 6
    _evict_gpu(sched)
    b = token_request("b", [*SYSTEM, 7, 8], max_tokens=2)
    sched.add_request(b, 1.0)
    out = step(sched, 1.0)
    # b is admitted to load its 96 tokens: nothing computed this step, no budget used.
    assert grants(out) == [] and sched.loading == [b] and not sched.waiting
    assert sched.next_wakeup(1.0) == pytest.approx(1.0 + 96 * SECONDS_PER_TOKEN)
    # Not done yet at 1.005: still loading.
    assert grants(step(sched, 1.005)) == [] and sched.loading == [b]
    # Done at 1.0096: back to waiting, then computed from token 96 on.
    assert grants(step(sched, 1.0096)) == [("b", 2, 96)]
    assert b.num_cached_tokens == 96 and tier.stats.num_hits == 96 and tier.stats.num_loads == 1
    assert not tier._pins
    sched.kv_cache.check_integrity()


def test_without_the_tier_the_evicted_prefix_is_recomputed():
    sched = _sched(64, 64)
    sched.kv_cache.host = None  # the same engine, no CPU tier
    sched.policy._offload = None
    a = token_request("a", [*SYSTEM, 1, 2, 3], max_tokens=1)
    sched.add_request(a, 0.0)
    step(sched)
    _evict_gpu(sched)
    b = token_request("b", [*SYSTEM, 7, 8], max_tokens=2)
    sched.add_request(b, 1.0)
    assert grants(step(sched, 1.0)) == [("b", 98, 0)]


def test_a_gpu_hit_is_extended_by_the_tier_and_a_whole_prompt_hit_recomputes_its_last_token():
    sched = _sched(64, 64)
    a = token_request("a", SYSTEM, max_tokens=1)
    sched.add_request(a, 0.0)
    step(sched)
    # Evict only the GPU's last three blocks: b hits three on the GPU, three from the tier.
    pool = sched.kv_cache.pool
    pool.evict(3)
    twin = token_request("twin", list(SYSTEM), max_tokens=1)
    sched.add_request(twin, 1.0)
    step(sched, 1.0)
    assert sched.loading == [twin] and twin.num_computed_tokens == 96
    step(sched, 2.0)
    # All 96 prompt tokens were there: the last one is recomputed to sample (vLLM's rule).
    assert twin.is_finished and twin.num_cached_tokens == 95


def test_a_load_that_does_not_fit_stops_the_pass_and_a_loading_request_does_not_block_others():
    sched = _sched(16, 64)
    a = token_request("a", [*SYSTEM, 1], max_tokens=1)
    sched.add_request(a, 0.0)
    step(sched)
    _evict_gpu(sched)
    b = token_request("b", [*SYSTEM, 2], max_tokens=3)
    c = token_request("c", list(range(5000, 5020)), max_tokens=3)
    sched.add_request(b, 1.0)
    sched.add_request(c, 1.0)
    out = step(sched, 1.0)
    # b loads; the pass goes on to c, which runs now.
    assert sched.loading == [b] and grants(out) == [("c", 20, 0)]
    sched.kv_cache.check_integrity()


def test_async_scheduling_sees_a_finished_load_one_pass_later_while_steps_run():
    sched = _sched(64, 64, async_scheduling=True)
    a = token_request("a", [*SYSTEM, 1], max_tokens=1)
    sched.add_request(a, 0.0)
    while sched.has_unfinished:
        step(sched, 0.0)
    _evict_gpu(sched)
    long = token_request("long", list(range(7000, 7010)), max_tokens=50)
    sched.add_request(long, 1.0)
    step(sched, 1.0)
    b = token_request("b", [*SYSTEM, 2], max_tokens=2)
    sched.add_request(b, 1.01)
    step(sched, 1.01)
    assert sched.loading == [b]
    step(sched, 1.1)  # done by now (1.01 + 9.6 ms), reported by this step
    assert sched.loading == [b]
    out = step(sched, 1.2)  # seen one pass later
    assert "b" in [g[0] for g in grants(out)] and not sched.loading


def _loading(sched: Scheduler) -> Request:
    """A request loading the system prompt from the tier at t=1 (its GPU copy evicted)."""
    sched.add_request(token_request("a", [*SYSTEM, 1], max_tokens=1), 0.0)
    step(sched)
    _evict_gpu(sched)
    b = token_request("b", [*SYSTEM, 2], max_tokens=2)
    sched.add_request(b, 1.0)
    step(sched, 1.0)
    assert sched.loading == [b]
    return b


def test_an_aborted_load_unpins_its_chunks_and_frees_its_blocks_when_the_load_is_done():
    """vLLM keeps the blocks of a request aborted in WAITING_FOR_REMOTE_KVS until the worker
    reports its load (``finish_requests``' ``delay_free_blocks``): the engine wakes then."""
    sched = _sched(64, 64)
    b = _loading(sched)
    assert sched.kv_cache.host._pins
    done = sched.policy.load_done(b)
    assert done is not None and done > 1.001
    assert sched.abort_request("b", "client went away", 1.001) is b
    # Its chunks stay pinned too (vLLM's ``complete_load`` comes with the worker's report).
    assert sched.kv_cache.host._pins and not sched.loading
    assert sched.kv_cache.num_used_blocks > 0 and sched.next_wakeup(1.001) == done
    step(sched, done)
    assert not sched.kv_cache.host._pins
    assert sched.kv_cache.num_used_blocks == 0 and sched.next_wakeup(done) is None
    sched.kv_cache.check_integrity()


def test_a_load_aborted_after_it_is_done_frees_its_blocks_at_once():
    sched = _sched(64, 64)
    b = _loading(sched)
    done = sched.policy.load_done(b)
    assert sched.abort_request("b", "client went away", done + 1e-3) is b
    assert sched.kv_cache.num_used_blocks == 0 and sched.held is None
    sched.kv_cache.check_integrity()


def test_only_prompt_blocks_are_offloaded():
    sched = _sched(64, 64)
    planned = list(range(9000, 9040))
    r = Request("r", 33, 40, 0.0, prompt_token_ids=list(range(2000, 2033)), planned_output_token_ids=planned)
    sched.add_request(r, 0.0)
    now = 0.0
    while sched.has_unfinished:
        step(sched, now)
        now += 0.01
    # 73 tokens had keys (prompt and planned outputs): four full blocks cached on the GPU, two
    # of them the prompt's, and only those two in the tier (offload_prompt_only).
    sched.kv_cache.host.new_pass()
    assert len(sched.kv_cache.host) == 2


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
        out.append(Request(f"r{i}", len(ids), int(rng.integers(2, 60)), i * 0.03, prompt_token_ids=ids,
                           priority=int(rng.integers(0, 3))))  # fmt: skip
    return out


def _run(seed: int, offload: bool, fast: bool = True, **flags) -> tuple[Engine, list[Request]]:
    config = VllmConfig(1024, 32, kv_offloading_size=0.5 if offload else None, **flags)
    policy = VllmPolicy(config)
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    policy.bind_cost_model(cost, True)
    tier = host_tier_chunks(0.5, 16 * cost.model.kv_bytes_per_token(1), 1) if offload else 0
    kv = make_kv_cache(policy.kv_spec(), 200, 16, num_host_blocks=tier)  # small: evicts, preempts
    sched = Scheduler(policy, kv, 4096)
    requests = _conversations(seed)
    engine = Engine(sched, SimExecutor(cost, 16), ListSource(requests), options=EngineOptions(fast, True))
    SimDriver(engine).run()
    return engine, requests


@pytest.mark.parametrize(
    "flags",
    [{}, {"async_scheduling": True}, {"scheduling_policy": "priority"},
     {"async_scheduling": True, "scheduling_policy": "priority", "watermark": 0.05}],
    ids=["sync", "async", "priority", "async-priority-watermark"],
)  # fmt: skip
def test_every_request_finishes_blocks_are_conserved_and_pins_released(flags):
    engine, requests = _run(5, True, **flags)  # check_integrity after every step (EngineOptions)
    sched = engine.scheduler
    assert all(r.finish_reason == "length" for r in requests)
    assert not sched.loading and not sched.kv_cache.host._pins
    kv = sched.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.host.stats.num_loads > 0 and kv.host.stats.num_hits > 0


def test_the_tier_raises_the_hit_rate_and_lowers_ttft_under_gpu_pressure():
    _, warm = _run(6, True)
    _, cold = _run(6, False)
    ttft = lambda rs: float(np.mean([r.token_times[0] - r.arrival_time for r in rs]))  # noqa: E731
    assert sum(r.num_cached_tokens for r in warm) > 1.3 * sum(r.num_cached_tokens for r in cold)
    assert ttft(warm) < ttft(cold)


def test_stepping_and_fast_paths_agree_with_the_tier():
    _, fast = _run(7, True, fast=True)
    _, stepped = _run(7, True, fast=False)
    assert [tuple(r.token_times) for r in fast] == [tuple(r.token_times) for r in stepped]


def test_an_idle_engine_wakes_when_a_load_is_done():
    config = VllmConfig(2048, 64, kv_offloading_size=1.0, async_scheduling=False)
    policy = VllmPolicy(config)
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    policy.bind_cost_model(cost, True)
    kv = make_kv_cache(policy.kv_spec(), 64, 16, num_host_blocks=64)
    sched = Scheduler(policy, kv, 4096)
    first = token_request("a", [*SYSTEM, 1], max_tokens=1, t=0.0)
    second = token_request("b", [*SYSTEM, 2], max_tokens=1, t=5.0)
    engine = Engine(
        sched, SimExecutor(cost, 16), ListSource([first, second]), options=EngineOptions(False, True)
    )
    # Evict the GPU copy between the two: the second must load from the tier.
    while not first.is_finished:
        engine.step()
    kv.drop_cached()
    SimDriver(engine).run()
    assert second.num_cached_tokens == 96 and kv.host.stats.num_loads == 1
    load = 96 * cost.swap_time(1)
    assert kv.host.stats.load_seconds == pytest.approx(load)
    # TTFT: the load, then one step computing one token on 96 of context.
    one = cost.prefill_time(1, 96)
    assert second.token_times[0] - second.arrival_time == pytest.approx(load + one, rel=1e-6)


# ---- engine flags ------------------------------------------------------------------------------
def test_vllm_line_maps_the_native_tier_and_says_what_it_does_not_model():
    line = "vllm serve meta-llama/Llama-3.1-8B-Instruct --kv-offloading-size 64"
    assert translate(lint(line)).spec.flags["kv_offloading_size"] == 64.0
    verdicts = lambda text: {r.flag: r.verdict for r in lint(text).rows}  # noqa: E731
    assert verdicts(line)["--kv-offloading-size"] == "scheduling"
    lm = verdicts(line + " --kv-offloading-backend lmcache")
    assert lm["--kv-offloading-size"] == lm["--kv-offloading-backend"] == "not modelled"
    assert "kv_offloading_size" not in translate(lint(line + " --kv-offloading-backend lmcache")).spec.flags
    assert verdicts("vllm serve m --kv-offloading-backend native")["--kv-offloading-backend"] == "no-op"
    simple = "VLLM_USE_SIMPLE_KV_OFFLOAD=1 " + line
    assert verdicts(simple)["--kv-offloading-size"] == "not modelled"


# ---- a live engine (serve --executor sim) ------------------------------------------------------
def test_a_live_simulated_engine_counts_tier_loads_as_vllms_external_hits(tmp_path):
    from tailserve.llm import LLMEngine, SamplingParams
    from torch_helpers import micro_model

    engine = LLMEngine.from_args(
        str(micro_model(tmp_path)), executor="sim", hardware="H100-SXM", sim_model="Llama-3-8B",
        policy="vllm", policy_flags={"kv_offloading_size": 1.0},
    )  # fmt: skip
    prompt = list(range(100, 140))  # 40 tokens: two full blocks

    def serve(rid: str) -> None:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()

    serve("first")
    engine.scheduler.kv_cache.drop_cached()  # gone from the GPU, still in the tier
    serve("second")
    stats = engine.stats()
    # The second request's two blocks came from the tier (vLLM's external counters), none from
    # the GPU cache; its own lookup past the GPU hit asked for its whole prompt.
    assert (stats.external_prefix_cache_hits, stats.prefix_cache_hits) == (32, 0)
    assert stats.external_prefix_cache_queries == 2 * len(prompt)


def test_explain_charges_the_load_wait_to_its_own_cause():
    from tailserve.metrics.attribution import KV_LOAD, Attributor

    config = VllmConfig(2048, 64, kv_offloading_size=1.0, async_scheduling=False)
    policy = VllmPolicy(config)
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    policy.bind_cost_model(cost, True)
    kv = make_kv_cache(policy.kv_spec(), 64, 16, num_host_blocks=64)
    sched = Scheduler(policy, kv, 4096)
    first = token_request("a", [*SYSTEM, 1], max_tokens=1, t=0.0)
    second = token_request("b", [*SYSTEM, 2], max_tokens=1, t=5.0)
    options = EngineOptions(False, True, record_batches=True)
    engine = Engine(sched, SimExecutor(cost, 16), ListSource([first, second]), options=options)
    while not first.is_finished:
        engine.step()
    kv.drop_cached()
    SimDriver(engine).run()
    start, end, loaded = second.kv_load
    assert loaded == 96
    assert start == pytest.approx(5.0) and end - start == pytest.approx(96 * cost.swap_time(1))
    breakdown = Attributor(engine.requests, engine.batches, "vllm").ttft(second)
    assert breakdown.components[KV_LOAD] == pytest.approx(end - start)
    assert sum(breakdown.components.values()) == pytest.approx(breakdown.seconds)
    assert first.kv_load is None


def test_a_workload_without_token_identities_runs_without_a_tier_and_says_so():
    from tailserve.executors.simulated.deployment import Deployment, build_cost_model
    from tailserve.sim.run import run_policy
    from tailserve.sim.workload_builder import WorkloadBuilder
    from tailserve.sim.workload_spec import WorkloadSpec

    built = build_cost_model(Deployment("Llama-3-8B", "H100-SXM", 1, "none"))
    workload = WorkloadBuilder(WorkloadSpec("chat", num_requests=20))  # bare lengths
    for flags in ({"async_scheduling": False}, {}):
        run = run_policy(built, PolicySpec.make("vllm", {"kv_offloading_size": 4.0, **flags}), workload)
        assert all(r.finish_reason == "length" for r in run.requests)
        assert any("no token identities" in note for note in run.notes)
