"""The golden corpus: runs whose every byte must survive a refactor (issue 13).

Each case is a ``tailserve simulate ... --save-run`` command line, run in process through the
CLI (the most stable entry point there is), and its saved run (requests with every token time,
the iteration log, the batch record where ``--explain`` asks for it) reduced to a SHA-256 of
the canonical JSON with the host-dependent ``wall_s`` removed. The real executor's cases are
greedy float32 tokens of a tiny random model on a fixed prompt batch, under several policies.

``python -m tests.golden.record`` writes ``tests/fixtures/golden/corpus.json``; the test
(tests/test_golden_corpus.py) recomputes every case and compares.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "golden" / "corpus.json"
AZURE = "azure_llm_2023_conv.csv"
MOONCAKE = "mooncake_conversation.jsonl"

# trtllm and slo, and the variants from sglang-no-overlap on, recorded at 15b6d2f (r48): until
# then only 2026/llama-3.1-70b-h200-fp8-trtllm covered TensorRT-LLM, and nothing slo.
POLICIES = ("static", "orca", "vllm-v0", "vllm", "sarathi", "sglang", "tgi", "trtllm", "slo")
# Policy variants whose code paths the defaults do not reach (sglang and trtllm run their
# overlap schedulers and vllm async scheduling by default on a GPU: the synchronous ones here).
VARIANTS = (
    ("vllm-priority", ["--policy", "vllm", "--scheduling-policy", "priority"]),
    ("vllm-v0-chunked", ["--policy", "vllm-v0", "--enable-chunked-prefill"]),
    ("sglang-lpm", ["--policy", "sglang", "--schedule-policy", "lpm"]),
    ("sglang-no-overlap", ["--policy", "sglang", "--disable-overlap-schedule"]),
    ("vllm-sync", ["--policy", "vllm", "--no-async-scheduling"]),
    ("trtllm-max-util", ["--policy", "trtllm", "--capacity-scheduler-policy", "MAX_UTILIZATION"]),
    ("trtllm-no-overlap", ["--policy", "trtllm", "--disable-overlap-scheduler"]),
    ("slo-vtc", ["--policy", "slo", "--fairness", "vtc", "--tenants", "a=0.8,b=0.2"]),
)


@dataclass(frozen=True)
class SimCase:
    name: str
    argv: tuple[str, ...]
    needs_trace: str | None = None  # a file of ../shared/traces, placed as {trace}


def sim_cases() -> list[SimCase]:
    cases: list[SimCase] = []
    policies = [(p, ["--policy", p]) for p in POLICIES] + [(n, a) for n, a in VARIANTS]
    for name, pol in policies:
        cases.append(SimCase(f"hol/{name}", (*pol, "--workload", "hol", "--explain")))
        cases.append(
            SimCase(
                f"azure2000/{name}",
                (*pol, "--model", "Llama-3-8B", "--hardware", "H100-SXM", "--trace", "{trace}",
                 "--max-requests", "2000"),
                needs_trace=AZURE,
            )
        )  # fmt: skip
        cases.append(
            SimCase(
                f"shared-prefix/{name}",
                (*pol, "--model", "Llama-3-8B", "--hardware", "A100-80GB", "--workload",
                 "shared-prefix", "--num-requests", "300", "--rate", "8", "--seed", "3"),
            )
        )  # fmt: skip
        cases.append(
            SimCase(
                f"multi-turn/{name}",
                (*pol, "--model", "Llama-3-8B", "--hardware", "A100-80GB", "--workload",
                 "multi-turn", "--num-sessions", "30", "--rate", "2", "--seed", "5"),
            )
        )  # fmt: skip
        # KV pressure: an 8B model on a 45 GB A40 leaves little KV; long outputs at a
        # high rate force preemption (recompute, and swap where the policy can).
        cases.append(
            SimCase(
                f"kv-pressure/{name}",
                (*pol, "--model", "Llama-3-8B", "--hardware", "A40",
                 "--workload", "random", "--num-requests", "300", "--rate", "20",
                 "--input-len", "uniform:256:3000", "--output-len", "uniform:200:1500",
                 "--seed", "7", "--priorities", "0=0.7,5=0.3", "--explain"),
            )
        )  # fmt: skip
    # The Mooncake trace's prompts are keyed by its hash_ids (kv/trace_block_index.py): prefix
    # hits, evictions and preemptions on one A100 (added after the index, recorded at e2e8cca).
    for name in ("vllm", "sglang"):
        cases.append(
            SimCase(
                f"mooncake600/{name}",
                ("--policy", name, "--model", "Llama-3.1-8B", "--hardware", "A100-80GB",
                 "--trace", "{trace}", "--max-requests", "600"),
                needs_trace=MOONCAKE,
            )
        )  # fmt: skip
    cases.append(
        SimCase(
            "kv-pressure/vllm-v0-swap",
            ("--policy", "vllm-v0", "--preemption-mode", "swap", "--model", "Llama-3-8B",
             "--hardware", "A40", "--workload", "random", "--num-requests",
             "300", "--rate", "20", "--input-len", "uniform:256:3000", "--output-len",
             "uniform:200:1500", "--seed", "7", "--explain"),
        )
    )  # fmt: skip
    cases.append(
        SimCase(
            "kv-pressure/sglang-retract",
            ("--policy", "sglang", "--schedule-conservativeness", "0.3", "--model", "Llama-3-8B",
             "--hardware", "A40", "--workload", "random", "--num-requests", "300", "--rate", "20",
             "--input-len", "uniform:256:3000", "--output-len", "uniform:200:1500", "--seed", "7",
             "--explain"),
        )
    )  # fmt: skip
    # 2026's deployments (issue 32): MoE with expert parallelism, MLA, MTP drafting,
    # FP8 / MXFP4 formats, sliding-window layers, each engine's own kernels (a data-parallel
    # engine saves no run, so none is here).
    for name, argv in (
        ("deepseek-v3-h200-ep-mtp",
         ("--policy", "vllm", "--model", "DeepSeek-V3", "--hardware", "H200", "--tp", "8",
          "--enable-expert-parallel", "--speculative-method", "mtp", "--num-speculative-tokens", "2",
          "--synthetic-acceptance-length", "2.4", "--workload", "chat", "--num-requests", "200",
          "--rate", "4", "--seed", "11")),
        ("qwen3-235b-h200-ep-fp8",
         ("--policy", "vllm", "--model", "Qwen3-235B-A22B", "--hardware", "H200", "--tp", "4",
          "--enable-expert-parallel", "--quantization", "fp8", "--workload", "chat",
          "--num-requests", "200", "--rate", "6", "--seed", "12")),
        ("gpt-oss-120b-b200-sglang",
         ("--policy", "sglang", "--model", "gpt-oss-120b", "--hardware", "B200", "--tp", "1",
          "--workload", "random", "--num-requests", "200", "--rate", "8", "--input-len",
          "uniform:256:8000", "--output-len", "uniform:50:800", "--seed", "13")),
        # SGLang with NEXTN (MTP) chain drafts: the decode KV reserve, 1 + accepted per step.
        ("deepseek-v3-h200-fp8-sglang-nextn",
         ("--policy", "sglang", "--model", "DeepSeek-V3", "--hardware", "H200", "--tp", "8",
          "--quantization", "fp8", "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
          "--synthetic-acceptance-length", "2.8", "--workload", "chat", "--num-requests", "200",
          "--rate", "4", "--seed", "15")),
        ("llama-3.1-70b-h200-fp8-trtllm",
         ("--policy", "trtllm", "--model", "Llama-3.1-70B", "--hardware", "H200", "--tp", "2",
          "--quantization", "fp8", "--kv-cache-dtype", "fp8", "--workload", "random",
          "--num-requests", "300", "--rate", "4", "--input-len", "uniform:256:4000",
          "--output-len", "uniform:50:600", "--seed", "14")),
    ):  # fmt: skip
        cases.append(SimCase(f"2026/{name}", argv))
    return cases


def find_trace(name: str) -> Path | None:
    for folder in (REPO.parent / "shared" / "traces", Path("/work/shared/traces")):
        if (folder / name).is_file():
            return folder / name
    return None


def canonical_digest(data: object) -> str:
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def run_sim_case(case: SimCase) -> dict:
    """The case's saved run: its digest and a few figures that say where a difference lies."""
    from tailserve.cli import main

    argv = list(case.argv)
    if case.needs_trace:
        trace = find_trace(case.needs_trace)
        if trace is None:
            raise FileNotFoundError(case.needs_trace)
        argv = [str(trace) if a == "{trace}" else a for a in argv]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.json"
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            rc = main(["simulate", *argv, "--save-run", str(path)])
        if rc != 0:
            raise RuntimeError(f"{case.name}: exit {rc}: {sink.getvalue()[-2000:]}")
        data = json.loads(path.read_text())
    data.pop("wall_s", None)
    summary = data["summary"]
    return {
        "sha256": canonical_digest(data),
        "requests": canonical_digest(data["requests"]),
        "iteration_log": canonical_digest(data["iteration_log"]),
        "batches": canonical_digest(data["batches"]),
        "num_iterations": summary["num_iterations"],
        "num_requests": len(data["requests"]),
        "num_preemptions": sum(r["num_preemptions"] for r in data["requests"]),
        "last_finish": max((r["finish_time"] or 0.0) for r in data["requests"]),
    }


# ---- the real executor ---------------------------------------------------------------------
# (case name, policy, flags, KV pressure). Under pressure the KV cache holds 24 blocks of 16
# tokens for 16 prompts, so requests are preempted (recompute, or swapped by vllm-v0).
TORCH_POLICIES = (
    ("vllm", "vllm", {}, False),
    ("vllm-budget64", "vllm", {"max_num_batched_tokens": 64}, False),
    ("sarathi", "sarathi", {"chunk_size": 32}, False),
    ("sglang", "sglang", {}, False),
    ("tgi", "tgi", {}, False),
    ("vllm-v0", "vllm-v0", {}, False),
    ("orca", "orca", {}, False),
    ("pressure/vllm", "vllm", {}, True),
    ("pressure/vllm-v0-swap", "vllm-v0", {"preemption_mode": "swap", "swap_space": 0.01}, True),
    ("pressure/sglang", "sglang", {}, True),
    ("pressure/sarathi", "sarathi", {"chunk_size": 32}, True),
)
TORCH_PROMPTS = (
    "The scheduler decides",
    "Continuous batching lets a new request join",
    "KV cache blocks are freed when",
    "A long prompt " + "of many words " * 20,
    "Preemption by recompute",
    "Prefix caching shares the system prompt",
    "Prefix caching shares the system prompt and then asks something else",
)
PRESSURE_PROMPTS = tuple(
    f"Request number {i} asks about " + "paged attention and block tables " * (1 + i % 4) for i in range(16)
)


def torch_model_dir(root: Path) -> Path:
    from tailserve.executors.pytorch.init_model import init_model

    out = root / "golden-tiny"
    if not out.exists():
        init_model(out, preset="tiny", seed=1234, dtype="float32", num_hidden_layers=2)
    return out


def run_torch_case(model_dir: Path, policy: str, flags: dict, pressure: bool) -> dict:
    """Greedy tokens per prompt, and the preemptions the run had."""
    from tailserve import LLM, SamplingParams

    kwargs = dict(flags)
    prompts = TORCH_PROMPTS
    max_tokens = 12
    if pressure:
        kwargs.update(max_model_len=256, kv_cache_memory_gib=0.0015)
        prompts, max_tokens = PRESSURE_PROMPTS, 24
    llm = LLM(str(model_dir), policy=policy, dtype="float32", seed=0, check_integrity=True, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(list(prompts), params)
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "num_preemptions": llm.engine.scheduler.num_preemptions,
    }
