"""Scheduling mechanics every policy shares; the policy decides only order and budgets.

Token accounting (the single rule, see ``request.py``): each iteration grants a request
``num_new_tokens`` so that ``num_computed_tokens`` catches up with ``num_tokens``; when it has
caught up, one output token is sampled. Prefill, chunked prefill, decode, prefix hits and
recompute after preemption are all this one rule with different grants.

Who owns which tokens of a request::

    |<------------- prompt_len ------------->|<--- num_output_tokens --->|
    |<---- num_computed_tokens (in KV) ---->|<- scheduled this step ->|
                                             (catches up with num_tokens)

Ownership of requests: ``waiting`` (a queue strategy the policy picks, ``core/queues.py``:
FCFS or vLLM's priority heap), ``running`` (admission order, the order vLLM's running list has),
``swapped`` (preempted by swapping their KV to the CPU pool, vLLM V0) and ``finished`` (every
request that left: finished, aborted or rejected, each with a reason when not finished). The
engine talks to the scheduler only; it asks the policy (``core/policy.py`` lists the hooks).

Past the style guide's ~300 lines on purpose: these are the mechanics every policy calls, kept in
one class as vLLM keeps them; splitting admission from preemption would split one state machine.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Literal, Protocol

from tailserve.core.executor import StepResult
from tailserve.core.kv_hold import HeldKV
from tailserve.core.queues import RequestQueue
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tailserve.kv.paged import NEVER, KVCacheManager
from tailserve.kv.prefix import block_hashes, keys_from_hash_ids

if TYPE_CHECKING:
    from tailserve.kv.prefix import PrefixMatch

# Finished by completing (a radix cache keeps what they computed); not aborted nor rejected.
# A tuple, not a set: ``in`` a tuple finds a member by identity, while a set hashes it through
# Enum's Python-level ``__hash__`` (a call per finished request).
_COMPLETED = (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)


class PolicyHooks(Protocol):
    """What the scheduler asks its policy. ``core/policy.py``'s ``Policy`` implements it; the
    scheduler names only these hooks instead of importing that class, which is written against
    the scheduler (its hooks take one), so the two modules do not import each other."""

    config: Any  # the policy's frozen config dataclass

    def create_waiting_queue(self) -> RequestQueue: ...

    def add_request(self, sched: Scheduler, request: Request) -> None: ...

    def schedule(self, sched: Scheduler, now: float) -> SchedulerOutput: ...

    def on_finished(self, sched: Scheduler, finished: list[Request]) -> None: ...

    def next_wakeup(self, sched: Scheduler, now: float) -> float | None: ...

    def describe(self) -> str: ...

    def async_scheduling(self) -> bool: ...

    def pipeline_parallel_size(self) -> int: ...

    def max_concurrent_batches(self) -> int: ...

    pipeline_engine: Literal["vllm", "sarathi", "trtllm"]  # the loop under stages (core/policy.py)
    schedule_tick: float

    def fetch_wait(self) -> tuple[float, int] | None: ...


def key_tokens(request: Request) -> list[int] | None:
    """The tokens a request's prefix keys are made from: its prompt (and, in simulation, the
    outputs it will generate); None when it has no token ids (Mooncake hash ids, or neither)."""
    if request.prompt_token_ids is None:
        return None
    if request.planned_output_token_ids:
        return [*request.prompt_token_ids, *request.planned_output_token_ids]
    return request.prompt_token_ids


def prefix_keys(request: Request, block_size: int, tokens: list[int] | None = None) -> list[int] | None:
    """Content keys of the request's full blocks: from its token ids (and, in simulation, the
    outputs it will generate), or from Mooncake ``hash_ids`` (512-token blocks, prompt only);
    None when the workload gives neither. ``tokens``: ``key_tokens(request)``, when the caller
    has it already."""
    if tokens is None:
        tokens = key_tokens(request)
    if tokens is not None:
        return block_hashes(tokens, block_size)
    if request.prefix_block_hashes:
        return keys_from_hash_ids(request.prefix_block_hashes, request.prompt_len, 512, block_size)
    return None


class Scheduler:
    def __init__(self, policy: PolicyHooks, kv_cache: KVCacheManager, max_model_len: int) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.policy = policy
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.waiting = policy.create_waiting_queue()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.finished: list[Request] = []
        # Requests admitted with KV arriving from outside the GPU (vLLM's WAITING_FOR_REMOTE_KVS:
        # a CPU offloading tier's load, ``policies/vllm_offload.py``): they hold blocks, are
        # neither waiting nor running, and go back to the waiting queue when the KV is in.
        self.loading: list[Request] = []
        # KV that finished requests keep until a release time (``core/kv_hold.py``): a P/D pair's
        # prefill replica keeps completed requests' until sent (``hold_sent``, ``cluster/disagg.py``);
        # a request aborted while KV was being loaded into it keeps its blocks until the load is
        # done (vLLM frees them at ``finished_recving``). None until something is held.
        self.held: HeldKV | None = None
        self.hold_sent = False
        # Under async scheduling vLLM reads a step's report (a transfer done) once the step
        # after it is scheduled, an idle engine's too (its empty steps fill the batch queue
        # first). The simulator takes an idle engine's empty steps as instant (vLLM's take well
        # under a millisecond) and reads their report at once; the differential, whose clock
        # is the step, turns this off (``_reported_by``).
        self.idle_reports_at_once = True
        self._last_schedule = 0.0  # when the last pass ran
        # vLLM with a KV connector that loads (``kv_consumer``/``kv_both``) and steps in flight
        # (async scheduling) frees a request's blocks only once every step it was scheduled in
        # has run (``defer_block_free``: a load may refill them unordered with a step still
        # writing them). Set by the policy; the blocks of such a request wait in ``_deferred``
        # as (steps scheduled then, table key) until that many non-empty steps are applied.
        self.defer_in_flight_frees = False
        self._deferred: deque[tuple[int, str]] = deque()
        self._num_scheduled_steps = 0
        self._num_applied_steps = 0
        self.num_released = 0  # requests handed over by ``pop_finished``
        self.num_preemptions = 0
        self.last_output: SchedulerOutput | None = None
        # The time of the last ``update`` if every running request sampled one token in it (so
        # each is one token behind then), else None; the simulator's chunk run sets it too, at
        # the end of a run whose prompt sampled. The driver reads it while the clock is still
        # there instead of scanning the batch for the same fact (``driver.steady``).
        self.one_behind_at: float | None = None
        # vLLM's async scheduling: the engine applies each step's outputs after scheduling the
        # next (``Engine``), with the policy's outputs ``advanced`` (``advance_scheduled``).
        self.async_scheduling = bool(policy.async_scheduling())
        # Pipeline parallelism (vLLM's batch queue of ``max_concurrent_batches``): ``Engine``
        # keeps that many batches in flight through the stages (``Engine._step_pipelined``).
        self.pipeline_parallel_size = int(policy.pipeline_parallel_size())
        self.max_concurrent_batches = int(policy.max_concurrent_batches())
        # Sarathi-Serve's and TensorRT-LLM's pipelined engines (``Engine._step_paused``,
        # ``Engine._step_ring``): each request whose batch is in the stages -> that batch
        # (``launched``, ``returned``). Their schedulers skip them (Sarathi: not PAUSED;
        # TensorRT-LLM: ``inflight_req_ids``); a preempted or aborted one leaves its batch, whose
        # outputs for it are then dropped. Empty under every other engine (vLLM's batch queue
        # advances computed tokens instead).
        self.batch_of: dict[Request, SchedulerOutput] = {}
        # TensorRT-LLM's batch_wait_timeout_ms: the fetch at each step's start waits (Engine._fetched).
        self.fetch_wait = policy.fetch_wait()

    # ---- requests in and out ------------------------------------------------------------
    def add_request(self, request: Request, now: float) -> bool:
        """Queue a request, or reject it (with a reason) if it can never be served."""
        total = request.prompt_len + request.max_tokens
        if total > self.max_model_len:
            # vLLM's API server answers 400 with this message; the engine never sees it.
            self._leave(
                request,
                RequestStatus.FINISHED_REJECTED,
                now,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {total} tokens ({request.prompt_len} in the prompt, "
                f"{request.max_tokens} in the completion).",
            )
            return False
        if self.kv_cache.blocks_for(total) > self.kv_cache.num_blocks:
            self._leave(
                request,
                RequestStatus.FINISHED_REJECTED,
                now,
                f"needs {total} tokens of KV cache but the cache holds only "
                f"{self.kv_cache.num_blocks * self.kv_cache.block_size}",
            )
            return False
        request.status = RequestStatus.WAITING
        request.enqueue_time = now
        if self.kv_cache.prefix_caching:
            tokens = key_tokens(request)  # built once: the keys and the KV events' token ids
            keys = prefix_keys(request, self.kv_cache.block_size, tokens)
            if keys:
                self.kv_cache.set_prefix_keys(request.request_id, keys, tokens)
                if self.kv_cache.host is not None:
                    self.kv_cache.set_host_range(request.request_id, request.prompt_len)
        self.policy.add_request(self, request)
        return not request.is_finished  # a policy may refuse it (``reject``), e.g. backpressure

    def abort_request(
        self, request_id: str, reason: str, now: float, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> Request | None:
        """End a queued or running request (``status``: FINISHED_REJECTED for one a policy turns
        away from its waiting queue before serving it)."""
        for queue in (self.running, self.waiting, self.swapped, self.loading):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    if self.batch_of:
                        self._leave_batch(request)
                    done = self.policy.load_done(request) if queue is self.loading else None
                    if done is not None and done > self._reported_by(now):
                        # Its blocks stay until the load is done and reported.
                        if self.held is None:
                            self.held = HeldKV()
                        self.held.hold(request, completed=False)
                        self.held.release_at(request_id, done)
                    else:
                        self._free_kv(request)
                    self._leave(request, status, now, reason)
                    self.policy.on_finished(self, [request])
                    return request
        return None

    def pop_finished(self) -> list[Request]:
        """Hand over (and forget) the requests that left so far: a long-running server must not
        keep every request it ever served."""
        done, self.finished = self.finished, []
        self.num_released += len(done)
        return done

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.loading)

    # ---- what the engine asks (answered by the policy's hooks) --------------------------
    def next_wakeup(self, now: float) -> float | None:
        wake = self.policy.next_wakeup(self, now)
        if self.held is not None:
            release = self.held.next_release()
            if release is not None and (wake is None or release < wake):
                return release
        return wake

    def hold_kv_until_sent(self) -> None:
        """Keep completed requests' KV until ``release_sent`` (a P/D pair's prefill side)."""
        self.hold_sent = True
        if self.held is None:
            self.held = HeldKV()

    def release_sent(self, request_id: str, t: float) -> None:
        """The held request's KV has reached the decode side at ``t``: free it from then."""
        assert self.held is not None, "hold_kv_until_sent first"
        self.held.release_at(request_id, t)

    def reports_lag(self) -> bool:
        """Whether a transfer's report (KV sent, a load or a store done) reaches this pass a pass
        late: it is read with the outputs of the step running when it ended, which under async
        scheduling (a step in flight) are applied once the step after it is scheduled. An idle
        engine's empty steps are taken as instant (``idle_reports_at_once``)."""
        return self.async_scheduling and bool(self.running or not self.idle_reports_at_once)

    def _reported_by(self, now: float) -> float:
        """The transfers the engine has read by ``now``: those done by then, or (``reports_lag``)
        only those done by the last pass."""
        return self._last_schedule if self.reports_lag() else now

    def free_sent(self, now: float) -> None:
        """Free the held KV whose release time has come: each iteration's first act (both
        engines poll their transfers once per turn); a harness that reports transfers between
        steps (``validate/tailserve_side.py``) calls it where the engine reads the report."""
        held = self.held
        if held is None:
            return
        kv = self.kv_cache
        for request, cache in held.due(now):
            kv.free(request.request_id, request.num_computed_tokens, cache)
            kv.forget_prefix_keys(request.request_id)

    def _free_kv(self, request: Request, finished: bool = False) -> None:
        """Release the request's KV now, or (``defer_in_flight_frees``) once the steps in flight
        it is scheduled in have run."""
        if self.defer_in_flight_frees and request.num_in_flight_tokens:
            key = f"{request.request_id}\0deferred{self._num_scheduled_steps}"
            self.kv_cache.detach(request.request_id, key)
            self._deferred.append((self._num_scheduled_steps, key))
        else:
            self.kv_cache.free(request.request_id, request.num_computed_tokens, finished)

    def _step_applied(self) -> None:
        """A non-empty step's outputs are applied: the deferred frees it fenced are done (vLLM's
        ``_drain_deferred_frees``, in the order they were deferred)."""
        self._num_applied_steps += 1
        deferred, kv = self._deferred, self.kv_cache
        while deferred and deferred[0][0] <= self._num_applied_steps:
            kv.free(deferred.popleft()[1])

    def describe_policy(self) -> str:
        return self.policy.describe()

    # ---- the iteration ------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        self.one_behind_at = None  # the next update says it anew
        if self.held:
            self.free_sent(self._reported_by(now))
        self._last_schedule = now
        out = self.policy.schedule(self, now)
        self.last_output = out
        if self.defer_in_flight_frees and out.scheduled:
            self._num_scheduled_steps += 1
        return out

    def add_block_ids(self, out: SchedulerOutput) -> None:
        """Give each scheduled request of ``out`` its block table, for an executor that owns KV
        tensors (``Executor.needs_block_ids``); the simulator skips this."""
        tables = self.kv_cache.block_tables
        for item in out.scheduled:
            table = tables[item.request.request_id]
            # The plain manager's tables are typed arrays (kv/paged.py); executors get lists.
            item.block_ids = table if type(table) is list else list(table)

    def update(self, out: SchedulerOutput, result: StepResult, now: float) -> list[Request]:
        """Apply an executed iteration at time ``now``; returns the requests that finished."""
        self.one_behind_at = None
        if out.advanced:
            return self.update_advanced(out, result, now)
        done: list[Request] = []
        partial = False  # some scheduled request did not sample exactly one token
        token_ids = result.token_ids
        stopped = result.stopped
        scheduled = out.scheduled
        head = out.decode_head
        if head is not None and token_ids is None and not stopped:
            # The leading one-token decodes the policy vouched for (``decode_head``): each
            # computes its token and samples one, without the tests the general loop makes.
            m = head[0]
            for item in scheduled[:m]:
                request = item.request
                request.num_computed_tokens += 1
                outputs = request.num_output_tokens = request.num_output_tokens + 1
                request.token_times.append(now)
                if outputs >= request.max_tokens:
                    request.status = RequestStatus.FINISHED_LENGTH
                    done.append(request)
            scheduled = scheduled[m:]
        for item in scheduled:
            request = item.request
            if item.num_spec_tokens:
                partial = True
                if self._apply_verify(item, result, now):
                    done.append(request)
                continue
            computed = request.num_computed_tokens = request.num_computed_tokens + item.num_new_tokens
            if computed != request.prompt_len + request.num_output_tokens:
                partial = True
                continue  # a partial prefill chunk: nothing sampled yet
            outputs = request.num_output_tokens = request.num_output_tokens + 1
            request.token_times.append(now)
            if token_ids is not None:  # the real executor's; the simulator samples none
                request.output_token_ids.append(token_ids[request.request_id])
            if stopped and request.request_id in stopped:
                request.status = RequestStatus.FINISHED_STOPPED
                done.append(request)
            elif outputs >= request.max_tokens:
                request.status = RequestStatus.FINISHED_LENGTH
                done.append(request)
        # Every running request was scheduled (the finished ones leave below) and sampled one
        # token: each is one token behind, what ``steady`` otherwise scans the batch for.
        if not partial and len(out.scheduled) == len(self.running):
            self.one_behind_at = now
        if done:
            self.finish(done, now)
        return done

    def _apply_verify(self, item: ScheduledRequest, result: StepResult, now: float) -> bool:
        """A speculative verification outside vLLM's accounting (SGLang's chain drafts: the
        last sampled token and ``num_spec_tokens`` drafts, all computed this step): 1 + the
        drafts accepted (``result.num_accepted``) become outputs at ``now`` and their KV is
        committed (SGLang's ``kv_committed_len += accept_len``), stopping at ``max_tokens``;
        the rest of the verified positions stay held, uncommitted. True when it finished."""
        request = item.request
        accepted = (result.num_accepted or {}).get(request.request_id, 0)
        num_sampled = 1 + min(accepted, item.num_spec_tokens)
        appended = max(0, min(num_sampled, request.max_tokens - request.num_output_tokens))
        request.num_output_tokens += appended
        request.token_times.extend([now] * appended)
        request.num_computed_tokens += appended
        if request.num_output_tokens >= request.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def update_run(
        self,
        decodes: list[Request],
        held_tokens: list[int],
        token_times: list[float],
        chunked: Request | None = None,
        chunk_tokens: int = 0,
    ) -> list[Request]:
        """The same rule as ``update``, in closed form for ``k = len(token_times)`` iterations
        (the simulator's exact fast paths): each request in ``decodes`` is one token behind and is granted
        one token in every iteration, so it samples one at each iteration's end
        (``token_times``); ``chunked`` is granted ``chunk_tokens`` in all and samples once, at
        the last iteration's end, if they complete its known tokens. KV blocks the run filled
        are allocated as ``allocate`` would have (``held_tokens``: the slots each decode held
        before the run), and registered with prefix caching. Returns the requests that reached
        ``max_tokens`` (status set); the caller finishes them with ``finish`` after the
        policy's ``FastPaths.on_decode_run``, the order stepping has. The executor reports no token ids
        and no stops here (only the cost model's runs are advanced this way)."""
        k = len(token_times)
        kv = self.kv_cache
        done: list[Request] = []
        # Once per request per run of the simulator's fast paths. Without prefix caching the
        # blocks a run's decodes grow into are taken together (``allocate_each``: the same
        # blocks, in the same order); with it each request's are registered as they fill.
        prefix_caching = kv.prefix_caching
        grow_ids: list[str] = []
        grow_to: list[int] = []
        if prefix_caching:
            for request, slots in zip(decodes, held_tokens):
                computed = request.num_computed_tokens = request.num_computed_tokens + k
                outputs = request.num_output_tokens = request.num_output_tokens + k
                request.token_times.extend(token_times)
                if computed > slots:
                    kv.allocate(request.request_id, computed)
                kv.register_computed(request.request_id, computed)  # blocks filled during the run
                if outputs >= request.max_tokens:
                    request.status = RequestStatus.FINISHED_LENGTH
                    done.append(request)
        else:
            for request, slots in zip(decodes, held_tokens):
                computed = request.num_computed_tokens = request.num_computed_tokens + k
                outputs = request.num_output_tokens = request.num_output_tokens + k
                request.token_times.extend(token_times)
                if computed > slots:
                    grow_ids.append(request.request_id)
                    grow_to.append(computed)
                if outputs >= request.max_tokens:
                    request.status = RequestStatus.FINISHED_LENGTH
                    done.append(request)
            if grow_ids:
                kv.allocate_each(grow_ids, grow_to)
        if chunked is not None:
            chunked.num_computed_tokens += chunk_tokens
            if chunked.num_computed_tokens == chunked.prompt_len + chunked.num_output_tokens:
                chunked.num_output_tokens += 1
                chunked.token_times.append(token_times[-1])
                if chunked.num_output_tokens >= chunked.max_tokens:
                    chunked.status = RequestStatus.FINISHED_LENGTH
                    done.append(chunked)
        return done

    def update_async_run(
        self,
        decodes: list[Request],
        held_tokens: list[int],
        token_times: list[float],
        num_behind: int = 0,
    ) -> list[Request]:
        """``advance_scheduled`` and ``update_advanced`` in closed form for a run of async decode
        steps (the simulator's exact fast path under async scheduling). Before the run each
        request in ``decodes`` has one step in flight that samples (one output placeholder,
        ``num_computed_tokens == num_tokens``); the run schedules ``m = len(token_times)`` steps
        of one token each and applies the outputs of the m steps before the last, one token at
        each ``token_times`` entry. A request whose last token that applies (``max_tokens``
        reached) was skipped by the last step (vLLM's guard: its last token was in flight) and
        finishes: status set, nothing left in flight, returned (in order) for the caller to
        ``finish`` as the step's update would. Every other one still has its last step in flight
        (one placeholder, one in-flight token). KV blocks are allocated as the steps'
        allocations would (``held_tokens``: the slots each held before the run), and with prefix
        caching registered only up to the tokens known, ``computed - placeholders``, as the
        update registers them. No stops: only the cost model's steps are advanced this way.

        ``num_behind``: the first requests of ``decodes`` had nothing in flight (the step in
        flight was a prefill batch of the others: ``async_decode_run.steady``), their last
        token known and uncomputed; the same steps schedule them, but the first output applied
        is not theirs: they get ``token_times[1:]``."""
        m = len(token_times)
        kv = self.kv_cache
        done: list[Request] = []
        # As in ``update_run``: without prefix caching the blocks the run's decodes grow into
        # are taken together (``allocate_each``: the same ids, in the same order), not by an
        # ``allocate`` call per request per run (SGLang's one-token slots grow every request in
        # every run: 150,912 calls in 5,000 sim_memory requests, issue 35); with it each
        # request's are registered as they fill, after its own allocation.
        grow_ids: list[str] = []
        grow_to: list[int] = []
        if num_behind:
            behind = decodes[:num_behind] if num_behind < len(decodes) else decodes
            for request in behind:
                request.num_output_placeholders = 1  # the run's steps leave one in flight
            self._apply_async_run(behind, held_tokens, token_times[1:], m, grow_ids, grow_to, done)
            if behind is not decodes:
                self._apply_async_run(
                    decodes[num_behind:], held_tokens[num_behind:], token_times, m, grow_ids, grow_to, done
                )
        else:
            self._apply_async_run(decodes, held_tokens, token_times, m, grow_ids, grow_to, done)
        if grow_ids:
            kv.allocate_each(grow_ids, grow_to)
        return done

    def _apply_async_run(
        self,
        decodes: list[Request],
        held_tokens: list[int],
        token_times: list[float],
        num_steps: int,
        grow_ids: list[str],
        grow_to: list[int],
        done: list[Request],
    ) -> None:
        """``update_async_run`` for requests that each get ``token_times`` as outputs and were
        scheduled in ``num_steps`` steps (the last of them left in flight unless the request
        finished, skipped by it); the slots to grow into are collected in ``grow_ids`` /
        ``grow_to`` without prefix caching (allocated with it), the finished ones in ``done``."""
        kv = self.kv_cache
        prefix_caching = kv.prefix_caching
        applied = len(token_times)
        # The manager's registration thresholds, tested before calling ``register_computed``
        # per request per run, as ``update_advanced`` does: below its threshold a request has
        # no block to register (its ``register_computed`` returns having done nothing), and
        # without planned keys none has one (trtllm's hashed manager on sim_memory; r48).
        gate = kv.registers_from
        for request, slots in zip(decodes, held_tokens):
            outputs = request.num_output_tokens = request.num_output_tokens + applied
            request.token_times.extend(token_times)
            if outputs >= request.max_tokens:
                computed = request.num_computed_tokens = request.num_computed_tokens + num_steps - 1
                request.num_in_flight_tokens = request.num_output_placeholders = 0
                known = computed
                request.status = RequestStatus.FINISHED_LENGTH
                done.append(request)
            else:
                computed = request.num_computed_tokens = request.num_computed_tokens + num_steps
                request.num_in_flight_tokens = 1
                known = computed - 1
            if not prefix_caching:
                if computed > slots:
                    grow_ids.append(request.request_id)
                    grow_to.append(computed)
                continue
            rid = request.request_id
            if computed > slots:
                kv.allocate(rid, computed)
            if gate is None or known >= gate.get(rid, NEVER):
                kv.register_computed(rid, known)

    # ---- vLLM V1's own accounting (async scheduling, speculative decoding) ------------------
    # vLLM advances a request's computed tokens when it schedules them, so that the next step
    # can be scheduled before this one's outputs are known, and rolls back the drafts the
    # rejection sampler rejects when the outputs arrive. A policy that follows it calls
    # ``advance_scheduled`` at the end of ``schedule``; ``update`` then goes to ``update_advanced``.
    def advance_scheduled(self, out: SchedulerOutput) -> None:
        """vLLM's ``_update_after_schedule`` (with ``AsyncScheduler``'s): each scheduled request's
        computed tokens advance by its grant now; one that is no longer prefilling will sample,
        and under async scheduling its outputs (1 + the drafts it verifies) become placeholders
        and it gets ``out.num_spec_tokens_to_schedule`` placeholder drafts for its next step."""
        placeholders = self.async_scheduling
        num_drafts = out.num_spec_tokens_to_schedule
        scheduled = out.scheduled
        head = out.decode_head
        if head is not None and placeholders:
            # The leading one-token decodes the policy vouched for (``decode_head``): each
            # computes the token it lacked and samples, without the tests below (per request
            # per step).
            m = head[0]
            for item in scheduled[:m]:
                request = item.request
                request.num_computed_tokens += 1
                request.num_in_flight_tokens += 1
                request.is_prefill_chunk = item.partial = False
                request.num_output_placeholders += 1
                request.num_draft_tokens = num_drafts
            scheduled = scheduled[m:]
        for item in scheduled:
            request = item.request
            n = item.num_new_tokens
            computed = request.num_computed_tokens = request.num_computed_tokens + n
            request.num_in_flight_tokens += n
            known = request.prompt_len + request.num_output_tokens  # ``num_tokens``, inlined
            partial = computed < known + request.num_output_placeholders
            request.is_prefill_chunk = item.partial = partial
            if placeholders and not partial:
                request.num_output_placeholders += 1 + item.num_spec_tokens
                request.num_draft_tokens = num_drafts
        out.advanced = True

    def update_advanced(self, out: SchedulerOutput, result: StepResult, now: float) -> list[Request]:
        """vLLM's ``update_from_output`` for an ``advanced`` step, applied at ``now``: a request
        that was not prefilling samples 1 + its accepted drafts (rejected drafts roll back its
        computed tokens, and its placeholders under async scheduling), each token checked for a
        stop and for ``max_tokens``; outputs of a request preempted since they were scheduled
        (stale) are kept without the rollback, and those of a finished or aborted one are
        dropped. Synchronous speculative decoding then gives every request of the step that
        still decodes its next drafts (vLLM's ``update_draft_token_ids``, after the update).
        Finished requests are freed in step order, as vLLM frees them; returns them."""
        if self.defer_in_flight_frees and out.scheduled:
            self._step_applied()  # first, as vLLM's update_from_output
        done: list[Request] = []
        stopped = result.stopped
        placeholders = self.async_scheduling
        num_drafts = 0 if placeholders else out.num_spec_tokens_to_schedule
        kv = self.kv_cache
        # The KV manager's registration thresholds (``registers_from``) are tested here instead
        # of calling ``register_computed`` for every request of every step: a block fills once
        # in ``block_size`` steps (empty: no request has one left to register), and under async
        # scheduling this call mostly repeats the one the next step's scheduling just made for
        # the same tokens. None: every call counts (a radix tree).
        gate = kv.registers_from
        running = RequestStatus.RUNNING
        for item in out.scheduled:
            request = item.request
            request.num_in_flight_tokens -= item.num_new_tokens
            stale = request.num_stale_output_tokens > 0
            if stale:
                request.num_stale_output_tokens -= item.num_new_tokens
                if self.hold_sent:
                    # A P/D prefill side drops it: its KV must reach the decode side whole, so
                    # the preempted request recomputes (vLLM's ``requires_kv_delivery``).
                    continue
            was_running = request.status is running
            if item.partial or (not was_running and request.is_finished):
                continue  # a prefill chunk, which samples nothing; or left while its step ran
            rid = request.request_id
            if item.num_spec_tokens or rid in stopped:
                appended, finished = _sample_advanced(item, result, stale, now)
            else:
                # One token and no stop, the common step: ``_sample_advanced``'s single pass
                # without its loop (once per request per step).
                appended = 1
                outputs = request.num_output_tokens = request.num_output_tokens + 1
                request.token_times.append(now)
                finished = outputs >= request.max_tokens
                if finished:
                    request.status = RequestStatus.FINISHED_LENGTH
            if placeholders:
                if not stale:
                    request.num_output_placeholders -= appended
                if was_running and (gate is None or gate):
                    # Blocks filled by tokens now known become matchable (AsyncScheduler).
                    known = request.num_computed_tokens - request.num_output_placeholders
                    if gate is None or known >= gate.get(rid, NEVER):
                        kv.register_computed(rid, known)
            if finished:
                if not was_running:
                    self.waiting.remove_request(request)  # preempted while its last step ran
                elif not stale:
                    # A later step of it still in flight commits nothing (its outputs are
                    # dropped): SGLang's spec v2, whose accepted run can cross max_tokens
                    # unforeseen; a stop token. What the request leaves computed excludes it.
                    request.num_computed_tokens -= request.num_in_flight_tokens
                if self.hold_sent:
                    self.held.hold(request)  # type: ignore[union-attr]  # sent first (``release_sent``)
                else:
                    self._free_kv(request, True)
                done.append(request)
            elif num_drafts and was_running:
                request.num_draft_tokens = num_drafts
        if done:
            self.running = without(self.running, done)
            for request in done:
                self._leave(request, request.status, now, None)
            self.policy.on_finished(self, done)
        return done

    def finish(self, done: list[Request], now: float) -> None:
        """Requests whose status was just set to a FINISHED_* status leave the running set."""
        self.running = without(self.running, done)
        kv = self.kv_cache
        held = self.held
        for request in done:
            completed = request.status in _COMPLETED
            if completed and self.hold_sent:
                held.hold(request)  # type: ignore[union-attr]  # sent first (``release_sent``)
            else:
                kv.free(request.request_id, request.num_computed_tokens, completed)
            self._leave(request, request.status, now, None)
        self.policy.on_finished(self, done)

    # ---- mechanics policies call --------------------------------------------------------
    def allocate(
        self, request: Request, num_total_tokens: int, reserve: int = 0, num_cached: int | None = None
    ) -> bool:
        """Make ``request`` hold KV for ``num_total_tokens`` tokens, keeping ``reserve`` blocks
        free; False (and nothing allocated) when that does not fit. ``num_cached``: the tokens
        whose full blocks become matchable now (default all ``num_total_tokens``; vLLM caches
        neither draft tokens nor lookahead slots, only tokens already known)."""
        kv = self.kv_cache
        if reserve and not kv.can_allocate(request.request_id, num_total_tokens, reserve):
            return False
        if kv.allocate(request.request_id, num_total_tokens) is None:
            return False
        if kv.prefix_caching:
            # Blocks that will be full once this iteration's tokens are computed become
            # matchable now, as vLLM caches them when it allocates them.
            kv.register_computed(request.request_id, num_total_tokens if num_cached is None else num_cached)
        return True

    def free_blocks(self, request: Request) -> None:
        """Give back the KV a request was granted in this pass before it ran (a batch put back,
        TGI's ``next_batch``): nothing of it is cached, a cached prefix it locked is unlocked.
        The caller resets its progress."""
        self.kv_cache.free(request.request_id)

    # ---- the KV manager's prefix cache (vLLM: ``get_computed_blocks``, ``allocate_slots``) ----
    # The manager owns the cache (built by ``kv/factory.py`` from the policy's ``KVSpec``);
    # policies ask through these, in the order their engine does.
    def set_prefix_keys(self, request: Request, keys: list) -> None:
        """The keys a radix cache matches the request by, as its engine makes them (SGLang:
        every token; TGI: the prompt's full blocks); the first builds the tree. Hashed block keys
        are set by ``add_request`` itself."""
        self.kv_cache.set_prefix_keys(request.request_id, keys)

    def cached_prefix(self, request: Request, num_tokens: int | None = None) -> PrefixMatch | None:
        """The request's longest cached prefix (``get_computed_blocks``), capped so at least one
        of its ``num_tokens`` tokens (default: all it has) is computed; None without a prefix
        cache or keys. Counts a lookup; locks and allocates nothing."""
        return self.kv_cache.match_prefix(
            request.request_id, request.num_tokens if num_tokens is None else num_tokens
        )

    def allocate_with_cached_prefix(
        self,
        request: Request,
        match: PrefixMatch,
        num_total_tokens: int,
        num_computed_tokens: int | None = None,
        register: bool = True,
        cache_limit: int | None = None,
        num_cached: int | None = None,
    ) -> bool:
        """Admit a request with a prefix hit (``allocate_slots`` with computed blocks): it takes
        the match's cached blocks and holds KV for ``num_total_tokens`` tokens, and starts at
        ``num_computed_tokens`` (default: the hit). With hashed prefix caching the blocks full
        once those tokens are computed are registered, as ``allocate`` does, unless ``register``
        is False (vLLM V0 registers them itself, after marking what is fresh). A radix cache
        keeps the match locked for the request until it is freed; ``cache_limit`` (SGLang: what
        this admission prefills) caps what ``cache_computed`` inserts; ``num_cached`` caps the
        hashed registration as in ``allocate``. False (nothing registered, progress unchanged)
        when it does not fit; callers check the fit first."""
        kv = self.kv_cache
        if not kv.allocate_with_prefix(request.request_id, match, num_total_tokens, cache_limit):
            return False
        if register and kv.prefix_caching:
            kv.register_computed(request.request_id, num_total_tokens if num_cached is None else num_cached)
        request.num_computed_tokens = match.num_tokens if num_computed_tokens is None else num_computed_tokens
        return True

    def cache_computed(self, request: Request, num_tokens: int) -> None:
        """Make the request's KV up to ``num_tokens`` tokens matchable by others (vLLM:
        ``cache_blocks``; SGLang: ``cache_unfinished_req``)."""
        self.kv_cache.register_computed(request.request_id, num_tokens)

    def lock_cached_prefix(self, match: PrefixMatch) -> None:
        """Protect a match from eviction while the policy weighs it (SGLang locks the node while
        the adder checks the budget); ``allocate_with_cached_prefix`` keeps the lock for the
        request, ``unlock_cached_prefix`` gives it back."""
        self.kv_cache.lock_prefix(match)

    def unlock_cached_prefix(self, match: PrefixMatch) -> None:
        self.kv_cache.unlock_prefix(match)

    def evict_cached(self, num_blocks: int) -> None:
        """Evict at least ``num_blocks`` blocks of cached KV nobody holds, least recently used
        first (a radix cache evicts on demand; SGLang on allocation, TGI at admission)."""
        self.kv_cache.evict_cached(num_blocks)

    def new_context_block(self, request: Request) -> int | None:
        """The key of the request's first full block not cached now (TensorRT-LLM's
        ``findNewContextBlock``: two requests with the same one would compute the same block);
        None when every full block is cached or without a prefix cache. Counts no lookup."""
        return self.kv_cache.new_context_block(request.request_id, request.num_tokens)

    def holds_slot(self, request: Request, num_total_tokens: int) -> bool:
        """True when ``allocate(request, num_total_tokens)`` would change nothing: the request's
        blocks already hold the tokens and no prefix-cache registration is due (plain KV). A
        cheap test for the decode walks, where most tokens land in a block with room."""
        return self.kv_cache.holds(request.request_id, num_total_tokens)

    def admit(self, request: Request, now: float) -> None:
        """Move a waiting request (already removed from the waiting queue) into running."""
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
        self.running.append(request)

    def preempt_by_recompute(self, request: Request) -> None:
        """Free all of the request's KV; it must compute everything again (prompt and outputs)."""
        self.running.remove(request)
        if self.batch_of:
            self._leave_batch(request)
        if self.kv_cache.host is not None:
            self.kv_cache.host_preempted(request.request_id)
        self._free_kv(request)
        request.num_computed_tokens = 0
        # vLLM (``_preempt_request``): drafts dropped; outputs of its steps still in flight come
        # back stale, without the placeholder accounting that restarts here (0 outside vllm).
        request.num_stale_output_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0
        request.num_draft_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1

    def launched(self, out: SchedulerOutput) -> None:
        """A paused-request pipelined engine launched ``out``: its requests are in flight until it
        returns (``batch_of``) — but a context's non-final chunk under the scheduler's own
        accounting (TensorRT-LLM: its next chunk may follow at once, its computed tokens advanced)."""
        batch_of = self.batch_of
        for item in out.scheduled:
            if not item.partial:
                batch_of[item.request] = out

    def returned(self, out: SchedulerOutput) -> None:
        """``out`` is out of the last stage and applied: its requests are schedulable again."""
        batch_of = self.batch_of
        for item in out.scheduled:
            if batch_of.get(item.request) is out:
                del batch_of[item.request]

    def _leave_batch(self, request: Request) -> None:
        """A paused-request pipelined engine: a request preempted or aborted while its batch is
        in the stages leaves that batch, so its outputs are dropped when the batch returns
        (Sarathi-Serve's ``on_step_completed``: "seq is preempted")."""
        out = self.batch_of.pop(request, None)
        if out is None:
            return
        for i, item in enumerate(out.scheduled):
            if item.request is request:
                del out.scheduled[i]
                if out.advanced:  # its tokens counted in flight at scheduling: not coming back
                    request.num_in_flight_tokens -= item.num_new_tokens
                break
        out.decode_head = None  # the leading decodes counted with it

    def reject(self, request: Request, reason: str, now: float) -> None:
        """A policy refuses a request it was handed (e.g. TGI's ``max_concurrent_requests``
        backpressure). The request must not be in any queue."""
        self._leave(request, RequestStatus.FINISHED_REJECTED, now, reason)

    def abort(self, request: Request, reason: str, now: float) -> None:
        """End a request the engine cannot serve (e.g. no CPU swap space left); it must already
        be out of every queue. Its KV is released."""
        if self.batch_of:
            self._leave_batch(request)  # a pipelined engine's batch in flight drops its outputs
        self.kv_cache.free(request.request_id, request.num_computed_tokens)
        self._leave(request, RequestStatus.FINISHED_ABORTED, now, reason)

    def preempt_by_swap(self, request: Request, out: SchedulerOutput) -> bool:
        """Move the request's KV to the CPU pool (its block pairs recorded in ``out``, for the
        executor's copies and the PCIe cost) and park it in ``swapped``; False (nothing changed)
        when the CPU pool is full."""
        if out.blocks_to_swap_in:
            # It could take CPU blocks a swap-in of this step still has to copy from.
            raise RuntimeError("a swap-out after a swap-in in one iteration")
        moved = self.kv_cache.swap_out(request.request_id)
        if moved is None:
            return False
        self.running.remove(request)
        if self.batch_of:
            self._leave_batch(request)
        request.status = RequestStatus.SWAPPED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.swapped.append(request)
        out.swapped_out.append(request)
        out.blocks_to_swap_out.extend(moved)
        return True

    def swap_in(self, request: Request, out: SchedulerOutput, reserve: int = 0) -> bool:
        """Bring a swapped request back to the GPU and into ``running``; False when the GPU
        cannot hold its blocks plus ``reserve``."""
        kv = self.kv_cache
        if not kv.can_swap_in(request.request_id, reserve):
            return False
        moved = kv.swap_in(request.request_id)
        if moved is None:
            return False
        self.swapped.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.swapped_in.append(request)
        out.blocks_to_swap_in.extend(moved)
        return True

    def _leave(self, request: Request, status: RequestStatus, now: float, reason: str | None) -> None:
        request.status = status
        request.status_reason = reason
        request.finish_time = now
        if self.held is None or request.request_id not in self.held.requests:
            kv = self.kv_cache
            if kv.host is not None:
                # vLLM offers a finished prompt's blocks (an aborted one's computed ones) once more
                aborted = status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_REJECTED)
                kv.host_finished(
                    request.request_id, request.num_computed_tokens if aborted else request.prompt_len
                )
            kv.forget_prefix_keys(request.request_id)  # (held: once its KV is freed)
        self.finished.append(request)


def without(running: list[Request], done: list[Request]) -> list[Request]:
    """``running`` less the requests of ``done`` (those in it), in order, as a new list: the
    decode runs keep the list they bound and index it after a finish. A few finished requests
    are found by ``list.index`` and deleted from a copy, in C (``Request`` compares by identity,
    ``eq=False``) instead of a Python filter over the whole batch at every finish."""
    if len(done) > 4:
        gone = {id(r) for r in done}
        return [r for r in running if id(r) not in gone]
    kept = running.copy()
    for request in done:
        try:  # noqa: SIM105  (``contextlib.suppress`` enters a context manager per request)
            del kept[kept.index(request)]
        except ValueError:
            pass  # not running (preempted while its last step ran)
    return kept


def _sample_advanced(item: ScheduledRequest, result: StepResult, stale: bool, now: float) -> tuple[int, bool]:
    """``Scheduler.update_advanced``'s outputs of one request that verified drafts or stopped:
    1 + its accepted drafts (the rejected ones roll back its computed tokens and placeholders,
    unless its count is stale), each stamped at ``now`` and checked for the stop and for
    ``max_tokens``. Returns (tokens appended, whether it finished)."""
    request = item.request
    rid = request.request_id
    num_sampled = 1
    num_spec = item.num_spec_tokens
    if num_spec:
        accepted = result.num_accepted or {}
        num_accepted = 0 if item.spec_padding else min(accepted.get(rid, 0), num_spec)
        num_sampled += num_accepted
        if not stale:  # a stale count predates the preemption's reset
            rejected = num_spec - num_accepted
            if request.num_computed_tokens > 0:
                request.num_computed_tokens -= rejected
            if request.num_output_placeholders > 0:
                request.num_output_placeholders -= rejected
    stop_at = result.stop_index.get(rid, 0) if rid in result.stopped else -1
    appended = 0
    finished = False  # (it was not when its outputs came: ``update_advanced`` skips those)
    while appended < num_sampled:
        request.num_output_tokens += 1
        request.token_times.append(now)
        if appended == stop_at:
            request.status = RequestStatus.FINISHED_STOPPED
            finished = True
        elif request.num_output_tokens >= request.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH
            finished = True
        appended += 1
        if finished:
            break  # vLLM trims the tokens after a stop
    return appended, finished
