"""Why a cluster request waited: the routing choice, and on a P/D split each leg of its path.

Routing: each decision recorded the true queue lengths at that moment (``RoutingDecision``), so
a request whose replica had more requests waiting than the least-loaded one at that instant is
one the route made wait ("sent to r3 with 12 queued while r0 had 0"). Its queueing time on its
replica is the most the route can have cost it.

P/D: TTFT = prefill wait + prefill compute + link wait (until the transfer starts: the prefill
replica's link busy with earlier transfers) + KV transfer + decode wait (vLLM's pair: the passes
until the first token; sent-on-finish pairs: for KV room and the first decode iteration). In
vLLM's pair the decode replica reads the KV only once it admits the request (blocks for its
prompt, a running slot, budget), which a decode side short of KV delays while the prompt's KV
stays on its prefill replica: the time from the prefill's end until then is "decode admission
wait", and the link wait counts from it. In an SGLang pair the decode server pre-allocates KV
before the prefill may start: the time until then is "decode prealloc wait", and the prefill
wait counts from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tailserve.cluster.cluster import ClusterRun, RoutingDecision, Stage

PD_PARTS = ("prefill_wait", "prefill", "link_wait", "kv_transfer", "decode_wait")
PAIRED_PD_PARTS = ("decode_prealloc_wait", *PD_PARTS)  # SGLang's pair (cluster/sglang_pd.py)
PULLED_PD_PARTS = ("prefill_wait", "prefill", "decode_admission_wait", *PD_PARTS[2:])  # vLLM's pair


def pd_parts(run: ClusterRun) -> tuple[str, ...]:
    """The parts of TTFT on this run's P/D path."""
    timeline = run.pd_timeline.values()
    if any(t.bootstrapped is not None for t in timeline):
        return PAIRED_PD_PARTS
    if any(t.decode_admitted is not None for t in timeline):
        return PULLED_PD_PARTS
    return PD_PARTS


# What the part of TTFT that dominates the slowest requests says about the split.
_BOTTLENECK = {
    "decode_prealloc_wait": "the decode server pre-allocating KV for it (SGLang: before the prefill "
    "may start, or under prefill_complete once it is done, the prefill server holding the KV "
    "meanwhile): its KV, less the reserve for running requests, is full; more decode capacity or a "
    "smaller num_reserved_decode_tokens would shorten it.",
    "prefill_wait": "queueing for a prefill replica: the prefill side is short of capacity; more "
    "prefill replicas would shorten it.",
    "prefill": "the prefill itself, from its first chunk to its first token (its compute and the "
    "other prompts sharing its iterations); more prefill capacity (replicas, tensor parallelism) "
    "would shorten it.",
    "decode_admission_wait": "the decode replica admitting the request, which it does once it has "
    "KV blocks for the prompt and a running slot, while the prompt's KV waits on its prefill "
    "replica: the decode side is full; more decode replicas or KV memory would shorten it.",
    "link_wait": "the prefill replica's link busy with earlier transfers; a faster link (--kv-link) "
    "or more prefill replicas (each has its own) would shorten it.",
    "kv_transfer": "the KV copy itself; a faster link (--kv-link) would shorten it.",
    "decode_wait": "the decode replica's passes after the KV arrived (for KV room or a running "
    "slot, then its first token); more decode capacity would shorten it.",
}


@dataclass(frozen=True, slots=True)
class RoutedWait:
    request_id: str
    ttft: float  # seconds
    queue: float  # seconds on its replica before first scheduled
    decision: RoutingDecision


def routed_waits(run: ClusterRun, stage: Stage) -> list[RoutedWait]:
    """Requests this stage sent to a replica with more waiting than another had, slowest first."""
    final = {r.request_id: r for r in run.requests}
    by_id = {r.request_id: r for replica in stage.replicas for r in replica.engine.requests}
    # An SGLang decode server takes a request at arrival and queues it until its KV is
    # pre-allocated (its prefill runs after): that is its queueing there, not the whole TTFT. A
    # vLLM decode replica queues it from the hand-over until it admits it to read its KV (the
    # read and the first pass after it are not queueing).
    decode_side = stage is run.stages.get("decode")
    out = []
    for d in stage.decisions:
        if d.num_waiting <= d.min_waiting:
            continue
        client, local = final.get(d.request_id), by_id.get(d.request_id)
        if client is None or local is None or not client.token_times or local.first_scheduled_time is None:
            continue
        started = local.first_scheduled_time
        times = run.pd_timeline.get(d.request_id)
        if decode_side and times is not None:
            if times.bootstrapped is not None:
                started = times.bootstrapped
            elif times.decode_admitted is not None:
                started = times.decode_admitted
        out.append(RoutedWait(d.request_id, client.token_times[0] - client.arrival_time, started - d.time, d))
    return sorted(out, key=lambda w: -w.ttft)


def pd_breakdown(run: ClusterRun) -> dict[str, np.ndarray]:
    """Per request that went through both sides, seconds in each part of PD_PARTS."""
    names = pd_parts(run)
    parts: dict[str, list[float]] = {name: [] for name in names}
    ttft: list[float] = []
    for r in run.requests:
        t = run.pd_timeline.get(r.request_id)
        if t is None or t.transfer_done is None or not r.token_times or t.prefill_scheduled is None:
            continue
        assert t.prefill_done is not None and t.transfer_start is not None
        queued = r.arrival_time
        if "decode_prealloc_wait" in parts:
            assert t.bootstrapped is not None
            if t.bootstrapped <= t.prefill_scheduled:  # early: reserved before the prefill began
                parts["decode_prealloc_wait"].append(t.bootstrapped - r.arrival_time)
                queued = t.bootstrapped
            else:  # prefill_complete: reserved after it, the prefill server holding the KV
                parts["decode_prealloc_wait"].append(t.bootstrapped - t.prefill_done)
        parts["prefill_wait"].append(t.prefill_scheduled - queued)
        parts["prefill"].append(t.prefill_done - t.prefill_scheduled)
        if "decode_admission_wait" in parts:
            assert t.decode_admitted is not None
            parts["decode_admission_wait"].append(t.decode_admitted - t.prefill_done)
        parts["link_wait"].append(t.transfer_start - t.transfer_ready)  # type: ignore[operator]
        parts["kv_transfer"].append(t.transfer_done - t.transfer_start)
        parts["decode_wait"].append(r.token_times[0] - t.transfer_done)
        ttft.append(r.token_times[0] - r.arrival_time)
    out = {name: np.asarray(v) for name, v in parts.items()}
    out["ttft"] = np.asarray(ttft)
    return out


def explain_cluster(run: ClusterRun) -> dict[str, Any]:
    """The run's explanation: plain-words lines and the numbers behind them."""
    lines: list[str] = []
    data: dict[str, Any] = {}
    done = [r for r in run.requests if r.token_times]
    if not done:
        return {"lines": ["no request finished"], "data": data}
    ttft = np.array([r.token_times[0] - r.arrival_time for r in done])
    p99 = float(np.percentile(ttft, 99))
    slow = {r.request_id for r, t in zip(done, ttft) if t >= p99}
    for name, stage in run.stages.items():
        if len(stage.replicas) < 2:
            continue
        waits = routed_waits(run, stage)
        names = [r.name for r in stage.replicas]
        slow_routed = [w for w in waits if w.request_id in slow]
        data[name] = {
            "num_routed_to_longer_queue": len(waits),
            "num_slowest_1pct_routed_so": len(slow_routed),
            "queue_s_sum": float(sum(w.queue for w in waits)),
        }
        side = "" if name == "replicas" else f"{name} "
        lines.append(
            f"{side}routing ({stage.router.describe()}): {len(waits)} of {len(stage.decisions)} requests were sent to a "
            f"replica with more requests waiting than another had; {len(slow_routed)} of the {len(slow)} slowest "
            f"(TTFT >= p99 {p99:.3f} s) were."
        )
        for w in waits[:3]:
            d = w.decision
            lines.append(
                f"  {w.request_id} (TTFT {w.ttft:.3f} s, {w.queue:.3f} s queued) was sent to {names[d.replica]} with "
                f"{d.num_waiting} queued while {names[d.min_waiting_replica]} had {d.min_waiting}"
            )
    if run.pd_timeline:
        parts = pd_breakdown(run)
        if parts["ttft"].size:
            order = np.argsort(parts["ttft"])
            tail = order[int(0.99 * (len(order) - 1)) :]
            names = pd_parts(run)
            shares = {k: float(parts[k][tail].mean()) for k in names}
            total = float(parts["ttft"][tail].mean())
            data["pd_p99_mean_s"] = {"ttft": total, **shares}
            data["pd_mean_s"] = {k: float(parts[k].mean()) for k in (*names, "ttft")}
            words = ", ".join(f"{k.replace('_', ' ')} {v:.3f} s" for k, v in shares.items())
            lines.append(f"P/D, slowest 1% by TTFT (mean {total:.3f} s): {words}.")
            top = max(shares, key=lambda k: shares[k])
            if shares[top] >= 0.5 * total:
                lines.append(f"  Most of it ({shares[top] / max(total, 1e-12):.0%}): {_BOTTLENECK[top]}")
            mean_x = data["pd_mean_s"]["kv_transfer"]
            lines.append(
                f"P/D, all requests: the KV transfer is {mean_x:.4f} s of a mean TTFT of "
                f"{data['pd_mean_s']['ttft']:.3f} s ({mean_x / max(data['pd_mean_s']['ttft'], 1e-12):.1%})."
            )
    return {"lines": lines, "data": data}
