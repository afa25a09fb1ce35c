"""Assemble an ``LLMEngine`` from a model directory and engine flags: the tokenizer and EOS ids
come from the directory; the scheduler, its KV cache and the executor (PyTorch, or the simulated
one paced in real time) from ``assemble.build_engine``, the same path the simulator takes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tailserve.assemble import BuildOptions, BuiltEngine, build_engine
from tailserve.core.engine import EngineOptions
from tailserve.executors.simulated.calibration_files import read_calibration_file
from tailserve.executors.simulated.cost_binding import bind_cost_model
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.llm.engine_args import EngineArgs
from tailserve.llm.llm_engine import LLMEngine
from tailserve.policies.registry import PolicySpec


def torch_cost_model(calibration: str, model: Path) -> CostModel | None:
    """The real executor's estimated iteration times: the cost model of ``model`` with a
    ``tailserve calibrate --executor torch`` file's host and fitted efficiencies (what the
    ``slo`` policy predicts with, correcting it by measured times); None for auto/none."""
    if calibration in ("auto", "none"):
        return None
    if not calibration.endswith(".json"):
        raise ValueError(
            "with the torch executor, calibration is auto, none or a FILE.json from "
            f"`tailserve calibrate --executor torch`, got {calibration!r}"
        )
    from tailserve.executors.simulated.models import load_hf_config

    cal = read_calibration_file(calibration)
    return CostModel(load_hf_config(model), cal.hardware, 1, cal.efficiency)


def build_llm_engine(model: str | Path | None = None, **kwargs: Any) -> LLMEngine:
    """``kwargs``: the fields of ``EngineArgs``; ValueError for a bad value, TypeError for an
    unknown name."""
    from tailserve.executors.pytorch.loader import load_config
    from tailserve.executors.pytorch.tokenizer import Tokenizer

    args = EngineArgs(**kwargs)
    if model is None:
        from tailserve.executors.pytorch.init_model import default_model_dir

        model = default_model_dir()
    config = load_config(model)
    tokenizer = Tokenizer.from_dir(model)
    spec = PolicySpec.make(args.policy, dict(args.policy_flags or {}))
    options = EngineOptions(
        fast_forward=False, check_integrity=args.check_integrity, keep_iteration_log=False
    )
    eos = tuple(dict.fromkeys((*config.eos_token_ids, *tokenizer.eos_token_ids)))
    name = args.served_model_name or config.name
    if args.executor == "sim":
        deployment = Deployment(
            model=args.sim_model,
            hardware=args.hardware,
            tp=args.tensor_parallel_size,
            calibration=args.calibration,
        )
        cost_model = build_cost_model(deployment, spec.name)
        built = build_engine(
            cost_model,
            spec,
            "realtime-sim",
            # A stand-in server keeps no CPU swap pool (as it always has); its placeholder
            # tokens avoid the tokenizer's EOS and special ids.
            BuildOptions(
                max_model_len=args.max_model_len,
                cpu_swap=False,
                seed=args.seed,
                eos_token_ids=eos,
                vocab_size=tokenizer.vocab_size,
            ),
        )
        engine = LLMEngine(
            built.scheduler,
            built.executor,
            tokenizer,
            name,
            eos_token_ids=(),
            options=options,
            description=_description(built.label, built),
        )
        # What bench --predict should simulate to predict this server (served in /v1/models).
        engine.deployment = {
            "model": cost_model.cost_model.model.name,
            "hardware": cost_model.cost_model.hardware.name,
            "tp": args.tensor_parallel_size,
            "calibration": deployment.calibration,
            "policy": built.spec.label,  # as it runs: async scheduling off on this executor
        }
        return engine
    built = build_engine(
        Path(model),
        spec,
        "torch",
        BuildOptions(
            max_model_len=args.max_model_len,
            seed=args.seed,
            dtype=args.dtype,
            device=args.device,
            kv_cache_memory_gib=args.kv_cache_memory_gib,
            threads=args.threads,
            eos_token_ids=eos,
        ),
    )
    # A calibration file's cost model only estimates the real executor's times (inexact).
    bind_cost_model(built.policy, torch_cost_model(args.calibration, Path(model)), exact=False)
    kv = built.kv_size
    return LLMEngine(
        built.scheduler,
        built.executor,
        tokenizer,
        name,
        eos_token_ids=eos,
        release=built.release,
        options=options,
        description=_description(f"{name} ({built.label})", built)
        + f"; KV cache {kv.num_blocks} blocks x {kv.block_size} tokens",
    )


def _description(what: str, built: BuiltEngine) -> str:
    """The engine in one line, with the defaults its engine's rules chose (vLLM's async
    scheduling off, and why)."""
    notes = "".join(f"; {note}" for note in built.notes)
    return f"{what} under {built.spec.label}{notes}"
