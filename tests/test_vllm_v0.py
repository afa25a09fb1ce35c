"""Behaviour of the vLLM V0 policy against ``shared/reference/policies.md`` §2.

Most tests drive the policy directly through ``Scheduler.schedule`` / ``Scheduler.update`` with a
hand-sized KV cache (often ``block_size=1`` so that blocks = tokens), so every grant, victim,
queue position and block count below is an exact number worked out from the rules. The
whole-run tests use the simulated executor with ``check_integrity=True``.

Watermark: ``int(watermark * num_blocks)`` blocks, 1% by default — 0 for caches under 100 blocks,
which is why the tests that are not about the watermark use small caches.
"""

from __future__ import annotations

import random

import pytest

from helpers import grants as _grants
from helpers import ids as _ids
from helpers import step as _step
from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.executor import StepResult
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import SchedulerOutput
from tailserve.core.source import ListSource
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.driver import SimDriver
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.kv.paged import KVCacheManager
from tailserve.policies.vllm_v0 import VllmV0Config, VllmV0Policy
from tailserve.workloads.arrivals import ClosedLoopSource

SWAP_ABORT = "Aborted due to the lack of CPU swap space"

# ---- helpers ------------------------------------------------------------------------------


def _v0(num_blocks: int, block_size: int = 16, num_cpu_blocks: int = 0, **cfg) -> Scheduler:
    cfg.setdefault("max_num_batched_tokens", 4096)
    kv = KVCacheManager(num_blocks, block_size, num_cpu_blocks)
    return Scheduler(VllmV0Policy(VllmV0Config(**cfg)), kv, 4096)


def _add(
    sched: Scheduler, rid: str, prompt: int, max_tokens: int, now: float = 0.0, priority: int = 0
) -> Request:
    request = Request(rid, prompt, max_tokens, now, priority=priority)
    assert sched.add_request(request, now)
    return request


def _cost_model() -> CostModel:
    return CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)


def _engine(sched: Scheduler, requests: list[Request], fast_forward: bool = True) -> Engine:
    executor = SimExecutor(_cost_model(), sched.kv_cache.block_size)
    options = EngineOptions(fast_forward=fast_forward, check_integrity=True)
    return Engine(sched, executor, ListSource(requests), options=options)


# ---- 1. default mode: prefill-only or decode-only iterations -------------------------------


def test_admission_iteration_is_prefill_only_and_schedules_whole_prompts():
    sched = _v0(1000)
    _add(sched, "a", 10, 20)
    _add(sched, "b", 10, 20)
    assert _grants(_step(sched)) == [("a", 10, 0), ("b", 10, 0)]
    assert _grants(_step(sched)) == [("a", 1, 10), ("b", 1, 10)]

    # A 3000-token prompt arrives: it is prefilled whole (no chunking), and a and b get nothing
    # in that iteration — the generation stall.
    _add(sched, "c", 3000, 5)
    out = _step(sched)
    assert _grants(out) == [("c", 3000, 0)]
    assert out.num_admitted == 1
    assert out.num_decode_tokens == 0
    assert sched.kv_cache.num_held("c") == 3000 // 16 + 1  # blocks for the whole prompt
    assert _grants(_step(sched)) == [("a", 1, 11), ("b", 1, 11), ("c", 1, 3000)]


def _random_requests(seed: int, n: int, max_prompt: int, max_output: int) -> list[Request]:
    rng = random.Random(seed)
    t = 0.0
    requests = []
    for i in range(n):
        t += rng.expovariate(100.0)
        # Prompts of >= 2 tokens: a 1-token prompt would count as a "decode" in the log.
        requests.append(Request(f"r{i}", rng.randint(2, max_prompt), rng.randint(1, max_output), t))
    return requests


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_default_mode_never_mixes_prefill_and_decode_over_a_whole_run(preemption_mode):
    sched = _v0(48, num_cpu_blocks=200, preemption_mode=preemption_mode)
    requests = _random_requests(seed=3, n=60, max_prompt=300, max_output=120)
    engine = _engine(sched, requests)
    SimDriver(engine).run()
    log = engine.log
    prefill_iterations = decode_iterations = 0
    for p, d in zip(log.num_prefill_tokens, log.num_decode_tokens):
        assert p == 0 or d == 0, (p, d)
        prefill_iterations += p > 0
        decode_iterations += d > 0
    assert prefill_iterations > 0 and decode_iterations > 0
    # Every prompt was prefilled (whole; more if recomputed after a preemption).
    assert sum(log.num_prefill_tokens) >= sum(r.prompt_len for r in requests)
    assert sched.num_preemptions > 0  # the cache is small enough to preempt
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)


# ---- 2. admission: whole prompt + watermark, HOL, NEVER, budget, max_num_seqs --------------


@pytest.mark.parametrize(("prompt", "admitted"), [(752, True), (753, False)])
def test_admission_needs_whole_prompt_blocks_plus_one_percent_watermark(prompt, admitted):
    # 200 blocks of 4 tokens: watermark = int(0.01 * 200) = 2 blocks.
    sched = _v0(200, block_size=4)
    _add(sched, "a", 40, 20)  # 10 blocks
    _step(sched)
    assert sched.kv_cache.num_free_blocks == 190
    # 752 tokens = 188 blocks: 190 - 188 = 2 >= 2, admitted; 753 tokens = 189 blocks: 1 < 2, LATER.
    _add(sched, "b", prompt, 1)
    _add(sched, "c", 4, 1)  # 1 block, behind b
    out = _step(sched)
    if admitted:
        assert _grants(out) == [("b", prompt, 0)]
        # c would leave 2 - 1 = 1 < 2 free blocks: it waits too.
        assert _ids(sched.waiting) == ["c"]
    else:
        # b blocks the queue (head-of-line): c, which fits, is not tried; a decodes instead.
        assert _grants(out) == [("a", 1, 40)]
        assert _ids(sched.waiting) == ["b", "c"]
        assert sched.kv_cache.num_free_blocks == 189  # a's 11th block


@pytest.mark.parametrize(("prompt", "never"), [(792, False), (793, True)])
def test_prompt_that_can_never_fit_under_the_watermark_is_aborted_with_a_reason(prompt, never):
    # 200 blocks of 4: a 198-block prompt leaves exactly the 2-block watermark; 199 never can.
    sched = _v0(200, block_size=4)
    big = _add(sched, "big", prompt, 1)
    _add(sched, "small", 4, 1)
    out = _step(sched)
    if never:
        assert big.status is RequestStatus.FINISHED_ABORTED
        assert big.status_reason == (
            "Input prompt (793 tokens) is too long and exceeds the capacity of block_manager"
        )
        assert big in sched.finished and not big.token_times
        # The walk goes on past an aborted prompt.
        assert _grants(out) == [("small", 4, 0)]
    else:
        assert _grants(out) == [("big", 792, 0)]
        assert big.status is RequestStatus.FINISHED_LENGTH
        assert _ids(sched.waiting) == ["small"]  # 200 - 198 - 1 = 1 < 2


def test_token_budget_stops_admission():
    sched = _v0(1000, max_num_batched_tokens=1000)
    for rid, prompt in (("a", 600), ("b", 600), ("c", 100)):
        _add(sched, rid, prompt, 3)
    out = _step(sched)
    # b's whole prompt (600) exceeds the 400 left: admission stops, c is not tried.
    assert _grants(out) == [("a", 600, 0)]
    assert _ids(sched.waiting) == ["b", "c"]
    assert _grants(_step(sched)) == [("b", 600, 0), ("c", 100, 0)]


def test_max_num_seqs_stops_admission():
    sched = _v0(1000, max_num_seqs=2)
    for rid in "abc":
        _add(sched, rid, 10, 3)
    assert _grants(_step(sched)) == [("a", 10, 0), ("b", 10, 0)]
    out = _step(sched)
    assert _grants(out) == [("a", 1, 10), ("b", 1, 10)]
    assert out.num_admitted == 0
    assert _ids(sched.waiting) == ["c"]


# ---- 3. decode preemption: tail victim, recompute vs swap, swap cost -----------------------


def _three_full_prompts(**cfg) -> Scheduler:
    """10 blocks of 4 tokens; a, b, c hold 3 blocks each (12-token prompts) and 1 is free.
    In the next iteration a takes the last block and b preempts the tail, c."""
    sched = _v0(10, block_size=4, **cfg)
    for rid in "abc":
        _add(sched, rid, 12, 10)
    assert _grants(_step(sched)) == [("a", 12, 0), ("b", 12, 0), ("c", 12, 0)]
    assert sched.kv_cache.num_free_blocks == 1
    _add(sched, "d", 36, 1)  # 9 blocks: LATER, so the next iteration decodes
    return sched


def test_recompute_preempts_the_tail_to_the_front_of_waiting():
    sched = _three_full_prompts(preemption_mode="recompute")
    c = sched.running[2]
    out = _step(sched)
    assert _grants(out) == [("a", 1, 12), ("b", 1, 12)]
    assert out.preempted == [c]
    assert not out.swapped_out and not sched.swapped
    assert _ids(sched.waiting) == ["c", "d"]  # in front of d, which was waiting already
    assert c.status is RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert sched.kv_cache.num_held("c") == 0
    assert sched.kv_cache.num_free_blocks == 2  # 3 freed, 1 taken by b


@pytest.mark.parametrize("preemption_mode", ["auto", "recompute"])
def test_auto_mode_recomputes_single_sequence_requests(preemption_mode):
    sched = _three_full_prompts(preemption_mode=preemption_mode)
    out = _step(sched)
    assert _ids(out.preempted) == ["c"] and not out.swapped_out


def test_swap_moves_the_tails_blocks_to_the_cpu_pool_and_prices_the_copy():
    sched = _three_full_prompts(preemption_mode="swap", num_cpu_blocks=8)
    kv = sched.kv_cache
    c = sched.running[2]
    out = sched.schedule(0.0)
    assert _grants(out) == [("a", 1, 12), ("b", 1, 12)]
    assert out.swapped_out == [c] and not out.preempted
    assert out.num_swap_out_blocks == 3
    assert list(sched.swapped) == [c] and c not in sched.running
    assert c.status is RequestStatus.SWAPPED and c.num_preemptions == 1
    assert c.num_computed_tokens == 12  # nothing to recompute
    assert kv.num_free_cpu_blocks == 5 and kv.is_swapped("c")
    assert kv.num_held("c") == 0 and kv.num_free_blocks == 2
    assert _ids(sched.waiting) == ["d"]

    # The iteration waits for the PCIe copy of 3 blocks x 4 tokens.
    cost = _cost_model()
    executor = SimExecutor(cost, 4)
    without_copy = SchedulerOutput(scheduled=list(out.scheduled))
    swap = cost.swap_time(3 * 4)
    assert swap > 0
    assert executor.execute(out).duration == executor.execute(without_copy).duration + swap


# ---- 4. the swapped queue: blocks new prefills; swap-in rules ------------------------------


def test_swapped_request_blocks_new_prefills_and_swaps_in_before_them():
    sched = _v0(10, block_size=4, num_cpu_blocks=8, preemption_mode="swap")
    _add(sched, "a", 12, 2)
    _add(sched, "b", 12, 10)
    _add(sched, "c", 12, 10)
    _step(sched)
    out = _step(sched)  # a takes the last block, b swaps c out; a finishes (2 tokens)
    assert _ids(out.swapped_out) == ["c"] and _grants(out) == [("a", 1, 12), ("b", 1, 12)]
    assert sched.kv_cache.num_free_blocks == 6  # 2 + a's 4

    _add(sched, "d", 4, 1)  # 1 block: it fits (6 - 1 >= 0), but c is swapped out
    out = _step(sched)
    # No prefill; b decodes, then c comes back (3 blocks + 0 watermark + 1 <= 6) and decodes in
    # this same iteration (its 4th block is allocated for its next token).
    assert _grants(out) == [("b", 1, 13), ("c", 1, 12)]
    assert out.num_admitted == 0 and _ids(out.swapped_in) == ["c"]
    assert out.num_swap_in_blocks == 3
    assert _ids(sched.waiting) == ["d"] and not sched.swapped
    assert sched.kv_cache.num_free_cpu_blocks == 8
    assert sched.kv_cache.num_held("c") == 4

    out = _step(sched)  # nothing swapped any more: d is admitted (a prefill-only iteration)
    assert _grants(out) == [("d", 4, 0)]


@pytest.mark.parametrize(("watermark", "swapped_in"), [(0.01, True), (0.02, False)])
def test_swap_in_needs_its_blocks_plus_watermark_plus_one(watermark, swapped_in):
    # 100 blocks of 1 token (every next token needs a new block); watermark 1 or 2 blocks.
    sched = _v0(100, block_size=1, num_cpu_blocks=100, preemption_mode="swap", watermark=watermark)
    _add(sched, "a", 3, 3)
    _add(sched, "b", 54, 40)
    _add(sched, "c", 40, 40)
    assert _grants(_step(sched)) == [("a", 3, 0), ("b", 54, 0), ("c", 40, 0)]  # 3 free
    assert _grants(_step(sched)) == [("a", 1, 3), ("b", 1, 54), ("c", 1, 40)]  # 0 free
    out = _step(sched)  # a needs a block: c (tail, 41 blocks) is swapped out; a finishes
    assert _grants(out) == [("a", 1, 4), ("b", 1, 55)]
    assert out.num_swap_out_blocks == 41
    assert sched.kv_cache.num_free_blocks == 44

    out = _step(sched)
    # b's decode leaves 43 free: c needs 41 + watermark + 1 = 43 (watermark 1) or 44 (2).
    if swapped_in:
        assert _grants(out) == [("b", 1, 56), ("c", 1, 41)]
        assert out.num_swap_in_blocks == 41
        assert sched.kv_cache.num_free_blocks == 1
    else:
        assert _grants(out) == [("b", 1, 56)]
        assert not out.swapped_in and _ids(sched.swapped) == ["c"]
        assert sched.kv_cache.num_free_blocks == 43


def _swap_out_by_hand(sched: Scheduler, *rids: str) -> None:
    """Park running requests in the swapped queue (the mechanics the policy uses), to set up a
    swapped queue of a given order and size."""
    for rid in rids:
        request = next(r for r in sched.running if r.request_id == rid)
        assert sched.preempt_by_swap(request, SchedulerOutput())


def test_swap_in_is_fcfs_and_a_head_that_does_not_fit_blocks_the_rest():
    sched = _v0(40, block_size=1, num_cpu_blocks=40, preemption_mode="swap")
    _add(sched, "a", 31, 3)
    _add(sched, "c", 8, 20)
    _add(sched, "b", 1, 20)
    _step(sched)  # 40 blocks in use
    _swap_out_by_hand(sched, "c", "b")  # swapped: [c (8 blocks), b (1 block)]; 9 free
    out = _step(sched)
    # a's decode leaves 8 free: c needs 8 + 1 = 9, so nothing comes back — not even b (1 + 1).
    assert _grants(out) == [("a", 1, 31)]
    assert not out.swapped_in and _ids(sched.swapped) == ["c", "b"]
    out = _step(sched)  # a finishes (3 tokens) after this one; 7 free still blocks c
    assert _grants(out) == [("a", 1, 32)] and not out.swapped_in
    out = _step(sched)  # 40 free: c first, then b; both decode in this iteration
    assert _grants(out) == [("c", 1, 8), ("b", 1, 1)]
    assert _ids(out.swapped_in) == ["c", "b"]
    assert out.num_swap_in_blocks == 9


def test_no_swap_in_in_an_iteration_that_preempted():
    sched = _v0(30, block_size=1, num_cpu_blocks=40, preemption_mode="swap")
    _add(sched, "x", 2, 20)
    _add(sched, "a", 6, 20)
    _add(sched, "b", 20, 10)
    _step(sched)  # 28 in use
    _swap_out_by_hand(sched, "x")  # swapped [x (2 blocks)]; 4 free
    assert _grants(_step(sched)) == [("a", 1, 6), ("b", 1, 20)]  # x needs 2 + 1 > 2 free
    assert _ids(sched.swapped) == ["x"] and sched.kv_cache.num_free_blocks == 2
    assert _grants(_step(sched)) == [("a", 1, 7), ("b", 1, 21)]
    # Now 0 free: a's block comes from swapping out the tail b (22 blocks). x would fit in what
    # is left (21 free >= 2 + 1) but nothing is swapped in while preempting.
    out = _step(sched)
    assert _grants(out) == [("a", 1, 8)]
    assert _ids(out.swapped_out) == ["b"] and not out.swapped_in
    assert _ids(sched.swapped) == ["x", "b"]
    assert sched.kv_cache.num_free_blocks == 21
    out = _step(sched)  # no preemption: x comes back (3 of the 20 free); b (22 + 1) cannot
    assert _ids(out.swapped_in) == ["x"] and _ids(sched.swapped) == ["b"]
    assert _grants(out) == [("a", 1, 9), ("x", 1, 2)]


def test_swapped_request_whose_next_token_fits_its_last_block_comes_back():
    # 100 blocks of 2 tokens, watermark 1. b (196-token prompt, 98 blocks) grows to 99 blocks
    # (197 tokens computed: its next token fits block 99); a (1 block) then needs its 2nd block
    # and swaps b out. Once a finishes, all 100 blocks are free: b needs 99 (+ watermark 1 =
    # 100) and must come back; the policy asks 99 + 1 + 1 = 101 and stalls.
    sched = _v0(100, block_size=2, num_cpu_blocks=200, preemption_mode="swap")
    requests = [Request("a", 1, 6, 0.0), Request("b", 196, 4, 0.001)]
    SimDriver(_engine(sched, requests)).run()
    assert [r.status for r in requests] == [RequestStatus.FINISHED_LENGTH] * 2


# ---- 5. CPU pool full ----------------------------------------------------------------------


def test_cpu_pool_full_aborts_the_victim_and_the_run_goes_on():
    sched = _three_full_prompts(preemption_mode="swap", num_cpu_blocks=2)
    c = sched.running[2]
    out = _step(sched)
    # c's 3 blocks do not fit the 2-block CPU pool: c is aborted (vLLM would stop the engine).
    assert _grants(out) == [("a", 1, 12), ("b", 1, 12)]
    assert not out.swapped_out and not out.preempted and not sched.swapped
    assert c.status is RequestStatus.FINISHED_ABORTED and c.status_reason == SWAP_ABORT
    assert c in sched.finished and c not in sched.running
    assert sched.kv_cache.num_held("c") == 0 and sched.kv_cache.num_free_cpu_blocks == 2

    # The same as a whole run: the others finish (a and b need 5 blocks each at most), blocks
    # are conserved.
    sched = _v0(10, block_size=4, num_cpu_blocks=2, preemption_mode="swap")
    requests = [Request(rid, 12, 8, 0.0) for rid in "abc"]
    SimDriver(_engine(sched, requests)).run()
    assert [r.status for r in requests] == [
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
    ]
    assert requests[2].status_reason == SWAP_ABORT
    assert [r.num_output_tokens for r in requests] == [8, 8, 1]
    assert sched.kv_cache.num_free_blocks == 10 and sched.kv_cache.num_free_cpu_blocks == 2


def test_policy_aborted_request_is_reported_to_the_source():
    sched = _v0(200, block_size=4)
    requests = [Request("big", 793, 1, 0.0), Request("r1", 10, 2, 0.0), Request("r2", 10, 2, 0.0)]
    engine = Engine(
        sched,
        SimExecutor(_cost_model(), 4),
        ClosedLoopSource(requests, concurrency=1),
        options=EngineOptions(check_integrity=True),
    )
    SimDriver(engine).run()
    assert requests[0].status is RequestStatus.FINISHED_ABORTED
    assert [r.status for r in requests[1:]] == [RequestStatus.FINISHED_LENGTH] * 2


# ---- 6. chunked-prefill mode ---------------------------------------------------------------


def _chunked(num_blocks: int = 1000, **cfg) -> Scheduler:
    cfg.setdefault("max_num_seqs", 8)
    return _v0(num_blocks, enable_chunked_prefill=True, **cfg)


def test_chunked_decodes_first_then_running_chunk_then_new_prompts_with_the_leftover():
    sched = _chunked(max_num_batched_tokens=64)
    _add(sched, "d0", 10, 50)
    _add(sched, "d1", 10, 50)
    assert _grants(_step(sched)) == [("d0", 10, 0), ("d1", 10, 0)]
    long = _add(sched, "long", 200, 5)
    out = _step(sched)
    assert _grants(out) == [("d0", 1, 10), ("d1", 1, 10), ("long", 62, 0)]
    # KV for the whole prompt is allocated at admission (V0 allocates prompts whole).
    assert sched.kv_cache.num_held("long") == 13

    _add(sched, "small", 30, 5)
    out = _step(sched)
    assert _grants(out) == [("d0", 1, 11), ("d1", 1, 11), ("long", 62, 62)]
    assert _ids(sched.waiting) == ["small"]
    assert _grants(_step(sched)) == [("d0", 1, 12), ("d1", 1, 12), ("long", 62, 124)]
    out = _step(sched)  # the last 14 of the prompt, and small gets 64 - 2 - 14 = 48 >= 30
    assert _grants(out) == [("d0", 1, 13), ("d1", 1, 13), ("long", 14, 186), ("small", 30, 0)]
    assert long.num_output_tokens == 1
    assert out.num_prefill_tokens == 44 and out.num_decode_tokens == 2  # a hybrid batch


def test_chunked_running_pass_stops_when_the_budget_is_spent_and_reorders_decodes_first():
    sched = _chunked(max_num_batched_tokens=100, max_num_partial_prefills=2)
    _add(sched, "A", 300, 5)
    _add(sched, "B", 30, 5)
    # Two schedulable prefills: each gets at most 100 // 2 = 50.
    assert _grants(_step(sched)) == [("A", 50, 0), ("B", 30, 0)]
    assert _ids(sched.running) == ["A", "B"]
    out = _step(sched)
    # A (the only prefill now: a 100-token slot) takes the whole budget; B, granted 0, ends the
    # pass without decoding.
    assert _grants(out) == [("A", 100, 50)]
    # Running is rebuilt decodes first, so next iteration B decodes before A's chunk.
    assert _ids(sched.running) == ["B", "A"]
    assert _grants(_step(sched)) == [("B", 1, 30), ("A", 99, 150)]


def test_chunked_reorder_puts_finishing_prefills_before_unfinished_ones():
    sched = _chunked(max_num_batched_tokens=100, max_num_partial_prefills=2)
    _add(sched, "Q", 300, 5)
    _add(sched, "P", 120, 5)
    assert _grants(_step(sched)) == [("Q", 50, 0), ("P", 50, 0)]
    assert _grants(_step(sched)) == [("Q", 50, 50), ("P", 50, 50)]
    assert _ids(sched.running) == ["Q", "P"]
    _add(sched, "R", 10, 5)
    out = _step(sched)
    # Two prefill slots of 50: Q 50, P its last 20, then the new R 10 of the 30 left.
    assert _grants(out) == [("Q", 50, 100), ("P", 20, 100), ("R", 10, 0)]
    # P finished its prompt in this iteration, Q did not: P moves ahead of Q; R stays last.
    assert _ids(sched.running) == ["P", "Q", "R"]
    # So P's first decode comes before Q's chunk (one prefill left: a 100-token slot).
    assert _grants(_step(sched)) == [("P", 1, 120), ("Q", 99, 150)]


def _partial(max_num_partial_prefills: int) -> Scheduler:
    return _chunked(
        max_num_batched_tokens=200,
        max_num_partial_prefills=max_num_partial_prefills,
        max_long_partial_prefills=1,
        long_prefill_token_threshold=50,
    )


def test_partial_prefills_hold_back_a_second_long_prompt_so_a_short_one_overtakes():
    sched = _partial(2)
    for rid, prompt in (("L1", 300), ("L2", 300), ("S", 40)):
        _add(sched, rid, prompt, 5)
    out = _step(sched)
    # Two slots of 200 // 2 = 100. L2 is long while L1 (long) runs: held back, S overtakes.
    assert _grants(out) == [("L1", 100, 0), ("S", 40, 0)]
    assert _ids(sched.waiting) == ["L2"]
    out = _step(sched)
    # PartialPrefillMetadata.from_queues now counts one schedulable prefill (L1; L2 is a long
    # prompt over the limit), so L1's slot is the whole budget and S, behind it in `running`,
    # gets 0 tokens: the running pass stops there.
    assert _grants(out) == [("L1", 200, 100)]
    assert _ids(sched.waiting) == ["L2"]  # still held back: L1 is still a long prefill


def test_one_partial_prefill_does_not_hold_long_prompts_back():
    sched = _partial(1)
    for rid, prompt in (("L1", 300), ("L2", 300), ("S", 40)):
        _add(sched, rid, prompt, 5)
    assert _grants(_step(sched)) == [("L1", 200, 0)]
    assert _grants(_step(sched)) == [("L1", 100, 200), ("L2", 100, 0)]
    assert _ids(sched.waiting) == ["S"]


def test_held_back_long_prompt_does_not_take_a_prefill_slot():
    sched = _partial(2)
    _add(sched, "L1", 300, 5)
    _add(sched, "L2", 300, 5)
    out = _step(sched)
    assert _grants(out) == [("L1", 200, 0)]
    assert _ids(sched.waiting) == ["L2"]


def test_chunked_swapped_in_decodes_go_first_in_running():
    sched = _chunked(30, block_size=1, num_cpu_blocks=40, preemption_mode="swap", max_num_batched_tokens=64)
    _add(sched, "x", 2, 20)
    _add(sched, "a", 6, 20)
    _add(sched, "b", 6, 20)
    _step(sched)
    _swap_out_by_hand(sched, "x")
    out = _step(sched)
    assert _ids(out.swapped_in) == ["x"]
    assert _grants(out) == [("a", 1, 6), ("b", 1, 6), ("x", 1, 2)]
    assert _ids(sched.running) == ["x", "a", "b"]


# ---- 7. defaults ---------------------------------------------------------------------------


def test_default_config_short_context_is_prefill_first_with_budget_max_model_len():
    device = get_hardware("A100-80GB").device_info
    cfg = VllmV0Policy.default_config(device, 8192)
    assert cfg.enable_chunked_prefill is False
    assert cfg.max_num_batched_tokens == 8192
    assert cfg.max_num_seqs == 256
    assert cfg.swap_space == 4.0
    assert cfg.watermark == 0.01
    assert cfg.preemption_mode == "auto" and cfg.scheduling_policy == "fcfs"
    assert cfg.max_num_partial_prefills == 1 and cfg.long_prefill_token_threshold == 0
    assert VllmV0Policy.default_config(device, 1024).max_num_batched_tokens == 2048  # floor


def test_default_config_long_context_turns_chunking_on_with_budget_2048():
    device = get_hardware("A100-80GB").device_info
    cfg = VllmV0Policy.default_config(device, 65536)
    assert cfg.enable_chunked_prefill is True
    assert cfg.max_num_batched_tokens == 2048
    # 32K exactly is not "above 32K".
    assert VllmV0Policy.default_config(device, 32768).enable_chunked_prefill is False


def test_default_config_partial_prefills_set_the_long_threshold_to_4_percent():
    device = get_hardware("A100-80GB").device_info
    cfg = VllmV0Policy.default_config(device, 8192, enable_chunked_prefill=True, max_num_partial_prefills=2)
    assert cfg.long_prefill_token_threshold == int(0.04 * 8192) == 327
    assert cfg.max_num_batched_tokens == 2048
    explicit = VllmV0Policy.default_config(
        device,
        8192,
        enable_chunked_prefill=True,
        max_num_partial_prefills=2,
        long_prefill_token_threshold=100,
    )
    assert explicit.long_prefill_token_threshold == 100


def test_default_config_rejects_a_budget_below_max_model_len_without_chunking():
    device = get_hardware("A100-80GB").device_info
    with pytest.raises(ValueError, match="smaller than max_model_len"):
        VllmV0Policy.default_config(device, 8192, max_num_batched_tokens=4096)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"preemption_mode": "evict"}, "preemption_mode"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
        ({"max_num_batched_tokens": 100, "max_num_seqs": 256}, "greater than or equal to max_num_seqs"),
        ({"watermark": 1.0}, "watermark"),
        ({"swap_space": -1.0}, "swap_space"),
        ({"max_num_partial_prefills": 0}, "max_num_partial_prefills"),
    ],
)
def test_config_validation(flags, message):
    flags.setdefault("max_num_batched_tokens", 4096)
    with pytest.raises(ValueError, match=message):
        VllmV0Config(**flags)


# ---- 8. priority preemption (default mode) -------------------------------------------------


def _priority_setup(
    head_prompt: int, head_priority: int = 0, head_arrival: float = 0.5
) -> tuple[Scheduler, Request]:
    """10 blocks of 4: x (priority 1), y (5), z (3) hold 3 blocks each, 10-token prompts (their
    decodes need no new block); 1 block free. Then the head h arrives. The first prefill takes
    them in arrival order: V0 appends to the waiting queue and sorts by priority only in
    ``_schedule_priority_preemption`` (vLLM 0.8.5, checked by the V0 differential driver)."""
    sched = _v0(10, block_size=4, scheduling_policy="priority")
    _add(sched, "x", 10, 20, now=0.0, priority=1)
    _add(sched, "y", 10, 20, now=0.1, priority=5)
    _add(sched, "z", 10, 20, now=0.2, priority=3)
    assert _grants(_step(sched)) == [("x", 10, 0), ("y", 10, 0), ("z", 10, 0)]
    head = Request("h", head_prompt, 1, head_arrival, priority=head_priority)
    assert sched.add_request(head, 0.5)
    return sched, head


def test_priority_preempts_less_urgent_running_until_the_head_fits():
    sched, _ = _priority_setup(head_prompt=28)  # 7 blocks; 1 free
    out = _step(sched, now=1.0)
    # y (5) goes first: 4 free, still short; then z (3): 7 free, h fits; x (1) stays.
    assert _ids(out.preempted) == ["y", "z"]
    assert _grants(out) == [("x", 1, 10)]
    assert _ids(sched.waiting) == ["h", "z", "y"]  # re-sorted by (priority, arrival)
    assert all(sched.kv_cache.num_held(r) == 0 for r in "yz")
    out = _step(sched, now=2.0)
    assert _grants(out) == [("h", 28, 0)]


@pytest.mark.parametrize(
    ("head_priority", "head_arrival", "victims"), [(1, 0.5, ["y", "z"]), (1, 0.0, ["y", "z"]), (9, 0.5, [])]
)
def test_priority_preempts_only_running_requests_less_urgent_than_the_head(
    head_priority, head_arrival, victims
):
    # h needs 9 blocks: even with y and z gone (7 free) it does not fit. With priority 1, x
    # (priority 1, arrival 0.0) is more urgent than h by (priority, arrival), or equally urgent
    # when h also arrived at 0.0: either way it is kept. With priority 9 nobody is less urgent.
    sched, _ = _priority_setup(head_prompt=36, head_priority=head_priority, head_arrival=head_arrival)
    out = _step(sched, now=1.0)
    assert _ids(out.preempted) == victims
    if not victims:
        assert _grants(out) == [("x", 1, 10), ("z", 1, 10), ("y", 1, 10)]
    else:
        assert _grants(out) == [("x", 1, 10)]
        assert _ids(sched.waiting) == ["h", "z", "y"]


def test_priority_preempts_all_less_urgent_and_no_more_when_the_head_still_does_not_fit():
    sched, _ = _priority_setup(head_prompt=36)  # 9 blocks: needs all but one
    out = _step(sched, now=1.0)
    # y, z, then x (priority 1 > 0): all 10 blocks free, h fits.
    assert _ids(out.preempted) == ["y", "z", "x"]
    assert not out.scheduled
    assert _ids(sched.waiting) == ["h", "x", "z", "y"]


def test_fcfs_never_preempts_for_the_waiting_head():
    sched = _v0(10, block_size=4)
    for rid in "xyz":
        _add(sched, rid, 10, 20, priority=5)
    _step(sched)
    _add(sched, "h", 28, 1, priority=0)
    out = _step(sched, now=1.0)
    assert not out.preempted
    assert _grants(out) == [("x", 1, 10), ("y", 1, 10), ("z", 1, 10)]


def test_priority_preempts_for_an_urgent_head_when_max_num_seqs_is_full():
    sched = _v0(1000, max_num_seqs=2, scheduling_policy="priority")
    _add(sched, "lo1", 10, 50, priority=5)
    _add(sched, "lo2", 10, 50, now=0.1, priority=5)
    _step(sched)
    _add(sched, "hi", 10, 5, now=0.5, priority=0)
    out = _step(sched, now=1.0)
    assert _ids(out.preempted) == ["lo2"]
    assert _grants(_step(sched, now=2.0)) == [("hi", 10, 0)]


# ---- 9. whole runs under KV pressure -------------------------------------------------------

MAX_MODEL_LEN = 1024
NUM_BLOCKS = 48  # 768 tokens: a few requests at a time


def _workload(seed: int, n: int = 40) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(200.0)
        prompt, max_tokens = rng.randint(1, 400), rng.randint(1, 150)
        if i % 13 == 5:
            prompt, max_tokens = 700, 200  # more KV than the whole cache: rejected
        requests.append(Request(f"r{i}", prompt, max_tokens, t, priority=rng.choice((0, 1, 2))))
    return requests


def _fresh(requests: list[Request]) -> list[Request]:
    return [
        Request(r.request_id, r.prompt_len, r.max_tokens, r.arrival_time, priority=r.priority)
        for r in requests
    ]


def _outcome(requests: list[Request]) -> list[tuple]:
    return [
        (r.request_id, r.status, r.status_reason, r.num_preemptions, tuple(r.token_times)) for r in requests
    ]


RUNS = {
    "recompute": dict(num_cpu_blocks=0, preemption_mode="recompute"),
    "swap-small-cpu": dict(num_cpu_blocks=6, preemption_mode="swap"),
    "swap-large-cpu": dict(num_cpu_blocks=1000, preemption_mode="swap"),
    "chunked-swap": dict(num_cpu_blocks=1000, preemption_mode="swap", enable_chunked_prefill=True),
    "chunked-partial": dict(
        enable_chunked_prefill=True, max_num_batched_tokens=256, max_num_partial_prefills=2
    ),
    "priority": dict(scheduling_policy="priority"),
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("run", list(RUNS))
def test_whole_runs_under_kv_pressure(run, seed):
    flags = dict(RUNS[run])
    num_cpu_blocks = flags.pop("num_cpu_blocks", 0)
    config = VllmV0Policy.default_config(get_hardware("H100-SXM").device_info, MAX_MODEL_LEN, **flags)
    requests = _workload(seed)
    outcomes = []
    for fast_forward in (False, True):
        kv = KVCacheManager(NUM_BLOCKS, 16, num_cpu_blocks)
        sched = Scheduler(VllmV0Policy(config), kv, MAX_MODEL_LEN)
        batch = _fresh(requests)
        SimDriver(_engine(sched, batch, fast_forward=fast_forward)).run()
        assert not sched.waiting and not sched.running and not sched.swapped
        assert len(sched.finished) == len(batch)
        assert kv.num_free_blocks == NUM_BLOCKS and kv.num_free_cpu_blocks == num_cpu_blocks
        for r in batch:
            if r.status is RequestStatus.FINISHED_LENGTH:
                assert len(r.token_times) == r.max_tokens == r.num_output_tokens
                assert r.finish_time == r.token_times[-1]
            else:
                assert r.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_REJECTED)
                assert r.status_reason
        assert sched.num_preemptions > 0
        assert sched.num_preemptions == sum(r.num_preemptions for r in batch)
        outcomes.append(_outcome(batch))
        if run == "swap-small-cpu":
            assert any(r.status_reason == SWAP_ABORT for r in batch)
    if run != "swap-small-cpu":  # see test_fast_path_matches_stepping_after_a_swap_abort
        assert outcomes[0] == outcomes[1]  # the fast path is exact


def test_fast_path_matches_stepping_after_a_swap_abort():
    outcomes = []
    for fast_forward in (False, True):
        # _three_full_prompts as a run, plus d (2 blocks) that fits once c's blocks are freed.
        sched = _v0(10, block_size=4, num_cpu_blocks=2, preemption_mode="swap")
        requests = [Request(rid, 12, 8, 0.0) for rid in "abc"] + [Request("d", 8, 2, 0.0)]
        SimDriver(_engine(sched, requests, fast_forward=fast_forward)).run()
        outcomes.append(_outcome(requests))
    # Stepping admits d in the iteration right after c's abort (its first token at the end of
    # iteration 3); the fast path keeps decoding a and b until they finish.
    assert outcomes[0] == outcomes[1]


def test_small_budget_with_matching_max_num_seqs_is_accepted():
    from tailserve.core.device import DeviceInfo
    from tailserve.policies.vllm_v0 import VllmV0Policy

    device = DeviceInfo("A100-80GB", 80.0)
    config = VllmV0Policy.default_config(
        device, 4096, max_num_batched_tokens=128, max_num_seqs=64, enable_chunked_prefill=True
    )
    assert (config.max_num_batched_tokens, config.max_num_seqs) == (128, 64)
    with pytest.raises(ValueError, match="max_num_seqs"):
        VllmV0Policy.default_config(device, 4096, max_num_batched_tokens=128, enable_chunked_prefill=True)


# ---- what the executor sees: block pairs for the copies, block tables on request -----------


def test_scheduler_output_carries_the_swap_block_pairs_and_the_block_tables():
    sched = _v0(10, block_size=4, num_cpu_blocks=8, preemption_mode="swap")
    kv = sched.kv_cache
    _add(sched, "a", 12, 2)
    _add(sched, "b", 12, 10)
    _add(sched, "c", 12, 10)
    _step(sched)
    c_gpu = list(kv.block_tables["c"])
    out = sched.schedule(0.0)  # b's next block is missing: c, the tail, is swapped out
    assert _ids(out.swapped_out) == ["c"]
    assert [gpu for gpu, _ in out.blocks_to_swap_out] == c_gpu  # every block, table order
    c_cpu = [cpu for _, cpu in out.blocks_to_swap_out]
    assert kv.cpu_block_tables["c"] == c_cpu and not out.blocks_to_swap_in
    assert all(s.block_ids is None for s in out.scheduled)  # the simulator never asks
    sched.add_block_ids(out)
    assert [s.block_ids for s in out.scheduled] == [list(kv.block_tables["a"]), list(kv.block_tables["b"])]
    sched.update(out, StepResult(0.01), 0.01)

    out = _step(sched, 0.02)  # a finished: c comes back from the CPU blocks it went to
    assert _ids(out.swapped_in) == ["c"]
    assert [cpu for cpu, _ in out.blocks_to_swap_in] == c_cpu
    assert [gpu for _, gpu in out.blocks_to_swap_in] == list(kv.block_tables["c"][:3])
    assert out.num_swap_in_blocks == 3 and not out.blocks_to_swap_out


def test_a_swap_out_after_a_swap_in_in_one_step_is_refused():
    sched = _v0(10, block_size=4, num_cpu_blocks=8, preemption_mode="swap")
    out = SchedulerOutput(blocks_to_swap_in=[(0, 1)])
    request = _add(sched, "a", 4, 2)
    with pytest.raises(RuntimeError, match="a swap-out after a swap-in in one iteration"):
        sched.preempt_by_swap(request, out)
