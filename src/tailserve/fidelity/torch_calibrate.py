"""``tailserve calibrate --executor torch``: profile the real executor, fit the cost model to it.

1. The host's roofline, measured: the GEMM rate in the engine's dtype (best of a few 1,024^3
   matmuls) and the copy bandwidth (a 256 MiB buffer) become a ``cpu`` hardware entry (peak
   FLOP/s, bytes/s).
2. A grid of iterations through the real engine (``LLMEngine``, ``vllm`` policy, every request
   submitted at once so the engine never idles): prefill chunks of 16-512 tokens over 0-1,536
   tokens of context (one long prompt cut into chunks by ``max_num_batched_tokens``), decode
   batches of 1-64 requests at 16-1,024 tokens of context, and mixed batches (chunked prefills
   beside running decodes). Each shape is run ``repeats`` times; its cost is the median period
   (execute to next execute: the engine's own per-step work is part of real time).
3. A fit of the cost model's efficiencies to those points (``calibration.calibrate``: compute,
   memory, per-iteration overhead, per-token host cost, sharpness), written as a calibration file
   (``calibration_files``) that ``--calibration FILE`` loads anywhere.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tailserve.executors.simulated.calibration import CalibrationResult, MeasuredBatch, calibrate
from tailserve.executors.simulated.calibration_files import CalibrationFile
from tailserve.executors.simulated.cost_model import BatchShape, CostModel, Efficiency
from tailserve.executors.simulated.hardware import Hardware
from tailserve.executors.simulated.models import ModelSpec, load_hf_config
from tailserve.fidelity.recorder import IterationRecord, install

CPU_FIT_FIELDS = (
    "compute",
    "memory",
    "overhead",
    "per_token",
    "per_logit",
    "sharpness",
    "prefill_attention",
    "decode_attention",
)


@dataclass(frozen=True, slots=True)
class Scenario:
    """Requests submitted together to one fresh engine run."""

    label: str
    prompt_lens: tuple[int, ...]
    max_tokens: int
    policy_flags: tuple[tuple[str, int], ...]


def measure_host(cpu_clock: bool = False, dtype: str = "bfloat16") -> Hardware:
    """This CPU's GEMM rate in ``dtype`` (an engine's: ``auto`` as the engine resolves it; a CPU
    without AVX-512 runs bf16 matmuls ~50x slower than float32, so the dtype the engine computes
    in is the peak that matters) and copy bandwidth (at torch's current thread count; with
    ``cpu_clock``, per second of this thread's CPU time)."""
    import torch

    if dtype == "auto":
        from tailserve.assemble.pytorch import auto_dtype  # the engine's own rule

        dtype = auto_dtype(torch.device("cpu"))[0]
    n = 1024
    a = torch.randn(n, n).to(getattr(torch, dtype))
    b = torch.randn(n, n).to(getattr(torch, dtype))
    gemm = engine_linear(b) or (lambda x: torch.matmul(x, b))
    gemm(a)
    timer = time.thread_time if cpu_clock else time.perf_counter
    best = min(_timed(lambda: gemm(a), timer) for _ in range(5))
    flops = 2 * n**3 / best
    src = torch.ones(256 * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src), timer) for _ in range(5))
    bandwidth = 2 * src.numel() / best
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return Hardware(
        name="cpu",
        peak_flops=flops,
        memory_bandwidth=bandwidth,
        memory_gib=round(ram_gib, 1),
        interconnect_bandwidth=bandwidth,  # unused at TP 1
        pcie_bandwidth=bandwidth,  # a CPU swap is a copy within RAM
        vendor="cpu",
    )


def measure_host_at(dtype: str, threads: int | None) -> Hardware:
    """``measure_host`` with torch at ``threads`` intra-op threads (the engine's count; None: as
    it is), restored after."""
    import torch

    if threads is None or threads == torch.get_num_threads():
        return measure_host(dtype=dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return measure_host(dtype=dtype)
    finally:
        torch.set_num_threads(before)


def engine_linear(weight: Any) -> Callable[[Any], object] | None:
    """The matmul the engine's linear layers run for this weight's dtype, where it is not
    PyTorch's own: a bf16 weight prepacked for tailserve's AVX2 or dpbf16 kernel (or oneDNN).
    On an AVX2 CPU PyTorch's bf16 matmul runs ~30x slower than that kernel, so timing it would
    put the host's peak far below what the engine reaches."""
    import torch

    from tailserve.executors.pytorch.cpu_backend import PackedLinear, can_pack

    if not can_pack(weight.dtype, torch.device("cpu")):
        return None
    return PackedLinear(weight.t().contiguous())


def _timed(fn: Callable[[], object], timer: Callable[[], float]) -> float:
    t = timer()
    fn()
    return timer() - t


# The shortest context the grid fits: a 512-token prompt for its 512-token chunks, 8 to spare.
# Below it a chunk's prompt rounded down to 0 tokens ("The prompt is empty" from the engine).
GRID_MIN_CONTEXT = 520


def default_grid(max_len: int) -> list[Scenario]:
    """Prefill chunk x prior context, decode batch x context, mixed batches (~1 minute per
    repeat for the tiny model on two cores)."""
    if max_len < GRID_MIN_CONTEXT:
        raise ValueError(
            f"the model's {max_len}-token context is too short for the profiling grid (its 512-token "
            f"prefill chunks need {GRID_MIN_CONTEXT}); use a model with a longer max_position_embeddings"
        )
    grid = []
    for chunk in (16, 64, 128, 256, 512):
        prompt = min(max_len - 8, max(4 * chunk, 1024))
        prompt -= prompt % chunk
        grid.append(
            Scenario(
                f"prefill {chunk}-token chunks",
                (prompt,),
                1,
                (("max_num_batched_tokens", chunk), ("max_num_seqs", min(chunk, 256))),
            )
        )
    # Decode: batch x context; the prompts' prefill is the setup cost, so the biggest batches
    # stop at moderate contexts.
    for batch, ctx in (
        (1, 16), (1, 512), (1, 1536), (4, 16), (4, 512), (4, 1024), (16, 16), (16, 256), (16, 768),
        (32, 16), (32, 256), (64, 16), (64, 128), (64, 256),
    ):  # fmt: skip
        if ctx + 17 <= max_len:
            grid.append(
                Scenario(
                    f"decode {batch} x {ctx}",
                    (ctx,) * batch,
                    16,
                    (("max_num_batched_tokens", max(2048, batch * ctx)), ("max_num_seqs", 256)),
                )
            )
    for budget, n, prompt in ((128, 12, 200), (256, 24, 400), (512, 32, 300)):
        grid.append(
            Scenario(
                f"mixed: {n} x {prompt}-token prompts, budget {budget}",
                (prompt,) * n,
                24,
                (("max_num_batched_tokens", budget), ("max_num_seqs", min(budget, 64))),
            )
        )
    return grid


# A fixed reference: the median decode period of 4 requests at ~128 tokens of context. Measured
# beside the calibration and again around each fidelity run, its ratio says how much faster or
# slower the machine is at that moment (other processes' cache and memory traffic stretch even
# the CPU-time clock).
PROBE = Scenario(
    "probe: decode 4 x 128", (128,) * 4, 25, (("max_num_batched_tokens", 2048), ("max_num_seqs", 256))
)


def probe(model_dir: str | Path, dtype: str = "auto", cpu_clock: bool = False, seed: int = 0) -> float:
    """Seconds per step of ``PROBE``'s decode iterations (median)."""
    records = run_scenario(model_dir, PROBE, seed, dtype, cpu_clock)
    return statistics.median(r.period_s for r in records if r.period_s and not r.shape.prefill_pairs)


def run_scenario(
    model_dir: str | Path, scenario: Scenario, seed: int, dtype: str = "auto", cpu_clock: bool = False
) -> list[IterationRecord]:
    from tailserve.fidelity.replay import kv_gib_for
    from tailserve.llm import LLMEngine, SamplingParams

    tokens = sum(n + scenario.max_tokens for n in scenario.prompt_lens)
    engine = LLMEngine.from_args(
        str(model_dir),
        executor="torch",
        policy="vllm",
        policy_flags=dict(scenario.policy_flags),
        dtype=dtype,
        # Room for the scenario, not the executor's 2 GiB default (seconds to zero per run).
        kv_cache_memory_gib=kv_gib_for(model_dir, tokens, len(scenario.prompt_lens)),
    )
    recorder = install(engine, cpu_clock)
    rng = random.Random(seed)
    vocab = engine.tokenizer.vocab_size
    params = SamplingParams(max_tokens=scenario.max_tokens, ignore_eos=True, temperature=0.0)
    for i, n in enumerate(scenario.prompt_lens):
        engine.add_request(f"r{i}", [rng.randrange(3, vocab) for _ in range(n)], params)
    while engine.has_unfinished_requests():
        engine.step()
    return recorder.records


def profile(
    model_dir: str | Path,
    grid: list[Scenario],
    repeats: int = 2,
    progress: Callable[[str], None] | None = None,
    dtype: str = "auto",
    cpu_clock: bool = False,
    scatter: list[float] | None = None,
    probes: list[float] | None = None,
) -> list[MeasuredBatch]:
    """Median period per distinct batch shape over ``repeats`` runs of every scenario (the
    first run of the first scenario warms the process up and is dropped). ``scatter``, if
    given, receives each run's ``replay.period_scatter`` (the measurement's own noise);
    ``probes``, if given, ``probe`` before every repeat and after the last."""
    from tailserve.fidelity.replay import period_scatter

    run_scenario(
        model_dir, grid[0], seed=10_000, dtype=dtype, cpu_clock=cpu_clock
    )  # warm-up: kernels, allocator
    periods: dict[BatchShape, list[float]] = defaultdict(list)
    labels: dict[BatchShape, str] = {}
    for r in range(repeats):
        if probes is not None:
            probes.append(probe(model_dir, dtype, cpu_clock, seed=r))
        for k, scenario in enumerate(grid):
            records = run_scenario(model_dir, scenario, seed=r * 1000 + k, dtype=dtype, cpu_clock=cpu_clock)
            if scatter is not None and (x := period_scatter(records)) is not None:
                scatter.append(x)
            for rec in records:
                if rec.period_s is not None:
                    periods[rec.shape].append(rec.period_s)
                    labels.setdefault(rec.shape, scenario.label)
            if progress is not None:
                progress(scenario.label)
    if probes is not None:
        probes.append(probe(model_dir, dtype, cpu_clock, seed=repeats))
    return [
        MeasuredBatch(shape, statistics.median(ts), _label(shape, labels[shape]))
        for shape, ts in sorted(periods.items(), key=lambda kv: (kv[0].num_tokens, kv[0].decode_kv_tokens))
    ]


def _label(shape: BatchShape, scenario: str) -> str:
    kind = "prefill" if shape.prefill_pairs and not shape.decode_kv_tokens else "decode"
    if shape.prefill_pairs and shape.decode_kv_tokens:
        kind = "mixed"
    return f"{kind} {shape.num_tokens} tok, {shape.num_logits} logits, kv {shape.prefill_kv_tokens + shape.decode_kv_tokens}"


def fit_host(
    model: ModelSpec,
    hardware: Hardware,
    points: list[MeasuredBatch],
    fields: tuple[str, ...] = CPU_FIT_FIELDS,
    prior: float = 0.0,
) -> CalibrationResult:
    """Least squares, then again without the points more than 3 robust deviations off (an
    iteration another process preempted on a shared machine is not the engine's cost); the
    result predicts every point. ``prior``: ``calibration.calibrate``'s pull of each efficiency
    towards the start (for a dozen probes, which do not pin eight terms)."""
    start = Efficiency(compute=0.5, memory=0.5, overhead=1e-3, sharpness=2.0, tile_m=1)
    base = CostModel(model, hardware, 1, start)
    kept = list(points)
    fit = calibrate(base, kept, fields, prior=prior)
    for _ in range(3):
        cm = base.with_efficiency(fit.efficiency)
        r = np.array([cm.iteration_time(p.shape) / p.seconds - 1.0 for p in points])
        scale = 1.4826 * float(np.median(np.abs(r - np.median(r))))
        mask = np.abs(r - np.median(r)) <= max(3.0 * scale, 0.05)
        now = [p for p, k in zip(points, mask) if k]
        if len(now) == len(kept):
            break
        kept = now
        fit = calibrate(base.with_efficiency(fit.efficiency), kept, fields, prior=prior)
    cm = base.with_efficiency(fit.efficiency)
    predicted = tuple(cm.iteration_time(p.shape) for p in points)
    return CalibrationResult(fit.efficiency, tuple(points), predicted, fit.warnings)


def point_kind(shape: BatchShape) -> str:
    if shape.prefill_pairs and shape.decode_kv_tokens:
        return "mixed"
    return "prefill" if shape.prefill_pairs else "decode"


def error_table(fit: CalibrationResult) -> dict[str, dict[str, float]]:
    """Median and p90 |relative error| of the fitted model per kind of point."""
    errs: dict[str, list[float]] = defaultdict(list)
    for point, predicted in zip(fit.points, fit.predicted):
        e = abs(predicted / point.seconds - 1.0)
        errs[point_kind(point.shape)].append(e)
        errs["all"].append(e)
    return {
        k: {"n": len(v), "median": float(np.median(v)), "p90": float(np.percentile(v, 90))}
        for k, v in errs.items()
    }


def calibrate_torch(
    model_dir: str | Path,
    repeats: int = 2,
    progress: Callable[[str], None] | None = None,
    grid: list[Scenario] | None = None,
    cpu_clock: bool = False,
    dtype: str = "auto",
) -> tuple[CalibrationFile, CalibrationResult]:
    """``cpu_clock``: time everything in this thread's CPU time (``recorder.CpuClock``), for a
    machine other processes share; the fit then describes a dedicated core. ``dtype``: the
    engine's (``EngineArgs.dtype``), the one the calibration is for."""
    import torch

    model = load_hf_config(model_dir)
    hardware = measure_host(cpu_clock, dtype)
    scatter: list[float] = []
    probes: list[float] = []
    points = profile(
        model_dir,
        grid or default_grid(model.max_position_embeddings),
        repeats,
        progress,
        dtype=dtype,
        cpu_clock=cpu_clock,
        scatter=scatter,
        probes=probes,
    )
    fit = fit_host(model, hardware, points)
    load = os.getloadavg()[0]
    clock = "thread CPU time" if cpu_clock else "wall time"
    source = (
        f"tailserve calibrate --executor torch --dtype {dtype} on this host ({clock}, "
        f"{torch.get_num_threads()} torch thread(s)): {len(points)} batch shapes, median period of "
        f"{repeats} run(s) each; GEMM "
        f"{hardware.peak_flops / 1e9:.0f} GFLOP/s ({dtype} matmul), copy {hardware.memory_bandwidth / 1e9:.1f} GB/s; "
        f"load average {load:.2f} on {os.cpu_count()} CPUs"
    )
    if scatter:
        source += f"; step-to-step scatter {statistics.median(scatter):.1%} (median over runs)"
    probe_s = statistics.median(probes)
    source += f"; probe {probe_s * 1e3:.2f} ms ({min(probes) * 1e3:.2f}-{max(probes) * 1e3:.2f})"
    cal = CalibrationFile(hardware, fit.efficiency, model.name, 1, source, tuple(points), probe_s)
    return cal, fit
