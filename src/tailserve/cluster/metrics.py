"""A cluster run's numbers: overall (the requests as clients saw them) and per replica.

Overall latency metrics use the single-engine definitions (``metrics.summary``). The prefix hit
rate is prompt tokens served from some replica's cache over all prompt tokens (on a P/D split,
the prefill replicas' lookups). Per replica: requests routed, their TTFT (on a prefill replica,
its own first token), and the busy fraction: time in iterations over the run's duration.
"""

from __future__ import annotations

from typing import Any

from tailserve.cluster.cluster import ClusterRun
from tailserve.cluster.replica import Replica
from tailserve.metrics.summary import Slo, prefix_cache_summary, stats, summarize


def replica_summary(replica: Replica, duration: float) -> dict[str, Any]:
    done = [r for r in replica.engine.requests if r.token_times]
    log = replica.engine.log
    pipelined = replica.engine.scheduler.pipeline_parallel_size > 1  # its micro-batches overlap
    busy = (log.busy_seconds() if pipelined else float(sum(log.duration))) if len(log) else 0.0
    hit = prefix_cache_summary(replica.engine.requests)
    return {
        "name": replica.name,
        "deployment": replica.spec.label,
        "policy": replica.spec.policy.label,
        "num_routed": replica.num_routed,
        "num_finished": len(done),
        "ttft_s": stats([r.token_times[0] - r.arrival_time for r in done]),
        "busy_fraction": busy / duration if duration > 0 else 0.0,
        "prefix_hit_rate_tokens": hit["hit_rate_tokens"],
        "num_preemptions": sum(r.num_preemptions for r in replica.engine.requests),
        # what its policy says of the run (an SGLang decode server's held-back pre-allocations)
        "notes": replica.engine.scheduler.policy.notes(),
    }


def cluster_summary(run: ClusterRun, slo: Slo | None = None) -> dict[str, Any]:
    out = summarize(run.requests, slo, stream=run.stream)
    # On a P/D split prefixes are looked up on the prefill side only (its copies' hits).
    prefill = run.stages.get("prefill")
    looked_up = [r for rep in prefill.replicas for r in rep.engine.requests] if prefill else run.requests
    out["prefix_cache"] = prefix_cache_summary(looked_up)
    out["wall_s"] = run.wall_s
    out["cpu_s"] = run.cpu_s
    duration = out["duration_s"]
    out["stages"] = {
        name: {
            "router": stage.placement(),
            "scrape_interval_s": stage.scrape_interval,
            "replicas": [replica_summary(r, duration) for r in stage.replicas],
        }
        for name, stage in run.stages.items()
    }
    if run.pd_timeline:
        # From when the KV could move (the prefill done; in vLLM's pair, the decode replica
        # admitting the request) to when it is on the decode side: the link's queue and the copy.
        timeline = run.pd_timeline.values()
        transfers = [
            t.transfer_done - ready
            for t in timeline
            if t.transfer_done is not None and (ready := t.transfer_ready) is not None
        ]
        out["kv_transfer_s"] = stats(transfers)
        admissions = [
            t.decode_admitted - t.prefill_done
            for t in timeline
            if t.decode_admitted is not None and t.prefill_done is not None
        ]
        if admissions:  # vLLM's pair: the prompt waited on the prefill side to be admitted
            out["decode_admission_wait_s"] = stats(admissions)
    return out
