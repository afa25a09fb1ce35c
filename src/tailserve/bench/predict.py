"""``tailserve bench --predict``: run the benchmark's exact workload through the simulator first.

The same requests (prompt lengths, token ids for prefix caching, output lengths), the same send
times and the same client-side ``--max-concurrency`` go through ``tailserve.sim.run`` on a
simulated deployment; the simulated requests become ``RequestResult``s (send = arrival, tokens
at their simulated times) so ``compute_result`` gives the predicted metrics with exactly the
definitions of the measured ones. The simulation has no network, tokenization or HTTP time, so
a measured TTFT above the predicted one by a few milliseconds is the server's overhead.

Against ``tailserve serve --executor sim`` the prediction uses the server's own deployment (its
``/v1/models`` card carries it under ``tailserve``), except for the ``--predict-*`` flags the user
set; against any other server it says that it predicts a deployment it cannot check.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Any

import numpy as np

from tailserve.bench.client import RequestResult
from tailserve.bench.datasets import BenchRequest
from tailserve.bench.predict_spec import PredictSpec
from tailserve.core.engine import EngineOptions
from tailserve.core.request import Request, RequestStatus
from tailserve.core.source import ListSource, RequestSource
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.policies.registry import parse_policy_list
from tailserve.sim.run import run_policy
from tailserve.sim.run_file import RunResult
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec


def server_deployment(base_url: str) -> dict[str, Any] | None:
    """The ``tailserve`` field of the server's first ``/v1/models`` card (None for other servers
    or when it cannot be read: the prediction then warns instead)."""
    import httpx

    try:
        response = httpx.get(f"{base_url}/v1/models", timeout=30.0)
        response.raise_for_status()
        card = response.json()["data"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None
    info = card.get("tailserve") if isinstance(card, dict) else None
    return info if isinstance(info, dict) else None


def spec_for_server(given: dict[str, Any], server: dict[str, Any] | None) -> tuple[PredictSpec, list[str]]:
    """The deployment to predict and the warnings to print: the server's own simulated deployment
    with the ``--predict-*`` flags ``given`` (``PredictSpec`` field names) applied on top, each
    one whatever its value; against any other server, ``PredictSpec``'s defaults under them."""
    asked = PredictSpec(**given)
    if server is None or server.get("executor") != "sim":
        what = (
            f"a {server['executor']} executor"
            if server and server.get("executor")
            else "no simulated deployment"
        )
        return asked, [
            f"the server runs {what}: predicting {asked.label}, a deployment the measurement may not match"
        ]
    try:
        theirs = PredictSpec(
            str(server["model"]),
            str(server["hardware"]),
            int(server["tp"]),
            str(server.get("calibration", "auto")),
            str(server.get("policy", "vllm")),
        )
    except (KeyError, TypeError, ValueError):
        return asked, [f"the server's deployment {server!r} is unreadable: predicting {asked.label}"]
    spec = replace(theirs, **given)
    if spec != theirs:
        return spec, [f"predicting {spec.label}, not the server's own deployment ({theirs.label})"]
    return spec, []


class GatedSource:
    """Open-loop sends behind a client-side concurrency limit (``--max-concurrency``): a request
    goes out at its send time, or when a slot frees if all ``concurrency`` slots are busy then;
    its arrival time is when it really went out, as the client measures from that moment."""

    horizon: float | None = None  # not a cluster replica's (RequestSource.horizon)

    def __init__(self, requests: list[Request], concurrency: int) -> None:
        self._pending: deque[Request] = deque(sorted(requests, key=lambda r: r.arrival_time))
        self._released: deque[Request] = deque()
        self._in_flight = 0
        self.concurrency = concurrency

    def next_arrival_time(self) -> float | None:
        if self._released:
            return self._released[0].arrival_time
        if self._pending and self._in_flight < self.concurrency:
            return self._pending[0].arrival_time
        return None

    def pop_arrived(self, now: float) -> list[Request]:
        out = list(self._released)
        self._released.clear()
        while self._pending and self._in_flight < self.concurrency and self._pending[0].arrival_time <= now:
            out.append(self._pending.popleft())
            self._in_flight += 1
        return out

    def on_finish(self, request: Request, now: float) -> None:
        self._in_flight -= 1
        if self._pending and self._pending[0].arrival_time <= now:
            request = self._pending.popleft()
            request.arrival_time = now  # waited for this slot
            self._released.append(request)
            self._in_flight += 1

    @property
    def exhausted(self) -> bool:
        return not self._pending and not self._released


class _BenchWorkload(WorkloadBuilder):
    """A ``WorkloadBuilder`` whose requests are the benchmark's own."""

    def __init__(self, requests: list[BenchRequest], times: np.ndarray, concurrency: int | None) -> None:
        super().__init__(WorkloadSpec(name="random", num_requests=len(requests)))
        self._requests = requests
        self._times = times
        self._concurrency = concurrency

    @property
    def shares_prefixes(self) -> bool:
        return True  # prompts carry token ids: the prefix cache can see real sharing

    @property
    def min_max_model_len(self) -> int:
        return max(r.prompt_len + r.output_len for r in self._requests)

    def build(self, cost_model: CostModel) -> RequestSource:
        requests = [
            Request(
                f"bench-{i}",
                r.prompt_len,
                r.output_len,
                float(t),
                prompt_token_ids=list(r.prompt) if isinstance(r.prompt, list) else None,
                prefix_block_hashes=list(r.prefix_block_hashes) if r.prefix_block_hashes else None,
            )
            for i, (r, t) in enumerate(zip(self._requests, self._times))
        ]
        if self._concurrency:
            return GatedSource(requests, self._concurrency)
        return ListSource(requests)


def simulate(
    requests: list[BenchRequest],
    times: np.ndarray,
    spec: PredictSpec,
    max_concurrency: int | None,
    options: EngineOptions | None = None,
) -> tuple[list[RequestResult], float, RunResult]:
    """The simulated run as client-side results in request order, and its duration (seconds
    from the start until the last request finished). ``options``: the engine's (e.g.
    ``record_batches`` for ``explain``)."""
    specs = parse_policy_list(spec.policy)
    if len(specs) != 1:
        raise ValueError(f"--predict-policy takes one policy, got {spec.policy!r}")
    policy = specs[0]
    built = build_cost_model(Deployment(spec.model, spec.hardware, spec.tp, spec.calibration), policy.name)
    workload = _BenchWorkload(requests, times, max_concurrency)
    run = run_policy(built, policy, workload, options=options or EngineOptions())
    sent = {f"bench-{i}": float(t) for i, t in enumerate(times)}
    by_id = {r.request_id: r for r in run.requests}
    stream = run.stream  # the chunks the client times: a step's tokens, or the stream interval's
    results = []
    for i, bench in enumerate(requests):
        r = by_id[f"bench-{i}"]
        result = RequestResult(prompt_len=bench.prompt_len, start_time=r.arrival_time)
        result.client_queue_time = r.arrival_time - sent[r.request_id]
        if r.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED) and r.token_times:
            result.success = True
            result.output_tokens = len(r.token_times)
            result.ttft = r.token_times[0] - r.arrival_time
            result.itl = np.diff(stream.chunk_times(r.token_times)).tolist()
            result.latency = r.token_times[-1] - r.arrival_time
        else:
            result.error = r.status_reason or r.status.value
        results.append(result)
    duration = max((r.finish_time or 0.0) for r in run.requests)
    return results, duration, run


def predicted_notes(run: RunResult) -> list[str]:
    notes: list[str] = list(run.notes)
    config = run.config
    notes.append(
        f"simulated {config['model']} on {config['hardware']} x{config['tp']} under {run.label}: "
        f"{config['num_kv_blocks']} KV blocks of {config['block_size']} tokens"
    )
    return notes
