"""One process of ``engine_threads.py``: its OpenMP wait setting came in the environment (read
once, when torch loads); inside it W runs alternate between unpinned and pinned threads, so
both arms of the pinning A/B share the process, the model and the machine's load.

    python benchmarks/_engine_threads_child.py PRESET THREADS RUNS FIRST_ARM   (prints one JSON line)
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _arrivals import random_prompts  # noqa: E402
from _engine_runs import step_profile  # noqa: E402
from _quiet import CpuMeter  # noqa: E402

from tailserve.executors.pytorch.init_model import default_model_dir  # noqa: E402
from tailserve.llm import LLM, SamplingParams  # noqa: E402


def process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _is_decode(log, j: int, batch: int) -> bool:
    return log.num_prefill_tokens[j] == 0 and log.batch_size[j] == batch


def main(preset: str, threads: str, runs: int, first: str) -> None:
    kwargs = {} if threads == "auto" else {"threads": int(threads)}
    llm = LLM(default_model_dir(preset), policy="vllm", dtype="bfloat16", **kwargs)
    engine = llm.engine.engine
    engine.options = dataclasses.replace(engine.options, keep_iteration_log=True)
    ctl = llm.engine.stop_checker.inner.threads
    vocab = llm.engine.tokenizer.vocab_size
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    warm = [{"prompt_token_ids": p} for p in random_prompts(2, 64, vocab, 7)]
    arms = ["unpinned", "pinned"] if first == "unpinned" else ["pinned", "unpinned"]
    out: dict = {"description": llm.engine.description, "runs": []}
    for i in range(runs * 2):
        arm = arms[i % 2]
        ctl.set_pinning(arm == "pinned")
        # Fresh prompts each run (W's shape, another seed): a repeated prompt would hit the
        # prefix cache and skip its prefill.
        prompts = [{"prompt_token_ids": p} for p in random_prompts(64, 256, vocab, 1234 + i)]
        llm.generate(warm, params)  # re-pins (or frees) the team before the timed run
        log = engine.log
        first_step = len(log)
        cpu0 = process_cpu_s()
        with CpuMeter() as meter:
            outs = llm.generate(prompts, params)
        steps = step_profile(log, first_step, len(log), len(prompts), 256, 64)
        decode = steps["decode"] or {}
        # Every step's own duration (schedule + forward + sample): the fastest ones show the
        # step with the machine's load away, which a whole run's wall time cannot.
        full = [log.duration[j] for j in range(first_step, len(log)) if _is_decode(log, j, len(prompts))]
        prefill = [log.duration[j] for j in range(first_step, len(log)) if log.num_decode_tokens[j] == 0]
        out["runs"].append(
            {
                "arm": arm,
                "pinned_now": ctl.pinned_cores() is not None,
                "wall_s": meter.wall_s,
                "output_tok_s": sum(len(o.token_ids) for o in outs) / meter.wall_s,
                "process_cpu_s": process_cpu_s() - cpu0,
                "others_cpu_s": meter.result()["other_cpu_s"],
                "decode_step_b64_s": decode.get("step_s"),
                "decode_b64_durations_s": full,
                "prefill_durations_s": prefill,
                "loadavg": os.getloadavg()[0],
                "threads": ctl.threads,
                "thread_changes": ctl.num_changes,
            }
        )
        time.sleep(0.2)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
