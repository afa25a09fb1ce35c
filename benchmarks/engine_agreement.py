"""bf16 greedy tokens of tailserve's real executor against transformers, prompt by prompt.

W's prompts (64 x 256 ids, ``random.Random(1234)``), 64 new tokens each, greedy with
``ignore_eos``: tailserve once per decode-attention kernel (``TAILSERVE_DECODE_KERNEL``: the
AVX-512 bf16 one where the CPU has it, and the portable one) and transformers' ``generate`` on
one batch. Prints, per model, how many prompts agree token for token and the first position
where the others diverge (bf16 rounding flips a near-tie; after it the sequences part). float32
identity is the tests' business (tests/test_torch_executor.py); this reports bf16, not asserts.

    python benchmarks/engine_agreement.py [--models tiny,small] [--num-prompts 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
importlib.import_module("tailserve.executors.pytorch")  # its OpenMP wait policy before torch

from _arrivals import random_prompts  # noqa: E402
from _engine_report import first_divergence  # noqa: E402
from _hf_static import HfStatic  # noqa: E402
from _paths import save_results  # noqa: E402

from tailserve.executors.pytorch import cpu_kernels  # noqa: E402
from tailserve.executors.pytorch.init_model import default_model_dir  # noqa: E402
from tailserve.executors.pytorch.loader import load_config  # noqa: E402
from tailserve.llm import LLM, SamplingParams  # noqa: E402

W_SEED, PROMPT_LEN, MAX_TOKENS = 1234, 256, 64


def tailserve_tokens(
    model_dir: Path, prompts: list[list[int]], kernel: str
) -> tuple[str | None, list[list[int]]]:
    os.environ["TAILSERVE_DECODE_KERNEL"] = kernel
    try:
        llm = LLM(model_dir, policy="vllm", dtype="bfloat16")
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return cpu_kernels.decode_isa(), [list(o.token_ids) for o in outs]
    finally:
        os.environ.pop("TAILSERVE_DECODE_KERNEL", None)


def summary(a: list[list[int]], b: list[list[int]]) -> dict:
    firsts = [first_divergence(x, y) for x, y in zip(a, b)]
    parted = sorted(f for f in firsts if f is not None)
    return {
        "identical": sum(f is None for f in firsts),
        "of": len(firsts),
        "first_divergence": firsts,
        "median_first_divergence": parted[len(parted) // 2] if parted else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,small")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--out", default=None, help="JSON (default benchmarks/out/engine_agreement.json)")
    args = p.parse_args(argv)
    if args.num_prompts < 1:
        print("engine_agreement: error: --num-prompts must be at least 1", file=sys.stderr)
        return 2
    results: dict = {"num_prompts": args.num_prompts, "max_tokens": MAX_TOKENS, "models": {}}
    for preset in [m.strip() for m in args.models.split(",") if m.strip()]:
        model_dir = default_model_dir(preset)
        vocab = load_config(model_dir).vocab_size
        prompts = random_prompts(args.num_prompts, PROMPT_LEN, vocab, W_SEED)
        runs = {}
        for kernel in ("auto", "portable"):
            isa, tokens = tailserve_tokens(model_dir, prompts, kernel)
            runs[f"tailserve[{isa}]"] = tokens
        runs["transformers"] = HfStatic(model_dir, "bfloat16").generate(prompts, MAX_TOKENS)
        names = list(runs)
        entry = {}
        print(f"{preset}: bf16 greedy, {args.num_prompts} prompts x {MAX_TOKENS} tokens")
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                s = summary(runs[a], runs[b])
                entry[f"{a} vs {b}"] = s
                print(
                    f"  {a} vs {b}: {s['identical']}/{s['of']} identical; first divergence of the rest: "
                    f"median {s['median_first_divergence']}, first 8 prompts {s['first_divergence'][:8]}"
                )
        results["models"][preset] = entry
    save_results(results, args.out, "engine_agreement.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
