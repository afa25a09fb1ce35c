"""The ``trtllm`` policy, rule by rule, each case worked by hand from TensorRT-LLM 1.2's source.

TensorRT-LLM's scheduler cannot run here (docs/validation.md, "TensorRT-LLM"): PyPI's
``tensorrt-llm`` is a placeholder that downloads the real wheel from NVIDIA's own index at install
time, and the scheduler modules import the C++ bindings at their top. So every rule has a case
below whose numbers follow from the source's arithmetic. Sources (stored NVIDIA/TensorRT-LLM):
``scheduler/scheduler.py`` (5f480b7a; the Python mirrors of ``capacityScheduler.cpp`` and
``microBatchScheduler.cpp``), ``kvCacheManager.cpp`` (block counts), ``llmRequest.h``
(``pause``, ``setPrepopulatedPromptLen``), ``executor_request_queue.py`` (fetch), ``llm.py``
(``_check_arguments``), ``py_executor_creator.py`` (chunk unit), ``llm_args.py`` (defaults).

KV blocks of 4 tokens throughout, so each count is small: a request of prompt P and ``max_tokens``
M needs ceil((P+M)/4) blocks to completion and ceil(P/4) for its prompt.
"""

from __future__ import annotations

from helpers import grants, ids, scheduler_for, step, token_request
from tailserve.core.device import DeviceInfo
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.executors.simulated.deployment import Deployment
from tailserve.policies.registry import PolicySpec, get_policy_cls, resolve_policy_name
from tailserve.policies.trtllm import TrtllmPolicy
from tailserve.policies.trtllm_config import TrtllmConfig
from tailserve.policies.trtllm_microbatch import equal_progress, first_come_first_served
from tailserve.tune.commands import command_line

H100 = DeviceInfo("H100-SXM", 80.0)
BLOCK = 4


def _trt(num_blocks: int = 100, **flags) -> Scheduler:
    spec = PolicySpec.make("trtllm", flags)
    policy = TrtllmPolicy(TrtllmPolicy.default_config(H100, 4096, **spec.flags))
    return scheduler_for(policy, num_blocks, BLOCK, 4096)


def _add(sched: Scheduler, rid: str, prompt: int, max_tokens: int) -> Request:
    request = Request(rid, prompt, max_tokens, 0.0)
    sched.add_request(request, 0.0)
    return request


# ---- flags and defaults ----------------------------------------------------------------------


def test_defaults_are_tensorrt_llms():
    # llm_args.py / BuildConfig: max_batch_size 2048, max_num_tokens 8192; SchedulerConfig:
    # GUARANTEED_NO_EVICT, chunking None (= FIRST_COME_FIRST_SERVED, py_executor_creator.py),
    # waiting_queue_policy fcfs; enable_chunked_prefill False; KvCacheConfig: enable_block_reuse
    # True, tokens_per_block 32, free_gpu_memory_fraction 0.9; TorchLlmArgs:
    # disable_overlap_scheduler False (the overlap scheduler on).
    config = TrtllmPolicy.default_config(H100, 8192)
    assert config == TrtllmConfig(
        2048, 8192, "GUARANTEED_NO_EVICT", "FIRST_COME_FIRST_SERVED", False, True, "fcfs",
        disable_overlap_scheduler=False,
    )  # fmt: skip
    assert TrtllmPolicy.default_block_size == 32
    assert TrtllmPolicy.default_gpu_memory_utilization == 0.9
    assert TrtllmPolicy.profile_tokens(config, 8192) == 8192  # profiled at max_num_tokens
    none = TrtllmPolicy.default_config(H100, 8192, max_batch_size=None, max_num_tokens=None)
    assert (none.batch_size, none.num_tokens) == (2048, 8192)  # None means the defaults
    for name in ("trtllm", "TensorRT-LLM", "trt_llm", "tensorrt_llm"):
        assert resolve_policy_name(name) == "trtllm"


def test_bad_flags_are_one_line_errors():
    for flags, needle in (
        ({"capacity_scheduler_policy": "MAX_UTIL"}, "GUARANTEED_NO_EVICT, MAX_UTILIZATION, STATIC_BATCH"),
        ({"context_chunking_policy": "fcfs"}, "FIRST_COME_FIRST_SERVED, EQUAL_PROGRESS"),
        ({"waiting_queue_policy": "sjf"}, "fcfs"),
        ({"max_num_tokens": "0"}, "max_num_tokens must be >= 1"),
    ):
        try:
            spec = PolicySpec.make("trtllm", flags)
            TrtllmPolicy.default_config(H100, 4096, **spec.flags)
        except ValueError as e:
            assert needle in str(e) and "\n" not in str(e)
        else:
            raise AssertionError(f"{flags} accepted")


def test_prompt_longer_than_max_num_tokens_is_refused_without_chunked_prefill():
    # llm.py _check_arguments (PyTorch backend, enable_chunked_prefill off).
    sched = _trt(max_num_tokens=8)
    request = _add(sched, "a", 9, 4)
    assert request.status is RequestStatus.FINISHED_REJECTED
    assert (
        request.status_reason
        == "The sum of prompt length (9), query length (0) should not exceed max_num_tokens (8)"
    )
    chunked = _trt(max_num_tokens=8, enable_chunked_prefill=True)
    assert _add(chunked, "a", 9, 4).status is RequestStatus.WAITING


# ---- fetch: the active list ------------------------------------------------------------------


def test_at_most_max_batch_size_requests_are_active():
    # executor_request_queue.py: _get_from_waiting_queue(max_num_active_requests - active).
    sched = _trt(max_batch_size=2)
    _add(sched, "a", 4, 1)
    _add(sched, "b", 4, 3)
    _add(sched, "c", 4, 3)
    assert grants(step(sched)) == [("a", 4, 0), ("b", 4, 0)]  # c is not even active
    assert ids(sched.policy._active) == ["b"]  # a finished (one token) and left
    assert grants(step(sched)) == [("c", 4, 0), ("b", 1, 4)]  # c fetched into a's place


# ---- capacity: GUARANTEED_NO_EVICT -----------------------------------------------------------


def test_guaranteed_no_evict_reserves_to_completion_and_blocks_at_the_first_misfit():
    # capacityScheduler.cpp GuaranteedNoEvict; kvCacheManager.cpp getRemainingBlocksToCompletion.
    sched = _trt(10)
    _add(sched, "a", 8, 8)  # ceil(16/4) = 4 blocks to completion
    _add(sched, "b", 8, 16)  # 6
    _add(sched, "c", 4, 4)  # 2: 10 - 4 - 6 = 0 left
    _add(sched, "d", 2, 2)  # 1: would fit nothing either, and waits behind c anyway
    assert grants(step(sched)) == [("a", 8, 0), ("b", 8, 0)]
    # Next step: free 10 - 4 held = 6; a reserves 4 - 2 held, b 6 - 2: 0 left.
    assert grants(step(sched)) == [("a", 1, 8), ("b", 1, 8)]
    assert ids(sched.waiting) == ["c", "d"]


def test_generation_requests_come_first_and_the_token_budget_ends_the_walk():
    # Capacity output: generation requests (first pass) before contexts (second pass); the
    # micro-batch walks it and stops at the first request past max_num_tokens.
    sched = _trt(max_num_tokens=10)
    _add(sched, "a", 4, 5)
    _add(sched, "b", 4, 5)
    step(sched)
    _add(sched, "c", 8, 2)
    _add(sched, "d", 4, 2)
    # 1 + 1 + 8 = 10 fit; d's 4 more would not. Contexts go first in the forward batch.
    assert grants(step(sched)) == [("c", 8, 0), ("a", 1, 4), ("b", 1, 4)]
    assert ids(sched.waiting) == ["d"]


def test_without_chunking_a_prompt_of_max_num_tokens_waits_for_every_decode():
    # No chunking: a context costs its whole prompt; beside any decode, a prompt of exactly
    # max_num_tokens never fits, so it waits until the decodes are done (the hol workload).
    sched = _trt(max_num_tokens=8)
    _add(sched, "a", 4, 3)
    step(sched)
    _add(sched, "b", 8, 1)
    assert grants(step(sched)) == [("a", 1, 4)]
    assert grants(step(sched)) == [("a", 1, 5)]  # a's last token
    assert grants(step(sched)) == [("b", 8, 0)]


def test_static_batch_admits_only_when_no_request_is_generating():
    # GuaranteedNoEvictPolicy(static_batch=True): the second pass runs only with nothing scheduled.
    sched = _trt(capacity_scheduler_policy="STATIC_BATCH")
    _add(sched, "a", 4, 3)
    step(sched)
    _add(sched, "b", 4, 1)
    assert grants(step(sched)) == [("a", 1, 4)]
    assert grants(step(sched)) == [("a", 1, 5)]
    assert grants(step(sched)) == [("b", 4, 0)]
    plain = _trt()
    _add(plain, "a", 4, 3)
    step(plain)
    _add(plain, "b", 4, 1)
    assert grants(step(plain)) == [("b", 4, 0), ("a", 1, 4)]


# ---- capacity: MAX_UTILIZATION ---------------------------------------------------------------


def test_max_utilization_pauses_the_last_started_request_which_recomputes_its_outputs():
    # MaxUtilizationPolicy: one step's blocks (getNeededBlocksOneStep); when a request does not
    # fit, pause the last started one and retry. LlmRequest::pause folds the outputs into the
    # prompt; the request stays in its place in the active list.
    sched = _trt(6, capacity_scheduler_policy="MAX_UTILIZATION")
    a = _add(sched, "a", 8, 10)
    b = _add(sched, "b", 8, 10)
    assert grants(step(sched)) == [("a", 8, 0), ("b", 8, 0)]  # 2 + 2 blocks of 6
    assert grants(step(sched)) == [("a", 1, 8), ("b", 1, 8)]  # token 9 opens a block each: 0 free
    for _ in range(3):  # tokens 10-12 fit the third blocks
        step(sched)
    out = step(sched)  # token 13 needs a fourth block for a: none free, so b (last) is paused
    assert grants(out) == [("a", 1, 12)]
    assert out.preempted == [b]
    assert (b.num_computed_tokens, b.num_output_tokens, b.num_tokens) == (0, 5, 13)
    assert ids(sched.policy._active) == ["a", "b"] and ids(sched.waiting) == ["b"]
    # b's 13 tokens need 4 blocks; 6 - 4 held by a = 2: it waits (nothing after it started).
    assert grants(step(sched)) == [("a", 1, 13)]
    while a.num_output_tokens < a.max_tokens:
        step(sched)
    assert grants(step(sched)) == [("b", 13, 0)]  # the whole grown prompt, recomputed
    assert b.num_preemptions == 1


def test_guaranteed_no_evict_never_pauses_what_max_utilization_pauses():
    sched = _trt(6)
    _add(sched, "a", 8, 10)  # 5 blocks to completion
    _add(sched, "b", 8, 10)  # 5 more: does not fit until a is done
    assert grants(step(sched)) == [("a", 8, 0)]
    while sched.running:
        assert not step(sched).preempted
    assert sched.waiting.peek_request().request_id == "b"


def test_max_utilization_stops_at_a_misfit_when_nothing_after_it_started():
    sched = _trt(6, capacity_scheduler_policy="MAX_UTILIZATION")
    _add(sched, "r0", 16, 8)
    step(sched)  # 4 blocks
    _add(sched, "a", 12, 2)  # 3 blocks: 1 (r0's next block) + 3 > 2 free
    _add(sched, "b", 4, 2)  # 1 block would fit, but the pass ended at a
    out = step(sched)
    assert grants(out) == [("r0", 1, 16)] and not out.preempted


# ---- micro-batch: context chunking -----------------------------------------------------------


def test_first_come_first_served_chunks_round_down_to_tokens_per_block():
    # setCtxRequestsChunkSize<FIRST_COME_FIRST_SERVED>; chunk unit = tokens_per_block.
    assert first_come_first_served([5, 20], 12, 4, 12) == [5, 4]  # 7 left for the second: 4
    assert first_come_first_served([20, 3], 12, 4, 12) == [12, 0]
    sched = _trt(max_num_tokens=12, enable_chunked_prefill=True)
    _add(sched, "a", 5, 3)
    _add(sched, "b", 20, 3)
    # Chunks present: contexts not on their last chunk first (sortRequests).
    assert grants(step(sched)) == [("b", 4, 0), ("a", 5, 0)]
    assert grants(step(sched)) == [("b", 8, 4), ("a", 1, 5)]  # 12 - 1 = 11 rounds down to 8
    assert grants(step(sched)) == [("b", 8, 12), ("a", 1, 6)]  # b's last chunk


def test_equal_progress_grows_every_chunk_by_a_unit_per_round():
    # setCtxRequestsChunkSize<EQUAL_PROGRESS>: round 1 gives 4 + 4, round 2 gives a 4 more
    # (12 in all) and b nothing (16 > 12), round 3 adds nothing.
    assert equal_progress([10, 10], 12, 4, 12) == [8, 4]
    assert equal_progress([3, 10], 12, 4, 12) == [3, 8]  # a whole short prompt, then units
    sched = _trt(max_num_tokens=12, enable_chunked_prefill=True, context_chunking_policy="EQUAL_PROGRESS")
    _add(sched, "a", 10, 2)
    _add(sched, "b", 10, 2)
    assert grants(step(sched)) == [("a", 8, 0), ("b", 4, 0)]


# ---- block reuse -----------------------------------------------------------------------------

PREFIX = list(range(1, 9))  # two full blocks


def test_a_context_sharing_its_first_new_block_waits_a_step_and_reuses_it():
    # beneficialToSkip: b's first uncached block is a's, so b waits; the step after, a's blocks
    # are stored (storeContextBlocks after the forward) and b starts past them.
    sched = _trt()
    sched.add_request(token_request("a", [*PREFIX, 100, 101, 102], 4), 0.0)
    b = token_request("b", [*PREFIX, 200, 201], 4)
    sched.add_request(b, 0.0)
    assert grants(step(sched)) == [("a", 11, 0)]
    assert grants(step(sched)) == [("b", 2, 8), ("a", 1, 11)]
    assert b.num_cached_tokens == 8
    off = _trt(enable_block_reuse=False)
    off.add_request(token_request("a", [*PREFIX, 100, 101, 102], 4), 0.0)
    off.add_request(token_request("b", [*PREFIX, 200, 201], 4), 0.0)
    assert grants(step(off)) == [("a", 11, 0), ("b", 10, 0)]


def test_the_budget_is_charged_the_whole_prompt_before_the_prefix_is_found():
    # The match happens in addSequence, after the micro-batch charged the context all its tokens.
    sched = _trt(max_num_tokens=12)
    sched.add_request(token_request("c0", [*PREFIX, 9], 1), 0.0)
    sched.add_request(token_request("a", [50, 51, 52], 10), 0.0)
    step(sched)  # c0 (9 tokens) and a (3) fill 12; c0 finishes, its two blocks stay cached
    sched.add_request(token_request("b", [*PREFIX, 60, 61, 62, 63], 2), 0.0)
    assert grants(step(sched)) == [("a", 1, 3)]  # 1 + 12 > 12 although b would compute 4


def test_a_cached_prefix_moves_the_chunk_to_the_same_block_boundary():
    # setPrepopulatedPromptLen: the chunk starts after the cached 8 tokens and ends where the
    # scheduled chunk would have (8 + 8 = 16), or at the prompt's end when it reaches it.
    sched = _trt(max_num_tokens=8, enable_chunked_prefill=True)
    sched.add_request(token_request("c0", PREFIX, 1), 0.0)
    step(sched)
    sched.add_request(token_request("b", PREFIX + list(range(100, 112)), 2), 0.0)
    assert grants(step(sched)) == [("b", 8, 8)]
    assert grants(step(sched)) == [("b", 4, 16)]
    short = _trt(max_num_tokens=8, enable_chunked_prefill=True)
    short.add_request(token_request("c0", PREFIX, 1), 0.0)
    step(short)
    short.add_request(token_request("b", [*PREFIX, 100, 101, 102, 103], 2), 0.0)
    assert grants(step(short)) == [("b", 4, 8)]  # 8 + 8 >= 12: the rest of the prompt


def test_a_paused_prompt_past_max_num_tokens_trips_the_engines_assertion():
    # microBatchScheduler: "Context tokens (N) exceeds limit (M)" (max_context_length =
    # max_num_tokens); the engine fails there, tailserve aborts that request only.
    sched = _trt(6, capacity_scheduler_policy="MAX_UTILIZATION", max_num_tokens=12)
    a = _add(sched, "a", 8, 10)
    b = _add(sched, "b", 9, 10)
    assert grants(step(sched)) == [("a", 8, 0)]  # 8 + 9 > 12
    assert grants(step(sched)) == [("b", 9, 0), ("a", 1, 8)]
    while not b.num_preemptions:
        step(sched)
    assert b.num_tokens == 13
    while sched.has_unfinished:
        step(sched)
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert b.status is RequestStatus.FINISHED_ABORTED
    assert b.status_reason == "Context tokens (13) exceeds limit (12)"
    assert not sched.policy._active


# ---- tune: the engine's own command line -----------------------------------------------------


def test_tune_prints_trtllm_serve_with_its_yaml():
    spec = PolicySpec.make(
        "trtllm", {"max_num_tokens": "4096", "capacity_scheduler_policy": "MAX_UTILIZATION"}
    )
    line = command_line(spec, Deployment.of("Llama-3-70B", "A100-80GB", 4), None, H100, 8192)
    assert line == (
        "echo '{enable_chunked_prefill: false, scheduler_config: {capacity_scheduler_policy: "
        "MAX_UTILIZATION}, kv_cache_config: {enable_block_reuse: true}}' > trtllm-options.yaml && "
        "trtllm-serve meta-llama/Meta-Llama-3-70B --tp_size 4 --max_batch_size 2048 --max_num_tokens 4096 "
        "--extra_llm_api_options trtllm-options.yaml"
    )
    assert get_policy_cls("trt-llm") is TrtllmPolicy
