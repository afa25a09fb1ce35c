#!/usr/bin/env python3
"""The real executor on whatever CPU runs this process, against transformers, on a tiny model.

Meant to run under an emulated CPU (``scripts/emulated_cpu_check.sh``: ``qemu-x86_64 -cpu
Haswell``, AVX2 without AVX-512; or qemu-aarch64), but it runs anywhere. It

1. writes a tiny random Llama directory (float32 weights, the byte-level BPE tokenizer that
   ``init_model`` trains) into a temporary directory; nothing is downloaded;
2. prints the CPU as this process sees it: ``torch.cpu.get_capabilities()`` (CPUID, so the
   emulated CPU's flags), ATen's dispatch level, ``/proc/cpuinfo``'s avx512 flags (the host's,
   under qemu-user) and the level tailserve detects (``cpu_isa.detect()``);
3. generates greedily with tailserve's real executor (``LLM``) in float32 and with transformers'
   ``generate`` on the same weights: the token ids must be identical (exit status 1 if not);
4. runs the executor again with ``dtype="auto"`` and ``dtype="bfloat16"``: each must finish
   without an exception; their tokens are compared with transformers (float32 and bfloat16)
   and the agreement is reported, not required;
5. writes everything as JSON (``--out``).

``TAILSERVE_CACHE`` points into the temporary directory (unless ``--cache`` says otherwise), so
the fused C++ kernels are compiled afresh for the level detected on this (emulated) CPU.

    python scripts/emulated_cpu_check.py --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

# The model: tests/torch_helpers.py's MICRO shapes (tiny, so an emulated CPU finishes quickly).
MICRO = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
)
KV_GIB = 4096 * 512 / 2**30  # 4,096 tokens of the micro model's KV (as tests/test_torch_executor.py)
CAPS = (
    "avx2",
    "fma3",
    "avx512_f",
    "avx512_bw",
    "avx512_vl",
    "avx512_dq",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
)


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _prompts(n: int, vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    lengths = [5, 17, 40, 33, 8, 60, 1, 24][:n]
    while len(lengths) < n:
        lengths.append(rng.randrange(1, 64))
    return [[1] + [rng.randrange(3, vocab) for _ in range(k - 1)] for k in lengths]


def cpu_report() -> dict[str, Any]:
    import torch

    caps = dict(torch.cpu.get_capabilities()) if hasattr(torch.cpu, "get_capabilities") else {}
    out: dict[str, Any] = {
        "machine": platform.machine(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_capabilities": {k: caps.get(k) for k in CAPS if k in caps},
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn_available": torch.backends.mkldnn.is_available(),
        "emulator": os.environ.get("EMULATED_CPU_CHECK_EMULATOR") or None,
    }
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(
                (line.split(":", 1)[1].split() for line in f if line.startswith(("flags", "Features"))), []
            )
        out["proc_cpuinfo_avx512"] = sorted(f for f in flags if f.startswith("avx512"))
        out["proc_cpuinfo_avx2"] = "avx2" in flags
    except OSError as e:
        out["proc_cpuinfo_error"] = str(e)
    try:
        from tailserve.executors.pytorch import cpu_isa
    except ImportError as e:
        out["tailserve_cpu_isa"] = f"unavailable ({e})"
    else:
        try:
            isa = cpu_isa.detect()
            out["tailserve_cpu_isa"] = {
                "level": isa.level,
                "native": isa.native,
                "label": isa.label(),
                "compile_flags": isa.compile_flags,
            }
        except Exception as e:  # a bad TAILSERVE_CPU_ISA: reported, the check goes on
            out["tailserve_cpu_isa"] = f"error: {type(e).__name__}: {e}"
    return out


def kernel_report() -> dict[str, Any]:
    """Which fused-kernel build this process got (after an executor ran)."""
    out: dict[str, Any] = {}
    try:
        from tailserve.executors.pytorch import cpu_kernels
    except ImportError as e:
        return {"unavailable": str(e)}
    for name in ("build_name", "failure", "decode_isa"):
        fn = getattr(cpu_kernels, name, None)
        if fn is None:
            continue
        try:
            out[name] = fn()
        except Exception as e:
            out[name] = f"error: {type(e).__name__}: {e}"
    build_dir = getattr(cpu_kernels, "build_dir", None)
    if build_dir is not None:
        try:
            d = build_dir()
            out["build_dir"] = str(d)
            out["built_so"] = sorted(p.name for p in d.glob("*.so")) if d.is_dir() else []
        except Exception as e:
            out["build_dir"] = f"error: {type(e).__name__}: {e}"
    return out


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new: int, dtype: Any) -> list[list[int]]:
    """transformers' ``generate``, one prompt at a time, greedy, exactly ``max_new`` tokens
    (as tests/torch_helpers.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


def tailserve_greedy(
    model_dir: Path, prompts: list[list[int]], max_new: int, dtype: str | None
) -> dict[str, Any]:
    from tailserve.llm import LLM, SamplingParams

    kwargs: dict[str, Any] = {"kv_cache_memory_gib": KV_GIB, "check_integrity": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    t0 = time.perf_counter()
    llm = LLM(str(model_dir), **kwargs)
    t1 = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True),
    )
    t2 = time.perf_counter()
    return {
        "tokens": [list(o.token_ids) for o in outs],
        "finish_reasons": [o.finish_reason for o in outs],
        "description": getattr(llm.engine, "description", None),
        "load_s": round(t1 - t0, 2),
        "generate_s": round(t2 - t1, 2),
    }


def agreement(got: list[list[int]], want: list[list[int]]) -> dict[str, Any]:
    pairs = [(a, b) for g, w in zip(got, want) for a, b in zip(g, w)]
    total = sum(max(len(g), len(w)) for g, w in zip(got, want))
    same = sum(a == b for a, b in pairs)
    return {
        "identical": got == want,
        "sequences_identical": sum(g == w for g, w in zip(got, want)),
        "sequences": len(want),
        "positions_equal": same,
        "positions": total,
        "fraction": round(same / total, 4) if total else 1.0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="write the result here as JSON")
    parser.add_argument("--prompts", type=int, default=8, help="how many prompts (default 8: 1-60 tokens)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per prompt (default 16)")
    parser.add_argument(
        "--dtypes",
        default="float32,auto,bfloat16",
        help="executor dtypes to run, comma-separated (default float32,auto,bfloat16); float32 must "
        "equal transformers, the others must only run",
    )
    parser.add_argument(
        "--workdir", type=Path, help="where the model and kernel cache go (default: a new temporary dir)"
    )
    parser.add_argument(
        "--cache", type=Path, help="TAILSERVE_CACHE (default: <workdir>/cache, a fresh kernel build)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args()

    started = time.perf_counter()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tailserve-emulated-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cache = args.cache or workdir / "cache"
    os.environ["TAILSERVE_CACHE"] = str(cache)  # before tailserve is imported
    result: dict[str, Any] = {"argv": sys.argv[1:], "workdir": str(workdir), "tailserve_cache": str(cache)}
    failures: list[str] = []
    try:
        _log("importing torch")
        import torch

        torch.manual_seed(0)
        result["cpu"] = cpu_report()
        _log(f"cpu: {json.dumps(result['cpu'])}")

        from tailserve.executors.pytorch.init_model import init_model

        model_dir = workdir / "model"
        t0 = time.perf_counter()
        if not (model_dir / "config.json").is_file():
            _log(f"writing the tiny model to {model_dir}")
            init_model(model_dir, preset="tiny", seed=0, dtype="float32", **MICRO)
        result["model"] = {
            "dir": str(model_dir),
            **MICRO,
            "weights": "float32",
            "write_s": round(time.perf_counter() - t0, 2),
        }
        prompts = _prompts(args.prompts, MICRO["vocab_size"])
        result["prompts"] = prompts
        result["max_tokens"] = args.max_tokens

        refs: dict[str, list[list[int]]] = {}
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            t0 = time.perf_counter()
            _log(f"transformers generate ({name})")
            refs[name] = hf_greedy(model_dir, prompts, args.max_tokens, dtype)
            result.setdefault("transformers", {})[name] = {
                "tokens": refs[name],
                "s": round(time.perf_counter() - t0, 2),
            }

        result["runs"] = {}
        for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
            _log(f"tailserve generate (dtype={dtype})")
            run: dict[str, Any] = {}
            try:
                run.update(
                    tailserve_greedy(
                        model_dir, prompts, args.max_tokens, None if dtype == "default" else dtype
                    )
                )
            except Exception as e:
                run["error"] = f"{type(e).__name__}: {e}"
                run["traceback"] = traceback.format_exc()
                failures.append(f"dtype={dtype}: {run['error']}")
                _log(f"dtype={dtype} FAILED:\n{run['traceback']}")
            else:
                run["vs_transformers_float32"] = agreement(run["tokens"], refs["float32"])
                run["vs_transformers_bfloat16"] = agreement(run["tokens"], refs["bfloat16"])
                if dtype == "float32" and not run["vs_transformers_float32"]["identical"]:
                    failures.append("dtype=float32: tokens differ from transformers")
                _log(
                    f"dtype={dtype}: {run['description']!r}; load {run['load_s']} s, generate {run['generate_s']} s; "
                    f"vs transformers float32 {run['vs_transformers_float32']['fraction']:.1%} "
                    f"(identical: {run['vs_transformers_float32']['identical']}), "
                    f"vs transformers bf16 {run['vs_transformers_bfloat16']['fraction']:.1%}"
                )
            run["kernels"] = kernel_report()
            result["runs"][dtype] = run
        result["cpu_after"] = cpu_report()  # TAILSERVE_CPU_ISA unchanged: the same level
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
        failures.append(result["error"])
        _log(f"FAILED:\n{result['traceback']}")
    finally:
        result["failures"] = failures
        result["ok"] = not failures
        result["wall_s"] = round(time.perf_counter() - started, 1)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")
        if not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)

    f32 = result.get("runs", {}).get("float32", {})
    print()
    print(
        f"machine {result.get('cpu', {}).get('machine')}, torch caps {result.get('cpu', {}).get('torch_capabilities')}"
    )
    print(f"tailserve level: {result.get('cpu', {}).get('tailserve_cpu_isa')}")
    if "vs_transformers_float32" in f32:
        a = f32["vs_transformers_float32"]
        print(f"float32 tokens == transformers: {a['identical']} ({a['positions_equal']}/{a['positions']})")
    for dtype, run in result.get("runs", {}).items():
        if dtype != "float32":
            if "error" in run:
                print(f"{dtype}: ERROR {run['error']}")
            else:
                a = run["vs_transformers_bfloat16"]
                print(
                    f"{dtype}: ran; agreement with transformers bf16 {a['fraction']:.1%}, "
                    f"with float32 {run['vs_transformers_float32']['fraction']:.1%}"
                )
    print(f"{'OK' if result['ok'] else 'FAILED: ' + '; '.join(failures)} ({result['wall_s']} s)")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
