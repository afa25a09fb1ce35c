"""GEMM times measured on the CUDA GPU at hand, per number format: ground truth for the cost
model's GEMM curves on a GPU it has only third-party tables for.

Each GEMM is ``x[M, K] @ W[N, K]^T`` as a linear layer runs it:

- ``bf16``: ``F.linear`` (cuBLAS), the kernel vLLM runs for unquantized weights;
- ``fp8``: ``torch._scaled_mm`` with one scale per tensor (cuBLASLt's FP8 GEMM), weights in
  ``float8_e4m3fn``, output bf16;
- ``fp8_row``: the same with one scale per token row and one per weight row (PyTorch's CUTLASS
  rowwise kernel on Hopper), the closest PyTorch has to vLLM's CUTLASS ``scaled_mm``;
- ``quant``: the dynamic per-tensor quantization of ``x`` that an FP8 layer runs before its
  GEMM (amax, scale, cast), per (M, K).

Timing: the GEMMs are captured in a CUDA graph over enough copies of the weights that they
exceed the L2 cache (a layer's weights are read cold: each layer has its own), one GEMM per copy,
so a replay is the kernels back to back with no launch gaps, as vLLM's CUDA-graph decode runs them;
time per GEMM = the median replay time (CUDA events) / copies. Inputs are random normal (never
zeros: they run faster).

Writes rows ``[format, M, N, K, seconds, copies]`` to ``--out`` (JSON) after every shape, so a
run stopped at its time budget keeps what it measured; ``--calibration gemm:FILE`` fits the cost
model's GEMM curves to it (``executors/simulated/gemm_table.py``). ``tailserve calibrate
--time-gemms FILE`` runs it; so does ``python3 scripts/gpu_gemm.py`` from a checkout, with no
install (a GPU machine without a package registry).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# Shapes on AISimulate's H200 grid (its vLLM GEMM tables), so the two measurements meet row by row
N_GRID = (1024, 2048, 4096, 7168, 8192, 12288, 16384, 24576)
K_GRID = (1024, 2048, 4096, 7168, 8192, 16384)
M_GRID = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# --dense: AISimulate's token counts up to 16,384, each step and the count one past it (a tile edge)
_EDGES = (*range(32, 129, 16), *range(160, 257, 32), *range(512, 4353, 256))
M_DENSE = (*range(1, 18), *(m + d for m in _EDGES for d in (0, 1)), 8192, 16384)
FORMATS = ("bf16", "fp8", "fp8_row")
COLD_BYTES = 256 * 2**20  # weights streamed per replay: > 4x the H200's 60 MB L2
MAX_COPIES = 128
FP8 = torch.float8_e4m3fn


def _graph_time(fn, copies: int, target_s: float = 0.004) -> float:
    """Median seconds per call of ``fn(i)`` for ``i < copies``, from CUDA-graph replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up outside the graph: cuBLAS picks and caches its kernel
        for i in range(min(copies, 3)):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    end.record()
    end.synchronize()
    first = start.elapsed_time(end) / 1000
    reps = max(3, min(50, int(target_s / max(first, 1e-7))))
    times = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del g
    return statistics.median(times) / copies


def _copies(weight_bytes: int) -> int:
    return max(1, min(MAX_COPIES, math.ceil(COLD_BYTES / weight_bytes)))


def measure_shape(n: int, k: int, formats: tuple[str, ...], ms: tuple[int, ...], rows: list) -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(n * 131 + k)
    w_bf16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) / math.sqrt(k)
              for _ in range(_copies(n * k * 2))]  # fmt: skip
    w_fp8 = None
    if any(f.startswith("fp8") for f in formats):
        w_fp8 = [torch.randn(n, k, device=dev, generator=gen).to(FP8) for _ in range(_copies(n * k))]
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
        for fmt in formats:
            if fmt == "bf16":
                t = _graph_time(lambda i, x=x, w=w_bf16: F.linear(x, w[i]), len(w_bf16))
                rows.append(["bf16", m, n, k, t, len(w_bf16)])
                continue
            assert w_fp8 is not None
            x8 = x.to(FP8)
            if fmt == "fp8":
                sa = torch.ones((), device=dev, dtype=torch.float32)
                sb = torch.ones((), device=dev, dtype=torch.float32)
            else:
                sa = torch.ones(m, 1, device=dev, dtype=torch.float32)
                sb = torch.ones(1, n, device=dev, dtype=torch.float32)
            try:
                t = _graph_time(
                    lambda i, a=x8, w=w_fp8, sa=sa, sb=sb: torch._scaled_mm(
                        a, w[i].t(), sa, sb, out_dtype=torch.bfloat16
                    ),
                    len(w_fp8),
                )
            # a shape the kernel refuses (in the warm-up, before capture): say so, keep going
            except Exception as e:
                print(f"  {fmt} {m}x{n}x{k}: {str(e).splitlines()[0][:120]}", flush=True)
                continue
            rows.append([fmt, m, n, k, t, len(w_fp8)])
    w_bf16 = w_fp8 = []
    torch.cuda.empty_cache()


def measure_quant(ks: tuple[int, ...], ms: tuple[int, ...], rows: list) -> None:
    """vLLM's dynamic per-tensor FP8 quantization of a layer's input, unfused: amax, scale, cast."""
    dev = torch.device("cuda")
    for k in ks:
        for m in ms:
            copies = max(1, min(MAX_COPIES, math.ceil(COLD_BYTES / (m * k * 2))))
            xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]

            def quant(i, xs=xs):
                scale = xs[i].abs().amax().float() / 448.0
                return (xs[i] / scale).to(FP8), scale

            rows.append(["quant", m, 0, k, _graph_time(quant, copies), copies])


def model_shapes(models: list[str], tps: list[int]) -> list[tuple[int, int]]:
    """(N, K) of each model's QKV, output, gate+up and down GEMMs on one TP shard."""
    from tailserve.executors.simulated.gemm import gemm_shapes
    from tailserve.executors.simulated.models import get_model

    found: set[tuple[int, int]] = set()
    for name in models:
        m = get_model(name)
        for tp in tps:
            q, kv = m.num_heads * m.dim_per_head / tp, m.kv_heads_per_shard(tp) * m.dim_per_head
            found |= {
                (int(n), int(k))
                for n, k in gemm_shapes(m.hidden_size, q, kv, m.intermediate_size / tp, m.gated_mlp)
            }
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_gemm.json", help="JSON results (default: %(default)s)")
    p.add_argument(
        "--budget-s", type=float, default=240.0, help="stop after this many seconds (default: %(default)s)"
    )
    p.add_argument("--formats", default=",".join(FORMATS), help="(default: %(default)s)")
    p.add_argument("--dense", action="store_true", help="AISimulate's 73 token counts up to 16,384, not 13")
    p.add_argument("--models", default="", help="instead of the grid: the dense layers' GEMM shapes of these "
                   "catalog models (comma list; needs tailserve importable: PYTHONPATH=src)")  # fmt: skip
    p.add_argument(
        "--tps", default="1,2,4,8", help="--models: their shards at these TP degrees (default: %(default)s)"
    )
    p.add_argument("--quick", action="store_true", help="three shapes and four token counts (a dry run)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "gpu_gemm: error: torch.cuda.is_available() is False — run this on a CUDA machine",
            file=sys.stderr,
        )
        return 2
    formats = tuple(f for f in args.formats.split(",") if f)
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        print(f"gpu_gemm: error: unknown format {bad[0]!r} (known: {', '.join(FORMATS)})", file=sys.stderr)
        return 2
    shapes = [(n, k) for n in N_GRID for k in K_GRID]
    if args.models:
        shapes = model_shapes(args.models.split(","), [int(t) for t in args.tps.split(",")])
    ms = M_DENSE if args.dense else M_GRID
    if args.quick:
        shapes, ms = [(4096, 4096), (1024, 7168), (24576, 16384)], (1, 64, 1024, 8192)
    # an order that spreads shapes, so a run cut at its budget still covers the grid's range
    shapes = shapes[::2] + shapes[1::2]
    props = torch.cuda.get_device_properties(0)
    out: dict = {
        "gpu": torch.cuda.get_device_name(0),
        "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "blas": str(torch.backends.cuda.preferred_blas_library()),
        "python": platform.python_version(),
        "method": f"CUDA graph over max(1, min({MAX_COPIES}, {COLD_BYTES >> 20} MiB / weight bytes)) weight copies, "
        "median replay / copies",
        "columns": ["format", "m", "n", "k", "seconds", "copies"],
        "models": args.models,
        "tps": args.tps if args.models else "",
        "rows": [],
    }
    print(f"{out['gpu']}: {out['sms']} SMs, torch {out['torch']}, CUDA {out['cuda']}", flush=True)
    rows = out["rows"]
    t0 = time.perf_counter()
    # the two ceilings, measured: a large bf16 GEMM and a device-to-device copy
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = _graph_time(lambda i, a=a: a @ a, 1, 0.05)
    out["bf16_8192_tflops"] = round(2 * 8192**3 / t / 1e12, 1)
    buf = torch.empty(2**30, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(buf)
    t = _graph_time(lambda i, d=dst, b=buf: d.copy_(b), 1, 0.05)
    out["copy_tb_s"] = round(2 * 2**30 / t / 1e12, 2)
    a = buf = dst = None
    print(
        f"ceilings: bf16 8192^3 {out['bf16_8192_tflops']} TFLOP/s, copy {out['copy_tb_s']} TB/s", flush=True
    )
    quant_ks = tuple(sorted({k for _, k in shapes}))
    measure_quant(quant_ks, ms, rows)
    done = 0
    for n, k in shapes:
        if time.perf_counter() - t0 > args.budget_s:
            print(f"budget {args.budget_s:.0f} s reached: {done} of {len(shapes)} shapes", flush=True)
            break
        measure_shape(n, k, formats, ms, rows)
        done += 1
        out["shapes_done"] = done
        out["wall_s"] = round(time.perf_counter() - t0, 1)
        Path(args.out).write_text(json.dumps(out) + "\n")
        last = {r[0]: r[4] for r in rows if r[1] == ms[-1] and (r[2], r[3]) == (n, k)}
        print(f"[{done}/{len(shapes)} {out['wall_s']:.0f} s] N={n} K={k}: M={ms[-1]} "
              + ", ".join(f"{f} {v * 1e6:.1f} us" for f, v in last.items()), flush=True)  # fmt: skip
    out["shapes_done"] = done
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).write_text(json.dumps(out) + "\n")
    print(f"wrote {args.out}: {len(rows)} rows in {out['wall_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
