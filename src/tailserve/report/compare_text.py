"""One paragraph, written from the numbers a comparison just produced, saying what its table shows."""

from __future__ import annotations

import textwrap
from typing import Any

import numpy as np

from tailserve.executors.simulated.deployment import BuiltCostModel
from tailserve.sim.run_file import RunResult
from tailserve.sim.workload_spec import WorkloadSpec


def _ms(seconds: float) -> str:
    if seconds >= 10:
        return f"{seconds:,.0f} s"
    return f"{seconds * 1e3:,.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.1f} ms"


def _hol_facts(run: RunResult) -> dict[str, float] | None:
    by_id = {r.request_id: r for r in run.requests}
    long = by_id.get("long-0")
    shorts = [r for rid, r in by_id.items() if rid.startswith("short-") and len(r.token_times) > 1]
    if long is None or not long.token_times or not shorts:
        return None
    gaps = np.concatenate([np.diff(r.token_times) for r in shorts])
    return {
        "stall": float(gaps.max()),  # the short requests' longest wait for a token
        "typical": float(np.median(gaps)),
        "long_ttft": long.token_times[0] - long.arrival_time,
        "short_ttft_max": max(r.token_times[0] - r.arrival_time for r in shorts),
        # The long prompt started only once every short request was done: it never shared an
        # iteration with them (TensorRT-LLM without chunking: prompt + decodes > max_num_tokens).
        # Under an overlapped loop (TensorRT-LLM's overlap scheduler) it is scheduled while the
        # shorts' last step runs, once their previous tokens are known: after their last but one.
        "waited": float(
            long.first_scheduled_time is not None
            and long.first_scheduled_time >= max(r.token_times[-2] for r in shorts)
        ),
    }


def _hol_paragraph(runs: list[RunResult], built: BuiltCostModel) -> str | None:
    facts = {r.label: f for r in runs if (f := _hol_facts(r)) is not None}
    # Static batching never lets the long prompt join running decodes; it is told apart below.
    mixing = {k: f for k, f in facts.items() if not k.startswith("static") and not f["waited"]}
    if len(mixing) < 2:
        return None
    cm = built.cost_model
    prefill = cm.prefill_time(8192)
    worst = max(mixing, key=lambda k: mixing[k]["stall"])
    best = min(mixing, key=lambda k: mixing[k]["stall"])
    w, b = mixing[worst], mixing[best]
    parts = [
        f"On {cm.model.name} / {cm.hardware.name} at TP {cm.tp} (calibration {built.calibration}), one "
        f"decode step of the ten short requests takes about {_ms(b['typical'])} and a whole "
        f"8,192-token prefill {_ms(prefill)}.",
        f"Under {worst} the long prompt arrives and all ten decoding requests stall for "
        f"{_ms(w['stall'])} waiting for their next token — the whole prefill in one iteration, "
        f"{w['stall'] / max(w['typical'], 1e-9):.0f}x a normal step.",
        f"Under {best} the prefill is split into chunks that share iterations with the decodes, so "
        f"their worst gap is {_ms(b['stall'])} ({w['stall'] / b['stall']:.1f}x smaller); the price is "
        f"the long prompt's own TTFT, {_ms(b['long_ttft'])} instead of {_ms(w['long_ttft'])}.",
    ]
    middle = [k for k in mixing if k not in (worst, best)]
    if middle:
        shown = "; ".join(
            f"{k}: {_ms(mixing[k]['stall'])} stall, {_ms(mixing[k]['long_ttft'])} long-prompt TTFT"
            for k in middle
        )
        parts.append(f"In between: {shown}.")
    for k, f in facts.items():
        if k in mixing:
            continue
        if k.startswith("static"):
            parts.append(
                f"{k} never mixes prefill into running decodes, but the long prompt waits for a "
                f"batch slot: its TTFT is {_ms(f['long_ttft'])}."
            )
        else:
            parts.append(
                f"{k} never lets the long prompt join the running decodes (prompt and decodes "
                f"together exceed its token budget): it waits until they finish, TTFT "
                f"{_ms(f['long_ttft'])}."
            )
    parts.append("Same GPU, same model: the scheduler's budget alone moves the tail.")
    return " ".join(parts)


def _rejected(run: RunResult, count: int) -> str:
    """``vllm 3 (2 longer than max_model_len, 1 too large for the KV cache)``: each reason counted,
    or the count alone when the run kept no requests to read them from."""
    kinds = run.rejected_by_kind()
    if sum(len(rs) for rs in kinds.values()) != count:
        return f"{run.label} {count}"
    if len(kinds) == 1:
        return f"{run.label} {count} ({next(iter(kinds))})"
    return f"{run.label} {count} (" + ", ".join(f"{len(rs)} {kind}" for kind, rs in kinds.items()) + ")"


def _generic_paragraph(runs: list[RunResult], summaries: list[dict[str, Any]]) -> str:
    def metric(s: dict[str, Any], name: str, stat: str) -> float:
        v = s["metrics"][name][stat]
        return float("inf") if v is None else v

    rows = list(zip(runs, summaries))
    ttft = sorted(rows, key=lambda rs: metric(rs[1], "ttft_s", "p99"))
    itl = sorted(rows, key=lambda rs: metric(rs[1], "itl_s", "p99"))
    tput = sorted(rows, key=lambda rs: -rs[1]["throughput"]["output_tokens_per_s"])
    (lo, slo), (hi, shi) = ttft[0], ttft[-1]
    parts = [
        f"p99 TTFT ranges from {_ms(metric(slo, 'ttft_s', 'p99'))} ({lo.label}) to "
        f"{_ms(metric(shi, 'ttft_s', 'p99'))} ({hi.label})"
        + (
            f", {metric(shi, 'ttft_s', 'p99') / metric(slo, 'ttft_s', 'p99'):.1f}x apart."
            if metric(slo, "ttft_s", "p99") > 0
            else "."
        ),
        f"The lowest p99 ITL is {itl[0][0].label}'s ({_ms(metric(itl[0][1], 'itl_s', 'p99'))}), the highest "
        f"{itl[-1][0].label}'s ({_ms(metric(itl[-1][1], 'itl_s', 'p99'))}).",
        f"{tput[0][0].label} has the highest output throughput "
        f"({tput[0][1]['throughput']['output_tokens_per_s']:,.0f} tok/s).",
    ]
    preempting = [(r.label, s["num_preemptions"]) for r, s in rows if s["num_preemptions"]]
    if preempting:
        parts.append("Preemptions: " + ", ".join(f"{label} {n}" for label, n in preempting) + ".")
    rejected = [_rejected(r, s["num_rejected"]) for r, s in rows if s["num_rejected"]]
    if rejected:
        parts.append("Rejected: " + ", ".join(rejected) + ".")
    return " ".join(parts)


def compare_paragraph(
    runs: list[RunResult],
    summaries: list[dict[str, Any]],
    built: BuiltCostModel,
    workload: WorkloadSpec,
) -> str:
    text = None
    if workload.name == "hol":
        text = _hol_paragraph(runs, built)
    if text is None:
        text = _generic_paragraph(runs, summaries)
    return textwrap.fill(text, width=100)
