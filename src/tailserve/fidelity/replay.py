"""The same requests, at the same arrival times, on the real executor and in the simulator.

``run_real`` drives an ``LLMEngine`` with the torch executor in real time (each request released
to the engine at its arrival time, greedy decoding, ``ignore_eos`` so every request runs to
``max_tokens``) and records every iteration's batch shape and step period. ``run_sim`` replays
the real run's requests — token ids, ``max_tokens`` and the arrival times the real engine
stamped — through the same policy configuration and KV cache size on the simulated executor.
``compare`` gives the per-iteration and request-metric errors of the simulator.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tailserve.assemble.scheduler import make_scheduler
from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.request import Request
from tailserve.core.source import ListSource, QueueSource
from tailserve.executors.simulated.cost_binding import bind_cost_model
from tailserve.executors.simulated.cost_model import BatchShape, CostModel
from tailserve.executors.simulated.driver import SimDriver
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.saved_shape import shape_from_saved
from tailserve.fidelity.recorder import IterationRecord, install
from tailserve.metrics.summary import summarize


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float  # seconds after the run starts


@dataclass
class EngineSetup:
    """What the simulator needs to schedule exactly like the real engine did."""

    policy: str
    policy_config: Any
    num_blocks: int
    block_size: int
    num_cpu_blocks: int
    max_model_len: int


@dataclass
class RunRecord:
    setup: EngineSetup
    requests: list[Request]
    iterations: list[IterationRecord]


def run_real(
    model_dir: str | Path,
    policy: str,
    planned: list[PlannedRequest],
    dtype: str = "auto",
    cpu_clock: bool = False,
    kv_cache_memory_gib: float | None = None,
) -> RunRecord:
    """``cpu_clock``: time is the engine thread's CPU time and idle waits are skipped
    (``recorder.CpuClock``), for a machine other processes share. ``kv_cache_memory_gib``: the
    KV cache (default: room for every planned request at once, ``kv_gib_for``; the executor's
    own 2 GiB default would take seconds to zero per run and change no decision here)."""
    from tailserve.llm import LLMEngine, SamplingParams

    if kv_cache_memory_gib is None:
        tokens = sum(len(p.prompt_token_ids) + p.max_tokens for p in planned)
        kv_cache_memory_gib = kv_gib_for(model_dir, tokens, len(planned))
    engine = LLMEngine.from_args(
        str(model_dir), executor="torch", policy=policy, dtype=dtype, kv_cache_memory_gib=kv_cache_memory_gib
    )
    recorder = install(engine, cpu_clock)
    sched = engine.scheduler
    kv = sched.kv_cache
    setup = EngineSetup(
        policy,
        copy.deepcopy(sched.policy.config),
        kv.num_blocks,
        kv.block_size,
        getattr(kv, "num_cpu_blocks", 0),
        sched.max_model_len,
    )
    # Every request is submitted up front with its true arrival time and held by a source that
    # releases it when due, so the engine knows when the next one comes (a policy waiting for a
    # batch, like static batching's max_wait, wakes for it) exactly as the simulator does.
    source = _TimedQueueSource()
    engine.source = engine.engine.source = source
    engine.engine.clock = _IdleMarkingClock(engine.engine.clock, recorder)
    start = engine.now
    requests: list[Request] = []
    for i in sorted(range(len(planned)), key=lambda i: planned[i].arrival_s):
        p = planned[i]
        params = SamplingParams(max_tokens=p.max_tokens, ignore_eos=True, temperature=0.0)
        engine.add_request(f"r{i}", list(p.prompt_token_ids), params)
        request = engine.stop_checker.requests[f"r{i}"]
        request.arrival_time = start + p.arrival_s
        requests.append(request)
    while engine.has_unfinished_requests():
        engine.step()
    return RunRecord(setup, requests, recorder.records)


def kv_gib_for(model_dir: str | Path, num_tokens: int, num_requests: int, block_size: int = 16) -> float:
    """A KV cache that holds ``num_tokens`` tokens of ``num_requests`` requests at once (each
    request's last block partly used), and at least one request of the model's full length (the
    engine's own rule), with a quarter more for the allocator's slack. Sized for float32 K/V
    (4 bytes a value): ``dtype`` auto is float32 on a CPU without AVX-512, and a cache that is
    allocated but not touched costs no memory."""
    from tailserve.executors.simulated.models import load_hf_config

    spec = load_hf_config(model_dir)
    tokens = max(num_tokens, spec.max_position_embeddings)
    blocks = -(-tokens // block_size) + num_requests
    per_token = spec.kv_bytes_per_token(1) * 4 // spec.dtype_bytes
    return 1.25 * blocks * block_size * per_token / 2**30


class _TimedQueueSource(QueueSource):
    """``LLMEngine``'s queue, releasing each request at its arrival time (added in that order)."""

    def pop_arrived(self, now: float) -> list[Request]:
        out = []
        while self._pending and self._pending[0].arrival_time <= now:
            out.append(self._pending.popleft())
        return out


class _IdleMarkingClock:
    """The engine's clock, telling the recorder when the engine waits (no period spans a wait)."""

    def __init__(self, inner, recorder) -> None:
        self.inner = inner
        self.recorder = recorder

    @property
    def now(self) -> float:
        return self.inner.now

    def advance(self, duration: float) -> None:
        self.inner.advance(duration)

    def wait_until(self, t: float) -> None:
        if t > self.inner.now:
            self.recorder.mark_idle()
        self.inner.wait_until(t)


def run_sim(cost_model: CostModel, setup: EngineSetup, real_requests: list[Request]) -> list[Request]:
    """The real run's requests, fresh, through the simulator with the real run's configuration."""
    from tailserve.policies.registry import get_policy_cls

    cls = get_policy_cls(setup.policy)
    policy = cls(copy.deepcopy(setup.policy_config))
    scheduler = make_scheduler(
        policy, setup.num_blocks, setup.block_size, setup.num_cpu_blocks, setup.max_model_len, True
    )
    fresh = [
        Request(
            r.request_id,
            r.prompt_len,
            r.max_tokens,
            r.arrival_time,
            prompt_token_ids=list(r.prompt_token_ids or []),
        )
        for r in real_requests
    ]
    bind_cost_model(policy, cost_model)  # (slo) the simulator's predictions are its times
    engine = Engine(
        scheduler, SimExecutor(cost_model, setup.block_size), ListSource(fresh), options=EngineOptions()
    )
    SimDriver(engine).run()
    return fresh


def iteration_errors(cost_model: CostModel, iterations: list[IterationRecord]) -> np.ndarray:
    """predicted / measured - 1 for every back-to-back real iteration."""
    timed = [r for r in iterations if r.period_s]
    return np.array([cost_model.iteration_time(r.shape) / r.period_s - 1.0 for r in timed])


def iteration_kind(shape: BatchShape) -> str:
    """prefill (chunks only), decode (single tokens only) or mixed (both in one iteration)."""
    if shape.prefill_pairs and shape.decode_kv_tokens:
        return "mixed"
    return "prefill" if shape.prefill_pairs else "decode"


def period_scatter(iterations: list[IterationRecord], reach: int = 3) -> float | None:
    """The measurement's own per-iteration noise: within each stretch of back-to-back decode
    iterations of one batch size (the work differs by a few KV tokens from step to step), the
    median |period / median of its ``reach`` neighbours each side - 1|. No cost model can match
    single iterations more closely than this. None when no stretch is long enough."""
    devs: list[float] = []
    stretch: list[float] = []

    def flush() -> None:
        t = np.array(stretch)
        for i in range(len(t)):
            near = np.delete(t[max(0, i - reach) : i + reach + 1], min(i, reach))
            if near.size >= reach + 1:
                devs.append(t[i] / np.median(near) - 1.0)
        stretch.clear()

    prev = None
    for r in iterations:
        shape = r.shape
        key = shape.num_tokens if (r.period_s and not shape.prefill_pairs) else None
        if key != prev or key is None:
            flush()
        if key is not None:
            stretch.append(r.period_s)  # type: ignore[arg-type]
        prev = key
    flush()
    return float(np.median(np.abs(devs))) if devs else None


def _error_summary(e: np.ndarray) -> dict[str, Any]:
    return {
        "n": int(e.size),
        "median_abs": float(np.median(np.abs(e))) if e.size else None,
        "p90_abs": float(np.percentile(np.abs(e), 90)) if e.size else None,
        "bias": float(np.median(e)) if e.size else None,
    }


METRICS = (
    ("TTFT p50", "ttft_s", "p50"),
    ("TTFT p99", "ttft_s", "p99"),
    ("TPOT p50", "tpot_s", "p50"),
    ("TPOT p99", "tpot_s", "p99"),
    ("E2E p50", "e2e_s", "p50"),
)


def compare(cost_model: CostModel, real: RunRecord, sim_requests: list[Request]) -> dict[str, Any]:
    a, b = summarize(real.requests), summarize(sim_requests)
    out: dict[str, Any] = {"real": {}, "sim": {}, "error": {}}
    for label, metric, stat in METRICS:
        r, s = a["metrics"][metric][stat], b["metrics"][metric][stat]
        out["real"][label], out["sim"][label] = r, s
        out["error"][label] = (s / r - 1.0) if r else None
    r, s = a["throughput"]["output_tokens_per_s"], b["throughput"]["output_tokens_per_s"]
    out["real"]["throughput"], out["sim"]["throughput"] = r, s
    out["error"]["throughput"] = (s / r - 1.0) if r else None
    e = iteration_errors(cost_model, real.iterations)
    out["iterations"] = _error_summary(e)
    out["iterations"]["scatter"] = period_scatter(real.iterations)
    kinds = np.array([iteration_kind(r.shape) for r in real.iterations if r.period_s])
    out["iterations_by_kind"] = {
        k: _error_summary(e[kinds == k]) for k in ("prefill", "decode", "mixed") if (kinds == k).any()
    }
    out["finished"] = {"real": a["num_finished"], "sim": b["num_finished"]}
    return out


# ---- recorded fixtures (tests) ---------------------------------------------------------------
def to_json(run: RunRecord) -> dict[str, Any]:
    import dataclasses

    return {
        "policy": run.setup.policy,
        "policy_config": dataclasses.asdict(run.setup.policy_config),
        "num_blocks": run.setup.num_blocks,
        "block_size": run.setup.block_size,
        "num_cpu_blocks": run.setup.num_cpu_blocks,
        "max_model_len": run.setup.max_model_len,
        "requests": [
            {
                "id": r.request_id,
                "prompt_token_ids": list(r.prompt_token_ids or []),
                "max_tokens": r.max_tokens,
                "arrival_s": r.arrival_time,
                "token_times": list(r.token_times),
                "finish_s": r.finish_time,
            }
            for r in run.requests
        ],
        "iterations": [
            {**dataclasses.asdict(it.shape), "period_s": it.period_s, "execute_s": it.execute_s}
            for it in run.iterations
        ],
    }


def from_json(body: dict[str, Any]) -> RunRecord:
    from tailserve.core.request import RequestStatus
    from tailserve.policies.registry import get_policy_cls

    cls = get_policy_cls(body["policy"])
    config = cls.config_cls(**body["policy_config"])
    setup = EngineSetup(
        body["policy"],
        config,
        body["num_blocks"],
        body["block_size"],
        body["num_cpu_blocks"],
        body["max_model_len"],
    )
    requests = []
    for r in body["requests"]:
        req = Request(r["id"], len(r["prompt_token_ids"]), r["max_tokens"], r["arrival_s"],
                      prompt_token_ids=list(r["prompt_token_ids"]))  # fmt: skip
        req.token_times = list(r["token_times"])
        req.num_output_tokens = len(req.token_times)
        req.first_scheduled_time = r["arrival_s"]
        req.finish_time = r["finish_s"]
        req.status = RequestStatus.FINISHED_LENGTH
        requests.append(req)
    iterations = [
        IterationRecord(shape_from_saved(it), 0.0, it["execute_s"], it["period_s"])
        for it in body["iterations"]
    ]
    return RunRecord(setup, requests, iterations)
