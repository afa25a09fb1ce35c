"""The DeepSeek-R1 MLPerf points' decode step, term by term, against TensorRT-LLM's own kernel
tables (docs/fidelity.md, "The R1 decode step, term by term").

NVIDIA's R1 Server points (``fidelity_mlperf``: attention DP 8 x TP 1, EP 8, NVFP4 experts, FP8
KV, CUDA graphs of 128/256/384/512) run ~156 requests per rank at the published rate (1,250 in
flight by Little's law) with a mean context of ~5,080 tokens (the step-weighted mean of the
point's own trace: a request of output L decodes L steps at input + 1..L). This prints the
cost model's step there, each term apart (``tailserve`` side), and the same operators in
AISimulate's TensorRT-LLM tables of the GPU (``--tables`` side, run in AISimulate's venv):

- MLA block (the projections, the fixed and per-request terms, the attention) against
  ``mla_generation_module`` (TensorRT-LLM 1.3.0rc20: the whole MLA module of a decode step, FP8
  KV, 128 heads; its ``gemm_type`` bf16 and nvfp4 rows bracket NVIDIA's checkpoint, whose MLA
  projections are bf16 but ``o_proj``), per layer x 61;
- routed experts against ``wideep_moe`` (1.3.0rc10, WideEP's CUTLASS NVFP4 kernel, EP 8, 256
  slots, power-law routing 1.01 and 1.2: the tables' expert imbalance), per layer x 58;
- the MoE token exchange against ``moe_a2a`` (1.3.0rc11, B200 only: DeepEP low-latency dispatch
  in NVFP4 plus combine in bf16; high-throughput both ways), per layer x 58;
- the shared expert and the router against ``gemm_perf`` (1.3.0rc20), per layer x 58.

Each ``(real, graph)`` row is ``real`` requests per rank replaying the ``graph``-sized CUDA graph
(the dummies' GEMMs priced, their attention not), on every rank alike. The tables' MLA module is
read at the real requests (its dummies' KV is a token or two), the other operators at the
graph's rows. Linear interpolation between the tables' batch sizes and KV lengths.

It also prices NVIDIA's published trtllm-bench max-throughput points (``PUBLISHED``: 1K/2K fixed
lengths, every slot busy) from the same step prices, and with ``--steps`` runs the B200 point's
simulation recording every lockstep step (``CostModel.group_time``): decode-only steps and steps
with a context, their times and batch.

    python -m benchmarks.r1_decode_step [--steps] [--aisimulate-venv DIR] [--out FILE]
    <peers>/aisimulate/bin/python -m benchmarks.r1_decode_step --tables   # the tables alone, JSON
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROWS = ((128, 128), (156, 256), (256, 256), (512, 512))  # (requests per rank, CUDA graph size)
GPUS = {"B200": "b200_sxm", "GB200": "gb200"}
MLA_LAYERS, MOE_LAYERS = 61, 58  # DeepSeek-R1: 61 MLA layers, 58 of them MoE
MODEL = "DeepSeek-R1-FP4-v2"
GRAPHS = (128, 256, 384, 512)


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    import numpy as np

    return float(np.interp(x, xs, ys))


def tables(context: int) -> dict:
    """TensorRT-LLM's operator times (ms, per layer) at ``ROWS`` and ``context`` from AISimulate's
    tables; runs where pandas and aisimulate_core are (the peer venv)."""
    import pandas as pd

    from benchmarks._aisim_tables import systems_dir

    root = systems_dir()
    out: dict = {}
    for gpu, key in GPUS.items():
        d = root / key
        mla = pd.read_parquet(next(d.glob("mla/trtllm/*/mla_generation_module_perf.parquet")))
        mla = mla[(mla.num_heads == 128) & (mla.kv_cache_dtype == "fp8")]
        moe = pd.read_parquet(next(d.glob("moe/trtllm/*/wideep_moe_perf.parquet")))
        moe = moe[(moe.hidden_size == 7168) & (moe.inter_size == 2048) & (moe.moe_ep_size == 8)]
        moe = moe[(moe.num_slots == 256) & (moe.moe_dtype == "nvfp4") & (moe.op_name == "wideep_moe")]
        a2a_files = list(d.glob("comm/trtllm/*/moe_a2a_perf.parquet"))
        a2a = pd.read_parquet(a2a_files[0]) if a2a_files else None
        if a2a is not None:
            a2a = a2a[(a2a.hidden_size == 7168) & (a2a.ep_size == 8) & (a2a.topk == 8)]
            a2a = a2a if len(a2a) else None  # GB200's table times other shapes only
        gemm = pd.read_parquet(next(d.glob("gemm/trtllm/*/gemm_perf.parquet")))
        rows = []
        for real, graph in ROWS:
            row: dict = {"real": real, "graph": graph}
            for gemm_type in ("bfloat16", "nvfp4"):
                g = mla[mla.gemm_type == gemm_type]
                # each table batch at this context, then across the batches
                batches = sorted(g.batch_size.unique())
                at_ctx = [
                    _interp(
                        list(g[g.batch_size == b].sort_values("step").step),
                        list(g[g.batch_size == b].sort_values("step").latency),
                        context,
                    )
                    for b in batches
                ]
                row[f"mla_{gemm_type}"] = _interp(batches, at_ctx, real)
            tokens = graph * 8
            for dist in ("power_law_1.01", "power_law_1.2"):
                m = moe[moe.distribution == dist].groupby("num_tokens").latency.min()
                row[f"moe_{dist}"] = _interp(list(m.index), list(m.values), tokens)
            if a2a is not None:
                for backend, d_dtype, c_dtype in (("trtllm_deepep_ll", "nvfp4", "bfloat16"),
                                                  ("trtllm_deepep_ht", "nvfp4", "bfloat16")):  # fmt: skip
                    b = a2a[a2a.comm_backend == backend]
                    total = 0.0
                    for phase, dtype in (("dispatch", d_dtype), ("combine", c_dtype)):
                        s = (
                            b[(b.phase == phase) & (b.comm_dtype == dtype)]
                            .groupby("num_tokens")
                            .latency.min()
                        )
                        if graph > s.index.max():
                            total = float("nan")  # beyond the kernel's token limit (LL: 256)
                            break
                        total += _interp(list(s.index), list(s.values), graph) * 1e-3  # us -> ms
                    row[backend] = total
            dense = 0.0
            for dtype, n, k in (("nvfp4", 4096, 7168), ("nvfp4", 7168, 2048), ("bfloat16", 256, 7168)):
                s = (
                    gemm[(gemm.gemm_dtype == dtype) & (gemm.n == n) & (gemm.k == k)]
                    .groupby("m")
                    .latency.min()
                )
                dense += _interp(list(s.index), list(s.values), graph)
            row["shared_router"] = dense
            rows.append(row)
        out[gpu] = rows
    return out


def step_context() -> float:
    """The B200 point's step-weighted mean context: sum(input x L + L (L + 1) / 2) / sum(L)
    over its trace's lengths (200,000 draws, seed 0)."""
    import numpy as np

    from benchmarks.fidelity_mlperf import DEEPSEEK_R1, POINTS

    point = next(p for p in POINTS if p.name == "nvidia-b200-r1")
    inputs, outputs = DEEPSEEK_R1.sample(200_000, point.out_mean, np.random.default_rng(0))
    return float((inputs * outputs + outputs * (outputs + 1) / 2).sum() / outputs.sum())


def tailserve_terms(gpu: str, real: int, graph: int, context: int) -> dict:
    """The cost model's step (ms) of ``real`` decodes of ``context`` tokens per rank on every
    rank, padded to ``graph`` (cuda_graph.py), and its terms."""
    from tailserve.executors.simulated.cost_model import BatchShape
    from tailserve.executors.simulated.cuda_graph import CudaGraphPadding
    from tailserve.executors.simulated.deployment import Deployment, build_cost_model

    deployment = Deployment(
        model=MODEL, hardware=gpu, tp=1, quantization="nvfp4", kv_cache_dtype="fp8",
        expert_parallel=True, dp=8, kernels="trtllm",
    )  # fmt: skip
    cm = build_cost_model(deployment, "trtllm").cost_model
    shape = CudaGraphPadding(GRAPHS).pad(BatchShape.of([], [context] * real), real, graph)
    n = shape.num_tokens
    experts_all = cm._experts(n)
    exchange = cm.model.num_moe_layers * cm.exchange_time(n)
    mla_proj = cm._mla_projections(n)
    head = cm._head(shape.num_logits)
    dense = cm._linear(n, shape.num_logits) - experts_all - mla_proj - head
    terms = {
        "step": cm.group_time([shape] * 8),
        "mla_projections": mla_proj,
        "mla_fixed_per_request": cm.mla_fixed_time(shape),
        "mla_attention": cm.attention_time(shape),
        "experts": experts_all - exchange,
        "exchange": exchange,
        "dense": dense,
        "lm_head": head,
        "overhead": cm.efficiency.overhead,
    }
    terms["mla_block"] = terms["mla_projections"] + terms["mla_fixed_per_request"] + terms["mla_attention"]
    return {k: v * 1e3 for k, v in terms.items()}


# NVIDIA's trtllm-bench max-throughput points, 8xB200, ADP 8 x EP 8, ISL/OSL 1,024 / 2,048 fixed
# (TensorRT-LLM docs/source/blogs/Best_perf_practice_on_DeepSeek-R1_in_TensorRT-LLM.md): (label,
# catalog model, KV format, requests per rank, output tok/s/GPU published)
PUBLISHED = (
    ("nvidia/DeepSeek-R1-FP4, bf16 KV, 384 per rank", "DeepSeek-R1-FP4", "", 384, 4548.0),
    ("nvidia/DeepSeek-R1-0528-FP4, FP8 KV, 896 per rank", "DeepSeek-R1-FP4-v2", "fp8", 896, 5393.0),
)


def published_estimate(model: str, kv: str, n: int, isl: int = 1024, osl: int = 2048) -> dict:
    """A max-throughput point's mean step from the cost model's step prices: a decode-only step
    of ``n`` requests per rank at the mean context ``isl + osl / 2``, and a step in which one rank
    also runs an ``isl``-token context (the lockstep group waits for it); each rank starts
    ``n / (osl + 1)`` contexts a step, so some rank has one in ``1 - (1 - n / (osl + 1))^8`` of
    the steps (no balancing)."""
    from tailserve.executors.simulated.cost_model import BatchShape
    from tailserve.executors.simulated.deployment import Deployment, build_cost_model

    deployment = Deployment(
        model=model, hardware="B200", tp=1, quantization="nvfp4", kv_cache_dtype=kv,
        expert_parallel=True, dp=8, kernels="trtllm",
    )  # fmt: skip
    cm = build_cost_model(deployment, "trtllm").cost_model
    context = isl + osl // 2
    decode = BatchShape.of([], [context] * n)
    pure = cm.group_time([decode] * 8)
    mixed = cm.group_time([BatchShape.of([(isl, 0)], [context] * (n - 1))] + [decode] * 7)
    share = 1.0 - (1.0 - min(1.0, n / (osl + 1))) ** 8
    step = (1.0 - share) * pure + share * mixed
    return {"decode_ms": pure * 1e3, "with_context_ms": mixed * 1e3, "context_share": share,
            "step_ms": step * 1e3, "tok_s_gpu": n / step}  # fmt: skip


def recorded_steps(name: str = "nvidia-b200-r1", window: tuple[float, float] = (150.0, 550.0)) -> dict:
    """The MLPerf point's simulation (``fidelity_mlperf.simulate``: its trace, flags, 600 s of
    arrivals) with every lockstep step recorded, summarised over ``window`` seconds of simulated
    time: decode-only steps and steps with a context."""
    import numpy as np

    from benchmarks.fidelity_mlperf import POINTS, requests_for, simulate
    from tailserve.executors.simulated.cost_model import CostModel

    rec: list[tuple[float, int, int, int, int]] = []
    original = CostModel.group_time

    def recording(self, shapes, windows=None):  # the group's step, as priced, and its batch
        t = original(self, shapes, windows)
        live = [x for x in shapes if x is not None]
        decode_kv = sum(x.decode_kv_tokens for x in live)
        rec.append(
            (t, sum(x.num_prefills for x in live), sum(x.num_decodes for x in live), len(live), decode_kv)
        )
        return t

    point = next(p for p in POINTS if p.name == name)
    CostModel.group_time = recording
    try:
        rate = point.scheduled_qps / point.replicas
        pred = simulate(point, rate, requests_for(rate, 600.0))  # fidelity_mlperf's run, as its table's
    finally:
        CostModel.group_time = original
    a = np.array(rec)
    clock = np.cumsum(a[:, 0])
    mid = (clock > window[0]) & (clock < window[1])
    out = {"ttft_ms": pred.ttft_ms, "tpot_ms": pred.tpot_ms, "in_flight": pred.in_flight}
    for label, m in (("decode_only", mid & (a[:, 1] == 0)), ("with_context", mid & (a[:, 1] > 0))):
        out[label] = {
            "steps": int(m.sum()),
            "share_of_steps": float(m.sum() / mid.sum()),
            "share_of_time": float(a[m, 0].sum() / a[mid, 0].sum()),
            "mean_ms": float(a[m, 0].mean() * 1e3),
            "decodes_per_rank": float((a[m, 2] / a[m, 3]).mean()),  # graph dummies included
            "contexts_per_step": float(a[m, 1].mean()),
            "kv_per_decode_slot": float(a[m, 4].sum() / a[m, 2].sum()),  # graph dummies hold none
        }
    out["mean_ms"] = float(a[mid, 0].mean() * 1e3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tables", action="store_true", help="print the tables' side as JSON (AISimulate's venv)"
    )
    parser.add_argument("--steps", action="store_true", help="also run the B200 point recording its steps")
    parser.add_argument("--context", type=int, default=0, help="mean context (default: the point's own)")
    parser.add_argument("--aisimulate-venv", default=None, help="default: <peers>/aisimulate")
    parser.add_argument(
        "--out", default=None, help="results JSON (default benchmarks/out/r1_decode_step.json)"
    )
    args = parser.parse_args()
    if args.tables:
        json.dump(tables(args.context), sys.stdout)
        return 0
    from benchmarks._common import missing_peer, module_cmd, module_env, peer_venv, save_results

    context = args.context or round(step_context())
    ours = {gpu: [tailserve_terms(gpu, r, g, context) for r, g in ROWS] for gpu in GPUS}
    venv = Path(args.aisimulate_venv) if args.aisimulate_venv else peer_venv("aisimulate")
    theirs = None
    if (venv / "bin" / "python").exists():
        cmd = module_cmd(venv / "bin" / "python", "r1_decode_step", "--tables", "--context", str(context))
        theirs = json.loads(subprocess.run(cmd, check=True, env=module_env(), capture_output=True).stdout)
    else:
        print(missing_peer("aisimulate", venv), file=sys.stderr)
    print(f"{MODEL}, ADP 8 x TP 1, EP 8, NVFP4, FP8 KV, TensorRT-LLM kernels; mean context {context} tokens")
    for gpu in GPUS:
        for i, (real, graph) in enumerate(ROWS):
            t = ours[gpu][i]
            line = (
                f"{gpu:5s} {real:3d} in a {graph:3d} graph: step {t['step']:5.1f} ms = MLA {t['mla_block']:4.1f} "
                f"(proj {t['mla_projections']:.1f}, fixed+per-request {t['mla_fixed_per_request']:.1f}, "
                f"attention {t['mla_attention']:.1f}) + experts {t['experts']:4.1f} + exchange {t['exchange']:4.1f} "
                f"+ dense {t['dense']:.1f} + head {t['lm_head']:.1f} + overhead {t['overhead']:.1f}"
            )
            print(line)
            if theirs:
                r = theirs[gpu][i]
                a2a = [
                    f"{k.split('_')[-1].upper()} {r[k] * MOE_LAYERS:4.1f}"
                    for k in ("trtllm_deepep_ll", "trtllm_deepep_ht")
                    if k in r
                ]
                print(
                    f"      TRT-LLM tables: MLA {r['mla_bfloat16'] * MLA_LAYERS:4.1f} (bf16 GEMMs) / "
                    f"{r['mla_nvfp4'] * MLA_LAYERS:4.1f} (nvfp4); experts {r['moe_power_law_1.01'] * MOE_LAYERS:4.1f} "
                    f"(power law 1.01) / {r['moe_power_law_1.2'] * MOE_LAYERS:4.1f} (1.2); exchange "
                    f"{', '.join(a2a) or 'no table'}; shared expert + router {r['shared_router'] * MOE_LAYERS:.1f}"
                )
    published = {}
    for label, model, kv, n, tok_s in PUBLISHED:
        e = published_estimate(model, kv, n)
        published[label] = {**e, "published_tok_s_gpu": tok_s}
        print(
            f"{label}: decode {e['decode_ms']:.1f} ms, with a context {e['with_context_ms']:.1f} ms in "
            f"{e['context_share']:.2f} of steps: {e['step_ms']:.1f} ms, {e['tok_s_gpu']:,.0f} tok/s/GPU "
            f"(published {tok_s:,.0f}: {n / tok_s * 1e3:.1f} ms; {e['tok_s_gpu'] / tok_s - 1:+.0%})"
        )
    steps = recorded_steps() if args.steps else None
    if steps:
        print(f"B200 point, simulated: TTFT p50 {steps['ttft_ms'][0]:.1f} ms, TPOT p50 {steps['tpot_ms'][0]:.1f} ms, "
              f"{steps['in_flight']:.0f} in flight, mean step {steps['mean_ms']:.1f} ms")  # fmt: skip
        for kind in ("decode_only", "with_context"):
            k = steps[kind]
            print(
                f"  {kind}: {k['steps']} steps ({k['share_of_steps']:.0%}, {k['share_of_time']:.0%} of the time), "
                f"{k['mean_ms']:.1f} ms, {k['decodes_per_rank']:.1f} decodes per rank, {k['contexts_per_step']:.2f} contexts, "
                f"{k['kv_per_decode_slot']:,.0f} KV tokens per decode slot"
            )
    results = {"context": context, "rows": ROWS, "tailserve": ours, "trtllm_tables": theirs,
               "published": published, "steps": steps}  # fmt: skip
    save_results(results, args.out, "r1_decode_step.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
