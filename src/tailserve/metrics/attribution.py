"""Why each request was slow: its TTFT and its long inter-token gaps split into causes.

Works on a run's ``BatchRecord`` (``EngineOptions(record_batches=True)``) and its requests'
timestamps; ``docs/explain.md`` states the rules for users. An interval of one request (arrival
to first token, or one gap between two of its tokens) is cut at iteration boundaries into slices,
and each slice is charged by the first rule that applies:

1. No iteration running: ``other`` (the engine idle, e.g. a batching timer) — or ``preemption``
   inside a preemption window (rule 2).
2. From the start of the iteration that preempted (or swapped out) the request to the end of the
   iteration whose grant brings it back to the tokens it had computed: ``preemption``, whatever
   ran. In that last iteration only the recomputed tokens' share of its own part (rule 3) counts.
3. The request ran in the iteration: the time is split by token counts. Other requests' prefill
   tokens' share is ``batched_prefill`` (charged to those requests as blockers). Before the first
   token, other requests' decode tokens' share is ``batched_decode`` and its own tokens' share
   ``prefill``; after it, every decode token's share (its own and the others') is ``decode``.
4. It did not run, and the iteration started before it arrived: by what ran (rule 6).
5. It did not run, has never been admitted, and the engine had no KV room: ``kv_wait``. No room
   means the iteration preempted or swapped out someone, or requests sat in the CPU swap pool, or
   the head of the waiting queue needed more free blocks than were left after scheduling (its
   need by the policy's admission rule: the prompt, or prompt + ``max_tokens`` where the engine
   reserves the whole lifetime; plus the policy's watermark).
6. Otherwise by what ran: other requests' prefill (whole or chunks) made it wait —
   ``queued_prefill``, charged to them by their prefill tokens; only decodes ran —
   ``decode_wait`` before the first token (a cap or timer of the policy held it, or it arrived
   mid-iteration), ``other`` between tokens.

Slices telescope, so the parts sum to the measured interval up to float rounding.

Why this file is past the style guide's ~300 lines: one pass over the batch record assigns
every second of a request's TTFT and long gaps to exactly one cause; the causes share that pass's
state, and the plain-words summary (``explain_text.py``) already lives apart.
"""

from __future__ import annotations

import math
import operator
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tailserve.core.iteration_log import BatchEntry, BatchRecord
from tailserve.core.request import Request, RequestStatus

QUEUED_PREFILL = "queued_prefill"
KV_WAIT = "kv_wait"
DECODE_WAIT = "decode_wait"
BATCHED_PREFILL = "batched_prefill"
BATCHED_DECODE = "batched_decode"
PREFILL = "prefill"
DECODE = "decode"
PREEMPTION = "preemption"
KV_LOAD = "kv_load"
OTHER = "other"

TTFT_CAUSES = (
    QUEUED_PREFILL,
    KV_WAIT,
    DECODE_WAIT,
    BATCHED_PREFILL,
    BATCHED_DECODE,
    PREFILL,
    PREEMPTION,
    KV_LOAD,
    OTHER,
)
TBT_CAUSES = (DECODE, BATCHED_PREFILL, QUEUED_PREFILL, PREEMPTION, OTHER)
_WAITING = (KV_WAIT, QUEUED_PREFILL, DECODE_WAIT)  # causes of an iteration a new request sits out
CAUSE_TEXT = {
    QUEUED_PREFILL: "queued while other requests' prefill ran",
    KV_WAIT: "waiting for KV memory",
    DECODE_WAIT: "queued while only decodes ran",
    BATCHED_PREFILL: "sharing its iterations with other requests' prefill",
    BATCHED_DECODE: "sharing its prefill iterations with other requests' decodes",
    PREFILL: "its own prefill compute",
    DECODE: "decode compute",
    PREEMPTION: "lost to preemption and recompute",
    KV_LOAD: "loading its cached prefix from CPU memory",
    OTHER: "idle / other",
}

# Column headers for tables.
CAUSE_SHORT = {
    QUEUED_PREFILL: "queued behind prefill",
    KV_WAIT: "KV wait",
    DECODE_WAIT: "queued (decodes ran)",
    BATCHED_PREFILL: "batched with prefill",
    BATCHED_DECODE: "batched with decodes",
    PREFILL: "own prefill",
    DECODE: "decode",
    PREEMPTION: "preemption",
    KV_LOAD: "KV load",
    OTHER: "idle/other",
}


@dataclass(slots=True)
class Blocker:
    request_id: str
    prompt_len: int  # tokens
    seconds: float  # of the explained interval charged to this request's prefill


@dataclass(slots=True)
class Breakdown:
    """One interval of one request — its TTFT, or one inter-token gap — split into causes."""

    request_id: str
    prompt_len: int  # tokens
    start: float  # seconds: the arrival, or the earlier token
    end: float  # seconds: the first token, or the later token
    components: dict[str, float]  # cause -> seconds; each >= 0, together end - start
    blockers: list[Blocker] = field(default_factory=list)  # most time first
    num_prefill_chunks: int = 0  # iterations that computed new prompt tokens (TTFT)
    num_preemptions: int = 0  # preemptions and swap-outs inside the interval
    token_index: int = 0  # gaps: index of the later token (1 = the gap after the first token)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def dominant(self) -> str:
        return max(self.components, key=lambda c: self.components[c])

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prompt_len": self.prompt_len,
            "start_s": self.start,
            "end_s": self.end,
            "seconds": self.seconds,
            "token_index": self.token_index,
            "components_s": self.components,
            "dominant": self.dominant,
            "num_prefill_chunks": self.num_prefill_chunks,
            "num_preemptions": self.num_preemptions,
            "blockers": [
                {"request_id": b.request_id, "prompt_len": b.prompt_len, "seconds": b.seconds}
                for b in self.blockers
            ],
        }


class _Flat:
    """The record flattened to one row per iteration, with per-entry token counts."""

    def __init__(self, record: BatchRecord) -> None:
        self.record = record
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.entry_of: list[int] = []
        self.offset: list[int] = []  # iteration j of its entry
        self.prefill: list[list[tuple[str, int]]] = []  # per entry: (request id, tokens) with > 1
        self.num_prefill: list[int] = []  # per entry
        self.num_decode: list[int] = []  # per entry: grants of one token
        self.num_tokens: list[int] = []  # per entry
        # Single iterations, by request: iteration index -> (new tokens, context tokens).
        self.grants: dict[str, dict[int, tuple[int, int]]] = {}
        self.events: dict[str, set[int]] = {}  # request id -> iterations that preempted it
        self.swapped_in: dict[str, set[int]] = {}
        self.first_grant: dict[str, int] = {}  # request id -> the iteration that first ran it
        self._run_pos: dict[int, dict[str, int]] = {}  # decode runs, built when asked
        # One entry per stepped iteration and one per decode run: a run's iterations are
        # extended at once, a single iteration appended (this walk ran per iteration in Python:
        # 0.8 s of 2.6 s explaining 20,000 Azure requests, r48).
        starts, ends, entry_of, offset = self.starts, self.ends, self.entry_of, self.offset
        grants, first_grant = self.grants, self.first_grant
        for k, e in enumerate(record.entries):
            new_tokens = e.num_new_tokens
            items = [(rid, n) for rid, n in zip(e.request_ids, new_tokens) if n > 1]
            self.prefill.append(items)
            self.num_prefill.append(sum(n for _, n in items))
            self.num_decode.append(new_tokens.count(1))
            self.num_tokens.append(sum(new_tokens))
            first = len(starts)
            if len(e.starts) == 1:
                start = e.starts[0]
                starts.append(start)
                ends.append(start + e.durations[0])
                entry_of.append(k)
                offset.append(0)
                for rid, n, c in zip(e.request_ids, new_tokens, e.num_context_tokens):
                    grants.setdefault(rid, {})[first] = (n, c)
                    first_grant.setdefault(rid, first)
                for rid in (*e.preempted, *e.swapped_out):
                    self.events.setdefault(rid, set()).add(first)
                for rid in e.swapped_in:
                    self.swapped_in.setdefault(rid, set()).add(first)
            else:
                starts.extend(e.starts)
                ends.extend(map(operator.add, e.starts, e.durations))  # s + d, each
                entry_of.extend([k] * len(e.starts))
                offset.extend(range(len(e.starts)))
        # An iteration ends where the next begins when they touch: slices then telescope exactly.
        # Each end is compared with the next start only (no start changes), so numpy does the
        # whole walk at once with the same float operations.
        start_arr = np.asarray(starts, dtype=np.float64)
        end_arr = np.asarray(ends, dtype=np.float64)
        if len(starts) > 1:
            nxt = start_arr[1:]
            touch = np.abs(end_arr[:-1] - nxt) <= 1e-12 * np.maximum(1.0, np.abs(nxt))
            end_arr[:-1][touch] = nxt[touch]
            self.ends = end_arr.tolist()
        self.start_arr = start_arr
        self.end_arr = end_arr

    def grant(self, rid: str, i: int) -> tuple[int, int] | None:
        """(new tokens, context tokens) of request ``rid`` in iteration ``i``, or None."""
        k = self.entry_of[i]
        e = self.record.entries[k]
        if len(e.starts) == 1:
            return self.grants.get(rid, {}).get(i)
        pos = self._run_pos.get(k)
        if pos is None:
            pos = self._run_pos[k] = {r: p for p, r in enumerate(e.request_ids)}
        p = pos.get(rid)
        return None if p is None else (1, e.num_context_tokens[p] + self.offset[i])

    def slices(self, t0: float, t1: float) -> list[tuple[float, float, int | None]]:
        """(start, end, iteration or None when idle) covering [t0, t1] exactly, in order."""
        out: list[tuple[float, float, int | None]] = []
        i = max(bisect_right(self.starts, t0) - 1, 0)
        if i < len(self.starts) and self.ends[i] <= t0:
            i += 1
        t = t0
        while t < t1:
            if i < len(self.starts) and self.starts[i] < t1:
                s = self.starts[i]
                if s > t:
                    out.append((t, s, None))
                    t = s
                e = min(self.ends[i], t1)
                if e > t:
                    out.append((t, e, i))
                    t = e
                i += 1
            else:
                out.append((t, t1, None))
                t = t1
        return out


@dataclass(slots=True)
class _Walk:
    """Where one request stands while its interval is walked slice by slice."""

    request_id: str
    t0: float  # seconds: the interval's start
    before_first: bool  # TTFT (True) or an inter-token gap
    computed: int  # tokens it has in the KV cache
    admitted: bool = False  # has run at least once in the interval (or before it)
    window: bool = False  # inside a preemption window
    hwm: int = 0  # tokens it had when the window opened
    chunks: int = 0  # iterations that computed new prompt tokens
    preemptions: int = 0
    blame: dict[str, float] = field(default_factory=dict)  # blocker id -> seconds

    def __post_init__(self) -> None:
        self.admitted = not self.before_first  # a gap's request has run; a new one has not


class Attributor:
    """Splits requests' TTFT and inter-token gaps of one run (see the module docstring)."""

    def __init__(
        self,
        requests: Sequence[Request],
        record: BatchRecord,
        policy: str = "",
        policy_flags: dict[str, Any] | None = None,
    ) -> None:
        self.requests = {r.request_id: r for r in requests}
        self.record = record
        self.flat = _Flat(record)
        self.policy = policy
        self.flags = policy_flags or {}
        self._codes: np.ndarray | None = None

    # ---- KV room ------------------------------------------------------------------------
    def admission_blocks(self, request: Request, now: float) -> int:
        """KV blocks the policy needs free to admit ``request`` at ``now`` (its recorded outputs
        so far count when it was preempted after some)."""
        outputs = bisect_left(request.token_times, now)
        tokens = request.prompt_len + outputs
        left = request.max_tokens - outputs
        if self.policy in ("orca", "static"):
            tokens += left  # the whole lifetime is reserved at admission
        elif self.policy == "tgi":
            tokens += left - 1
        elif self.policy == "trtllm" and self.flags.get("capacity_scheduler_policy") != "MAX_UTILIZATION":
            tokens += left  # GUARANTEED_NO_EVICT / STATIC_BATCH reserve blocks to completion
        elif self.policy == "sglang":
            tokens += min(left, 4096) + 1  # reserved outputs (CLIP_MAX_NEW_TOKENS) and one page
        rec = self.record
        watermark = int(float(self.flags.get("watermark", 0.0)) * rec.num_blocks)
        return -(-tokens // rec.block_size) + watermark

    def _no_kv_room(self, i: int, e: BatchEntry) -> bool:
        if self.policy == "static":
            return False  # a static batch admits only between batches: the batch holds it, not KV
        if e.preempted or e.swapped_out or e.num_swapped:
            return True
        head = self.requests.get(e.waiting_head) if e.waiting_head is not None else None
        if head is None:
            return False
        free = self.record.num_blocks - e.num_used_blocks[self.flat.offset[i]]
        return self.admission_blocks(head, self.flat.starts[i]) > free

    # ---- one interval -------------------------------------------------------------------
    def _split(
        self,
        request: Request,
        t0: float,
        t1: float,
        before_first: bool,
        computed: int,
        segments: list[tuple[float, float, str]] | None = None,
    ) -> Breakdown:
        """The rules of the module docstring over [t0, t1]; ``segments`` (if given) receives
        (start, end, cause) in time order, a split slice drawn as its parts one after another."""
        walk = _Walk(request.request_id, t0, before_first, computed)
        parts = dict.fromkeys(TTFT_CAUSES if before_first else TBT_CAUSES, 0.0)
        load = request.kv_load if before_first else None
        if load is not None and t0 <= load[0] <= load[1] <= t1:
            # Admitted to load its prefix from a CPU tier (policies/vllm_offload.py): neither
            # waiting nor running until the load is in, whatever ran meanwhile.
            self._span(walk, parts, t0, load[0], segments)
            parts[KV_LOAD] += load[1] - load[0]
            if segments is not None and load[1] > load[0]:
                segments.append((load[0], load[1], KV_LOAD))
            self._span(walk, parts, load[1], t1, segments)
        else:
            self._span(walk, parts, t0, t1, segments)
        blockers = [
            Blocker(b, self.requests[b].prompt_len if b in self.requests else 0, sec)
            for b, sec in sorted(walk.blame.items(), key=lambda x: -x[1])
        ]
        return Breakdown(
            request.request_id,
            request.prompt_len,
            t0,
            t1,
            parts,
            blockers,
            walk.chunks,
            walk.preemptions,
        )

    def _span(
        self,
        walk: _Walk,
        parts: dict[str, float],
        t0: float,
        t1: float,
        segments: list[tuple[float, float, str]] | None,
    ) -> None:
        """[t0, t1] by the rules: whole iterations before a request's first run at once."""
        flat = self.flat
        first = flat.first_grant.get(walk.request_id) if walk.before_first else None
        j0 = bisect_left(flat.starts, t0)
        if first is not None and segments is None and j0 < first and flat.starts[first] <= t1:
            # Whole iterations between its arrival and its first run: the same rules, at once.
            self._walk(walk, parts, t0, flat.starts[j0], None)
            self._waiting(walk, parts, j0, first)
            self._walk(walk, parts, flat.starts[first], t1, None)
        else:
            self._walk(walk, parts, t0, t1, segments)

    def _walk(
        self,
        walk: _Walk,
        parts: dict[str, float],
        t0: float,
        t1: float,
        segments: list[tuple[float, float, str]] | None,
    ) -> None:
        for s, t, i in self.flat.slices(t0, t1):
            for cause, seconds in self._classify(walk, s, t, i):
                parts[cause] += seconds
                if segments is not None and seconds > 0:
                    if segments and segments[-1][2] == cause:
                        segments[-1] = (segments[-1][0], s + seconds, cause)
                    else:
                        segments.append((s, s + seconds, cause))
                    s += seconds

    def _waiting(self, walk: _Walk, parts: dict[str, float], j0: int, j1: int) -> None:
        """Iterations ``j0 .. j1 - 1`` (and the idle time up to ``j1``'s start) for a request that
        arrived before ``j0`` and first runs in ``j1``: rules 1, 5 and 6, vectorised."""
        flat = self.flat
        lengths = flat.end_arr[j0:j1] - flat.start_arr[j0:j1]
        idle = flat.start_arr[j0 + 1 : j1 + 1] - flat.end_arr[j0:j1]
        codes = self.waiting_codes()[j0:j1]
        sums = np.bincount(codes, weights=lengths, minlength=len(_WAITING))
        for code, cause in enumerate(_WAITING):
            parts[cause] += float(sums[code])
        parts[OTHER] += float(idle.sum())
        queued = _WAITING.index(QUEUED_PREFILL)
        for j in np.flatnonzero(codes == queued):
            k = flat.entry_of[j0 + j]
            self._charge(walk.blame, flat.prefill[k], walk.request_id, float(lengths[j]), flat.num_prefill[k])

    def waiting_codes(self) -> np.ndarray:
        """Per iteration, the cause (index into ``_WAITING``) for a request that arrived before it
        and has not run yet: rule 5 (no KV room), else rule 6."""
        if self._codes is None:
            flat = self.flat
            codes = np.empty(len(flat.starts), dtype=np.int64)
            for i, k in enumerate(flat.entry_of):
                if self._no_kv_room(i, self.record.entries[k]):
                    codes[i] = 0
                else:
                    codes[i] = 1 if flat.num_prefill[k] else 2
            self._codes = codes
        return self._codes

    def _classify(self, walk: _Walk, s: float, t: float, i: int | None) -> list[tuple[str, float]]:
        """(cause, seconds) pieces of the slice [s, t] in iteration ``i`` (None: idle)."""
        length = t - s
        if i is None:
            return [(PREEMPTION if walk.window else OTHER, length)]
        flat = self.flat
        rid = walk.request_id
        k = flat.entry_of[i]
        if i in flat.events.get(rid, ()):
            walk.preemptions += 1
            if not walk.window:
                walk.window, walk.hwm = True, walk.computed
        grant = flat.grant(rid, i)
        if grant is not None:
            n, ctx = grant
            walk.admitted = True
            walk.computed = ctx + n
            if walk.window and (ctx + n < walk.hwm or i in flat.swapped_in.get(rid, ())):
                walk.window = ctx + n < walk.hwm
                return [(PREEMPTION, length)]
            total = flat.num_tokens[k]
            others = flat.num_prefill[k] - (n if n > 1 else 0)
            shared = length * others / total if others else 0.0
            decodes = flat.num_decode[k] - (n == 1) if walk.before_first else 0
            riding = length * decodes / total if decodes else 0.0
            mine = length - shared - riding
            pieces = []
            if walk.window:  # the grant that catches up: the recomputed tokens' share is lost
                lost = mine * max(walk.hwm - ctx, 0) / n
                pieces.append((PREEMPTION, lost))
                mine -= lost
                walk.window = False
            if walk.before_first and ctx + n > max(ctx, walk.hwm):
                walk.chunks += 1
            pieces.append((PREFILL if walk.before_first else DECODE, mine))
            if shared:
                pieces.append((BATCHED_PREFILL, shared))
                self._charge(walk.blame, flat.prefill[k], rid, shared, others)
            if riding:
                pieces.append((BATCHED_DECODE, riding))
            return pieces
        if walk.window:
            return [(PREEMPTION, length)]
        if walk.before_first and not walk.admitted and flat.starts[i] >= walk.t0:
            cause = _WAITING[self.waiting_codes()[i]]
            if cause == QUEUED_PREFILL:
                self._charge(walk.blame, flat.prefill[k], rid, length, flat.num_prefill[k])
            return [(cause, length)]
        if flat.num_prefill[k]:
            self._charge(walk.blame, flat.prefill[k], rid, length, flat.num_prefill[k])
            return [(QUEUED_PREFILL, length)]
        return [(DECODE_WAIT if walk.before_first else OTHER, length)]

    @staticmethod
    def _charge(
        blame: dict[str, float], items: list[tuple[str, int]], rid: str, seconds: float, total: int
    ) -> None:
        for other, n in items:
            if other != rid:
                blame[other] = blame.get(other, 0.0) + seconds * n / total

    def ttft(self, request: Request) -> Breakdown:
        """Arrival to first token of a request that produced one."""
        return self._split(request, request.arrival_time, request.token_times[0], True, 0)

    def ttft_segments(self, request: Request) -> list[tuple[float, float, str]]:
        """(start, end, cause) from arrival to first token, in time order, for drawing."""
        segments: list[tuple[float, float, str]] = []
        self._split(request, request.arrival_time, request.token_times[0], True, 0, segments)
        return segments

    def gap(self, request: Request, k: int) -> Breakdown:
        """The gap before token ``k`` (k >= 1) of a decoding request."""
        times = request.token_times
        # When token k-1 was sampled, prompt + k-1 tokens were in the cache.
        b = self._split(request, times[k - 1], times[k], False, request.prompt_len + k - 1)
        b.token_index = k
        return b


# ---- a whole run ------------------------------------------------------------------------------
@dataclass
class RunExplanation:
    label: str
    policy: str
    ttft: list[Breakdown]  # every finished request, slowest first
    stalls: list[Breakdown]  # inter-token gaps above ``tbt_threshold``, longest first
    tbt_threshold: float  # seconds
    slow_ids: list[str]  # the slowest 1% by TTFT (at least one request)
    ttft_dominant: str | None  # the cause with most of their time
    summary: str  # the plain-words paragraph

    def to_json(self, top: int | None = None) -> dict[str, Any]:
        return {
            "label": self.label,
            "policy": self.policy,
            "summary": self.summary,
            "slowest_1pct": self.slow_ids,
            "ttft_dominant_cause": self.ttft_dominant,
            "tbt_threshold_s": self.tbt_threshold,
            "ttft": [b.to_json() for b in self.ttft[:top]],
            "tbt_stalls": [b.to_json() for b in self.stalls[:top]],
        }


def finished(requests: Sequence[Request]) -> list[Request]:
    ok = (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
    return [r for r in requests if r.status in ok and r.token_times]


def pooled_gaps(requests: Iterable[Any]) -> np.ndarray:
    """Every inter-token gap of the requests (anything with ``token_times``), in one array. The
    tokens one step yields together (accepted drafts) share a time: a gap is between steps, as
    vLLM's ITL counts one per streamed chunk, so their zeros are not gaps (a median of them
    would read 0 ms and take the 3 x median bound away)."""
    gaps = [np.diff(r.token_times) for r in requests if len(r.token_times) > 1]
    pooled = np.concatenate(gaps) if gaps else np.empty(0)
    return pooled[pooled > 0]


def stall_threshold(pooled: np.ndarray) -> float:
    """A gap is a stall above both the p99 of ``pooled`` and three times its median."""
    if not len(pooled):
        return math.inf
    return float(max(np.percentile(pooled, 99), 3 * np.median(pooled)))


def default_tbt_threshold(requests: Iterable[Any]) -> float:
    """A gap is a stall above both the run's p99 inter-token gap and three times its median."""
    return stall_threshold(pooled_gaps(requests))


def explain(
    requests: Sequence[Request],
    record: BatchRecord,
    *,
    policy: str = "",
    policy_flags: dict[str, Any] | None = None,
    label: str = "",
    tbt_threshold: float | None = None,  # seconds; None = ``default_tbt_threshold``
) -> RunExplanation:
    done = finished(requests)
    attributor = Attributor(requests, record, policy, policy_flags)
    ttft = sorted((attributor.ttft(r) for r in done), key=lambda b: -b.seconds)
    threshold = default_tbt_threshold(done) if tbt_threshold is None else tbt_threshold
    stalls = []
    for r in done:
        times = r.token_times
        for k in range(1, len(times)):
            if times[k] - times[k - 1] > threshold:
                stalls.append(attributor.gap(r, k))
    stalls.sort(key=lambda b: -b.seconds)
    slow = ttft[: max(1, math.ceil(len(ttft) / 100))] if ttft else []
    dominant = None
    if slow:
        totals = {c: sum(b.components[c] for b in slow) for c in TTFT_CAUSES}
        dominant = max(totals, key=lambda c: totals[c])
    explanation = RunExplanation(
        label, policy, ttft, stalls, threshold, [b.request_id for b in slow], dominant, ""
    )
    from tailserve.metrics.explain_text import run_summary  # it reads this module's types

    explanation.summary = run_summary(explanation, attributor)
    return explanation


def run_attributor(run: Any) -> Attributor:
    """The ``Attributor`` of a ``RunResult`` simulated with its batch record."""
    return Attributor(
        run.requests, run.batches, run.config.get("policy", ""), run.config.get("policy_flags", {})
    )


def explain_run(run: Any, tbt_threshold: float | None = None) -> RunExplanation:
    """``explain`` for a ``RunResult`` simulated with ``EngineOptions(record_batches=True)``."""
    if run.batches is None:
        raise ValueError(
            f"run {run.label!r} has no batch record: simulate with --explain, --report or --save-run "
            "(EngineOptions(record_batches=True))"
        )
    explanation = explain(
        run.requests,
        run.batches,
        policy=run.config.get("policy", ""),
        policy_flags=run.config.get("policy_flags", {}),
        label=run.label,
        tbt_threshold=tbt_threshold,
    )
    from tailserve.metrics.explain_text import (
        expert_load_words,
        fetch_wait_words,
        pipeline_words,
        stream_words,
    )  # they read this module's types

    explanation.summary += (
        stream_words(run.config, run.requests)
        + expert_load_words(run.config)
        + pipeline_words(run.config)
        + fetch_wait_words(run.config)
    )
    return explanation
