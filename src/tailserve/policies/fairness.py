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
wrapped policy's own rules are untouched.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tailserve.core.policy import Policy
from tailserve.core.queues import RequestQueue
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import SchedulerOutput
from tailserve.executors.simulated.cost_binding import bind_cost_model
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.fast_paths import FastPaths
from tailserve.kv.spec import KVSpec
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


class FairPolicy(Policy, FastPaths):
    """A head-of-queue policy (vllm, sglang with fcfs) with its waiting queue in VTC order."""

    def __init__(self, inner: Policy, backlog: TenantBacklog) -> None:
        super().__init__(inner.config)
        self.inner = inner
        self.backlog = backlog
        self.name = inner.name
        self.summary = inner.summary
        self.config_cls = inner.config_cls
        self.decode_reserve_blocks = inner.decode_reserve_blocks if isinstance(inner, FastPaths) else 0

    @classmethod
    def default_config(cls, device: Any, max_model_len: int, **overrides: Any) -> Any:
        raise TypeError("FairPolicy wraps a configured policy; build the inner one first")

    def create_waiting_queue(self) -> RequestQueue:
        return self.inner.create_waiting_queue()

    def kv_spec(self) -> KVSpec:
        return self.inner.kv_spec()

    def bind_cost_model(self, cost_model: CostModel | None, exact: bool) -> None:
        bind_cost_model(self.inner, cost_model, exact)

    def chunk_run_budget(self) -> int | None:
        # The chunked-prefill fast path runs iterations without asking the policy: VTC's
        # charges would be skipped, so it stays off.
        return None

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
        # (No lone chunk runs either: ``lone_chunk_run`` keeps the default None.)
        return isinstance(self.inner, FastPaths) and self.inner.can_fast_forward(sched)

    def on_decode_run(self, sched: Scheduler, num_steps: int) -> None:
        self.backlog.charge_decode_run(sched.running, num_steps)
        assert isinstance(self.inner, FastPaths)  # it signed ``can_fast_forward``
        self.inner.on_decode_run(sched, num_steps)

    def next_wakeup(self, sched: Scheduler, now: float) -> float | None:
        return self.inner.next_wakeup(sched, now)

    def notes(self) -> list[str]:
        return [*self.inner.notes(), "waiting queue in VTC order (fairness=vtc)"]

    def describe(self) -> str:
        return self.inner.describe() + " + fairness=vtc"


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
