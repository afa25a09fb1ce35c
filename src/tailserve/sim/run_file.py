"""One simulated run's result (``RunResult``: requests with their timestamps, the iteration log,
the KV capacity) and its file (``simulate --save-run``, read back by ``load_run``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tailserve.core.finished_store import FinishedStore
from tailserve.core.iteration_log import BatchRecord, IterationLog
from tailserve.core.request import Request, RequestStatus
from tailserve.core.stream_interval import StreamInterval
from tailserve.executors.simulated.kv_capacity import KVCapacity
from tailserve.metrics.summary import Slo, prefix_cache_summary, summarize

# A rejection's kind, in a few words, from the reason its rejecter wrote (the scheduler's context
# and KV checks, then the policies' own refusals): summaries count each kind, where every
# rejection was once called "longer than max_model_len".
REJECTION_KINDS = (
    ("maximum context length", "longer than max_model_len"),  # Scheduler.add_request
    ("of KV cache but the cache holds", "too large for the KV cache"),  # Scheduler.add_request
    ("KV slots", "too large for the KV cache"),  # SGLang's admission
    ("should not exceed max_num_tokens", "prompt over max_num_tokens"),  # TensorRT-LLM unchunked
    ("max_concurrent_requests", "over max_concurrent_requests"),  # TGI's backpressure
    ("TTFT target", "TTFT target out of reach"),  # the slo policy
    ("max_num_queued_reqs=", "over max_num_queued_reqs"),  # vLLM's admission limits (503)
    ("max_num_queued_tokens=", "over max_num_queued_tokens"),
    ("max_queued_requests=", "over max_queued_requests"),  # SGLang's full waiting queue (503)
)


def rejection_kind(reason: str | None) -> str:
    for text, kind in REJECTION_KINDS:
        if reason is not None and text in reason:
            return kind
    return "other reason"


@dataclass
class RunResult:
    label: str
    config: dict[str, Any]
    requests: list[Request]
    log: IterationLog
    kv: KVCapacity
    wall_s: float  # seconds the simulation took on this machine
    notes: list[str] = field(default_factory=list)  # how this configuration is simulated
    prefix_stats: dict[str, Any] | None = None  # pool counters when prefix caching ran
    batches: BatchRecord | None = None  # with EngineOptions(record_batches=True)
    # With EngineOptions(stream_finished=True): the finished requests' numbers (``requests`` is
    # then empty); the summary reads them from here.
    finished: FinishedStore | None = None
    loop_cpu_s: float = 0.0  # CPU seconds of the simulation loop (not in the run file)

    @property
    def stream(self) -> StreamInterval:
        """How the engine's API server chunked streamed responses (the client's ITL)."""
        return StreamInterval.from_json(self.config.get("stream_interval"))

    def summary(self, slo: Slo | None = None) -> dict[str, Any]:
        source = self.finished if self.finished is not None else self.requests
        out = {"config": self.config, **summarize(source, slo, stream=self.stream)}
        out["num_iterations"] = len(self.log)
        if self.prefix_stats is not None:
            out["prefix_cache"] = {**prefix_cache_summary(source), **self.prefix_stats}
        return out

    def rejected_by_kind(self) -> dict[str, list[Request]]:
        """The rejected requests by ``rejection_kind``, most common first (empty when the run
        streamed its metrics and kept no requests)."""
        kinds: dict[str, list[Request]] = {}
        for r in self.requests:
            if r.status == RequestStatus.FINISHED_REJECTED:
                kinds.setdefault(rejection_kind(r.status_reason), []).append(r)
        return dict(sorted(kinds.items(), key=lambda item: -len(item[1])))

    def to_json(self) -> dict[str, Any]:
        """The whole run (``simulate --save-run``): requests with their timestamps, the iteration
        log and the batch record, so ``tailserve explain`` can work on it offline."""
        if self.finished is not None:
            raise ValueError(
                "a run with streamed metrics (--stream-metrics) keeps no requests: it cannot be "
                "saved (--save-run), explained or reported; run it without --stream-metrics"
            )
        return {
            "tailserve_run": 1,
            "label": self.label,
            "config": self.config,
            "notes": self.notes,
            "kv": asdict(self.kv),
            "wall_s": self.wall_s,
            "prefix_stats": self.prefix_stats,
            "summary": self.summary(),
            "requests": [_request_json(r) for r in self.requests],
            "iteration_log": {name: getattr(self.log, name) for name in IterationLog.FIELDS},
            "batches": self.batches.to_json() if self.batches is not None else None,
        }


_REQUEST_FIELDS = (
    "request_id", "prompt_len", "max_tokens", "arrival_time", "priority", "num_preemptions",
    "num_cached_tokens", "status_reason", "first_scheduled_time", "token_times", "finish_time",
)  # fmt: skip


def _request_json(r: Request) -> dict[str, Any]:
    return {**{name: getattr(r, name) for name in _REQUEST_FIELDS}, "status": r.status.value}


def load_run(path: str | Path) -> RunResult:
    """A run saved with ``RunResult.to_json``; ValueError naming what is wrong with the file."""
    try:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or data.get("tailserve_run") != 1:
            raise ValueError("not a run saved by tailserve simulate --save-run")
        requests = []
        for item in data["requests"]:
            r = Request(item["request_id"], item["prompt_len"], item["max_tokens"], item["arrival_time"])
            for name in _REQUEST_FIELDS[4:]:
                setattr(r, name, item[name])
            r.status = RequestStatus(item["status"])
            r.num_output_tokens = len(r.token_times)
            requests.append(r)
        log = IterationLog(data["kv"]["num_blocks"])
        for name in IterationLog.FIELDS:
            getattr(log, name).extend(data["iteration_log"][name])
        batches = BatchRecord.from_json(data["batches"]) if data.get("batches") else None
        return RunResult(
            data["label"],
            data["config"],
            requests,
            log,
            KVCapacity(**data["kv"]),
            data["wall_s"],
            data["notes"],
            data["prefix_stats"],
            batches,
        )
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    except KeyError as e:
        raise ValueError(
            f"{path}: no field {e} (expected a run saved by tailserve simulate --save-run)"
        ) from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
