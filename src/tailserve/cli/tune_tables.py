"""What ``tailserve tune`` prints: the capacity table, the SLO-ratio grid by budget, and the flags
to paste."""

from __future__ import annotations

import math

from rich.table import Table

from tailserve.report.tables import console, wrap_label
from tailserve.tune.capacity import size_option, workload_size
from tailserve.tune.ceiling import BUDGETS
from tailserve.tune.recommend import PolicyTune, SizePoint, TuneResult


def _ratio(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{value:.2f}"


def _flat(t: PolicyTune) -> str:
    if t.flat is None:
        return "-"
    lo, hi = t.flat
    return f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,} ({hi / lo:g}x)"


def _capacity(t: PolicyTune, max_rate: float) -> str:
    c = t.capacity
    if c.rate <= 0:
        return f"< {c.upper:.3g}" if c.upper else "0"
    if c.upper is None:
        return f">= {max_rate:g}"
    return f"{c.rate:.3g}"


def transient_warnings(result: TuneResult) -> list[str]:
    """A line for each policy whose capacity misses the SLO when the workload has twice the
    requests: a queue that grew too slowly to show on the shorter run, or busier traffic later
    in a trace."""
    out = []
    w = result.config.workload
    more = size_option(w)
    for t in result.policies:
        if t.holds_longer is not False:
            continue
        ratio = t.longer_ratio
        how = f"SLO ratio {ratio:.2f}" if ratio is not None and math.isfinite(ratio) else "nothing finished"
        out.append(
            f"! {t.spec.label}: its capacity ({t.capacity.rate:.3g} req/s, {workload_size(w)}) misses the SLO "
            f"at the same rate with {t.longer_label} ({how}): it holds for this many requests only — a "
            "short run can end before its queue grows past the SLO, and a trace's later requests can "
            f"come in busier stretches. Tune with as much traffic as the answer is for ({more} or more)."
        )
    return out


def ceiling_lines(result: TuneResult) -> list[str]:
    """The throughput ceiling (``tune/ceiling.py``), how close the best capacity comes to it,
    and a line for each capacity above its upper end: a queue that grew all run long."""
    ceiling = result.ceiling
    if ceiling is None:
        return []
    best = max((t.capacity.rate for t in result.policies), default=0.0)
    out = [
        f"throughput ceiling {ceiling.rate:.3g}-{ceiling.upper:.3g} req/s: these requests all queued at "
        f"once, the best of vllm at budgets {', '.join(f'{b:,}' for b in BUDGETS)} ({ceiling.policy}) "
        f"completes them at {ceiling.rate:.3g} req/s, and had started them all at {ceiling.upper:.3g}; "
        f"no policy sustains more. The best capacity is {best / ceiling.upper:.0%}-"
        f"{best / ceiling.rate:.0%} of it."
    ]
    for t in result.policies:
        if t.capacity.rate > ceiling.upper:
            out.append(
                f"! {t.spec.label}: its capacity ({t.capacity.rate:.3g} req/s) is above the throughput "
                "ceiling: the deployment does not get through these requests that fast even with all "
                "of them queued, so the work it holds grew all run long and it met the SLO only "
                "because the run ended."
            )
    return out


CAPACITY_HEADER = (
    "rank",
    "policy",
    "capacity\nreq/s",
    "budget flag",
    "capacity\nat size",
    "best",
    "flat region",
    "SLO ratio\nat best",
)


def capacity_rows(result: TuneResult, wrap: bool = True) -> list[list[str]]:
    """The capacity table's rows (``CAPACITY_HEADER``), ranked: the terminal's and (policy
    labels not wrapped) the report's."""
    max_rate = result.config.max_rate
    return [
        [
            str(rank),
            wrap_label(t.spec.label) if wrap else t.spec.label,
            _capacity(t, max_rate),
            t.knob or "(none)",
            f"{t.capacity_size:,}" if t.capacity_size is not None else "-",
            f"{t.best.size:,}" if t.best else "-",
            _flat(t),
            _ratio(t.best.ratio) if t.best else "-",
        ]
        for rank, t in enumerate(result.policies, start=1)
    ]


def print_tune(result: TuneResult, deployment: str) -> None:
    c = result.config
    console.print(f"{deployment} — {c.workload.label}")
    console.print(f"SLO: {c.slo}; budget sweep at {result.sweep_rate:.3g} requests/s")
    table = Table(title="capacity (highest rate meeting the SLO) and best budget", title_justify="left")
    for name in CAPACITY_HEADER:
        table.add_column(name, justify="left" if name in ("policy", "budget flag") else "right")
    for row in capacity_rows(result):
        table.add_row(*row)
    console.print(table)
    for line in [*ceiling_lines(result), *transient_warnings(result)]:
        console.print(line)
    swept = [t for t in result.policies if t.points]
    if swept:
        sizes = sorted({p.size for t in swept for p in t.points})
        grid = Table(
            title=f"SLO ratio (worst measured / bound; <= 1 meets) by budget at {result.sweep_rate:.3g} req/s; "
            "* = flat region, ! = requests turned away",
            title_justify="left",
        )
        grid.add_column("policy")
        for size in sizes:
            grid.add_column(f"{size:,}", justify="right")
        for t in swept:
            cells = {p.size: _cell(t, p) for p in t.points}
            grid.add_row(t.spec.label, *(cells.get(s, "") for s in sizes))
        console.print(grid)
        for t in swept:
            away = [f"{p.size:,}: {p.num_turned_away}" for p in t.points if p.num_turned_away]
            if away:
                console.print(f"! {t.spec.label} turned requests away (at size: requests): {', '.join(away)}")
    console.print("flags to paste:")
    for t in result.policies:
        if t.command:
            console.print(f"  {t.command}", soft_wrap=True)
            if t.spec.name == "vllm-v0":
                console.print("    (vLLM 0.10 or older: 0.11 removed the V0 engine and VLLM_USE_V1)")
                if "--pipeline-parallel-size" in t.command:
                    console.print(
                        "    (simulated as the Sarathi-Serve paper ran V0's policy, in Sarathi-Serve's pipelined "
                        "engine; vLLM V0's own stages run one scheduler per virtual engine, not simulated)"
                    )
            if t.best is not None and not t.best.meets:
                console.print(
                    f"    (misses the SLO at {result.sweep_rate:.3g} req/s even at its best size: "
                    f"ratio {_ratio(t.best.ratio)}, {t.best.num_turned_away} turned away)"
                )
    for t in result.policies:
        errors = {p.error for p in t.points if p.error}
        for error in errors:
            console.print(f"note: {t.spec.name}: some sizes are invalid: {error}")


def _cell(t: PolicyTune, p: SizePoint) -> str:
    if p.error:
        return "invalid"
    text = "inf" if not math.isfinite(p.ratio) else f"{p.ratio:.2f}"
    return text + ("!" if p.num_turned_away else "") + ("*" if p.size in t.flat_sizes else "")
