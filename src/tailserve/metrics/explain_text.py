"""The run's explanation in plain words: which cause dominates the slow requests, who blocked
them, and what addresses it in the flags of the engine that ran (``tailserve policies``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tailserve.core.request import RequestStatus
from tailserve.core.stream_interval import StreamInterval
from tailserve.metrics.attribution import (
    BATCHED_DECODE,
    BATCHED_PREFILL,
    CAUSE_TEXT,
    DECODE_WAIT,
    KV_LOAD,
    KV_WAIT,
    OTHER,
    PREEMPTION,
    PREFILL,
    QUEUED_PREFILL,
    TBT_CAUSES,
    TTFT_CAUSES,
    Attributor,
    Breakdown,
    RunExplanation,
    finished,
    pooled_gaps,
)
from tailserve.metrics.summary import RequestLatencies

# ---- the run's summary in plain words -------------------------------------------------------
# What addresses each cause, in the flags of the engine that ran (``tailserve policies``).
_BUDGET_FLAG = {
    "vllm": "--max-num-batched-tokens",
    "vllm-v0": "--max-num-batched-tokens",
    "sarathi": "--chunk-size",
    "sglang": "--chunked-prefill-size",
    "tgi": "--max-batch-prefill-tokens",
    "trtllm": "--max_num_tokens",
}
_CHUNKING = (
    "chunked prefill bounds it to one chunk: `vllm --max-num-batched-tokens 512-2048` or "
    "`sarathi --chunk-size 512`"
)
_MORE_KV = "raise `--gpu-memory-utilization` or add GPUs (`--tp`) for more KV blocks"
_REMEDIES: dict[tuple[str, str], str] = {
    (QUEUED_PREFILL, "orca"): "Orca runs every prompt whole and first come, first served, so nothing "
    "overtakes a long prompt and Orca has no flag for it; " + _CHUNKING,
    (QUEUED_PREFILL, "static"): "static batching holds new requests until the batch in flight ends: "
    "continuous batching (`orca`, `vllm`) admits them every iteration",
    (QUEUED_PREFILL, "vllm"): "prompts are served FCFS within `--max-num-batched-tokens` per step: a "
    "larger budget prefills more of them per step (longer decode stalls), "
    "`--long-prefill-token-threshold` (e.g. 512-2048) caps a long prompt's chunk so a short one shares "
    "the step, and `--scheduling-policy priority` serves urgent requests first",
    (QUEUED_PREFILL, "vllm-v0"): "`--enable-chunked-prefill --max-num-batched-tokens 2048` with "
    "`--max-num-partial-prefills 2` and `--long-prefill-token-threshold` lets short prompts pass a long "
    "one, or `--scheduling-policy priority`",
    (QUEUED_PREFILL, "sarathi"): "Sarathi serves prompts FCFS within `--chunk-size`: a larger chunk "
    "finishes earlier prompts sooner (longer decode stalls); vLLM's `--long-prefill-token-threshold` "
    "lets short prompts share the budget",
    (QUEUED_PREFILL, "trtllm"): "TensorRT-LLM walks running decodes first, then waiting prompts in "
    "arrival order, and without chunking a prompt that does not fit what `--max_num_tokens` leaves "
    "waits (and holds up every prompt behind it): `enable_chunked_prefill: true` in "
    "`--extra_llm_api_options` lets it start in chunks; under GUARANTEED_NO_EVICT a prompt also waits "
    "for KV reserved to completion (prompt + max_tokens)",
    (QUEUED_PREFILL, "sglang"): "SGLang continues the chunked prompt first: a larger "
    "`--chunked-prefill-size` finishes it in fewer iterations, `--enable-priority-scheduling` lets "
    "urgent requests go first",
    (QUEUED_PREFILL, "tgi"): "TGI's router is strictly FIFO (no priorities): `--max-batch-prefill-tokens` "
    "sets how much prefill each forward carries; a larger value finishes long prompts sooner",
    (KV_WAIT, ""): _MORE_KV + ", or ask for fewer `max_tokens`",
    (KV_WAIT, "orca"): "Orca reserves prompt + max_tokens for every request at admission: "
    + _MORE_KV
    + ", lower `max_tokens`, or use paged allocation (`vllm`)",
    (KV_WAIT, "tgi"): "TGI reserves prompt + max_tokens for every request: "
    + _MORE_KV
    + " (`--max-batch-total-tokens` if set), or lower `max_new_tokens`",
    (KV_WAIT, "sglang"): _MORE_KV + " (`--mem-fraction-static` in SGLang), lower "
    "`--max-running-requests`, or lower `--schedule-conservativeness` below 1 to reserve less per "
    "running request (more retractions)",
    (KV_WAIT, "vllm-v0"): _MORE_KV + " or lower `--max-num-seqs`; requests swapped out with "
    "`--preemption-mode swap` block every new prompt until they return (the convoy): "
    "`--preemption-mode recompute` avoids it",
    (PREEMPTION, ""): _MORE_KV + ", or lower `--max-num-seqs` so fewer sequences compete for KV; "
    "each recompute redoes the whole sequence",
    (PREEMPTION, "vllm-v0"): _MORE_KV + ", lower `--max-num-seqs`, or `--preemption-mode swap "
    "--swap-space N` to move KV over PCIe instead of recomputing (watch for the swap convoy)",
    (PREEMPTION, "sglang"): "raise `--schedule-conservativeness` above 1 (reserve more KV per running "
    "request, fewer retractions), lower `--max-running-requests`, or " + _MORE_KV,
    (DECODE_WAIT, ""): "it waited for the iteration in flight when it arrived, or for a slot under "
    "`--max-num-seqs` (raise it if KV allows)",
    (DECODE_WAIT, "trtllm"): "TensorRT-LLM charges a prompt all its tokens beside the running decodes: "
    "without chunking, a prompt that does not fit what `--max_num_tokens` leaves them waits until "
    "enough decodes finish (a prompt of `--max_num_tokens` waits for all of them); "
    "`enable_chunked_prefill: true` in `--extra_llm_api_options` lets it start beside them",
    (DECODE_WAIT, "tgi"): "TGI holds new requests while the batch decodes until "
    "`--waiting-served-ratio` x running requests wait or `--max-waiting-tokens` steps passed "
    "(without prefill chunking): lower both, or check `--max-batch-size`",
    (DECODE_WAIT, "sglang"): "SGLang stops admitting at `--max-running-requests` or after an admission "
    "ran out of KV (until a request leaves): raise the cap, or " + _MORE_KV,
    (DECODE_WAIT, "static"): "a static batch runs to completion before anyone joins: lower "
    "`--max-wait` / `--batch-size`, or use continuous batching",
    (BATCHED_PREFILL, ""): "its prompt was computed in the same iterations as other prompts; "
    "{budget} caps the tokens one iteration carries: a smaller value puts fewer prompts together but "
    "leaves the rest for later iterations",
    (BATCHED_PREFILL, "vllm"): "other prompts' chunks took most of the steps it ran in: "
    "`--long-prefill-token-threshold` (e.g. 512-2048) caps each long prompt's chunk so shorter ones get "
    "more of `--max-num-batched-tokens`, or `--scheduling-policy priority` serves urgent requests first",
    (BATCHED_PREFILL, "orca"): "Orca admits every waiting prompt whole into the same iteration, so a "
    "short prompt pays for the long ones beside it; " + _CHUNKING,
    (BATCHED_PREFILL, "static"): "a static batch prefills its prompts together, padded to the longest: "
    "a smaller `--batch-size`, or continuous batching",
    (BATCHED_DECODE, ""): "continuous batching runs every running request's decode in the iteration "
    "that computes a new prompt; fewer concurrent sequences (`--max-num-seqs`) make those iterations "
    "cheaper, at the cost of throughput",
    (BATCHED_DECODE, "tgi"): "TGI runs new prompts in one forward with the running batch; a smaller "
    "`--max-batch-size` makes those forwards cheaper, at the cost of throughput",
    (BATCHED_DECODE, "sglang"): "with `--enable-mixed-chunk` decodes ride along with prefill chunks; "
    "turning it off or lowering `--max-running-requests` makes those iterations cheaper",
    (PREFILL, ""): "no scheduler setting shortens a prompt's own compute: more tensor parallelism "
    "(`--tp`), a faster GPU, or prefix caching for shared prompts (`--enable-prefix-caching` in "
    "vllm-v0; on by default in vllm, sglang and tgi); smaller chunks lengthen it slightly",
    (KV_LOAD, ""): "its prefix came from the CPU offloading tier over PCIe instead of the GPU cache "
    "(still far cheaper than recomputing it): a larger GPU KV cache (`--gpu-memory-utilization`, "
    "FP8 KV) keeps more prefixes on the GPU",
    (OTHER, ""): "the engine was idle while it waited: a batching timer (static `--max-wait`) or "
    "nothing schedulable",
}
_TBT_REMEDIES = {
    "orca": "Orca runs a new prompt whole in the decodes' iteration; " + _CHUNKING,
    "vllm": "lower `--max-num-batched-tokens` to 512-2048: it is the largest chunk one step carries",
    "vllm-v0": "vLLM V0 without chunking runs prompts in prefill-only steps while every decode waits: "
    "`--enable-chunked-prefill --max-num-batched-tokens 512-2048`",
    "sarathi": "lower `--chunk-size` (256-512): it bounds every iteration",
    "sglang": "SGLang runs prefill-only batches while decodes wait: lower `--chunked-prefill-size` "
    "(512-2048) and `--enable-mixed-chunk` so decodes ride along",
    "tgi": "lower `--max-batch-prefill-tokens` (512-2048), and keep prefill chunking on (without it a "
    "new batch is prefilled alone while the running batch waits)",
    "trtllm": "TensorRT-LLM without chunking runs a whole prompt in the decodes' step: "
    "`enable_chunked_prefill: true` with a smaller `--max_num_tokens` (2048-4096) bounds the step; "
    "`capacity_scheduler_policy: MAX_UTILIZATION` pauses decodes when KV runs short (recomputed later)",
    "static": "static batching never mixes prompts into a running batch; the gap is its own batch's work",
}


# Flags that hold waiting prompts back on purpose, when the run set them: they come first.
_HOLDING_FLAGS: dict[tuple[str, str], tuple[tuple[str, ...], str]] = {
    (DECODE_WAIT, "sglang"): (
        ("prefill_decode_interval",),
        "`--prefill-decode-interval {prefill_decode_interval}` skips the prefill pass for that many turns after "
        "each prefill batch (while `--prefill-decode-interval-min-bs` requests decode): lower it, or raise the "
        "min batch so small batches still admit every turn",
    ),
    (DECODE_WAIT, "trtllm"): (
        ("batch_wait_timeout_iters", "batch_wait_max_tokens_ratio"),
        "`batch_wait_timeout_iters: {batch_wait_timeout_iters}` with `batch_wait_max_tokens_ratio: "
        "{batch_wait_max_tokens_ratio}` hold a step's prompts back while generations run until they add up "
        "to that share of `--max_num_tokens`: lower the iterations, or set either to 0 to turn it off",
    ),
}


def remedy(cause: str, policy: str, flags: dict[str, Any] | None = None) -> str:
    text = _REMEDIES.get((cause, policy)) or _REMEDIES.get((cause, ""), "")
    budget = _BUDGET_FLAG.get(policy, "the prefill budget")
    text = text.replace("{budget}", f"`{budget}`")
    names, holding = _HOLDING_FLAGS.get((cause, policy), ((), ""))
    if names and flags and all(flags.get(n) for n in names):
        text = holding.format(**{n: flags[n] for n in names}) + "; else " + text
    return text


def _ms(seconds: float) -> str:
    if seconds >= 10:
        return f"{seconds:,.0f} s"
    return f"{seconds * 1e3:,.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.1f} ms"


def _blockers(breakdowns: Sequence[Breakdown]) -> list[tuple[str, int, float, int]]:
    """(request id, prompt tokens, seconds charged, intervals it appears in), most time first."""
    total: dict[str, list[Any]] = {}
    for b in breakdowns:
        for blocker in b.blockers:
            row = total.setdefault(blocker.request_id, [blocker.prompt_len, 0.0, 0])
            row[1] += blocker.seconds
            row[2] += 1
    ranked = sorted(total.items(), key=lambda x: -x[1][1])
    return [(rid, row[0], row[1], row[2]) for rid, row in ranked]


def _blocker_words(ranked: list[tuple[str, int, float, int]]) -> str:
    shown = [f"{rid} ({n:,} tokens, {_ms(sec)} in all)" for rid, n, sec, _ in ranked[:3]]
    more = f" and {len(ranked) - 3} more" if len(ranked) > 3 else ""
    return ", ".join(shown) + more


def _cause_detail(cause: str, slow: Sequence[Breakdown], peak_kv: float) -> str:
    """What the slow requests' share of ``cause`` was made of, as a clause."""
    if cause in (QUEUED_PREFILL, BATCHED_PREFILL):
        return f"mostly the prefill of {_blocker_words(_blockers(slow))}"
    if cause == PREFILL:
        lens = sorted(b.prompt_len for b in slow)
        chunks = sum(b.num_prefill_chunks for b in slow) / len(slow)
        span = (
            f"{lens[0]:,}"
            if lens[0] == lens[-1]
            else f"{lens[0]:,}-{lens[-1]:,} (median {lens[len(lens) // 2]:,})"
        )
        return f"prompts of {span} tokens, {chunks:.1f} prefill iteration(s) each"
    if cause == KV_WAIT:
        return f"KV usage peaked at {peak_kv:.0%} of the cache"
    if cause == PREEMPTION:
        return f"{sum(b.num_preemptions for b in slow)} preemption(s) among them"
    return ""


def _ttft_words(x: RunExplanation, peak_kv: float, flags: dict[str, Any]) -> str:
    slow = x.ttft[: len(x.slow_ids)]
    total = sum(b.seconds for b in slow)
    totals = {c: sum(b.components[c] for b in slow) for c in TTFT_CAUSES}
    ranked = sorted(totals, key=lambda c: -totals[c])
    # The dominant cause, and the next one too when it holds a fifth of the time.
    causes = [c for i, c in enumerate(ranked[:2]) if i == 0 or (total > 0 and totals[c] / total >= 0.2)]
    who = slow[0].request_id if len(slow) == 1 else f"{len(slow)} requests"
    span = _ms(slow[0].seconds) if len(slow) == 1 else f"{_ms(slow[-1].seconds)}-{_ms(slow[0].seconds)}"
    shares = " and ".join(
        f"{totals[c] / total if total > 0 else 0.0:.0%} was {CAUSE_TEXT[c]}" for c in causes
    )
    text = (
        f"The slowest 1% of requests by TTFT ({who} of {len(x.ttft)}, TTFT {span}): of that time, {shares}."
    )
    engine = x.policy or "this engine"
    shown: set[str] = set()
    for c in causes:
        detail = _cause_detail(c, slow, peak_kv)
        if detail in shown:
            detail = "the same requests"  # queued behind and batched with share one blocker list
        shown.add(detail)
        text += f" {CAUSE_TEXT[c][0].upper()}{CAUSE_TEXT[c][1:]}: " + (f"{detail}; " if detail else "")
        text += f"what addresses it ({engine}): {remedy(c, x.policy, flags)}."
    return text + _longest_wait(x, causes, flags)


def _longest_wait(x: RunExplanation, covered: list[str], flags: dict[str, Any]) -> str:
    """The request that waited longest for anything but its own compute, when that is not the
    slowest requests' story already: short requests behind long ones hide below p99 TTFT."""
    b = max(x.ttft, key=lambda b: b.seconds - b.components[PREFILL])
    wait = b.seconds - b.components[PREFILL]
    if b.request_id in x.slow_ids or wait < 0.5 * b.seconds:
        return ""
    cause = max((c for c in TTFT_CAUSES if c != PREFILL), key=lambda c: b.components[c])
    text = (
        f" The longest wait: {b.request_id} ({b.prompt_len:,} tokens) waited {_ms(wait)} of its "
        f"{_ms(b.seconds)} TTFT, mostly {CAUSE_TEXT[cause]}"
    )
    if cause in (QUEUED_PREFILL, BATCHED_PREFILL) and b.blockers:
        top = b.blockers[0]
        text += f" (the prefill of {top.request_id}, {top.prompt_len:,} tokens)"
    if cause not in covered:
        text += f"; what addresses it ({x.policy or 'this engine'}): {remedy(cause, x.policy, flags)}"
    return text + "."


def _tbt_words(x: RunExplanation, median_gap: float) -> str:
    if not x.stalls:
        return f"No inter-token gap exceeded {_ms(x.tbt_threshold)}."
    totals = {c: sum(b.components[c] for b in x.stalls) for c in TBT_CAUSES}
    cause = max(totals, key=lambda c: totals[c])
    requests = {b.request_id for b in x.stalls}
    text = (
        f"{len(x.stalls)} inter-token gap(s) of {len(requests)} request(s) exceeded "
        f"{_ms(x.tbt_threshold)} (median gap {_ms(median_gap)}); the longest was {_ms(x.stalls[0].seconds)}."
    )
    if cause in (QUEUED_PREFILL, BATCHED_PREFILL):
        rid, n, _, _ = _blockers(x.stalls)[0]
        hit = [b for b in x.stalls if any(bl.request_id == rid for bl in b.blockers)]
        victims = len({b.request_id for b in hit})
        mean = sum(b.seconds for b in hit) / len(hit)
        text += (
            f" The prefill of {rid} ({n:,} tokens) stalled {victims} decoding request(s) for "
            f"{_ms(mean)} each. What addresses it: {_TBT_REMEDIES.get(x.policy, _CHUNKING)}."
        )
    elif cause == PREEMPTION:
        text += f" Most of the stall time was {CAUSE_TEXT[PREEMPTION]}: {remedy(PREEMPTION, x.policy)}."
    else:
        text += f" Most of the stall time was {CAUSE_TEXT[cause]}."
    return text


def run_summary(x: RunExplanation, attributor: Attributor) -> str:
    """The paragraph: which cause dominates the p99 TTFT and the TBT stalls, and what to set."""
    if not x.ttft:
        return "No request finished: nothing to explain."
    rec = attributor.record
    peak = max((u for e in rec.entries for u in e.num_used_blocks), default=0) / max(rec.num_blocks, 1)
    gaps = pooled_gaps(finished(list(attributor.requests.values())))  # between steps: no drafts' zeros
    median_gap = float(np.median(gaps)) if gaps.size else 0.0
    flags = attributor.flags
    refused = _refused_words(list(attributor.requests.values()), len(x.ttft))
    return refused + _overload_words(x) + _ttft_words(x, peak, flags) + " " + _tbt_words(x, median_gap)


def expert_load_words(config: dict[str, Any]) -> str:
    """A run simulated with uneven expert routing (``--expert-imbalance``): every MoE layer
    waited for the busiest EP rank; say so, and what EPLB does about it."""
    load = config.get("expert_load")
    if not load or not load.get("imbalance"):
        return ""
    without = load.get("busiest_without_eplb", 1 + load["imbalance"])
    ratio = load.get("busiest", without)
    eplb = load.get("eplb_redundant_experts") is not None
    share = f"{ratio:.2f}x the mean share at a large batch" + (
        f" with EPLB ({without:.2f}x without)" if eplb else ""
    )
    text = (
        f" Routing was uneven (expert imbalance {load['imbalance']:g}): every MoE layer waited for the "
        f"busiest expert-parallel rank, {share}, which lengthens the prefill-carrying steps most (their "
        "experts are compute-bound)."
    )
    if not eplb:
        text += (
            " EPLB places hot experts apart and replicates them (vLLM and SGLang `--enable-eplb`, with "
            "redundant experts; TensorRT-LLM's load balancer): simulate it with `--enable-eplb "
            "--num-redundant-experts N`."
        )
    return text


def fetch_wait_words(config: dict[str, Any]) -> str:
    """A TensorRT-LLM run with ``batch_wait_timeout_ms`` (the run config's policy flags): every
    step's request fetch waited for ``max_batch_size`` requests (``Engine._fetched``)."""
    flags = config.get("policy_flags") or {}
    wait = flags.get("batch_wait_timeout_ms")
    if config.get("policy") != "trtllm" or not wait:
        return ""
    return (
        f" `batch_wait_timeout_ms: {wait:g}` made every step's request fetch wait up to {wait:g} ms for "
        "`max_batch_size` new requests, decoding steps too (under the overlap scheduler only what the "
        "previous step's forward pass does not cover): lower it or set it to 0 where TPOT matters."
    )


def pipeline_words(config: dict[str, Any]) -> str:
    """A run under pipeline parallelism (the run config's ``pipeline``): every token crossed each
    stage, and a micro-batch carrying a long prompt held every stage for the batches behind it."""
    pipe = config.get("pipeline")
    if not pipe:
        return ""
    # The flag that bounds a micro-batch's tokens, in the engine's own words (none for Orca,
    # whose whole prompts join; Sarathi-Serve's chunk, whose next chunk also waits for the last).
    policy = config.get("policy")
    if policy == "sarathi":
        evens = (
            " A prompt's next chunk waits for its previous one to leave the last stage (Sarathi-Serve's "
            "engine); a lower `chunk_size` evens the micro-batches out"
        )
    elif policy == "trtllm":
        evens = (
            " TensorRT-LLM's PP loop runs whole contexts up to `max_num_tokens` unless "
            "`enable_chunked_prefill` is on; a lower `max_num_tokens` with it evens the micro-batches out"
        )
    elif policy == "vllm-v0":
        evens = (
            " vLLM V0 runs whole prompts in prefill-only micro-batches unless `enable_chunked_prefill` is on; "
            "with it a lower `max_num_batched_tokens` evens the micro-batches out"
        )
    elif policy == "orca":
        evens = (
            " Orca admits whole prompts: nothing evens its micro-batches out but chunked prefill (`sarathi`)"
        )
    else:
        evens = " A lower `--max-num-batched-tokens` evens the micro-batches out"
    return (
        f" The engine ran {pipe['pp']} pipeline stages ({'/'.join(map(str, pipe['layers']))} layers, "
        f"{pipe['link']} between them): every token crossed each stage, so a decode's gap is a trip "
        "through all of them, and the micro-batches in flight hold different decodes; one that "
        f"carries a long prompt holds each stage for the batches behind it.{evens}; more TP per stage "
        "shortens the trip."
    )


def stream_words(config: dict[str, Any], requests: list[Any]) -> str:
    """With a stream interval (the run config's, ``sim/run.py``) the client's ITL is the chunking,
    not the engine: say so, with the client's figures beside the engine's median step gap (the
    gaps explained above are the engine's steps)."""
    rule = StreamInterval.from_json(config.get("stream_interval"))
    if not rule.is_set:
        return ""
    lat = RequestLatencies.of(finished(requests), rule)  # the client's gaps, and the engine's
    client, steps = lat.itl, lat.engine_itl
    if not client.size or steps is None or not steps.size:
        return ""
    p50, p99 = np.percentile(client, [50, 99])
    return (
        f" Streaming holds tokens back ({rule.describe()}): a client's ITL is the gap between chunks, "
        f"p50 {_ms(float(p50))} and p99 {_ms(float(p99))} against the engine's median step gap of "
        f"{_ms(float(np.median(steps)))}; TTFT, TPOT and E2E are not affected. A lower stream interval "
        "smooths what the client sees (at more API-server work per token)."
    )


def _refused_words(requests: list[Any], num_served: int) -> str:
    """Requests turned away at arrival (an engine's 503 valve, backpressure, too long): the times
    that follow are only the served ones'."""
    refused = [r for r in requests if r.status is RequestStatus.FINISHED_REJECTED]
    if not refused:
        return ""
    reasons: dict[str, int] = {}
    for r in refused:
        reason = (r.status_reason or "no reason given").split(" (")[0]
        reasons[reason] = reasons.get(reason, 0) + 1
    top, count = max(reasons.items(), key=lambda item: item[1])
    return (
        f"{len(refused):,} of {len(requests):,} requests were refused at arrival ({count:,} of them: "
        f'"{top}"); the times below are the {num_served:,} finished requests\'. '
    )


# Seconds of median-TTFT growth per second of arrivals that call a run overloaded. In a fluid queue
# the growth is arrival rate / service rate - 1 (0.1: 1.1x), but the medians of the first and last
# quarters measure less (the first quarter queues too, lengths vary): at 0.25 a chat run served at
# 29.5/s and offered 40/s (Llama-3-8B on one H100, SGLang) went unnamed and its paragraph blamed
# admission caps instead.
OVERLOAD_GROWTH = 0.1


# An engine's own limit that turns excess requests away fast (HTTP 503) instead of queueing them.
_QUEUE_CAPS = {
    "vllm": "`--max-num-queued-tokens` (vLLM 0.32: the prompt tokens still in prefill, set to target TTFT "
    "x prefill throughput) or `--max-num-queued-reqs`",
    "sglang": "`--max-queued-requests`",
    "tgi": "`--max-concurrent-requests`",
}


def _overload_words(x: RunExplanation) -> str:
    """A queue that grows through the run is overload, not scheduling: say so first."""
    by_arrival = sorted(x.ttft, key=lambda b: b.start)
    quarter = len(by_arrival) // 4
    if quarter < 5:
        return ""
    first = float(np.median([b.seconds for b in by_arrival[:quarter]]))
    last = float(np.median([b.seconds for b in by_arrival[-quarter:]]))
    span = float(
        np.median([b.start for b in by_arrival[-quarter:]])
        - np.median([b.start for b in by_arrival[:quarter]])
    )
    # A stable system's TTFT does not trend; an overloaded one's queue (and TTFT) grows by a
    # fixed fraction of every second of arrivals.
    if last < 1.0 or last - first < OVERLOAD_GROWTH * span:
        return ""
    return (
        f"TTFT grows through the run (median {_ms(first)} for the first quarter of arrivals, "
        f"{_ms(last)} for the last): requests arrive faster than this deployment serves them, and "
        "no scheduler setting fixes that — lower the rate, or add GPUs or replicas"
        + (
            f"; to keep the served requests' TTFT bounded meanwhile, {cap} turns the excess away (503) "
            "instead of queueing it"
            if (cap := _QUEUE_CAPS.get(x.policy))
            else ""
        )
        + ". "
    )
