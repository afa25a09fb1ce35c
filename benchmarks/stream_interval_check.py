"""``stream_interval`` against vLLM's and SGLang's own code: for random requests (an interval, a
request's own value or none, 1 to 60 steps of 1 token, or of 1 to 4 as speculative steps), the
steps at which each engine's streaming code sends a chunk (``validate/drivers/stream_interval.py``, run
in the peer venvs) against tailserve's rule (``core/stream_interval.py``: ``Chunker``, ``for_request``).

    python -m benchmarks.stream_interval_check [--cases 2000] [--seed 0] [--out FILE]

Needs the peer venvs (``bash scripts/setup-peers.sh vllm sglang``); an engine without one is
skipped with a line saying so. Prints the agreement per engine and saves it as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

from tailserve.core.stream_interval import Chunker, StreamInterval
from tailserve.validate.peers import DRIVERS, peer_python

PEER_SCRIPT = DRIVERS / "stream_interval.py"
# the engine, its peer venv's engine name, and how a request's own value acts (core/stream_interval.py)
ENGINES = {"vllm": ("vllm", "max"), "sglang": ("sglang", "replace")}


def cases(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(1, 60)
        spec = rng.random() < 0.4
        steps = [rng.randint(1, 4) if spec else 1 for _ in range(length)]
        request = rng.choice([None, None, rng.randint(1, 12)])
        out.append({"interval": rng.randint(1, 12), "request": request, "steps": steps})
    return out


def tailserve_sent(case: dict, per_request: str) -> list[int]:
    rule = StreamInterval(case["interval"], "tokens", per_request).for_request(case["request"])
    chunker = Chunker(rule)
    last = len(case["steps"]) - 1
    return [i for i, k in enumerate(case["steps"]) if chunker.take(k, finished=i == last)]


def check(engine: str, batch: list[dict]) -> dict | None:
    venv, per_request = ENGINES[engine]
    python = peer_python(venv)
    if python is None:
        print(f"{engine}: no peer venv (bash scripts/setup-peers.sh {venv}); skipped", file=sys.stderr)
        return None
    payload = json.dumps({"engine": engine, "cases": batch})
    done = subprocess.run(
        [str(python), str(PEER_SCRIPT)], input=payload, capture_output=True, text=True, check=True
    )
    theirs = json.loads(done.stdout.strip().splitlines()[-1])["sent"]
    ours = [tailserve_sent(c, per_request) for c in batch]
    differ = [i for i, (a, b) in enumerate(zip(theirs, ours, strict=True)) if a != b]
    return {
        "cases": len(batch),
        "identical": len(batch) - len(differ),
        "chunks": sum(len(s) for s in theirs),
        "first_differing": [
            {"case": batch[i], "engine": theirs[i], "tailserve": ours[i]} for i in differ[:3]
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/stream_interval_check.json")
    args = parser.parse_args()
    batch = cases(args.cases, args.seed)
    t0 = time.perf_counter()
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seed": args.seed}
    for engine in ENGINES:
        found = check(engine, batch)
        if found is None:
            continue
        result[engine] = found
        print(
            f"{engine}: {found['identical']:,} of {found['cases']:,} requests chunked at the same steps as "
            f"the engine's own streaming code ({found['chunks']:,} chunks)"
        )
    result["seconds"] = round(time.perf_counter() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"saved {args.out} ({result['seconds']} s)")


if __name__ == "__main__":
    main()
