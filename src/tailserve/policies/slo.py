"""``slo``: tailserve's own scheduler, built to meet each request's TTFT and TBT targets.

Every request has an SLO class (``slo_classes.py``: TTFT and TBT targets, chosen by tenant or
priority). Each iteration, with predicted times from the engine's cost model
(``slo_predictor.py``):

1. **Running requests first, most urgent first** (least slack to their next deadline: the next
   token's ``last token + tbt``, or ``arrival + ttft`` before the first). Decodes get one token;
   partial prefills continue under rule 2's budget.
2. **Prefill budget from TBT slack.** The iteration must end before the tightest running
   decode's next-token deadline: prefill chunks are cut (bisection on the predicted iteration
   time) so that decodes + chunks are predicted within the least TBT slack, capped by
   ``max_num_batched_tokens``. So that prefills always progress, ``min_prefill_tokens`` tokens
   are allowed per iteration even when no slack is left.
3. **Waiting requests by least TTFT slack**: ``deadline - now - predicted prefill`` (prefix-cache
   hits counted: only the uncached tokens are priced), served in that order; a request is
   *feasible* if its deadline still holds after the predicted prefills of the feasible requests
   before it (its queue time), each stretched by how much longer recent iterations with
   prefill chunks took than the chunks alone (the decodes beside them).
4. **Infeasible requests** (``slo_admission``): ``best-effort`` serves them behind every feasible
   one, oldest first; ``reject`` turns a never-admitted one away at once with the reason.
5. **Aging**: a best-effort request waiting longer than ``aging_s`` goes ahead of the feasible
   ones (oldest first) while aged requests have taken less than ``aging_share`` of the prefill
   tokens (a credit: each iteration earns ``aging_share`` x its prefill tokens, up to one token
   budget; admitting an aged request spends its whole remaining prefill); otherwise right
   behind them. So best-effort work cannot starve, and under overload already-late work
   cannot crowd out the requests still on time (with ``aging_share=1`` it always went first,
   and past capacity every class ended up late).
6. **Admission** as vLLM's: the whole prompt must fit the free KV blocks (net of prefix hits);
   the first that does not stops admission; at most ``max_num_seqs`` run.
7. **Preemption** (recompute) when a running request's KV does not fit: the victim among the
   requests not yet scheduled this iteration is the one whose SLO loss is smallest — the extra
   lateness its recompute adds to its next deadline, relative to its target (a request with
   slack to absorb the recompute, or one already late by more, loses least); ties: the cheaper
   recompute, then the latest admitted. Nobody is admitted in an iteration that preempted.
8. **Fairness** (``fairness=vtc``): the waiting order of rule 3-5 is interleaved by tenant with
   the Virtual Token Counter (``fairness.py``): VTC picks the tenant, rule 3-5 the request.
9. **Isolation** (with fairness; tailserve's rule, ``tenant_share.py``): an active tenant under
   half its weighted share of the recent service becomes *protected*, and stays so until it has
   ``protect_until`` of its share. Its waiting requests go first (VTC order among them) and
   before unprotected tenants' partial prefills continue, feasible ones in arrival order
   (``protected_order``), their rule-3 queue the protected requests ahead only; its chunks
   count only protected decodes' TBT slack (rule 2); when its first
   waiting request does not fit the free KV blocks, unprotected tenants' running requests are
   preempted for it (``slo_fair.py``). VTC's lifted counters tie a newly active tenant with a
   backlogged one, so the counters alone cannot tell who is over its share *now*.
10. **Yield** (with fairness; tailserve's rule, ``slo_yield.py``): in an iteration where a
   protected tenant has a prefill to run, the tenants over their fair share of the recent
   service are left out of it — their decodes (each only while its gap since its last token is
   under ``yield_tbts`` TBT targets), partial prefills and admissions — so the protected
   tenant's chunks get the iteration its own decodes' slack allows, as if it ran alone.
11. **Short quanta** (with fairness, ``slo_yield.py``): while a protected tenant has running
   requests, an over-share tenant's prefill chunk may take the iteration to at most
   ``quantum_tbts`` x the protected requests' smallest TBT target, so the protected tenant's
   next arrival waits less for the iteration in flight.

This file is the iteration (rules 1, 2 and 7) and the wiring. The other rules are parts with
public interfaces, each handed the shared state (``slo_state.SloState``: public fields, the
queries every rule asks) and never the policy: ``slo_admit.Admission`` (rules 3-6),
``slo_burst.BurstBudget``, ``slo_fair.FairShare`` (rule 9), ``slo_yield.YieldRules`` (rules
10-11), ``slo_predictor.Predictor``, and ``tenant_share.RecentService`` inside the backlog.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from tailserve.core.device import DeviceInfo
from tailserve.core.policy import Policy
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.fast_paths import FastPaths
from tailserve.kv.spec import KVSpec
from tailserve.policies.fairness import TenantBacklog, make_backlog
from tailserve.policies.slo_admit import Admission
from tailserve.policies.slo_burst import BurstBudget
from tailserve.policies.slo_classes import SloClasses, parse_slo_classes
from tailserve.policies.slo_config import SloConfig
from tailserve.policies.slo_fair import FairShare
from tailserve.policies.slo_predictor import BatchLoad, Predictor
from tailserve.policies.slo_state import SloState
from tailserve.policies.slo_yield import YieldRules
from tailserve.policies.vllm import device_batch_defaults
from tailserve.policies.vtc import tenant_of

STRETCH_ALPHA = 0.05  # weight of one iteration in rule 3's stretch average


class SloPolicy(Policy, FastPaths):
    name = "slo"
    summary = "tailserve's SLO-aware scheduler: prefill budget from TBT slack, least TTFT slack first"
    config_cls = SloConfig
    default_block_size = 16
    default_gpu_memory_utilization = 0.92

    @classmethod
    def default_config(cls, device: DeviceInfo, max_model_len: int, **overrides: Any) -> SloConfig:
        budget, max_seqs = device_batch_defaults(device)
        known = {f.name for f in fields(SloConfig)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"slo has no flag {sorted(unknown)[0]!r}; valid: {', '.join(sorted(known))}")
        return replace(SloConfig(budget, max_seqs), **overrides)

    def __init__(self, config: SloConfig) -> None:
        super().__init__(config)
        # The parts, each handed the shared state (``slo_state.py``) and nothing of the policy.
        self.state = SloState(
            config,
            parse_slo_classes(config.slo_classes),
            make_backlog(config.fairness, config.tenant_weights),
            Predictor(),
        )
        self.admission = Admission(self.state)  # rules 3-6 (and rule 5's aging credit)
        self.burst = BurstBudget(config.tbt_late_fraction)  # the late-gap experiment
        self.fair_share = FairShare(self.state, self.admission)  # rule 9 (with fairness)
        self.yield_rules = YieldRules(self.state)  # rules 10-11 (with fairness)
        self._last: tuple[float, Any] | None = None  # (start, batch shape) of the last iteration

    # ---- the shared state, as the policy's users ask it --------------------------------------
    @property
    def classes(self) -> SloClasses:
        return self.state.classes

    @property
    def backlog(self) -> TenantBacklog | None:
        return self.state.backlog

    @property
    def predictor(self) -> Predictor:
        return self.state.predictor

    @predictor.setter
    def predictor(self, predictor: Predictor) -> None:
        self.state.predictor = predictor

    @classmethod
    def profile_tokens(cls, config: SloConfig, max_model_len: int) -> int:
        return config.max_num_batched_tokens  # vLLM profiles its token budget

    def kv_spec(self) -> KVSpec:
        return KVSpec("hashed" if self.config.enable_prefix_caching else "paged")

    # ---- the engine's cost model (``PredictsIterations``) ------------------------------------
    def bind_cost_model(self, cost_model: CostModel | None, exact: bool) -> None:
        """Predict with the engine's cost model (exact for the simulators, corrected by measured
        times for a calibrated real executor); without one, learn one from measured iterations."""
        self.state.predictor = Predictor(cost_model, exact)

    def deadline(self, request: Request) -> float:
        """When the request's next token is due (``SloState.deadline``)."""
        return self.state.deadline(request)

    def add_request(self, sched: Scheduler, request: Request) -> None:
        sched.waiting.add_request(request)
        self.state.enter(sched, request)

    def on_finished(self, sched: Scheduler, finished: list[Request]) -> None:
        for r in finished:
            self.state.forget(r)

    # ---- the iteration ------------------------------------------------------------------
    def schedule(self, sched: Scheduler, now: float) -> SchedulerOutput:
        cfg: SloConfig = self.config
        state = self.state
        tier = state.tier
        last = self._last
        if last is not None:
            state.predictor.observe(last[1], now - last[0])
        out = SchedulerOutput()
        load = BatchLoad()
        tokens_left = cfg.max_num_batched_tokens
        slacks: list[tuple[float, float]] = []  # (tenant's VTC counter, TBT slack s) per decode
        floor_left = cfg.min_prefill_tokens
        scheduled_ids: set[int] = set()
        yield_to: frozenset[str] = frozenset()  # rule 10's over-share tenants this iteration
        if state.backlog is not None:
            self.protect(sched)
            if sched.waiting:
                self.fair_share.make_room(sched, now, out)
            yield_to = self.yield_rules.yielding_tenants(sched)
        num_fair_preempted = len(out.preempted)

        # 1. Running decodes, most urgent first; the least slack bounds the iteration (2).
        # Rule 10: over-share tenants' decodes sit out a protected tenant's prefill iteration.
        # Each deadline computed once, for the order and for the decodes' slack: a stable sort
        # of the positions by them is ``sorted(running, key=deadline)``'s order.
        running = sched.running
        deadlines = [state.deadline(r) for r in running]
        decodes: list[Request] = []
        decode_deadlines: list[float] = []
        prefills: list[Request] = []
        for i in sorted(range(len(running)), key=deadlines.__getitem__):
            r = running[i]
            left = r.num_tokens - r.num_computed_tokens
            if left == 1:
                decodes.append(r)
                decode_deadlines.append(deadlines[i])
            elif left > 1:
                prefills.append(r)
        held: list[Request] = []
        held_prefills: list[Request] = []
        if yield_to:
            kept: list[Request] = []
            kept_deadlines: list[float] = []
            for r, d in zip(decodes, decode_deadlines):
                if self.yield_rules.sits_out(r, now, yield_to):
                    held.append(r)
                else:
                    kept.append(r)
                    kept_deadlines.append(d)
            decodes, decode_deadlines = kept, kept_deadlines
            held_prefills = [r for r in prefills if tenant_of(r.tenant_id) in yield_to]
            prefills = [r for r in prefills if tenant_of(r.tenant_id) not in yield_to]
        tokens_left = self._decode(
            sched, now, out, load, decodes, tokens_left, slacks, scheduled_ids, decode_deadlines
        )
        if self.burst.fraction > 0 and self.burst.spends(state, sched, now, len(out.scheduled)):
            slacks.clear()  # the experiment: no TBT limit this iteration (slo_burst.py)
        # 2. Partial prefills continue, cut to what the slack leaves; under fairness those of
        # unprotected tenants continue after a protected tenant's admission (rule 9).
        later: list[Request] = []
        if state.backlog is not None:
            prefills.sort(key=tier)  # stable: by deadline within a tier
            if any(tier(r) == 0 for r in sched.waiting):
                later = [r for r in prefills if tier(r)]
                prefills = [r for r in prefills if not tier(r)]
        first_chunk = len(out.scheduled)
        tokens_left, floor_left = self._continue(
            sched, now, out, load, prefills, tokens_left, slacks, floor_left, scheduled_ids
        )

        # 3-6. Waiting requests by slack, unless someone was preempted for lack of KV.
        if len(out.preempted) == num_fair_preempted and sched.waiting and tokens_left > 0:
            tokens_left, floor_left = self.admission.admit(
                sched, now, out, load, tokens_left, slacks, floor_left, skip=yield_to
            )
            # Admitted requests are scheduled: never a victim of the KV growth below.
            scheduled_ids.update(id(s.request) for s in out.scheduled[first_chunk:])
        if yield_to and not any(tier(s.request) == 0 for s in out.scheduled[first_chunk:]):
            # Rule 10, no protected chunk got in after all (KV): an ordinary iteration for the
            # decodes left out; the over-share tenant's chunks continue after the others'.
            tokens_left = self._decode(sched, now, out, load, held, tokens_left, slacks, scheduled_ids)
            later = sorted(later + held_prefills, key=state.deadline)
        if later:
            self._continue(sched, now, out, load, later, tokens_left, slacks, floor_left, scheduled_ids)
        if state.backlog is not None:
            state.backlog.charge(out)
        chunks = [s for s in out.scheduled if s.num_new_tokens > 1]  # this iteration's prefill
        self.admission.earn_aging_credit(chunks)
        self._observe_stretch(chunks, load)
        self._last = (now, load.shape()) if out.scheduled else None
        return out

    def _decode(
        self,
        sched: Scheduler,
        now: float,
        out: SchedulerOutput,
        load: BatchLoad,
        decodes: list[Request],
        tokens_left: int,
        slacks: list[tuple[float, float]],
        scheduled_ids: set[int],
        deadlines: list[float] | None = None,
    ) -> int:
        """Rule 1 for ``decodes``, in the given order: one token each; the tokens left.
        ``deadlines``: theirs, when the caller has them (``SloState.deadline``)."""
        state = self.state
        if deadlines is None:
            deadlines = [state.deadline(r) for r in decodes]
        # Without protected tenants every tier is 1 (``SloState.tier``): no call per decode.
        tier = state.tier if state.protected else None
        block_size = sched.kv_cache.block_size
        scheduled = out.scheduled
        running_status = RequestStatus.RUNNING
        num_decodes = context = 0  # for ``load.add_decodes``, once
        for request, deadline in zip(decodes, deadlines):
            if tokens_left <= 0:
                break
            if request.status is not running_status:  # preempted earlier in this pass
                continue
            computed = request.num_computed_tokens
            if computed % block_size:
                # Its slot is in its last, partly filled block (it holds the blocks of its
                # computed tokens): ``Scheduler.allocate`` would take nothing and could not
                # preempt; a block it fills becomes matchable now, as there (vllm.py's rule).
                if not (computed + 1) % block_size:
                    sched.cache_computed(request, computed + 1)
            elif not self._allocate(sched, request, computed + 1, scheduled_ids, out, now):
                continue  # it was its own victim
            scheduled.append(ScheduledRequest(request, 1, computed))
            scheduled_ids.add(id(request))
            num_decodes += 1
            context += computed
            tokens_left -= 1
            slacks.append((tier(request) if tier is not None else 1, deadline - now))
        load.add_decodes(num_decodes, context)
        return tokens_left

    def _observe_stretch(self, chunks: list[ScheduledRequest], load: BatchLoad) -> None:
        """Rule 3's queue time: how much longer the iterations carrying prefill chunks take than
        those chunks alone (the decodes beside them, chunks cut by the slack), a moving average."""
        state = self.state
        alone = sum(state.predictor.prefill_time(s.num_new_tokens, s.num_context_tokens) for s in chunks)
        if alone > 0:
            sample = max(1.0, state.predictor.time(load.shape()) / alone)
            state.stretch += STRETCH_ALPHA * (sample - state.stretch)

    def _continue(
        self,
        sched: Scheduler,
        now: float,
        out: SchedulerOutput,
        load: BatchLoad,
        prefills: list[Request],
        tokens_left: int,
        slacks: list[tuple[float, float]],
        floor_left: int,
        scheduled_ids: set[int],
    ) -> tuple[int, int]:
        """Rule 2 for running partial prefills, in the given order; (tokens left, floor left)."""
        for request in prefills:
            if tokens_left <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue
            computed = request.num_computed_tokens
            limit = self.state.limit(slacks, request)
            want = self.state.chunk(
                load, computed, min(request.num_tokens - computed, tokens_left), limit, floor_left
            )
            if want == 0:
                continue
            if not self._allocate(sched, request, computed + want, scheduled_ids, out, now):
                continue
            out.scheduled.append(ScheduledRequest(request, want, computed))
            scheduled_ids.add(id(request))
            load.add_chunk(want, computed, computed + want == request.num_tokens)
            tokens_left -= want
            floor_left = max(0, floor_left - want)
        return tokens_left, floor_left

    def protect(self, sched: Scheduler) -> None:
        """Rule 9's decision for this iteration (``FairShare.decide``: protected and over-share
        tenants) and rule 11's quantum from it (``YieldRules.quantum_s``); with fairness only."""
        self.fair_share.decide(sched)
        self.state.quantum = self.yield_rules.quantum_s(sched)

    def _allocate(
        self,
        sched: Scheduler,
        request: Request,
        target: int,
        scheduled: set[int],
        out: SchedulerOutput,
        now: float,
    ) -> bool:
        """KV for ``request`` up to ``target`` tokens, preempting the least SLO loss among the
        running requests not scheduled yet (unprotected tenants' first, rule 9); False when
        ``request`` itself was the victim."""
        while not sched.allocate(request, target):
            candidates = [r for r in sched.running if id(r) not in scheduled]
            # Under fairness an unprotected tenant's request goes first (rule 9: a protected
            # tenant's KV comes from the others'); the tier is 1 for everyone without it.
            state = self.state
            victim = min(
                candidates, key=lambda r: (-state.tier(r), state.slo_loss(r, now, sched.running.index(r)))
            )
            sched.preempt_by_recompute(victim)
            sched.waiting.add_request(victim)
            state.enter(sched, victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def slo_loss(self, request: Request, now: float, position: int = 0) -> tuple[float, float, int]:
        """Sort key of a preemption victim (``SloState.slo_loss``)."""
        return self.state.slo_loss(request, now, position)

    def order_waiting(self, sched: Scheduler, now: float) -> tuple[list[Request], list[Request]]:
        """(requests in service order, never-admitted infeasible ones); rules 3-5
        (``Admission.order_waiting``)."""
        return self.admission.order_waiting(sched, now)

    # ---- the engine's fast paths ----------------------------------------------------------
    def can_fast_forward(self, sched: Scheduler) -> bool:
        # With requests waiting, slack and aging change with time: decide each iteration.
        return not sched.waiting

    def on_decode_run(self, sched: Scheduler, num_steps: int) -> None:
        self._last = None  # the clock moved by many iterations: no single period to learn from
        self.burst.count(len(sched.running), False, num_steps)
        if self.state.backlog is not None:
            self.state.backlog.charge_decode_run(sched.running, num_steps)

    def notes(self) -> list[str]:
        return [f"slo: predictions from {self.state.predictor.source}"]
