"""Fresh requests for each run of a ``WorkloadSpec`` (requests carry mutable progress), and the
seeded priority mix laid over any workload."""

from __future__ import annotations

from tailserve.core.request import Request
from tailserve.core.source import ListSource, RequestSource
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.workloads import builtin, prefix
from tailserve.workloads.mix_source import MixSource
from tailserve.workloads.tenants import TenantSource
from tailserve.workloads.traces import load_trace


def hol_long_arrival(cost_model: CostModel) -> float:
    """When the long prompt of ``hol`` arrives: after the ten 512-token prompts were prefilled one
    512-token chunk at a time (the slowest way any policy here does it) and eight decode steps,
    so every policy has them all decoding by then."""
    return 10 * cost_model.prefill_time(512) + 8 * cost_model.decode_time(10, 520)


class WorkloadBuilder:
    """Builds fresh requests for each run (requests carry mutable progress); parses a trace once."""

    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec
        self._trace: list[Request] | None = None

    @property
    def shares_prefixes(self) -> bool:
        """True when requests carry token ids or prefix block hashes (a Mooncake trace)."""
        if self.spec.name in ("shared-prefix", "multi-turn"):
            return True
        if self.spec.name != "trace":
            return False
        return any(r.prefix_block_hashes or r.prompt_token_ids for r in self._load_trace())

    @property
    def min_max_model_len(self) -> int:
        """The context the workload needs. ``hol``'s 8,192-token prompt plus its 256 outputs
        exceed Llama-3-70B's 8,192-token context, so that scenario raises max_model_len (as
        ``--max-model-len`` with ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`` would in vLLM)."""
        if self.spec.name == "hol":
            return builtin.HOL_LONG_PROMPT_LEN + builtin.HOL_OUTPUT_LEN
        return 0

    def build(self, cost_model: CostModel) -> RequestSource:
        source = self._build(cost_model)
        if self.spec.priorities:
            source = PrioritySource(source, self.spec.priorities, self.spec.seed)
        if self.spec.tenants:
            source = TenantSource(source, self.spec.tenants, self.spec.seed)
        return source

    def _build(self, cost_model: CostModel) -> RequestSource:
        s = self.spec
        if s.name == "hol":
            return ListSource(builtin.hol(hol_long_arrival(cost_model)))
        if s.name == "chat":
            return ListSource(builtin.chat(s.num_requests, s.rate, s.seed))
        if s.name == "random":
            return builtin.synthetic(s.num_requests, s.rate, s.input_len, s.output_len, s.arrival, s.seed)
        if s.name == "shared-prefix":
            return ListSource(
                prefix.shared_prefix(
                    s.num_requests, s.rate, s.num_prefixes, s.prefix_len, s.shared_fraction, seed=s.seed
                )
            )
        if s.name == "multi-turn":
            return ListSource(
                prefix.multi_turn(
                    s.num_sessions,
                    s.turns,
                    s.rate,
                    s.think_time,
                    system_prompt_len=s.system_prompt_len,
                    max_context=cost_model.model.max_position_embeddings,
                    seed=s.seed,
                )
            )
        return ListSource(_fresh(r) for r in self._load_trace())

    def _load_trace(self) -> list[Request]:
        if self._trace is None:
            s = self.spec
            trace = load_trace(s.trace_path or "", rate_scale=s.rate_scale, max_requests=s.max_requests)
            if not trace:
                raise ValueError(f"trace {s.trace_path}: no requests in it (a header and no rows?)")
            self._trace = trace
        return self._trace


class PrioritySource(MixSource):
    """Gives each request a priority drawn from a seeded mix as it arrives (any workload)."""

    def __init__(self, source: RequestSource, mix: tuple[tuple[int, float], ...], seed: int) -> None:
        super().__init__(source, "priority", mix, seed + 7919)


def _fresh(r: Request) -> Request:
    return Request(
        request_id=r.request_id,
        prompt_len=r.prompt_len,
        max_tokens=r.max_tokens,
        arrival_time=r.arrival_time,
        priority=r.priority,
        tenant_id=r.tenant_id,
        prompt_token_ids=r.prompt_token_ids,
        prefix_block_hashes=r.prefix_block_hashes,
        planned_output_token_ids=r.planned_output_token_ids,
    )
