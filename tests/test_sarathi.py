"""Behaviour of the Sarathi-Serve policy against ``shared/reference/policies.md`` §5.

Stall-free batching: every iteration carries all decodes, then prompts in progress, then new
prompts, within ``chunk_size`` tokens; prompts are allocated whole at admission (plus a 1%
watermark); the victim of a preemption is the latest arrival, recomputed from the front of the
waiting queue. Tests drive the policy through ``Scheduler.schedule`` / ``Scheduler.update`` with
hand-sized caches so every number is exact; whole runs use the simulated executor with
``check_integrity=True``.
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
from tailserve.core.source import ListSource
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.driver import SimDriver
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.kv.paged import KVCacheManager
from tailserve.policies.sarathi import SarathiConfig, SarathiPolicy

MAX_MODEL_LEN = 8192

# ---- helpers ------------------------------------------------------------------------------


def _sarathi(num_blocks: int, block_size: int = 16, **cfg) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(SarathiPolicy(SarathiConfig(**cfg)), kv, MAX_MODEL_LEN)


def _add(
    sched: Scheduler, rid: str, prompt: int, max_tokens: int, arrival: float = 0.0, now: float = 0.0
) -> Request:
    request = Request(rid, prompt, max_tokens, arrival)
    assert sched.add_request(request, now)
    return request


def _dynamic(high: int, low: int, stages: int, max_tokens: int, num_blocks: int = 1000) -> Scheduler:
    return _sarathi(
        num_blocks,
        enable_dynamic_chunking_schedule=True,
        high_chunk_size=high,
        low_chunk_size=low,
        chunk_schedule_stages=stages,
        chunk_schedule_max_tokens=max_tokens,
    )


# ---- budget, stall-free decodes, batch order -----------------------------------------------


def test_decodes_never_stall_while_a_long_prompt_is_chunked_within_chunk_size():
    sched = _sarathi(1000, chunk_size=64)
    _add(sched, "d0", 10, 50)
    _add(sched, "d1", 10, 50)
    assert _grants(_step(sched)) == [("d0", 10, 0), ("d1", 10, 0)]
    _add(sched, "long", 200, 5, arrival=0.5)
    grants = [_grants(_step(sched)) for _ in range(5)]
    assert grants == [
        [("d0", 1, 10), ("d1", 1, 10), ("long", 62, 0)],
        [("d0", 1, 11), ("d1", 1, 11), ("long", 62, 62)],
        [("d0", 1, 12), ("d1", 1, 12), ("long", 62, 124)],
        [("d0", 1, 13), ("d1", 1, 13), ("long", 14, 186)],
        [("d0", 1, 14), ("d1", 1, 14), ("long", 1, 200)],
    ]


def test_batch_order_is_decodes_then_running_prefills_then_new_prefills():
    sched = _sarathi(1000, chunk_size=64)
    _add(sched, "D", 10, 50, arrival=1.0)
    assert _grants(_step(sched)) == [("D", 10, 0)]
    # P arrived before D but reaches the scheduler after it (e.g. a replayed trace): once both
    # run, FCFS puts P first in running, yet D's decode still comes before P's chunk.
    _add(sched, "P", 100, 5, arrival=0.5)
    assert _grants(_step(sched)) == [("D", 1, 10), ("P", 63, 0)]
    _add(sched, "N", 40, 5, arrival=2.0)
    out = _step(sched)
    assert _ids(sched.running) == ["P", "D", "N"]  # sorted by arrival
    assert _grants(out) == [("D", 1, 11), ("P", 37, 63), ("N", 26, 0)]
    assert out.num_scheduled_tokens == 64


def _drive(sched: Scheduler, requests: list[Request], chunk_size: int) -> int:
    """Run to completion by hand, checking each iteration; returns the hybrid iterations."""
    pending = sorted(requests, key=lambda r: r.arrival_time)
    now = 0.0
    hybrid = 0
    while pending or sched.has_unfinished:
        while pending and pending[0].arrival_time <= now:
            sched.add_request(pending.pop(0), now)
        decoding = [r for r in sched.running if r.num_tokens - r.num_computed_tokens == 1]
        out = sched.schedule(now)
        if out.is_empty:
            assert pending, "nothing scheduled and nothing left to arrive"
            now = pending[0].arrival_time
            continue
        assert out.num_scheduled_tokens <= chunk_size
        granted = {id(s.request): s.num_new_tokens for s in out.scheduled}
        preempted = {id(r) for r in out.preempted}
        for r in decoding:  # every decode gets its token, unless preempted for lack of KV
            assert granted.get(id(r)) == 1 or id(r) in preempted, r.request_id
        hybrid += out.num_prefill_tokens > 0 and out.num_decode_tokens > 0
        sched.update(out, StepResult(duration=0.01), now + 0.01)
        now += 0.01
    return hybrid


def _random_requests(seed: int, n: int) -> list[Request]:
    rng = random.Random(seed)
    t = 0.0
    requests = []
    for i in range(n):
        t += rng.expovariate(50.0)
        requests.append(Request(f"r{i}", rng.randint(1, 600), rng.randint(1, 80), t))
    return requests


@pytest.mark.parametrize("num_blocks", [2000, 48])
def test_random_run_respects_the_budget_and_never_stalls_a_decode(num_blocks):
    sched = _sarathi(num_blocks, chunk_size=128)
    requests = _random_requests(seed=7, n=60)
    hybrid = _drive(sched, requests, chunk_size=128)
    assert hybrid > 10  # prompts were chunked alongside decodes
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)
    if num_blocks == 48:
        assert sched.num_preemptions > 0
    else:
        assert sched.num_preemptions == 0


# ---- admission -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "watermark", "admitted"),
    [(1584, 0.01, True), (1585, 0.01, False), (1585, 0.0, True)],
)
def test_admission_allocates_the_whole_prompt_and_keeps_a_watermark(prompt, watermark, admitted):
    # 100 blocks of 16: watermark int(0.01 * 100) = 1 block. 1584 tokens = 99 blocks (leaves 1),
    # 1585 tokens = 100 blocks.
    sched = _sarathi(100, chunk_size=64, watermark=watermark)
    _add(sched, "big", prompt, 1)
    _add(sched, "small", 4, 1)
    out = _step(sched)
    if admitted:
        # Only one chunk is computed, but the whole prompt's blocks are held from admission.
        assert _grants(out) == [("big", 64, 0)]
        assert sched.kv_cache.num_held("big") == -(-prompt // 16)
        assert _ids(sched.waiting) == ["small"]  # no budget left this iteration
    else:
        # big does not fit: the walk stops there; small (1 block) is not tried.
        assert _grants(out) == []
        assert _ids(sched.waiting) == ["big", "small"]
        assert sched.kv_cache.num_free_blocks == 100


def test_walk_stops_at_max_num_seqs():
    sched = _sarathi(1000, chunk_size=64, max_num_seqs=2)
    for rid in "abc":
        _add(sched, rid, 10, 3)
    assert _grants(_step(sched)) == [("a", 10, 0), ("b", 10, 0)]
    assert _grants(_step(sched)) == [("a", 1, 10), ("b", 1, 10)]
    assert _ids(sched.waiting) == ["c"]


def test_walk_stops_when_no_budget_is_left_for_a_chunk():
    sched = _sarathi(1000, chunk_size=64)
    _add(sched, "a", 64, 3)
    _add(sched, "b", 4, 3)
    assert _grants(_step(sched)) == [("a", 64, 0)]
    assert _ids(sched.waiting) == ["b"]
    assert _grants(_step(sched)) == [("a", 1, 64), ("b", 4, 0)]


# ---- preemption ----------------------------------------------------------------------------


def test_preemption_victim_is_the_latest_arrival_and_goes_to_the_front_of_waiting():
    # 6 blocks of 4 tokens; three 8-token prompts fill them.
    sched = _sarathi(6, block_size=4, chunk_size=64)
    _add(sched, "A", 8, 10, arrival=0.0)
    _add(sched, "X", 8, 10, arrival=2.0)
    _add(sched, "Y", 8, 10, arrival=1.0)
    assert _grants(_step(sched)) == [("A", 8, 0), ("X", 8, 0), ("Y", 8, 0)]  # admission order
    _add(sched, "W", 4, 1, arrival=3.0)
    x = next(r for r in sched.running if r.request_id == "X")
    out = _step(sched)
    # A needs a third block: the latest arrival X (admitted before Y) is preempted.
    assert out.preempted == [x]
    assert _grants(out) == [("A", 1, 8), ("Y", 1, 8)]
    assert _ids(sched.waiting) == ["X", "W"]
    assert x.status is RequestStatus.PREEMPTED and x.num_computed_tokens == 0
    assert sched.kv_cache.num_held("X") == 0 and sched.kv_cache.num_free_blocks == 0


def test_a_decode_that_is_the_latest_arrival_preempts_itself():
    # 4 blocks of 4: A (6 tokens) and B (8 tokens) hold 2 blocks each; A's next token fits its
    # second block, B's needs a third. B is the last running request, so it preempts itself.
    sched = _sarathi(4, block_size=4, chunk_size=64)
    _add(sched, "A", 6, 4, arrival=0.0)
    _add(sched, "B", 8, 4, arrival=1.0)
    assert _grants(_step(sched)) == [("A", 6, 0), ("B", 8, 0)]
    out = _step(sched)
    assert _grants(out) == [("A", 1, 6)]
    assert _ids(out.preempted) == ["B"]
    assert _ids(sched.waiting) == ["B"] and _ids(sched.running) == ["A"]
    # B (8 prompt + 1 output = 9 tokens, 3 blocks) waits until A frees its blocks.
    assert _grants(_step(sched)) == [("A", 1, 7)]


def test_decode_preempts_when_no_block_is_free_even_if_its_token_fits():
    sched = _sarathi(4, block_size=4, chunk_size=64)
    _add(sched, "a", 6, 4, arrival=0.0)
    _add(sched, "b", 6, 4, arrival=1.0)
    assert _grants(_step(sched)) == [("a", 6, 0), ("b", 6, 0)]
    assert sched.kv_cache.num_free_blocks == 0
    out = _step(sched)
    assert _ids(out.preempted) == ["b"]
    # Sarathi's phase 2 does not skip admission after a preemption: b, now at the front of the
    # waiting queue with its 2 blocks free again, is re-admitted to recompute its 7 tokens.
    assert _grants(out) == [("a", 1, 6), ("b", 7, 0)]


# ---- dynamic chunking ----------------------------------------------------------------------


def test_dynamic_chunks_shrink_as_the_prompt_progresses():
    # Stages of 4096 / 4 = 1024 processed tokens; sizes 1024, 768, 512, 256.
    sched = _dynamic(high=1024, low=256, stages=4, max_tokens=4096)
    _add(sched, "R", 4096, 1)
    chunks = [_grants(_step(sched))[0][1] for _ in range(8)]
    # processed: 0 -> stage 0; 1024, 1792 -> 1; 2560 -> 2; 3072, 3328, 3584, 3840 -> 3.
    assert chunks == [1024, 768, 768, 512, 256, 256, 256, 256]
    assert not sched.running and sched.finished[0].num_output_tokens == 1


def test_dynamic_stage_sizes_are_rounded_to_multiples_of_32():
    # linspace(244, 1000, 3) = 244, 622, 1000 -> 256, 608, 992 (to 16 it would be 240, 624,
    # 992); stages of 1000 processed tokens.
    sched = _dynamic(high=1000, low=244, stages=3, max_tokens=3000)
    _add(sched, "R", 2848, 1)
    chunks = [_grants(_step(sched))[0][1] for _ in range(4)]
    assert chunks == [992, 992, 608, 256]


def test_dynamic_stage_size_is_the_budget_shared_with_decodes():
    sched = _dynamic(high=256, low=160, stages=4, max_tokens=1024)  # sizes 256, 224, 192, 160
    _add(sched, "D", 10, 50)
    assert _grants(_step(sched)) == [("D", 10, 0)]
    _add(sched, "R", 1000, 2)
    assert _grants(_step(sched)) == [("D", 1, 10), ("R", 255, 0)]  # stage 0: 256 - 1 decode
    assert _grants(_step(sched)) == [("D", 1, 11), ("R", 255, 255)]  # 255 < 256: still stage 0
    assert _grants(_step(sched)) == [("D", 1, 12), ("R", 223, 510)]  # stage 1: 224 - 1


def test_dynamic_stage_length_is_not_rounded_down():
    sched = _dynamic(high=256, low=160, stages=4, max_tokens=1023)
    _add(sched, "D", 10, 50)
    _step(sched)
    _add(sched, "R", 1000, 2)
    assert _grants(_step(sched)) == [("D", 1, 10), ("R", 255, 0)]
    assert _grants(_step(sched)) == [("D", 1, 11), ("R", 255, 255)]


# ---- config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"chunk_size": 0}, "chunk_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"watermark": 1.0}, "watermark"),
        ({"watermark": -0.1}, "watermark"),
        (
            {
                "enable_dynamic_chunking_schedule": True,
                "high_chunk_size": 512,
                "low_chunk_size": 16,
                "chunk_schedule_stages": 2,
                "chunk_schedule_max_tokens": 1024,
            },
            "low_chunk_size",
        ),
        (
            {
                "enable_dynamic_chunking_schedule": True,
                "high_chunk_size": 256,
                "low_chunk_size": 512,
                "chunk_schedule_stages": 2,
                "chunk_schedule_max_tokens": 1024,
            },
            "low_chunk_size <= high_chunk_size",
        ),
        (
            {
                "enable_dynamic_chunking_schedule": True,
                "high_chunk_size": 512,
                "low_chunk_size": 256,
                "chunk_schedule_stages": 0,
                "chunk_schedule_max_tokens": 1024,
            },
            "chunk_schedule_stages",
        ),
        (
            {
                "enable_dynamic_chunking_schedule": True,
                "high_chunk_size": 512,
                "low_chunk_size": 256,
                "chunk_schedule_stages": 2,
                "chunk_schedule_max_tokens": 0,
            },
            "chunk_schedule_max_tokens",
        ),
    ],
)
def test_config_validation(flags, message):
    with pytest.raises(ValueError, match=message):
        SarathiConfig(**flags)


def test_defaults():
    cfg = SarathiPolicy.default_config(get_hardware("A100-80GB").device_info, 4096)
    assert cfg.chunk_size == 512 and cfg.max_num_seqs == 128
    assert cfg.watermark == 0.01 and cfg.enable_dynamic_chunking_schedule is False
    assert (
        SarathiPolicy.default_config(get_hardware("A100-80GB").device_info, 4096, chunk_size=2048).chunk_size
        == 2048
    )
    # Dynamic chunking is off unless asked for: the unused sizes need no validation.
    assert SarathiConfig(low_chunk_size=0, high_chunk_size=0).chunk_size == 512


# ---- whole runs ----------------------------------------------------------------------------


def _fresh(requests: list[Request]) -> list[Request]:
    return [Request(r.request_id, r.prompt_len, r.max_tokens, r.arrival_time) for r in requests]


@pytest.mark.parametrize("dynamic", [False, True])
def test_whole_run_under_kv_pressure_conserves_blocks_and_fast_path_is_exact(dynamic):
    flags = {"chunk_size": 256}
    if dynamic:
        flags.update(
            enable_dynamic_chunking_schedule=True,
            high_chunk_size=512,
            low_chunk_size=128,
            chunk_schedule_stages=3,
            chunk_schedule_max_tokens=600,
        )
    requests = _random_requests(seed=11, n=50)
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    outcomes = []
    for fast_forward in (False, True):
        sched = _sarathi(48, **flags)
        batch = _fresh(requests)
        options = EngineOptions(fast_forward=fast_forward, check_integrity=True)
        engine = Engine(sched, SimExecutor(cost, 16), ListSource(batch), options=options)
        SimDriver(engine).run()
        assert all(r.status is RequestStatus.FINISHED_LENGTH for r in batch)
        assert all(len(r.token_times) == r.max_tokens for r in batch)
        assert sched.kv_cache.num_free_blocks == 48 and not sched.kv_cache.block_tables
        assert sched.num_preemptions > 0
        limit = 512 if dynamic else 256
        for p, d in zip(engine.log.num_prefill_tokens, engine.log.num_decode_tokens):
            assert p + d <= limit
        outcomes.append([(r.request_id, r.num_preemptions, tuple(r.token_times)) for r in batch])
    assert outcomes[0] == outcomes[1]
