"""Where one engine step's time goes: W and P of ``engine_cpu.py`` with every stage timed.

The stages are the functions of the live engine, wrapped by an exclusive timer (a stage's
time excludes the stages it calls): scheduling (``Scheduler.schedule``), update
(``Scheduler.update``), input preparation (the executor outside the model and sampler: token
ids, positions, attention metadata), linear layers (every projection through ``model.linear``, packed or ``F.linear``, the LM head included),
attention (``paged_attention``: KV store and attention), the rest of the forward pass (embedding,
RMSNorm, RoPE, SiLU-mul, residual adds), sampling, detokenisation and stop checks
(``StopChecker`` outside the executor), output handling (``LLMEngine._collect``), and the
remainder of the wall time (engine loop, the driver). Fractions matter more than milliseconds on
a shared machine; the timer costs ~1 us per call.

    python benchmarks/engine_profile.py [--models tiny,small] [--workloads W,P] [--threads N]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# tailserve's executor package first: it loads torch with its OpenMP wait setting (threads.py).
importlib.import_module("tailserve.executors.pytorch")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _arrivals import at_rate, drive, poisson_requests, random_prompts  # noqa: E402

from tailserve.core.scheduler import Scheduler  # noqa: E402
from tailserve.executors.pytorch import executor as executor_mod  # noqa: E402
from tailserve.executors.pytorch import model as model_mod  # noqa: E402
from tailserve.executors.pytorch.init_model import default_model_dir  # noqa: E402
from tailserve.executors.pytorch.sampler import Sampler  # noqa: E402
from tailserve.llm import LLM, SamplingParams  # noqa: E402
from tailserve.llm.llm_engine import LLMEngine  # noqa: E402
from tailserve.llm.stop_checker import StopChecker  # noqa: E402

STAGES = (
    "schedule",
    "update",
    "input_prep",
    "linear",
    "attention",
    "forward_other",
    "sampling",
    "detokenise_stop",
    "output",
    "loop_other",
)


class StageTimer:
    """Exclusive time per stage: a wrapped call's time minus the wrapped calls inside it."""

    def __init__(self) -> None:
        self.exclusive: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[float] = []  # child time accumulated per open frame

    def wrap(self, stage: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append(0.0)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - t
                children = self._stack.pop()
                self.exclusive[stage] += elapsed - children
                self.calls[stage] += 1
                if self._stack:
                    self._stack[-1] += elapsed

        return timed

    def reset(self) -> None:
        self.exclusive.clear()
        self.calls.clear()


def install(timer: StageTimer) -> None:
    """Wrap the engine's stages in place (this process only)."""
    Scheduler.schedule = timer.wrap("schedule", Scheduler.schedule)
    Scheduler.update = timer.wrap("update", Scheduler.update)
    cls = executor_mod.TorchExecutor
    cls.execute = timer.wrap("input_prep", cls.execute)
    model_mod.LlamaModel.forward = timer.wrap("forward_other", model_mod.LlamaModel.forward)
    model_mod.paged_attention = timer.wrap("attention", model_mod.paged_attention)
    # model.linear: every projection, packed (bf16 on CPU) or F.linear; F.linear itself stays
    # wrapped for what calls it directly.
    model_mod.linear = timer.wrap("linear", model_mod.linear)
    F.linear = timer.wrap("linear", F.linear)
    Sampler.sample = timer.wrap("sampling", Sampler.sample)
    StopChecker.execute = timer.wrap("detokenise_stop", StopChecker.execute)
    LLMEngine._collect = timer.wrap("output", LLMEngine._collect)


def split(timer: StageTimer, wall_s: float, num_steps: int) -> dict[str, Any]:
    stages = {s: timer.exclusive.get(s, 0.0) for s in STAGES if s != "loop_other"}
    stages["loop_other"] = max(0.0, wall_s - sum(stages.values()))
    return {
        "wall_s": wall_s,
        "num_steps": num_steps,
        "ms_per_step": {s: 1e3 * t / max(num_steps, 1) for s, t in stages.items()},
        "fraction": {s: t / wall_s for s, t in stages.items()},
    }


def profile_model(preset: str, workloads: list[str], timer: StageTimer, rate: float | None) -> dict:
    model_dir = default_model_dir(preset)
    llm = LLM(model_dir, policy="vllm", dtype="bfloat16")
    engine = llm.engine
    vocab = engine.tokenizer.vocab_size
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in random_prompts(2, 64, vocab, 7)], params)
    out: dict[str, Any] = {}
    steps = {"n": 0}
    original_step = LLMEngine.step

    def counted(self: LLMEngine) -> Any:
        steps["n"] += 1
        return original_step(self)

    LLMEngine.step = counted
    try:
        if "W" in workloads:
            prompts = random_prompts(64, 256, vocab, 1234)
            timer.reset()
            steps["n"] = 0
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            wall = time.perf_counter() - t
            out["W"] = split(timer, wall, steps["n"])
            out["W"]["output_tok_s"] = 64 * 64 / wall
        if "P" in workloads:
            unit = poisson_requests(96, vocab)
            mean_out = sum(r.max_tokens for r in unit) / len(unit)
            p_rate = rate or 0.5 * out.get("W", {}).get("output_tok_s", 1000.0) / mean_out
            requests = at_rate(unit, p_rate)

            def add(r: Any) -> None:
                sp = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
                engine.add_request(r.request_id, r.prompt_token_ids, sp)

            def step() -> list[tuple[str, int, bool]]:
                return [(o.request_id, len(o.token_ids), o.finished) for o in engine.step()]

            timer.reset()
            steps["n"] = 0
            t = time.perf_counter()
            drive(requests, add, step, engine.has_unfinished_requests)
            wall = time.perf_counter() - t
            out["P"] = split(timer, wall, steps["n"])
            out["P"]["rate_req_s"] = p_rate
    finally:
        LLMEngine.step = original_step
    return out


def print_split(preset: str, name: str, res: dict[str, Any]) -> None:
    parts = ", ".join(f"{s} {100 * f:.0f}%" for s, f in res["fraction"].items() if f >= 0.005)
    print(f"{preset} {name}: {res['wall_s']:.2f} s, {res['num_steps']} steps; {parts}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,small")
    p.add_argument("--workloads", default="W,P")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--rate", type=float, default=None, help="P rate, req/s (default: half of W's)")
    p.add_argument("--out", default=None, help="JSON results file")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    workloads = [w.strip().upper() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in workloads if w not in ("W", "P")]
    if bad:
        print(f"engine_profile: error: unknown workload(s) {', '.join(bad)}; known: W, P", file=sys.stderr)
        return 2
    timer = StageTimer()
    install(timer)
    results: dict[str, Any] = {"threads": torch.get_num_threads(), "models": {}}
    for preset in [m.strip() for m in args.models.split(",") if m.strip()]:
        res = profile_model(preset, workloads, timer, args.rate)
        results["models"][preset] = res
        for name, r in res.items():
            print_split(preset, name, r)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
