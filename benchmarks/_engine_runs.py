"""The timed sections of ``engine_cpu.py`` and the three engines that run them.

W (one offline batch), single-request TTFT and the Poisson run are timed the same way for
tailserve and transformers in this process (``timed_*``), and mirrored by ``_vllm_driver.py``
inside vLLM's venv. Each section first waits for a quiet machine and records its CPU use.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._arrivals import RequestTiming, TimedRequest, at_rate, drive, median, summarize
from benchmarks._common import CpuMeter, gated, module_cmd, module_env
from tailserve.llm import LLM, SamplingParams
from tailserve.policies.registry import parse_policy_list

HERE = Path(__file__).resolve().parent
DTYPE = "bfloat16"  # the weights on disk and every engine's default dtype (--dtype changes it)


Generate = Callable[[list[list[int]], int], list[list[int]]]  # (prompts, max_tokens) -> new ids


def gate(args: argparse.Namespace) -> dict[str, Any]:
    return gated(args.quiet_threshold, args.quiet_timeout)


def _say_next(engine: str, work: dict[str, Any], args: argparse.Namespace, limit: str = "") -> None:
    """One line before an engine's sections, which print nothing until W is done."""
    print(
        f"    {engine}: load, warm up, then W ({len(work['w'])} prompts x {len(work['w'][0])} tokens, "
        f"{work['w_max_tokens']} new each), TTFT and P, each after a quiet-machine wait{limit}",
        flush=True,
    )


def timed_w(generate: Generate, prompts: list[list[int]], max_tokens: int, args: argparse.Namespace) -> dict:
    quiet = gate(args)
    with CpuMeter() as meter:
        outputs = generate(prompts, max_tokens)
    num_out = sum(len(o) for o in outputs)
    return {
        "quiet": quiet,
        "cpu": meter.result(),
        "wall_s": meter.wall_s,
        "output_tokens": num_out,
        "output_tok_s": num_out / meter.wall_s,
        "outputs": [list(o) for o in outputs[: args.check]],
    }


def timed_ttft(generate: Generate, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    quiet = gate(args)
    times = []
    with CpuMeter() as meter:
        for prompt in prompts:
            t = time.perf_counter()
            generate([prompt], 1)
            times.append(time.perf_counter() - t)
    return {"quiet": quiet, "cpu": meter.result(), "runs_s": times, "median_s": median(times)}


def timed_poisson(run: Callable[[], list[RequestTiming]], args: argparse.Namespace) -> dict:
    quiet = gate(args)
    with CpuMeter() as meter:
        timings = run()
    return {
        "quiet": quiet,
        "cpu": meter.result(),
        **summarize(timings),
        "timings": [t.to_json() for t in timings],
    }


# ---- engines ---------------------------------------------------------------------------------
def run_tailserve(model_dir: Path, args: argparse.Namespace, work: dict[str, Any]) -> dict[str, Any]:
    spec = parse_policy_list(args.policy)[0]
    _say_next("tailserve", work, args)
    t = time.perf_counter()
    llm = LLM(
        model_dir, policy=spec.name, dtype=args.dtype, threads=args.threads, **spec.flags, **spec.engine_flags
    )
    result: dict[str, Any] = {"startup_s": time.perf_counter() - t, "description": llm.engine.description}
    # Whether the last layer after attention runs on the sampled rows alone (the roofline's FLOPs).
    model = getattr(llm.engine.stop_checker.inner, "model", None)
    result["last_layer_rows_only"] = bool(getattr(model, "packed", False))

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]

    # The live engine keeps no iteration log by default; the step profile below reads it.
    engine_loop = llm.engine.engine
    engine_loop.options = dataclasses.replace(engine_loop.options, keep_iteration_log=True)
    generate(work["warmup"], 8)
    log = engine_loop.log
    first = len(log)
    threads = llm.engine.stop_checker.inner.threads  # the executor's ThreadController (None on CUDA)
    before = threads.seconds_at() if threads is not None else None
    result["w"] = timed_w(generate, work["w"], work["w_max_tokens"], args)
    if before is not None:
        result["w"]["seconds_at_threads"] = _since(before, threads.seconds_at())
    result["w"]["steps"] = step_profile(
        log, first, len(log), len(work["w"]), len(work["w"][0]), work["w_max_tokens"]
    )
    at = result["w"].get("seconds_at_threads")
    print(
        f"    tailserve W {result['w']['wall_s']:.2f} s, {result['w']['output_tok_s']:.0f} tok/s"
        + (f" (seconds at each thread count: {at})" if at else ""),
        flush=True,
    )
    result["ttft"] = timed_ttft(generate, work["ttft"], args)
    rate = work["rate"](result["w"]["output_tok_s"])
    requests = at_rate(work["poisson_unit"], rate)
    engine = llm.engine

    def add(r: TimedRequest) -> None:
        params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(r.request_id, r.prompt_token_ids, params)

    def step() -> list[tuple[str, int, bool]]:
        return [(o.request_id, len(o.token_ids), o.finished) for o in engine.step()]

    before = threads.seconds_at() if threads is not None else None
    result["poisson"] = timed_poisson(
        lambda: drive(requests, add, step, engine.has_unfinished_requests), args
    )
    result["poisson"]["rate_req_s"] = rate
    if before is not None:
        result["poisson"]["seconds_at_threads"] = _since(before, threads.seconds_at())
    result["seconds_at_threads"] = threads.seconds_at() if threads is not None else None
    return result


def _since(before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """Seconds at each thread count between two ``ThreadController.seconds_at`` readings."""
    return {
        str(k): round(v - before.get(k, 0.0), 3)
        for k, v in sorted(after.items())
        if v - before.get(k, 0.0) > 0
    }


def step_profile(log: Any, first: int, last: int, batch_size: int, prompt_len: int, max_tokens: int) -> dict:
    """W's iterations from the engine's log: decode-only steps at the full batch (start-to-start
    period, and schedule + forward + sample alone) and the largest prefill-only step."""
    decode = [
        i for i in range(first, last) if log.num_prefill_tokens[i] == 0 and log.batch_size[i] == batch_size
    ]
    periods = [log.start[i + 1] - log.start[i] for i in decode if i + 1 < last]
    prefill = [
        i for i in range(first, last) if log.num_decode_tokens[i] == 0 and log.num_prefill_tokens[i] > 0
    ]
    out: dict[str, Any] = {"num_steps": last - first, "decode": None, "prefill_batch": None}
    if periods:
        out["decode"] = {
            "batch_size": batch_size,
            "num_steps": len(periods),
            # Contexts grow from prompt_len to prompt_len + max_tokens over the decode phase.
            "mean_context_len": prompt_len + max_tokens / 2,
            "step_s": median(periods),
            "schedule_and_forward_s": median([log.duration[i] for i in decode]),
        }
    if prefill:
        i = max(prefill, key=lambda j: log.num_prefill_tokens[j])
        tokens = log.num_prefill_tokens[i]
        out["prefill_batch"] = {
            "num_tokens": tokens,
            "num_sampled_rows": max(1, tokens // prompt_len),  # W's prompts fill the budget whole
            "time_s": log.duration[i],
        }
    return out


def run_hf(
    model_dir: Path, args: argparse.Namespace, work: dict[str, Any], requests: list[TimedRequest]
) -> dict:
    from _hf_static import HfStatic, drive_static

    _say_next("transformers", work, args)
    t = time.perf_counter()
    hf = HfStatic(model_dir, args.dtype)
    result: dict[str, Any] = {
        "startup_s": time.perf_counter() - t,
        "attn_implementation": hf.model.config._attn_implementation,
    }
    hf.generate(work["warmup"], 8)
    result["w"] = timed_w(hf.generate, work["w"], work["w_max_tokens"], args)
    print(
        f"    transformers W {result['w']['wall_s']:.2f} s, {result['w']['output_tok_s']:.0f} tok/s",
        flush=True,
    )
    result["ttft"] = timed_ttft(hf.generate, work["ttft"], args)
    result["poisson"] = timed_poisson(lambda: drive_static(hf, requests, args.hf_batch_size), args)
    result["batch_size"] = args.hf_batch_size
    return result


def run_vllm(
    model_dir: Path, bind: str, args: argparse.Namespace, work: dict[str, Any], requests: list[TimedRequest]
) -> dict:
    """One vLLM instance in its venv (``_vllm_driver.py``); its log stays in a temporary folder."""
    python = Path(args.vllm_venv) / "bin" / "python"
    folder = Path(tempfile.mkdtemp(prefix="engine_cpu_vllm_"))
    spec = {
        "model_dir": str(model_dir),
        "dtype": getattr(args, "vllm_dtype", None) or args.dtype,
        "max_model_len": None,
        "w_prompts": work["w"],
        "w_max_tokens": work["w_max_tokens"],
        "ttft_prompts": work["ttft"],
        "warmup_prompts": work["warmup"],
        "poisson": [r.to_json() for r in requests],
        "check_k": args.check,
        "quiet": {"threshold_cores": args.quiet_threshold, "timeout_s": args.quiet_timeout},
    }
    (folder / "spec.json").write_text(json.dumps(spec))
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "HF_HUB_OFFLINE": "1",  # the model is a local directory; never reach for a hub
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    cmd = module_cmd(python, "_vllm_driver", folder / "spec.json", folder / "out.json")
    # Its log goes to a file: say what runs and for how long at most, or the wait looks hung.
    _say_next(f"vLLM (bind {bind})", work, args, f"; up to {args.vllm_timeout:.0f} s (--vllm-timeout)")
    log_path = folder / "vllm.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, env=module_env(env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=args.vllm_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # the driver's session: it and vLLM's engine-core process
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = None
    if rc != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        why = f"timed out after {args.vllm_timeout} s" if rc is None else f"exited with status {rc}"
        print(f"    vLLM (bind {bind}) {why}; log: {log_path}", flush=True)
        print("      " + "\n      ".join(tail[-8:]), flush=True)
        return {"error": why, "log": str(log_path), "log_tail": tail, "threads_bind": bind}
    result = json.loads((folder / "out.json").read_text())
    result["log"] = str(log_path)
    result["threads_bind"] = bind
    print(
        f"    vLLM (bind {bind}) W {result['w']['wall_s']:.2f} s, {result['w']['output_tok_s']:.0f} tok/s "
        f"(startup {result['startup_s']:.0f} s)",
        flush=True,
    )
    return result
