"""tailserve's CPU kernels at this CPU's level against PyTorch's ops, side by side in one run.

- **Bandwidth**: a stream copy (``dst.copy_(src)``, 256 MiB, bytes read + written per second, as
  ``engine_cpu``'s roofline takes it) and a read (``src.sum()``), best of 5: what the percentages
  below are of.
- **Linear**: a pass over a set of weight matrices at 1-256 rows, the set cycled so its weights
  come from memory as in a forward pass: the tiny model's decode step (4 layers' qkv, o, gate_up
  and down and the LM head, two copies: 67 MB in bf16, twice the 32 MiB L3 here) and one
  Llama-3.2-1B-shaped layer (hidden 2,048, intermediate 8,192, 32 heads of 64, 8 KV heads:
  121 MB in bf16). ``tailserve``: bf16 weights through ``PackedLinear`` (the level's kernel: the
  AVX2 one at avx2, dpbf16 or oneDNN above, AMX at amx_bf16, where the dpbf16 kernel runs beside
  it on the same packing); ``oneDNN prepacked``: PyTorch's reordered bf16 matmul (at
  avx512_bf16 and amx_bf16; AMX where the CPU has it); ``F.linear f32``: PyTorch's float32 (MKL) on float32
  copies; ``F.linear bf16``: PyTorch's bf16 on the bf16 weights (its generic GEMM below AVX-512,
  slow: run at up to 16 rows there). Reported: ms per pass, GFLOP/s, GB/s of weights streamed (in
  each candidate's dtype) and that as % of the read bandwidth.
- **Decode attention**: a decode step's attention for 64 requests of 289 tokens (W's mean
  context) on the tiny model's heads (8 query, 4 KV, 64 dims), four layers' caches (76 MB in
  bf16) with blocks in order or shuffled: this level's kernel, the portable one, and PyTorch's
  path (context gathered, two matmuls); GB/s of K/V read and % of the read bandwidth.

- **Prefill attention**: one layer's, W's prefill batch on the tiny model's heads and mixed
  chunks on Llama-3-8B's: this level's kernel, and at amx_bf16 the dpbf16 one beside the AMX one.

Candidates alternate within each repetition and the median is reported, so a busy moment costs
every candidate alike. Before each row count (and each attention layout) the script waits until
the machine's other processes use under ``--quiet-threshold`` cores for 3 s (up to
``--quiet-timeout``), as ``engine_cpu`` does, and records how that went: two threads sharing
their cores with another process make every parallel region wait for a time slice, which
multiplies small-batch times several-fold.

    python -m benchmarks.engine_kernels [--reps 9] [--rows 1,4,8,16,64,256] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

importlib.import_module("tailserve.executors.pytorch")  # torch with tailserve's OpenMP settings

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks._common import cpu_line, forced_level, gated, load_averages, save_results  # noqa: E402
from benchmarks._roofline import measure_copy_bandwidth  # noqa: E402
from tailserve.executors.pytorch import attention, cpu_isa, cpu_kernels  # noqa: E402
from tailserve.executors.pytorch.cpu_backend import PackedLinear, can_pack, linear_path  # noqa: E402
from tailserve.executors.pytorch.init_model import PRESETS  # noqa: E402

BF16, CPU = torch.bfloat16, torch.device("cpu")


def load() -> str:
    return " ".join(load_averages())


def read_bandwidth(size_mib: int = 256, reps: int = 5) -> float:
    src = torch.ones(size_mib * 2**20 // 4)
    src.sum()
    best = min(_time(src.sum) for _ in range(reps))
    return src.numel() * 4 / best


def _time(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def interleaved(candidates: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds of each candidate, the candidates alternating within each repetition."""
    for fn in candidates.values():
        fn()  # warm up: first-touch pages, kernel dispatch
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(reps):
        for name, fn in candidates.items():
            times[name].append(_time(fn))
    return {name: statistics.median(ts) for name, ts in times.items()}


# ---- linear --------------------------------------------------------------------------------------
def tiny_shapes() -> list[tuple[int, int]]:
    p = PRESETS["tiny"]
    h, inter, heads = p["hidden_size"], p["intermediate_size"], p["num_attention_heads"]
    kv, d = p["num_key_value_heads"], h // heads
    layer = [((heads + 2 * kv) * d, h), (h, heads * d), (2 * inter, h), (h, inter)]
    one = layer * p["num_hidden_layers"] + [(p["vocab_size"], h)]
    return one * 2  # two copies: 67 MB of bf16, twice the L3


def llama_1b_layer() -> list[tuple[int, int]]:
    h, inter, heads, kv, d = 2048, 8192, 32, 8, 64
    return [((heads + 2 * kv) * d, h), (h, heads * d), (2 * inter, h), (h, inter)]


def bench_linear(
    name: str, shapes: list[tuple[int, int]], rows: list[int], args: argparse.Namespace, read_bw: float
) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    w32 = [torch.randn(n, k, generator=g) * 0.02 for n, k in shapes]
    w16 = [w.to(BF16) for w in w32]
    packed = [PackedLinear(w) for w in w16] if can_pack(BF16, CPU) else None
    # At level amx_bf16 the level below's kernel runs on the same packing, and oneDNN's
    # prepacked matmul (AMX too, on such a CPU) is the library's answer: both beside it.
    amx = packed is not None and all(p.kind == "amx" for p in packed)
    onednn = (
        [torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 64) for w in w16]
        if packed is not None and cpu_isa.detect().at_least("avx512_bf16")
        else None
    )
    params = sum(n * k for n, k in shapes)
    native_bf16 = cpu_isa.detect().at_least("avx512")
    out = []
    for m in rows:
        xs32 = {k: torch.randn(m, k, generator=g) for k in {k for _, k in shapes}}
        xs16 = {k: x.to(BF16) for k, x in xs32.items()}
        cands: dict[str, Callable[[], object]] = {}
        if packed is not None:
            cands["tailserve"] = lambda xs16=xs16: [p(xs16[p.in_features]) for p in packed]
        if amx:
            cands["dpbf16 kernel"] = lambda xs16=xs16: [
                p.kernel.linear_bf16(xs16[p.in_features], p.packed, None) for p in packed
            ]
        if onednn is not None:
            cands["oneDNN prepacked"] = lambda xs16=xs16: [
                torch.ops.mkldnn._linear_pointwise(xs16[w.shape[1]], o, None, "none", [], "")
                for w, o in zip(w16, onednn, strict=True)
            ]
        cands["F.linear f32"] = lambda xs32=xs32: [F.linear(xs32[w.shape[1]], w) for w in w32]
        if native_bf16 or m <= 16:
            cands["F.linear bf16"] = lambda xs16=xs16: [F.linear(xs16[w.shape[1]], w) for w in w16]
        quiet = gated(args.quiet_threshold, args.quiet_timeout)
        med = interleaved(cands, args.reps)
        for cand, t in med.items():
            wbytes = params * (4 if cand == "F.linear f32" else 2)
            row = {
                "set": name, "rows": m, "candidate": cand, "ms": t * 1e3, "gflop_s": 2 * m * params / t / 1e9,
                "weights_gb_s": wbytes / t / 1e9, "pct_read_bw": 100 * wbytes / t / read_bw, "quiet": quiet,
            }  # fmt: skip
            out.append(row)
        base = med["F.linear f32"]
        line = ", ".join(
            f"{c} {t * 1e3:.2f} ms ({base / t:.2f}x f32, {params * (4 if c == 'F.linear f32' else 2) / t / 1e9:.1f} GB/s)"
            for c, t in med.items()
        )
        print(f"  {name} {m:4d} rows: {line}", flush=True)
    return out


# ---- decode attention ----------------------------------------------------------------------------
def decode_case(seed: int, shuffle: bool, batch: int = 64, context: int = 289) -> tuple:
    g = torch.Generator().manual_seed(seed)
    bs, kv_heads, dim = 16, 4, 64
    per = -(-context // bs)
    blocks = batch * per
    kv = attention.PagedKVCache(1, blocks, bs, kv_heads, dim, BF16, CPU)
    k_slots, v_slots = kv.slots(0)
    k_slots[: blocks * bs] = torch.randn(blocks * bs, kv_heads, dim, generator=g).to(BF16)
    v_slots[: blocks * bs] = torch.randn(blocks * bs, kv_heads, dim, generator=g).to(BF16)
    order = torch.randperm(blocks, generator=g).tolist() if shuffle else list(range(blocks))
    tables = [order[i * per : (i + 1) * per] for i in range(batch)]
    meta = attention.build_metadata(tables, [1] * batch, [context - 1] * batch, batch, bs, kv.null_slot, CPU)
    q = torch.randn(batch, 8, dim, generator=g).to(BF16)
    return q, k_slots, v_slots, meta


def bench_decode(args: argparse.Namespace, read_bw: float) -> list[dict]:
    module = cpu_kernels.load()
    if module is None:
        print(f"  decode attention: no kernels here ({cpu_kernels.failure()})")
        return []
    own = cpu_kernels.decode_isa(module)
    out = []
    for shuffle in (False, True):
        cases = [decode_case(s, shuffle) for s in range(4)]  # four layers' caches
        nbytes = sum(
            2 * int(meta.decode_lengths.sum()) * k.shape[1] * k.shape[2] * 2 for _, k, _, meta in cases
        )

        def run(kernel: str, cases: list[tuple] = cases) -> Callable[[], object]:
            return lambda: [
                module.paged_decode_attention(q, k, v, meta.decode_slots, meta.decode_lengths, 0.125, kernel)
                for q, k, v, meta in cases
            ]

        def pytorch(cases: list[tuple] = cases) -> None:
            os.environ["TAILSERVE_CPU_KERNEL"] = "0"
            try:
                for q, k, v, meta in cases:
                    attention._decode_attention(q, k, v, meta)
            finally:
                os.environ.pop("TAILSERVE_CPU_KERNEL")

        cands = {f"{own} kernel": run(own)} if own != "portable" else {}
        cands |= {"portable kernel": run("portable"), "PyTorch path": pytorch}
        quiet = gated(args.quiet_threshold, args.quiet_timeout)
        med = interleaved(cands, args.reps)
        blocks = "shuffled blocks" if shuffle else "blocks in order"
        parts = []
        for cand, t in med.items():
            out.append({
                "blocks": blocks, "candidate": cand, "ms": t * 1e3, "kv_gb_s": nbytes / t / 1e9,
                "pct_read_bw": 100 * nbytes / t / read_bw, "quiet": quiet,
            })  # fmt: skip
            parts.append(
                f"{cand} {t * 1e3:.2f} ms ({nbytes / t / 1e9:.1f} GB/s, {100 * nbytes / t / read_bw:.0f}%)"
            )
        print(
            f"  decode attention, batch 64 x 289, {blocks}, 4 layers ({nbytes / 1e6:.0f} MB): "
            + ", ".join(parts)
        )
    return out


# ---- prefill attention ---------------------------------------------------------------------------
def prefill_case(
    seed: int, heads: int, kv_heads: int, dim: int, new: list[int], ctx: list[int], spare_blocks: int = 0
) -> tuple:
    """``paged_prefill_attention``'s arguments for chunks of ``new`` tokens after ``ctx`` cached
    ones, blocks shuffled (``spare_blocks`` more than they need, holding other keys), one layer.
    Also the tests' case (tests/test_amx_kernels.py)."""
    g = torch.Generator().manual_seed(seed)
    bs = 16
    need = [-(-(c + n) // bs) for c, n in zip(ctx, new, strict=True)]
    blocks = sum(need) + spare_blocks
    order, tables, at = torch.randperm(blocks, generator=g).tolist(), [], 0
    for n in need:
        tables.append(order[at : at + n])
        at += n
    meta = attention.build_metadata(tables, new, ctx, 0, bs, blocks * bs, CPU)
    kv = attention.PagedKVCache(1, blocks, bs, kv_heads, dim, BF16, CPU)
    k_slots, v_slots = kv.slots(0)
    k_slots[: blocks * bs] = torch.randn(blocks * bs, kv_heads, dim, generator=g).to(BF16)
    v_slots[: blocks * bs] = torch.randn(blocks * bs, kv_heads, dim, generator=g).to(BF16)
    q = torch.randn(sum(new), heads, dim, generator=g).to(BF16)
    pk = attention.prefill_kernel_inputs(meta)
    return q, k_slots, v_slots, pk.slots, pk.starts, pk.news, pk.contexts, dim**-0.5


def bench_prefill(args: argparse.Namespace) -> list[dict]:
    """One layer's prefill attention: W's prefill batch on the tiny model's heads (8 prompts of
    256 fresh tokens; 8 query, 4 KV heads of 64) and mixed chunks after context on Llama-3-8B's
    (32 / 8 heads of 128). This level's kernel; at amx_bf16 also the dpbf16 one beside it (the
    avx512_bf16 build, loaded in this process)."""
    module = cpu_kernels.load()
    if module is None or not cpu_kernels.prefill_attention_applies(
        torch.empty(1, 8, 64, dtype=BF16), torch.empty(1, 4, 64, dtype=BF16), module
    ):
        print(f"  prefill attention: no bf16 prefill kernel at this level ({cpu_kernels.failure()})")
        return []
    mods = {cpu_kernels.prefill_kernel_name(BF16, module): module}
    if cpu_isa.detect().level == "amx_bf16":
        with forced_level("avx512_bf16"):
            lower = cpu_kernels.load()
        if lower is not None:
            mods["dpbf16 kernel"] = lower
    out = []
    cases = {
        "tiny, 8 x 256 fresh": prefill_case(0, 8, 4, 64, [256] * 8, [0] * 8),
        "Llama-3-8B heads, chunks 512/200/37/1 after 64/0/19/100": prefill_case(
            1, 32, 8, 128, [512, 200, 37, 1], [64, 0, 19, 100]
        ),
    }
    for name, case in cases.items():
        cands = {
            label: (lambda m=m, case=case: m.paged_prefill_attention(*case)) for label, m in mods.items()
        }
        quiet = gated(args.quiet_threshold, args.quiet_timeout)
        med = interleaved(cands, args.reps)
        first = next(iter(med.values()))
        for cand, t in med.items():
            out.append({"case": name, "candidate": cand, "ms": t * 1e3, "quiet": quiet})
        print(
            f"  prefill attention, {name}, one layer: "
            + ", ".join(f"{c} {t * 1e3:.2f} ms ({t / first:.2f}x)" for c, t in med.items()),
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--rows", default="1,4,8,16,64,256")
    ap.add_argument("--quick", action="store_true", help="3 repetitions, rows 1,64, tiny set only")
    ap.add_argument(
        "--quiet-threshold", type=float, default=0.2, help="busy cores below which the machine is quiet"
    )
    ap.add_argument(
        "--quiet-timeout", type=float, default=120.0, help="seconds to wait for quiet, then time anyway"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.quiet_timeout = 3, 10.0
    rows = [1, 64] if args.quick else [int(r) for r in args.rows.split(",")]
    isa = cpu_isa.detect()
    print(cpu_line())
    print(
        f"level {isa.label()}, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
        f"{torch.get_num_threads()} threads, bf16 linear: {linear_path(BF16, CPU)}; load {load()}",
        flush=True,
    )
    quiet = gated(args.quiet_threshold, args.quiet_timeout)
    copy_bw = measure_copy_bandwidth(256)
    read_bw = read_bandwidth()
    print(
        f"  bandwidth: copy {copy_bw / 1e9:.1f} GB/s (read + write), read {read_bw / 1e9:.1f} GB/s",
        flush=True,
    )
    results: dict[str, Any] = {
        "level": isa.level, "torch": torch.__version__, "threads": torch.get_num_threads(), "load_before": load(),
        "copy_bandwidth_gb_s": copy_bw / 1e9, "read_bandwidth_gb_s": read_bw / 1e9, "bandwidth_quiet": quiet,
        "linear": [],
    }  # fmt: skip
    results["linear"] += bench_linear("tiny step", tiny_shapes(), rows, args, read_bw)
    if not args.quick:
        results["linear"] += bench_linear("1B layer", llama_1b_layer(), rows, args, read_bw)
    results["decode_attention"] = bench_decode(args, read_bw)
    results["prefill_attention"] = bench_prefill(args)
    results["load_after"] = load()
    print(f"  load after: {results['load_after']}")
    save_results(results, args.out, "engine_kernels_quick.json" if args.quick else "engine_kernels.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
