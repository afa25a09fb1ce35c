"""The fused RMSNorm / add + RMSNorm / SiLU-mul kernels against PyTorch's ops, A/B in one process.

Per model (bf16, one thread): one core's CPU time (``time.process_time``) of an 8 x 256-token
prefill (``max_tokens=1``) and of a batch-64 decode step at context 288 (forward + LM head),
the model's ``norm_ops`` switched between the fused kernels and ``torch_norm_ops`` and the two
alternating round by round so load drifts hit both alike (best of ``--rounds``); then the W
prompts' greedy tokens both ways, which must be identical (the kernels give PyTorch's bits),
and each op alone at 64 and 2,048 rows.

    OMP_NUM_THREADS=1 python benchmarks/engine_fused_norm.py [--models tiny,small] [--rounds 4]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
importlib.import_module("tailserve.executors.pytorch")  # its OpenMP wait policy before torch

import torch  # noqa: E402
from _arrivals import random_prompts  # noqa: E402
from _host import simd_flags  # noqa: E402
from _paths import default_out  # noqa: E402

from tailserve.executors.pytorch.attention import build_metadata  # noqa: E402
from tailserve.executors.pytorch.backend import torch_norm_ops  # noqa: E402
from tailserve.executors.pytorch.init_model import default_model_dir  # noqa: E402
from tailserve.llm import LLM, SamplingParams  # noqa: E402

BATCH, CONTEXT, W_SEED = 64, 288, 1234


def cpu_ms(fn: Callable[[], object], calls: int) -> float:
    t = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - t) / calls * 1e3


def decode_step(llm: LLM) -> Callable[[], object]:
    """A batch-64 decode step's forward + LM head over a cache filled with random values."""
    ex = llm.engine.stop_checker.inner
    m, kv = ex.model, ex.kv
    nb = -(-(CONTEXT + 1) // kv.block_size)
    tables = [list(range(i * nb, (i + 1) * nb)) for i in range(BATCH)]
    g = torch.Generator().manual_seed(0)
    for t in (*kv.k, *kv.v):
        t[: BATCH * nb].copy_(torch.randn(t[: BATCH * nb].shape, generator=g).to(t.dtype))
    meta = build_metadata(
        tables, [1] * BATCH, [CONTEXT] * BATCH, BATCH, kv.block_size, kv.null_slot, m.device
    )
    ids = torch.randint(3, m.config.vocab_size, (BATCH,), generator=g)
    pos = torch.full((BATCH,), CONTEXT)

    def step() -> object:
        with torch.inference_mode():
            return m.compute_logits(m.forward(ids, pos, meta, kv))

    return step


def per_op(m, rounds: int) -> dict:
    """Each op alone at a decode batch (64 rows) and a prefill (2,048), both ways: us per call."""
    modes = {"pytorch": torch_norm_ops(m.eps), "fused": m.norm_ops}
    w = m.layers[0].post_attention_norm
    g = torch.Generator().manual_seed(1)
    out = {}
    for rows in (64, 2048):
        x, r = (torch.randn(rows, m.config.hidden_size, generator=g).to(m.dtype) for _ in range(2))
        gu = torch.randn(rows, 2 * m.config.intermediate_size, generator=g).to(m.dtype)
        calls = max(3, 20000 // rows)
        for name, args in (("rms_norm", (x, w)), ("add_rms_norm", (r, x, w)), ("silu_and_mul", (gu,))):
            cell = {}
            for mode, ops in modes.items():
                fn = functools.partial(getattr(ops, name), *args)
                fn()
                cell[mode] = round(min(cpu_ms(fn, calls) for _ in range(rounds)) * 1e3, 1)
            out[f"{name} {rows} rows"] = cell
    return out


def run_model(preset: str, rounds: int) -> dict:
    llm = LLM(default_model_dir(preset), policy="vllm", dtype="bfloat16", threads=1)
    m = llm.engine.stop_checker.inner.model
    modes = {"pytorch": torch_norm_ops(m.eps), "fused": m.norm_ops}
    rng = random.Random(0)
    greedy1 = SamplingParams(max_tokens=1, temperature=0.0)

    def prefill() -> object:
        ps = [[1] + [rng.randrange(3, m.config.vocab_size) for _ in range(255)] for _ in range(8)]
        return llm.generate([{"prompt_token_ids": p} for p in ps], greedy1)

    step = decode_step(llm)
    best = {(what, mode): float("inf") for what in ("prefill", "decode") for mode in modes}
    for rep in range(rounds + 1):  # round 0 warms both
        for mode in list(modes) if rep % 2 == 0 else list(modes)[::-1]:
            m.norm_ops = modes[mode]
            p, d = cpu_ms(prefill, 1), cpu_ms(step, 10)
            if rep:
                best["prefill", mode] = min(best["prefill", mode], p)
                best["decode", mode] = min(best["decode", mode], d)
    prompts = random_prompts(8, 256, m.config.vocab_size, W_SEED)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    tokens = {}
    for mode, ops in modes.items():
        m.norm_ops = ops
        tokens[mode] = [
            list(o.token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        ]
    m.norm_ops = modes["fused"]
    return {
        "fused_ops": list(modes["fused"].fused),
        "per_op_cpu_us": per_op(m, rounds),
        "prefill_8x256_cpu_ms": {mode: round(best["prefill", mode], 1) for mode in modes},
        "decode_b64_cpu_ms": {mode: round(best["decode", mode], 2) for mode in modes},
        "w_prompts_identical": sum(a == b for a, b in zip(tokens["pytorch"], tokens["fused"], strict=True)),
        "w_prompts": len(prompts),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,small")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=None, help="JSON (default benchmarks/out/engine_fused_norm.json)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        print("engine_fused_norm: error: --rounds must be at least 1", file=sys.stderr)
        return 2
    result: dict = {
        "load_before": os.getloadavg()[0],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "simd": simd_flags(),
        "models": {},
    }
    print(
        f"load {result['load_before']:.2f}; torch capability {result['cpu_capability']}; "
        f"{' '.join(result['simd']) or 'no AVX-512'}; one thread, one core's CPU ms (best of {args.rounds})"
    )
    for preset in [s.strip() for s in args.models.split(",") if s.strip()]:
        r = run_model(preset, args.rounds)
        result["models"][preset] = r
        pre, dec = r["prefill_8x256_cpu_ms"], r["decode_b64_cpu_ms"]
        print(
            f"{preset}: fused {', '.join(r['fused_ops']) or 'none'}\n"
            f"  prefill 8 x 256:   PyTorch ops {pre['pytorch']:8.1f}  fused {pre['fused']:8.1f}  "
            f"({pre['fused'] / pre['pytorch']:.3f}x)\n"
            f"  decode batch 64:   PyTorch ops {dec['pytorch']:8.2f}  fused {dec['fused']:8.2f}  "
            f"({dec['fused'] / dec['pytorch']:.3f}x)\n"
            f"  W prompts' greedy tokens identical: {r['w_prompts_identical']} of {r['w_prompts']}"
        )
        for name, cell in r["per_op_cpu_us"].items():
            print(f"  {name:24s} PyTorch ops {cell['pytorch']:8.1f} us  fused {cell['fused']:8.1f} us")
    result["load_after"] = os.getloadavg()[0]
    out = Path(args.out) if args.out else default_out("engine_fused_norm.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"load after {result['load_after']:.2f}; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
