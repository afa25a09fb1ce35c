"""Sarathi-Serve (OSDI'24) stall-free batching (``sarathi/core/scheduler/sarathi_scheduler.py``).

The rules (``docs/policies.md``, "`sarathi` — Sarathi-Serve"), every iteration, within ``chunk_size`` tokens:
1. Order the running requests by arrival (FCFS).
2. Decodes first: every decoding request gets 1 token. While no KV block is free
   (``can_append_slot``, even if its token would fit its last block) it preempts, by
   recompute, the latest arrival among the running requests not yet looked at in this pass, or
   itself if none is left. A preempted request goes to the *front* of the waiting queue — and,
   as in Sarathi's code, may be admitted again in the same iteration's phase 4.
3. Then prompts in progress: each gets ``min(prompt left, chunk_size - tokens so far)``; their KV
   was allocated whole at admission, so they never need blocks.
4. Then new requests, FCFS, each with a first chunk of what is left of the budget. Admission
   needs free blocks for the *whole* prompt plus a 1% watermark, fewer than ``max_num_seqs``
   running and a chunk above 0; the first request that fails any of these stops the walk.
So no iteration carries more than ``chunk_size`` tokens and decodes never stall behind a prompt.

With ``enable_dynamic_chunking_schedule`` the chunk a prompt gets shrinks as it progresses:
``chunk_schedule_stages`` sizes from ``high_chunk_size`` down to ``low_chunk_size`` (multiples of
32), the stage chosen from the prompt tokens already processed out of
``chunk_schedule_max_tokens`` — later chunks attend to more context and cost more.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields, replace
from operator import attrgetter
from typing import Any

from tailserve.core.device import DeviceInfo
from tailserve.core.policy import Policy
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import ScheduledRequest, SchedulerOutput, new_output, scheduled_decode
from tailserve.executors.simulated.fast_paths import FastPaths
from tailserve.policies.sarathi_pipeline import PausedPipeline


@dataclass(frozen=True, slots=True)
class SarathiConfig:
    chunk_size: int = 512  # the token budget of every iteration
    max_num_seqs: int = 128
    enable_dynamic_chunking_schedule: bool = False
    low_chunk_size: int = 0
    high_chunk_size: int = 0
    chunk_schedule_max_tokens: int = 0
    chunk_schedule_stages: int = 0
    watermark: float = 0.01  # fraction of blocks kept free at admission (BaseBlockSpaceManager)
    # Set from the deployment's pipeline stages (``--pipeline-parallel-size``): Sarathi-Serve's
    # pipelined engine, this many micro-batches in flight (policies/sarathi_pipeline.py)
    pipeline_parallel_size: int = field(default=1, metadata={"recorded_when_set": True})

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.enable_dynamic_chunking_schedule:
            if not 32 <= self.low_chunk_size <= self.high_chunk_size:
                raise ValueError(
                    "dynamic chunking needs 32 <= low_chunk_size <= high_chunk_size, got "
                    f"{self.low_chunk_size} and {self.high_chunk_size}"
                )
            if self.chunk_schedule_stages < 1 or self.chunk_schedule_max_tokens < 1:
                raise ValueError(
                    "dynamic chunking needs chunk_schedule_stages >= 1 and chunk_schedule_max_tokens >= 1, "
                    f"got {self.chunk_schedule_stages} and {self.chunk_schedule_max_tokens}"
                )


class SarathiPolicy(PausedPipeline, Policy, FastPaths):
    name = "sarathi"
    summary = "Sarathi-Serve: stall-free hybrid batches of decodes + prompt chunks within chunk_size"
    config_cls = SarathiConfig
    default_block_size = 16
    default_gpu_memory_utilization = 0.8
    decode_reserve_blocks = 1  # decodes preempt unless a block is free (see phase 1)
    # Beside a full chunk the budget is spent: phase 3 stops at its first request (chunk 0), so
    # a request arriving during a chunk run only waits (chunk_run.py adds it inside the run).
    chunk_run_takes_arrivals = True
    # The iteration in which a decode samples its last token is shaped as the others (phase 1
    # gives it its token; the finish comes at the iteration's end), and phase 1 walks the batch
    # in arrival order: a chunk run may end with it (chunk_run.py).
    chunk_run_ends_at_finish = True

    def __init__(self, config: SarathiConfig) -> None:
        super().__init__(config)
        self._chunk_sizes = _stage_sizes(config) if config.enable_dynamic_chunking_schedule else None
        # Each running request's one-token decode item, reused from step to step by phase 1's
        # common pass (``ScheduledRequest``'s docstring); dropped when it leaves (``on_finished``).
        self._decode_items: dict[Request, ScheduledRequest] = {}
        # The running batch's last request when it was last known in arrival order (after the
        # sort, or a later admission no earlier than it), None when not known: ``schedule``
        # sorts only when the batch's last request is another (see ``schedule``).
        self._sorted_tail: Request | None = None

    @classmethod
    def default_config(cls, device: DeviceInfo, max_model_len: int, **overrides: Any) -> SarathiConfig:
        known = {f.name for f in fields(SarathiConfig)}
        return replace(SarathiConfig(), **{k: v for k, v in overrides.items() if k in known})

    @classmethod
    def profile_tokens(cls, config: SarathiConfig, max_model_len: int) -> int:
        return max(config.chunk_size, config.high_chunk_size)

    def chunk_run_budget(self) -> int | None:
        """The token budget while it is one fixed chunk size (the simulator's ``chunk_run`` advances the
        iterations a chunked prompt makes beside decodes in one step); None with the dynamic
        chunk schedule, whose size changes as the prompt progresses."""
        return self.config.chunk_size if self._chunk_sizes is None else None

    def _chunk_for(self, request: Request) -> int:
        sizes = self._chunk_sizes
        if sizes is None:
            return self.config.chunk_size
        stage = request.num_computed_tokens * len(sizes) // self.config.chunk_schedule_max_tokens
        return sizes[min(stage, len(sizes) - 1)]

    def schedule(self, sched: Scheduler, now: float) -> SchedulerOutput:
        cfg: SarathiConfig = self.config
        out = new_output()
        running = sched.running
        # Stable: equal arrivals keep admission order. Skipped while the batch's last request is
        # the one that was last when it was known sorted: leaving (a finish, a preemption) keeps
        # the order of the rest, and anything appended since would be last itself; admissions
        # here keep the tail (phase 3), and a preempted tail, which may come back, drops it.
        # (The sort took ~1.8% of every Sarathi loop; most steps change nothing of the order.)
        if running and running[-1] is not self._sorted_tail:
            running.sort(key=_arrival)
            self._sorted_tail = running[-1]
        batched = 0

        # Phase 1: decodes. While no block is free (``can_append_slot``), preempt the latest
        # arrival among the requests not yet looked at, or the request itself if none is left.
        prefilling: list[Request] = []
        kv = sched.kv_cache
        has_free = kv.free_block_count() > 0  # changes only where a block is allocated below
        # (Not a bound ``scheduled.append``: Python 3.11 appends a method call inline.)
        scheduled = out.scheduled
        # ``holds`` inlined where the manager answers it from the table's length alone (a call
        # per running request per step showed); a hashed manager is asked (it says False).
        tables = kv.block_tables if kv.holds_by_table_length else None
        block_size = kv.block_size
        # Under pipeline stages, the requests whose batch is in flight (not PAUSED: skipped).
        busy = sched.batch_of
        rest = running  # what the general loop below takes, in order
        if tables is not None:
            # The common pass while nobody needs preempting, a plain loop over the batch (every
            # running request in every stepped iteration): the general loop's decisions without
            # its queue; the first request that would preempt hands the rest to that loop.
            rest = None
            context = 0  # the decodes' context tokens, for ``decode_head``
            items = self._decode_items
            for request in running:
                if busy and request in busy:
                    continue
                computed = request.num_computed_tokens
                if request.prompt_len + request.num_output_tokens - computed > 1:  # is_prefilling
                    prefilling.append(request)
                    continue
                if not has_free:
                    rest = running[running.index(request) :]
                    break
                # Unless its last block has room for the token, it takes a block. (Every
                # running request holds a table: admission allocated its whole prompt.)
                if len(tables[request.request_id]) * block_size <= computed:
                    if not sched.allocate(request, computed + 1):
                        rest = running[running.index(request) :]
                        break
                    has_free = kv.free_block_count() > 0
                # Its decode item of an earlier step, the context set anew (``ScheduledRequest``'s
                # docstring), or a new one, kept until it leaves.
                item = items.get(request)
                if item is None:
                    item = items[request] = scheduled_decode(request, computed)
                else:
                    item.num_context_tokens = computed
                scheduled.append(item)
                context += computed
            batched = len(scheduled)  # one token each; nobody preempted yet
            # These stay the output's first entries: the loops below append after them, and a
            # preemption's victim is one not yet scheduled (or the request being looked at).
            out.decode_head = (batched, context)
        pending = deque(rest) if rest else deque()
        popleft, holds_slot = pending.popleft, kv.holds
        while pending:
            request = popleft()
            if busy and request in busy:
                continue
            computed = request.num_computed_tokens
            if request.prompt_len + request.num_output_tokens - computed > 1:  # is_prefilling, inlined
                prefilling.append(request)
                continue
            if has_free and (  # ``Scheduler.holds_slot``
                (table := tables.get(request.request_id)) is not None
                and len(table) * block_size >= computed + 1
                if tables is not None
                else holds_slot(request.request_id, computed + 1)
            ):
                # Its last block has room for the token: what the loop below would do (nothing,
                # and succeed) without its calls, the bulk of every chunked-prefill iteration.
                scheduled.append(scheduled_decode(request, computed))
                batched += 1
                continue
            while not (
                sched.kv_cache.free_block_count() and sched.allocate(request, request.num_computed_tokens + 1)
            ):
                victim = pending.pop() if pending else request
                if victim in prefilling:
                    prefilling.remove(victim)
                self._preempt(sched, victim, out)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, 1, request.num_computed_tokens))
                batched += 1
            has_free = kv.free_block_count() > 0

        # Phase 2: prompts in progress (their blocks were allocated whole at admission).
        preempted = bool(out.preempted)
        # The chunk size when it is fixed (0 with the dynamic schedule, which ``_chunk_for``
        # computes per request): no call per prompt per step (~650 instructions each).
        fixed = cfg.chunk_size if self._chunk_sizes is None else 0
        for request in prefilling:
            if preempted and request not in running:
                continue
            # ``min(prompt left, budget left)`` spelled out: the builtin parses its arguments as
            # keywords (~1,000 instructions a call), per prompt per stepped iteration.
            chunk = (fixed or self._chunk_for(request)) - batched
            # ``num_remaining_tokens`` inlined (a property: a call through C per read).
            left = request.prompt_len + request.num_output_tokens - request.num_computed_tokens
            if left < chunk:
                chunk = left
            if chunk <= 0:
                continue
            out.scheduled.append(ScheduledRequest(request, chunk, request.num_computed_tokens))
            batched += chunk

        # Phase 3: new requests, FCFS; the first that cannot start stops the walk.
        watermark = int(cfg.watermark * kv.num_blocks)
        while sched.waiting and len(running) < cfg.max_num_seqs:
            request = sched.waiting.peek_request()
            chunk = (fixed or self._chunk_for(request)) - batched  # ``min`` spelled out, as in phase 2
            tokens = request.prompt_len + request.num_output_tokens  # ``num_tokens``, inlined
            left = tokens - request.num_computed_tokens
            if left < chunk:
                chunk = left
            if chunk <= 0:
                break
            if not sched.allocate(request, tokens, reserve=watermark):
                break
            sched.waiting.pop_request()
            sched.admit(request, now)
            tail = self._sorted_tail
            # Still in arrival order if it came no earlier than the last (``_sorted_tail``).
            self._sorted_tail = (
                request if tail is not None and request.arrival_time >= tail.arrival_time else None
            )
            out.num_admitted += 1
            out.scheduled.append(ScheduledRequest(request, chunk, request.num_computed_tokens))
            batched += chunk
        return out

    def on_finished(self, sched: Scheduler, finished: list[Request]) -> None:
        items = self._decode_items
        for request in finished:
            items.pop(request, None)

    def _preempt(self, sched: Scheduler, victim: Request, out: SchedulerOutput) -> None:
        for item in out.scheduled:
            if item.request is victim:
                out.scheduled.remove(item)
                break
        sched.preempt_by_recompute(victim)
        if victim is self._sorted_tail:
            self._sorted_tail = None  # it may come back, after requests appended meanwhile
        sched.waiting.prepend_request(victim)
        out.preempted.append(victim)


_arrival = attrgetter("arrival_time")


def _stage_sizes(cfg: SarathiConfig) -> list[int]:
    """``chunk_schedule_stages`` sizes from high to low, linearly spaced, multiples of 32."""
    n = cfg.chunk_schedule_stages
    if n == 1:
        return [cfg.high_chunk_size // 32 * 32]
    step = (cfg.high_chunk_size - cfg.low_chunk_size) / (n - 1)
    return [max(32, round((cfg.high_chunk_size - i * step) / 32) * 32) for i in range(n)]
