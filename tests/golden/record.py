"""Record the golden corpus: ``python -m tests.golden.record [--only PREFIX]``.

Run it on the commit whose behaviour is the reference (before a refactor), never to make a
failing golden test pass.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from tests.golden import corpus


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", help="record only cases whose name starts with this")
    args = ap.parse_args()
    data = json.loads(corpus.FIXTURE.read_text()) if corpus.FIXTURE.exists() else {"sim": {}, "torch": {}}
    for case in corpus.sim_cases():
        if args.only and not case.name.startswith(args.only):
            continue
        if case.needs_trace and corpus.find_trace(case.needs_trace) is None:
            print(f"skip {case.name}: {case.needs_trace} not found", file=sys.stderr)
            continue
        t0 = time.perf_counter()
        data["sim"][case.name] = corpus.run_sim_case(case)
        print(f"{case.name}: {data['sim'][case.name]['num_iterations']} iterations "
              f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)  # fmt: skip
    if not args.only or args.only.startswith("torch"):
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = corpus.torch_model_dir(Path(tmp))
            for name, policy, flags, pressure in corpus.TORCH_POLICIES:
                t0 = time.perf_counter()
                data["torch"][name] = corpus.run_torch_case(model_dir, policy, flags, pressure)
                print(f"torch/{name} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    corpus.FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    corpus.FIXTURE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {corpus.FIXTURE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
