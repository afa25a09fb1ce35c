"""Tenant fairness as an ordering of the waiting queue: VTC (``vtc.py``) over any policy.

``TenantBacklog`` keeps, beside the counters, how many waiting requests each tenant has, so the
counter lift fires exactly when a tenant's queue goes from empty to non-empty, and it orders a
list of waiting requests the way VTC would admit them in one pass: repeatedly the backlogged
tenant with the smallest counter, its first request, its counter advanced (on a copy) by the
prompt tokens it still has to compute — the paper charges a request's input at admission.
Within a tenant the given order is kept (FCFS for ``vllm`` and ``sglang``; least TTFT slack for
``slo``). The real counters advance only by the tokens actually scheduled (``charge``).

``FairPolicy`` puts this in front of a policy that walks its waiting queue from the head
(``vllm`` with ``scheduling_policy=fcfs``, ``sglang`` with ``schedule_policy=fcfs``): before
each iteration the queue is put in VTC order, after it the scheduled tokens are charged. The
wrapped policy's own rules are untouched: every other hook is forwarded to it by construction
(``policy_hooks``), and the fast paths that would skip VTC's charges are declared off in
``FairPolicy.NOT_FORWARDED``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

from tailserve.core.policy import Policy
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import SchedulerOutput
from tailserve.executors.simulated.cost_binding import PredictsIterations
from tailserve.executors.simulated.fast_paths import FastPaths, LoneChunkRun
from tailserve.policies.tenant_share import RecentService
from tailserve.policies.vtc import VirtualTokenCounter, parse_tenant_weights, tenant_of

FAIRNESS = ("none", "vtc")


class TenantBacklog:
    def __init__(self, counter: VirtualTokenCounter) -> None:
        self.vtc = counter
        self.recent = RecentService()  # the slo policy's isolation rule (tenant_share.py)
        self.num_waiting: dict[str, int] = {}
        self._waiting_ids: set[str] = set()

    def enqueue(self, request: Request) -> None:
        """``request`` entered the waiting queue (arrival, or back after a preemption)."""
        if request.request_id in self._waiting_ids:
            return
        self._waiting_ids.add(request.request_id)
        tenant = tenant_of(request.tenant_id)
        n = self.num_waiting.get(tenant, 0)
        if n == 0:
            self.vtc.on_backlogged(tenant, [t for t, k in self.num_waiting.items() if k > 0])
        self.num_waiting[tenant] = n + 1

    def dequeue(self, request: Request) -> None:
        """``request`` left the waiting queue (admitted, rejected or aborted)."""
        if request.request_id not in self._waiting_ids:
            return
        self._waiting_ids.discard(request.request_id)
        tenant = tenant_of(request.tenant_id)
        n = self.num_waiting[tenant] - 1
        self.num_waiting[tenant] = n
        if n == 0:
            self.vtc.on_idle(tenant)

    def is_waiting(self, request: Request) -> bool:
        return request.request_id in self._waiting_ids

    def order(self, requests: Sequence[Request]) -> list[Request]:
        """``requests`` in the order VTC admits them (see the module docstring)."""
        by_tenant: dict[str, list[Request]] = {}
        for r in requests:
            by_tenant.setdefault(tenant_of(r.tenant_id), []).append(r)
        if len(by_tenant) <= 1:
            return list(requests)
        vtc = self.vtc
        counters = {t: vtc.counter(t) for t in by_tenant}
        heads = dict.fromkeys(by_tenant, 0)
        ordered: list[Request] = []
        while len(ordered) < len(requests):
            # Ties (a counter just lifted to a backlogged tenant's) go to the tenant with the
            # least recent service: the one that arrived beside a backlogged one.
            tenant = min(
                (t for t in by_tenant if heads[t] < len(by_tenant[t])),
                key=lambda t: (counters[t], self.recent.rank(t)),
            )
            r = by_tenant[tenant][heads[tenant]]
            heads[tenant] += 1
            ordered.append(r)
            counters[tenant] += (r.num_tokens - r.num_computed_tokens) * vtc.input_price / vtc.weight(tenant)
        return ordered

    def charge(self, out: SchedulerOutput) -> None:
        """The tokens one iteration served: chunks at the input price, decodes at the output price."""
        vtc = self.vtc
        costs: dict[str, float] = {}
        for s in out.scheduled:
            tenant = tenant_of(s.request.tenant_id)
            if s.num_new_tokens == 1:
                vtc.charge(tenant, 0, 1)
                cost = vtc.output_price
            else:
                vtc.charge(tenant, s.num_new_tokens, 0)
                cost = vtc.input_price * s.num_new_tokens
            costs[tenant] = costs.get(tenant, 0.0) + cost / vtc.weight(tenant)
        self.recent.step(costs)

    def charge_decode_run(self, running: Iterable[Request], num_steps: int) -> None:
        vtc = self.vtc
        costs: dict[str, float] = {}
        for r in running:
            tenant = tenant_of(r.tenant_id)
            vtc.charge(tenant, 0, num_steps)
            costs[tenant] = costs.get(tenant, 0.0) + vtc.output_price / vtc.weight(tenant)
        self.recent.step(costs, num_steps)

    def rank(self, tenant_id: str | None) -> float:
        """A tenant's recent weighted service (``tenant_share.RecentService``)."""
        return self.recent.rank(tenant_of(tenant_id))


def make_backlog(fairness: str, tenant_weights: str) -> TenantBacklog | None:
    if fairness not in FAIRNESS:
        raise ValueError(f"fairness must be one of {', '.join(FAIRNESS)}, got {fairness!r}")
    weights = parse_tenant_weights(tenant_weights) if tenant_weights else {}
    if fairness == "none":
        if weights:
            raise ValueError("--tenant-weights needs --fairness vtc")
        return None
    return TenantBacklog(VirtualTokenCounter(weights))


def _is_hook(value: object) -> bool:
    return callable(value) or isinstance(value, (classmethod, staticmethod, property))


def policy_hooks() -> tuple[str, ...]:
    """Every public method a policy is asked through: ``Policy``'s, ``FastPaths``' and
    ``PredictsIterations``' (``bind_cost_model``), read from the classes themselves, so a hook
    added to any of them is in the list."""
    names: dict[str, None] = {}
    for protocol in (Policy, FastPaths, PredictsIterations):
        for name, value in vars(protocol).items():
            if not name.startswith("_") and _is_hook(value):
                names[name] = None
    return tuple(names)


def policy_declarations() -> tuple[str, ...]:
    """Every class-level declaration of ``Policy`` and ``FastPaths`` (their ``ClassVar``s:
    ``name``, ``decode_reserve_blocks``, ...), which a wrapper copies from the wrapped policy."""
    names: dict[str, None] = {}
    for protocol in (Policy, FastPaths):
        for name, annotation in vars(protocol).get("__annotations__", {}).items():
            if "ClassVar" in str(annotation):
                names[name] = None
    return tuple(names)


def _forwarder(name: str) -> Callable[..., Any]:
    def forward(self: FairPolicy, *args: Any, **kwargs: Any) -> Any:
        hook = getattr(self.inner, name, None)
        if hook is None:  # a FastPaths or PredictsIterations hook the wrapped policy lacks
            default = getattr(FastPaths, name, None)
            return None if default is None else default(self, *args, **kwargs)
        return hook(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = f"Forwarded to the wrapped policy's ``{name}`` (generated, ``policy_hooks``)."
    forward.forwarded = True  # type: ignore[attr-defined]
    return forward


class FairPolicy(Policy, FastPaths):
    """A head-of-queue policy (vllm, sglang with fcfs) with its waiting queue in VTC order.

    Forwards every hook of ``Policy``, ``FastPaths`` and ``PredictsIterations`` to the wrapped
    policy by construction: each hook ``policy_hooks`` lists and this class does not write
    itself gets a generated forwarder (below the class), and every declaration
    (``policy_declarations``) is copied from the wrapped policy. The hooks written here forward
    too, around VTC's bookkeeping, except those in ``NOT_FORWARDED``, each with its reason.
    ``tests/test_vtc.py`` calls every hook on a recording policy and fails on one that neither
    reaches it nor is listed there.
    """

    # Hooks deliberately answered here instead of by the wrapped policy, and why.
    NOT_FORWARDED: ClassVar[dict[str, str]] = {
        "default_config": "a classmethod asked of the registry's class before any policy exists; "
        "a FairPolicy wraps a configured policy",
        "profile_tokens": "a classmethod asked of the registry's class (assemble/simulated.py) "
        "before any policy exists; the wrapped policy's class answers it",
        "default_notes": "a classmethod asked of the registry's class with default_config "
        "(assemble/scheduler.py) before any policy exists; the wrapped policy's class answers it",
        "drafter_memory": "a classmethod asked of the registry's class (assemble/simulated.py) "
        "before any policy exists; the wrapped policy's class answers it",
        "chunk_run_budget": "the chunked-prefill fast path runs iterations without asking the "
        "policy, so VTC's charges would be skipped: it stays off (None)",
        "lone_chunk_run": "the lone-chunk fast path runs iterations without asking the policy, so "
        "VTC's charges would be skipped: it stays off (None)",
    }

    def __init__(self, inner: Policy, backlog: TenantBacklog) -> None:
        super().__init__(inner.config)
        self.inner = inner
        self.backlog = backlog
        for name in policy_declarations():
            # The wrapped policy's declaration (FastPaths' default where it has none).
            setattr(self, name, getattr(inner, name, getattr(FastPaths, name, None)))

    @classmethod
    def default_config(cls, device: Any, max_model_len: int, **overrides: Any) -> Any:
        raise TypeError("FairPolicy wraps a configured policy; build the inner one first")

    def chunk_run_budget(self) -> int | None:
        return None  # NOT_FORWARDED

    def lone_chunk_run(self, sched: Scheduler) -> LoneChunkRun | None:
        return None  # NOT_FORWARDED

    def add_request(self, sched: Scheduler, request: Request) -> None:
        self.inner.add_request(sched, request)
        if not request.is_finished:
            self.backlog.enqueue(request)

    def schedule(self, sched: Scheduler, now: float) -> SchedulerOutput:
        waiting = sched.waiting
        if len(waiting) > 1:
            waiting.reorder(self.backlog.order(list(waiting)))
        out = self.inner.schedule(sched, now)
        backlog = self.backlog
        for s in out.scheduled:
            backlog.dequeue(s.request)
        for r in out.preempted:
            backlog.enqueue(r)
        for r in out.swapped_out:
            backlog.enqueue(r)
        backlog.charge(out)
        return out

    def on_finished(self, sched: Scheduler, finished: list[Request]) -> None:
        for r in finished:
            self.backlog.dequeue(r)
        self.inner.on_finished(sched, finished)

    def can_fast_forward(self, sched: Scheduler) -> bool:
        # A decode run keeps a blocked waiting head blocked, but the run's charges can put
        # another tenant's request at the head (one that fits): with two tenants waiting, step.
        waiting = sched.waiting
        if len(waiting) > 1:
            first = tenant_of(waiting.peek_request().tenant_id)
            if any(tenant_of(r.tenant_id) != first for r in waiting):
                return False
        return isinstance(self.inner, FastPaths) and self.inner.can_fast_forward(sched)

    def on_decode_run(self, sched: Scheduler, num_steps: int) -> None:
        self.backlog.charge_decode_run(sched.running, num_steps)
        assert isinstance(self.inner, FastPaths)  # it signed ``can_fast_forward``
        self.inner.on_decode_run(sched, num_steps)

    def notes(self) -> list[str]:
        return [*self.inner.notes(), "waiting queue in VTC order (fairness=vtc)"]

    def describe(self) -> str:
        return self.inner.describe() + " + fairness=vtc"


for _name in policy_hooks():
    if _name not in vars(FairPolicy) and _name not in FairPolicy.NOT_FORWARDED:
        setattr(FairPolicy, _name, _forwarder(_name))
del _name


def with_fairness(policy: Policy, fairness: str = "none", tenant_weights: str = "") -> Policy:
    """``policy`` as configured, or wrapped in VTC ordering. Only policies that admit from the
    head of an FCFS queue can take it; others get a ValueError saying so."""
    backlog = make_backlog(fairness, tenant_weights)
    if backlog is None:
        return policy
    if getattr(policy, "backlog", None) is not None or policy.name == "slo":
        raise ValueError("the slo policy takes fairness=vtc as its own flag")
    if not policy.admits_fcfs():
        raise ValueError(
            f"--fairness vtc orders the waiting queue of vllm (scheduling_policy=fcfs), sglang "
            f"(schedule_policy=fcfs) or slo; {policy.name} with these flags keeps its own order"
        )
    return FairPolicy(policy, backlog)
