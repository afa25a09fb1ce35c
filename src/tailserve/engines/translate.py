"""A linted launch line as tailserve's own settings: the policy spec and the deployment.

The mapping is generic: tailserve's policy config fields are the engines' flag names, so a
scheduling flag whose name (or table ``target``) is a field of the chosen policy's config passes
through as it is, and a field added to a policy later is picked up without a change here; one
the policy lacks is reported as not modelled. Engine-wide flags (``block_size``,
``gpu_memory_utilization``, ``max_model_len``) go to the spec's engine flags, the model, TP,
formats and expert parallelism to the ``Deployment``. The GPU is not on a launch line: it stays
tailserve's ``--hardware``. The keys of an options file the line names map the same way (its
rows feed the names its table gives: ``scheduler_config.capacity_scheduler_policy`` feeds
``capacity_scheduler_policy``); a file that is not there stops the translation (its settings
would be missing from the run), and a key set to null keeps the engine's default.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tailserve.core.device import DeviceInfo
from tailserve.engines import speculative, trtllm_options, vllm_flags
from tailserve.engines.flag_spec import DEPLOYMENT, FATAL, NO_OP, NOT_MODELLED, SCHEDULING
from tailserve.engines.lint import ENGINE_NAMES, Report
from tailserve.engines.sglang_flags import A2A_EP_SPANNING
from tailserve.engines.trtllm_options import TENSORRT_BACKENDS
from tailserve.engines.vllm_kv_transfer import offloading_gib
from tailserve.policies.registry import ENGINE_FLAGS, POLICIES, PolicySpec, policy_flags

_FP8_KV = ("fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True, slots=True)
class Translation:
    spec: PolicySpec
    deployment: dict[str, Any] = field(default_factory=dict)  # model, tp, quantization, ...
    taken: tuple[str, ...] = ()  # flags taken into the spec or the deployment, as typed
    ignored: tuple[str, ...] = ()  # "--flag (verdict)" for the flags the simulation leaves out
    speculates: bool = False  # the line drafts tokens the simulation verifies

    def summary(self, report: Report) -> str:
        """One line: what was taken from the command and what was left out."""
        engine = f"{ENGINE_NAMES[report.engine]} {report.version.version}"
        why = f" ({report.policy_why})" if report.policy_why else ""
        deployment = " ".join(
            _option(k) if v is True else f"{_option(k)} {v}"
            for k, v in self.deployment.items()
            if v not in ("", False)
        )
        text = f"{engine}{why}: --policy {self.spec.label}" + (f" {deployment}" if deployment else "")
        if self.ignored:
            text += f"; not simulated: {', '.join(self.ignored)}"
        return text


def translate(
    report: Report,
    device: DeviceInfo | None = None,
    acceptance_length: float | None = None,
    experts: Callable[[str], int] | None = None,
) -> Translation:
    """The policy spec and deployment of ``report``'s line; ValueError (one line) for a line the
    engine would refuse, or a policy this tailserve does not have. ``acceptance_length``: the
    drafts' acceptance where the line speculates without giving one (``engines/speculative.py``).
    ``experts``: a model's routed experts as the line names it (ValueError: not known), which
    TensorRT-LLM's load balancer needs (its ``num_slots`` are the experts plus the redundant
    ones); the caller gives it, as the translation stays off the simulator's model catalog
    (without it, EPLB is taken with no redundant experts, and that is said)."""
    if report.refused:
        raise ValueError(
            f"the engine would not start: {_first_fatal(report)} (tailserve lint shows every flag)"
        )
    if report.unread:
        raise ValueError(
            f"the engine command's options file {report.unread[0]} is not there (looked from "
            f"{os.getcwd()}): tailserve reads it to simulate the line; give its path from here"
        )
    if report.policy not in POLICIES:
        raise ValueError(
            f"the {report.policy} policy is not available in this tailserve; `tailserve lint` still reads "
            f"{ENGINE_NAMES[report.engine]} lines (policies: {', '.join(POLICIES)})"
        )
    fields = policy_flags(POLICIES[report.policy])
    flags: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    deployment: dict[str, Any] = {}
    taken: list[str] = []
    ignored: list[str] = []
    dp_attention = report.engine == "sglang" and bool(report.values.get("enable_dp_attention"))
    backend = "pytorch"
    speculates = False
    last_drafts = next((r for r in reversed(report.rows) if r.name == "speculative_config"), None)
    last_eplb = next((r for r in reversed(report.rows) if r.name == "eplb_config"), None)
    eplb_redundant: int | None = None  # vLLM's --eplb-config num_redundant_experts
    eplb_slots: tuple[str, int] | None = None  # TensorRT-LLM's load balancer: (its row, num_slots)
    for row in report.rows:
        if report.engine == "trtllm" and row.name == "moe_config" and row.value is not None:
            eplb_slots = _trtllm_load_balancer(row, ignored)
            if eplb_slots is not None:
                taken.append(row.flag)
            continue
        if report.engine == "sglang" and row.name in ("moe_a2a_backend", "deepep_mode"):
            taken.append(row.flag)  # read together after the loop (_sglang_exchange)
            continue
        if dp_attention and row.name == "dp_size":
            deployment["attn_dp"] = row.value  # --dp-size N --enable-dp-attention: --attn-dp-size N
            taken.append(row.flag)
            continue
        if row.verdict in (NO_OP, NOT_MODELLED):
            ignored.append(f"{row.flag} ({row.verdict})")
            continue
        if row.verdict not in (SCHEDULING, DEPLOYMENT) or not row.feeds:
            continue  # --host and the like
        if row.value is None:
            continue  # a file's null: the engine's own default
        if row.name == "speculative_config" and report.engine in ("vllm", "trtllm"):
            if row is not last_drafts:
                continue  # a later one replaces it (vLLM: the last value, or the dotted keys)
            read = speculative.vllm_fields if report.engine == "vllm" else speculative.trtllm_fields
            drafts, left_out = read(row.value, acceptance_length)
            if drafts and not set(drafts) <= set(fields):
                ignored.append(f"{row.flag} (not modelled by tailserve's {report.policy} policy)")
                continue
            flags.update(drafts)
            ignored.extend(left_out)
            if drafts:
                taken.append(row.flag)
                speculates = True
            continue
        if report.engine == "vllm" and row.name == "eplb_config":
            if row is last_eplb:  # the last one given (the dotted keys after any JSON) is vLLM's
                config, _ = vllm_flags.eplb_config(row.value, report.version.version)
                eplb_redundant = config.get(vllm_flags.EPLB_READ, 0)
                left = [key for key in config if key != vllm_flags.EPLB_READ]
                ignored.extend(f"{row.flag.split('.')[0]} {key} (not modelled)" for key in left)
                taken.append(row.flag)
            continue
        if report.engine == "vllm" and row.name == "kv_transfer_config":
            gib = offloading_gib(row.value)  # (its rule made it "scheduling" only then)
            if gib is not None and "kv_offloading_size" in fields:
                flags["kv_offloading_size"] = gib  # what --kv-offloading-size builds
                taken.append(row.flag)
            else:
                ignored.append(f"{row.flag} (not modelled by tailserve's {report.policy} policy)")
            continue
        if report.engine == "trtllm" and row.name == "backend":
            backend = row.value  # the last given wins: launch_server reads it after the file
            taken.append(row.flag)
            continue
        target = row.feeds
        if target.startswith("deployment."):
            deployment[target.removeprefix("deployment.")] = row.value
        elif target in fields:
            flags[target] = row.value
        elif target in ENGINE_FLAGS:
            engine[target] = row.value
        else:
            ignored.append(f"{row.flag} (not modelled by tailserve's {report.policy} policy)")
            continue
        taken.append(row.flag)
    if report.engine == "sglang":
        ignored += _sglang_exchange(report, deployment)
        spans = str(report.values.get("moe_a2a_backend") or "none") in A2A_EP_SPANNING
        if spans:  # SGLang resolves ep_size = tp_size, whatever --ep-size said (_a2a_ep_size)
            deployment["expert_parallel"] = deployment.get("tp", 1)
    if eplb_redundant and "num_redundant_experts" not in deployment:  # 0.11's --num-redundant-experts wins
        deployment["num_redundant_experts"] = eplb_redundant
    if eplb_slots is not None:
        ignored += _trtllm_redundant(eplb_slots, deployment, experts)
    if report.engine == "trtllm" and deployment.get("dp_attention"):
        # enable_attention_dp: every TP rank an attention-DP rank (the MoE layers keep the TP/EP size)
        deployment["attn_dp"] = deployment.get("tp", 1)
    deployment = _deployment(deployment)
    deployment = _attention_dp(deployment)
    for name, value in report.version.policy_defaults.items():
        if name in fields and name not in flags:
            flags[name] = value  # how this version's scheduler behaves where the policy's default differs
    if (
        report.engine == "vllm"
        and str(report.values.get("distributed_executor_backend", "")) == "ray"
        and "async_scheduling" in fields
        and "async_scheduling" not in flags
    ):
        # vLLM turns it off for Ray's executor (vllm_flags._async_backend_rule)
        flags["async_scheduling"] = False
    if backend in TENSORRT_BACKENDS and "disable_overlap_scheduler" in fields:
        # The C++ executor has no overlap scheduler, whatever the file says (trtllm_options.BACKEND_WHAT).
        flags["disable_overlap_scheduler"] = True
    if report.engine == "vllm" and report.policy == "vllm" and device is not None:
        flags = _vllm_batch_defaults(report, device, flags)
    if report.engine == "sglang" and flags.get("speculative_algorithm"):
        length = speculative.sglang_acceptance(dict(report.launch.env), acceptance_length)
        flags = {**flags, "synthetic_acceptance_length": length}
        speculates = True
    return Translation(
        PolicySpec.make(report.policy, {**flags, **engine}),
        deployment,
        tuple(taken),
        tuple(ignored),
        speculates,
    )


# SGLang's --deepep-mode as vLLM's --all2all-backend names, which tailserve prices (moe_comm.py).
_DEEPEP_MODES = {
    "low_latency": "deepep_low_latency",
    "normal": "deepep_high_throughput",
    "auto": "deepep_auto",
}


def _sglang_exchange(report: Report, deployment: dict[str, Any]) -> list[str]:
    """SGLang's ``--moe-a2a-backend`` / ``--deepep-mode`` as the deployment's exchange; what of
    them is not simulated."""
    values = report.values
    backend = values.get("moe_a2a_backend") or "none"
    mode = values.get("deepep_mode") or "auto"
    if backend == "deepep":
        deployment["all2all_backend"] = _DEEPEP_MODES[mode]
        return []
    if backend != "none":
        return [f"--moe-a2a-backend {backend} (not modelled: priced as all-gather/reduce-scatter)"]
    return []


def _trtllm_load_balancer(row: Any, ignored: list[str]) -> tuple[str, int] | None:
    """TensorRT-LLM's ``moe_config`` row: (the row, num_slots) when its load balancer is EPLB as
    tailserve simulates it (the row's verdict is ``trtllm_options.moe_load_balancer_rule``'s, which
    lint applied; a refusal stopped the translation already), else None with what was left out
    said; ValueError for a load balancer file that is not there (its num_slots are needed)."""
    try:
        balancer = trtllm_options.load_balancer(row.value)
    except trtllm_options.LoadBalancerFileMissing as e:
        raise ValueError(
            f"the engine command's MoE load balancer file {e.path} is not there (looked from {os.getcwd()}): "
            "tailserve reads its num_slots to simulate the line; give its path from here"
        ) from None
    if row.verdict == DEPLOYMENT:
        assert balancer is not None and balancer.num_slots is not None
        return row.flag, balancer.num_slots
    if row.verdict in (NO_OP, NOT_MODELLED):
        ignored.append(f"{row.flag} ({row.verdict}: {row.what})")
    return None


def _trtllm_redundant(
    slots: tuple[str, int], deployment: dict[str, Any], experts: Callable[[str], int] | None
) -> list[str]:
    """EPLB from TensorRT-LLM's ``num_slots``: the redundant experts are the slots beyond the
    model's experts (``experts``: see ``translate``); not known, EPLB without redundant experts,
    said."""
    flag, num_slots = slots
    model = str(deployment.get("model", ""))
    try:
        count = experts(model) if experts is not None else None
    except ValueError:
        count = None
    if count is None:
        deployment["enable_eplb"] = True
        return [
            f"{flag} num_slots {num_slots} (the model's experts are not known here: EPLB without redundant experts)"
        ]
    if not count:
        return [f"{flag} (no-op: {model} has no routed experts to balance)"]
    if num_slots < count:
        raise ValueError(
            f"{flag}: num_slots {num_slots} is below {model}'s {count} experts: TensorRT-LLM needs num_slots >= "
            f"the experts ({trtllm_options.WIDE_EP})"
        )
    deployment["enable_eplb"] = True
    if num_slots > count:
        deployment["num_redundant_experts"] = num_slots - count
    return []


def _deployment(given: dict[str, Any]) -> dict[str, Any]:
    """The deployment's fields from the values given, once all are known (an expert-parallel
    size is read against the TP degree, wherever on the line each was given)."""
    out = dict(given)
    if "kv_cache_dtype" in out:
        text = str(out["kv_cache_dtype"]).lower()
        out["kv_cache_dtype"] = "" if text == "auto" else "fp8" if text in _FP8_KV else text
    ep = out.get("expert_parallel")
    if ep is not None and not isinstance(ep, bool):
        # SGLang's --ep-size / TensorRT-LLM's --ep_size: experts split whole over the TP ranks
        # when it equals the TP degree; tailserve has no other expert layout.
        tp = out.get("tp", 1)
        if ep not in (1, tp):
            raise ValueError(
                f"expert parallel size {ep} with TP {tp}: tailserve splits experts over the TP ranks only"
            )
        out["expert_parallel"] = ep == tp and ep > 1
    return out


def _attention_dp(deployment: dict[str, Any]) -> dict[str, Any]:
    """SGLang's attention DP as tailserve's DP ranks: ``--tp-size T --attn-dp-size N`` is N
    ranks whose attention runs at TP T/N, T GPUs in all (``attn_tp_size_of`` in
    sglang/srt/runtime_context.py@v0.5.23); tailserve's DP engine spreads the experts over the
    same T GPUs. TensorRT-LLM's ``enable_attention_dp`` is N = T."""
    out = dict(deployment)
    out.pop("dp_attention", None)
    ranks = out.pop("attn_dp", 1)
    if ranks <= 1:
        return out
    total = out.get("tp", 1)
    if total % ranks:
        raise ValueError(f"attention DP size {ranks} does not divide TP size {total} (SGLang refuses it)")
    out["tp"], out["dp"] = total // ranks, ranks
    return out


def _vllm_batch_defaults(report: Report, device: DeviceInfo, flags: dict[str, Any]) -> dict[str, Any]:
    """vLLM's GPU-dependent budget and max_num_seqs of this version, where they differ from
    the ``vllm`` policy's (0.32's) on this GPU and the line does not set them."""
    from tailserve.policies.vllm import device_batch_defaults

    mine = vllm_flags.batch_defaults(report.version.version, device.memory_gib, device.is_a100)
    if mine == device_batch_defaults(device) or report.values.get("enable_chunked_prefill") is False:
        return flags
    budget, seqs = mine
    out = dict(flags)
    out.setdefault("max_num_batched_tokens", budget)
    out.setdefault("max_num_seqs", min(seqs, out["max_num_batched_tokens"]))
    return out


def _first_fatal(report: Report) -> str:
    for row in report.rows:
        if row.verdict in FATAL:
            return f"{row.flag}: {row.what}"
    finding = report.conflicts[0]
    return f"{finding.what} ({finding.source})"


def _option(key: str) -> str:
    return {"expert_parallel": "--enable-expert-parallel"}.get(key, "--" + key.replace("_", "-"))
