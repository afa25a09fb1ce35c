"""``LLMEngine``: the live engine behind the offline ``LLM`` API and the HTTP server.

It is the simulator's ``Engine`` with a wall clock, a ``QueueSource`` fed by ``add_request``,
and an executor that produces tokens: the PyTorch executor (a real model) or the simulated one
paced in real time (placeholder tokens at the cost model's speed, a stand-in server). Around the
loop it keeps per-request text state, checks stop conditions and reports deltas.

Single-threaded: one thread owns an ``LLMEngine`` and calls ``step`` (the server's async layer
feeds it through a queue).

A failed iteration is contained when it can be: if the executor (or the stop checks after it)
raises, the requests of that iteration are aborted with a reason naming the error, their KV
blocks are freed, cached prefix blocks are dropped (the failed step may have registered blocks
whose contents were never written), and the engine's invariants are checked; then ``step``
raises ``StepFailedError`` and the engine can go on. A failure while scheduling, under a radix
prefix cache, or one that leaves the invariants broken raises ``EngineFatalError``: the state
cannot be trusted and the owner must stop (the server exits non-zero, as vLLM does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tailserve.core.engine import Engine, EngineOptions, WallClock
from tailserve.core.executor import Executor
from tailserve.core.request import Request, RequestStatus
from tailserve.core.sampling_params import SamplingParams
from tailserve.core.scheduler import Scheduler
from tailserve.core.source import QueueSource
from tailserve.llm.outputs import RequestOutput
from tailserve.llm.stop_checker import StopChecker, TextState


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int  # includes requests added but not yet seen by the scheduler
    num_swapped: int
    kv_cache_usage: float  # 0..1, fraction of KV blocks in use
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache (vLLM's counter)
    prefix_cache_hits: int  # of which were cached (on the GPU)
    num_preemptions: int
    num_prompt_tokens: int  # of requests that produced their first token
    num_generation_tokens: int
    # Wall seconds the torch executor spent at each CPU thread count since it started (it runs on
    # the cores other processes leave free, executors/pytorch/threads.py); empty for others.
    cpu_thread_seconds: tuple[tuple[int, float], ...] = ()
    cpu_threads: int = 0  # the count it steps with now (0: not a CPU torch executor)
    # A CPU offloading tier's (vLLM's connector counters; 0 without one): prompt tokens looked
    # up past the GPU hit, and those loaded from the tier
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0


class StepFailedError(RuntimeError):
    """One iteration raised; its requests were aborted (``request_ids``, reason ``reason``), their
    blocks freed and the engine checked consistent: stepping may go on."""

    def __init__(self, cause: BaseException, request_ids: list[str], reason: str) -> None:
        super().__init__(f"{reason} ({len(request_ids)} requests aborted)")
        self.cause = cause
        self.request_ids = request_ids
        self.reason = reason


class EngineFatalError(RuntimeError):
    """A failure after which the engine's state cannot be trusted; its owner must stop."""


class RequestRefusedError(RuntimeError):
    """The policy refused the request at arrival as an API server does (vLLM's
    ``max_num_queued_reqs`` / ``max_num_queued_tokens``: HTTP 503; TGI's backpressure: 429);
    nothing of it is kept. ``status``: the HTTP status the engine's server answers."""

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.status = status


def describe_error(error: BaseException) -> str:
    """``TypeName: message`` on one line, for logs and reasons."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class LLMEngine:
    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        tokenizer: Any,
        model_name: str,
        *,
        eos_token_ids: tuple[int, ...] = (),
        release: Any = None,
        options: EngineOptions = EngineOptions(fast_forward=False, keep_iteration_log=False),
        description: str = "",
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = scheduler.max_model_len
        self.description = description
        # The simulated deployment a stand-in server runs (model, hardware, tp, calibration,
        # policy), set by the builder for the sim executor; None for a real model.
        self.deployment: dict[str, Any] | None = None
        self.source = QueueSource()
        self.stop_checker = StopChecker(executor, eos_token_ids)
        self.engine = Engine(scheduler, self.stop_checker, self.source, WallClock(), options)
        self._release = release  # executor hook: forget a request's sampler state
        self._aborted: list[Request] = []
        self._ids: set[str] = set()
        self._prefix_queries = self._prefix_hits = 0
        self._external_queries = self._external_hits = 0  # a CPU offloading tier's (vLLM's connector)
        self._prompt_tokens = self._generation_tokens = 0
        # An API server's admission check (``Policy.refuses_at_arrival``), once a server asks for
        # it (``raise_refusals``): each request is handed to the scheduler as it is added, and a
        # refusal raised to the caller. Offline, a refused request ends as a finished output.
        self._refuses_at_arrival = False

    def raise_refusals(self) -> None:
        """Refuse at ``add_request`` what the policy refuses at arrival (``RequestRefusedError``),
        as the engine's API server answers it; the server calls this."""
        self._refuses_at_arrival = self.scheduler.policy.refuses_at_arrival()

    @classmethod
    def from_args(cls, model: str | None = None, **kwargs: Any) -> LLMEngine:
        """Build from a model directory and engine flags; see ``tailserve.llm.builder``."""
        from tailserve.llm.builder import build_llm_engine

        return build_llm_engine(model, **kwargs)

    # ---- requests in ------------------------------------------------------------------------
    @property
    def now(self) -> float:
        return self.engine.clock.now

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        tenant_id: str | None = None,
    ) -> None:
        """Queue a request; ValueError (nothing queued) for input the engine can never serve,
        ``RequestRefusedError`` for one the policy refuses at arrival (vLLM's admission limits).
        ``tenant_id`` is who sent it (fairness, per-tenant SLO classes)."""
        params = params or SamplingParams()
        if request_id in self._ids:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise ValueError("The prompt is empty; it must contain at least one token.")
        vocab = self.tokenizer.vocab_size
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"Token id {bad[0]!r} is out of vocabulary (the vocabulary has {vocab} tokens).")
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"stop_token_ids: token id {bad[0]} is out of vocabulary (the vocabulary has {vocab} tokens)."
            )
        max_len = self.max_model_len
        n = len(prompt_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len - n
        if n + max_tokens > max_len or max_tokens < 1:
            raise ValueError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{n + max(max_tokens, 1)} tokens ({n} in the messages, {max(max_tokens, 1)} in the completion). "
                "Please reduce the length of the messages or completion."
            )
        if params.min_tokens > max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {params.min_tokens}."
            )
        request = Request(
            request_id,
            n,
            max_tokens,
            self.now,
            priority=priority,
            tenant_id=tenant_id,
            prompt_token_ids=prompt_ids,
            sampling_params=params,
        )
        self.stop_checker.states[request_id] = TextState(self.tokenizer.detokenizer(), params)
        self.stop_checker.requests[request_id] = request
        self._ids.add(request_id)
        self.source.add(request)
        if self._refuses_at_arrival:
            self._hand_over(request)

    def _hand_over(self, request: Request) -> None:
        """Give the scheduler the request now, as vLLM's API server checks its admission limits
        before answering (``policies/vllm_admission.py``); if the policy refused it, forget it
        and raise ``RequestRefusedError`` with the policy's reason."""
        self.engine.add_arrivals(self.now)  # (every earlier request was handed over when added)
        if request.status is not RequestStatus.FINISHED_REJECTED:
            return
        self.source.forget_finished(request)
        self.scheduler.finished.remove(request)
        self.engine.num_requests_seen -= 1  # it never entered (check_integrity's count)
        self.stop_checker.states.pop(request.request_id)
        self.stop_checker.requests.pop(request.request_id)
        self._ids.discard(request.request_id)
        reason = request.status_reason or "the engine refused the request"
        raise RequestRefusedError(reason, self.scheduler.policy.refusal_status)

    def abort_request(self, request_id: str, reason: str = "aborted") -> None:
        """End a request wherever it is; its blocks are freed now, its output comes with the next
        ``step``. Unknown or finished ids are ignored (a client may disconnect late)."""
        request = self.source.remove_pending(request_id)
        if request is not None:  # never reached the scheduler
            request.status = RequestStatus.FINISHED_ABORTED
            request.status_reason = reason
            request.finish_time = self.now
        else:
            request = self.scheduler.abort_request(request_id, reason, self.now)
            if request is None:
                return
        self._aborted.append(request)

    # ---- the loop ---------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.has_unfinished or self.source.num_pending or self._aborted)

    def step(self) -> list[RequestOutput]:
        """One iteration; outputs of requests that got tokens or finished. Raises
        ``StepFailedError`` or ``EngineFatalError`` when the iteration fails (module docstring)."""
        if self.scheduler.has_unfinished or self.source.num_pending:
            self.scheduler.last_output = None  # set again by schedule(): tells the phase that failed
            try:
                self.engine.step()
            except Exception as error:
                self._contain(error)
        return self._collect()

    def _contain(self, error: Exception) -> None:
        """Abort the failed iteration's requests and raise ``StepFailedError``, or raise
        ``EngineFatalError`` when the state cannot be made consistent."""
        what = describe_error(error)
        out = self.scheduler.last_output
        if out is None:
            raise EngineFatalError(f"the scheduler failed: {what}") from error
        kv = self.scheduler.kv_cache
        if not kv.can_drop_cached:
            # A radix tree may hold slots the failed step never wrote.
            raise EngineFatalError(f"an iteration failed under a radix prefix cache: {what}") from error
        reason = f"the engine failed in this request's step ({type(error).__name__})"
        involved = [s.request for s in out.scheduled] + list(out.swapped_in) + list(out.swapped_out)
        request_ids = list(dict.fromkeys(r.request_id for r in involved if not r.is_finished))
        for request_id in request_ids:
            self.abort_request(request_id, reason)
        kv.drop_cached()  # no block of the failed step may be matched
        try:
            self.check_integrity()
        except Exception as broken:
            raise EngineFatalError(
                f"an iteration failed ({what}) and the engine is inconsistent: {describe_error(broken)}"
            ) from error
        raise StepFailedError(error, request_ids, reason) from error

    def _collect(self) -> list[RequestOutput]:
        finished = self.source.pop_finished() + self._aborted
        self._aborted = []
        self.scheduler.pop_finished()
        done = {r.request_id for r in finished}
        outputs: list[RequestOutput] = []
        for request_id, state in self.stop_checker.states.items():
            if state.pending and request_id not in done:
                outputs.append(self._output(self.stop_checker.requests[request_id], state, False))
        for request in finished:
            state = self.stop_checker.states.pop(request.request_id)
            self.stop_checker.requests.pop(request.request_id)
            self._ids.discard(request.request_id)
            if self._release is not None:
                self._release(request.request_id)
            outputs.append(self._output(request, state, True))
        return outputs

    def _output(self, request: Request, state: TextState, finished: bool) -> RequestOutput:
        if state.num_reported_tokens == 0 and state.pending:
            self._prefix_queries += request.prompt_len
            external = request.kv_load[2] if request.kv_load is not None else 0
            self._prefix_hits += request.num_cached_tokens - external
            if self.scheduler.kv_cache.host is not None:
                # vLLM's connector counters: the tokens past the GPU hit, and those loaded
                self._external_queries += request.prompt_len - request.num_cached_tokens + external
                self._external_hits += external
            self._prompt_tokens += request.prompt_len
        new_ids, state.pending = state.pending, []
        self._generation_tokens += len(new_ids)
        state.num_reported_tokens += len(new_ids)
        text = state.text
        if not finished and state.params.stop:
            # Hold back what could be the start of a stop string, so clients never see one.
            hold = max(len(s) for s in state.params.stop) - 1
            text = text[: max(len(text) - hold, state.num_reported_chars)]
        new_text = text[state.num_reported_chars :]
        state.num_reported_chars = len(text)
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids or [],
            new_token_ids=new_ids,
            new_text=new_text,
            token_ids=list(request.output_token_ids),
            text=text,
            finished=finished,
            finish_reason=request.finish_reason if finished else None,
            stop_reason=state.stop_reason if finished else None,
            status_reason=request.status_reason,
            num_cached_tokens=request.num_cached_tokens,
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.token_times[0] if request.token_times else None,
            finish_time=request.finish_time,
            token_times=list(request.token_times),
        )

    def stats(self) -> EngineStats:
        sched = self.scheduler
        threads = getattr(self.stop_checker.inner, "threads", None)  # the torch executor's controller
        return EngineStats(
            num_running=len(sched.running),
            # (vLLM counts requests loading KV as waiting: its kv_holding_waiting queue)
            num_waiting=len(sched.waiting) + len(sched.loading) + self.source.num_pending,
            num_swapped=len(sched.swapped),
            kv_cache_usage=sched.kv_cache.usage,
            prefix_cache_queries=self._prefix_queries,
            prefix_cache_hits=self._prefix_hits,
            external_prefix_cache_queries=self._external_queries,
            external_prefix_cache_hits=self._external_hits,
            num_preemptions=sched.num_preemptions,
            num_prompt_tokens=self._prompt_tokens,
            num_generation_tokens=self._generation_tokens,
            cpu_thread_seconds=tuple(sorted(threads.seconds_at().items())) if threads else (),
            cpu_threads=threads.threads if threads else 0,
        )

    def check_integrity(self) -> None:
        self.engine.check_integrity()
