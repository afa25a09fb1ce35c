"""vLLM V1's scheduling pass with output placeholders and draft tokens: the ``vllm`` policy with
``async_scheduling`` or speculative decoding (``docs/policies.md``, "`vllm` — vLLM V1").

Followed from vLLM 0.32 (``vllm/v1/core/sched/scheduler.py``: ``schedule``,
``_update_after_schedule``; ``async_scheduler.py``; ``kv_cache_manager.py``: ``allocate_slots``),
where it differs from the plain pass in ``vllm.py``:

- vLLM advances a request's computed tokens when it schedules them (``Scheduler.advance_scheduled``)
  and, under async scheduling, counts the outputs of steps in flight as placeholders: a running
  request is granted ``num_tokens + drafts + placeholders - computed`` — one more decode before
  its last token is known.
- The ``max_tokens`` guard: a request whose in-flight step already yields its last token
  (``computed + 2 - placeholders >= prompt + max_tokens``) is skipped, not scheduled again; a
  request that stops on a stop token is not foreseen and gets one extra step, whose output is
  dropped.
- Grants are capped at ``max_model_len - computed - 1`` (room for the sampled token); a grant of
  0 skips the request.
- Speculative decoding: a decoding request holds drafts (``Request.num_draft_tokens``); they are
  scheduled with it and count against the token budget, cut when the budget (or
  ``long_prefill_token_threshold``) is short; KV is allocated for the grant plus the drafter's
  lookahead slots, and only tokens already known are cached. A newly admitted request with one
  token left (a one-token prompt, or a prompt cached but for its last token) is padded to
  ``1 + k`` with placeholder drafts when no prefill chunk runs, or admission stops if the budget
  cannot hold the padding. With an EAGLE-family drafter a prefix hit gives up its last block.
- A priority victim before the current position moves the position back whether or not it was
  scheduled (async scheduling skips requests).

The waiting pass is otherwise the plain one (FCFS or priority, the full-prompt gate, the
watermark, head-of-line blocking, no admission in a step that preempted). Handed the policy's
config (``cfg``: a ``VllmConfig``, not imported: ``vllm.py`` imports this module) and its
``SpecDecoding``.
"""

from __future__ import annotations

from typing import Any

from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import (
    ScheduledRequest,
    SchedulerOutput,
    alternate_decode,
    new_output,
    scheduled_decode,
)
from tailserve.executors.simulated.spec_decode import SpecDecoding
from tailserve.kv.paged import NEVER
from tailserve.kv.prefix import PrefixMatch
from tailserve.policies.vllm_dp_prefill import PrefillThrottle
from tailserve.policies.vllm_offload import BLOCKED, OffloadLoads
from tailserve.policies.vllm_pipeline import DecodeStagger
from tailserve.policies.vllm_prefill_cap import prefill_cap


def schedule_advanced(
    cfg: Any,
    spec: SpecDecoding | None,
    sched: Scheduler,
    now: float,
    decode_items: dict[Request, list[ScheduledRequest]],
    offload: OffloadLoads | None,
    throttle: PrefillThrottle,
    stagger: DecodeStagger | None = None,
) -> SchedulerOutput:
    """One step of vLLM's scheduler with its own accounting. ``decode_items``: the policy's two
    plain decode items per running request, handed out in turn (``ScheduledRequest``; a batch
    queue deeper than two makes new ones);
    ``offload``: the CPU offloading tier's loads (``vllm_offload.py``), None without one;
    ``throttle``: DP prefill balancing (``vllm_dp_prefill.py``); ``stagger``: the V2 model runner's
    decode stagger under pipeline parallelism with async scheduling (``vllm_pipeline.py``)."""
    out = new_output()  # ``SchedulerOutput()`` without the class call
    # A plain decode's item: one of its two in turn, or a new one where more than two of its
    # steps may be in flight (a batch queue deeper than two: pipeline parallelism).
    decode_item = alternate_decode if sched.max_concurrent_batches <= 2 else _new_decode
    k = spec.num_speculative_tokens if spec is not None else 0
    lookahead = spec.num_lookahead_tokens if spec is not None else 0
    drop_hit_block = spec is not None and spec.drops_hit_block
    out.num_spec_tokens_to_schedule = k
    budget = cfg.max_num_batched_tokens
    cap = cfg.long_prefill_token_threshold
    if cap:  # (vLLM's get_request_counts: loads from the CPU tier among the waiting)
        cap = prefill_cap(cfg, len(sched.running) + len(sched.waiting) + len(sched.loading))
    max_len = sched.max_model_len
    kv = sched.kv_cache
    block_size = kv.block_size
    # The manager's registration thresholds (``registers_from``), tested before the decodes'
    # registration call below, read as ``Scheduler.update_advanced`` reads them: None, every
    # call counts; empty, none is due (no prefix caching; or no request has a keyed block left
    # to register, as in a workload without token ids).
    gate = kv.registers_from if kv.prefix_caching else {}
    waiting = sched.waiting
    scheduled = out.scheduled
    preempted = out.preempted
    prefill_scheduled = False  # a running request continues a prefill this step (read with k)

    # Running requests, oldest admission first. The list is bound once (``preempt_by_recompute``
    # removes from this very list) and its length too, refreshed where a preemption can change
    # it: this loop runs per running request per step.
    running = sched.running
    num_running = len(running)
    # The leading plain decodes that each sample (one token on its placeholder, no drafts), and
    # their context tokens, for ``decode_head``; ``leading`` ends at the first other entry.
    leading = True
    num_leading = context = 0
    defer = throttle.throttled and throttle.defers(any(not r.is_prefill_chunk for r in running))
    skips = defer or stagger is not None  # (one test per running request when neither is on)
    tracked = throttle.deferred if throttle.tracking else None
    i = 0
    while i < num_running and budget > 0:
        request = running[i]
        computed = request.num_computed_tokens
        placeholders = request.num_output_placeholders
        prompt_len = request.prompt_len
        if placeholders and computed + 2 - placeholders >= prompt_len + request.max_tokens:
            i += 1  # its last token is already in flight
            continue
        if skips and (
            (stagger is not None and stagger.waits(request))  # decoded under pp passes ago (vllm_pipeline.py)
            or (
                defer and request.is_prefill_chunk
            )  # a prefill chunk waits for a cadence step (vllm_dp_prefill.py)
        ):
            i += 1
            continue
        num_tokens = prompt_len + request.num_output_tokens
        drafts = request.num_draft_tokens
        want = num_tokens + drafts + placeholders - computed
        if want != 1:
            if 0 < cap < want:
                want = cap
            if want > budget:
                want = budget
        # (A grant of 1, most of them, is under any cap and the budget, which is > 0 here.)
        if want > max_len - computed - 1:
            want = max_len - computed - 1
        if want <= 0:
            i += 1
            continue
        if want == 1 and not lookahead and computed % block_size:
            # A decode whose slot is in its last, partly filled block: ``allocate`` would take
            # no block (so preempt nobody), only cache the blocks its known tokens fill. The
            # common step, kept cheap (the decodes of every step an async run steps): its known
            # tokens fill a block once in ``block_size`` steps, so the call is made only then.
            if gate is None or gate:
                known = computed + 1 if computed < num_tokens else num_tokens
                if gate is None or known >= gate.get(request.request_id, NEVER):
                    sched.cache_computed(request, known)
        else:
            self_preempted = False
            while not sched.allocate(
                request,
                min(computed + want + lookahead, max_len),
                num_cached=min(computed + want, request.num_tokens),
            ):
                victim = waiting.preemption_victim(running)
                if victim.num_in_flight_tokens and sched.defer_in_flight_frees:
                    # Its blocks would come back only after its step in flight: vLLM preempts
                    # nobody ("a deferred free will not help"), the request waits, the pass ends.
                    self_preempted = True
                    break
                if running.index(victim) < i:
                    i -= 1
                item = next((s for s in scheduled if s.request is victim), None)
                if item is not None:  # already scheduled this step (priority): its tokens go back
                    scheduled.remove(item)
                    budget += item.num_new_tokens
                sched.preempt_by_recompute(victim)
                waiting.prepend_request(victim)
                preempted.append(victim)
                if victim is request:
                    self_preempted = True
                    break
            num_running = len(running)
            if self_preempted:
                break  # a request that preempted itself (or could not) ends the running pass
        if k and request.is_prefill_chunk:  # (only the padding of new decodes reads it)
            prefill_scheduled = True
        num_spec = 0
        if drafts:
            known = request.num_tokens + placeholders
            num_spec = min(max(computed + want - known, 0), drafts)
            request.num_draft_tokens = 0  # the drafter proposes the next ones after this step
        if num_spec or want != 1:
            scheduled.append(ScheduledRequest(request, want, computed, num_spec_tokens=num_spec))
            leading = False
        else:
            scheduled.append(decode_item(decode_items, request, computed))  # a plain decode
            if leading:
                if computed + 1 == num_tokens + placeholders:  # its one token was all it lacked
                    num_leading += 1
                    context += computed
                else:
                    leading = False  # a chunk cut to one token: it samples nothing
        budget -= want
        i += 1
    if not preempted:
        # Vouched for only where nobody was preempted (a priority victim's entry may have left
        # the head); the waiting pass appends after it.
        out.decode_head = (num_leading, context)

    # Waiting requests, unless someone was preempted.
    if not preempted:
        running_scheduled = bool(scheduled)
        watermark_blocks = int(cfg.watermark * kv.num_blocks)
        queue = waiting
        max_active = cfg.max_num_active_seqs or cfg.max_num_seqs  # (admission into RUNNING)
        if offload is not None:
            queue = offload.pass_queue(sched, now)  # the requests whose KV is in first
        stale: list[Request] = []  # skipped for this pass: outputs of their steps still in flight
        while queue and budget > 0 and len(sched.running) < max_active:
            request = queue.peek_request()
            if request.num_stale_output_tokens and queue is waiting:
                # Preempted with steps still in the pipeline (pipeline parallelism: a batch
                # queue deeper than two): vLLM skips it until they drain ("deliverable stale
                # output still in flight", scheduler.py:934-939@v0.32.0).
                stale.append(queue.pop_request())
                if tracked is not None:
                    tracked.add(request)  # vLLM's skip_request: deferred_waiting
                continue
            match: PrefixMatch | None = None
            if not request.num_computed_tokens:
                match = sched.cached_prefix(request)
                if match is not None and match.num_tokens and drop_hit_block:
                    # EAGLE's drafter needs the last cached block's hidden states recomputed.
                    match = PrefixMatch(match.num_tokens - block_size, match.kv_indices[:-1])
            hit = match.num_tokens if match is not None else 0
            if offload is not None and not request.num_computed_tokens:
                # The CPU tier's blocks after the GPU hit: a request that has some only loads now.
                reserve = watermark_blocks if sched.running else 0
                taken = offload.admit(
                    sched, request, match, hit, now, reserve, cfg.scheduler_reserve_full_isl
                )
                if taken is BLOCKED:
                    break
                if taken is not None:
                    if tracked is not None:
                        tracked.add(request)  # vLLM's ``deferred_waiting``, until admitted
                    continue  # loading, or skipped for this pass
            # KV already computed: the hit, or (no lookup then) what a request brings with it (a
            # P/D decode replica's request, its KV transferred: cluster/disagg.py).
            known = request.num_computed_tokens + hit
            if defer and known < request.num_tokens - 1:
                break  # prompt tokens to compute: they wait for a cadence step
            want = request.num_remaining_tokens - hit
            padded = False
            # A new decode padded to the uniform decode size (1 + k), if that fits max_model_len:
            # with running requests scheduled, or KV of its own (a hit, or a load's).
            pad = k and want == 1 and not prefill_scheduled and (running_scheduled or known)
            if pad and known + 1 + k + 1 <= max_len:
                if 1 + k > budget:
                    break  # vLLM prefers not scheduling it to scheduling it unpadded
                want = 1 + k
                padded = True
            if 0 < cap < want:
                want = cap
            if not cfg.enable_chunked_prefill and want > budget:
                break
            want = min(want, budget)
            reserve = watermark_blocks if sched.running else 0
            slots = min(known + want + lookahead, max_len)
            num_cached = min(known + want, request.num_tokens)
            if hit:
                assert match is not None
                free = kv.free_block_count()
                if cfg.scheduler_reserve_full_isl and (
                    kv.num_blocks_needed_after_hit(match, request.num_tokens) + reserve > free
                ):
                    break
                if kv.num_blocks_needed_after_hit(match, slots) + reserve > free:
                    break
                sched.allocate_with_cached_prefix(request, match, slots, num_cached=num_cached)
            else:
                if cfg.scheduler_reserve_full_isl and not kv.can_allocate(
                    request.request_id, request.num_tokens, reserve
                ):
                    break
                if not sched.allocate(request, slots, reserve, num_cached=num_cached):
                    break  # head-of-line blocking: nothing behind it is tried
            if hit and request.first_scheduled_time is None:
                request.num_cached_tokens = hit
            # In vLLM's in-flight prefills from now if partial (the reserve of KV loads), and for
            # the rest of this pass if it comes from a load (vLLM drops a request from the set
            # only after the pass, ``_update_after_schedule``); the step's ``advance_scheduled``
            # says it anew.
            loaded = offload is not None and bool(offload.held) and offload.held[0] is request
            request.is_prefill_chunk = loaded or known + want < request.num_tokens
            queue.pop_request()
            sched.admit(request, now)
            if tracked:
                tracked.discard(request)
            out.num_admitted += 1
            scheduled.append(
                ScheduledRequest(
                    request,
                    want,
                    request.num_computed_tokens,
                    num_spec_tokens=k if padded else 0,
                    spec_padding=padded,
                )
            )
            budget -= want

        for request in reversed(stale):  # back where they were, as vLLM prepends them
            waiting.prepend_request(request)
        if offload is not None:
            offload.requeue(waiting)
        if tracked is not None and not defer:  # (read only on throttled steps: tracking's)
            throttle.released(len(waiting) + len(sched.loading))

    sched.advance_scheduled(out)
    return out


def _new_decode(
    items: dict[Request, list[ScheduledRequest]], request: Request, num_context_tokens: int
) -> ScheduledRequest:
    """``alternate_decode``'s stand-in under a batch queue deeper than two: a new item each step."""
    return scheduled_decode(request, num_context_tokens)
