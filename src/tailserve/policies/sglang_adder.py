"""SGLang's prefill admission: one pass of its ``PrefillAdder`` over the waiting queue.

Split from ``sglang.py`` (the policy) because it is SGLang's own separate component: the KV and
token budgets of one prefill batch, chunking, and priority preemption to make room. As in SGLang
(``schedule_policy.py``), the adder is handed its collaborators and budgets explicitly — the page
size and KV pool (the scheduler), the radix cache (``SglangRadix``), the running batch, the
``new_token_ratio``, the input and chunk budgets and the preemption threshold — and never sees
the policy, so this module imports nothing of ``sglang.py``.
"""

from __future__ import annotations

import enum

from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import ScheduledRequest
from tailserve.kv.hiradix import HiPrefixMatch
from tailserve.kv.paged import KVCacheManager
from tailserve.kv.prefix import PrefixMatch
from tailserve.policies.sglang_radix import SglangRadix

# SGLang's environment defaults (``environ.py``, ``schedule_policy.py``).
CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
INIT_NEW_TOKEN_RATIO = 0.7  # SGLANG_INIT_NEW_TOKEN_RATIO
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
RETRACT_DECODE_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS
IGNORE_EOS_RESERVE_TOKENS = 1

ABORT_REASON = (
    "Out of memory even after retracting all other requests in the decode batch. Aborting the last request."
)
NEVER_FITS_REASON = "prompt + outputs + min(max_tokens - outputs, 4096) + 1 page exceed the empty KV cache"


class AddReqResult(enum.Enum):
    """SGLang's ``AddReqResult``: why the walk over the waiting queue goes on or stops."""

    CONTINUE = enum.auto()
    NO_TOKEN = enum.auto()  # the KV budget is spent: stop the walk, set batch_is_full
    OTHER = enum.auto()  # a token budget is spent: stop the walk


def queued_at(request: Request) -> float:
    return request.enqueue_time if request.enqueue_time is not None else request.arrival_time


def reserved_tokens(request: Request, new_token_ratio: float) -> float:
    """A running request's future tokens in the admission budget: its outputs still to come,
    clipped at 4096, times the ratio (``PrefillAdder.__init__``'s running-batch offset)."""
    remaining = min(request.max_tokens - request.num_output_tokens, CLIP_MAX_NEW_TOKENS)
    return remaining * new_token_ratio


def decode_fits(
    kv: KVCacheManager,
    requests: list[Request],
    evictable: int = 0,
    num_tokens: int = 1,
    lag: dict[str, int] | None = None,
) -> bool:
    """Whether the free blocks plus ``evictable`` radix-cached ones let each of ``requests`` hold
    ``num_tokens`` slots past its committed tokens (``check_decode_mem``: one more token, or with
    speculative decoding SGLang's reserve, ``new_tokens_required_next_decode``). The committed
    tokens are the computed ones less ``lag`` (by request id: the overlap scheduler's verify in
    flight, not committed yet)."""
    available = kv.num_free_blocks + evictable
    if num_tokens == 1 and len(requests) <= available:
        return True  # a decode needs at most one new block
    lag = lag or {}
    need = kv.num_blocks_needed
    return (
        sum(
            need(r.request_id, r.num_computed_tokens - lag.get(r.request_id, 0) + num_tokens)
            for r in requests
        )
        <= available
    )


class PrefillAdder:
    """One prefill pass (SGLang's ``PrefillAdder`` with its ``PrefillBudget``).

    ``total_offset`` reserves every admitted and running request's future tokens,
    ``current_offset`` only what this pass allocates now; both are subtracted from the free
    slots. SGLang allocates a batch's KV only after the pass, so the free slots it reads exclude
    this pass's own grants (already in the offsets): they are added back here. Freed slots (a
    request evicted for priority) count at once, as in SGLang.
    """

    def __init__(
        self,
        sched: Scheduler,
        tree_cache: SglangRadix,
        running_batch: list[Request],
        new_token_ratio: float,
        rem_input_tokens: int,
        rem_chunk_tokens: int | None,
        mixed_with_decode_tokens: int = 0,
        priority_scheduling_preemption_threshold: int = 0,
        schedule_low_priority_values_first: bool = False,
        ignore_eos_without_cache: bool = False,
        shortest_prefill_first: bool = False,
        prefill_max_requests: int | None = None,
    ) -> None:
        """SGLang's arguments: ``sched`` stands for its page size and KV pool (the scheduler's
        KV manager, and its ``preempt_by_recompute``), ``tree_cache`` for its radix cache,
        ``running_batch`` is the decoding requests (priority preemption removes from it),
        ``rem_chunk_tokens`` None when chunking is off. ``ignore_eos_without_cache``: every
        request ``ignore_eos`` and the radix cache disabled (``add_one_req_ignore_eos``).
        ``shortest_prefill_first``: ``schedule_policy`` is shortest-prefill-first, under which a
        request that would need chunking waits while a chunked request is still unfinished.
        ``prefill_max_requests``: the most requests in ``can_run`` (the continuing chunk counts)."""
        mixed = mixed_with_decode_tokens
        self.sched = sched
        self.tree_cache = tree_cache
        self.decodes = running_batch
        self.new_token_ratio = new_token_ratio
        self.priority_scheduling_preemption_threshold = priority_scheduling_preemption_threshold
        self.schedule_low_priority_values_first = schedule_low_priority_values_first
        self.ignore_eos_without_cache = ignore_eos_without_cache
        self.shortest_prefill_first = shortest_prefill_first
        self.prefill_max_requests = prefill_max_requests
        # Requests that needed a chunk while one was unfinished, under a policy other than
        # shortest-prefill-first: SGLang's scheduler stops there (see ``_add_one_req``).
        self.num_second_chunks_refused = 0
        self.page = sched.kv_cache.block_size
        self.rem_input_tokens = rem_input_tokens - mixed
        self.rem_chunk_tokens: int | None = rem_chunk_tokens - mixed if rem_chunk_tokens is not None else None
        # ``reserved_tokens`` inlined (the same operations, the same floats, summed in the same
        # order): once per running request per prefill pass, a call each showed, and so did
        # ``min`` (the builtin parses its arguments as keywords, ~750 instructions a call).
        # The terms in a list, not a generator (resumed once per term); ``sum`` adds them alike.
        clip = CLIP_MAX_NEW_TOKENS
        self.total_offset: float = mixed + sum(
            [
                (clip if clip < (left := r.max_tokens - r.num_output_tokens) else left) * new_token_ratio
                for r in running_batch
            ]
        )
        self.current_offset = mixed
        self.num_blocks_granted = 0  # KV blocks allocated in this pass
        self.can_run: list[ScheduledRequest] = []
        self.new_chunked: Request | None = None
        self.preempted: list[Request] = []
        self._req_states: list[tuple[float, int]] | None = None  # ignore_eos admission
        self.num_loaded_tokens = 0  # HiCache: host tokens this pass loaded back (sglang_hicache.py)

    # ---- budget ------------------------------------------------------------------------
    def _free_tokens(self) -> int:
        """Free slots before this pass's grants, plus the radix tree's evictable tokens
        (eviction moves slots from evictable to free, so it leaves this unchanged)."""
        free = (self.sched.kv_cache.num_free_blocks + self.num_blocks_granted) * self.page
        return free + self.tree_cache.evictable_tokens()

    @property
    def remaining_total(self) -> float:
        return self._free_tokens() - self.total_offset

    @property
    def remaining_current(self) -> float:
        return self._free_tokens() - self.current_offset

    def _paged(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page) * self.page

    def budget_state(self) -> AddReqResult:
        if self.remaining_total <= 0 or self.remaining_current <= 0:
            return AddReqResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddReqResult.OTHER
        return AddReqResult.CONTINUE

    def _commit(self, request: Request, extend: int, max_new_tokens: int) -> bool:
        """Allocate ``extend`` more tokens of KV for ``request`` and charge the budgets."""
        computed = request.num_computed_tokens
        kv = self.sched.kv_cache
        held_before = kv.num_held(request.request_id)
        if not self.tree_cache.allocate(self.sched, request, computed + extend):
            return False
        self.num_blocks_granted += kv.num_held(request.request_id) - held_before
        paged = self._paged(extend)
        self.total_offset += paged + self.page + max_new_tokens
        self.current_offset += paged + self.page
        self.rem_input_tokens -= paged
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= paged
        self.can_run.append(ScheduledRequest(request, extend, computed))
        return True

    # ---- the chunked request -------------------------------------------------------------
    def add_chunked_req(self, request: Request, limit: int | None = None) -> Request | None:
        """Schedule its next chunk; returns the request while its prompt is still unfinished.
        ``limit``: shortest-prefill-first's cap on the chunk (``chunked_req_limit``)."""
        rem_chunk = self.rem_chunk_tokens
        assert rem_chunk is not None
        available = min(rem_chunk, int(self.remaining_total))
        if available <= 0:
            available = rem_chunk  # SGLang: a continuation must progress to release its KV
        if limit is not None:
            available = min(available, limit)
        kv = self.sched.kv_cache
        computed = request.num_computed_tokens
        # The simulator cannot overcommit: cap the chunk at the slots really free or evictable.
        free = kv.num_held(request.request_id) + kv.num_free_blocks
        room = free * self.page + self.tree_cache.evictable_tokens() - computed
        rest = request.num_tokens - computed
        extend = min(rest, available, room)
        if extend <= 0:
            return request
        truncated = extend < rest
        max_new = 0 if truncated else min(request.max_tokens, CLIP_MAX_NEW_TOKENS)
        self._commit(request, extend, max_new)
        return request if truncated else None

    # ---- new requests --------------------------------------------------------------------
    def add_one_req(
        self, request: Request, match: PrefixMatch | None = None, has_chunked_req: bool = False
    ) -> AddReqResult:
        """``match``: the request's radix-cache hit (``init_next_round_input``), None without a
        cache. Its node is locked while the budget is checked (locking can shrink the evictable
        part of the budget) and stays locked, with its slots shared, if the request is admitted.
        ``has_chunked_req``: a chunked request is still unfinished after this pass's chunk."""
        if (limit := self.prefill_max_requests) is not None and len(self.can_run) >= limit:
            return AddReqResult.OTHER  # before any budget or cache look, as SGLang's first line
        if self.ignore_eos_without_cache:
            return self._add_one_req_ignore_eos(request)
        radix = self.tree_cache
        if match is not None:
            radix.lock(match)
        result = self._add_one_req(request, match, has_chunked_req)
        if match is not None and not radix.attached(request):
            radix.unlock(match)
        return result

    def _add_one_req(
        self, request: Request, match: PrefixMatch | None, has_chunked_req: bool
    ) -> AddReqResult:
        prefix = match.num_tokens if match is not None else 0
        extend = request.num_remaining_tokens - prefix
        max_new = min(max(request.max_tokens - request.num_output_tokens, 0), CLIP_MAX_NEW_TOKENS)
        if not extend + max_new + self.page < self.remaining_total:
            return AddReqResult.NO_TOKEN
        # HiCache: the host hit needs GPU slots (above) but is loaded, not computed: off the
        # input and chunk budgets (``_select_prefill_admission``, schedule_policy.py:1603@v0.5.23).
        host = match.host_tokens if type(match) is HiPrefixMatch else 0
        extend -= host
        input_tokens = self._paged(extend)
        if self.rem_chunk_tokens is None and self.can_run and input_tokens >= self.rem_input_tokens:
            return AddReqResult.OTHER
        charge = min(request.max_tokens, CLIP_MAX_NEW_TOKENS)
        is_chunked = False
        if self.rem_chunk_tokens is not None and input_tokens > self.rem_chunk_tokens:
            if has_chunked_req:
                # ``_select_prefill_admission`` refuses it under shortest-prefill-first. Under the
                # other policies SGLang cuts it and its scheduler then fails ``assert
                # self.chunked_req is None`` (scheduler.py:4326): reachable when the continuing
                # chunk was cut short by the KV budget and a priority preemption freed room.
                # tailserve lets it wait, as shortest-prefill-first does, and counts it.
                if not self.shortest_prefill_first:
                    self.num_second_chunks_refused += 1
                return AddReqResult.OTHER
            extend = self.rem_chunk_tokens // self.page * self.page
            if extend <= 0:
                return AddReqResult.OTHER
            is_chunked, charge = True, 0  # a chunked request reserves its outputs at its last chunk
        if match is not None:
            if host:
                loaded = self.tree_cache.load_back(match)
                if loaded is None:  # not loaded (too short, or no GPU room): re-checked as a recompute
                    device_only = PrefixMatch(prefix, match.kv_indices, match.node)
                    return self._add_one_req(request, device_only, has_chunked_req)
                match = loaded
                self.num_loaded_tokens += host
            self.tree_cache.attach(request, match)
        return self._admit(request, extend, charge, is_chunked)

    def _add_one_req_ignore_eos(self, request: Request) -> AddReqResult:
        """SGLang's admission for ``ignore_eos`` requests without a radix cache: simulate the
        running requests finishing shortest-remaining first and require headroom throughout."""
        extend = request.num_remaining_tokens
        paged_input = self._paged(extend) + self.page
        if paged_input > min(self.remaining_current, self.remaining_total):
            return AddReqResult.NO_TOKEN
        if self._req_states is None:
            states = [self._req_state(request)]
            states += [self._req_state(r) for r in self.decodes]
            states += [self._req_state(s.request) for s in self.can_run]
            self._req_states = sorted((s for s in states if s[0] > 0), key=lambda s: s[0])
        else:
            left, occupied = self._req_state(request)
            if left > 0:
                # SGLang's insertion: a value larger than all lands before the last entry.
                i = 0
                for i in range(len(self._req_states)):
                    if left <= self._req_states[i][0]:
                        break
                self._req_states.insert(i, (left, occupied))
        cur_rem = self.remaining_current - paged_input
        freed = 0
        n = len(self._req_states)
        for i, (left, occupied) in enumerate(self._req_states):
            if cur_rem + freed - left * (n - i) <= IGNORE_EOS_RESERVE_TOKENS * (n - i):
                return AddReqResult.NO_TOKEN
            freed += occupied
        if self.rem_chunk_tokens is None or extend <= self.rem_chunk_tokens:
            return self._admit(request, extend, min(request.max_tokens, CLIP_MAX_NEW_TOKENS), False)
        if self.rem_chunk_tokens <= 0:
            return AddReqResult.OTHER
        return self._admit(request, self.rem_chunk_tokens, 0, True)

    def _req_state(self, request: Request) -> tuple[float, int]:
        left = request.max_tokens * self.new_token_ratio - request.num_output_tokens
        return left, request.num_tokens

    def _admit(self, request: Request, extend: int, max_new: int, is_chunked: bool) -> AddReqResult:
        if not self._commit(request, extend, max_new):
            return AddReqResult.NO_TOKEN  # unreachable while the budget is below the free slots
        if is_chunked:
            self.new_chunked = request
        return self.budget_state()

    # ---- priority preemption -------------------------------------------------------------
    def preempt_to_schedule(self, request: Request, fill_len: int, prefix_len: int) -> bool:
        """Evict running requests less urgent than ``request`` by more than the threshold, least
        urgent and most recent first, if their reservations cover its need.

        The need is SGLang's: (``len(req.full_untruncated_fill_ids)`` - ``req.prefix_len``) +
        min(``max_tokens``, 4096) - the KV budget left. The scheduler asks before this pass looks
        at the request (``init_next_round_input`` comes after), so both lengths are what its last
        look left (``fill_len``, ``prefix_len``): 0 and 0 for a request never looked at (its fill
        ids are still empty: it needs only its outputs), prompt + outputs and the match of an
        earlier walk, and after a retraction or preemption the fill of its last admission with a
        prefix of 0 (``reset_for_retract``)."""
        sign = 1 if self.schedule_low_priority_values_first else -1
        candidates = sorted(self.decodes, key=lambda r: (r.priority * -sign, -queued_at(r)))
        need = fill_len - prefix_len + min(request.max_tokens, CLIP_MAX_NEW_TOKENS) - self.remaining_total
        victims: list[Request] = []
        for running in candidates:
            if (request.priority - running.priority) * -sign <= self.priority_scheduling_preemption_threshold:
                break
            victims.append(running)
            need -= reserved_tokens(running, self.new_token_ratio)
            if need <= 0:
                break
        if not victims or need > 0:
            return False
        num_running = len(self.decodes)
        for released, victim in enumerate([r for r in self.decodes if r in victims], start=1):
            self.total_offset -= reserved_tokens(victim, self.new_token_ratio)
            self.sched.preempt_by_recompute(victim)
            self.decodes.remove(victim)
            self.preempted.append(victim)
            if self.tree_cache.tree is not None:
                # ``release_req(i, len(reqs) - released)``: as after a retraction, the tree
                # evicts until that many requests (SGLang's count) would have 20 tokens each.
                self.tree_cache.evict_for((num_running - released) * RETRACT_DECODE_STEPS)
        return True
