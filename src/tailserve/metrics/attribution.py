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
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
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
OTHER = "other"

TTFT_CAUSES = (
    QUEUED_PREFILL,
    KV_WAIT,
    DECODE_WAIT,
    BATCHED_PREFILL,
    BATCHED_DECODE,
    PREFILL,
    PREEMPTION,
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
        for k, e in enumerate(record.entries):
            items = [(rid, n) for rid, n in zip(e.request_ids, e.num_new_tokens) if n > 1]
            self.prefill.append(items)
            self.num_prefill.append(sum(n for _, n in items))
            self.num_decode.append(sum(1 for n in e.num_new_tokens if n == 1))
            self.num_tokens.append(sum(e.num_new_tokens))
            first = len(self.starts)
            for j, (s, d) in enumerate(zip(e.starts, e.durations)):
                self.starts.append(s)
                self.ends.append(s + d)
                self.entry_of.append(k)
                self.offset.append(j)
            if len(e.starts) == 1:
                for rid, n, c in zip(e.request_ids, e.num_new_tokens, e.num_context_tokens):
                    self.grants.setdefault(rid, {})[first] = (n, c)
                    self.first_grant.setdefault(rid, first)
                for rid in (*e.preempted, *e.swapped_out):
                    self.events.setdefault(rid, set()).add(first)
                for rid in e.swapped_in:
                    self.swapped_in.setdefault(rid, set()).add(first)
        # An iteration ends where the next begins when they touch: slices then telescope exactly.
        for i in range(len(self.starts) - 1):
            nxt = self.starts[i + 1]
            if abs(self.ends[i] - nxt) <= 1e-12 * max(1.0, abs(nxt)):
                self.ends[i] = nxt
        self.start_arr = np.asarray(self.starts, dtype=np.float64)
        self.end_arr = np.asarray(self.ends, dtype=np.float64)

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
        flat = self.flat
        first = flat.first_grant.get(request.request_id) if before_first else None
        j0 = bisect_left(flat.starts, t0)
        if first is not None and segments is None and j0 < first and flat.starts[first] <= t1:
            # Whole iterations between its arrival and its first run: the same rules, at once.
            self._walk(walk, parts, t0, flat.starts[j0], None)
            self._waiting(walk, parts, j0, first)
            self._walk(walk, parts, flat.starts[first], t1, None)
        else:
            self._walk(walk, parts, t0, t1, segments)
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


def default_tbt_threshold(requests: Sequence[Request]) -> float:
    """A gap is a stall above both the run's p99 inter-token gap and three times its median."""
    gaps = [np.diff(r.token_times) for r in requests if len(r.token_times) > 1]
    if not gaps:
        return math.inf
    pooled = np.concatenate(gaps)
    return float(max(np.percentile(pooled, 99), 3 * np.median(pooled)))


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
    explanation.summary = run_summary(explanation, attributor)
    return explanation


def explain_run(run: Any, tbt_threshold: float | None = None) -> RunExplanation:
    """``explain`` for a ``RunResult`` simulated with ``EngineOptions(record_batches=True)``."""
    if run.batches is None:
        raise ValueError(
            f"run {run.label!r} has no batch record: simulate with --explain, --report or --save-run "
            "(EngineOptions(record_batches=True))"
        )
    return explain(
        run.requests,
        run.batches,
        policy=run.config.get("policy", ""),
        policy_flags=run.config.get("policy_flags", {}),
        label=run.label,
        tbt_threshold=tbt_threshold,
    )


# ---- the run's summary in plain words -------------------------------------------------------
# What addresses each cause, in the flags of the engine that ran (``tailserve policies``).
_BUDGET_FLAG = {
    "vllm": "--max-num-batched-tokens",
    "vllm-v0": "--max-num-batched-tokens",
    "sarathi": "--chunk-size",
    "sglang": "--chunked-prefill-size",
    "tgi": "--max-batch-prefill-tokens",
}
_CHUNKING = (
    "chunked prefill bounds it to one chunk: `vllm --max-num-batched-tokens 512-2048` or "
    "`sarathi --chunk-size 512`"
)
_MORE_KV = "raise `--gpu-memory-utilization` or add GPUs (`--tp`) for more KV blocks"
_REMEDIES: dict[tuple[str, str], str] = {
    (QUEUED_PREFILL, "orca"): "Orca runs every prompt whole and first come, first served, so nothing "
    "overtakes a long prompt and Orca has no flag for it; " + _CHUNKING,
    (QUEUED_PREFILL, "static"): "static batching holds new requests until the batch in flight ends: "
    "continuous batching (`orca`, `vllm`) admits them every iteration",
    (QUEUED_PREFILL, "vllm"): "prompts are served FCFS within `--max-num-batched-tokens` per step: a "
    "larger budget prefills more of them per step (longer decode stalls), "
    "`--long-prefill-token-threshold` (e.g. 512-2048) caps a long prompt's chunk so a short one shares "
    "the step, and `--scheduling-policy priority` serves urgent requests first",
    (QUEUED_PREFILL, "vllm-v0"): "`--enable-chunked-prefill --max-num-batched-tokens 2048` with "
    "`--max-num-partial-prefills 2` and `--long-prefill-token-threshold` lets short prompts pass a long "
    "one, or `--scheduling-policy priority`",
    (QUEUED_PREFILL, "sarathi"): "Sarathi serves prompts FCFS within `--chunk-size`: a larger chunk "
    "finishes earlier prompts sooner (longer decode stalls); vLLM's `--long-prefill-token-threshold` "
    "lets short prompts share the budget",
    (QUEUED_PREFILL, "sglang"): "SGLang continues the chunked prompt first: a larger "
    "`--chunked-prefill-size` finishes it in fewer iterations, `--enable-priority-scheduling` lets "
    "urgent requests go first",
    (QUEUED_PREFILL, "tgi"): "TGI's router is strictly FIFO (no priorities): `--max-batch-prefill-tokens` "
    "sets how much prefill each forward carries; a larger value finishes long prompts sooner",
    (KV_WAIT, ""): _MORE_KV + ", or ask for fewer `max_tokens`",
    (KV_WAIT, "orca"): "Orca reserves prompt + max_tokens for every request at admission: "
    + _MORE_KV
    + ", lower `max_tokens`, or use paged allocation (`vllm`)",
    (KV_WAIT, "tgi"): "TGI reserves prompt + max_tokens for every request: "
    + _MORE_KV
    + " (`--max-batch-total-tokens` if set), or lower `max_new_tokens`",
    (KV_WAIT, "sglang"): _MORE_KV + " (`--mem-fraction-static` in SGLang), lower "
    "`--max-running-requests`, or lower `--schedule-conservativeness` below 1 to reserve less per "
    "running request (more retractions)",
    (KV_WAIT, "vllm-v0"): _MORE_KV + " or lower `--max-num-seqs`; requests swapped out with "
    "`--preemption-mode swap` block every new prompt until they return (the convoy): "
    "`--preemption-mode recompute` avoids it",
    (PREEMPTION, ""): _MORE_KV + ", or lower `--max-num-seqs` so fewer sequences compete for KV; "
    "each recompute redoes the whole sequence",
    (PREEMPTION, "vllm-v0"): _MORE_KV + ", lower `--max-num-seqs`, or `--preemption-mode swap "
    "--swap-space N` to move KV over PCIe instead of recomputing (watch for the swap convoy)",
    (PREEMPTION, "sglang"): "raise `--schedule-conservativeness` above 1 (reserve more KV per running "
    "request, fewer retractions), lower `--max-running-requests`, or " + _MORE_KV,
    (DECODE_WAIT, ""): "it waited for the iteration in flight when it arrived, or for a slot under "
    "`--max-num-seqs` (raise it if KV allows)",
    (DECODE_WAIT, "tgi"): "TGI holds new requests while the batch decodes until "
    "`--waiting-served-ratio` x running requests wait or `--max-waiting-tokens` steps passed "
    "(without prefill chunking): lower both, or check `--max-batch-size`",
    (DECODE_WAIT, "sglang"): "SGLang stops admitting at `--max-running-requests` or after an admission "
    "ran out of KV (until a request leaves): raise the cap, or " + _MORE_KV,
    (DECODE_WAIT, "static"): "a static batch runs to completion before anyone joins: lower "
    "`--max-wait` / `--batch-size`, or use continuous batching",
    (BATCHED_PREFILL, ""): "its prompt was computed in the same iterations as other prompts; "
    "{budget} caps the tokens one iteration carries: a smaller value puts fewer prompts together but "
    "leaves the rest for later iterations",
    (BATCHED_PREFILL, "vllm"): "other prompts' chunks took most of the steps it ran in: "
    "`--long-prefill-token-threshold` (e.g. 512-2048) caps each long prompt's chunk so shorter ones get "
    "more of `--max-num-batched-tokens`, or `--scheduling-policy priority` serves urgent requests first",
    (BATCHED_PREFILL, "orca"): "Orca admits every waiting prompt whole into the same iteration, so a "
    "short prompt pays for the long ones beside it; " + _CHUNKING,
    (BATCHED_PREFILL, "static"): "a static batch prefills its prompts together, padded to the longest: "
    "a smaller `--batch-size`, or continuous batching",
    (BATCHED_DECODE, ""): "continuous batching runs every running request's decode in the iteration "
    "that computes a new prompt; fewer concurrent sequences (`--max-num-seqs`) make those iterations "
    "cheaper, at the cost of throughput",
    (BATCHED_DECODE, "tgi"): "TGI runs new prompts in one forward with the running batch; a smaller "
    "`--max-batch-size` makes those forwards cheaper, at the cost of throughput",
    (BATCHED_DECODE, "sglang"): "with `--enable-mixed-chunk` decodes ride along with prefill chunks; "
    "turning it off or lowering `--max-running-requests` makes those iterations cheaper",
    (PREFILL, ""): "no scheduler setting shortens a prompt's own compute: more tensor parallelism "
    "(`--tp`), a faster GPU, or prefix caching for shared prompts (`--enable-prefix-caching` in "
    "vllm-v0; on by default in vllm, sglang and tgi); smaller chunks lengthen it slightly",
    (OTHER, ""): "the engine was idle while it waited: a batching timer (static `--max-wait`) or "
    "nothing schedulable",
}
_TBT_REMEDIES = {
    "orca": "Orca runs a new prompt whole in the decodes' iteration; " + _CHUNKING,
    "vllm": "lower `--max-num-batched-tokens` to 512-2048: it is the largest chunk one step carries",
    "vllm-v0": "vLLM V0 without chunking runs prompts in prefill-only steps while every decode waits: "
    "`--enable-chunked-prefill --max-num-batched-tokens 512-2048`",
    "sarathi": "lower `--chunk-size` (256-512): it bounds every iteration",
    "sglang": "SGLang runs prefill-only batches while decodes wait: lower `--chunked-prefill-size` "
    "(512-2048) and `--enable-mixed-chunk` so decodes ride along",
    "tgi": "lower `--max-batch-prefill-tokens` (512-2048), and keep prefill chunking on (without it a "
    "new batch is prefilled alone while the running batch waits)",
    "static": "static batching never mixes prompts into a running batch; the gap is its own batch's work",
}


def remedy(cause: str, policy: str) -> str:
    text = _REMEDIES.get((cause, policy)) or _REMEDIES.get((cause, ""), "")
    budget = _BUDGET_FLAG.get(policy, "the prefill budget")
    return text.replace("{budget}", f"`{budget}`")


def _ms(seconds: float) -> str:
    if seconds >= 10:
        return f"{seconds:,.0f} s"
    return f"{seconds * 1e3:,.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.1f} ms"


def _blockers(breakdowns: Sequence[Breakdown]) -> list[tuple[str, int, float, int]]:
    """(request id, prompt tokens, seconds charged, intervals it appears in), most time first."""
    total: dict[str, list[Any]] = {}
    for b in breakdowns:
        for blocker in b.blockers:
            row = total.setdefault(blocker.request_id, [blocker.prompt_len, 0.0, 0])
            row[1] += blocker.seconds
            row[2] += 1
    ranked = sorted(total.items(), key=lambda x: -x[1][1])
    return [(rid, row[0], row[1], row[2]) for rid, row in ranked]


def _blocker_words(ranked: list[tuple[str, int, float, int]]) -> str:
    shown = [f"{rid} ({n:,} tokens, {_ms(sec)} in all)" for rid, n, sec, _ in ranked[:3]]
    more = f" and {len(ranked) - 3} more" if len(ranked) > 3 else ""
    return ", ".join(shown) + more


def _cause_detail(cause: str, slow: Sequence[Breakdown], peak_kv: float) -> str:
    """What the slow requests' share of ``cause`` was made of, as a clause."""
    if cause in (QUEUED_PREFILL, BATCHED_PREFILL):
        return f"mostly the prefill of {_blocker_words(_blockers(slow))}"
    if cause == PREFILL:
        lens = sorted(b.prompt_len for b in slow)
        chunks = sum(b.num_prefill_chunks for b in slow) / len(slow)
        span = (
            f"{lens[0]:,}"
            if lens[0] == lens[-1]
            else f"{lens[0]:,}-{lens[-1]:,} (median {lens[len(lens) // 2]:,})"
        )
        return f"prompts of {span} tokens, {chunks:.1f} prefill iteration(s) each"
    if cause == KV_WAIT:
        return f"KV usage peaked at {peak_kv:.0%} of the cache"
    if cause == PREEMPTION:
        return f"{sum(b.num_preemptions for b in slow)} preemption(s) among them"
    return ""


def _ttft_words(x: RunExplanation, peak_kv: float) -> str:
    slow = x.ttft[: len(x.slow_ids)]
    total = sum(b.seconds for b in slow)
    totals = {c: sum(b.components[c] for b in slow) for c in TTFT_CAUSES}
    ranked = sorted(totals, key=lambda c: -totals[c])
    # The dominant cause, and the next one too when it holds a fifth of the time.
    causes = [c for i, c in enumerate(ranked[:2]) if i == 0 or (total > 0 and totals[c] / total >= 0.2)]
    who = slow[0].request_id if len(slow) == 1 else f"{len(slow)} requests"
    span = _ms(slow[0].seconds) if len(slow) == 1 else f"{_ms(slow[-1].seconds)}-{_ms(slow[0].seconds)}"
    shares = " and ".join(
        f"{totals[c] / total if total > 0 else 0.0:.0%} was {CAUSE_TEXT[c]}" for c in causes
    )
    text = (
        f"The slowest 1% of requests by TTFT ({who} of {len(x.ttft)}, TTFT {span}): of that time, {shares}."
    )
    engine = x.policy or "this engine"
    shown: set[str] = set()
    for c in causes:
        detail = _cause_detail(c, slow, peak_kv)
        if detail in shown:
            detail = "the same requests"  # queued behind and batched with share one blocker list
        shown.add(detail)
        text += f" {CAUSE_TEXT[c][0].upper()}{CAUSE_TEXT[c][1:]}: " + (f"{detail}; " if detail else "")
        text += f"what addresses it ({engine}): {remedy(c, x.policy)}."
    return text + _longest_wait(x, causes)


def _longest_wait(x: RunExplanation, covered: list[str]) -> str:
    """The request that waited longest for anything but its own compute, when that is not the
    slowest requests' story already: short requests behind long ones hide below p99 TTFT."""
    b = max(x.ttft, key=lambda b: b.seconds - b.components[PREFILL])
    wait = b.seconds - b.components[PREFILL]
    if b.request_id in x.slow_ids or wait < 0.5 * b.seconds:
        return ""
    cause = max((c for c in TTFT_CAUSES if c != PREFILL), key=lambda c: b.components[c])
    text = (
        f" The longest wait: {b.request_id} ({b.prompt_len:,} tokens) waited {_ms(wait)} of its "
        f"{_ms(b.seconds)} TTFT, mostly {CAUSE_TEXT[cause]}"
    )
    if cause in (QUEUED_PREFILL, BATCHED_PREFILL) and b.blockers:
        top = b.blockers[0]
        text += f" (the prefill of {top.request_id}, {top.prompt_len:,} tokens)"
    if cause not in covered:
        text += f"; what addresses it ({x.policy or 'this engine'}): {remedy(cause, x.policy)}"
    return text + "."


def _tbt_words(x: RunExplanation, median_gap: float) -> str:
    if not x.stalls:
        return f"No inter-token gap exceeded {_ms(x.tbt_threshold)}."
    totals = {c: sum(b.components[c] for b in x.stalls) for c in TBT_CAUSES}
    cause = max(totals, key=lambda c: totals[c])
    requests = {b.request_id for b in x.stalls}
    text = (
        f"{len(x.stalls)} inter-token gap(s) of {len(requests)} request(s) exceeded "
        f"{_ms(x.tbt_threshold)} (median gap {_ms(median_gap)}); the longest was {_ms(x.stalls[0].seconds)}."
    )
    if cause in (QUEUED_PREFILL, BATCHED_PREFILL):
        rid, n, _, _ = _blockers(x.stalls)[0]
        hit = [b for b in x.stalls if any(bl.request_id == rid for bl in b.blockers)]
        victims = len({b.request_id for b in hit})
        mean = sum(b.seconds for b in hit) / len(hit)
        text += (
            f" The prefill of {rid} ({n:,} tokens) stalled {victims} decoding request(s) for "
            f"{_ms(mean)} each. What addresses it: {_TBT_REMEDIES.get(x.policy, _CHUNKING)}."
        )
    elif cause == PREEMPTION:
        text += f" Most of the stall time was {CAUSE_TEXT[PREEMPTION]}: {remedy(PREEMPTION, x.policy)}."
    else:
        text += f" Most of the stall time was {CAUSE_TEXT[cause]}."
    return text


def run_summary(x: RunExplanation, attributor: Attributor) -> str:
    """The paragraph: which cause dominates the p99 TTFT and the TBT stalls, and what to set."""
    if not x.ttft:
        return "No request finished: nothing to explain."
    rec = attributor.record
    peak = max((u for e in rec.entries for u in e.num_used_blocks), default=0) / max(rec.num_blocks, 1)
    gaps = [np.diff(r.token_times) for r in finished(list(attributor.requests.values()))]
    gaps = [g for g in gaps if g.size]
    median_gap = float(np.median(np.concatenate(gaps))) if gaps else 0.0
    return _overload_words(x) + _ttft_words(x, peak) + " " + _tbt_words(x, median_gap)


def _overload_words(x: RunExplanation) -> str:
    """A queue that grows through the run is overload, not scheduling: say so first."""
    by_arrival = sorted(x.ttft, key=lambda b: b.start)
    quarter = len(by_arrival) // 4
    if quarter < 5:
        return ""
    first = float(np.median([b.seconds for b in by_arrival[:quarter]]))
    last = float(np.median([b.seconds for b in by_arrival[-quarter:]]))
    span = float(
        np.median([b.start for b in by_arrival[-quarter:]])
        - np.median([b.start for b in by_arrival[:quarter]])
    )
    # A stable system's TTFT does not trend; an overloaded one's queue (and TTFT) grows by a
    # fixed fraction of every second of arrivals.
    if last < 1.0 or last - first < 0.25 * span:
        return ""
    return (
        f"TTFT grows through the run (median {_ms(first)} for the first quarter of arrivals, "
        f"{_ms(last)} for the last): requests arrive faster than this deployment serves them, and "
        "no scheduler setting fixes that — lower the rate, or add GPUs or replicas. "
    )
