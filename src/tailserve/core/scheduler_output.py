"""What the scheduler decides for one iteration; the only thing an executor ever sees.

Block ids travel as vLLM V1's do in spirit, but whole rather than as deltas: each scheduled
request carries its full block table (``ScheduledRequest.block_ids``), and the step's KV copies
come as ``(src, dst)`` block pairs (``blocks_to_swap_out``: GPU -> CPU, ``blocks_to_swap_in``:
CPU -> GPU). Whole tables because the executor rebuilds its attention metadata from whole tables
every step anyway, and a delta protocol would make it keep a mirror of every table that
recompute preemption, swap-in and prefix hits all reset — exactly the state that drifts. The
table is the KV manager's own list, not a copy (free to attach): read it during ``execute``,
never change or keep it. There is no GPU -> GPU copy list: nothing here copies a block within
the GPU (vLLM's ``blocks_to_copy`` serves copy-on-write for beam search and ``n > 1``, which
tailserve does not model); a prefix hit shares blocks by reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tailserve.core.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request's grant in one iteration. Its facts hold for that iteration's step: a policy
    may hand a running request the same object again in a later step with its fields set anew,
    so read an output's items while its step runs, as the executor, ``Scheduler.update``, the
    iteration log and ``BatchRecord`` do, and copy what must outlive it.

    Sarathi's phase 1 and vLLM's plain pass do that with each running request's one-token
    decode item (``scheduled_decode``, kept per request until it leaves: ``on_finished``): a
    new object per running request per stepped iteration cost ~1,500 instructions to make and
    free, the kept one a lookup and a store of its context. Nothing else in such an item
    changes: no field of it but ``block_ids``, which ``Scheduler.add_block_ids`` sets for every
    step, is written after the policy returns an output that is not ``advanced``. An output
    that stays in flight while the next step is scheduled (async scheduling) is read until the
    step after it is scheduled and applied: SGLang's overlap gets items of its own, and vLLM's
    advanced pass keeps two plain decode items per running request and hands out the one it
    did not hand out last (its step is two steps back, applied: one step is in flight at a
    time, ``Engine._step_async``; the async decode run leaves the in-flight step's items in
    flight, ``async_decode_run.py``). ``Scheduler.advance_scheduled`` sets ``partial`` anew
    on every advanced item."""

    request: Request
    num_new_tokens: int  # tokens computed this iteration: a prefill chunk, or 1 for a decode
    num_context_tokens: int  # tokens already in the KV cache before this iteration
    # The request's whole GPU block table, filled in by ``Scheduler.schedule`` only for an
    # executor that declares ``needs_block_ids`` (the simulator never reads it); None otherwise.
    block_ids: list[int] | None = None
    # Speculative decoding (vLLM V1): of ``num_new_tokens``, the draft tokens this step verifies
    # (the rest: the one token whose output is sampled, or a chunk); ``spec_padding`` when they
    # are placeholders no drafter proposed (vLLM pads a newly scheduled decode to the uniform
    # decode size), which the rejection sampler always rejects.
    num_spec_tokens: int = 0
    spec_padding: bool = False
    # Set only in an ``advanced`` output (below): this step leaves part of the request's tokens
    # uncomputed, so it samples nothing (vLLM's ``is_prefill_chunk``).
    partial: bool = False


_new = object.__new__


def scheduled_decode(request: Request, num_context_tokens: int) -> ScheduledRequest:
    """``ScheduledRequest(request, 1, num_context_tokens)``, the same object built without the
    class call: calling a Python class enters ``__init__`` through a fresh interpreter frame
    from C, ~1,500 instructions, and the policies' running loops make one per running request
    per stepped iteration. Every field is set (``tests/test_speed_paths.py`` compares the two)."""
    item = _new(ScheduledRequest)
    item.request = request
    item.num_new_tokens = 1
    item.num_context_tokens = num_context_tokens
    item.block_ids = None
    item.num_spec_tokens = 0
    item.spec_padding = False
    item.partial = False
    return item


def alternate_decode(
    items: dict[Request, list[ScheduledRequest]], request: Request, num_context_tokens: int
) -> ScheduledRequest:
    """One of ``request``'s two plain decode items, handed out in turn: the one its step before
    last had, its context set anew (``ScheduledRequest``'s docstring). Under async scheduling
    or an overlap scheduler one step is in flight while the next is built, so the last step's
    item may still be read; the one before it is done. Both are made at the request's first
    decode; the policy drops the pair when the request leaves. Saves a ``ScheduledRequest``
    per running request per stepped step (``vllm_async.py``, ``trtllm.py``)."""
    pair = items.get(request)
    if pair is None:
        item = scheduled_decode(request, num_context_tokens)
        items[request] = [item, scheduled_decode(request, num_context_tokens)]
        return item
    item = pair[1]
    pair[1] = pair[0]
    pair[0] = item
    item.num_context_tokens = num_context_tokens
    return item


@dataclass(frozen=True, slots=True)
class PaddingSlot:
    """Work a padded batch does for nobody (static batching): costs time, produces no token."""

    num_new_tokens: int
    num_context_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # by recompute this iteration
    swapped_out: list[Request] = field(default_factory=list)
    swapped_in: list[Request] = field(default_factory=list)
    padding: list[PaddingSlot] = field(default_factory=list)
    num_admitted: int = 0  # waiting requests that entered the running set this iteration
    # The policy advanced each scheduled request's computed tokens when it scheduled it, as vLLM
    # V1 does (``Scheduler.advance_scheduled``: the ``vllm`` policy with async scheduling or
    # speculative decoding); ``Scheduler.update`` then applies the step the same way
    # (``update_advanced``). False: computed tokens advance when the step is applied.
    advanced: bool = False
    # Speculative decoding: draft tokens each request that decodes gets for its next step
    # (vLLM's ``num_spec_tokens_to_schedule``); 0 without drafts.
    num_spec_tokens_to_schedule: int = 0
    # KV blocks copied before this iteration's forward pass, as (src, dst) pairs in decision
    # order: swap-outs (GPU block, CPU block), then swap-ins (CPU block, GPU block); apply them
    # in that order. A GPU block a swap-out frees and a swap-in reuses is then copied out before
    # it is overwritten; the reverse (a swap-out taking CPU blocks a swap-in just freed) cannot
    # happen: ``Scheduler.preempt_by_swap`` refuses to swap out after a swap-in in one step.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Seconds this iteration's forward pass waits for KV copies between host and GPU that the
    # policy issued with it and priced itself (TensorRT-LLM's host pool: onboards and offloads,
    # ``policies/trtllm_host_cache.py``); 0.0 without any. The simulated executor adds them.
    kv_copy_time: float = 0.0
    # ``token_counts`` as counted by a pass over ``scheduled`` that already ran (the simulator's
    # ``batch_shape``, which the engine's log would otherwise repeat after every stepped
    # iteration); None until then. Set only once ``scheduled`` is final.
    counted_tokens: tuple[int, int] | None = field(default=None, repr=False, compare=False)
    # ``(m, context)``: the first m entries of ``scheduled`` are one-token decodes without
    # drafts that each sample (one token behind, as every running request between synchronous
    # steps is), their context tokens summing to ``context``; set by a policy that built them so
    # in one pass of its own (Sarathi's phase 1, vLLM's plain pass and its advanced pass when
    # they preempt nobody, SGLang's decode batch), so that ``batch_shape`` and
    # ``Scheduler.update`` (of an ``advanced`` output: ``advanced_batch_shape`` and
    # ``Scheduler.advance_scheduled``) need not re-derive it per request. None: nothing is known.
    decode_head: tuple[int, int] | None = field(default=None, repr=False, compare=False)
    # Seconds of host -> GPU KV copies this step's forward pass consumes layer by layer (SGLang's
    # HiCache load-backs, ``policies/sglang_hicache.py``); the executor overlaps them with the
    # forward (``executors/simulated/layerwise_load.py``). 0.0: none.
    host_load_seconds: float = 0.0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.swapped_out and not self.swapped_in

    @property
    def num_swap_out_blocks(self) -> int:
        return len(self.blocks_to_swap_out)

    @property
    def num_swap_in_blocks(self) -> int:
        return len(self.blocks_to_swap_in)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return self.token_counts()[0]

    def token_counts(self) -> tuple[int, int]:
        """(``num_prefill_tokens``, ``num_decode_tokens``) in one pass: the engine logs both
        after every stepped iteration."""
        if self.counted_tokens is not None:
            return self.counted_tokens
        prefill = decode = 0
        for s in self.scheduled:
            q = s.num_new_tokens
            if q == 1 or s.num_spec_tokens:
                decode += q
            elif q > 1:
                prefill += q
        return prefill, decode

    @property
    def num_decode_tokens(self) -> int:
        """Tokens of decodes: one each, or 1 + the drafts a speculative decode verifies."""
        return self.token_counts()[1]


def new_output() -> SchedulerOutput:
    """``SchedulerOutput()``, the same object built without the class call: the dataclass's
    ``__init__`` is entered through a fresh interpreter frame from C and calls ``list`` once per
    list field, ~6,100 instructions, and every policy makes one per stepped iteration. Every
    field is set, each list a new one (``tests/test_speed_paths.py`` compares the two)."""
    out = _new(SchedulerOutput)
    out.scheduled = []
    out.preempted = []
    out.swapped_out = []
    out.swapped_in = []
    out.padding = []
    out.num_admitted = 0
    out.advanced = False
    out.num_spec_tokens_to_schedule = 0
    out.blocks_to_swap_out = []
    out.blocks_to_swap_in = []
    out.kv_copy_time = 0.0
    out.counted_tokens = None
    out.decode_head = None
    out.host_load_seconds = 0.0
    return out
