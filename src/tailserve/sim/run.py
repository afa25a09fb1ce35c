"""Run a workload through one policy on a simulated deployment.

deployment -> CostModel (``executors/simulated/deployment.py``); policy spec + engine flags -> Policy, KV cache sized
like vLLM, Scheduler, SimExecutor (``assemble.build_engine``); workload spec -> RequestSource
(fresh requests every run); Engine.run() -> RunResult (requests + iteration log).
"""

from __future__ import annotations

import time
from dataclasses import asdict, fields
from typing import Any

from tailserve.assemble import BuildOptions, build_engine
from tailserve.core.engine import EngineOptions
from tailserve.executors.simulated.deployment import BuiltCostModel
from tailserve.executors.simulated.driver import SimDriver
from tailserve.executors.simulated.expert_load import busiest_shares
from tailserve.policies.registry import PolicySpec
from tailserve.sim.run_file import RunResult
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.workloads import builtin


def run_policy(
    built: BuiltCostModel,
    spec: PolicySpec,
    workload: WorkloadBuilder,
    *,
    options: EngineOptions = EngineOptions(),
) -> RunResult:
    cost_model = built.cost_model
    hardware = cost_model.hardware
    model = cost_model.model
    assembled = build_engine(
        built,
        spec,
        "sim",
        BuildOptions(
            min_max_model_len=workload.min_max_model_len,
            # vLLM hashes blocks into its block pool; SGLang keeps a radix tree beside its slots.
            shares_prefixes=workload.shares_prefixes,
            seed=workload.spec.seed,  # the simulated executor's draws (speculative decoding)
            engine=options,
        ),
        source=workload.build(cost_model),
    )
    engine = assembled.engine
    assert engine is not None  # made over the source
    config = assembled.policy_config
    policy = assembled.policy
    capacity = assembled.kv_size  # the simulator's KVCapacity (vLLM's sizing, for the run file)
    max_model_len = assembled.max_model_len
    kv = assembled.scheduler.kv_cache
    t0, c0 = time.perf_counter(), time.thread_time()
    SimDriver(engine).run()  # the exact fast paths between steps
    wall = time.perf_counter() - t0
    cpu = time.thread_time() - c0  # a loaded machine stretches wall time, not this
    store = engine.finished_store
    if not (store.num_requests if store is not None else engine.requests):
        raise ValueError(f"workload {workload.spec.label}: no requests arrived, nothing to simulate")
    run_config = {
        "policy": spec.name,
        "policy_flags": recorded_flags(config),
        "model": model.name,
        "hardware": hardware.name,
        "tp": cost_model.tp,
        "calibration": built.calibration,
        "efficiency": asdict(cost_model.efficiency),
        "max_model_len": max_model_len,
        "block_size": capacity.block_size,
        "num_kv_blocks": capacity.num_blocks,
        "kv_cache_gib": round(capacity.kv_gib, 3),
        "workload": workload.spec.label,
        "seed": workload.spec.seed,
    }
    label = spec.label
    budget_flag = getattr(config, "max_num_batched_tokens", None)
    if budget_flag is not None and "max_num_batched_tokens" not in spec.flags:
        label += f" (default budget {budget_flag})"
    if built.kernels != "vllm":  # another engine's GEMM / fused-MoE set priced it (hardware.EngineKernels)
        run_config["kernels"] = built.kernels
    run_config["prefix_caching"] = kv.shares_prefixes
    prefix_stats = None
    if kv.shares_prefixes:
        stats = kv.prefix_cache_stats  # None: a radix cache whose tree was never built
        prefix_stats = {"evicted_tokens": stats.num_evicted_tokens if stats is not None else 0}
    notes = [*assembled.notes, *policy.notes()]
    routing = expert_load_config(cost_model)
    if routing is not None:
        run_config["expert_load"] = routing
    pipe = cost_model.pipeline
    if pipe is not None:  # the stages (executors/simulated/pipeline.py), for explain
        run_config["pipeline"] = {"pp": pipe.pp, "layers": list(pipe.layers), "link": pipe.link.name}
    stream = policy.stream_interval()
    if stream.is_set:
        run_config["stream_interval"] = stream.to_json()
        notes.append(
            f"{stream.describe()}: ITL is the gap between streamed chunks as a client times them "
            "(vllm bench serve), TTFT, TPOT and E2E unchanged; the engine's own ITL (Prometheus) "
            "is the run JSON's stream.engine_itl_s"
        )
    tier_flag = policy.kv_spec().host_tier_flag
    if tier_flag is not None and not kv.shares_prefixes:
        notes.append(
            f"{tier_flag}: this workload has no token identities (bare lengths), so no prefix "
            "cache and no host tier behind it; replay a trace with token ids or hash_ids, or use "
            "--workload multi-turn / shared-prefix"
        )
    report = kv.host_tier_report()
    if report is not None and prefix_stats is not None:
        prefix_stats["cpu_tier"], note = report
        notes.append(note)
    if (
        workload.spec.name == "hol"
        and "max_model_len" not in spec.engine_flags
        and model.max_position_embeddings < builtin.HOL_LONG_PROMPT_LEN
    ):
        notes.insert(
            0,
            f"hol's {builtin.HOL_LONG_PROMPT_LEN:,}-token prompt is longer than {model.name}'s "
            f"{model.max_position_embeddings:,}-token context; max_model_len is raised to "
            f"{max_model_len:,} for it (as vLLM with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1), which the "
            "model was not trained for",
        )
    return RunResult(
        label,
        run_config,
        engine.requests,
        engine.log,
        capacity,
        wall,
        notes,
        prefix_stats,
        engine.batches,
        store,
        cpu,
    )


def expert_load_config(cost_model: Any) -> dict[str, Any] | None:
    """The run file's record of uneven expert routing (None: uniform, no EPLB): the ratio given,
    EPLB's redundant experts, the EP size, and the busiest rank's share over the mean at a large
    batch as priced, after EPLB and without it (what ``explain`` says)."""
    load, experts = cost_model.expert_load, cost_model.model.num_experts
    if load.is_uniform and not load.eplb:
        return None
    ep = cost_model.tp * cost_model.dp
    busiest, without = busiest_shares(load, experts, ep)
    return {
        "imbalance": load.imbalance,
        "eplb_redundant_experts": load.redundant,
        "ep": ep,
        "busiest": busiest,
        "busiest_without_eplb": without,
    }


def recorded_flags(config: Any) -> dict[str, Any]:
    """The policy's flags as the run file keeps them: every field, except a field of a feature
    that is off by default (its metadata says ``recorded_when_set``: vLLM's async scheduling and
    speculative decoding) while it is at that default or off, so a run file names the features
    that ran and files written before such a feature existed still compare equal. (Compared
    without ``in``: a limit of 0 where the default is None, vLLM's ``max_num_queued_reqs=0``, is
    set, though ``0 == False``.)"""
    flags = asdict(config)
    for f in fields(config):
        value = flags[f.name]
        if f.metadata.get("recorded_when_set") and (value == f.default or value is False):
            del flags[f.name]  # at its default, or off (async scheduling resolved to off)
    return flags
