"""The pipeline stages' send (``executors/simulated/pipeline.py``) against Vidur's measured NCCL
send/recv on DGX A100 and H100 nodes (``../shared/profiles/vidur/network/{a100,h100}_dgx/
send_recv.csv``: 994 message sizes from 2 KiB to 64 MiB each, two GPUs of one node
(``devices_per_node`` 2) and one GPU on each of two nodes (1); the median of three runs).

It refits ``latency + bytes / bandwidth`` per topology (least squares of the relative error, the
fit ``pipeline.py`` holds) and prints, for the catalog's constants, the median, p90 and largest
relative error over the sizes, and the share of sizes within 10%:

- over NVLink: H100's and A100's own fits (``NVLINK_FITS``), and the rule for other GPUs
  (H100's fraction of the line rate) applied to A100, predicted rather than fitted;
- between nodes: H100's fit over 400 Gb/s InfiniBand (``NETWORK_*``); Vidur's A100 nodes reach
  7.8 GB/s, a slower network than any ``--pp-link``, so that row shows what the H100 rule
  would predict there and is not an agreement claim.

    python -m benchmarks.pp_send_recv [--root ../shared/profiles/vidur] [--out FILE]

Needs only numpy and the profiles (``$VIDUR_PROFILES``); seconds.
"""

from __future__ import annotations

import argparse
import csv
import os
from pathlib import Path

import numpy as np

from benchmarks._common import run_stamp, save_results
from tailserve.executors.simulated import pipeline as P
from tailserve.executors.simulated.hardware import LINKS, get_hardware

ROOT = Path(__file__).resolve().parents[1] / ".." / "shared" / "profiles" / "vidur"


def measured(root: Path, topology: str, devices_per_node: str) -> tuple[np.ndarray, np.ndarray]:
    """(bytes, seconds) of one topology's send/recv rows."""
    with open(root / "network" / topology / "send_recv.csv") as f:
        rows = [
            (int(r["size"]), float(r["time_stats.send_recv.median"]) * 1e-3)
            for r in csv.DictReader(f)
            if r["collective"] == "send_recv" and r["devices_per_node"] == devices_per_node
        ]
    rows.sort()
    return np.array([b for b, _ in rows], float), np.array([t for _, t in rows])


def fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(latency s, bytes/s) minimising the squared relative error."""
    a = np.stack([np.ones_like(x), x], 1) / y[:, None]
    (latency, inverse), *_ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
    return float(latency), float(1 / inverse)


def errors(link: P.SendLink, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    rel = np.abs(np.array([link.time(b) for b in x]) / y - 1)
    return {
        "median_pct": round(float(np.median(rel)) * 100, 1),
        "p90_pct": round(float(np.percentile(rel, 90)) * 100, 1),
        "max_pct": round(float(rel.max()) * 100, 1),
        "within_10pct": round(float(np.mean(rel <= 0.10)), 3),
    }


def run(root: Path) -> dict:
    h100, a100 = get_hardware("H100-SXM"), get_hardware("A100-80GB")
    network = LINKS["ib-ndr"]
    cases = [
        ("H100 NVLink (fitted)", "h100_dgx", "2", P.nvlink(h100)),
        ("A100 NVLink (fitted)", "a100_dgx", "2", P.nvlink(a100)),
        (
            "A100 NVLink (H100's fraction of the line rate: the rule for other GPUs)",
            "a100_dgx",
            "2",
            P.SendLink("rule", P.NVLINK_LATENCY, a100.interconnect_bandwidth * P.NVLINK_EFFICIENCY),
        ),
        (
            "H100 across nodes, ib-ndr (fitted)",
            "h100_dgx",
            "1",
            P.SendLink("ib-ndr", P.NETWORK_LATENCY, network.bandwidth * P.NETWORK_EFFICIENCY),
        ),
        (
            "A100 across nodes (Vidur's cluster: 7.8 GB/s; the ib-ndr rule, not a claim)",
            "a100_dgx",
            "1",
            P.SendLink("ib-ndr", P.NETWORK_LATENCY, network.bandwidth * P.NETWORK_EFFICIENCY),
        ),
    ]
    rows = []
    for label, topology, dpn, link in cases:
        x, y = measured(root, topology, dpn)
        latency, bandwidth = fit(x, y)
        rows.append(
            {
                "case": label,
                "topology": topology,
                "devices_per_node": int(dpn),
                "sizes": len(x),
                "refit_latency_us": round(latency * 1e6, 1),
                "refit_bandwidth_gbs": round(bandwidth / 1e9, 1),
                "catalog_latency_us": round(link.latency * 1e6, 1),
                "catalog_bandwidth_gbs": round(link.bandwidth / 1e9, 1),
                **errors(link, x, y),
            }
        )
    return {"source": str(root / "network"), "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.environ.get("VIDUR_PROFILES", str(ROOT)))
    ap.add_argument("--out", help="JSON results (default benchmarks/out/pp_send_recv.json)")
    args = ap.parse_args()
    root = Path(args.root)
    if not (root / "network").is_dir():
        print(
            f"no Vidur profiles at {root}: pass --root DIR (or $VIDUR_PROFILES) holding network/*/send_recv.csv"
        )
        return 1
    stamp = run_stamp("pp_send_recv")
    results = run(root)
    print(f"{'case':<78} {'refit':>20} {'catalog':>20} {'median':>7} {'p90':>6} {'max':>6} {'<=10%':>6}")
    for r in results["rows"]:
        refit = f"{r['refit_latency_us']} us {r['refit_bandwidth_gbs']} GB/s"
        cat = f"{r['catalog_latency_us']} us {r['catalog_bandwidth_gbs']} GB/s"
        print(
            f"{r['case']:<78} {refit:>20} {cat:>20} {r['median_pct']:>6}% {r['p90_pct']:>5}% "
            f"{r['max_pct']:>5}% {r['within_10pct']:>6.1%}"
        )
    save_results({**stamp, **results}, args.out, "pp_send_recv.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
