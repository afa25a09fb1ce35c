"""Behaviour of the scheduling policies against ``shared/reference/policies.md`` §1 (vLLM V1),
§6 (Orca) and static batching.

Most tests drive a policy directly through ``Scheduler.schedule`` / ``Scheduler.update`` with a
hand-sized KV cache, so every grant, victim and queue position is an exact number the rules
determine. The whole-run tests use the simulated executor with ``check_integrity=True``.
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
from tailserve.core.scheduler_output import PaddingSlot
from tailserve.core.source import ListSource
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.driver import SimDriver
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.kv.paged import KVCacheManager
from tailserve.policies.orca import OrcaConfig, OrcaPolicy
from tailserve.policies.registry import get_policy_cls, parse_policy_list
from tailserve.policies.static import StaticConfig, StaticPolicy
from tailserve.policies.vllm import VllmConfig, VllmPolicy

# ---- helpers ------------------------------------------------------------------------------


def _vllm(num_blocks: int, block_size: int = 16, max_model_len: int = 4096, **cfg) -> Scheduler:
    cfg.setdefault("max_num_seqs", 16)
    return Scheduler(VllmPolicy(VllmConfig(**cfg)), KVCacheManager(num_blocks, block_size), max_model_len)


def _orca(num_blocks: int, block_size: int = 16, max_model_len: int = 4096, **cfg) -> Scheduler:
    return Scheduler(OrcaPolicy(OrcaConfig(**cfg)), KVCacheManager(num_blocks, block_size), max_model_len)


def _static(num_blocks: int = 1000, block_size: int = 16, max_model_len: int = 4096, **cfg) -> Scheduler:
    return Scheduler(StaticPolicy(StaticConfig(**cfg)), KVCacheManager(num_blocks, block_size), max_model_len)


def _add(sched: Scheduler, rid: str, prompt: int, max_tokens: int, now: float = 0.0) -> Request:
    request = Request(rid, prompt, max_tokens, now)
    assert sched.add_request(request, now)
    return request


def _cost_model() -> CostModel:
    return CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)


def _engine(sched: Scheduler, requests: list[Request]) -> Engine:
    return Engine(
        sched, SimExecutor(_cost_model()), ListSource(requests), options=EngineOptions(check_integrity=True)
    )


# ---- vLLM V1: token budget ----------------------------------------------------------------


def test_vllm_decodes_first_then_prompt_chunks_take_budget_minus_decodes():
    sched = _vllm(1000, max_num_batched_tokens=64)
    for i in range(3):
        _add(sched, f"d{i}", 10, 50)
    out = _step(sched)
    assert _grants(out) == [("d0", 10, 0), ("d1", 10, 0), ("d2", 10, 0)]
    assert out.num_admitted == 3

    long = _add(sched, "long", 200, 5)
    out = _step(sched)
    # Running decodes first (1 token each), then the prompt gets exactly 64 - 3 = 61 tokens.
    assert _grants(out) == [("d0", 1, 10), ("d1", 1, 10), ("d2", 1, 10), ("long", 61, 0)]
    assert out.num_admitted == 1
    assert long.num_computed_tokens == 61 and long.num_output_tokens == 0

    # A small request arriving now waits: the running chunk takes all that is left.
    _add(sched, "small", 30, 5)
    out = _step(sched)
    assert _grants(out) == [("d0", 1, 11), ("d1", 1, 11), ("d2", 1, 11), ("long", 61, 61)]
    assert out.num_admitted == 0
    assert _ids(sched.waiting) == ["small"]

    out = _step(sched)
    assert _grants(out) == [("d0", 1, 12), ("d1", 1, 12), ("d2", 1, 12), ("long", 61, 122)]
    # Last chunk: min(remaining 17, 64 - 3); the 44 tokens left go to the small prompt.
    out = _step(sched)
    assert _grants(out) == [
        ("d0", 1, 13),
        ("d1", 1, 13),
        ("d2", 1, 13),
        ("long", 17, 183),
        ("small", 30, 0),
    ]
    assert out.num_admitted == 1
    assert long.num_output_tokens == 1  # the completed prompt sampled its first token
    out = _step(sched)
    assert _grants(out) == [("d0", 1, 14), ("d1", 1, 14), ("d2", 1, 14), ("long", 1, 200), ("small", 1, 30)]
    assert all(s.num_new_tokens <= 64 for s in out.scheduled)


def test_vllm_budget_caps_the_running_pass():
    """With a budget of 2 and three decodes, the third running request gets nothing this iteration
    (and is neither preempted nor dropped)."""
    sched = _vllm(1000, max_num_batched_tokens=32, max_num_seqs=3)
    for rid in "abc":
        _add(sched, rid, 8, 10)
    _step(sched)
    sched.policy.config = VllmConfig(max_num_batched_tokens=2, max_num_seqs=2)
    out = _step(sched)
    assert _grants(out) == [("a", 1, 8), ("b", 1, 8)]
    assert not out.preempted
    assert _ids(sched.running) == ["a", "b", "c"]


# ---- vLLM V1: preemption ------------------------------------------------------------------


def test_vllm_preempts_the_last_admitted_and_admits_nothing_that_iteration():
    # 7 blocks of 4 tokens; three 8-token prompts take 6, so only one of them can grow.
    sched = _vllm(7, block_size=4, max_num_batched_tokens=256)
    a = _add(sched, "a", 8, 20)
    b = _add(sched, "b", 8, 20)
    c = _add(sched, "c", 8, 20)
    out = _step(sched)
    assert _ids(sched.running) == ["a", "b", "c"]
    assert sched.kv_cache.num_free_blocks == 1
    assert c.num_output_tokens == 1

    # A 4-token request that would fit the block freed by the preemption.
    d = _add(sched, "d", 4, 2)
    out = _step(sched)
    # a takes the last free block; b cannot grow, so c (admitted last) is preempted.
    assert _grants(out) == [("a", 1, 8), ("b", 1, 8)]
    assert out.preempted == [c]
    assert c.num_computed_tokens == 0
    assert c.status is RequestStatus.PREEMPTED
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert c.num_output_tokens == 1  # generated tokens are kept (they are recomputed)
    assert _ids(sched.waiting) == ["c", "d"]  # the FRONT of waiting
    assert _ids(sched.running) == ["a", "b"]
    # No admission in an iteration with a preemption, although d's block is free.
    assert out.num_admitted == 0
    assert sched.kv_cache.num_free_blocks == 1  # d needs just 1 block
    assert sched.kv_cache.num_held("c") == 0
    assert d.status is RequestStatus.WAITING
    assert a.num_preemptions == 0 and b.num_preemptions == 0


def test_vllm_self_preemption_ends_the_running_pass():
    sched = _vllm(5, block_size=4, max_num_batched_tokens=256)
    _add(sched, "a", 8, 10)
    b = _add(sched, "b", 8, 10)
    _step(sched)
    assert sched.kv_cache.num_free_blocks == 1
    _add(sched, "d", 4, 2)
    out = _step(sched)
    # a takes the last block; b cannot grow and is itself the last of running: it preempts
    # itself, and nothing is admitted even though its two blocks are now free.
    assert _grants(out) == [("a", 1, 8)]
    assert out.preempted == [b]
    assert b.num_computed_tokens == 0 and b.status is RequestStatus.PREEMPTED
    assert _ids(sched.running) == ["a"]
    assert _ids(sched.waiting) == ["b", "d"]
    assert out.num_admitted == 0
    assert sched.num_preemptions == 1


def test_vllm_no_admission_after_a_preemption_even_if_the_victims_chunk_fits():
    # 4 blocks of 4 tokens, prefill chunks capped at 4 tokens (1 block), first chunk enough to admit.
    sched = _vllm(
        4,
        block_size=4,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=4,
        scheduler_reserve_full_isl=False,
    )
    _add(sched, "a", 4, 3)
    c = _add(sched, "c", 12, 1)
    assert _grants(_step(sched)) == [("a", 4, 0), ("c", 4, 0)]
    assert _grants(_step(sched)) == [("a", 1, 4), ("c", 4, 4)]
    assert sched.kv_cache.num_free_blocks == 0
    out = sched.schedule(0.0)
    # c's third chunk needs a 3rd block: c is the last of running, so it preempts itself. Its
    # 2 blocks are free again and its next 4-token chunk would fit, but nothing is admitted.
    assert _grants(out) == [("a", 1, 5)]
    assert out.preempted == [c]
    assert out.num_admitted == 0
    assert _ids(sched.waiting) == ["c"]
    assert sched.kv_cache.num_free_blocks == 2
    sched.update(out, StepResult(duration=0.01), 0.01)
    # Next iteration c is admitted again from token 0 (a finished, so c is alone: no cap).
    assert _grants(_step(sched)) == [("c", 12, 0)]


def test_vllm_preempts_victims_one_at_a_time_and_recomputes_their_outputs():
    # 5 blocks of 4. A 16-token prompt chunked by the cap (8 tokens = 2 blocks per chunk) runs
    # ahead of two short requests that fill the rest of the cache.
    sched = _vllm(
        5,
        block_size=4,
        max_num_batched_tokens=20,
        long_prefill_token_threshold=8,
        scheduler_reserve_full_isl=False,
    )
    a = _add(sched, "a", 16, 1)
    b = _add(sched, "b", 8, 4)
    c = _add(sched, "c", 4, 4)
    out = _step(sched)
    assert _grants(out) == [("a", 8, 0), ("b", 8, 0), ("c", 4, 0)]
    assert sched.kv_cache.num_free_blocks == 0

    out = _step(sched)
    # a's next chunk needs 2 blocks: c (1 block) is not enough, so b goes too.
    assert _grants(out) == [("a", 8, 8)]
    assert out.preempted == [c, b]
    assert sched.num_preemptions == 2
    assert _ids(sched.waiting) == ["b", "c"]  # each prepended: the earlier-admitted one first
    assert out.num_admitted == 0

    # a finishes (max_tokens 1); b and c come back and recompute prompt + their 1 output token.
    assert a.status is RequestStatus.FINISHED_LENGTH
    out = _step(sched)
    assert _grants(out) == [("b", 8, 0), ("c", 5, 0)]  # b: min(9, cap 8); c: 4 + 1
    assert b.num_preemptions == 1 and c.num_preemptions == 1


# ---- vLLM V1: head-of-line blocking -------------------------------------------------------


def _hol_setup(full_isl: bool) -> tuple[Scheduler, Request, Request]:
    sched = _vllm(10, max_num_batched_tokens=64, scheduler_reserve_full_isl=full_isl)
    _add(sched, "r", 64, 50)
    _step(sched)  # r holds 4 blocks
    head = _add(sched, "head", 150, 10)  # whole prompt: 10 blocks
    small = _add(sched, "small", 16, 4)  # 1 block
    return sched, head, small


def test_vllm_full_isl_head_blocks_smaller_request_behind_it():
    sched, head, small = _hol_setup(full_isl=True)
    out = _step(sched)
    # r's decode takes a 5th block: 5 free < 10 for head's prompt; small (1 block) would fit
    # but is never tried.
    assert _grants(out) == [("r", 1, 64)]
    assert out.num_admitted == 0
    assert _ids(sched.waiting) == ["head", "small"]
    assert sched.kv_cache.num_free_blocks == 5
    assert head.status is RequestStatus.WAITING and small.status is RequestStatus.WAITING


def test_vllm_without_full_isl_head_is_admitted_when_its_first_chunk_fits():
    sched, head, _small = _hol_setup(full_isl=False)
    out = _step(sched)
    assert head.status is RequestStatus.RUNNING
    # First chunk = 64 - 1 decode = 63 tokens = 4 blocks <= 5 free.
    assert _grants(out) == [("r", 1, 64), ("head", 63, 0)]
    assert out.num_admitted == 1
    assert _ids(sched.waiting) == ["small"]
    assert sched.kv_cache.num_free_blocks == 1


def test_vllm_first_chunk_that_does_not_fit_also_blocks_the_queue():
    sched = _vllm(10, max_num_batched_tokens=64, scheduler_reserve_full_isl=False)
    _add(sched, "r", 64, 30)
    _step(sched)  # r: 4 blocks
    _add(sched, "r2", 32, 30)
    assert _grants(_step(sched)) == [("r", 1, 64), ("r2", 32, 0)]  # r: 5 blocks, r2: 2
    _add(sched, "head", 150, 10)  # first chunk 64 - 2 = 62 tokens = 4 blocks > 2 free
    _add(sched, "small", 16, 4)  # 1 block: would fit
    out = _step(sched)
    assert _grants(out) == [("r", 1, 65), ("r2", 1, 32)]
    assert sched.kv_cache.num_free_blocks == 2
    assert out.num_admitted == 0
    assert _ids(sched.waiting) == ["head", "small"]


@pytest.mark.parametrize(("blocks", "admitted"), [(85, True), (86, False)])
def test_vllm_watermark_applies_only_once_something_runs(blocks, admitted):
    # watermark 0.1 of 100 blocks = 10 blocks kept free when admitting.
    sched = _vllm(100, max_num_batched_tokens=2048, watermark=0.1)
    _add(sched, "alone", 95 * 16, 16)  # 95 + 10 > 100, but nothing runs: no watermark
    assert _grants(_step(sched)) == [("alone", 95 * 16, 0)]
    sched = _vllm(100, max_num_batched_tokens=2048, watermark=0.1)
    _add(sched, "r", 64, 20)
    _step(sched)
    _add(sched, "head", blocks * 16, 16)
    out = _step(sched)  # r's decode takes a 5th block: 95 free
    assert sched.kv_cache.num_free_blocks == (95 - blocks if admitted else 95)
    assert out.num_admitted == int(admitted)


# ---- vLLM V1: max_num_seqs and long_prefill_token_threshold -------------------------------


def test_vllm_max_num_seqs_caps_the_running_set():
    sched = _vllm(1000, max_num_batched_tokens=256, max_num_seqs=2)
    _add(sched, "a", 10, 2)
    _add(sched, "b", 10, 5)
    _add(sched, "c", 10, 5)
    out = _step(sched)
    assert _grants(out) == [("a", 10, 0), ("b", 10, 0)]
    assert _ids(sched.waiting) == ["c"]
    out = _step(sched)  # a produces its 2nd (last) token
    assert _grants(out) == [("a", 1, 10), ("b", 1, 10)]
    assert _ids(sched.running) == ["b"]
    out = _step(sched)
    assert _grants(out) == [("b", 1, 11), ("c", 10, 0)]
    assert len(sched.running) == 2


def test_vllm_long_prefill_threshold_caps_chunks_but_not_a_lone_request():
    sched = _vllm(1000, max_num_batched_tokens=256, long_prefill_token_threshold=32)
    _add(sched, "long", 100, 3)
    _add(sched, "short", 10, 1)
    out = _step(sched)
    assert _grants(out) == [("long", 32, 0), ("short", 10, 0)]
    # short finished; long is now the only request running or waiting: no cap.
    assert _ids(sched.running) == ["long"] and not sched.waiting
    out = _step(sched)
    assert _grants(out) == [("long", 68, 32)]


def test_vllm_long_prefill_threshold_applies_in_running_pass_while_others_wait():
    sched = _vllm(1000, max_num_batched_tokens=256, max_num_seqs=1, long_prefill_token_threshold=32)
    _add(sched, "long", 100, 3)
    _add(sched, "other", 10, 1)
    assert _grants(_step(sched)) == [("long", 32, 0)]
    assert _grants(_step(sched)) == [("long", 32, 32)]
    assert _grants(_step(sched)) == [("long", 32, 64)]
    assert _grants(_step(sched)) == [("long", 4, 96)]


def test_vllm_lone_request_is_not_capped():
    sched = _vllm(1000, max_num_batched_tokens=256, long_prefill_token_threshold=32)
    _add(sched, "long", 100, 3)
    assert _grants(_step(sched)) == [("long", 100, 0)]


# ---- vLLM V1: chunked prefill off ---------------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True])
def test_vllm_chunking_off_stops_admission_instead_of_chunking(chunked):
    sched = _vllm(1000, max_num_batched_tokens=128, enable_chunked_prefill=chunked)
    _add(sched, "r", 100, 20)
    _step(sched)
    _add(sched, "big", 128, 4)  # 128 > 127 left after r's decode
    _add(sched, "small", 10, 4)
    out = _step(sched)
    if chunked:
        assert _grants(out) == [("r", 1, 100), ("big", 127, 0)]
    else:
        assert _grants(out) == [("r", 1, 100)]
        assert _ids(sched.waiting) == ["big", "small"]


def test_vllm_chunking_off_admits_a_prompt_equal_to_the_budget_left():
    sched = _vllm(1000, max_num_batched_tokens=128, enable_chunked_prefill=False)
    _add(sched, "r", 100, 20)
    _step(sched)
    _add(sched, "fits", 127, 4)
    _add(sched, "next", 1, 4)
    out = _step(sched)
    assert _grants(out) == [("r", 1, 100), ("fits", 127, 0)]
    assert _ids(sched.waiting) == ["next"]  # budget exhausted


def test_vllm_default_config_chunking_off_raises_budget_to_max_model_len():
    a100 = get_hardware("A100-80GB").device_info
    cfg = VllmPolicy.default_config(a100, 8192, enable_chunked_prefill=False)
    assert cfg.max_num_batched_tokens == 8192
    assert cfg.max_num_seqs == 256
    assert cfg.enable_chunked_prefill is False
    with pytest.raises(ValueError, match="max_model_len"):
        VllmPolicy.default_config(a100, 8192, enable_chunked_prefill=False, max_num_batched_tokens=2048)


# ---- vLLM V1: device defaults -------------------------------------------------------------


@pytest.mark.parametrize(
    ("hardware", "budget", "max_seqs"),
    [
        ("A100-80GB", 2048, 256),
        ("A100-40GB", 2048, 256),
        ("L4", 2048, 256),
        ("H100-SXM", 8192, 1024),
        ("H200", 8192, 1024),
        ("MI300X", 16384, 1024),
    ],
)
def test_vllm_device_defaults(hardware, budget, max_seqs):
    cfg = VllmPolicy.default_config(get_hardware(hardware).device_info, 8192)
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (budget, max_seqs)
    assert cfg.long_prefill_token_threshold == 0
    assert cfg.enable_chunked_prefill is True
    assert cfg.scheduler_reserve_full_isl is True
    assert cfg.watermark == 0.0


def test_vllm_explicit_small_budget_lowers_default_max_num_seqs():
    h100 = get_hardware("H100-SXM").device_info
    cfg = VllmPolicy.default_config(h100, 8192, max_num_batched_tokens=512)
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (512, 512)


def test_vllm_budget_below_max_num_seqs_is_rejected():
    h100 = get_hardware("H100-SXM").device_info
    with pytest.raises(ValueError, match="max_num_seqs"):
        VllmPolicy.default_config(h100, 8192, max_num_batched_tokens=256, max_num_seqs=512)
    with pytest.raises(ValueError):
        VllmConfig(max_num_batched_tokens=256, max_num_seqs=512)


def test_vllm_default_budget_is_capped_at_max_num_seqs_times_max_model_len():
    a100 = get_hardware("A100-80GB").device_info
    cfg = VllmPolicy.default_config(a100, 1024, max_num_seqs=1)
    assert cfg.max_num_batched_tokens == 1024


def test_vllm_long_prefill_threshold_above_max_model_len_is_rejected():
    h100 = get_hardware("H100-SXM").device_info
    with pytest.raises(ValueError):
        VllmPolicy.default_config(h100, 1024, long_prefill_token_threshold=2048)


# ---- Orca ---------------------------------------------------------------------------------


def test_orca_whole_prompt_joins_running_decodes():
    sched = _orca(1000)
    _add(sched, "a", 20, 10)
    _add(sched, "b", 30, 10)
    out = _step(sched)
    assert _grants(out) == [("a", 20, 0), ("b", 30, 0)]
    _add(sched, "long", 3000, 50)
    out = _step(sched)
    # No chunking, no budget: the whole 3000-token prompt in the same iteration as the decodes.
    assert _grants(out) == [("a", 1, 20), ("b", 1, 30), ("long", 3000, 0)]
    assert out.num_admitted == 1


def test_orca_reserves_prompt_plus_max_tokens_and_stops_at_first_misfit():
    sched = _orca(30)
    _add(sched, "a", 20, 10)  # 30 tokens -> 2 blocks
    _add(sched, "b", 300, 50)  # 350 tokens -> 22 blocks
    _add(sched, "c", 100, 10)  # 110 tokens -> 7 blocks > 6 free
    _add(sched, "d", 10, 5)  # 1 block: would fit, but is behind c
    out = _step(sched)
    assert _grants(out) == [("a", 20, 0), ("b", 300, 0)]
    assert sched.kv_cache.num_held("a") == 2
    assert sched.kv_cache.num_held("b") == 22
    assert sched.kv_cache.num_free_blocks == 6
    assert _ids(sched.waiting) == ["c", "d"]
    # Decoding never needs a new block: everything was reserved up front.
    out = _step(sched)
    assert _grants(out) == [("a", 1, 20), ("b", 1, 300)]
    assert sched.kv_cache.num_free_blocks == 6
    assert _ids(sched.waiting) == ["c", "d"]


def test_orca_max_num_seqs():
    sched = _orca(1000, max_num_seqs=2)
    for rid in "abc":
        _add(sched, rid, 10, 3)
    out = _step(sched)
    assert _grants(out) == [("a", 10, 0), ("b", 10, 0)]
    assert _ids(sched.waiting) == ["c"]


def test_orca_never_preempts_under_a_small_kv_cache():
    rng = random.Random(7)
    requests = [Request(f"r{i}", rng.randint(1, 300), rng.randint(1, 120), i * 0.002) for i in range(60)]
    sched = _orca(40)  # 640 tokens: a handful of reservations at a time
    SimDriver(_engine(sched, requests)).run()
    assert sched.num_preemptions == 0
    assert len(sched.finished) == 60
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)
    assert all(r.num_preemptions == 0 for r in requests)
    assert sched.kv_cache.num_free_blocks == 40


# ---- static batching ----------------------------------------------------------------------


def test_static_waits_for_a_full_batch_or_max_wait():
    sched = _static(batch_size=3, max_wait=0.5)
    _add(sched, "a", 10, 2, now=0.0)
    _add(sched, "b", 10, 2, now=0.1)
    assert sched.schedule(0.2).is_empty
    assert sched.schedule(0.49).is_empty
    out = sched.schedule(0.5)  # the oldest has waited max_wait
    assert _ids(s.request for s in out.scheduled) == ["a", "b"]
    assert out.num_admitted == 2

    sched = _static(batch_size=3, max_wait=0.5)
    for rid in "abc":
        _add(sched, rid, 10, 2, now=0.0)
    out = sched.schedule(0.0)  # full batch: no waiting
    assert _ids(s.request for s in out.scheduled) == ["a", "b", "c"]


@pytest.mark.parametrize("arrival", [0.0, 0.25, 1.5])
def test_static_lone_request_starts_at_arrival_plus_max_wait(arrival):
    request = Request("lone", 100, 5, arrival)
    sched = _static(batch_size=4, max_wait=0.5)
    engine = _engine(sched, [request])
    for _ in range(100):
        if not engine.step():
            break
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert request.first_scheduled_time == arrival + 0.5


def test_static_lone_request_with_inexact_wakeup_time_is_served():
    request = Request("lone", 100, 5, 0.2)
    sched = _static(batch_size=4, max_wait=0.5)
    engine = _engine(sched, [request])
    for _ in range(100):  # a finished run takes ~7 steps; bounded so the bug cannot hang
        if not engine.step():
            break
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert request.first_scheduled_time == pytest.approx(0.7)


def test_static_pads_prompts_to_the_longest_and_keeps_finished_slots():
    sched = _static(batch_size=3, max_wait=10.0)
    a = _add(sched, "a", 10, 1)
    _add(sched, "b", 30, 3)
    _add(sched, "c", 20, 2)
    out = _step(sched)
    assert _grants(out) == [("a", 10, 0), ("b", 30, 0), ("c", 20, 0)]
    assert sorted((p.num_new_tokens, p.num_context_tokens) for p in out.padding) == [(10, 20), (20, 10)]
    assert a.status is RequestStatus.FINISHED_LENGTH
    # a is done but its slot still runs as padding.
    out = _step(sched)
    assert _grants(out) == [("b", 1, 30), ("c", 1, 20)]
    assert out.padding == [PaddingSlot(1, 31)]  # a's padded row: 30 prompt slots + 1 token


def test_static_nobody_joins_a_running_batch():
    sched = _static(batch_size=2, max_wait=0.0)
    _add(sched, "a", 10, 1)
    _add(sched, "b", 10, 3)
    out = _step(sched)
    assert _ids(s.request for s in out.scheduled) == ["a", "b"]
    # a finished; a newcomer (batch_size would allow 1 more) must wait for b.
    _add(sched, "c", 10, 2, now=0.0)
    out = _step(sched, now=1.0)
    assert _grants(out) == [("b", 1, 10)]
    assert out.num_admitted == 0
    assert _ids(sched.waiting) == ["c"]
    out = _step(sched, now=2.0)
    assert _grants(out) == [("b", 1, 11)]
    assert _ids(sched.waiting) == ["c"]
    assert not sched.running
    out = _step(sched, now=3.0)  # the batch is over: c starts a new one
    assert _grants(out) == [("c", 10, 0)]
    assert out.num_admitted == 1
    assert not out.padding


# ---- every policy: whole runs under KV pressure -------------------------------------------

POLICY_SPECS = ["static", "orca", "vllm", "vllm:max_num_batched_tokens=256"]
MAX_MODEL_LEN = 1024
NUM_BLOCKS = 48  # 768 tokens of 16-token blocks: a few requests at a time


def _random_workload(seed: int, n: int = 50) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(200.0)
        prompt = rng.randint(1, 500)
        max_tokens = rng.randint(1, 200)
        if i % 17 == 5:
            prompt, max_tokens = 700, 200  # 900 tokens: more KV than the whole cache
        if i % 23 == 7:
            prompt, max_tokens = 1000, 100  # longer than max_model_len
        requests.append(Request(f"r{i}", prompt, max_tokens, t))
    return requests


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("policy", POLICY_SPECS)
def test_random_workload_invariants(policy, seed):
    spec = parse_policy_list(policy)[0]
    cls = get_policy_cls(spec.name)
    config = cls.default_config(get_hardware("H100-SXM").device_info, MAX_MODEL_LEN, **spec.flags)
    sched = Scheduler(cls(config), KVCacheManager(NUM_BLOCKS, 16), MAX_MODEL_LEN)
    requests = _random_workload(seed)
    engine = _engine(sched, requests)
    SimDriver(engine).run()

    assert not sched.waiting and not sched.running
    assert len(sched.finished) == len(requests)
    assert sched.kv_cache.num_free_blocks == NUM_BLOCKS
    assert not sched.kv_cache.block_tables
    rejected = 0
    for r in requests:
        if r.status is RequestStatus.FINISHED_REJECTED:
            rejected += 1
            assert r.status_reason
            assert not r.token_times
            continue
        assert r.status is RequestStatus.FINISHED_LENGTH, (r.request_id, r.status)
        assert len(r.token_times) == r.max_tokens == r.num_output_tokens
        assert all(x <= y for x, y in zip(r.token_times, r.token_times[1:]))
        assert r.first_scheduled_time is not None
        assert r.arrival_time <= r.first_scheduled_time < r.token_times[0]
        assert r.finish_time == r.token_times[-1]
    assert rejected >= 4  # both kinds of rejection occur
    if spec.name == "vllm":
        assert sched.num_preemptions > 0  # the cache is small enough to force preemptions
    else:
        assert sched.num_preemptions == 0
    assert sched.num_preemptions == sum(r.num_preemptions for r in requests)


# ---- registry -----------------------------------------------------------------------------


def test_registry_unknown_policy_lists_known_names():
    with pytest.raises(ValueError, match="unknown policy") as info:
        parse_policy_list("fifo")
    for name in ("static", "orca", "vllm", "vllm-v0", "sarathi"):
        assert name in str(info.value)
    with pytest.raises(ValueError, match="static, orca, vllm"):
        get_policy_cls("nope")


def test_registry_unknown_flag_lists_valid_flags():
    with pytest.raises(ValueError, match="max_num_batched_tokens") as info:
        parse_policy_list("vllm:chunk_size=512")
    message = str(info.value)
    assert "chunk_size" in message
    for flag in ("max_num_seqs", "long_prefill_token_threshold", "block_size", "max_model_len"):
        assert flag in message
    with pytest.raises(ValueError, match="max_num_seqs"):
        parse_policy_list("orca:batch_size=4")


def test_registry_parses_a_policy_list_and_converts_flags():
    specs = parse_policy_list("orca,vllm:max_num_batched_tokens=512,max_num_seqs=64,vllm")
    assert [s.name for s in specs] == ["orca", "vllm", "vllm"]
    assert specs[0].flags == {}
    assert specs[1].flags == {"max_num_batched_tokens": 512, "max_num_seqs": 64}
    assert all(type(v) is int for v in specs[1].flags.values())
    assert specs[2].flags == {}
    assert specs[1].label == "vllm:max_num_batched_tokens=512,max_num_seqs=64"


def test_registry_converts_bool_float_and_dashed_flags():
    (spec,) = parse_policy_list(
        "vllm:enable-chunked-prefill=false:watermark=0.01:block_size=32:gpu_memory_utilization=0.8"
    )
    assert spec.flags == {"enable_chunked_prefill": False, "watermark": 0.01}
    assert spec.engine_flags == {"block_size": 32, "gpu_memory_utilization": 0.8}
    with pytest.raises(ValueError, match="not a valid int"):
        parse_policy_list("vllm:max_num_seqs=lots")
