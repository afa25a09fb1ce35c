"""``slo_policy.py``'s fairness part (Llama-3-8B / H100): tenant ``light`` at a fixed rate,
``heavy`` at 10x it (far past capacity). The light tenant's p99 TTFT with heavy present against
its solo run, under fcfs (vllm, slo) and VTC (vllm + fairness=vtc, slo + fairness=vtc). Then two
tenants both backlogged (both past capacity, different lengths): the largest measured difference
of weighted service (``w_p`` x prefill + ``w_q`` x decode tokens) over any interval in which
both stay backlogged, against the paper's bound ``2 max(w_p L_input, w_q M)``."""

from __future__ import annotations

from typing import Any

import numpy as np

from tailserve.assemble import BuildOptions, build_engine
from tailserve.core.engine import EngineOptions
from tailserve.core.request import Request
from tailserve.core.source import ListSource
from tailserve.executors.simulated.deployment import Deployment
from tailserve.policies.fairness import FairPolicy, TenantBacklog
from tailserve.policies.registry import PolicySpec
from tailserve.policies.vtc import VirtualTokenCounter
from tailserve.workloads.lengths import LogNormal
from tailserve.workloads.tenants import tenant_streams


class Recorder(TenantBacklog):
    """A backlog that also records, after every iteration, each tenant's weighted service so far
    and who was backlogged; ``fair=False`` keeps the wrapped policy's own (FCFS) order."""

    def __init__(self, counter: VirtualTokenCounter, fair: bool) -> None:
        super().__init__(counter)
        self.fair = fair
        self.served: dict[str, float] = {}
        self.samples: list[tuple[dict[str, float], frozenset[str]]] = []

    def order(self, requests):  # type: ignore[override]
        return super().order(requests) if self.fair else list(requests)

    def charge(self, out) -> None:  # type: ignore[override]
        super().charge(out)
        for s in out.scheduled:
            t = s.request.tenant_id or ""
            cost = self.vtc.output_price if s.num_new_tokens == 1 else self.vtc.input_price * s.num_new_tokens
            self.served[t] = self.served.get(t, 0.0) + cost
        self._sample()

    def charge_decode_run(self, running, num_steps: int) -> None:  # type: ignore[override]
        super().charge_decode_run(running, num_steps)
        for r in running:
            t = r.tenant_id or ""
            self.served[t] = self.served.get(t, 0.0) + self.vtc.output_price * num_steps
        self._sample()

    def _sample(self) -> None:
        backlogged = frozenset(t for t, n in self.num_waiting.items() if n > 0)
        self.samples.append((dict(self.served), backlogged))


def run_tenants(policy: str, requests: list[Request], fair: bool) -> tuple[list[Request], Recorder, int]:
    deployment = Deployment.of("Llama-3-8B", "H100-SXM", 1)
    name, _, flags = policy.partition(":")
    spec = PolicySpec.make(name, dict(f.split("=", 1) for f in flags.split(";") if f))
    built = build_engine(deployment, spec, "sim", BuildOptions(shares_prefixes=False))
    recorder = Recorder(VirtualTokenCounter(), fair)
    inner = built.policy
    if isinstance(inner, FairPolicy):
        inner = inner.inner
    if policy.startswith("slo") and fair:
        inner.backlog = recorder  # slo's own VTC (and rule 9), observed
        wrapped = inner
    else:
        # Observed from outside; an unfair recorder keeps the waiting order (slo's own
        # rules 1-7 run without fairness: its backlog stays None).
        wrapped = FairPolicy(inner, recorder)
    built.scheduler.policy = wrapped
    built.parts.policy = wrapped
    fresh = [
        Request(r.request_id, r.prompt_len, r.max_tokens, r.arrival_time, tenant_id=r.tenant_id)
        for r in requests
    ]
    engine = built.make_engine(ListSource(fresh), options=EngineOptions())
    engine.run()
    return fresh, recorder, built.scheduler.kv_cache.num_blocks * built.scheduler.kv_cache.block_size


def p99_ttft(requests: list[Request], tenant: str) -> float:
    ttft = [r.token_times[0] - r.arrival_time for r in requests if r.tenant_id == tenant and r.token_times]
    return float(np.percentile(ttft, 99))


def tenant_service(requests: list[Request], tenant: str, duration: float) -> dict[str, float]:
    """A tenant's TBT p99 and max (every gap between its tokens) and its generated tokens per
    second while traffic lasts (tokens produced by ``duration``)."""
    mine = [r for r in requests if r.tenant_id == tenant and r.token_times]
    gaps = np.concatenate([np.diff(r.token_times) for r in mine]) if mine else np.array([])
    tokens = sum(int(np.searchsorted(r.token_times, duration, side="right")) for r in mine)
    return {
        "tbt_p99_s": float(np.percentile(gaps, 99)) if gaps.size else float("nan"),
        "tbt_max_s": float(gaps.max()) if gaps.size else float("nan"),
        "tokens_per_s": tokens / duration,
    }


def max_service_difference(recorder: Recorder, a: str, b: str) -> float:
    """max over intervals [t1, t2] with both backlogged throughout of |dW_a - dW_b|."""
    worst = 0.0
    lo = hi = None
    for served, backlogged in recorder.samples:
        if a in backlogged and b in backlogged:
            d = served.get(a, 0.0) - served.get(b, 0.0)
            lo = d if lo is None else min(lo, d)
            hi = d if hi is None else max(hi, d)
            worst = max(worst, hi - lo)
        else:
            lo = hi = None
    return worst


def _well_behaved(
    policies: list[tuple[str, str, bool]],
    both: list[Request],
    solo: list[Request],
    duration: float,
    seed: int,
) -> list[dict[str, Any]]:
    """One row per policy: light's p99 TTFT alone and beside heavy, both tenants' TBT, and their
    tokens per second while traffic lasts."""
    rows = []
    solo_ttft: dict[str, float] = {}
    for label, policy, fair in policies:
        # With one tenant rules 9-11 never fire: every slo + vtc variant has the same solo run.
        key = policy.split(":")[0] + (" vtc" if fair else "")
        if key not in solo_ttft:
            alone, _, _ = run_tenants(policy, solo, fair)
            solo_ttft[key] = p99_ttft(alone, "light")
        shared, _, _ = run_tenants(policy, both, fair)
        s, w = solo_ttft[key], p99_ttft(shared, "light")
        heavy = tenant_service(shared, "heavy", duration)
        light = tenant_service(shared, "light", duration)
        rows.append(
            {
                "seed": seed,
                "policy": label,
                "spec": policy,
                "light_p99_ttft_solo_s": s,
                "light_p99_ttft_shared_s": w,
                "ratio": w / s,
                "light_tbt_p99_s": light["tbt_p99_s"],
                "heavy_tbt_p99_s": heavy["tbt_p99_s"],
                "heavy_tbt_max_s": heavy["tbt_max_s"],
                "heavy_tokens_per_s": heavy["tokens_per_s"],
                "light_tokens_per_s": light["tokens_per_s"],
            }
        )
        print(
            f"  {label:30} light p99 TTFT solo {s:.3f} s, beside heavy {w:.3f} s (x{w / s:.2f});"
            f" heavy TBT p99 {heavy['tbt_p99_s'] * 1e3:.0f} ms (max {heavy['tbt_max_s'] * 1e3:.0f}),"
            f" {heavy['tokens_per_s']:.0f} tok/s; light TBT p99 {light['tbt_p99_s'] * 1e3:.0f} ms",
            flush=True,
        )
    return rows


def fairness(quick: bool, variants: tuple[str, ...] = (), seeds: tuple[int, ...] = (1,)) -> dict[str, Any]:
    """``variants``: extra ``slo + vtc`` rows in both comparisons, each a ``;``-joined set of
    slo flags (e.g. ``quantum_tbts=0.6``); ``seeds``: the well-behaved comparison once per
    traffic seed."""
    duration = 30.0 if quick else 60.0
    lengths = (LogNormal(1024, 0.8, 4000), LogNormal(200, 0.8, 1000))
    light_rate = 5.0
    out: dict[str, Any] = {
        "light_rate": light_rate,
        "heavy_rate": 10 * light_rate,
        "duration_s": duration,
        "seeds": list(seeds),
    }
    classes = "slo_classes=all=ttft:2s,tbt:50ms"
    policies = [
        ("vllm fcfs", "vllm", False),
        ("vllm + vtc", "vllm", True),
        ("slo (no vtc)", f"slo:{classes}", False),
        ("slo + vtc, rules 10-11 off", f"slo:fairness=vtc;yield_tbts=0;quantum_tbts=0;{classes}", True),
        ("slo + vtc, rule 11 off", f"slo:fairness=vtc;quantum_tbts=0;{classes}", True),
        ("slo + vtc", f"slo:fairness=vtc;{classes}", True),
    ]
    policies += [(f"slo + vtc, {v}", f"slo:fairness=vtc;{v};{classes}", True) for v in variants]
    rows = []
    for seed in seeds:
        both = tenant_streams(
            (("light", light_rate), ("heavy", 10 * light_rate)), duration, *lengths, seed=seed
        )
        solo = [r for r in both if r.tenant_id == "light"]
        if len(seeds) > 1:
            print(f"  seed {seed}:", flush=True)
        rows += _well_behaved(policies, both, solo, duration, seed)
    out["well_behaved"] = rows
    # Both backlogged: a sends long prompts, b short ones with long outputs, each past capacity.
    a = tenant_streams((("a", 30.0),), duration, LogNormal(2000, 0.5, 4000), LogNormal(100, 0.5, 400), seed=2)
    b = tenant_streams((("b", 30.0),), duration, LogNormal(300, 0.5, 1000), LogNormal(400, 0.5, 1000), seed=3)
    mix = sorted(a + b, key=lambda r: r.arrival_time)
    diffs = []
    for label, policy, fair in [
        ("vllm fcfs", "vllm", False),
        ("vllm + vtc", "vllm", True),
        ("slo + vtc, rules 10-11 off", "slo:fairness=vtc;yield_tbts=0;quantum_tbts=0", True),
        ("slo + vtc", "slo:fairness=vtc", True),
        *((f"slo + vtc, {v}", f"slo:fairness=vtc;{v}", True) for v in variants),
    ]:
        _, recorder, kv_tokens = run_tenants(policy, mix, fair)
        measured = max_service_difference(recorder, "a", "b")
        bound = recorder.vtc.bound(max(r.prompt_len for r in mix), kv_tokens)
        diffs.append(
            {"policy": label, "max_service_difference": measured, "bound": bound, "within": measured <= bound}
        )
        print(f"  {label:30} max service difference {measured:,.0f} (bound {bound:,.0f})", flush=True)
    out["backlogged"] = diffs
    return out
