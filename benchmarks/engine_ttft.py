"""Where P's TTFT goes in tailserve, request by request, at one or more token budgets.

P is ``engine_cpu.py``'s Poisson run (96 requests, prompts 32-512, outputs 16-128 ids, bf16,
greedy, each submitted at its arrival time). Each request's TTFT (the driver's clock, from its
scheduled arrival to the step that returned its first token) splits into:

- ``submit``: arrival to ``add_request`` (the driver was inside a step when it arrived);
- ``queue``: ``add_request`` to the first iteration that scheduled it;
- ``prefill``: that iteration's start to the end of the one that sampled its first token (more
  than one when the prompt was chunked or waited beside others);
- ``report``: the end of that iteration to the driver seeing the token (output handling).

The budgets (``--budgets``, vLLM policy ``max_num_batched_tokens``; tailserve's ``LLM`` default is
2,048, vLLM CPU's 4,096) run in one process, interleaved ``--repeats`` times on the same
requests. ``--compare engine_cpu.json`` adds the TTFTs another engine had for the same requests
in that run (e.g. vLLM bind 0-1), side by side with the slowest of ours. Each repeat shifts
the prompts' ids (same lengths and arrivals), so no repeat hits an earlier one's prefix cache.

    python benchmarks/engine_ttft.py [--models tiny] [--rate 8.7] [--budgets 2048,4096] \
        [--repeats 3] [--compare FILE.json] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
importlib.import_module("tailserve.executors.pytorch")  # torch with tailserve's OpenMP wait policy

from _arrivals import TimedRequest, at_rate, drive, percentile, poisson_requests  # noqa: E402
from _paths import save_results  # noqa: E402

from tailserve.executors.pytorch.init_model import default_model_dir  # noqa: E402
from tailserve.llm import LLM, SamplingParams  # noqa: E402


def run_p(llm: LLM, requests: list[TimedRequest]) -> list[dict[str, Any]]:
    """P through the engine's step loop, stamping each phase of every request's TTFT."""
    engine = llm.engine
    log = engine.engine.log
    first_iteration = len(log)
    rows = {
        r.request_id: {"id": r.request_id, "arrival": r.arrival_s, "prompt": len(r.prompt_token_ids)}
        for r in requests
    }

    def add(r: TimedRequest) -> None:
        rows[r.request_id]["added"] = time.perf_counter() - t0
        params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(r.request_id, r.prompt_token_ids, params)

    def step() -> list[tuple[str, int, bool]]:
        outs = engine.step()
        seen = time.perf_counter() - t0
        for o in outs:
            row = rows[o.request_id]
            if o.token_ids and "seen" not in row:
                row["seen"] = seen
                row["scheduled"] = o.first_scheduled_time - e0
                row["first_token"] = o.first_token_time - e0
        return [(o.request_id, len(o.token_ids), o.finished) for o in outs]

    # The driver's own loop (_arrivals.drive) submits and steps; its clock starts microseconds
    # after t0, which the stamps here share.
    t0 = time.perf_counter()
    e0 = engine.now  # the engine's clock at the driver's time zero
    drive(requests, add, step, engine.has_unfinished_requests)
    starts = [log.start[j] - e0 for j in range(first_iteration, len(log))]
    ends = [s + log.duration[j] for s, j in zip(starts, range(first_iteration, len(log)))]
    out = []
    for row in rows.values():
        sched, tok = row["scheduled"], row["first_token"]
        steps = [j for j, s in enumerate(starts) if sched - 1e-9 <= s < tok]
        last = steps[-1] if steps else None
        out.append(
            {
                **row,
                "ttft": row["seen"] - row["arrival"],
                "submit": row["added"] - row["arrival"],
                "queue": sched - row["added"],
                "prefill": tok - sched,
                "report": row["seen"] - tok,
                "num_steps": len(steps),
                "last_step_s": ends[last] - starts[last] if last is not None else None,
                "last_step_tokens": (
                    log.num_prefill_tokens[first_iteration + last]
                    + log.num_decode_tokens[first_iteration + last]
                    if last is not None
                    else None
                ),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="tiny")
    p.add_argument(
        "--rate", type=float, default=8.7, help="P requests/s (engine_cpu's auto rate for tiny was 8.7)"
    )
    p.add_argument("--budgets", default="2048,4096")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--compare", default=None, help="an engine_cpu.py JSON whose engines' P TTFTs to list beside"
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
        if not budgets or min(budgets) < 1 or args.repeats < 1 or not args.rate > 0:
            raise ValueError("--budgets, --repeats and --rate must be positive")
    except ValueError as exc:
        print(f"engine_ttft: error: {exc}", file=sys.stderr)
        return 2
    compare = json.loads(Path(args.compare).read_text()) if args.compare else None
    results: dict[str, Any] = {
        "command": " ".join(["engine_ttft.py", *(argv if argv is not None else sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "models": {},
    }
    for preset in [m.strip() for m in args.models.split(",") if m.strip()]:
        kw = {} if args.threads is None else {"threads": args.threads}
        llms = {
            b: LLM(default_model_dir(preset), policy="vllm", dtype="bfloat16", max_num_batched_tokens=b, **kw)
            for b in budgets
        }
        for llm in llms.values():  # the live engine keeps no iteration log by default
            loop = llm.engine.engine
            loop.options = dataclasses.replace(loop.options, keep_iteration_log=True)
        vocab = next(iter(llms.values())).engine.tokenizer.vocab_size
        requests = at_rate(poisson_requests(96, vocab), args.rate)
        runs: dict[int, list[list[dict]]] = {b: [] for b in budgets}
        for rep in range(args.repeats):
            for b in budgets if rep % 2 == 0 else budgets[::-1]:
                prefix = f"{preset}-{b}-{rep}-"
                reqs = [
                    TimedRequest(
                        prefix + r.request_id,
                        r.arrival_s,
                        _shifted(r.prompt_token_ids, rep, vocab),
                        r.max_tokens,
                    )
                    for r in requests
                ]
                rows = run_p(llms[b], reqs)
                for row in rows:
                    row["id"] = row["id"][len(prefix) :]
                runs[b].append(rows)
                ttfts = [r["ttft"] for r in rows]
                print(
                    f"{preset} budget {b} rep {rep + 1}: TTFT p50 {percentile(ttfts, 50) * 1e3:.0f} ms, "
                    f"p99 {percentile(ttfts, 99) * 1e3:.0f} ms (load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
        model: dict[str, Any] = {"rate_req_s": args.rate, "budgets": {}}
        for b, reps in runs.items():
            p99s = [percentile([r["ttft"] for r in rows], 99) for rows in reps]
            best = reps[p99s.index(min(p99s))]
            worst = sorted(best, key=lambda r: -r["ttft"])[:6]
            parts = ("submit", "queue", "prefill", "report")
            model["budgets"][b] = {
                "ttft_p99_s": p99s,
                "ttft_p50_s": [percentile([r["ttft"] for r in rows], 50) for rows in reps],
                "mean_parts_s": {k: statistics.mean(r[k] for r in best) for k in parts},
                "slowest": worst,
                "requests": best,
            }
            print(
                f"\n{preset} budget {b}: p99 {', '.join(f'{x * 1e3:.0f}' for x in p99s)} ms; slowest of the best run:"
            )
            others = _other_engines(compare, preset)
            head = "  id      prompt  TTFT ms  submit  queue  prefill  report  steps  last step ms/tokens"
            print(head + "".join(f"  {name}" for name in others))
            for r in worst:
                last = f"{r['last_step_s'] * 1e3:.0f}/{r['last_step_tokens']}" if r["last_step_s"] else "-"
                line = (
                    f"  {r['id']:6s} {r['prompt']:6d} {r['ttft'] * 1e3:8.0f} {r['submit'] * 1e3:7.0f}"
                    f" {r['queue'] * 1e3:6.0f} {r['prefill'] * 1e3:8.0f} {r['report'] * 1e3:7.1f} {r['num_steps']:6d}  {last}"
                )
                print(line + "".join(f"  {t.get(r['id'], float('nan')) * 1e3:.0f}" for t in others.values()))
        results["models"][preset] = model
    save_results(results, args.out, "engine_ttft.json")
    return 0


def _shifted(ids: list[int], rep: int, vocab: int) -> list[int]:
    """The same prompt with every id past the specials moved by ``rep``: the same lengths and
    arrivals, but no prefix-cache hit on an earlier repeat's blocks (BOS stays)."""
    return [t if t < 3 else 3 + (t - 3 + rep) % (vocab - 3) for t in ids]


def _other_engines(compare: dict | None, preset: str) -> dict[str, dict[str, float]]:
    """Per engine of an engine_cpu.py JSON: request id -> P TTFT (s)."""
    if not compare or preset not in compare.get("models", {}):
        return {}
    found = {}
    for name, eng in compare["models"][preset]["engines"].items():
        timings = (eng.get("poisson") or {}).get("timings") or []
        found[name] = {
            t["request_id"]: t["first_token_s"] - t["arrival_s"] for t in timings if t["first_token_s"]
        }
    return found


if __name__ == "__main__":
    sys.exit(main())
