"""What ``engine_cpu.py`` prints and derives: token agreement, ratios, machine facts, tables."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def token_agreement(engines: dict[str, dict]) -> dict[str, Any]:
    """Greedy W outputs of each pair, prompt by prompt: None where identical, else the first
    position that differs (bf16 rounding can flip a near-tie late in a sequence)."""
    outputs = {name: e["w"]["outputs"] for name, e in engines.items() if "w" in e}
    names = list(outputs)
    result = {}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            firsts = [first_divergence(x, y) for x, y in zip(outputs[a], outputs[b])]
            result[f"{a} vs {b}"] = {"identical": all(f is None for f in firsts), "first_divergence": firsts}
    return result


def ratios(engines: dict[str, dict]) -> dict[str, Any]:
    """tailserve / peer: above 1 is better for throughput, below 1 is better for latency."""
    ts = engines["tailserve"]
    result = {}
    for name, peer in engines.items():
        if name == "tailserve" or "w" not in peer:
            continue
        result[f"tailserve/{name}"] = {
            "w_output_tok_s": ts["w"]["output_tok_s"] / peer["w"]["output_tok_s"],
            "p_output_tok_s": ts["poisson"]["output_tok_s"] / peer["poisson"]["output_tok_s"],
            "ttft_single": ts["ttft"]["median_s"] / peer["ttft"]["median_s"],
            "p_ttft_p50": ts["poisson"]["ttft_p50_s"] / peer["poisson"]["ttft_p50_s"],
            "p_ttft_p99": ts["poisson"]["ttft_p99_s"] / peer["poisson"]["ttft_p99_s"],
            "p_e2e_p50": ts["poisson"]["e2e_p50_s"] / peer["poisson"]["e2e_p50_s"],
        }
    return result


def machine_info() -> dict[str, Any]:
    import transformers

    import tailserve

    cpuinfo = Path("/proc/cpuinfo").read_text()
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():  # the first processor's entries
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    commit = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=HERE, capture_output=True, text=True
    )
    return {
        "cpu_model": fields.get("model name"),
        "num_cpus": os.cpu_count(),
        "cpu_flags": sorted(
            flags & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"}
        ),
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "env": {
            k: os.environ.get(k)
            for k in (
                "OMP_NUM_THREADS",
                "MKL_NUM_THREADS",
                "OMP_WAIT_POLICY",
                "KMP_BLOCKTIME",
                "GOMP_SPINCOUNT",
                "VLLM_CPU_OMP_THREADS_BIND",
                "VLLM_CPU_KVCACHE_SPACE",
                "TAILSERVE_CPU_ISA",
                "TAILSERVE_MALLOC",
                "LD_PRELOAD",
            )
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tailserve": getattr(tailserve, "__version__", None),
            "git": commit.stdout.strip() or None,
        },
        "platform": platform.platform(),
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}"


def _quiet_mark(engine: dict[str, Any]) -> str:
    """'yes' if every section started on a quiet machine; the most CPU-s others used in one."""
    sections = [engine[k] for k in ("w", "ttft", "poisson") if k in engine]
    quiet = all(s["quiet"]["quiet"] for s in sections)
    other = max(s["cpu"]["other_cpu_s"] for s in sections)
    return f"{'yes' if quiet else 'NO'} / {other:.1f}"


def print_report(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    # Wide tables stay readable in a log; no markup: engine names hold brackets ("vllm[auto]").
    console = Console(width=max(Console().width, 150), markup=False)
    settings = results["settings"]
    dtype = settings.get("dtype", "bfloat16")
    vllm_dtype = settings.get("vllm_dtype") or dtype
    dtypes = dtype if vllm_dtype == dtype else f"{dtype}, vLLM {vllm_dtype}"
    table = Table(title=f"Real executor on CPU ({dtypes}, greedy, ignore_eos)")
    for col in (
        "model",
        "engine",
        "W wall s",
        "W tok/s",
        "TTFT 1 req ms",
        "P tok/s",
        "P TTFT p50 ms",
        "P TTFT p99 ms",
        "P E2E p50 s",
        "quiet / other CPU-s",
    ):
        table.add_column(col, justify="left" if col in ("model", "engine") else "right")
    for preset, model in results["models"].items():
        for name, e in model["engines"].items():
            if "error" in e:
                table.add_row(preset, name, e["error"], *[""] * 7)
                continue
            w, p = e["w"], e["poisson"]
            table.add_row(
                preset,
                name,
                f"{w['wall_s']:.2f}",
                f"{w['output_tok_s']:,.0f}",
                _ms(e["ttft"]["median_s"]),
                f"{p['output_tok_s']:,.0f}",
                _ms(p["ttft_p50_s"]),
                _ms(p["ttft_p99_s"]),
                f"{p['e2e_p50_s']:.2f}",
                _quiet_mark(e),
            )
    console.print(table)

    ratio_table = Table(title="tailserve / peer (throughput: >1 better; latency: <1 better)")
    for col in ("model", "peer", "W tok/s", "P tok/s", "TTFT 1 req", "P TTFT p50", "P TTFT p99", "P E2E p50"):
        ratio_table.add_column(col, justify="left" if col in ("model", "peer") else "right")
    for preset, model in results["models"].items():
        for pair, r in model["ratios"].items():
            ratio_table.add_row(
                preset,
                pair.split("/", 1)[1],
                *(
                    f"{r[k]:.2f}x"
                    for k in (
                        "w_output_tok_s",
                        "p_output_tok_s",
                        "ttft_single",
                        "p_ttft_p50",
                        "p_ttft_p99",
                        "p_e2e_p50",
                    )
                ),
            )
    console.print(ratio_table)

    rates = results["machine_rates"]
    roof = Table(
        title=f"tailserve against this machine's limits (copy {rates['copy_bandwidth_gb_s']:.1f} GB/s, "
        f"{rates.get('gemm_dtype', 'bfloat16')} GEMM {rates['gemm_gflop_s']:.0f} GFLOP/s)"
    )
    for col in ("model", "step", "measured ms", "limit ms", "fraction"):
        roof.add_column(col, justify="left" if col in ("model", "step") else "right")
    for preset, model in results["models"].items():
        r = model["roofline"]
        d = r.get("decode")
        if d is not None:
            roof.add_row(
                preset,
                f"decode, batch {d['batch_size']}: weights",
                f"{d['step_s'] * 1e3:.1f}",
                f"{d['weights_limit_s'] * 1e3:.2f}",
                f"{d['fraction_of_weights_limit']:.0%}",
            )
            roof.add_row(
                preset,
                f"decode, batch {d['batch_size']}: weights + KV",
                f"{d['step_s'] * 1e3:.1f}",
                f"{d['weights_and_kv_limit_s'] * 1e3:.2f}",
                f"{d['fraction_of_weights_and_kv_limit']:.0%}",
            )
        for key in ("prefill_batch", "prefill_single"):
            if key in r:
                q = r[key]
                roof.add_row(
                    preset,
                    f"{key.replace('_', ' ')}, {q['num_tokens']} tokens",
                    f"{q['time_s'] * 1e3:.1f}",
                    f"{q['flop_limit_s'] * 1e3:.2f}",
                    f"{q['fraction_of_flop_limit']:.0%}",
                )
    console.print(roof)

    for preset, model in results["models"].items():
        for pair, agree in model["token_agreement"].items():
            where = (
                "identical"
                if agree["identical"]
                else f"first divergence per prompt {agree['first_divergence']}"
            )
            console.print(f"{preset}: {pair} (first {len(agree['first_divergence'])} W prompts): {where}")
        w = model["poisson_workload"]
        console.print(
            f"{preset}: P = {w['num_requests']} requests at {w['rate_req_s']:.2f} req/s ({w['rate_source']})"
        )
