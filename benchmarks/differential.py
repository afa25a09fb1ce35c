"""Step-for-step differential run: K seeded random workloads through tailserve and an engine's
own scheduler code (its peer venv, ``scripts/setup-peers.sh``). Not a test: it prints how many
workloads were step-identical, the first divergences (shrunk with ``--shrink``) and wall time,
and saves JSON (``benchmarks/out/differential-ENGINE.json`` unless ``--out``).

    python -m benchmarks.differential                      # vLLM, 1,000 workloads
    python -m benchmarks.differential --engine sglang -k 500
    python -m benchmarks.differential --record-fixture tests/fixtures/differential/vllm.json -k 300

``--record-fixture`` writes the engine's decisions for the workloads (those of at most
``--fixture-max-steps`` steps) as the golden file the normal test suite checks tailserve against.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks._common import cpu_line, default_out, simd_flags
from tailserve.validate.golden import NUM_FULL_TRACES, write_fixture
from tailserve.validate.peers import PeerDriver, PeerError
from tailserve.validate.runner import DIFFERENTIALS, differential
from tailserve.validate.shrink import shrink, size
from tailserve.validate.workload import Workload


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=sorted(DIFFERENTIALS), default="vllm")
    p.add_argument("-k", "--num-workloads", type=int, default=1000)
    p.add_argument("--seed-start", type=int, default=0)
    p.add_argument("--shrink", type=int, default=3, help="shrink the first N divergences (0: none)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--recheck-hash-seeds",
        type=int,
        default=3,
        help="rerun each divergent workload's engine side under string hash seeds 0..N-1: one that "
        "matches then differs only by the order the engine iterates a set of request ids (0: off)",
    )
    p.add_argument("--record-fixture", type=Path, default=None)
    p.add_argument("--fixture-max-steps", type=int, default=120)
    p.add_argument(
        "--fixture-identical-only",
        action="store_true",
        help="record only cases tailserve matches today (a regression guard where divergences remain)",
    )
    args = p.parse_args()
    if args.num_workloads < 1:
        p.error("-k must be >= 1")

    diff = differential(args.engine)
    load = os.getloadavg()
    t0 = time.perf_counter()
    try:
        driver = PeerDriver(diff.engine)  # vllm-async, vllm-spec: the vllm peer
    except PeerError as exc:
        print(f"differential: {exc}", file=sys.stderr)
        return 2
    startup = time.perf_counter() - t0
    identical = 0
    decisions = 0
    groups: dict[str, list[int]] = {}  # kind -> [identical, cases]
    divergent: list[dict] = []
    errors: list[dict] = []
    entries: list[dict] = []
    t1 = time.perf_counter()
    with driver:
        for seed in range(args.seed_start, args.seed_start + args.num_workloads):
            case = diff.generate(seed)
            try:
                theirs = diff.run_theirs(driver, case)
            except PeerError as exc:
                errors.append({"seed": seed, "error": str(exc)})
                continue
            decisions += diff.num_decisions(theirs)
            difference = diff.compare(diff.run_ours(case), theirs)
            if diff.group is not None:
                counts = groups.setdefault(diff.group(case), [0, 0])
                counts[0] += difference is None
                counts[1] += 1
            if difference is None:
                identical += 1
            else:
                item = {"seed": seed, "first": difference}
                if diff.engine_fails is not None and (why := diff.engine_fails(theirs)):
                    item["engine_fails"] = why
                if len(divergent) < args.shrink and isinstance(case, Workload):

                    def diverges(w: Workload) -> bool:
                        try:
                            return diff.compare(diff.run_ours(w), diff.run_theirs(driver, w)) is not None
                        except PeerError:
                            return False

                    small = shrink(case, diverges)
                    item["shrunk_size"] = list(size(small))
                    item["shrunk"] = small.to_dict()
                    item["shrunk_first"] = diff.compare(diff.run_ours(small), diff.run_theirs(driver, small))
                divergent.append(item)
            wanted = difference is None or not args.fixture_identical_only
            if (
                args.record_fixture is not None
                and wanted
                and diff.num_decisions(theirs) <= args.fixture_max_steps
            ):
                entries.append(diff.record(case, theirs, len(entries) < NUM_FULL_TRACES))
        version = driver.version
    wall = time.perf_counter() - t1
    t2 = time.perf_counter()
    recheck = [item for item in divergent if item["seed"] is not None and "engine_fails" not in item]
    for hash_seed in range(args.recheck_hash_seeds if recheck and diff.engine.startswith("vllm") else 0):
        if all("matches_with_engine_hash_seed" in item for item in recheck):
            break
        with PeerDriver(diff.engine, hash_seed=hash_seed) as rerun:
            for item in recheck:
                if "matches_with_engine_hash_seed" in item:
                    continue
                case = diff.generate(item["seed"])
                try:
                    if diff.compare(diff.run_ours(case), diff.run_theirs(rerun, case)) is None:
                        item["matches_with_engine_hash_seed"] = hash_seed
                except PeerError:
                    continue
    recheck_s = time.perf_counter() - t2
    n = args.num_workloads
    label = f"{diff.label} {version}"
    print(f"{identical} of {n} {diff.unit} {diff.verdict} {label}'s scheduler ({decisions} {diff.decision})")
    for kind, (same, cases) in sorted(groups.items()):
        print(f"  {kind}: {same} of {cases} identical")
    print(f"divergent: {len(divergent)}, engine errors: {len(errors)}")
    order_only = [item["seed"] for item in divergent if "matches_with_engine_hash_seed" in item]
    if order_only:
        print(
            f"  of the divergent, {len(order_only)} match the engine run under another string hash seed "
            f"(the order it iterates a set of request ids; docs/validation.md): seeds {order_only}"
        )
    fails: dict[str, int] = {}
    for item in divergent:
        if "engine_fails" in item:
            fails[item["engine_fails"]] = fails.get(item["engine_fails"], 0) + 1
    for why, count in sorted(fails.items()):
        print(f"  of the divergent, {count} where {label} itself stops: {why}")
    print(f"wall: {wall:.1f} s for {n} cases (+{startup:.1f} s engine start); load before: {load}")
    if recheck_s > 0.05:
        print(f"  (+{recheck_s:.1f} s rechecking {len(recheck)} divergent under other engine hash seeds)")
    for item in divergent[:5]:
        print(f"- seed {item['seed']}: {item['first']}")
        if "shrunk_first" in item:
            print(
                f"  shrunk to {item['shrunk_size'][0]} requests, {item['shrunk_size'][1]} tokens: {item['shrunk_first']}"
            )
    for item in errors[:5]:
        print(f"- seed {item['seed']}: engine error: {item['error']}")
    result = {
        "engine": args.engine,
        "engine_version": version,
        "num_workloads": n,
        "seed_start": args.seed_start,
        "identical": identical,
        "identical_under_another_engine_hash_seed": len(order_only),
        "decisions": decisions,
        "decision_unit": diff.decision,
        "by_kind": {
            kind: {"identical": same, "cases": cases} for kind, (same, cases) in sorted(groups.items())
        },
        "divergent": divergent,
        "errors": errors,
        "wall_s": round(wall, 2),
        "startup_s": round(startup, 2),
        "loadavg_before": load,
        "command": " ".join(sys.argv),
    }
    out = args.out or default_out(f"differential-{args.engine}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    print(cpu_line())
    out.write_text(json.dumps({**result, "cpu_flags": simd_flags()}, indent=1) + "\n")
    print(f"saved {out}")
    if args.record_fixture is not None:
        write_fixture(args.record_fixture, args.engine, version, entries)
        print(f"recorded {len(entries)} workloads to {args.record_fixture}")
    return 0 if not divergent and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
