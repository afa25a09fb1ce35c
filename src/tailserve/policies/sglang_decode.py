"""SGLang 0.5.23 as the decode server of a prefill/decode pair (``--disaggregation-mode decode``).

Followed from ``disaggregation/decode.py@v0.5.23`` (``DecodePreallocQueue``,
``DecodeTransferQueue``, ``SchedulerDisaggregationDecodeMixin``), ``arg_groups/fields/disagg.py``
and ``arg_groups/pd_disaggregation_hook.py``. One turn of ``event_loop_normal_disagg_decode``:

1. **Retracted requests first** (``resume_retracted_reqs``, :1021): each, in retraction order,
   is given back its KV (``_pre_alloc``: prompt + outputs - 1 tokens, copied back from the host,
   priced as ``CostModel.swap_time``) while a request slot is free and its tokens +
   ``num_reserved_decode_tokens`` fit the budget below (without the single-request term); it
   joins the waiting queue. While any stays retracted, nothing else happens in step 2
   (``process_decode_queue``, :3470: no new pre-allocation and no transfer polled).
2. **Pre-allocation** (``pop_preallocated``, :1333), every ``disaggregation_decode_polling_interval``
   turns (an idle server's turns take no time, so it polls at once): the requests the router dispatched here at arrival, first come first served, each
   given KV for its prompt (``_pre_alloc_fill_len``) and a request slot *before* its prefill
   runs, while ``max(prompt + R, prompt + min(max_tokens, 4096) - retractable)`` fits
   ``free - max(R x active, single)`` (``_required_admission_tokens``, ``_allocatable_token_budgets``,
   :2096): R = ``num_reserved_decode_tokens`` (512), active = running + transferring + waiting +
   pre-allocated in this pass, retractable = the running requests' prompt + output tokens,
   single = the largest running request's prompt + min(max_tokens, 4096) less retractable. The
   first that does not fit stops the pass (head-of-line). A pre-allocated request's prefill may
   start now: the pair's bootstrap (``PrefillBootstrapQueue.pop_bootstrapped``: the prefill
   server admits it once the decode server sent its KV indices, ``can_prefill_before_bootstrap``
   False under the default ``early`` allocation policy) — ``on_prealloc``, the cluster's hook.
   Then the requests whose KV has arrived (``pop_transferred``) join the waiting queue.
3. **Prebuilt admission** (``get_new_prebuilt_batch``, :3375): waiting requests enter the running
   batch, up to ``max_running_requests`` running, without a forward pass: the prefill server
   computed their prompt and sampled their first token, which is emitted now
   (``process_batch_result_prebuilt``).
4. **Decode** every running request, as the ``sglang`` policy does (``update_running_batch``):
   one token each, retraction when the free slots cannot hold the next — but a retracted
   request's KV is kept on the host (``disaggregation_decode_retraction_backup``, ``cpu_tensor``
   inferred) and it waits in the retracted queue of 1., not recomputed.

Request slots: ``max_running_requests`` + ``disaggregation_decode_extra_slots`` (SGLang's
``DecodeReqToTokenPool``: pre-allocated and transferring requests hold one; the extra slots
default to 2 x the running cap when that is at most 32, else 0: ``pd_disaggregation_hook.py:133``).
The decode server's radix cache is off (``disaggregation_decode_enable_radix_cache`` False: the
hook sets ``disable_radix_cache``), so nothing here matches prefixes.

Deviations: a request that could never be pre-allocated, even into an idle server, is rejected
at arrival (SGLang would hold it at the head of the queue); the host copy of a retraction
(device to host) is not priced; the metadata buffers (2 x the request slots) never bind; priority
scheduling does not reorder the pre-allocation queue. Not modelled: the decode radix cache,
HiCache / host receive on the decode server, PD role switch.

``disaggregation_decode_allocation_policy=prefill_complete`` (set on both servers): the prefill
runs without waiting for the decode server (``can_prefill_before_bootstrap``), holds the KV after
it, and the decode server reserves KV only for requests whose prefill is done (the receiver turns
``waiting_for_input`` then, ``mark_prefill_complete``; the others are passed over, not blocking
the pass); the KV is sent once reserved (``on_prealloc``). The notification's own network time
and the prefill server's turn that starts the send are not modelled (the send starts at the
reservation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import SchedulerOutput, new_output
from tailserve.policies.sglang import SglangPolicy
from tailserve.policies.sglang_adder import CLIP_MAX_NEW_TOKENS
from tailserve.policies.sglang_config import SglangConfig
from tailserve.policies.sglang_overlap import drop_in_flight

# ``disaggregation_decode_extra_slots`` unset: 2 x the running cap per worker when that is at most
# this, else none (``pd_disaggregation_hook.py:133-142``).
SMALL_BATCH_EXTRA_SLOTS_LIMIT = 32

NEVER_PREALLOCATED_REASON = (
    "prompt {prompt} + max_tokens {max_tokens} can never be pre-allocated on the decode server's "
    "{capacity} KV slots (it needs max(prompt + num_reserved_decode_tokens {reserved}, prompt + "
    "min(max_tokens, 4096)) with nothing else running); SGLang would hold it at the head of the "
    "queue"
)


def extra_slots(config: SglangConfig, max_running: int) -> int:
    """The request slots past the running cap that pre-allocated and transferring requests may
    hold (``pd_disaggregation_hook.py:133``: SGLang reads the flag's value, else 2 x a small
    explicit running cap)."""
    if config.disaggregation_decode_extra_slots is not None:
        return config.disaggregation_decode_extra_slots
    cap = config.max_running_requests
    if cap is not None and cap <= SMALL_BATCH_EXTRA_SLOTS_LIMIT:
        return 2 * cap
    return 0


class SglangDecodePolicy(SglangPolicy):
    """SGLang's decode server: KV pre-allocated before the prefill, first token from the prefill
    server, retracted requests parked with their KV on the host."""

    summary = "SGLang decode server (P/D): KV pre-allocated before the prefill, prebuilt admission"

    def __init__(self, config: SglangConfig) -> None:
        super().__init__(config)
        self.transferring: dict[str, Request] = {}  # pre-allocated, KV not here yet
        self.kv_arrival: dict[str, float] = {}  # when each one's KV lands, once the pair knows
        self.arrived: list[Request] = []  # SGLang's waiting queue: KV here, not running yet
        self.retracted: list[Request] = []  # KV on the host, waiting for room
        # The pair's hook: called with each request as it is pre-allocated (its prefill may start,
        # or under ``prefill_complete`` its KV may be sent).
        self.on_prealloc: Callable[[Request, float], None] | None = None
        # ``prefill_complete``: KV is reserved only for requests whose prefill is done (the
        # receiver's ``waiting_for_input``); the others are passed over in the queue.
        self.deferred = config.disaggregation_decode_allocation_policy == "prefill_complete"
        self.prefilled: dict[str, float] = {}  # request id -> when its prefill was done
        self.seconds_per_token: float | None = None  # host -> GPU restore, from the cost model
        self._polls = 0
        self.num_prealloc_blocked = 0  # turns whose pre-allocation pass stopped at a request
        self.max_prealloc_queue = 0  # the longest the queue got (SGLang's "#prealloc-req")
        self.num_retracted = 0
        self.restore_seconds = 0.0

    def bind_cost_model(self, cost_model: Any, exact: bool) -> None:
        super().bind_cost_model(cost_model, exact)
        if cost_model is not None:
            self.seconds_per_token = cost_model.swap_time(1)

    # ---- what the pair tells it ------------------------------------------------------------
    def kv_arrives(self, request_id: str, t: float) -> None:
        """The prefill server finished the request and its KV lands here at ``t``."""
        self.kv_arrival[request_id] = t

    def prefill_completed(self, request_id: str, t: float) -> None:
        """``prefill_complete``: the request's prefill was done at ``t``; its KV may be reserved
        from then on."""
        self.prefilled[request_id] = t

    def prefill_failed(self, sched: Scheduler, request_id: str, reason: str, now: float) -> Request | None:
        """The prefill server rejected or aborted the request: its pre-allocation is given back
        (the receiver polls ``KVPoll.Failed`` and the request is aborted), or under
        ``prefill_complete`` it leaves the queue unallocated; returns it."""
        request = self.transferring.pop(request_id, None)
        self.kv_arrival.pop(request_id, None)
        self.prefilled.pop(request_id, None)
        if request is not None:
            sched.loading.remove(request)
            sched.abort(request, f"prefill server: {reason}", now)
            return request
        waiting = [r for r in sched.waiting if r.request_id == request_id]
        if waiting:
            sched.waiting.remove_requests(waiting)
            sched.abort(waiting[0], f"prefill server: {reason}", now)
            return waiting[0]
        return None

    def next_wakeup(self, sched: Scheduler, now: float) -> float | None:
        """The first known KV arrival still ahead."""
        ahead = [t for rid, t in self.kv_arrival.items() if rid in self.transferring and t > now]
        return min(ahead) if ahead else None

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, sched: Scheduler, request: Request) -> None:
        """Into the pre-allocation queue; rejected when even an idle server could not take it."""
        kv = sched.kv_cache
        capacity = kv.num_blocks * kv.block_size
        reserved = self.config.num_reserved_decode_tokens
        if self._admission_tokens(kv.block_size, request, 0) > capacity:
            reason = NEVER_PREALLOCATED_REASON.format(
                prompt=request.prompt_len, max_tokens=request.max_tokens, capacity=capacity, reserved=reserved
            )
            now = request.enqueue_time if request.enqueue_time is not None else request.arrival_time
            sched.reject(request, reason, now)
            return
        sched.waiting.add_request(request)

    def _slots_free(self, sched: Scheduler) -> int:
        cap = self.max_running_requests(sched)
        held = len(sched.running) + len(self.transferring) + len(self.arrived)
        return cap + extra_slots(self.config, cap) - held

    @staticmethod
    def _aligned(tokens: int, page: int) -> int:
        return -(-tokens // page) * page

    def _fill_len(self, request: Request) -> int:
        """``_pre_alloc_fill_len``: the prompt, and a retracted request's outputs but the last."""
        return request.prompt_len + max(request.num_output_tokens - 1, 0)

    def _admission_tokens(self, page: int, request: Request, retractable: int) -> int:
        """``_required_admission_tokens`` with no prefix."""
        fill = self._aligned(self._fill_len(request), page)
        return max(
            fill + self.config.num_reserved_decode_tokens,
            request.prompt_len + min(request.max_tokens, CLIP_MAX_NEW_TOKENS) - retractable,
        )

    def _budget(self, sched: Scheduler, extra: int, retractable: int | None) -> int:
        """``_allocatable_token_budgets``: free tokens less the decode reserve of every active
        request (or, if larger, the room the largest running request could still need)."""
        kv = sched.kv_cache
        active = len(sched.running) + len(self.transferring) + len(self.arrived) + extra
        reserved = self.config.num_reserved_decode_tokens * active
        single = 0
        if retractable is not None and sched.running:
            single = max(
                min(r.max_tokens, CLIP_MAX_NEW_TOKENS) + r.prompt_len - retractable for r in sched.running
            )
        return kv.num_free_blocks * kv.block_size - max(reserved, single)

    # ---- the turn ---------------------------------------------------------------------------
    def schedule(self, sched: Scheduler, now: float) -> SchedulerOutput:
        out = new_output()
        self._resume_retracted(sched, now, out)
        if not self.retracted:
            self._polls = (self._polls + 1) % self.config.disaggregation_decode_polling_interval
            # An idle server's loop turns take no time: it reaches its polling turn at once.
            if self._polls == 0 or not sched.running:
                self._polls = 0
                self._pop_preallocated(sched, now)
                self._pop_transferred(now)
        self._prebuilt(sched, now)
        self._decode(sched, now, out)
        self._last_batch = [s.request for s in out.scheduled]
        self._last_was_prefill = False
        if self.overlap:
            sched.advance_scheduled(out)
        return out

    def _resume_retracted(self, sched: Scheduler, now: float, out: SchedulerOutput) -> None:
        if not self.retracted:
            return
        page = sched.kv_cache.block_size
        reserved = self.config.num_reserved_decode_tokens
        resumed: list[Request] = []
        for request in self.retracted:
            if self._slots_free(sched) - len(resumed) <= 0:
                break
            fill = self._fill_len(request)
            if self._aligned(fill, page) + reserved > self._budget(sched, len(resumed), None):
                break
            sched.waiting.remove_requests([request])
            sched.allocate(request, fill)  # fits: the budget is at most the free slots
            request.num_computed_tokens = fill
            resumed.append(request)
        if not resumed:
            return
        del self.retracted[: len(resumed)]
        restored = sum(r.num_computed_tokens for r in resumed)
        if self.seconds_per_token is None:
            raise RuntimeError(
                "sglang decode server: restoring retracted KV needs a cost model (bind_cost_model)"
            )
        seconds = restored * self.seconds_per_token
        out.kv_copy_time += seconds
        self.restore_seconds += seconds
        for request in resumed:
            request.status = RequestStatus.WAITING
            sched.loading.append(request)
        self.arrived.extend(resumed)

    def _pop_preallocated(self, sched: Scheduler, now: float) -> None:
        waiting = sched.waiting
        if not waiting:
            return
        if self.on_prealloc is None:
            raise ValueError(
                "sglang disaggregation_mode=decode is the decode server of a P/D pair; nothing sends it "
                "KV here (simulate the pair with --prefill-replicas / --decode-replicas)"
            )
        self.max_prealloc_queue = max(self.max_prealloc_queue, len(waiting))
        page = sched.kv_cache.block_size
        retractable = sum(r.prompt_len + r.num_output_tokens for r in sched.running)
        taken: list[Request] = []
        deferred, prefilled = self.deferred, self.prefilled
        for request in waiting:
            if deferred:
                done = prefilled.get(request.request_id)
                if done is None or done > now:
                    continue  # its prefill not done by now: not waiting for input yet (passed over)
            if self._slots_free(sched) <= 0:
                break
            budget = self._budget(sched, 0, retractable)
            if self._admission_tokens(page, request, retractable) > budget:
                self.num_prealloc_blocked += 1
                break
            fill = self._fill_len(request)
            sched.allocate(request, fill)
            request.num_computed_tokens = 0  # its KV arrives with the transfer
            self.transferring[request.request_id] = request
            sched.loading.append(request)
            taken.append(request)
        if not taken:
            return
        if deferred:
            for request in taken:
                del prefilled[request.request_id]
        waiting.remove_requests(taken)
        if self.on_prealloc is not None:
            for request in taken:
                self.on_prealloc(request, now)

    def _pop_transferred(self, now: float) -> None:
        arrival = self.kv_arrival
        landed = [r for rid, r in self.transferring.items() if arrival.get(rid, float("inf")) <= now]
        for request in landed:
            del self.transferring[request.request_id]
            del arrival[request.request_id]
            request.num_computed_tokens = request.prompt_len
        self.arrived.extend(landed)

    def _prebuilt(self, sched: Scheduler, now: float) -> None:
        """``get_new_prebuilt_batch`` and ``process_batch_result_prebuilt``: the first token was
        sampled by the prefill server and is emitted as the request joins the running batch."""
        room = self.max_running_requests(sched) - len(sched.running)
        if room <= 0 or not self.arrived:
            return
        joining, self.arrived = self.arrived[:room], self.arrived[room:]
        done: list[Request] = []
        for request in joining:
            sched.loading.remove(request)
            sched.admit(request, now)
            if request.num_output_tokens == 0:  # a resumed request has its outputs already
                request.num_output_tokens = 1
                request.token_times.append(now)
                if request.max_tokens == 1:
                    request.status = RequestStatus.FINISHED_LENGTH
                    done.append(request)
        if done:
            sched.finish(done, now)

    # ---- retraction: to the host, not recomputed -------------------------------------------
    def _requeue(self, sched: Scheduler, request: Request, now: float, out: SchedulerOutput) -> None:
        """A retracted request keeps its prompt and outputs; its KV waits on the host
        (``decode.py`` ``add(is_retracted=True)``: the retracted queue), restored by 1."""
        request.enqueue_time = now
        sched.waiting.add_request(request)
        self.retracted.append(request)
        self.num_retracted += 1
        out.preempted.append(request)
        drop_in_flight(self._step_in_flight(sched), request)

    def notes(self) -> list[str]:
        notes = super().notes()
        if self.num_prealloc_blocked:
            notes.append(
                f"sglang decode server: {self.num_prealloc_blocked} pre-allocation passes stopped at a "
                "request the KV budget could not take (its prefill waited for it); the queue reached "
                f"{self.max_prealloc_queue} requests"
            )
        if self.num_retracted:
            notes.append(
                f"sglang decode server: {self.num_retracted} retractions; their KV restored from the "
                f"host in {self.restore_seconds:.3f} s of copies"
            )
        return notes

    def admits_fcfs(self) -> bool:
        return False  # no prefill queue: requests are admitted as their KV arrives

    def can_fast_forward(self, sched: Scheduler) -> bool:
        """Runs of decode steps only while nothing waits for pre-allocation (retracted requests
        wait there too) or for admission, and no transfer's landing time is known: otherwise a
        turn may admit (the budget moves as the running requests grow, a transfer lands). A
        pre-allocated request whose prefill has not finished lands nothing before its prefill
        server hands it over, which the pair's loop bounds the run by (``lockstep_pd.py``).
        Polling every turn only: a longer interval counts turns."""
        if sched.waiting or self.arrived or self.kv_arrival:
            return False
        if self.config.disaggregation_decode_polling_interval != 1:
            return False
        return super().can_fast_forward(sched)
