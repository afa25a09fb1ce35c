"""SGLang's flags, version 0.5.23 (the peer the differential tests pin).

Sources: ``python/sglang/srt/arg_groups/fields/*.py`` (0.5.23 declares ``ServerArgs`` as field
groups; ``server_args.py`` assembles them), ``arg_groups/validation_hook.py`` (the start-up
checks), ``managers/scheduler.py`` and ``managers/schedule_policy.py``, read from the released
``sglang`` 0.5.23 package. Its parser is plain argparse: dashes only (``--max_running_requests``
is refused) and unique-prefix abbreviations (``--tp`` is ``--tp-size``).
"""

from __future__ import annotations

from tailserve.engines.flag_spec import (
    DEPLOYMENT,
    NO_OP,
    NOT_MODELLED,
    REFUSED,
    SCHEDULING,
    EngineVersion,
    Finding,
    FlagSpec,
    Given,
)

V = "0.5.23"
F = "sglang/srt/arg_groups/fields"
VAL = "sglang/srt/arg_groups/validation_hook.py"
SCHED = "sglang/srt/managers/scheduler.py"
POLICY = "sglang/srt/managers/schedule_policy.py"

# SGLang 0.5.23's --schedule-policy choices (fields/schedule.py:86).
SCHEDULE_POLICIES = (
    "lpm", "random", "fcfs", "dfs-weight", "lof", "priority", "routing-key", "hrrn", "shortest-prefill-first",
)  # fmt: skip


def _at(path: str, line: int | str) -> str:
    return f"{path}:{line}@v{V}"


def _mixed_chunk_rule(given: Given) -> list[Finding]:
    if given.get("enable_mixed_chunk") and given.get("chunked_prefill_size", 1) <= 0:
        return [Finding(("enable_mixed_chunk", "chunked_prefill_size"), NO_OP,
                        "mixing needs chunked prefill: with chunked_prefill_size <= 0 it is off",
                        _at(SCHED, 1376))]  # fmt: skip
    return []


def _radix_off_rule(given: Given) -> list[Finding]:
    policy = given.get("schedule_policy", "fcfs")
    if not given.get("disable_radix_cache"):
        return []
    if policy == "shortest-prefill-first":
        return [Finding(("schedule_policy", "disable_radix_cache"), REFUSED,
                        "shortest-prefill-first requires prefix caching", _at(POLICY, 333))]  # fmt: skip
    if policy in ("lpm", "dfs-weight", "hrrn"):
        return [Finding(("schedule_policy",), NO_OP,
                        f"{policy} needs the radix cache: without it the order is fcfs", _at(POLICY, 338))]  # fmt: skip
    return []


def _policy_choice_rule(given: Given) -> list[Finding]:
    if given.get("schedule_policy") == "priority":
        # The parser offers it, but neither of SchedulePolicy's enums holds it.
        return [Finding(("schedule_policy",), REFUSED,
                        "the parser takes 'priority' but the scheduler has no such policy (Unknown schedule_policy); "
                        "priority order is --enable-priority-scheduling", _at(POLICY, 344))]  # fmt: skip
    return []


def _priority_rules(given: Given) -> list[Finding]:
    found = []
    if given.get("enable_priority_scheduling"):
        policy = given.get("schedule_policy", "fcfs")
        if policy not in ("fcfs", "lof"):
            found.append(Finding(("enable_priority_scheduling", "schedule_policy"), REFUSED,
                                 f"priority scheduling takes schedule_policy fcfs or lof, not {policy}",
                                 _at(VAL, 282)))  # fmt: skip
        return found
    quiet = {
        "disable_priority_preemption": _at(VAL, 295),
        "default_priority_value": _at(VAL, 299),
        "schedule_low_priority_values_first": _at(SCHED, 3522),
        "priority_scheduling_preemption_threshold": _at(SCHED, 494),
    }
    for name, source in quiet.items():
        if name in given:
            found.append(Finding((name,), NO_OP, "no effect without --enable-priority-scheduling", source))
    if given.get("retraction_policy") == "priority":
        found.append(Finding(("retraction_policy",), REFUSED,
                             "--retraction-policy priority requires --enable-priority-scheduling",
                             _at(VAL, 303)))  # fmt: skip
    return found


def _page_rule(given: Given) -> list[Finding]:
    size, page = given.get("chunked_prefill_size"), given.get("page_size")
    if size is not None and page and size > 0 and size % page:
        return [Finding(("chunked_prefill_size", "page_size"), REFUSED,
                        f"chunked_prefill_size {size} is not a multiple of page_size {page}", _at(VAL, 244))]  # fmt: skip
    return []


def _dynamic_chunk_rule(given: Given) -> list[Finding]:
    if given.get("enable_dynamic_chunking") and given.get("pp_size", 1) <= 1:
        return [Finding(("enable_dynamic_chunking",), NO_OP, "acts only with pipeline parallelism (pp_size > 1)",
                        _at(SCHED, 1383))]  # fmt: skip
    return []


def _dp_attention_rule(given: Given) -> list[Finding]:
    """``--dp-size N --enable-dp-attention``: N attention-DP ranks, not N replicas."""
    if given.get("enable_dp_attention") and given.get("dp_size", 1) > 1:
        return [Finding(("dp_size",), DEPLOYMENT,
                        "with --enable-dp-attention: attention-DP ranks inside the TP group, one scheduler "
                        "each (tailserve: --data-parallel-size N, --tp tp_size/N)",
                        _at(f"{F}/parallel.py", 192))]  # fmt: skip
    return []


_HICACHE_SIZING = ("hicache_ratio", "hicache_size", "hicache_write_policy")


def _hicache_rule(given: Given) -> list[Finding]:
    """HiCache's sizing and write policy act only with ``--enable-hierarchical-cache``, which
    the radix cache must back (``arg_groups/kv_cache_hook.py:393``)."""
    if not given.get("enable_hierarchical_cache"):
        named = tuple(name for name in _HICACHE_SIZING if name in given)
        if named:
            return [Finding(named, NO_OP, "no effect without --enable-hierarchical-cache",
                            _at(f"{F}/memory.py", 98))]  # fmt: skip
        return []
    if given.get("disable_radix_cache"):
        return [Finding(("enable_hierarchical_cache", "disable_radix_cache"), REFUSED,
                        "enable-hierarchical-cache and disable-radix-cache are mutually exclusive",
                        _at("sglang/srt/arg_groups/kv_cache_hook.py", 393))]  # fmt: skip
    ratio = given.get("hicache_ratio")
    if ratio is not None and ratio <= 0:
        return [Finding(("hicache_ratio",), REFUSED, "must be > 0", _at(f"{F}/memory.py", 109))]
    return []


_DECODE_SERVER_FLAGS = (
    "num_reserved_decode_tokens", "disaggregation_decode_extra_slots", "disaggregation_decode_polling_interval",
)  # fmt: skip


def _decode_server_rule(given: Given) -> list[Finding]:
    """The decode server's own settings act only with ``--disaggregation-mode decode``."""
    if given.get("disaggregation_mode") == "decode":
        return []
    named = tuple(name for name in _DECODE_SERVER_FLAGS if name in given)
    if named:
        return [Finding(named, NO_OP, "acts only on a decode server (--disaggregation-mode decode)",
                        _at(f"{F}/disagg.py", 55))]  # fmt: skip
    return []


def _conservativeness_rule(given: Given) -> list[Finding]:
    if given.get("schedule_conservativeness", 1.0) < 0:
        return [Finding(("schedule_conservativeness",), REFUSED, "must be non-negative", _at(VAL, 314))]
    return []


# --moe-a2a-backend choices whose resolution sets ep_size to tp_size (_a2a_ep_size).
A2A_EP_SPANNING = frozenset({
    "megamoe", "deepep", "deepep_v2", "mooncake", "nixl", "ascend_fuseep", "flashinfer", "flashinfer_megamoe", "mori",
    "pplx",
})  # fmt: skip
_A2A_EP_SOURCE = _at("sglang/srt/arg_groups/overrides.py", "1578-1619") + " (_a2a_ep_size)"


def _eplb_rule(given: Given) -> list[Finding]:
    """EPLB needs an expert-parallel size above 1 once the arguments are resolved (``--ep-size``,
    or a ``--moe-a2a-backend`` whose resolution sets it to ``--tp-size``): SGLang asserts it at
    start. Redundant experts without EPLB are placed by index (``init_trivial``: physical slot i
    holds expert i mod E) or by ``--init-expert-location``, not by load: not modelled."""
    redundant = given.get("ep_num_redundant_experts", 0)
    if not given.get("enable_eplb"):
        if redundant:
            return [Finding(("ep_num_redundant_experts",), NOT_MODELLED,
                            f"without --enable-eplb the {redundant} redundant slots hold experts by index (slot i "
                            "holds expert i mod E) or by --init-expert-location, not by measured load; tailserve "
                            "places redundant experts only with EPLB",
                            _at("sglang/srt/eplb/expert_location.py", "108-135") + " (init_trivial)")]  # fmt: skip
        return []
    tp = given.get("tp_size", 1)
    ep = given.get("ep_size", 1)
    if str(given.get("moe_a2a_backend") or "none") in A2A_EP_SPANNING:
        ep = tp
    if ep <= 1:
        return [Finding(("enable_eplb",), REFUSED,
                        "EPLB needs an expert-parallel size > 1 (assert resolved_view(server_args).ep_size > 1 fails "
                        "at start): give --ep-size equal to --tp-size, or a --moe-a2a-backend that spans the TP ranks",
                        f"{_at('sglang/srt/arg_groups/parallel_hook.py', '790-791')}; {_A2A_EP_SOURCE}")]  # fmt: skip
    return []


SGLANG_0_5_23 = EngineVersion(
    "sglang", V, "sglang 0.5.23",
    (
        FlagSpec("model_path", str, DEPLOYMENT, "the model: a catalog name, Hugging Face id or config.json "
                 "directory", _at(f"{F}/model.py", 51), aliases=("--model",), target="deployment.model"),
        FlagSpec("tp_size", int, DEPLOYMENT, "tensor-parallel degree", _at(f"{F}/parallel.py", 45), "1",
                 aliases=("--tensor-parallel-size",), target="deployment.tp"),
        FlagSpec("dp_size", int, DEPLOYMENT, "data-parallel replicas behind SGLang's round-robin controller "
                 "(a dense model: tailserve's --data-parallel-size; with --enable-dp-attention: attention-DP "
                 "ranks, as --attn-dp-size)", _at(f"{F}/parallel.py", 73), "1", aliases=("--data-parallel-size",),
                 target="deployment.dp"),
        FlagSpec("attn_dp_size", int, DEPLOYMENT, "attention data-parallel ranks inside the TP group, one "
                 "scheduler each (tailserve: --data-parallel-size N, --tp tp_size/N)",
                 _at(f"{F}/parallel.py", 81), "1", aliases=("--attention-data-parallel-size",),
                 target="deployment.attn_dp"),
        FlagSpec("enable_dp_attention", bool, DEPLOYMENT, "deprecated spelling: --dp-size N --enable-dp-attention "
                 "is --attn-dp-size N", "sglang/srt/server_args.py:419@v0.5.23; "
                 f"{F}/parallel.py:192@v0.5.23", "false", target="deployment.dp_attention"),
        FlagSpec("moe_a2a_backend", str, DEPLOYMENT,
                 "the MoE token exchange between attention-DP ranks: deepep as tailserve's deepep_* "
                 "(--deepep-mode), none as all-gather/reduce-scatter; others not modelled",
                 _at(f"{F}/exec_.py", 836), "none"),
        FlagSpec("deepep_mode", ("auto", "normal", "low_latency"), DEPLOYMENT,
                 "DeepEP's kernels: low_latency, normal (high-throughput), auto (low_latency for decode "
                 "steps, normal when any rank extends a prompt: tailserve's deepep_auto)",
                 _at(f"{F}/exec_.py", 898), "auto"),
        FlagSpec("enable_eplb", bool, DEPLOYMENT, "expert-parallel load balancing: experts placed, and "
                 "--ep-num-redundant-experts hot ones replicated, by their recorded load (tailserve --enable-eplb; "
                 "executors/simulated/expert_load.py)", _at(f"{F}/exec_.py", 922), "false",
                 target="deployment.enable_eplb"),
        FlagSpec("ep_num_redundant_experts", int, DEPLOYMENT, "EPLB's redundant expert slots over the EP ranks "
                 "(tailserve --num-redundant-experts)", _at(f"{F}/exec_.py", 914), "0",
                 target="deployment.num_redundant_experts"),
        FlagSpec("eplb_algorithm", str, NOT_MODELLED, "how EPLB places the experts; tailserve places them as "
                 "DeepSeek's EPLB does (replicate the most loaded, pack the heaviest on the least loaded rank)",
                 _at(f"{F}/exec_.py", 923), "auto"),
        FlagSpec("eplb_rebalance_num_iterations", int, NOT_MODELLED, "forward passes between EPLB's rebalances: "
                 "tailserve prices the balanced placement, not when it is rearranged", _at(f"{F}/exec_.py", 924),
                 "1000"),
        FlagSpec("eplb_rebalance_layers_per_chunk", int, NOT_MODELLED, "layers moved per forward pass while "
                 "rebalancing; not simulated", _at(f"{F}/exec_.py", 927), "all"),
        FlagSpec("eplb_min_rebalancing_utilization_threshold", float, NOT_MODELLED, "GPU utilization below which "
                 "EPLB skips a rebalance; not simulated", _at(f"{F}/exec_.py", 931), "1.0"),
        FlagSpec("ep_dispatch_algorithm", str, NOT_MODELLED, "which replica of a replicated expert a token goes to "
                 "(static, dynamic, fake, lp); tailserve splits an expert's tokens evenly over its replicas",
                 _at(f"{F}/exec_.py", 917), "dynamic without an a2a backend, else static (parallel_hook.py:766-778)"),
        FlagSpec("init_expert_location", str, NOT_MODELLED, "the experts' starting placement (a file of recorded "
                 "load or a mapping); not read", _at(f"{F}/exec_.py", 921), "trivial"),
        FlagSpec("enable_two_batch_overlap", bool, NOT_MODELLED, "two micro-batches overlapping the MoE "
                 "exchange with compute; not priced", _at(f"{F}/exec_.py", 1047), "false"),
        FlagSpec("enable_torch_compile", bool, NOT_MODELLED, "torch.compile of small decode batches; not priced",
                 _at(f"{F}/exec_.py", 691), "false"),
        FlagSpec("enable_hierarchical_cache", bool, SCHEDULING, "HiCache: a host-memory tier behind the radix "
                 "cache, loaded back into the prefill batch that hits it (policies/sglang_hicache.py)",
                 _at(f"{F}/memory.py", 98), "false", aliases=("--enable-hicache",)),
        FlagSpec("hicache_ratio", float, SCHEDULING, "host pool tokens per GPU pool token, per rank",
                 _at(f"{F}/memory.py", 109), "2.0 (arg_groups/hicache_hook.py:119)"),
        FlagSpec("hicache_size", int, SCHEDULING, "host pool GB per rank; > 0 overrides hicache_ratio",
                 _at(f"{F}/memory.py", 113), "0"),
        FlagSpec("hicache_write_policy", ("write_back", "write_through", "write_through_selective"), SCHEDULING,
                 "when a radix node is copied to host: at insert (write_through), at its second insert hit "
                 "(write_through_selective), or at GPU eviction (write_back)", _at(f"{F}/memory.py", 121),
                 "write_through"),
        FlagSpec("hicache_io_backend", ("direct", "kernel", "kernel_ascend"), NOT_MODELLED,
                 "the host<->GPU copy kernels; tailserve prices a copy at the host link's bandwidth",
                 _at(f"{F}/memory.py", 128), "kernel"),
        FlagSpec("hicache_mem_layout", str, NOT_MODELLED, "the host pool's memory layout; not priced",
                 _at(f"{F}/memory.py", 135), "page_first"),
        FlagSpec("hicache_storage_backend", str, NOT_MODELLED, "HiCache's L3 storage tier (file, mooncake, "
                 "hf3fs, nixl, ...) behind the host pool; not modelled", _at(f"{F}/memory.py", 148)),
        FlagSpec("hicache_host_memory_mode", ("cache", "buffer_only"), NOT_MODELLED, "buffer_only makes host "
                 "memory a staging buffer for the storage tier; tailserve models the cache mode",
                 _at(f"{F}/memory.py", 102), "cache"),
        FlagSpec("hicache_host_memory_fraction", float, NOT_MODELLED, "shrinks a defaulted hicache_ratio to fit "
                 "the machine's free host memory, which tailserve does not know (it keeps 2.0)",
                 _at(f"{F}/memory.py", 117), "0.8"),
        FlagSpec("enable_lmcache", bool, NOT_MODELLED, "LMCache's KV tiers beside the radix cache; not modelled",
                 _at(f"{F}/memory.py", 256), "false"),
        FlagSpec("disaggregation_mode", str, NOT_MODELLED, "this server is one side of a prefill/decode pair; "
                 "simulate the pair with --prefill-replicas / --decode-replicas", _at(f"{F}/disagg.py", 55),
                 "null"),
        FlagSpec("num_reserved_decode_tokens", int, SCHEDULING, "decode server: KV tokens reserved per active "
                 "request when pre-allocating a new one (policies/sglang_decode.py)", _at(f"{F}/disagg.py", 109),
                 "512"),
        FlagSpec("disaggregation_decode_extra_slots", int, SCHEDULING, "decode server: request slots past "
                 "--max-running-requests for requests in transfer", _at(f"{F}/disagg.py", 113),
                 "2 x a running cap <= 32, else 0 (arg_groups/pd_disaggregation_hook.py:133)"),
        FlagSpec("disaggregation_decode_polling_interval", int, SCHEDULING, "decode server: turns between polls "
                 "of its pre-allocation and transfer queues", _at(f"{F}/disagg.py", 117), "1"),
        FlagSpec("disaggregation_decode_allocation_policy", ("early", "prefill_complete"), SCHEDULING,
                 "when the decode server reserves a request's KV: early (before its prefill may start) or "
                 "prefill_complete (once its prefill is done; the prefill server holds the KV until then)",
                 _at(f"{F}/disagg.py", 59), "early"),
        FlagSpec("optimistic_prefill_attempts", int, NOT_MODELLED, "prefill server: forward passes a request may "
                 "take before its decode server's pre-allocation (bootstrap); under the early allocation policy not "
                 "modelled (its prefill waits), under prefill_complete (which needs it) the prefill starts at once",
                 _at(f"{F}/disagg.py", 125), "0 (1 with prefill_complete: pd_disaggregation_hook.py:47-55)"),
        FlagSpec("disaggregation_decode_enable_radix_cache", bool, NOT_MODELLED, "a radix cache on the decode "
                 "server; not modelled (off, as SGLang's default)", _at(f"{F}/disagg.py", 88), "false"),
        FlagSpec("disaggregation_transfer_backend", str, NOT_MODELLED, "the KV transfer library (mooncake, nixl, "
                 "...): tailserve prices a transfer by its link (--kv-link), not by the library",
                 _at(f"{F}/disagg.py", 65), "mooncake"),
        FlagSpec("pp_size", int, NOT_MODELLED, "pipeline parallelism: SGLang's (event_loop_pp) is not simulated; "
                 "vLLM's, TensorRT-LLM's and Sarathi-Serve's are",
                 _at(f"{F}/parallel.py", 59), "1", aliases=("--pipeline-parallel-size",)),
        FlagSpec("ep_size", int, DEPLOYMENT, "expert parallelism: = tp_size splits experts whole over the TP ranks",
                 _at(f"{F}/parallel.py", 281), "1", aliases=("--expert-parallel-size", "--ep"),
                 target="deployment.expert_parallel"),
        FlagSpec("quantization", str, DEPLOYMENT, "the weights' number format", _at(f"{F}/model.py", 177),
                 "the checkpoint's", target="deployment.quantization"),
        FlagSpec("kv_cache_dtype", str, DEPLOYMENT, "the KV cache's number format (fp8_e4m3: twice the tokens)",
                 _at(f"{F}/model.py", 197), "auto", target="deployment.kv_cache_dtype"),
        FlagSpec("dtype", str, NOT_MODELLED, "activation dtype: tailserve prices the model's own format",
                 _at(f"{F}/model.py", 160), "auto"),
        FlagSpec("context_length", int, DEPLOYMENT, "context length", _at(f"{F}/model.py", 110), "the model's",
                 target="max_model_len"),
        FlagSpec("page_size", int, DEPLOYMENT, "tokens per KV page", _at(f"{F}/schedule.py", 143), "1",
                 target="block_size"),
        FlagSpec("mem_fraction_static", float, DEPLOYMENT, "fraction of GPU memory for weights and KV pool",
                 _at(f"{F}/schedule.py", 27), "per GPU memory", target="gpu_memory_utilization"),
        FlagSpec("chunked_prefill_size", int, SCHEDULING, "tokens per prefill chunk (-1: no chunking)",
                 _at(f"{F}/schedule.py", 52), "per GPU memory (arg_groups/memory_hook.py:93)"),
        FlagSpec("max_prefill_tokens", int, SCHEDULING, "tokens per prefill batch", _at(f"{F}/schedule.py", 71),
                 "16384"),
        FlagSpec("schedule_policy", SCHEDULE_POLICIES, SCHEDULING, "waiting-queue order (routing-key: by the "
                 "running batch's X-SMG-Routing-Key counts, tailserve's tenant)", _at(f"{F}/schedule.py", 86), "fcfs"),
        FlagSpec("schedule_conservativeness", float, SCHEDULING, "how much of running requests' future "
                 "outputs admission reserves", _at(f"{F}/schedule.py", 139), "1.0"),
        FlagSpec("enable_mixed_chunk", bool, SCHEDULING, "a prefill chunk shares its step with decodes",
                 _at(f"{F}/schedule.py", 208), "false"),
        FlagSpec("max_running_requests", int, SCHEDULING, "most running requests", _at(f"{F}/schedule.py", 31),
                 "from the KV pool"),
        FlagSpec("max_total_tokens", int, DEPLOYMENT,
                 "the KV pool's tokens: at most this many, the smaller of it and what memory gives",
                 _at(f"{F}/schedule.py", 39), "from the memory"),
        FlagSpec("enable_priority_scheduling", bool, SCHEDULING, "order by request priority",
                 _at(f"{F}/schedule.py", 103), "false"),
        FlagSpec("schedule_low_priority_values_first", bool, SCHEDULING, "lower priority values first",
                 _at(f"{F}/schedule.py", 118), "false"),
        FlagSpec("priority_scheduling_preemption_threshold", int, SCHEDULING,
                 "priority gap a new request needs to preempt running ones", _at(f"{F}/schedule.py", 122), "10"),
        FlagSpec("disable_priority_preemption", bool, SCHEDULING, "priority scheduling without preemption",
                 _at(f"{F}/schedule.py", 107), "false"),
        FlagSpec("retraction_policy", ("length", "priority"), SCHEDULING, "whom to retract when KV runs out",
                 _at(f"{F}/schedule.py", 126), "length"),
        FlagSpec("disable_radix_cache", bool, SCHEDULING, "no prefix sharing", _at(f"{F}/memory.py", 64), "false"),
        FlagSpec("random_seed", int, SCHEDULING, "seeds schedule_policy=random", _at(f"{F}/device.py", 47)),
        FlagSpec("speculative_algorithm", str, SCHEDULING, "speculative decoding: EAGLE, EAGLE3 or NEXTN (a chain "
                 "of drafts; the simulation also needs synthetic_acceptance_rates or _length)", _at(f"{F}/spec.py", 31)),
        FlagSpec("speculative_num_steps", int, SCHEDULING, "draft steps per decode", _at(f"{F}/spec.py", 58),
                 "auto (3 for DeepSeek-V3)"),
        FlagSpec("speculative_eagle_topk", int, SCHEDULING, "drafts per step (tailserve: 1 only)",
                 _at(f"{F}/spec.py", 62), "auto"),
        FlagSpec("speculative_num_draft_tokens", int, SCHEDULING, "tokens a verification computes (steps + 1 "
                 "with topk 1)", _at(f"{F}/spec.py", 66), "auto"),
        FlagSpec("speculative_draft_model_path", str, NOT_MODELLED, "the drafter's checkpoint: tailserve prices one "
                 "decoder layer of the target per draft step", _at(f"{F}/spec.py", 36),
                 aliases=("--speculative-draft-model",)),
        FlagSpec("default_priority_value", int, NOT_MODELLED, "priority of requests that give none",
                 _at(f"{F}/schedule.py", 111)),
        FlagSpec("max_queued_requests", int, SCHEDULING, "a request entering a full waiting queue is refused "
                 "with 503 (arrivals, retracted and preempted requests; under priority scheduling a less urgent "
                 "waiting one leaves instead; ignored in a P/D pair)", _at(SCHED, 3552), "no limit"),
        FlagSpec("stream_interval", int, SCHEDULING, "a streamed chunk once this many tokens are unsent (first "
                 "and last at once): the client's ITL, not the scheduler's (core/stream_interval.py)",
                 f"{_at(f'{F}/serving.py', 262)}; sglang/srt/managers/scheduler_components/output_streamer.py:454-470",
                 "1"),
        FlagSpec("prefill_max_requests", int, SCHEDULING, "most requests in one prefill batch, a continuing "
                 "chunk included", _at(POLICY, 1398), "no limit"),
        FlagSpec("prefill_decode_interval", int, SCHEDULING, "scheduler turns without a prefill pass after "
                 "each prefill batch (ignored in a P/D pair)", _at(SCHED, 1400), "0 (22 for Qwen3-VL on Hopper)"),
        FlagSpec("prefill_decode_interval_min_bs", int, SCHEDULING, "prefill_decode_interval applies while at "
                 "least this many requests decode", _at(SCHED, 1406), "0"),
        FlagSpec("num_continuous_decode_steps", int, NO_OP, "declared, but nothing in 0.5.23's scheduler reads "
                 "it (decode steps are not run back to back)", _at(f"{F}/schedule.py", 200), "1"),
        FlagSpec("disable_overlap_schedule", bool, SCHEDULING, "no CPU scheduling overlapped with the GPU "
                 "step (policies/sglang_overlap.py)", _at(f"{F}/schedule.py", 193), "false"),
        FlagSpec("enable_dynamic_chunking", bool, NOT_MODELLED, "chunk sizes fitted per pipeline stage",
                 _at(f"{F}/schedule.py", 67), "false"),
    ),
    rules=(
        _dp_attention_rule,
        _mixed_chunk_rule,
        _radix_off_rule,
        _policy_choice_rule,
        _priority_rules,
        _page_rule,
        _dynamic_chunk_rule,
        _conservativeness_rule,
        _hicache_rule,
        _decode_server_rule,
        _eplb_rule,
    ),
    policy="sglang",
    underscores=False,
    config_file="sglang",
)  # fmt: skip

VERSIONS = (SGLANG_0_5_23,)
