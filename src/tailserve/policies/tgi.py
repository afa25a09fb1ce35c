"""Hugging Face TGI, router v3 (``backends/v3/src/{backend,queue}.rs``) with the flash shard
(``server/.../flash_causal_lm.py``): whole-lifetime KV reservation, strict FIFO, no preemption.

Each engine forward is one tailserve iteration, so one turn of the router loop is one or two
iterations: an optional admission forward, then the decode forward. The rules, in the engine's
order (``docs/policies.md``, "`tgi` — Hugging Face TGI, router v3"):
1. No running batch: build a first batch with ``next_batch`` (no minimum size, at most
   ``max_batch_size`` requests, the full prefill budget) and prefill it alone. The router then
   tries to admit again *before* the first decode.
2. ``next_batch`` walks the waiting queue strictly FIFO. It returns nothing when either budget
   is 0, when fewer than ``min_size`` requests wait, or when ``max_size`` is 0. The prefill
   budget is rounded up to a multiple of the block size. Each request reserves blocks for
   prompt + ``max_tokens`` − 1 (its whole lifetime, so a decode never allocates); the first that
   does not fit stays at the front and stops the walk (head-of-line blocking). A prompt larger
   than the prefill budget left gets the rest of the budget as its first chunk and stops the
   walk (chunking), or stays at the front (legacy). The walk stops at ``max_size`` requests; a
   batch smaller than ``min_size`` goes back whole.
3. Chunking mode (``prefill_chunking``, the default for flash models): with a running batch,
   the prefill budget is ``max_batch_prefill_tokens`` minus the tokens the running batch feeds
   next (1 per decode plus its next chunks); no minimum or maximum size, so
   ``waiting_served_ratio``, ``max_waiting_tokens`` and ``max_batch_size`` are ignored there. New
   requests run in **one forward with the running batch**, each running request advancing by
   its next grant.
4. Legacy mode: ``min_size = floor(len(running) x waiting_served_ratio)``, or none once a
   counter that restarts at 1 on every admission and grows by 1 per decode forward reaches
   ``max_waiting_tokens`` (so after ``max_waiting_tokens − 1`` decodes);
   ``max_size = max_batch_size − len(running)``. A new batch is **prefilled alone while the
   running batch waits** (a decode stall).
5. Then one decode forward over the whole running batch, admission or not.
6. After every forward (chunking mode) the shard plans the next chunk of each prompt still
   being prefilled: ``budget = max_batch_prefill_tokens − (len(batch) − 1)``, walking the batch
   in **reverse** (the code says "prioritize older requests", but the newest requests are at the
   end of the batch, so they are served first); each gets ``max(min(left, budget), 1)``.
7. No preemption, ever. ``max_concurrent_requests`` in flight (waiting + running) makes the
   router reject further requests ("Model is overloaded").

8. Prefix cache (``radix.rs``, ``RadixAllocator``; ``policies/tgi_radix.py``), on by default: TGI's
   ``PREFIX_CACHING=true`` is ``disable_radix_cache=False`` here (the flag SGLang's integration
   and the simulation use; ``disable_radix_cache=True`` is ``PREFIX_CACHING=false``).
   Requests that carry token ids (or Mooncake ``hash_ids``, full 512-token blocks only) share KV
   through a radix trie over whole blocks (``RadixCache(page_size=block_size)``, one key per
   block) whose nodes hold references on the KV blocks (``RadixKVCacheManager``). At admission
   the PROMPT is matched, capped so that at least one prompt token is computed (queue.rs drops
   one from ``prefix_len`` when the whole prompt is cached); the matched node is locked, its
   blocks are shared into the request's table, and only the rest of the lifetime reservation is
   taken from the free blocks, evicting least recently used unlocked leaves when short. The
   request starts at the end of the match (``num_cached_tokens``), and the prefill budget counts
   only its uncached tokens. When it leaves, its prompt's full blocks are inserted with its
   blocks (the trie adopts the new ones; blocks that duplicate an existing insertion return to
   the free list with the request's own references) and the lock is dropped. Generated tokens
   are never cached. Requests without token identities never touch the trie, which then stays
   unbuilt. Decodes never touch it either.

Deviations: ``RadixAllocator`` evicts before it finds that an allocation fails; here the fit
(free + evictable blocks, and ``max_batch_total_tokens``) is checked on a read-only walk first, so
a failed admission changes nothing (not even LRU stamps), which keeps the decode fast path exact.
With blocks larger than one token the match is capped to whole blocks below the prompt's length
(TGI keeps the last block shared and recomputes one token).

Not modelled: speculation, padded (non-flash) models, the health-check block, requests that ask
for prompt logprobs skipping the lookup, ``compute_optimal`` for the ``max_batch_prefill_tokens``
default.

Why this file is past the style guide's ~300 lines: the queue's ``next_batch`` and the
backend's batching loop (``backend.rs``) are one rule in TGI — whether a batch is formed depends
on the waiting-served ratio and the running batch; the radix prefix cache already lives in
``tgi_radix.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from tailserve.core.device import DeviceInfo
from tailserve.core.policy import Policy
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tailserve.executors.simulated.fast_paths import FastPaths
from tailserve.kv.radix import RadixCache
from tailserve.kv.spec import KVSpec
from tailserve.policies.tgi_radix import RadixAllocator

# The launcher's fallback when ``compute_optimal`` (fp16 FLOP/s / model FLOPs per token) is not
# available; tailserve's policies do not see the model, so it is always used.
DEFAULT_MAX_BATCH_PREFILL_TOKENS = 4096


@dataclass(frozen=True, slots=True)
class TgiConfig:
    waiting_served_ratio: float = 0.3  # the launcher's default; the router binary alone says 1.2
    max_waiting_tokens: int = 20  # decode forwards before a waiting request is forced in (legacy)
    max_batch_prefill_tokens: int = DEFAULT_MAX_BATCH_PREFILL_TOKENS  # tokens per prefill forward
    max_batch_total_tokens: int | None = None  # KV tokens for all requests; None = the KV cache
    max_batch_size: int | None = None  # requests per batch (first batch and legacy admission)
    max_concurrent_requests: int = 128  # in flight (waiting + running); more are rejected
    prefill_chunking: bool = True  # PREFILL_CHUNKING; False = the legacy mode
    disable_radix_cache: bool = False  # True = PREFIX_CACHING=false; default: the prefix cache is on

    def __post_init__(self) -> None:
        if not self.waiting_served_ratio >= 0:
            raise ValueError(f"waiting_served_ratio must be >= 0, got {self.waiting_served_ratio}")
        if self.max_waiting_tokens < 0:
            raise ValueError(f"max_waiting_tokens must be >= 0, got {self.max_waiting_tokens}")
        if self.max_batch_prefill_tokens < 1:
            raise ValueError(f"max_batch_prefill_tokens must be >= 1, got {self.max_batch_prefill_tokens}")
        total = self.max_batch_total_tokens
        if total is not None and total < self.max_batch_prefill_tokens:
            # The router's own check (backends/v3/src/main.rs).
            raise ValueError(
                "`max_batch_prefill_tokens` must be <= `max_batch_total_tokens`. Given: "
                f"{self.max_batch_prefill_tokens} and {total}"
            )
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be > 0, got {self.max_batch_size}")
        if self.max_concurrent_requests < 1:
            raise ValueError(f"max_concurrent_requests must be >= 1, got {self.max_concurrent_requests}")


_OPTIONAL_INTS = ("max_batch_total_tokens", "max_batch_size")


def _optional_int(name: str, value: Any) -> int | None:
    """The registry converts only plain ``int`` flags; ``int | None`` ones arrive as text."""
    if not isinstance(value, str):
        return value
    if value.lower() in ("", "none"):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"flag {name}: {value!r} is not a valid int") from None


class TgiPolicy(Policy, FastPaths):
    name = "tgi"
    summary = (
        "TGI v3 (legacy: archived 2026-03-21): FIFO router, KV reserved for prompt + max_tokens, new "
        "prefill chunks batched with the running batch, no preemption"
    )
    config_cls = TgiConfig
    default_block_size = 1  # flashinfer, the default attention
    default_gpu_memory_utilization = 1.0  # --cuda-memory-fraction
    # Beside a full chunk the router's prefill budget is 0: an arrival only waits or is rejected.
    chunk_run_takes_arrivals = True

    def __init__(self, config: TgiConfig) -> None:
        super().__init__(config)
        self._decode_due = False  # an admission forward ran; the loop's decode forward is next
        self._waiting_tokens = 1  # decode forwards since the last admission, counted from 1
        self._next_chunk: dict[str, int] = {}  # request id -> its next prompt chunk, tokens
        # Prefix cache: its trie is built with the first request that carries token identities.
        self.allocator = RadixAllocator()

    @classmethod
    def default_config(cls, device: DeviceInfo, max_model_len: int, **overrides: Any) -> TgiConfig:
        known = {f.name for f in fields(TgiConfig)}
        flags = {
            k: _optional_int(k, v) if k in _OPTIONAL_INTS else v for k, v in overrides.items() if k in known
        }
        # The longest prompt tailserve accepts leaves room for one output token.
        max_input_tokens = max_model_len - 1
        if "max_batch_prefill_tokens" not in flags:
            budget = min(DEFAULT_MAX_BATCH_PREFILL_TOKENS, max_model_len)
            if not flags.get("prefill_chunking", True):
                budget = max(budget, max_input_tokens)
            flags["max_batch_prefill_tokens"] = budget
        config = TgiConfig(**flags)
        if not config.prefill_chunking and config.max_batch_prefill_tokens < max_input_tokens:
            raise ValueError(
                "`max_batch_prefill_tokens` must be >= `max_input_tokens`. Given: "
                f"{config.max_batch_prefill_tokens} and {max_input_tokens} (without prefill "
                "chunking a longer prompt could never be scheduled)"
            )
        total = config.max_batch_total_tokens
        if total is not None and total < max_model_len:
            raise ValueError(
                f"`max_total_tokens` must be <= `max_batch_total_tokens`. Given: {max_model_len} and {total}"
            )
        return config

    @classmethod
    def profile_tokens(cls, config: TgiConfig, max_model_len: int) -> int:
        return config.max_batch_prefill_tokens

    # ---- requests in ----------------------------------------------------------------------
    def kv_spec(self) -> KVSpec:
        return KVSpec("paged" if self.config.disable_radix_cache else "radix", radix="tgi")

    refusal_status = 429  # router/src/server.rs: InferError::Overloaded -> TOO_MANY_REQUESTS

    def refuses_at_arrival(self) -> bool:
        return True  # max_concurrent_requests is always set

    def add_request(self, sched: Scheduler, request: Request) -> None:
        limit = self.config.max_concurrent_requests
        if len(sched.waiting) + len(sched.running) >= limit:
            # Scheduler.add_request stamped enqueue_time with the current time just before.
            now = request.enqueue_time if request.enqueue_time is not None else request.arrival_time
            sched.reject(request, f"Model is overloaded (max_concurrent_requests={limit})", now)
            return
        if not self.config.disable_radix_cache:
            self.allocator.add(sched, request)
        sched.waiting.add_request(request)

    @property
    def tree(self) -> RadixCache | None:
        return self.allocator.tree

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens, over every admission."""
        return self.allocator.hit_rate

    # ---- the router loop ------------------------------------------------------------------
    def schedule(self, sched: Scheduler, now: float) -> SchedulerOutput:
        cfg: TgiConfig = self.config
        if not sched.running:
            # 1. No running batch: a first batch, prefilled alone.
            self._decode_due = False
            new = self._next_batch(
                sched, None, cfg.max_batch_size, cfg.max_batch_prefill_tokens, self._total_tokens(sched)
            )
            out = SchedulerOutput()
            if new:
                self._waiting_tokens = 1
                self._admit(sched, new, now, out)
            return out
        if not self._decode_due:
            out = self._try_admission(sched, now)
            if out is not None:
                return out
        # 5. The decode forward over the whole running batch.
        out = SchedulerOutput()
        for request in sched.running:
            out.scheduled.append(ScheduledRequest(request, self._grant(request), request.num_computed_tokens))
        self._decode_due = False
        self._waiting_tokens += 1
        self._plan_next_chunks(out)
        return out

    def _try_admission(self, sched: Scheduler, now: float) -> SchedulerOutput | None:
        """3-4. The loop's admission forward, or None when ``next_batch`` returns nothing."""
        cfg: TgiConfig = self.config
        running = list(sched.running)
        kv = sched.kv_cache
        held = sum(kv.num_held(r.request_id) for r in running) * kv.block_size
        token_budget = self._total_tokens(sched) - held
        if cfg.prefill_chunking:
            current_tokens = sum(self._grant(r) for r in running)
            new = self._next_batch(
                sched, None, None, cfg.max_batch_prefill_tokens - current_tokens, token_budget
            )
        else:
            min_size = None
            if self._waiting_tokens < cfg.max_waiting_tokens:
                min_size = math.floor(len(running) * cfg.waiting_served_ratio)
            max_size = None if cfg.max_batch_size is None else max(cfg.max_batch_size - len(running), 0)
            new = self._next_batch(sched, min_size, max_size, cfg.max_batch_prefill_tokens, token_budget)
        if not new:
            return None
        self._waiting_tokens = 1
        self._decode_due = True
        out = SchedulerOutput()
        if cfg.prefill_chunking:
            # prefill(new, cached): the running batch advances in the same forward.
            for request in running:
                out.scheduled.append(
                    ScheduledRequest(request, self._grant(request), request.num_computed_tokens)
                )
        self._admit(sched, new, now, out)
        return out

    def _next_batch(
        self,
        sched: Scheduler,
        min_size: int | None,
        max_size: int | None,
        prefill_budget: int,
        token_budget: int,
    ) -> list[ScheduledRequest]:
        """2. ``Queue::next_batch``: pops the batch from ``waiting`` with its KV reserved; [] if none."""
        waiting = sched.waiting
        if not waiting or prefill_budget <= 0 or token_budget <= 0:
            return []
        if min_size is not None and len(waiting) < min_size:
            return []
        if max_size is not None and max_size == 0:
            return []
        kv = sched.kv_cache
        block_size = kv.block_size
        prefill_budget = -(-prefill_budget // block_size) * block_size
        total = self._total_tokens(sched)
        chunking = self.config.prefill_chunking
        batch: list[ScheduledRequest] = []
        prefill_tokens = 0
        tree = self.tree
        for request in waiting:
            lifetime = request.prompt_len + request.max_tokens - 1  # + speculate (0)
            if tree is not None:
                # The radix allocator: checked first, so that a failure changes nothing.
                fit = self.allocator.fit(sched, request, total)
                if fit is None:
                    break  # head-of-line blocking
                prefix, excess = fit
                prompt = request.num_tokens - prefix  # only the uncached tokens count
                if prefill_tokens + prompt > prefill_budget:
                    chunk = prefill_budget - prefill_tokens if chunking else 0
                    if chunk > 0:
                        self.allocator.take(sched, request, prefix, excess)
                        batch.append(ScheduledRequest(request, chunk, prefix))
                    break
                self.allocator.take(sched, request, prefix, excess)
                prefill_tokens += prompt
                batch.append(ScheduledRequest(request, prompt, prefix))
                if max_size is not None and len(batch) == max_size:
                    break
                continue
            if (kv.num_used_blocks + kv.blocks_for(lifetime)) * block_size > total:
                break
            if not sched.allocate(request, lifetime):
                break  # head-of-line blocking: nothing behind it is tried
            prompt = request.num_remaining_tokens
            if prefill_tokens + prompt > prefill_budget:
                chunk = prefill_budget - prefill_tokens if chunking else 0
                if chunk > 0:
                    batch.append(ScheduledRequest(request, chunk, request.num_computed_tokens))
                else:
                    sched.free_blocks(request)
                break
            prefill_tokens += prompt
            batch.append(ScheduledRequest(request, prompt, request.num_computed_tokens))
            if max_size is not None and len(batch) == max_size:
                break
        if min_size is not None and len(batch) < min_size:
            for item in batch:
                sched.free_blocks(item.request)  # unlocks a cached prefix, caches nothing
                item.request.num_computed_tokens = 0
            return []
        for _ in batch:
            waiting.pop_request()
        return batch

    def _admit(self, sched: Scheduler, new: list[ScheduledRequest], now: float, out: SchedulerOutput) -> None:
        stats = self.allocator.prefix_stats if self.tree is not None else None
        for item in new:
            request = item.request
            if stats is not None:
                # First (and only) admission: TGI never preempts.
                request.num_cached_tokens = request.num_computed_tokens
                stats.num_lookups += 1
                stats.num_query_tokens += request.prompt_len
                stats.num_hit_tokens += request.num_computed_tokens
            sched.admit(request, now)
        out.scheduled.extend(new)
        out.num_admitted += len(new)
        self._plan_next_chunks(out)

    # ---- the shard's chunk bookkeeping ----------------------------------------------------
    def _grant(self, request: Request) -> int:
        """Tokens a running request feeds the next forward: its planned chunk, or 1."""
        left = request.num_remaining_tokens
        if left <= 1:
            return 1
        return self._next_chunk.get(request.request_id, left)

    def _plan_next_chunks(self, out: SchedulerOutput) -> None:
        """6. After this forward, the next chunk of every prompt it leaves unfinished."""
        if not self.config.prefill_chunking:
            return  # every prompt is prefilled whole
        budget = self.config.max_batch_prefill_tokens - (len(out.scheduled) - 1)
        for item in reversed(out.scheduled):
            request_id = item.request.request_id
            left = item.request.num_tokens - (item.num_context_tokens + item.num_new_tokens)
            if left > 0:
                chunk = max(min(left, budget), 1)
                budget -= chunk
                self._next_chunk[request_id] = chunk
            else:
                self._next_chunk.pop(request_id, None)

    def _total_tokens(self, sched: Scheduler) -> int:
        """``max_batch_total_tokens``, or what the KV cache holds (TGI infers it at warmup)."""
        kv = sched.kv_cache
        capacity = kv.num_blocks * kv.block_size
        total = self.config.max_batch_total_tokens
        return capacity if total is None else min(total, capacity)

    # ---- fast path ------------------------------------------------------------------------
    def can_fast_forward(self, sched: Scheduler) -> bool:
        # Every running request is one token behind (the engine checked). Admission depends on
        # the free blocks and the held tokens, which a decode run leaves unchanged (everything was
        # reserved up front), and in legacy mode on a counter that only loosens ``min_size``; so if
        # the head cannot get in even without ``min_size``, nobody gets in for the whole run.
        if not sched.waiting:
            return True
        return not self._head_could_join(sched)

    def _head_could_join(self, sched: Scheduler) -> bool:
        cfg: TgiConfig = self.config
        kv = sched.kv_cache
        running = sched.running
        held = sum(kv.num_held(r.request_id) for r in running) * kv.block_size
        total = self._total_tokens(sched)
        if total - held <= 0:
            return False
        head = sched.waiting.peek_request()
        prefix = 0
        if self.tree is not None:
            fit = self.allocator.fit(sched, head, total)  # read-only
            if fit is None:
                return False
            prefix = fit[0]
        else:
            blocks = kv.blocks_for(head.prompt_len + head.max_tokens - 1)
            if blocks > kv.num_free_blocks or (kv.num_used_blocks + blocks) * kv.block_size > total:
                return False
        if cfg.prefill_chunking:
            return cfg.max_batch_prefill_tokens - len(running) > 0
        if cfg.max_batch_size is not None and len(running) >= cfg.max_batch_size:
            return False
        budget = -(-cfg.max_batch_prefill_tokens // kv.block_size) * kv.block_size
        return head.prompt_len - prefix <= budget

    def notes(self) -> list[str]:
        if self.tree is None:
            return []
        return [
            f"tgi prefix cache: {self.prefix_cache_hit_rate:.1%} of the prompt tokens admitted were cached "
            f"({self.tree.stats.num_evicted_tokens} tokens evicted)"
        ]

    def on_decode_run(self, sched: Scheduler, num_steps: int) -> None:
        # Each skipped iteration was a router turn whose admission found nobody, then a decode.
        self._decode_due = False
        self._waiting_tokens += num_steps

    def chunk_run_budget(self) -> int | None:
        # Chunking mode: a prompt chunked beside decodes D gets ``max_batch_prefill_tokens - |D|``
        # per forward (rule 6), the shape the simulator's ``chunk_run.py`` advances; legacy mode has none.
        return self.config.max_batch_prefill_tokens if self.config.prefill_chunking else None

    def chunk_run_ready(self, sched: Scheduler) -> bool:
        return bool(self._next_chunk)  # a prompt is being chunked only when the shard planned it

    def chunk_run_grants(self, sched: Scheduler, prompt: Request, chunk: int) -> bool:
        # The plan was made with the previous forward's batch: one request larger when a request
        # finished in it, so the chunk is short and the router's prefill budget is not 0.
        return self._grant(prompt) == chunk

    def on_chunk_run(self, sched: Scheduler, prompt: Request, num_steps: int) -> None:
        # Each iteration was a router turn whose admission had no prefill budget, then a forward
        # over the running batch, after which the shard planned the prompt's next chunk.
        self._decode_due = False
        self._waiting_tokens += num_steps
        if prompt.num_output_tokens:  # it sampled its first token: no chunk left (no preemption)
            self._next_chunk.pop(prompt.request_id, None)
        else:
            budget = self.config.max_batch_prefill_tokens - (len(sched.running) - 1)
            left = prompt.num_tokens - prompt.num_computed_tokens
            self._next_chunk[prompt.request_id] = max(min(left, budget), 1)
