"""Attention alone: decode (the portable fused kernel, the AVX-512 bf16 one, the PyTorch path)
at W's decode shape (batch 64, context 288, bf16), and W's prefill step (16 fresh prompts of 256
tokens: SDPA per chunk against the AVX-512 bf16 tiled prefill kernel), in one core's CPU time
(``time.thread_time``, min of ``--repeats`` runs), so a shared machine's load distorts it little.

    OMP_NUM_THREADS=1 python benchmarks/engine_attention.py [--batch 64] [--context 288]

For each model shape (tiny: 8 heads / 4 KV heads, small: 12 / 4; head_dim 64) it prints ms per
layer, the K/V bytes read per layer over that time (GB/s), and the speed-up over the portable
kernel; it checks the kernels agree with the PyTorch path (float32 softmax both) first.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch

from tailserve.executors.pytorch import attention, cpu_kernels

SHAPES = {"tiny": (8, 4, 64), "small": (12, 4, 64), "llama-8b": (32, 8, 128)}


def cpu_ms(fn: Callable[[], object], repeats: int, calls: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - t) / calls)
    return best * 1e3


def case(heads: int, kv_heads: int, head_dim: int, batch: int, context: int, block_size: int = 16):
    g = torch.Generator().manual_seed(0)
    per = -(-(context + 1) // block_size)
    kv = attention.PagedKVCache(
        1, batch * per, block_size, kv_heads, head_dim, torch.bfloat16, torch.device("cpu")
    )
    ks, vs = kv.slots(0)
    n = batch * per * block_size
    ks[:n] = torch.randn(n, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    vs[:n] = torch.randn(n, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    perm = torch.randperm(batch * per, generator=g).tolist()
    tables = [perm[i * per : (i + 1) * per] for i in range(batch)]
    meta = attention.build_metadata(
        tables, [1] * batch, [context] * batch, batch, block_size, kv.null_slot, torch.device("cpu")
    )
    q = torch.randn(batch, heads, head_dim, generator=g).to(torch.bfloat16)
    return q, ks, vs, meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=288)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shapes", default="tiny,small,llama-8b")
    p.add_argument(
        "--prefill-chunks", type=int, default=16, help="prompts in the prefill step (W: 16 of 256)"
    )
    p.add_argument("--prefill-len", type=int, default=256)
    args = p.parse_args(argv)
    if cpu_kernels.load() is None:
        print(
            f"engine_attention: error: the CPU kernels could not be built: {cpu_kernels.failure()}",
            file=sys.stderr,
        )
        return 2
    print(
        f"load {os.getloadavg()[0]:.2f}, torch threads {torch.get_num_threads()}, "
        f"decode kernel {cpu_kernels.decode_isa()}; batch {args.batch}, context {args.context}, bf16"
    )
    for name in args.shapes.split(","):
        h, kvh, d = SHAPES[name]
        q, ks, vs, meta = case(h, kvh, d, args.batch, args.context)
        kv_bytes = 2 * args.batch * (args.context + 1) * kvh * d * 2

        def run(mode: str, q=q, ks=ks, vs=vs, meta=meta) -> torch.Tensor:
            os.environ["TAILSERVE_CPU_KERNEL"] = "0" if mode == "pytorch" else "1"
            os.environ["TAILSERVE_DECODE_KERNEL"] = "portable" if mode == "portable" else "auto"
            return attention._decode_attention(q, ks, vs, meta)

        want = run("pytorch").float()
        times = {}
        for mode in ("pytorch", "portable", "auto"):
            got = run(mode).float()
            err = (got - want).abs().max().item()
            if err > 2e-2:
                print(
                    f"engine_attention: error: {mode} differs from the PyTorch path by {err}", file=sys.stderr
                )
                return 1
            times[mode] = cpu_ms(lambda m=mode: run(m), args.repeats)
        print(f"  {name} ({h} heads / {kvh} KV, head_dim {d}):")
        for mode, label in (
            ("pytorch", "PyTorch ops"),
            ("portable", "portable kernel"),
            ("auto", cpu_kernels.decode_isa()),
        ):
            t = times[mode]
            print(
                f"    {label:18s} {t:7.3f} ms/layer  {kv_bytes / t / 1e6:6.1f} GB/s of K/V  "
                f"{times['portable'] / t:5.2f}x portable"
            )
        prefill = prefill_case(h, kvh, d, args.prefill_chunks, args.prefill_len)
        pt = {}
        for mode in ("portable", "auto"):
            os.environ["TAILSERVE_DECODE_KERNEL"] = mode

            def run_prefill(prefill=prefill) -> torch.Tensor:
                q, k, v, ks, vs, meta = prefill
                meta.prefill_kernel = None  # built per iteration in the engine: count it
                return attention.paged_attention(q, k, v, ks, vs, meta)

            pt[mode] = cpu_ms(run_prefill, args.repeats, calls=3)
        print(
            f"    prefill {args.prefill_chunks} x {args.prefill_len} tokens (causal, KV store included): "
            f"SDPA per chunk {pt['portable']:.2f} ms/layer, {cpu_kernels.decode_isa()} tiled kernel "
            f"{pt['auto']:.2f} ms/layer ({pt['portable'] / pt['auto']:.2f}x)"
        )
    os.environ.pop("TAILSERVE_DECODE_KERNEL", None)
    os.environ.pop("TAILSERVE_CPU_KERNEL", None)
    return 0


def prefill_case(heads: int, kv_heads: int, head_dim: int, chunks: int, length: int, block_size: int = 16):
    """W's prefill step: ``chunks`` fresh prompts of ``length`` tokens in one iteration."""
    g = torch.Generator().manual_seed(1)
    per = -(-length // block_size)
    kv = attention.PagedKVCache(
        1, chunks * per, block_size, kv_heads, head_dim, torch.bfloat16, torch.device("cpu")
    )
    ks, vs = kv.slots(0)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(chunks)]
    meta = attention.build_metadata(
        tables, [length] * chunks, [0] * chunks, 0, block_size, kv.null_slot, torch.device("cpu")
    )
    n = chunks * length
    q = torch.randn(n, heads, head_dim, generator=g).to(torch.bfloat16)
    k = torch.randn(n, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    v = torch.randn(n, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    return q, k, v, ks, vs, meta


if __name__ == "__main__":
    sys.exit(main())
