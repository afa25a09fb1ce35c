"""Which SDPA kernel PyTorch runs for the real executor's attention calls on a GPU, and what each
costs when every call has a new sequence length (as serving has: a decode's context grows by one
token a step, every prefill chunk has its own length).

For the decode call (one query per request over a padded context, a boolean mask, GQA) and the
prefill call (causal, GQA) at lengths that change every call, the host-side wall time per call
(synchronized) under PyTorch's default choice and under each kernel alone. A kernel that builds a
plan per new shape (cuDNN's) shows here as milliseconds per call.

    python3 scripts/gpu_sdpa.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

KERNELS = {
    "default": None,
    "flash": [SDPBackend.FLASH_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "math": [SDPBackend.MATH],
    "no-cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
}


def _decode(batch: int, width: int, heads: int, kv_heads: int, dim: int):
    q = torch.randn(batch, heads, 1, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, kv_heads, width, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    mask = torch.arange(width, device="cuda")[None, :] < torch.randint(
        1, width + 1, (batch, 1), device="cuda"
    )
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], enable_gqa=True)


def _decode_repeated(batch: int, width: int, heads: int, kv_heads: int, dim: int):
    """CudaBackend's half-precision decode: KV heads repeated to the query heads, no enable_gqa."""
    q = torch.randn(batch, heads, 1, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, kv_heads, width, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lengths = torch.randint(1, width + 1, (batch, 1), device="cuda")
    mask = torch.arange(width, device="cuda")[None, :] < lengths
    group = heads // kv_heads
    return lambda: F.scaled_dot_product_attention(
        q,
        k.repeat_interleave(group, dim=1),
        v.repeat_interleave(group, dim=1),
        attn_mask=mask[:, None, None, :],
    )


def _prefill(length: int, heads: int, kv_heads: int, dim: int):
    q = torch.randn(1, heads, length, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def per_call_ms(make, lengths, kernels) -> float | str:
    times = []
    try:
        for n in lengths:
            fn = make(n)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if kernels is None:
                fn()
            else:
                with sdpa_kernel(kernels):
                    fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1000)
    except Exception as e:  # a kernel that refuses the call
        return f"refused: {str(e).splitlines()[0][:90]}"
    return round(statistics.median(times[2:]), 3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_sdpa.json")
    args = p.parse_args()
    out: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                 "cudnn": torch.backends.cudnn.version(), "rows": []}  # fmt: skip
    cases = {
        # the tiny model (8 heads, 4 KV heads, dim 64) and a Llama-3-8B shard (32 / 8, dim 128)
        "decode b64 tiny": (lambda n: _decode(64, n, 8, 4, 64), range(300, 340)),
        "decode b64 8B": (lambda n: _decode(64, n, 32, 8, 128), range(1000, 1040)),
        "prefill tiny": (lambda n: _prefill(n, 8, 4, 64), range(200, 240)),
        "prefill 8B": (lambda n: _prefill(n, 32, 8, 128), range(1000, 1040)),
        "decode b64 8B, KV repeated": (lambda n: _decode_repeated(64, n, 32, 8, 128), range(2000, 2040)),
        "decode b64 tiny, same length": (lambda n: _decode(64, 320, 8, 4, 64), range(300, 340)),
    }
    for case, (make, lengths) in cases.items():
        row = {"case": case}
        for name, kernels in KERNELS.items():
            row[name] = per_call_ms(make, lengths, kernels)
        out["rows"].append(row)
        print(f"{case:30s} " + "  ".join(f"{k} {v}" for k, v in row.items() if k != "case"), flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
