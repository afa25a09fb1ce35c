"""A simulated deployment: model, GPU, tensor parallelism and calibration, and the cost model
they give (``build_cost_model``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tailserve.executors.simulated.calibration import (
    PRESETS,
    CalibrationResult,
    calibrate,
    parse_points,
)
from tailserve.executors.simulated.calibration_files import is_calibration_source, load_calibration_source
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.expert_load import ExpertLoad, busiest_shares
from tailserve.executors.simulated.hardware import (
    KERNEL_ENGINES,
    Hardware,
    engine_hardware,
    get_hardware,
    resolve_hardware_name,
)
from tailserve.executors.simulated.models import ModelSpec, get_model, resolve_model_name
from tailserve.executors.simulated.moe_comm import resolve_backend
from tailserve.executors.simulated.pipeline import PP_LINKS, pipeline_note
from tailserve.executors.simulated.precision import get_precision

SEED_PRESET = PRESETS["seed"]
KERNEL_CHOICES = ("auto", *KERNEL_ENGINES)
# The policies that model an engine with kernels of its own in the catalog; every other policy
# (vllm, vllm-v0, sarathi, orca, static, tgi, slo) runs on vLLM's.
POLICY_KERNELS = {"trtllm": "trtllm", "sglang": "sglang"}


def kernel_engine(kernels: str, policy: str = "") -> str:
    """The engine whose kernels price a run: ``kernels`` itself, or for ``auto`` the policy's
    engine (``trtllm`` -> trtllm, ``sglang`` -> sglang, any other or none -> vllm)."""
    return POLICY_KERNELS.get(policy, "vllm") if kernels == "auto" else kernels


# The KV cache's formats the engines store (vLLM 0.32's CacheDType: bfloat16, float16, the fp8
# spellings, int8 / int4 per token head, nvfp4; SGLang's and TensorRT-LLM's fp8 and (Blackwell)
# nvfp4; AMD's fp4 as mxfp4). The scaled weight formats (fp8_block, fp8_static) and fp32 are not.
KV_FORMATS = ("bf16", "fp16", "fp8", "int8", "int4", "mxfp4", "nvfp4")


@dataclass(frozen=True, slots=True)
class Deployment:
    """Model, GPU, TP and calibration, with the names resolved to their catalog entries on
    construction: every spelling a user may type (``llama-3-70b``, ``A100``, a Hugging Face id)
    becomes the canonical name here, so defaults, labels, calibration and JSON never see it."""

    model: str = SEED_PRESET.model
    hardware: str = SEED_PRESET.hardware
    tp: int = SEED_PRESET.tp
    calibration: str = "auto"  # "auto", "none", a preset name, or measured points
    # vLLM's --quantization and --kv-cache-dtype: the weights' and the KV cache's number format
    # ("" = the model's own: its checkpoint's format, bf16 by default; precision.py's names)
    quantization: str = ""
    kv_cache_dtype: str = ""
    # vLLM's --enable-expert-parallel: the experts of an MoE model split whole over the TP ranks
    # (and the DP ranks, with ``dp``)
    expert_parallel: bool = False
    # vLLM's --data-parallel-size (SGLang's --dp-size with --enable-dp-attention): DP ranks of
    # ``tp`` GPUs each, ``dp x tp`` GPUs in all. For an MoE model one engine whose ranks step
    # together and share the experts (cluster/dp_group.py); for a dense model independent
    # replicas behind the engine's balancer (vLLM runs dense DP ranks as separate engines).
    dp: int = 1
    # vLLM's --all2all-backend: how an MoE layer moves tokens between DP ranks (moe_comm.py)
    all2all_backend: str = "allgather_reducescatter"
    # Whose GEMM and fused-MoE kernels price the layers (hardware.EngineKernels): "auto" (the
    # policy's engine: kernel_engine), "vllm", "sglang" or "trtllm"
    kernels: str = "auto"
    # Uneven routing under expert parallelism (expert_load.py): the per-rank imbalance ratio
    # (max - mean) / mean the engine reports without EPLB (TensorRT-LLM's report_load_statistics;
    # vLLM's balancedness b is 1 / b - 1); 0: uniform routing
    expert_imbalance: float = 0.0
    # vLLM's --enable-eplb and its eplb_config num_redundant_experts (SGLang's --enable-eplb,
    # --ep-num-redundant-experts; TensorRT-LLM's load_balancer num_slots - experts)
    enable_eplb: bool = False
    num_redundant_experts: int = 0
    # the EP size expert_imbalance was measured at, when a plan runs the routing at another (0:
    # this deployment's own, tp x dp)
    expert_imbalance_ep: int = 0
    # vLLM's --pipeline-parallel-size: the layers split over ``pp`` stages of ``tp`` GPUs each
    # (pipeline.py), the stages joined by ``pp_link``: "auto", NVLink inside one NVLink domain and
    # InfiniBand NDR past it, or the network named (the stages on separate nodes)
    pp: int = 1
    pp_link: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", resolve_model_name(self.model))
        for name, flag in (("quantization", "--quantization"), ("kv_cache_dtype", "--kv-cache-dtype")):
            value = getattr(self, name).strip().lower()
            if value in ("", "auto", "none"):
                value = ""
            else:
                try:
                    value = get_precision(value).name
                except ValueError as error:
                    raise ValueError(f"{flag}: {error}") from None
                if name == "kv_cache_dtype" and value not in KV_FORMATS:
                    raise ValueError(
                        f"{flag} {getattr(self, name)}: not a KV cache format the engines store; "
                        f"KV formats: auto, {', '.join(KV_FORMATS)}"
                    )
            object.__setattr__(self, name, value)
        object.__setattr__(self, "hardware", resolve_hardware_name(self.hardware))
        keyword = self.calibration.strip().lower()
        if keyword in ("auto", "none") or keyword in PRESETS:
            object.__setattr__(self, "calibration", keyword)
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp}")
        if self.dp < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {self.dp}")
        if self.pp < 1:
            raise ValueError(f"--pipeline-parallel-size must be >= 1, got {self.pp}")
        if self.pp_link not in PP_LINKS:
            raise ValueError(f"--pp-link: unknown {self.pp_link!r}; choose from {', '.join(PP_LINKS)}")
        object.__setattr__(self, "all2all_backend", resolve_backend(self.all2all_backend))
        kernels = self.kernels.strip().lower().replace("-", "")
        kernels = {"tensorrtllm": "trtllm"}.get(kernels, kernels)
        if kernels not in KERNEL_CHOICES:
            raise ValueError(f"--kernels: unknown {self.kernels!r}; choose from {', '.join(KERNEL_CHOICES)}")
        object.__setattr__(self, "kernels", kernels)
        if self.num_redundant_experts < 0:
            raise ValueError(f"--num-redundant-experts must be >= 0, got {self.num_redundant_experts}")
        if self.num_redundant_experts and not self.enable_eplb:
            # vLLM's ParallelConfig check (vllm/config/parallel.py:581-587@v0.32.0)
            raise ValueError(
                f"num_redundant_experts is set to {self.num_redundant_experts} but EPLB is not enabled. "
                "Either enable EPLB (--enable-eplb) or unset num_redundant_experts."
            )
        if self.enable_eplb and not self.expert_parallel:
            raise ValueError(
                "enable_expert_parallel must be True to use EPLB (--enable-eplb needs --enable-expert-parallel)"
            )

    @property
    def expert_load(self) -> ExpertLoad:
        """The routing the cost model prices (``expert_load.py``)."""
        return ExpertLoad(
            self.expert_imbalance,
            self.num_redundant_experts if self.enable_eplb else None,
            self.expert_imbalance_ep if self.expert_imbalance_ep != self.tp * self.dp else 0,
        )

    @classmethod
    def of(
        cls,
        model: str,
        hardware: str,
        tp: int | None = None,
        calibration: str = "auto",
        quantization: str = "",
        kv_cache_dtype: str = "",
        expert_parallel: bool = False,
        dp: int = 1,
        all2all_backend: str = "allgather_reducescatter",
        kernels: str = "auto",
        *,
        expert_imbalance: float = 0.0,
        enable_eplb: bool = False,
        num_redundant_experts: int = 0,
        pp: int = 1,
        pp_link: str = "auto",
    ) -> Deployment:
        """As the CLI builds one: without a TP, the seed deployment's own (4) for its model and
        GPU, 1 otherwise — decided on the resolved names, whatever the spelling."""
        names = cls(
            model,
            hardware,
            1,
            calibration,
            quantization,
            kv_cache_dtype,
            expert_parallel,
            dp,
            all2all_backend,
            kernels,
            expert_imbalance,
            enable_eplb,
            num_redundant_experts,
            pp=pp,
            pp_link=pp_link,
        )
        if tp is None:
            tp = SEED_PRESET.tp if names.is_seed else 1
        return replace(names, tp=tp)

    def model_spec(self) -> ModelSpec:
        """The model's shapes with this deployment's number formats: ``quantization`` sets every
        weight's (experts' too, as vLLM quantizes them) but for the groups of linear layers the
        model's checkpoint keeps in another format (``ModelSpec.module_dtypes``: a catalog
        entry's, or a config's ignore list), ``kv_cache_dtype`` the KV cache's. A catalog model
        without such groups (DeepSeek-V3) is quantized whole; ``DeepSeek-R1-FP4`` keeps NVIDIA's
        exclusions."""
        spec = get_model(self.model)
        if self.quantization:
            spec = replace(
                spec, weight_dtype=self.quantization, expert_dtype=self.quantization if spec.is_moe else ""
            )
        if self.kv_cache_dtype:
            spec = replace(spec, kv_dtype=self.kv_cache_dtype)
        return spec

    @property
    def data_parallel_group(self) -> bool:
        """Whether the deployment is one engine of lockstep DP ranks (an MoE model, dp > 1)."""
        return self.dp > 1 and get_model(self.model).is_moe

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def is_seed(self) -> bool:
        return (self.model, self.hardware) == (SEED_PRESET.model, SEED_PRESET.hardware)

    def for_policy(self, policy: str) -> Deployment:
        """This deployment with ``kernels`` "auto" resolved for ``policy`` (``kernel_engine``): the
        key a memo of built cost models shares between policies on the same engine's kernels."""
        return replace(self, kernels=kernel_engine(self.kernels, policy))

    def resolved_calibration(self) -> str:
        """``auto`` means the seed preset for the seed's model and GPU, the bare roofline otherwise."""
        if self.calibration != "auto":
            return self.calibration
        return SEED_PRESET.name if self.is_seed else "none"


@dataclass(frozen=True, slots=True)
class BuiltCostModel:
    cost_model: CostModel
    calibration: str  # what was applied: "none", a preset name or the points
    fit: CalibrationResult | None = None
    notes: tuple[str, ...] = ()
    # The engine whose kernel set priced the GEMMs and fused MoE (hardware.EngineKernels):
    # "vllm" when the GPU's own curves did, also when the chosen engine has no set on it.
    kernels: str = "vllm"


def build_cost_model(deployment: Deployment, policy: str = "") -> BuiltCostModel:
    """The deployment's cost model; ``policy`` (a registry name) decides ``kernels`` "auto".
    With ``dp`` > 1 it prices one DP rank: an MoE model's with the experts over all ``dp x tp``
    GPUs and the layers' token exchange; a dense model's as a lone engine of ``tp`` GPUs (its DP
    ranks never wait for each other)."""
    built = _build_cost_model(deployment, deployment.for_policy(policy).kernels)
    cm = built.cost_model
    if deployment.expert_parallel:
        cm = cm.with_expert_parallel()
    if deployment.dp > 1:
        hardware = get_hardware(deployment.hardware)
        if deployment.dp * deployment.tp > hardware.nvlink_domain:
            raise ValueError(
                f"--data-parallel-size {deployment.dp} x --tp {deployment.tp} = {deployment.dp * deployment.tp} GPUs is more "
                f"than one {hardware.name} NVLink domain ({hardware.nvlink_domain}): the exchange between "
                "nodes is not modelled"
            )
        if cm.model.is_moe:
            if deployment.pp > 1:
                raise ValueError(
                    "an MoE model's data-parallel group with pipeline stages (--data-parallel-size with "
                    "--pipeline-parallel-size) is not modelled: give one of them"
                )
            if deployment.all2all_backend == "deepep_auto" and policy and not policy.startswith("sglang"):
                raise ValueError(
                    f"--all2all-backend deepep_auto is SGLang's --deepep-mode auto; the {policy} policy's engine "
                    "runs deepep_low_latency or deepep_high_throughput"
                )
            cm = cm.with_data_parallel(deployment.dp, deployment.all2all_backend)
        else:
            note = (
                f"{cm.model.name} is dense: its {deployment.dp} data-parallel ranks run as independent "
                f"replicas of TP {deployment.tp} (vLLM runs a dense model's DP ranks as separate engines)"
            )
            built = replace(built, notes=(*built.notes, note))
    domain = cm.hardware.nvlink_domain
    if deployment.tp > domain:
        note = (
            f"TP {deployment.tp} spans {-(-deployment.tp // domain)} {cm.hardware.name} NVLink domains of {domain}: "
            "its all-reduces are priced as inside one (TP over the network between nodes is not modelled); "
            f"pipeline stages across nodes are: --tp {domain} --pipeline-parallel-size {-(-deployment.tp // domain)}"
        )
        built = replace(built, notes=(*built.notes, note))
    if deployment.pp > 1:
        cm = cm.with_pipeline(deployment.pp, deployment.pp_link)
        built = replace(built, notes=(*built.notes, pipeline_note(cm)))
    load = deployment.expert_load
    if not load.is_uniform or load.eplb:  # after the DP ranks: the EP group is tp x dp
        cm = cm.with_expert_load(load)
        built = replace(built, notes=(*built.notes, expert_load_note(cm)))
    if cm.hardware.gemm_table is not None:  # aisim:FILE: said once, here (the run's model is built once)
        notes = cm.table_notes
        if cm.mla_outside:
            notes += (
                "MLA's attention block (projections, attention, fixed terms) keeps the catalog's fitted "
                f"terms: {cm.mla_outside}",
            )
        if cm.table_outside:
            notes += (f"outside the measured shapes, on the catalog's curve: {', '.join(cm.table_outside)}",)
        built = replace(built, notes=(*built.notes, *notes))
    return replace(built, cost_model=cm)


def expert_load_note(cost_model: CostModel) -> str:
    """What the routing given does to the busiest expert-parallel rank, in one line."""
    load, m = cost_model.expert_load, cost_model.model
    ep = cost_model.tp * cost_model.dp
    after, before = busiest_shares(load, m.num_experts, ep)
    text = f"{load.describe()} over {ep} EP ranks of {m.name}'s {m.num_experts} experts: "
    if load.eplb and load.is_uniform:
        text += (
            "with uniform routing EPLB has nothing to balance (give --expert-imbalance R, the ratio your "
            "engine reports, for what it balances)"
        )
    elif load.eplb:
        text += f"the busiest rank routes {after:.2f}x the mean at a large batch ({before:.2f}x without EPLB)"
    else:
        text += f"the busiest rank routes {before:.2f}x the mean at a large batch"
    if load.redundant:
        text += (
            f"; the redundant experts' weights take {cost_model.redundant_expert_bytes / 2**30:.1f} GiB "
            "per GPU from the KV cache"
        )
    return text


def _build_cost_model(deployment: Deployment, engine: str) -> BuiltCostModel:
    model = deployment.model_spec()
    hardware, kernel_note = engine_hardware(get_hardware(deployment.hardware), engine)
    kernels = "vllm" if kernel_note else engine
    built = _calibrated(deployment, model, hardware)
    notes = (kernel_note, *built.notes) if kernel_note else built.notes
    return replace(built, notes=notes, kernels=kernels)


def _calibrated(deployment: Deployment, model: ModelSpec, hardware: Hardware) -> BuiltCostModel:
    base = CostModel(model, hardware, deployment.tp)
    calibration = deployment.resolved_calibration()
    if calibration == "none":
        return BuiltCostModel(base, "none")
    notes: list[str] = []
    if calibration in PRESETS:
        preset = PRESETS[calibration]
        points = parse_points(preset.points)
        # The points were measured at the preset's deployment: fit there, apply here.
        fit_at = CostModel(get_model(preset.model), get_hardware(preset.hardware), preset.tp, preset.base)
        if model.name != preset.model or hardware.name != preset.hardware:
            notes.append(
                f"calibration {preset.name!r} was measured on {preset.model} / {preset.hardware}; "
                f"its efficiencies are applied to {model.name} / {hardware.name}"
            )
    elif is_calibration_source(calibration):  # FILE.json, vidur:DIR, gemm:FILE or aisim:FILE
        cm, source_fit, source_notes = load_calibration_source(calibration, model, hardware, deployment.tp)
        return BuiltCostModel(cm, calibration, source_fit, source_notes)
    else:
        points = parse_points(calibration)
        fit_at = base
    fit = calibrate(fit_at, points)
    return BuiltCostModel(base.with_efficiency(fit.efficiency), calibration, fit, tuple(notes))
