"""``slo_policy.py --cpu``: the same comparison at small scale on the real PyTorch executor."""

from __future__ import annotations

from typing import Any

import numpy as np


def cpu_comparison(quick: bool, calibration: str | None = None) -> dict[str, Any]:
    """The same comparison at small scale on the real PyTorch executor (the tiny model on this
    CPU, bf16, one torch thread): short prompts decoding while long ones arrive. Time is the
    engine thread's CPU time (``fidelity.recorder.CpuClock``), so other processes on the machine
    do not enter it. ``slo`` runs twice: predicting from a fit to its own measured iterations,
    and, with ``calibration`` (a ``tailserve calibrate --executor torch --cpu-clock --threads 1``
    file), from that file's cost model corrected by measured times."""
    from tailserve.executors.pytorch.init_model import default_model_dir
    from tailserve.fidelity.recorder import install
    from tailserve.fidelity.replay import _TimedQueueSource
    from tailserve.llm import LLMEngine, SamplingParams

    rng = np.random.default_rng(7)
    n = 24 if quick else 48
    arrivals = np.cumsum(rng.exponential(0.25, n))
    planned = []
    for i in range(n):
        long = i % 4 == 0
        prompt = [int(t) for t in rng.integers(10, 1000, 1200 if long else 64)]
        planned.append((prompt, 48, float(arrivals[i])))
    classes = "all=ttft:2s,tbt:150ms"
    rows = []
    runs = [
        ("vllm (default budget)", "vllm", {}, "auto"),
        ("vllm budget 256", "vllm", {"max_num_batched_tokens": "256"}, "auto"),
        ("vllm budget 512", "vllm", {"max_num_batched_tokens": "512"}, "auto"),
        ("slo (fit to measured)", "slo", {"slo_classes": classes}, "auto"),
    ]
    if calibration:
        runs.append(("slo (calibration file)", "slo", {"slo_classes": classes}, calibration))
    for label, policy, flags, cal in runs:
        engine = LLMEngine.from_args(
            str(default_model_dir()),
            executor="torch",
            policy=policy,
            policy_flags=flags,
            dtype="bfloat16",
            threads=1,
            calibration=cal,
        )
        install(engine, cpu_clock=True)
        source = _TimedQueueSource()
        engine.source = engine.engine.source = source
        start = engine.now
        requests = []
        for i, (prompt, max_tokens, at) in enumerate(planned):
            engine.add_request(
                f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
            )
            request = engine.stop_checker.requests[f"r{i}"]
            request.arrival_time = start + at
            requests.append(request)
        while engine.has_unfinished_requests():
            engine.step()
        ttft = [r.token_times[0] - r.arrival_time for r in requests]
        gaps = np.concatenate([np.diff(r.token_times) for r in requests])
        row = {
            "policy": label,
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "tbt_p99_s": float(np.percentile(gaps, 99)),
            "tbt_max_s": float(gaps.max()),
            "predictor": engine.scheduler.policy.predictor.source if policy == "slo" else None,
        }
        rows.append(row)
        print(
            f"  {label:22} TTFT p99 {row['ttft_p99_s']:.3f} s  TBT p99 {row['tbt_p99_s'] * 1e3:.1f} ms"
            f"  max {row['tbt_max_s'] * 1e3:.1f} ms",
            flush=True,
        )
    return {"requests": n, "slo_classes": classes, "calibration": calibration, "rows": rows}
