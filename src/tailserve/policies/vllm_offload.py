"""vLLM's native KV offloading, the scheduler's side: loads from the CPU tier (``--kv-offloading-size``).

Followed from vLLM 0.32 (``v1/core/sched/scheduler.py`` with the ``OffloadingConnector``):

- **Admission.** A new request's GPU prefix hit is looked up first; the CPU tier is then asked
  for the blocks right after it (``get_num_new_matched_tokens``). When it holds some, the request
  is admitted *for loading only* (``load_kv_async``): it gets blocks for its hit and the loaded
  tokens (``allocate_slots`` with ``num_new_tokens=0``, the full-sequence gate and the watermark
  as any admission, and ``reserved_blocks``: what the prefills in flight still need to finish),
  uses no token budget, and leaves the waiting queue for ``WAITING_FOR_REMOTE_KVS``
  (``Scheduler.loading``); the pass goes on to the next request. A load that does not fit stops
  the pass, as any admission that does not fit.
- **The transfer.** The worker starts it with the step that carries it, on its own stream, after
  the transfers before it (``cpu/gpu_worker.py``: one stream per transfer, each waiting for the
  previous one): ``start = max(step start, link free)``, ``done = start + tokens x the KV bytes
  per token per GPU / the host link's bandwidth`` (``CostModel.swap_time``: each GPU moves its
  own shard in parallel). Stores go the other way and are not priced (they delay nothing).
- **Back to waiting.** The worker reports a finished load at the end of a step
  (``get_finished``); at the next pass the request's loaded blocks are cached and its computed
  tokens counted, recomputing the last prompt token when the hit covered it all
  (``_update_waiting_for_remote_kv``). A loading request sits in vLLM's ``kv_holding_waiting``
  queue, which each pass drains before the waiting queue, skipping the loads not done: so the
  requests whose KV is in are tried first, in that queue's order (``HeldFirst``): under fcfs the
  order their loads were admitted in (the skipped ones are put back in pass order), under
  ``priority`` by their own key. They stay in ``Scheduler.loading`` until scheduled. Under async
  scheduling a step's report is read one pass later (its output is applied after the next step
  is scheduled), an idle engine's at once; an idle engine wakes when a load is done
  (``next_wakeup``). A request aborted while its load is in flight keeps its blocks until the
  load is done (``load_done``; vLLM frees them at ``finished_recving``).
- **Not now.** A request whose tier hit another request is loading right now, or meets a chunk
  still being stored, is skipped for the pass (``_lookup_complete_chunks``'
  ``_chunks_being_loaded`` check, ``HIT_PENDING``; ``skip_request``): it stays in the waiting
  queue and the pass goes on behind it. A load's chunks are unpinned when its report is read
  (``complete_load``), an aborted load's too.

vLLM counts a loaded prompt's tokens as cached (``num_cached_tokens`` = its computed tokens at
first schedule), so TTFT and the hit rate read as vLLM's; the tier's own figures are its stats
(``HostTierStats``, the run's note).
"""

from __future__ import annotations

from dataclasses import dataclass

from tailserve.core.queues import PriorityRequestQueue, RequestQueue, priority_key
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.kv.prefix import PrefixMatch

# What ``OffloadLoads.admit`` did with a waiting request (None: nothing, admit it as usual).
LOADING = "loading"  # admitted to load; it left the waiting queue
SKIPPED = "skipped"  # its hit is being loaded by another request: out of the queue for this pass
BLOCKED = "blocked"  # its load does not fit: the pass stops, as any admission that does not fit


@dataclass(slots=True)
class _Load:
    keys: list[int]  # the chunks it loads, pinned in the tier until it is done
    start: float  # when it was admitted (its step's start)
    done: float  # when its KV is on the GPU


class OffloadLoads:
    """The loads in flight of one engine and its host link."""

    uses_host_tier = True  # its KV comes from the KV manager's CPU tier

    def __init__(self, async_scheduling: bool, advanced: bool = False) -> None:
        # Seconds to move one token's KV shard from host to GPU (``bind``); None until a cost
        # model prices it.
        self.seconds_per_token: float | None = None
        self.async_scheduling = async_scheduling
        # vLLM's advanced pass (async scheduling or drafts: ``vllm_async.py``) keeps
        # ``Request.is_prefill_chunk``; the plain pass ``Request.prefill_outputs`` (``_reserved``).
        self.advanced = advanced
        # With speculative decoding, the KV slots one decode step takes: 1 + k drafts + the
        # drafter's lookahead slots (vLLM's ``num_spec_decode_tokens``); 0 without (``bind_spec``).
        self.spec_step_tokens = 0
        self._link_free = 0.0
        self._loads: dict[Request, _Load] = {}
        # Async scheduling: loads found done at the last pass, promoted at this one.
        self._reported: list[Request] = []
        # Requests skipped in this pass: their tier hit is being loaded by another request
        # (vLLM's ``_chunks_being_loaded`` check answers "not now"); back in the queue after it.
        self._skipped: list[Request] = []
        # Loaded requests (KV in) not yet scheduled, in the order vLLM tries them (module
        # docstring); still in ``Scheduler.loading``.
        self.held: list[Request] = []
        # Loads of aborted requests still in flight, with whether they were done by the last
        # pass: their chunks stay pinned until the worker reports them (vLLM's
        # ``complete_load``), as their blocks stay held (``load_done``).
        self._dropped: list[tuple[_Load, bool]] = []

    def __bool__(self) -> bool:
        return bool(self._loads) or bool(self.held) or bool(self._dropped)

    def only_in_flight(self) -> bool:
        """Nothing but loads in flight, none of them read yet (the passes of a decode run, which
        ends before the next load's end, change nothing here)."""
        return not (self.held or self._dropped or self._reported)

    def bind_spec(self, num_speculative_tokens: int, num_lookahead_tokens: int) -> None:
        """Speculative decoding's slots per decode step, which the load reserve counts."""
        self.spec_step_tokens = (
            1 + num_speculative_tokens + num_lookahead_tokens if num_speculative_tokens else 0
        )

    def next_done(self, now: float) -> float | None:
        """When an idle engine must look again: the earliest load to finish. (In virtual time an
        idle engine's pass has promoted every load done by then; on a wall clock one may finish
        between that pass and the wait, which then returns at once.)"""
        held = self.held
        return min((load.done for r, load in self._loads.items() if r not in held), default=None)

    def load_done(self, request: Request) -> float | None:
        """When the request's load in flight is done (None: none is)."""
        load = self._loads.get(request)
        return None if load is None else load.done

    def admit(self, sched: Scheduler, request: Request, match: PrefixMatch | None, hit: int, now: float,
              reserve: int, full_sequence: bool) -> str | None:  # fmt: skip
        """A new request at the head of the waiting pass, its GPU hit ``hit`` tokens (``match``):
        LOADING, SKIPPED or BLOCKED when the CPU tier holds blocks right after the hit, None when
        it holds none (the pass admits it as usual)."""
        num_load = self.lookup(sched, request, hit)
        if not num_load:
            return None
        if num_load < 0:
            self.skip(sched.waiting)
            return SKIPPED
        if not self.start(sched, request, match, hit, num_load, now, reserve, full_sequence):
            return BLOCKED
        return LOADING

    def start(self, sched: Scheduler, request: Request, match: PrefixMatch | None, hit: int, num_load: int,
              now: float, reserve: int, full_sequence: bool) -> bool:  # fmt: skip
        """Admit ``request`` to load ``num_load`` tokens after its GPU hit of ``hit``; False
        (nothing changed) when its blocks do not fit. The caller has removed nothing yet; on
        success the request has left the waiting queue for ``sched.loading``."""
        kv = sched.kv_cache
        rid = request.request_id
        free = kv.free_block_count()
        if kv.prefix_caching:
            hit_match = match if match is not None else PrefixMatch(0, [])

            def needed(tokens: int) -> int:
                return kv.num_blocks_needed_after_hit(hit_match, tokens)
        else:  # (a P/D decode side without prefix caching: nothing is cached, nothing hit)

            def needed(tokens: int) -> int:
                return kv.num_blocks_needed(rid, tokens)

        if full_sequence and needed(request.num_tokens) + reserve > free:
            return False
        total = hit + num_load
        # The load takes no lookahead slots yet (vLLM allocates them once it runs), but keeps
        # room for its first decode step's (``_spec_decode_step_blocks``).
        step = kv.blocks_for(self.spec_step_tokens) if self.spec_step_tokens else 0
        if needed(total) + reserve > free - self._reserved(sched) - step:
            return False
        # The loaded blocks are cached when they arrive (``delay_cache_blocks``).
        if match is not None and hit:
            sched.allocate_with_cached_prefix(
                request, match, total, num_computed_tokens=total, register=False
            )
        else:
            if kv.allocate(rid, total) is None:
                return False
            request.num_computed_tokens = total
        keys, done = self.begin(sched, request, hit, num_load, now)
        request.prefill_outputs = request.num_output_tokens  # an in-flight prefill (``_reserved``)
        request.is_prefill_chunk = True
        self._loads[request] = _Load(keys, now, done)
        sched.waiting.pop_request()
        sched.loading.append(request)
        return True

    # ---- the source of the KV: the CPU tier (a pair's remote prefill: ``vllm_remote.py``) ----
    def lookup(self, sched: Scheduler, request: Request, hit: int) -> int:
        """Tokens to load after the GPU hit of ``hit`` (0: none; negative: being loaded by
        another request, not now)."""
        return sched.kv_cache.host_lookup(request.request_id, hit, request.num_tokens)  # type: ignore[attr-defined]

    def begin(
        self, sched: Scheduler, request: Request, hit: int, num_load: int, now: float
    ) -> tuple[list[int], float]:
        """Start the copy of ``num_load`` tokens after the hit: the tier's chunks it reads
        (pinned until done) and when it is done (one host link, FIFO)."""
        if self.seconds_per_token is None:
            raise RuntimeError("kv offloading needs a cost model to price its loads (bind_cost_model)")
        kv = sched.kv_cache
        keys = kv.host_keys(request.request_id, hit, num_load)  # type: ignore[attr-defined]
        host = kv.host
        assert host is not None
        host.pin(keys)
        begin = now if now > self._link_free else self._link_free
        done = self._link_free = begin + num_load * self.seconds_per_token
        host.stats.num_loads += 1
        host.stats.num_hits += num_load
        return keys, done

    def end(self, sched: Scheduler, load: _Load) -> None:
        """A load done (or dropped): its chunks unpinned, its time counted."""
        host = sched.kv_cache.host
        if host is not None:
            host.unpin(load.keys)
            host.stats.load_seconds += load.done - load.start

    def _reserved(self, sched: Scheduler) -> int:
        """vLLM's ``_inflight_prefill_reserved_blocks``: the blocks the prefills in flight still
        need for their whole sequence. Those are the loads (and loaded requests not yet
        scheduled) and the running requests admitted, or last scheduled, with a chunk that left
        part of their tokens uncomputed, until a step computes them all (``_inflight_prefills``:
        a preempted request recomputing its outputs is one too)."""
        kv = sched.kv_cache
        tables = kv.block_tables
        reserved = 0
        if self.advanced:
            prefilling = [r for r in sched.running if r.is_prefill_chunk]
        else:
            prefilling = [r for r in sched.running if r.prefill_outputs == r.num_output_tokens]
        extra = self.spec_step_tokens  # (a whole sequence's blocks and one decode step's slots)
        for request in (*prefilling, *sched.loading):
            need = kv.blocks_for(request.num_tokens + extra) - len(tables.get(request.request_id, ()))
            if need > 0:
                reserved += need
        return reserved

    def read_reports(self, sched: Scheduler, now: float) -> None:
        """At each pass's start, whether or not it reaches the waiting queue: the loads reported
        done by now join ``held`` (vLLM's ``finished_recving_kv_req_ids``, filled as outputs
        are applied)."""
        loads = self._loads
        lag = sched.reports_lag()
        # Under the lag, what the step in flight before reported is seen now.
        ready = self._reported if lag else [r for r, load in loads.items() if load.done <= now]
        if self._dropped:
            self._end_dropped(sched, now, lag)
        held = self.held
        if ready:
            known = set(held)
            new = [r for r in ready if r not in known]
            if new:
                for request in new:
                    # Reported done: its chunks are unpinned now (``complete_load``), whenever
                    # the pass promotes it.
                    self.end(sched, loads[request])
                held.extend(new)
                if isinstance(sched.waiting, PriorityRequestQueue):
                    held.sort(key=priority_key)
                elif len(held) > 1:
                    position = {id(r): i for i, r in enumerate(sched.loading)}  # admission order
                    held.sort(key=lambda r: position[id(r)])
        if self.async_scheduling:
            self._reported = [r for r, load in loads.items() if load.done <= now and r not in held]

    def _end_dropped(self, sched: Scheduler, now: float, lag: bool) -> None:
        """Unpin the chunks of aborted requests' loads reported by now (``read_reports``' rule)."""
        host = sched.kv_cache.host
        left = []
        for load, seen in self._dropped:
            if seen if lag else load.done <= now:
                if host is not None:
                    host.unpin(load.keys)
            else:
                left.append((load, load.done <= now))
        self._dropped = left

    def pass_queue(self, sched: Scheduler, now: float) -> RequestQueue | HeldFirst:
        """What the waiting pass walks: the requests whose KV is in (``held``) first, then the
        waiting queue. A held request is promoted when the pass reaches it, as vLLM's
        ``_handle_blocked_waiting_request`` is called on the head of ``kv_holding_waiting``: a
        pass that never gets there (no budget or running slot left) caches nothing of it."""
        return HeldFirst(self, sched, now) if self.held else sched.waiting

    def promote(self, sched: Scheduler, request: Request, now: float) -> None:
        """A held request reached by the pass: its load is over, its loaded blocks cached and
        counted (the last prompt token recomputed when the hit covered it all)."""
        load = self._loads.pop(request)  # (ended when reported: ``read_reports``)
        sched.cache_computed(request, request.num_computed_tokens)
        if request.num_computed_tokens >= request.num_tokens:
            request.num_computed_tokens = request.num_tokens - 1
        if request.first_scheduled_time is None:  # vLLM: its computed tokens at first schedule
            request.num_cached_tokens = self.cached_tokens(request)
            request.kv_load = (load.start, now, self.loaded_tokens(request, load, sched.kv_cache.block_size))

    def skip(self, waiting: RequestQueue) -> None:
        """vLLM's ``skip_request``: the head leaves the queue for this pass, the pass goes on."""
        self._skipped.append(waiting.pop_request())

    def requeue(self, waiting: RequestQueue) -> None:
        """After the pass, the skipped requests go back where they were (vLLM prepends them)."""
        skipped = self._skipped
        if skipped:
            for request in reversed(skipped):
                waiting.prepend_request(request)
            self._skipped = []

    def loaded_tokens(self, request: Request, load: _Load, block_size: int) -> int:
        """Tokens the load moved (``Request.kv_load``)."""
        return len(load.keys) * block_size

    def cached_tokens(self, request: Request) -> int:
        """Its cached tokens as vLLM counts them: all it has computed at its first schedule,
        the loaded ones included."""
        return request.num_computed_tokens

    def forget(self, sched: Scheduler, finished: list[Request]) -> None:
        """Loads of requests that left (aborted while loading) are dropped; their chunks stay
        pinned until the load is reported (``_end_dropped``)."""
        for request in finished:
            load = self._loads.pop(request, None)
            reported = request in self._reported
            if reported:
                self._reported.remove(request)
            if request in self.held:
                self.held.remove(request)  # (its load ended when reported)
            elif load is not None and load.keys:
                self._dropped.append((load, reported))


class HeldFirst:
    """The waiting pass's queue (``OffloadLoads.pass_queue``): the requests whose KV is in
    (vLLM's ``kv_holding_waiting``, the loads not done skipped) before the waiting queue. The
    head is promoted when first looked at; popping a held request takes it out of
    ``Scheduler.loading``, and the pass admits it as any waiting request."""

    __slots__ = ("held", "loads", "now", "sched", "waiting")

    def __init__(self, loads: OffloadLoads, sched: Scheduler, now: float) -> None:
        self.loads, self.sched, self.now = loads, sched, now
        self.held, self.waiting = loads.held, sched.waiting

    def __bool__(self) -> bool:
        return bool(self.held) or bool(self.waiting)

    def peek_request(self) -> Request:
        held = self.held
        if not held:
            return self.waiting.peek_request()
        request = held[0]
        if request in self.loads._loads:
            self.loads.promote(self.sched, request, self.now)
        return request

    def pop_request(self) -> Request:
        if self.held:
            request = self.held.pop(0)
            self.sched.loading.remove(request)
            return request
        return self.waiting.pop_request()
