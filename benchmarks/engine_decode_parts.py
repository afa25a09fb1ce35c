"""One decode step at batch 64 (context 288) split into its parts, in one core's CPU time
(``time.process_time``, best of 3 x 20 calls), so a shared machine's load distorts it little.

    OMP_NUM_THREADS=1 python benchmarks/engine_decode_parts.py [tiny|small]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tailserve.executors.pytorch import cpu_kernels
from tailserve.executors.pytorch.attention import _decode_attention, build_metadata
from tailserve.executors.pytorch.init_model import default_model_dir
from tailserve.executors.pytorch.model import linear, rms_norm
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


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "tiny"
    llm = LLM(default_model_dir(preset), policy="vllm", dtype="bfloat16", threads=1)
    ex = llm.engine.stop_checker.inner
    m, kv = ex.model, ex.kv
    bs = kv.block_size
    nb = -(-(CONTEXT + 1) // bs)
    tables = [list(range(i * nb, (i + 1) * nb)) for i in range(BATCH)]
    h, kvh, d, layers = m.num_heads, m.num_kv_heads, m.head_dim, len(m.layers)
    w = m.layers[0]
    with torch.inference_mode():
        meta = build_metadata(tables, [1] * BATCH, [CONTEXT] * BATCH, BATCH, bs, kv.null_slot, m.device)
        x = torch.randn(BATCH, m.config.hidden_size, dtype=m.dtype)
        pos = torch.full((BATCH,), CONTEXT)
        qkv = linear(x, w.qkv, None)
        q = qkv[:, : h * d].reshape(BATCH, h, d)
        k = qkv[:, h * d : (h + kvh) * d].reshape(BATCH, kvh, d)
        v = qkv[:, (h + kvh) * d :].reshape(BATCH, kvh, d)
        ks, vs = kv.slots(0)
        gate, up = linear(x, w.gate_up, None).chunk(2, dim=-1)
        act = F.silu(gate) * up
        logits = m.compute_logits(x)
        parts = {
            "attention metadata": cpu_ms(
                lambda: build_metadata(
                    tables, [1] * BATCH, [CONTEXT] * BATCH, BATCH, bs, kv.null_slot, m.device
                )
            )
            / layers,
            "rms_norm x2": 2 * cpu_ms(lambda: rms_norm(x, w.input_norm, m.eps)),
            "qkv linear": cpu_ms(lambda: linear(x, w.qkv, None)),
            "rope + split": cpu_ms(lambda: m.fused.rope_split(qkv, m.rope.cos, m.rope.sin, pos, h, kvh, d))
            if m.fused is not None
            else float("nan"),
            "kv store": cpu_ms(
                lambda: (ks.index_copy_(0, meta.slot_mapping, k), vs.index_copy_(0, meta.slot_mapping, v))
            ),
            "decode attention": cpu_ms(lambda: _decode_attention(q, ks, vs, meta)),
            "o linear": cpu_ms(lambda: linear(x, w.o, None)),
            "gate_up linear": cpu_ms(lambda: linear(x, w.gate_up, None)),
            "silu * up": cpu_ms(lambda: F.silu(gate) * up),
            "down linear": cpu_ms(lambda: linear(act, w.down, None)),
            "lm head (share per layer)": cpu_ms(lambda: m.compute_logits(x)) / layers,
            "greedy argmax (share per layer)": cpu_ms(lambda: cpu_kernels.argmax_rows(logits).tolist())
            / layers,
        }
    total = sum(t for t in parts.values() if t == t)
    print(
        f"{preset}: decode batch {BATCH}, context {CONTEXT}; one core's CPU ms per layer (x{layers} layers)"
    )
    for name, t in parts.items():
        print(f"  {name:32s} {t:7.3f} ms  {100 * t / total:4.0f}%")
    print(f"  sum {total:.3f} ms per layer, {total * layers:.1f} ms per step")


if __name__ == "__main__":
    main()
