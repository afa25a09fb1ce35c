"""``build_engine``: the one assembly path for the simulator, ``LLM`` / ``LLMEngine``, the server
and ``bench --predict`` (and many replicas of one deployment).

    deployment (simulated) | model directory (real)
      -> policy config for the device -> KV capacity -> KV manager -> Scheduler   (scheduler.py)
      -> executor: SimExecutor | RealtimeSimExecutor | TorchExecutor
      -> Engine over a RequestSource, when one is given (nothing runs yet)

The KV capacity step is the executor's own (``simulated.py``, ``pytorch.py``); the rest is
written once. torch is imported only for ``executor="torch"``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tailserve.assemble.scheduler import KVSize, SchedulerParts, overlap_flag
from tailserve.assemble.simulated import simulated_scheduler
from tailserve.core.engine import Engine, EngineOptions, VirtualClock, WallClock
from tailserve.core.executor import Executor
from tailserve.core.policy import Policy
from tailserve.core.scheduler import Scheduler
from tailserve.core.source import RequestSource
from tailserve.executors.simulated.cost_binding import bind_cost_model
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.deployment import BuiltCostModel, Deployment, build_cost_model
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.models import MODELS
from tailserve.policies.registry import PIPELINED_POLICIES, PolicySpec, parse_policy_list, runs_under_stages

ExecutorKind = Literal["sim", "realtime-sim", "torch"]
EXECUTOR_KINDS: tuple[str, ...] = ("sim", "realtime-sim", "torch")


@dataclass(frozen=True, slots=True)
class BuildOptions:
    """Everything but the deployment, the policy and the executor kind; each field says which
    executors read it."""

    max_model_len: int | None = None  # tokens; None: the model's context (a --max-model-len flag wins)
    min_max_model_len: int = 0  # sim: the workload's need raises the default (hol's long prompt)
    shares_prefixes: bool = True  # sim: False for bare lengths, which no prefix cache could match
    cpu_swap: bool = True  # simulated: give a policy's swap_space a CPU pool
    seed: int = 0  # torch, realtime-sim: sampling; sim: speculative decoding's acceptance draws
    dtype: str = "auto"  # torch
    device: str = "cpu"  # torch
    kv_cache_memory_gib: float | None = None  # torch: KV budget (None: 2 GiB on CPU, vLLM's rule on CUDA)
    threads: int | None = None  # torch on CPU: intra-op threads (None: the free cores, revisited)
    eos_token_ids: tuple[int, ...] = ()  # torch: the sampler's EOS; realtime-sim: never sampled
    vocab_size: int = 0  # realtime-sim: placeholder tokens are drawn below this
    engine: EngineOptions = field(default_factory=EngineOptions)  # for the Engine made over ``source``
    pd_pair: bool = False  # sim: a side of a P/D pair (cluster/sglang_pd.py), which may set a P/D mode


@dataclass(slots=True)
class BuiltEngine:
    """An assembled engine, not yet run: the scheduler and executor (a live ``LLMEngine`` wraps
    them), and the ``Engine`` over the ``source`` given to ``build_engine`` (None without one)."""

    kind: str  # an EXECUTOR_KINDS value
    parts: SchedulerParts
    executor: Executor
    label: str  # the executor in words: "simulated Llama-3-8B on H100-SXM x1", "21.0 M parameters, ..."
    cost_model: BuiltCostModel | None = None  # simulated kinds
    release: Callable[[str], None] | None = None  # torch: forget a request's sampler state
    engine: Engine | None = None

    @property
    def scheduler(self) -> Scheduler:
        return self.parts.scheduler

    @property
    def policy(self) -> Policy:
        return self.parts.policy

    @property
    def policy_config(self) -> Any:
        return self.parts.config

    @property
    def kv_size(self) -> KVSize:
        return self.parts.kv_size

    @property
    def max_model_len(self) -> int:
        return self.parts.max_model_len

    @property
    def spec(self) -> PolicySpec:
        """The policy as it runs: the one asked for, with any default the executor had to change
        (``async_scheduling=False`` where it runs steps synchronously)."""
        return self.parts.spec

    @property
    def notes(self) -> tuple[str, ...]:
        """Defaults chosen by the engine's rules, a line each (vLLM's async scheduling)."""
        return self.parts.notes

    def make_engine(
        self,
        source: RequestSource,
        clock: VirtualClock | WallClock | None = None,
        options: EngineOptions = EngineOptions(),
    ) -> Engine:
        """The ``Engine`` over ``source`` (a virtual clock unless one is given); once per build,
        since the scheduler and its KV cache belong to that engine."""
        if self.engine is not None:
            raise ValueError("this BuiltEngine already has its Engine; build another for another source")
        self.engine = Engine(self.scheduler, self.executor, source, clock, options)
        return self.engine


def build_engine(
    target: Deployment | BuiltCostModel | str | Path,
    policy: PolicySpec | str,
    executor: ExecutorKind = "sim",
    options: BuildOptions = BuildOptions(),
    *,
    source: RequestSource | None = None,
    clock: VirtualClock | WallClock | None = None,
) -> BuiltEngine:
    """Assemble one engine. ``target``: a simulated deployment (or its built cost model, to
    share one fit between many engines) for ``sim`` / ``realtime-sim``; a Hugging Face model
    directory for ``torch``. ``policy``: a spec or its text, ``NAME[:flag=value...]``.
    With ``source`` the ``Engine`` is made too (``options.engine``, ``clock``), ready for
    ``run()`` or ``step()``; ValueError for anything that cannot be built."""
    spec = _policy_spec(policy)
    if executor == "torch":
        if not isinstance(target, (str, Path)):
            raise ValueError(f"executor 'torch' needs a model directory, got {type(target).__name__}")
        built = _build_torch(Path(target), spec, options)
    elif executor in ("sim", "realtime-sim"):
        if isinstance(target, (str, Path)):
            raise ValueError(f"executor {executor!r} needs a simulated Deployment, got a path {target}")
        built = _build_simulated(target, spec, executor, options)
    else:
        raise ValueError(f"unknown executor kind {executor!r}; known: {', '.join(EXECUTOR_KINDS)}")
    mode = getattr(built.parts.config, "disaggregation_mode", "null")
    if mode != "null" and not options.pd_pair:
        raise ValueError(
            f"disaggregation_mode={mode} makes this engine one side of a prefill/decode pair: simulate "
            "the pair with --prefill-replicas / --decode-replicas (the pair sets each side's mode)"
        )
    if source is not None:
        built.make_engine(source, clock, options.engine)
    return built


def _policy_spec(policy: PolicySpec | str) -> PolicySpec:
    if isinstance(policy, PolicySpec):
        return policy
    specs = parse_policy_list(policy)
    if len(specs) != 1:
        raise ValueError(f"one policy expected, got {policy!r}")
    return specs[0]


def _build_simulated(
    target: Deployment | BuiltCostModel, spec: PolicySpec, kind: str, options: BuildOptions
) -> BuiltEngine:
    built = target if isinstance(target, BuiltCostModel) else build_cost_model(target, spec.name)
    cost_model = built.cost_model
    model = cost_model.model
    if cost_model.pipeline is not None:
        spec = _pipelined_spec(spec, cost_model.pipeline.pp, kind, options)
        pp = cost_model.pipeline.pp
        if (
            spec.name == "vllm"
            and spec.flags.get("speculative_method") == "eagle3"
            and not _eagle3_over_pp(model)
        ):
            # v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:44-50@v0.32.0 (the V2 model runner)
            raise ValueError(
                f"{model.name} does not support eagle3 with pipeline parallelism (vLLM relays the "
                "auxiliary hidden states over the stages only for its Llama and Qwen2 decoders)"
            )
        if not runs_under_stages(spec.name, model.num_layers, pp):
            # ModelConfig.verify_with_parallel_config: "Total number of hidden layers ... must be divisible
            # by pipeline parallel size"
            raise ValueError(
                f"{spec.name} runs in Sarathi-Serve's pipelined engine, which needs the layers ({model.num_layers} "
                f"in {model.name}) divisible by the pipeline stages ({pp})"
            )
    elif spec.flags.get("pipeline_parallel_size", 1) != 1:
        if kind != "sim":
            raise ValueError(
                f"pipeline parallelism is simulated in virtual time (simulate, tune, cost), not by the {kind} "
                "executor that paces serve"
                if kind == "realtime-sim"
                else f"pipeline parallelism needs the simulated executor (sim), not {kind!r}"
            )
        raise ValueError(
            f"pipeline_parallel_size={spec.flags['pipeline_parallel_size']} is the deployment's: give "
            "--pipeline-parallel-size (its stages price the steps)"
        )
    default_len = options.max_model_len or max(model.max_position_embeddings, options.min_max_model_len)
    max_model_len = spec.engine_flags.get("max_model_len", default_len)
    parts = simulated_scheduler(
        cost_model,
        spec,
        max_model_len,
        shares_prefixes=options.shares_prefixes,
        cpu_swap=options.cpu_swap,
        synchronous=_synchronous(kind, cost_model),
    )
    # A policy that predicts iteration times (slo) predicts with the simulator's own cost model,
    # whose predictions are this engine's iteration times.
    bind_cost_model(parts.policy, cost_model, exact=True)
    block_size = parts.kv_size.block_size
    executor: Executor
    if kind == "sim":
        # Drafts' acceptance is drawn per request, seeded by the run's seed (spec_decode.py).
        policy = parts.policy
        executor = SimExecutor(
            cost_model, block_size, policy.speculative_decoding(), options.seed, policy.cuda_graph_padding()
        )
    else:
        _refuse_virtual_time_only(parts.policy, kind)
        from tailserve.executors.simulated.realtime import RealtimeSimExecutor

        executor = RealtimeSimExecutor(
            cost_model,
            block_size,
            options.vocab_size,
            set(options.eos_token_ids),
            options.seed,
            parts.policy.cuda_graph_padding(),
        )
    label = f"simulated {model.name} on {cost_model.hardware.name} x{cost_model.tp}"
    if cost_model.pipeline is not None:
        label += f" x PP {cost_model.pipeline.pp}"
    return BuiltEngine(kind, parts, executor, label, cost_model=built)


def _eagle3_over_pp(model: Any) -> bool:
    """Whether vLLM 0.32 runs EAGLE-3 under pipeline parallelism for ``model`` (a catalog
    ModelSpec): its decoder sets ``supports_aux_hidden_states_over_pp`` — ``LlamaModel``
    (Llama 2/3/4, Mistral, Yi) and ``Qwen2Model`` (Qwen2.5, dense Qwen3), ``llama.py:358``,
    ``qwen2.py:335``; a model outside the catalog is given the benefit of the doubt."""
    name = model.name
    if name not in MODELS:
        return True
    return name.startswith(("Llama-", "Mistral-", "Yi-", "Qwen2.5-")) or (
        name.startswith("Qwen3-") and not model.is_moe
    )


def _pipelined_spec(spec: PolicySpec, pp: int, kind: str, options: BuildOptions) -> PolicySpec:
    """The policy under the deployment's ``pp`` pipeline stages: its config's
    ``pipeline_parallel_size`` (vLLM's batch queue, policies/vllm_pipeline.py; Sarathi-Serve's
    pipelined engine for sarathi, orca and vllm-v0, policies/sarathi_pipeline.py); a policy
    without one, or a combination not simulated, is refused in one line."""
    given = spec.flags.get("pipeline_parallel_size")
    if given is not None and given != pp:
        raise ValueError(
            f"{spec.name}:pipeline_parallel_size={given} disagrees with the deployment's "
            f"--pipeline-parallel-size {pp}"
        )
    if spec.name not in PIPELINED_POLICIES:
        raise ValueError(
            f"pipeline parallelism (--pipeline-parallel-size {pp}) is simulated for the vllm policy "
            "(vLLM's batch queue), trtllm (its PP loop) and sarathi, orca and vllm-v0 (Sarathi-Serve's "
            f"pipelined engine), not {spec.name}"
        )
    if kind != "sim":
        raise ValueError(
            f"pipeline parallelism is simulated in virtual time (simulate, tune, cost), not by the {kind} "
            "executor that paces serve"
        )
    if options.pd_pair:
        raise ValueError("pipeline parallelism on a side of a prefill/decode pair is not simulated")
    if spec.flags.get("kv_offloading_size"):
        raise ValueError("a CPU KV tier (kv_offloading_size) under pipeline parallelism is not simulated")
    return PolicySpec(spec.name, {**spec.flags, "pipeline_parallel_size": pp}, spec.engine_flags)


def _synchronous(kind: str, cost_model: CostModel) -> str:
    """Why a simulated engine steps only synchronously ("" when it can schedule a step while the
    previous one runs): what turns a default async scheduling off (assemble/scheduler.py)."""
    if kind == "realtime-sim":
        return "the real-time simulated executor (serve --executor sim) runs steps synchronously"
    if cost_model.dp > 1 and cost_model.model.is_moe:
        return "tailserve steps an MoE model's data-parallel ranks in lockstep, synchronously"
    return ""


def _build_torch(model_dir: Path, spec: PolicySpec, options: BuildOptions) -> BuiltEngine:
    from tailserve.assemble.pytorch import torch_parts

    t = torch_parts(
        model_dir,
        spec,
        dtype=options.dtype,
        device=options.device,
        seed=options.seed,
        max_model_len=options.max_model_len,
        kv_cache_memory_gib=options.kv_cache_memory_gib,
        eos_token_ids=options.eos_token_ids,
        threads=options.threads,
    )
    _refuse_virtual_time_only(t.parts.policy, "torch")
    return BuiltEngine("torch", t.parts, t.executor, t.label, release=t.executor.release)


def _refuse_virtual_time_only(policy: Policy, kind: str) -> None:
    """vLLM's async scheduling and speculative decoding are simulated (virtual time, drafts drawn
    by the simulated executor); a real or real-time executor refuses them in one line."""
    if policy.async_scheduling():
        flag = overlap_flag(getattr(policy, "config", None))
        raise ValueError(
            f"executor {kind!r} runs steps synchronously: {flag} needs the simulated executor (sim)"
        )
    if policy.speculative_decoding() is not None:
        raise ValueError(
            f"executor {kind!r} does not do speculative decoding: it needs the simulated executor (sim)"
        )
