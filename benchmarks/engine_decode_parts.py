"""One decode step at batch 64 (context 288) split into its parts.

- Default: one core's CPU time (``time.process_time``, best of 3 x 20 calls), so a shared
  machine's load distorts it little.
- ``--scaling 1,2``: wall time of every part (and of the whole forward + LM head) at each thread
  count, the counts alternating inside one process (best of 5 x 20 calls each), and the speedup
  of the last count over the first: which parts do not gain from a second thread.

    OMP_NUM_THREADS=1 python benchmarks/engine_decode_parts.py [tiny|small]
    python benchmarks/engine_decode_parts.py tiny --scaling 1,2 [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tailserve.executors.pytorch import cpu_kernels
from tailserve.executors.pytorch.attention import _decode_attention, build_metadata
from tailserve.executors.pytorch.init_model import default_model_dir
from tailserve.executors.pytorch.model import linear
from tailserve.llm import LLM

BATCH, CONTEXT = 64, 288


def cpu_ms(fn: Callable[[], object], calls: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        t = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - t) / calls)
    return best * 1e3


def wall_ms(fn: Callable[[], object], calls: int = 20) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e3


def build_parts(preset: str, threads: int) -> tuple[dict[str, tuple[Callable[[], object], float]], int]:
    """name -> (one call, how many of it a step makes per layer), and the layer count."""
    llm = LLM(default_model_dir(preset), policy="vllm", dtype="bfloat16", threads=threads)
    ex = llm.engine.stop_checker.inner
    m, kv = ex.model, ex.kv
    bs = kv.block_size
    nb = -(-(CONTEXT + 1) // bs)
    tables = [list(range(i * nb, (i + 1) * nb)) for i in range(BATCH)]
    h, kvh, d, layers = m.num_heads, m.num_kv_heads, m.head_dim, len(m.layers)
    w = m.layers[0]
    g = torch.Generator().manual_seed(0)
    for t in (*kv.k, *kv.v):  # the cache is allocated unwritten: give attention real values
        t[: BATCH * nb].copy_(torch.randn(t[: BATCH * nb].shape, generator=g).to(t.dtype))
    meta = build_metadata(tables, [1] * BATCH, [CONTEXT] * BATCH, BATCH, bs, kv.null_slot, m.device)
    x = torch.randn(BATCH, m.config.hidden_size, generator=g).to(m.dtype)
    pos = torch.full((BATCH,), CONTEXT)
    qkv = linear(x, w.qkv, None)
    q = qkv[:, : h * d].reshape(BATCH, h, d)
    k = qkv[:, h * d : (h + kvh) * d].reshape(BATCH, kvh, d)
    v = qkv[:, (h + kvh) * d :].reshape(BATCH, kvh, d)
    ks, vs = kv.slots(0)
    gate_up = linear(x, w.gate_up, None)
    norm = m.norm_ops  # what the forward pass runs: fused kernels where they match PyTorch's bits
    act = norm.silu_and_mul(gate_up)
    logits = m.compute_logits(x)
    ids = torch.randint(3, m.config.vocab_size, (BATCH,), generator=g)
    per_step = 1.0 / layers
    parts: dict[str, tuple[Callable[[], object], float]] = {
        "attention metadata": (
            lambda: build_metadata(tables, [1] * BATCH, [CONTEXT] * BATCH, BATCH, bs, kv.null_slot, m.device),
            per_step,
        ),
        "rms_norm": (lambda: norm.rms_norm(x, w.input_norm), per_step),
        "residual add + rms_norm": (lambda: norm.add_rms_norm(x, x, w.post_attention_norm), 2.0),
        "qkv linear": (lambda: linear(x, w.qkv, None), 1.0),
        "kv store": (
            lambda: (ks.index_copy_(0, meta.slot_mapping, k), vs.index_copy_(0, meta.slot_mapping, v)),
            1.0,
        ),
        "decode attention": (lambda: _decode_attention(q, ks, vs, meta), 1.0),
        "o linear": (lambda: linear(x, w.o, None), 1.0),
        "gate_up linear": (lambda: linear(x, w.gate_up, None), 1.0),
        "silu * up": (lambda: norm.silu_and_mul(gate_up), 1.0),
        "down linear": (lambda: linear(act, w.down, None), 1.0),
        "lm head": (lambda: m.compute_logits(x), per_step),
        "greedy argmax": (lambda: cpu_kernels.argmax_rows(logits).tolist(), per_step),
        "whole forward + lm head": (
            lambda: m.compute_logits(m.forward(ids, pos, meta, kv)),
            per_step,
        ),
    }
    if m.fused is not None:
        parts["rope + split"] = (lambda: m.fused.rope_split(qkv, m.rope.cos, m.rope.sin, pos, h, kvh, d), 1.0)
    return parts, layers


def cpu_report(preset: str) -> None:
    parts, layers = build_parts(preset, 1)
    whole = parts.pop("whole forward + lm head")
    times = {name: cpu_ms(fn) * n for name, (fn, n) in parts.items()}
    total = sum(times.values())
    print(
        f"{preset}: decode batch {BATCH}, context {CONTEXT}; one core's CPU ms per layer (x{layers} layers)"
    )
    for name, t in times.items():
        print(f"  {name:32s} {t:7.3f} ms  {100 * t / total:4.0f}%")
    print(f"  sum {total:.3f} ms per layer, {total * layers:.1f} ms per step")
    print(f"  whole forward + lm head: {cpu_ms(whole[0]):.1f} ms per step")


def scaling_report(preset: str, counts: list[int], out: str | None) -> None:
    parts, layers = build_parts(preset, counts[0])
    best = {c: {name: float("inf") for name in parts} for c in counts}
    for rep in range(5):
        for c in counts if rep % 2 == 0 else counts[::-1]:
            torch.set_num_threads(c)
            for name, (fn, _) in parts.items():
                fn()
                best[c][name] = min(best[c][name], wall_ms(fn))
    first, last = counts[0], counts[-1]
    print(
        f"{preset}: decode batch {BATCH}, context {CONTEXT}; wall ms per step (best of 5 x 20), "
        f"threads {', '.join(map(str, counts))} (load {os.getloadavg()[0]:.1f})"
    )
    rows = {}
    for name, (_, n) in parts.items():
        per_step = {c: best[c][name] * n * layers for c in counts}
        rows[name] = per_step
        cells = "  ".join(f"{per_step[c]:8.3f}" for c in counts)
        print(f"  {name:28s} {cells}   x{per_step[first] / per_step[last]:.2f}")
    summed = {c: sum(v[c] for k, v in rows.items() if k != "whole forward + lm head") for c in counts}
    print("  sum of parts                 " + "  ".join(f"{summed[c]:8.3f}" for c in counts))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(
            json.dumps(
                {
                    "preset": preset,
                    "threads": counts,
                    "ms_per_step": rows,
                    "sum_ms": summed,
                    "loadavg": os.getloadavg(),
                },
                indent=1,
            )
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("preset", nargs="?", default="tiny")
    p.add_argument("--scaling", default=None, help="thread counts to compare in wall time, e.g. 1,2")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.scaling is None:
        with torch.inference_mode():
            cpu_report(args.preset)
        return 0
    try:
        counts = [int(c) for c in args.scaling.split(",")]
        if len(counts) < 2 or min(counts) < 1:
            raise ValueError
    except ValueError:
        print(
            f"engine_decode_parts: error: --scaling {args.scaling!r}: give two or more counts, e.g. 1,2",
            file=sys.stderr,
        )
        return 2
    with torch.inference_mode():
        scaling_report(args.preset, counts, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
