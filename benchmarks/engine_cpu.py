"""tailserve's real executor against transformers static batching and vLLM's CPU build, one run.

For each generated model (``tiny``: the peer reference's shape, 21 M parameters; ``small``: 101 M,
both bf16), on the same token-id workloads and greedy decoding with ``ignore_eos``:

- **W** (peer-engines-cpu.md): 64 prompts of 256 ids (BOS, then ids uniform in [3, vocab) from
  ``random.Random(1234)``), 64 new tokens each, as one offline batch: wall time and output tok/s.
- **TTFT**: one 256-token prompt with ``max_tokens=1``, median of 5 fresh prompts (no prefix hit).
- **P**: a Poisson run of mixed lengths (prompts uniform 32-512, outputs uniform 16-128), each
  request submitted at its arrival time: output tok/s, TTFT p50/p99, E2E p50. The rate is
  ``--rate`` or, by default, half of what tailserve's W throughput could sustain for P's mean
  output length — the same rate for every engine, recorded.

Engines: tailserve (``LLM`` / ``LLMEngine`` in this process, ``--policy``), Hugging Face
``generate`` (one padded batch for W; for P a static batcher, see ``_hf_static.py``) and vLLM
(``_vllm_driver.py`` in vLLM's venv, once per ``--vllm-threads-bind`` setting). Also measured:
tailserve's decode step at batch 64 against the memory-bandwidth limit and its prefill against the
bf16 GEMM limit (``_roofline.py``), and whether the engines' greedy tokens agree. Every timed
section waits for a quiet machine and records the machine's other CPU use (``_common.py``).

    python -m benchmarks.engine_cpu [--models tiny,small] [--policy vllm] [--skip-vllm] [--skip-hf]
    python -m benchmarks.engine_cpu --quick      # smoke test: tiny only, a few prompts
    python -m benchmarks.engine_cpu --also-levels avx512_bf16   # on an AMX CPU: the AMX path
                                                                # beside the dpbf16 one (Zen 4's)

Prints tables and writes ``benchmarks/out/engine_cpu.json`` (``engine_cpu_quick.json`` with
``--quick``; git-ignored; the committed figures are ``--out benchmarks/results/engine_cpu.json``).
vLLM runs from ``${TAILSERVE_PEERS:-<repo>/.peers}/vllm`` (``scripts/setup-peers.sh vllm``).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# tailserve's executor package first: it loads torch with its OpenMP wait policy (threads.py).
importlib.import_module("tailserve.executors.pytorch")

import torch  # noqa: E402

from benchmarks._arrivals import (  # noqa: E402
    P_ARRIVAL_SEED,
    P_LEN_SEED,
    P_OUTPUT_LEN,
    P_PROMPT_LEN,
    at_rate,
    poisson_requests,
    random_prompts,
)
from benchmarks._common import cpu_line, default_out, forced_level, missing_peer, peer_venv  # noqa: E402
from benchmarks._engine_report import machine_info, print_report, ratios, token_agreement  # noqa: E402
from benchmarks._engine_runs import DTYPE, gate, run_hf, run_tailserve, run_vllm  # noqa: E402
from benchmarks._roofline import (  # noqa: E402
    ModelCounts,
    gemm_notice,
    measure_copy_bandwidth,
    measure_gemm_flops,
    roofline,
)
from tailserve.executors.pytorch import cpu_isa  # noqa: E402
from tailserve.executors.pytorch.init_model import PRESETS, default_model_dir, init_model  # noqa: E402
from tailserve.executors.pytorch.loader import load_config  # noqa: E402
from tailserve.policies.registry import parse_policy_list  # noqa: E402

W_SEED, TTFT_SEED, WARMUP_SEED = 1234, 99, 7
AUTO_LOAD = 0.5  # auto rate: this fraction of tailserve's W throughput, in P requests/s
# ``--also-levels``: levels tailserve can be forced to in this process and still run as on
# such a CPU. PyTorch reads its dispatch (ATen's, oneDNN's) once at start-up, so only a level
# whose bf16 path makes no oneDNN call qualifies: avx512_bf16 under amx_bf16 (its linear layers
# are tailserve's dpbf16 kernel); avx512 would run oneDNN with this CPU's AMX.
IN_PROCESS_LEVELS = {"amx_bf16": ("avx512_bf16",)}


# ---- one model, all engines ------------------------------------------------------------------
def resolve_model(preset: str, model_dir: str | None) -> Path:
    """tailserve's model cache (seed 0, bf16), or ``MODEL_DIR/PRESET``, generated once."""
    if model_dir is None:
        return default_model_dir(preset)
    path = Path(model_dir).expanduser() / preset
    if not (path / "config.json").is_file():
        print(f"  generating the {preset} model into {path}", flush=True)
        init_model(path, preset, dtype=DTYPE)
    return path


def rate_for(preset: str, rates: dict[str, float], mean_output_len: float) -> Any:
    """The Poisson rate, from ``--rate`` or from tailserve's W throughput (auto)."""
    fixed = rates.get(preset, rates.get("*"))
    if fixed is not None:
        return lambda _w_tok_s: fixed
    return lambda w_tok_s: AUTO_LOAD * w_tok_s / mean_output_len


def bench_model(
    preset: str,
    args: argparse.Namespace,
    rates: dict[str, float],
    binds: list[str],
    bandwidth: float,
    gemm: float,
) -> dict[str, Any]:
    model_dir = resolve_model(preset, args.model_dir)
    config = load_config(model_dir)
    vocab = config.vocab_size
    poisson_unit = poisson_requests(args.num_requests, vocab)
    mean_out = sum(r.max_tokens for r in poisson_unit) / len(poisson_unit)
    work = {
        "w": random_prompts(args.num_prompts, 256, vocab, W_SEED),
        "w_max_tokens": 64,
        "ttft": random_prompts(5, 256, vocab, TTFT_SEED),
        "warmup": random_prompts(2, 64, vocab, WARMUP_SEED),
        "poisson_unit": poisson_unit,
        "rate": rate_for(preset, rates, mean_out),
    }
    out: dict[str, Any] = {"model_dir": str(model_dir), "num_params": config.num_params, "engines": {}}
    engines = out["engines"]
    print(f"{preset}: {config.num_params / 1e6:.1f} M parameters, {model_dir}", flush=True)
    ts = run_tailserve(model_dir, args, work)
    gc.collect()
    engines["tailserve"] = ts
    rate = ts["poisson"]["rate_req_s"]
    for level in args.also_levels:
        # The same engine forced down a level, at the same P rate (check_args allows only the
        # levels whose PyTorch dispatch is this run's, since torch reads it once at start-up).
        with forced_level(level):
            engines[f"tailserve[{level}]"] = run_tailserve(model_dir, args, {**work, "rate": lambda _: rate})
        gc.collect()
    requests = at_rate(poisson_unit, rate)
    out["poisson_workload"] = {
        "num_requests": len(requests),
        "rate_req_s": rate,
        "rate_source": "--rate"
        if preset in rates or "*" in rates
        else f"auto: {AUTO_LOAD} x tailserve W tok/s / mean max_tokens",
        "prompt_len_range": P_PROMPT_LEN,
        "output_len_range": P_OUTPUT_LEN,
        "mean_prompt_len": sum(len(r.prompt_token_ids) for r in requests) / len(requests),
        "mean_max_tokens": mean_out,
        "seeds": {"lengths": P_LEN_SEED, "arrivals": P_ARRIVAL_SEED},
    }
    counts = ModelCounts.from_config(config, torch.empty((), dtype=getattr(torch, args.dtype)).element_size())
    steps = ts["w"]["steps"]
    prefills = {
        "prefill_single": {"num_tokens": 256, "num_sampled_rows": 1, "time_s": ts["ttft"]["median_s"]}
    }
    if steps["prefill_batch"] is not None:
        prefills["prefill_batch"] = steps["prefill_batch"]
    out["roofline"] = roofline(
        counts, bandwidth, gemm, steps["decode"], prefills, ts.get("last_layer_rows_only", False)
    )
    if not args.skip_hf:
        engines["transformers"] = run_hf(model_dir, args, work, requests)
        gc.collect()
    for bind in binds:
        engines[f"vllm[{bind}]"] = run_vllm(model_dir, bind, args, work, requests)
    out["token_agreement"] = token_agreement(engines)
    out["ratios"] = ratios(engines)
    return out


# ---- command line ----------------------------------------------------------------------------
def parse_rates(text: str) -> dict[str, float]:
    """``auto`` -> {}; ``12`` -> every model; ``tiny=12,small=3`` -> per model."""
    if text == "auto":
        return {}
    rates: dict[str, float] = {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        name, raw = (key.strip(), value) if eq else ("*", key)
        try:
            rate = float(raw)
        except ValueError:
            raise ValueError(f"--rate: {item!r} is not a number, NAME=NUMBER or 'auto'") from None
        if not rate > 0:
            raise ValueError(f"--rate: {item!r} must be positive")
        rates[name] = rate
    return rates


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--models", default=None, help="comma-separated presets (default: tiny,small; --quick: tiny)"
    )
    p.add_argument(
        "--model-dir",
        default=None,
        help="folder of generated models, one per preset (created once); default: tailserve's model cache",
    )
    p.add_argument(
        "--policy", default="vllm", help="tailserve policy spec, e.g. vllm:max_num_batched_tokens=4096"
    )
    p.add_argument("--num-prompts", type=int, default=None, help="W prompts (default 64; --quick: 8)")
    p.add_argument("--num-requests", type=int, default=None, help="P requests (default 96; --quick: 12)")
    p.add_argument("--rate", default="auto", help="P arrival rate, req/s: auto, a number, or tiny=X,small=Y")
    p.add_argument("--hf-batch-size", type=int, default=64, help="static batcher's largest batch for P")
    p.add_argument("--check", type=int, default=4, help="W prompts whose tokens are compared across engines")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for tailserve (fixed; default: adaptive to the free cores) and transformers",
    )
    p.add_argument(
        "--also-levels",
        default="",
        help="comma-separated lower CPU levels (e.g. avx512_bf16 on an AMX CPU) at which tailserve "
        "runs again beside its own level, same workloads and P rate: tailserve[LEVEL]",
    )
    p.add_argument("--skip-hf", action="store_true", help="leave out transformers")
    p.add_argument("--skip-vllm", action="store_true", help="leave out vLLM")
    p.add_argument(
        "--vllm-venv",
        default=str(peer_venv("vllm")),
        help="vLLM's CPU build venv (default: $TAILSERVE_PEERS/vllm, else <repo>/.peers/vllm)",
    )
    p.add_argument(
        "--vllm-threads-bind",
        default=None,
        help="VLLM_CPU_OMP_THREADS_BIND values, one vLLM run each (default auto,0-1; --quick: auto)",
    )
    p.add_argument(
        "--vllm-timeout", type=float, default=1800.0, help="seconds for one vLLM run, startup included"
    )
    p.add_argument(
        "--quiet-threshold", type=float, default=0.2, help="busy cores below which the machine is quiet"
    )
    p.add_argument(
        "--quiet-timeout",
        type=float,
        default=None,
        help="seconds to wait for quiet before timing anyway, with a warning (default 600; --quick: 20)",
    )
    p.add_argument("--quick", action="store_true", help="smoke test: tiny only, a few prompts")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float32"),
        help="every engine's dtype (default: auto, tailserve's choice for this CPU: bfloat16 with "
        "AVX-512 or AVX2, float32 without, which has no bf16 matmul)",
    )
    p.add_argument(
        "--vllm-dtype",
        default=None,
        choices=("bfloat16", "float32"),
        help="vLLM's dtype where it should differ from --dtype (e.g. float32, its faster one on an "
        "AVX2 CPU, against tailserve's bfloat16); default: --dtype",
    )
    p.add_argument(
        "--out",
        default=None,
        help="results JSON (default benchmarks/out/engine_cpu[_quick].json, git-ignored)",
    )
    args = p.parse_args(argv)
    if args.dtype == "auto":
        from tailserve.executors.pytorch.backend import auto_dtype

        args.dtype, _ = auto_dtype(torch.device("cpu"))
    args.vllm_dtype = args.vllm_dtype or args.dtype
    quick = args.quick
    args.models = args.models or ("tiny" if quick else "tiny,small")
    args.num_prompts = args.num_prompts or (8 if quick else 64)
    args.num_requests = args.num_requests or (12 if quick else 96)
    args.vllm_threads_bind = args.vllm_threads_bind or ("auto" if quick else "auto,0-1")
    args.quiet_timeout = args.quiet_timeout if args.quiet_timeout is not None else (20.0 if quick else 600.0)
    args.out = (
        Path(args.out) if args.out else default_out("engine_cpu_quick.json" if quick else "engine_cpu.json")
    )
    return args


def check_args(args: argparse.Namespace) -> tuple[list[str], dict[str, float]]:
    presets = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in presets if m not in PRESETS]
    if not presets or unknown:
        raise ValueError(
            f"--models: unknown preset(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(PRESETS)}"
        )
    specs = parse_policy_list(args.policy)
    if len(specs) != 1:
        raise ValueError(f"--policy: give one policy, got {len(specs)} in {args.policy!r}")
    for name in ("num_prompts", "num_requests", "hf_batch_size", "check"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    args.also_levels = [v.strip() for v in args.also_levels.split(",") if v.strip()]
    run = cpu_isa.detect().level
    allowed = IN_PROCESS_LEVELS.get(run, ())
    for level in args.also_levels:
        if level not in allowed:
            raise ValueError(
                f"--also-levels: {level!r} cannot run beside this run's {run} in one process "
                f"(can: {', '.join(allowed) or 'none'}); for another level run the benchmark "
                f"again with TAILSERVE_CPU_ISA=LEVEL, which also lowers PyTorch's dispatch"
            )
    rates = parse_rates(args.rate)
    stray = set(rates) - {"*", *presets}
    if stray:
        raise ValueError(f"--rate names {', '.join(sorted(stray))}, which --models does not run")
    return presets, rates


def limit_gemm_dtype(dtype: str) -> str:
    """The dtype whose matmul rate is the prefill limit: the model's, except bf16 at level avx2,
    where tailserve's kernel widens bf16 weights to float32 and multiplies with float32 FMAs (its
    limit is the float32 rate; PyTorch's own bf16 matmul there is its slow generic one)."""
    if dtype == "bfloat16" and cpu_isa.detect().level == "avx2":
        return "float32"
    return dtype


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        presets, rates = check_args(args)
    except ValueError as exc:
        print(f"engine_cpu: error: {exc}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    binds: list[str] = []
    if not args.skip_vllm:
        if (Path(args.vllm_venv) / "bin" / "python").is_file():
            binds = [b.strip() for b in args.vllm_threads_bind.split(",") if b.strip()]
        else:
            print(
                f"{missing_peer('vllm', args.vllm_venv)} vLLM is skipped (--skip-vllm silences this).",
                flush=True,
            )
    results: dict[str, Any] = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "settings": {
            "policy": args.policy,
            "dtype": args.dtype,
            "vllm_dtype": args.vllm_dtype,
            "cpu_level": cpu_isa.detect().label(),
            "w": {"num_prompts": args.num_prompts, "prompt_len": 256, "max_tokens": 64, "seed": W_SEED},
            "ttft": {"num_prompts": 5, "prompt_len": 256, "max_tokens": 1, "seed": TTFT_SEED},
            "hf_batch_size": args.hf_batch_size if not args.skip_hf else None,
            "vllm_threads_bind": binds,
            "vllm_skipped": "--skip-vllm" if args.skip_vllm else (None if binds else "venv missing"),
            "quiet_threshold_cores": args.quiet_threshold,
            "quiet_timeout_s": args.quiet_timeout,
        },
        "models": {},
    }
    print(
        f"measuring this machine's copy bandwidth and {args.dtype} GEMM rate ({torch.get_num_threads()} "
        "torch threads), once the machine is quiet",
        flush=True,
    )
    quiet = gate(args)
    bandwidth = measure_copy_bandwidth()
    gemm_dtype = limit_gemm_dtype(args.dtype)
    dtype = getattr(torch, gemm_dtype)
    print(gemm_notice(dtype=dtype), flush=True)
    gemm = measure_gemm_flops(dtype=dtype, say=lambda line: print(line, flush=True))
    results["machine_rates"] = {
        "quiet": quiet,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "gemm_dtype": gemm_dtype,
        "gemm_gflop_s": gemm / 1e9,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for preset in presets:
        try:
            results["models"][preset] = bench_model(preset, args, rates, binds, bandwidth, gemm)
        except ValueError as exc:  # e.g. a policy flag value the engine rejects
            print(f"engine_cpu: error: {exc}", file=sys.stderr)
            return 2
        args.out.write_text(json.dumps(results, indent=1))  # what is done so far survives a later failure
    print(cpu_line())
    print_report(results)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
