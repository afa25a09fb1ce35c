"""The real executor on a CUDA GPU, in one short run (< 8 min on one GPU):

1. tokens: float32 greedy tokens of a small random Llama on the GPU against transformers on the
   same GPU and against tailserve's own CPU run (both must be identical);
2. throughput: a W-style offline run (64 prompts of 64-512 tokens, 128 output tokens each,
   bf16, vLLM's default budget) — output tok/s and the engine's step count;
3. decode step split: one decode step at batch 1/16/64 with 512 tokens of context, timed with
   CUDA events, and PyTorch's profiler splitting its GPU time into linear (GEMM), attention
   (SDPA), the paged-KV gather/store and the rest.

Prints a line per part and writes everything to ``--out`` (JSON). Runs from a checkout with
``PYTHONPATH=src`` (no install: the GPU machine may have no registry): ``scripts/gpu_check.sh``.
``--device cpu`` runs the same script on the CPU (a dry run of the script itself; the token
check then compares the CPU run with transformers on the CPU).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from tailserve.executors.pytorch.init_model import init_model
from tailserve.llm import LLM, SamplingParams

SMALL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, vocab_size=4096)


def _say(msg: str) -> None:
    print(msg, flush=True)


def check_tokens(model_dir: Path, out: dict, device: str) -> bool:
    from transformers import AutoModelForCausalLM

    rng = random.Random(3)
    prompts = [[1] + [rng.randrange(3, 4000) for _ in range(n - 1)] for n in (7, 33, 120, 250, 64, 1)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    runs = {}
    for dev in dict.fromkeys((device, "cpu")):
        llm = LLM(str(model_dir), dtype="float32", device=dev, kv_cache_memory_gib=0.25,
                  max_num_batched_tokens=64)  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        runs[dev] = [list(o.token_ids) for o in outs]
        out.setdefault("descriptions", {})[dev] = llm.engine.description
        del llm
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    hf.generation_config.eos_token_id = None
    want = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                              pad_token_id=0)  # fmt: skip
            want.append(gen[0, len(p) :].tolist())
    same_hf = runs[device] == want
    same_cpu = runs[device] == runs["cpu"]
    out["tokens"] = {"prompts": len(prompts), "equal_transformers": same_hf, "equal_tailserve_cpu": same_cpu}
    _say(f"tokens: {device} == transformers({device}): {same_hf}; {device} == tailserve cpu: {same_cpu}")
    return same_hf and same_cpu


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def throughput(model_dir: Path, out: dict, device: str) -> None:
    rng = random.Random(5)
    prompts = [[1] + [rng.randrange(3, 4000) for _ in range(rng.randrange(64, 512))] for _ in range(64)]
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    llm = LLM(str(model_dir), dtype="auto", device=device, kv_cache_memory_gib=2.0)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4, ignore_eos=True))
    _sync(device)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    _sync(device)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    out["throughput"] = {
        "requests": len(prompts),
        "output_tokens": tokens,
        "prompt_tokens": sum(map(len, prompts)),
        "wall_s": round(wall, 3),
        "output_tok_s": round(tokens / wall, 1),
        "description": llm.engine.description,
    }
    _say(f"W: {len(prompts)} requests, {tokens} output tokens in {wall:.2f} s = {tokens / wall:.0f} tok/s")


def decode_split(model_dir: Path, out: dict, device: str, batches: tuple[int, ...]) -> None:
    from torch.profiler import ProfilerActivity, profile

    from tailserve.executors.pytorch.attention import PagedKVCache, build_metadata
    from tailserve.executors.pytorch.loader import load_config, load_state_dict
    from tailserve.executors.pytorch.model import LlamaModel

    dev = torch.device(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = load_config(model_dir)
    model = LlamaModel(config, load_state_dict(model_dir, config, dtype, dev), dtype, dev)
    context, block = 512, 16
    rows = []
    activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
    for batch in batches:
        blocks_per = context // block + 1
        kv = PagedKVCache(config.num_hidden_layers, batch * blocks_per, block, config.num_key_value_heads,
                          config.head_dim, dtype, dev)  # fmt: skip
        tables = [list(range(i * blocks_per, (i + 1) * blocks_per)) for i in range(batch)]
        meta = build_metadata(tables, [1] * batch, [context] * batch, batch, block, kv.null_slot, dev)
        ids = torch.ones(batch, dtype=torch.long, device=dev)
        pos = torch.full((batch,), context, device=dev)

        def step(ids=ids, pos=pos, meta=meta, kv=kv):
            with torch.inference_mode():
                model.compute_logits(model.forward(ids, pos, meta, kv))

        for _ in range(5):
            step()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(20):
            step()
        _sync(device)
        ms = (time.perf_counter() - t0) / 20 * 1000
        with profile(activities=[activity]) as prof:
            for _ in range(5):
                step()
            _sync(device)
        split = {"linear": 0.0, "attention": 0.0, "kv gather/store": 0.0, "other": 0.0}
        for ev in prof.key_averages():
            total = ev.self_device_time_total if device == "cuda" else ev.self_cpu_time_total
            t = total / 5 / 1000  # ms per step
            name = ev.key.lower()
            if device != "cuda" and not name.startswith(("aten::", "tailserve")):
                continue  # CPU: the operator rows only (their self time adds up once)
            # attention first: the memory-efficient kernel's name (fmha_cutlassF_...) says cutlass too
            if any(k in name for k in ("flash", "attention", "sdpa", "fmha", "efficient")):
                split["attention"] += t
            elif any(k in name for k in ("gemm", "matmul", "addmm", "aten::mm", "cutlass", "sm90", "linear")):
                split["linear"] += t
            elif any(k in name for k in ("index", "gather", "scatter")):
                split["kv gather/store"] += t
            else:
                split["other"] += t
        rows.append({"batch": batch, "context": context, "step_ms": round(ms, 3),
                     **{k: round(v, 3) for k, v in split.items()}})  # fmt: skip
        _say(f"decode batch {batch:3d}: {ms:.3f} ms/step; {device} time split (ms): "
             + ", ".join(f"{k} {v:.3f}" for k, v in split.items()))  # fmt: skip
    out["decode_split"] = rows


def profile_throughput(model_dir: Path, out: dict, device: str, path: Path) -> int:
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.runcall(throughput, model_dir, out, device)
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(40)
    path.write_text(text.getvalue())
    top = io.StringIO()
    pstats.Stats(prof, stream=top).sort_stats("tottime").print_stats(15)
    _say(top.getvalue()[-6000:])
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_check.json", help="JSON results (default: %(default)s)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="(default: %(default)s)")
    p.add_argument("--profile", metavar="FILE", help="run only the W throughput run, under cProfile, and "
                   "write its functions by own and by cumulative time to FILE (where the host time goes)")  # fmt: skip
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: error: torch.cuda.is_available() is False — run this on a CUDA machine",
            file=sys.stderr,
        )
        return 2
    out: dict = {
        "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    _say(f"{out['gpu'] or 'cpu'}, torch {out['torch']} (CUDA {out['cuda']})")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "small"
        init_model(model_dir, "tiny", dtype="float32", **SMALL)
        if args.profile:
            return profile_throughput(model_dir, out, args.device, Path(args.profile))
        ok = check_tokens(model_dir, out, args.device)
        throughput(model_dir, out, args.device)
        decode_split(model_dir, out, args.device, (1, 16, 64) if args.device == "cuda" else (1, 16))
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    _say(f"wrote {args.out} ({out['wall_s']} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
