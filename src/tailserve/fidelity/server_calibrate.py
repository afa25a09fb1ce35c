"""``tailserve calibrate --from-server URL``: fit the cost model to a running engine from outside.

What a user has of an engine is its API and, for vLLM and SGLang, its Prometheus metrics. The
probes are requests of chosen shapes, each shape ``repeats`` times in rounds (the median kept):

- **prefill P**: one request at a time, a fresh prompt of P tokens, ``max_tokens`` 1: its TTFT
  is one prefill iteration of P tokens (P stays within the server's token budget, so the prompt
  is not chunked) plus, at the client, the network, HTTP and tokenizer time around it. Where the
  server publishes ``vllm:request_prefill_time_seconds`` (or a server-side TTFT) the change of its
  ``_sum`` over the request is the iteration without them, and that is the figure fitted.
- **decode B x L**: B streams at once, prompts of L - N/2 tokens, ``max_tokens`` N: after their
  prefills all B decode together, one token each per step, at ~L tokens of context in the middle.
  The step time is the median gap between chunks in the steady middle half of each stream
  (median over the streams; the first gaps may hold a late stream's prefill, the last a stream
  that finished first). At B = 1 the server's inter-token histogram (``_sum`` / ``_count`` over the
  request) gives the same step without the client.

- **prefill Q at context C**: a fresh prompt of C tokens (one token out), then the same C tokens
  followed by Q new ones: the server's prefix cache holds the first C (C is a multiple of 128
  tokens, so whole blocks at every common block size) and computes Q tokens over C of context,
  the shape of a chunked prefill's later chunks. Kept only where the server's
  ``vllm:prefix_cache_hits`` counter (or the response's ``cached_tokens``) says C tokens were
  served from the cache; a server without prefix caching gives no such point. Prompts from
  context 0 alone cannot tell the attention's cost from the linear layers' (both grow with the
  prompt), and the fit then charges a later chunk's attention wrongly.
- **mixed B x L + P**: B streams decoding at ~L tokens of context, then one request of P tokens
  sent beside them: its prefill shares a step with the B decodes (the server's prefill histogram
  times that step: the decodes' own figures arrive only when they finish, after it). Under load
  most steps are mixed; pure shapes alone leave their price to extrapolation.

The points are fitted as ``calibrate --executor torch`` fits its own (``torch_calibrate.fit_host``)
on a ``cpu`` hardware entry (``--hardware cpu``: this host's measured GEMM rate and copy
bandwidth, for a server on this machine), or on a catalog GPU's curves (compute, memory, per-step
and per-token overheads fitted), and written as a calibration file ``--calibration FILE`` loads.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from tailserve.executors.simulated.calibration import CalibrationResult, MeasuredBatch, calibrate
from tailserve.executors.simulated.calibration_files import CalibrationFile
from tailserve.executors.simulated.cost_model import BatchShape, CostModel
from tailserve.executors.simulated.hardware import Hardware
from tailserve.executors.simulated.models import ModelSpec
from tailserve.fidelity.server_metrics import CACHE_HITS, DECODE, PREFILL, HistogramTotals
from tailserve.fidelity.server_probe import ProbeError, Prompts, ServerProbe, StreamTiming

GPU_FIT_FIELDS = ("compute", "memory", "overhead", "per_token")
FEW_FIELDS = ("compute", "memory", "overhead")
MIN_POINTS_PER_FIELD = 1.5  # fewer points than that per fitted term: only compute, memory, overhead
# A CPU fit's pull towards its start (``calibration.calibrate``'s prior): a dozen probes do not pin
# eight terms, and unanchored the fit ran off (vLLM's CPU build at 4,960% of the host's peak
# FLOP/s with attention 220x its roofline; a memory efficiency of 2e17). Refitting the quiet
# closed-loop run's own probes with it (2026-12-03), vLLM's TTFT p50 error fell from +53% to +13%
# (median over 21 cells) at the same probe error; 0.03-0.1 gave the same.
CPU_PRIOR = 0.05
DEFAULT_BUDGET = 2048  # vLLM's API-server max_num_batched_tokens on CPUs and most GPUs
DEFAULT_DECODE_TOKENS = 32
# A mixed probe's decode streams: long enough to still run when the probe beside them ends.
MIXED_DECODE_TOKENS = 128
MIXED_WARM_CHUNKS = 4  # tokens every decode stream has before the probe is sent
# Repeats of one probe further apart than this (slowest - fastest over the median) are named
# after the fit: timed on a quiet 2-core VM, a small model's lone decode step moved by ~40%.
SPREAD_WARNING = 0.2
CONTEXT_ALIGN = 128  # cached contexts are multiples of it: whole blocks at 16, 32, 64 and 128


@dataclass(frozen=True, slots=True)
class ProbePlan:
    prefill_lens: tuple[int, ...]
    decode_shapes: tuple[tuple[int, int], ...]  # (batch, context tokens per request)
    decode_tokens: int = DEFAULT_DECODE_TOKENS
    repeats: int = 3
    context_prefills: tuple[tuple[int, int], ...] = ()  # (new tokens, cached context tokens)
    mixed: tuple[tuple[int, int, int], ...] = ()  # (decode batch, decode context, prefill tokens)
    mixed_decode_tokens: int = MIXED_DECODE_TOKENS  # each decode stream's length in a mixed probe

    def too_long(self, max_len: int) -> list[int]:
        """The probes' token counts that do not fit a ``max_len``-token context."""
        mixed_decodes = [c + self.mixed_decode_tokens for _, c, _ in self.mixed]
        return [
            n
            for n in (
                *self.prefill_lens,
                *(c + self.decode_tokens // 2 for _, c in self.decode_shapes),
                *(q + c for q, c in self.context_prefills),
                *mixed_decodes,
                *(p for _, _, p in self.mixed),
            )
            if n >= max_len
        ]

    def over_budget(self, budget: int) -> list[int]:
        """The steps' token counts above the server's budget (it would split them)."""
        steps = [q for q, _ in self.context_prefills] + [b + p for b, _, p in self.mixed]
        return [n for n in steps if n > budget]

    @property
    def num_probes(self) -> int:
        shapes = (
            len(self.prefill_lens) + len(self.decode_shapes) + len(self.context_prefills) + len(self.mixed)
        )
        return shapes * self.repeats


def default_plan(
    max_model_len: int, budget: int, repeats: int = 3, decode_tokens: int = DEFAULT_DECODE_TOKENS
) -> ProbePlan:
    """Prefills from 32 tokens up to the budget or the context, whichever is smaller; decode
    batches of 1-32 requests at short and long context."""
    top = min(budget, max_model_len - 1)
    prefill = tuple(p for p in (32, 128, 512, 1024, 2048, 4096, 8192) if p <= top)
    if top not in prefill and top > 32:
        prefill += (top,)
    longest = max_model_len - decode_tokens // 2 - 1
    shapes = []
    for batch, ctx in ((1, 128), (1, 1024), (4, 128), (4, 1024), (16, 128), (16, 512), (32, 256)):
        ctx = min(ctx, longest)
        if ctx > decode_tokens // 2 and (batch, ctx) not in shapes:
            shapes.append((batch, ctx))
    context = tuple(
        (q, c)
        for q, c in ((128, 512), (256, 1024), (512, 1024), (256, 1536))
        if q <= top and q + c < max_model_len
    )
    mixed = tuple(
        (b, ctx, p)
        for b, ctx, p in ((4, 256, 128), (8, 256, 512), (16, 512, 256))
        if b + p <= budget and p < max_model_len and ctx + MIXED_DECODE_TOKENS < max_model_len
    )
    return ProbePlan(prefill, tuple(shapes), decode_tokens, repeats, context, mixed)


def parse_prefill_lens(text: str) -> tuple[int, ...]:
    try:
        lens = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        lens = ()
    if not lens or min(lens) < 1:
        raise ValueError(f"--prefill {text!r}: expected prompt lengths in tokens, e.g. 128,512,2048")
    return lens


def parse_decode_shapes(text: str) -> tuple[tuple[int, int], ...]:
    shapes = []
    for item in text.split(","):
        batch, x, ctx = item.strip().partition("x")
        try:
            shapes.append((int(batch), int(ctx)))
        except ValueError:
            raise ValueError(f"--decode {text!r}: expected BATCHxCONTEXT items, e.g. 1x128,16x512") from None
        if not x or shapes[-1][0] < 1 or shapes[-1][1] < 1:
            raise ValueError(f"--decode {text!r}: expected BATCHxCONTEXT items with both >= 1")
    return tuple(shapes)


def parse_context_prefills(text: str) -> tuple[tuple[int, int], ...]:
    """``Q@C,...``: Q new tokens over C cached ones (C a multiple of 128)."""
    out = []
    for item in text.split(","):
        q, at, c = item.strip().partition("@")
        try:
            out.append((int(q), int(c)))
        except ValueError:
            raise ValueError(
                f"--context-prefill {text!r}: expected NEW@CONTEXT items, e.g. 256@1024"
            ) from None
        if not at or out[-1][0] < 1 or out[-1][1] < CONTEXT_ALIGN or out[-1][1] % CONTEXT_ALIGN:
            raise ValueError(
                f"--context-prefill {text!r}: NEW >= 1 and CONTEXT a positive multiple of {CONTEXT_ALIGN} "
                "(whole cache blocks at every common block size)"
            )
    return tuple(out)


def parse_mixed(text: str) -> tuple[tuple[int, int, int], ...]:
    """``BxL+P,...``: a prefill of P tokens beside B decodes at L tokens of context."""
    out = []
    for item in text.split(","):
        decode, plus, p = item.strip().partition("+")
        batch, x, ctx = decode.partition("x")
        try:
            out.append((int(batch), int(ctx), int(p)))
        except ValueError:
            raise ValueError(f"--mixed {text!r}: expected BxL+P items, e.g. 8x256+512") from None
        if not plus or not x or min(out[-1]) < 1:
            raise ValueError(f"--mixed {text!r}: expected BxL+P items with every number >= 1")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ProbedPoint:
    """One probed shape: the figure fitted and where it came from."""

    batch: BatchShape
    seconds: float  # fitted: server-side where the server's histograms gave it, else the client's
    client_s: float  # the client's own figure (TTFT, or the median gap), for comparison
    source: str  # the histogram the figure came from, or "client"
    label: str
    # The repeats' fitted figures, fastest and slowest: how far the machine moved while they ran
    # (a lone decode step of a small model, mostly host time, moved 2.8 -> 4.2 ms between two
    # calibrations 30 s apart on a quiet 2-core VM, docs/fidelity.md).
    low_s: float | None = None
    high_s: float | None = None

    @property
    def spread(self) -> float:
        """(slowest - fastest) repeat over the fitted median; 0 with one repeat."""
        if self.low_s is None or self.high_s is None or self.seconds <= 0:
            return 0.0
        return (self.high_s - self.low_s) / self.seconds

    def measured(self) -> MeasuredBatch:
        return MeasuredBatch(self.batch, self.seconds, f"{self.label} [{self.source}]")


def probe_server(
    probe: ServerProbe,
    prompts: Prompts,
    plan: ProbePlan,
    use_metrics: bool = True,
    progress: Callable[[str], None] | None = None,
) -> list[ProbedPoint]:
    """Every shape of the plan, ``repeats`` times, after a warm-up the fit never sees. The
    repeats run in rounds — every shape once, then every shape again — not back to back: the fit
    reads the shapes against each other, and a server's speed moves over tens of seconds (a small
    model's lone decode step read 2.8 and 4.2 ms in two calibrations 30 s apart), so each round
    times all shapes at about one speed and each median spans the whole calibration."""
    warm_up(probe, prompts, settle=use_metrics)
    jobs: list[tuple[str, Callable[[], _Run | None], Callable[[list[_Run]], ProbedPoint]]] = []
    for length in plan.prefill_lens:
        jobs.append(
            (
                f"prefill {length}",
                functools.partial(_prefill_once, probe, prompts, length, use_metrics),
                _summarize_prefill,
            )
        )
    for batch, ctx in plan.decode_shapes:
        jobs.append(
            (
                f"decode {batch} x {ctx}",
                functools.partial(_decode_once, probe, prompts, batch, ctx, plan.decode_tokens, use_metrics),
                functools.partial(_summarize_decode, batch=batch, tokens=plan.decode_tokens),
            )
        )
    for q, c in plan.context_prefills:
        jobs.append(
            (
                f"prefill {q} at {c}",
                functools.partial(_context_prefill_once, probe, prompts, q, c, use_metrics),
                _summarize_context_prefill,
            )
        )
    for batch, ctx, p in plan.mixed:
        jobs.append(
            (
                f"{p} beside {batch} x {ctx}",
                functools.partial(
                    _mixed_once, probe, prompts, batch, ctx, p, use_metrics, plan.mixed_decode_tokens
                ),
                functools.partial(_summarize_mixed, batch=batch),
            )
        )
    runs: list[list[_Run]] = [[] for _ in jobs]
    for _ in range(plan.repeats):
        for (label, once, _), done in zip(jobs, runs):
            run = once()
            if run is not None:  # a cached-context prefill the server did not serve from its cache
                done.append(run)
            if progress:
                progress(label)
    # none for a cached-context shape: the server cached nothing (no prefix caching, or no way to tell)
    return [summarize(done) for (_, _, summarize), done in zip(jobs, runs) if done]


WARM_UP_S = 1.5  # streaming the warm-up lasts at least this long (at most WARM_UP_STREAMS streams)
WARM_UP_STREAMS = 20


def warm_up(
    probe: ServerProbe,
    prompts: Prompts,
    clock: Callable[[], float] = time.perf_counter,
    settle: bool = False,
) -> None:
    """First-request costs (allocations, caches), then decode streams for ``WARM_UP_S``: a server
    that sizes its thread pool from the host's load (tailserve's CPU executor, revisiting it every
    0.5 s of stepping) has by then seen this client's start-up CPU pass, so the first probes do not
    run on the one thread it dropped to while the calibration's own process was importing.
    ``settle``: return once the server's histograms hold every warm-up request (a server may
    record a request's figures just after its last byte; the first probe's scrape before it
    would then count the warm-up's last request as its own and fall back to the client)."""
    before = probe.histograms() if settle else None
    probe.stream(prompts.make(64), 4)
    sent = 1
    start = clock()
    for _ in range(WARM_UP_STREAMS):
        if clock() - start >= WARM_UP_S:
            break
        probe.stream(prompts.make(64), 64)
        sent += 1
    _server_mean(probe, before, PREFILL, sent)


@dataclass(frozen=True, slots=True)
class _Run:
    timings: tuple[StreamTiming, ...]
    client_s: float
    server_s: float | None
    source: str
    # A cached-context prefill: the context served from the cache; a mixed probe: each decode's
    # context in its step.
    contexts: tuple[int, ...] = ()


def _prefill_once(probe: ServerProbe, prompts: Prompts, length: int, use_metrics: bool) -> _Run:
    before = probe.histograms() if use_metrics else None
    timing = probe.stream(prompts.make(length), 1)
    server_s, source, _ = _server_mean(probe, before, PREFILL, 1)
    return _Run((timing,), timing.ttft_s, server_s, source)


def _decode_once(
    probe: ServerProbe, prompts: Prompts, batch: int, ctx: int, tokens: int, use_metrics: bool
) -> _Run:
    prompt_len = max(1, ctx - tokens // 2)
    # One stream alone: the server's inter-token histogram holds exactly its steps.
    before = probe.histograms() if use_metrics and batch == 1 else None
    timings = tuple(probe.streams([prompts.make(prompt_len) for _ in range(batch)], tokens))
    server_s, source, _ = _server_mean(probe, before, DECODE, tokens - 1)
    client = statistics.median(_steady_step(t) for t in timings)
    return _Run(timings, client, server_s, source)


def _context_prefill_once(
    probe: ServerProbe, prompts: Prompts, q: int, c: int, use_metrics: bool
) -> _Run | None:
    """``c`` tokens sent once to fill the prefix cache, then again with ``q`` new ones; None when
    the server cannot be seen to have served the ``c`` from its cache."""
    base = prompts.make(c)
    seeded = probe.histograms()
    probe.stream(base, 1)
    # The seeding request's own figures may land just after its last byte: wait for them, so
    # the probe's scrape before and after holds the probe alone.
    before = _server_mean(probe, seeded, PREFILL, 1)[2] or probe.histograms()
    full = base + prompts.make(q) if isinstance(base, list) else f"{base} {prompts.make(q)}"
    timing = probe.stream(full, 1)
    server_s, source, after = _server_mean(probe, before if use_metrics else None, PREFILL, 1)
    hits = timing.cached_tokens
    if hits is None and before is not None:
        after = after or probe.histograms()
        moved = after.counter_delta(before, CACHE_HITS) if after is not None else None
        hits = None if moved is None else round(moved)
    if hits is None or hits < c - CONTEXT_ALIGN // 2:
        return None
    return _Run((timing,), timing.ttft_s, server_s, source, contexts=(hits,))


def _mixed_once(
    probe: ServerProbe,
    prompts: Prompts,
    batch: int,
    ctx: int,
    p: int,
    use_metrics: bool,
    decode_tokens: int = MIXED_DECODE_TOKENS,
) -> _Run:
    """A prefill of ``p`` tokens beside ``batch`` streams decoding at ~``ctx`` tokens."""
    decode_prompts = [prompts.make(ctx) for _ in range(batch)]
    t = probe.beside(
        decode_prompts,
        decode_tokens,
        prompts.make(p),
        MIXED_WARM_CHUNKS,
        before=probe.histograms if use_metrics else None,
        after=lambda before: _server_mean(probe, before, PREFILL, 1),
    )
    server_s, source, _ = t.after
    if any(n >= decode_tokens for n in t.chunks_at_end):
        server_s, source = None, "client"  # a decode finished in the window: its figures mixed in
    prompt = t.decodes[0].prompt_tokens if t.decodes else ctx
    # Each decode's context in the probe's step: its prompt and the tokens it had by then.
    contexts = tuple(prompt + n for n in t.chunks_at_send)
    return _Run((t.probe,), t.probe.ttft_s, server_s, source, contexts=contexts)


def _server_mean(
    probe: ServerProbe, before: HistogramTotals | None, names: tuple[str, ...], expected: int
) -> tuple[float | None, str, HistogramTotals | None]:
    """The mean of the ``expected`` observations the request added to the first histogram of
    ``names`` the server has, and the scrape it was read from; (None, "client", ...) when it has
    none or they did not all arrive within 2 s (a server records a request's figures as it
    finishes, sometimes just after the last byte). Polls every 50 ms: a scrape costs the server
    CPU, which an engine sharing the machine's cores feels."""
    if before is None or (name := before.first(names)) is None:
        return None, "client", None
    deadline = time.monotonic() + 2.0
    while True:
        after = probe.histograms()
        if after is None:
            return None, "client", None
        total, count = after.delta(before, name)
        if count == expected and total > 0:
            return total / count, name, after
        if count > expected or time.monotonic() > deadline:
            return None, "client", after  # other traffic, or figures that never came
        time.sleep(0.05)


def _steady_step(timing: StreamTiming) -> float:
    """The median gap of the middle half of a stream; where the server sent several tokens in a
    chunk (fewer chunks than tokens), the stream's mean time per token after the first."""
    gaps = timing.gaps_s
    if not gaps:
        raise ProbeError("a decode probe stream returned one chunk; probe with more --decode-tokens")
    if len(gaps) + 1 < timing.completion_tokens:
        return sum(gaps) / (timing.completion_tokens - 1)
    quarter = len(gaps) // 4
    return statistics.median(gaps[quarter : len(gaps) - quarter] or gaps)


def _summarize_prefill(runs: list[_Run]) -> ProbedPoint:
    length = round(statistics.median(r.timings[0].prompt_tokens for r in runs))
    seconds, source, client, low, high = _fitted_figure(runs)
    return ProbedPoint(
        BatchShape.of([(length, 0)], []), seconds, client, source, f"prefill {length}", low, high
    )


def _summarize_context_prefill(runs: list[_Run]) -> ProbedPoint:
    total = round(statistics.median(r.timings[0].prompt_tokens for r in runs))
    cached = round(statistics.median(r.contexts[0] for r in runs))
    q = total - cached
    seconds, source, client, low, high = _fitted_figure(runs)
    shape = BatchShape.of([(q, cached)], [])
    return ProbedPoint(shape, seconds, client, source, f"prefill {q} at {cached}", low, high)


def _summarize_mixed(runs: list[_Run], batch: int) -> ProbedPoint:
    p = round(statistics.median(r.timings[0].prompt_tokens for r in runs))
    ctx = round(statistics.median(c for r in runs for c in r.contexts))
    seconds, source, client, low, high = _fitted_figure(runs)
    shape = BatchShape.of([(p, 0)], [ctx] * batch)
    return ProbedPoint(shape, seconds, client, source, f"prefill {p} beside {batch} x {ctx}", low, high)


def _fitted_figure(runs: list[_Run]) -> tuple[float, str, float, float, float]:
    """(figure fitted, its source, the client's figure, the fastest and slowest repeat of the
    fitted kind): server-side only when every repeat had it (a mix would be a median of two
    different things)."""
    client = [r.client_s for r in runs]
    server = [r.server_s for r in runs if r.server_s is not None]
    if len(server) == len(runs):
        return statistics.median(server), runs[0].source, statistics.median(client), min(server), max(server)
    c = statistics.median(client)
    return c, "client", c, min(client), max(client)


def _summarize_decode(runs: list[_Run], batch: int, tokens: int) -> ProbedPoint:
    prompt = round(statistics.median(t.prompt_tokens for r in runs for t in r.timings))
    ctx = prompt + tokens // 2
    seconds, source, client, low, high = _fitted_figure(runs)
    shape = BatchShape.of([], [ctx] * batch)
    return ProbedPoint(shape, seconds, client, source, f"decode {batch} x {ctx}", low, high)


def fit_points(
    model: ModelSpec, hardware: Hardware, tp: int, points: list[MeasuredBatch]
) -> CalibrationResult:
    """A CPU as ``calibrate --executor torch`` fits one (every term, outliers dropped), each term
    pulled towards its start (``CPU_PRIOR``); a GPU from
    its catalog curves, scaled (compute, memory and the two overheads). A handful of probes
    cannot pin eight terms (the fit runs off to zero attention cost and infinite bandwidth):
    below 1.5 points a term, only compute, memory and the per-step overhead are fitted."""
    if hardware.vendor == "cpu":
        from tailserve.fidelity.torch_calibrate import CPU_FIT_FIELDS, fit_host

        many = len(points) >= MIN_POINTS_PER_FIELD * len(CPU_FIT_FIELDS)
        return fit_host(model, hardware, points, CPU_FIT_FIELDS if many else FEW_FIELDS, prior=CPU_PRIOR)
    many = len(points) >= MIN_POINTS_PER_FIELD * len(GPU_FIT_FIELDS)
    return calibrate(CostModel(model, hardware, tp), points, GPU_FIT_FIELDS if many else FEW_FIELDS)


def calibration_file(
    url: str,
    served: str,
    model: ModelSpec,
    hardware: Hardware,
    tp: int,
    plan: ProbePlan,
    points: list[ProbedPoint],
    fit: CalibrationResult,
    token_ids: bool,
    thread_seconds: dict[int, float] | None = None,
) -> CalibrationFile:
    """``thread_seconds``: a tailserve server's CPU executor's seconds at each thread count over
    the probes (its ``tailserve_cpu_thread_seconds``), said in the source line."""
    overhead = request_overhead(points)
    sources = sorted({p.source for p in points})
    load = os.getloadavg()[0]
    outside = (
        f"; {overhead * 1e3:.1f} ms per request outside the engine (client TTFT - server prefill)"
        if overhead is not None
        else ""
    )
    context = sum(
        1 for p in points if not p.batch.decode_kv_tokens and p.batch.prefill_kv_tokens > p.batch.num_tokens
    )
    skipped = (
        f"; {len(plan.context_prefills) - context} of {len(plan.context_prefills)} cached-context prefills "
        "dropped (the server did not report serving their context from its prefix cache)"
        if context < len(plan.context_prefills)
        else ""
    )
    source = (
        f"tailserve calibrate --from-server {url} (served model {served}): {len(plan.prefill_lens)} "
        f"prefill, {context} cached-context prefill, {len(plan.mixed)} mixed and "
        f"{len(plan.decode_shapes)} decode shapes, median of {plan.repeats} each{skipped}, "
        f"{plan.decode_tokens} tokens per decode stream; prompts as {'token ids' if token_ids else 'text'}; "
        f"times from {', '.join(sources)}{outside}; load average {load:.2f} on {os.cpu_count()} CPUs"
        f"{threads_note(thread_seconds)}"
    )
    measured = tuple(p.measured() for p in points)
    return CalibrationFile(
        hardware, fit.efficiency, model.name, tp, source, measured, request_overhead_s=overhead
    )


def threads_note(thread_seconds: dict[int, float] | None) -> str:
    """'; the server's CPU executor ran 2 threads 64% of the time, 1 thread 36%' (or '')."""
    total = sum((thread_seconds or {}).values())
    if not thread_seconds or total <= 0:
        return ""
    parts = [
        f"{n} thread{'s' if n != 1 else ''} {s / total:.0%}"
        for n, s in sorted(thread_seconds.items(), key=lambda item: -item[0])
    ]
    return f"; the server's CPU executor ran {', '.join(parts)} of the time"


def request_overhead(points: list[ProbedPoint]) -> float | None:
    """The median of the client's TTFT less the server's prefill time over the prefill probes
    the server timed itself: what a request spends outside the engine (None: none timed)."""
    gaps = [p.client_s - p.seconds for p in points if p.source in PREFILL and p.batch.decode_kv_tokens == 0]
    return max(statistics.median(gaps), 0.0) if gaps else None
