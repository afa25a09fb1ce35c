"""TensorRT-LLM's attention-DP group: the lockstep ranks of ``enable_attention_dp`` with the
engine's own placement and, under ``attention_dp_config.enable_balance``, its context holding.

The rules are ``policies/trtllm_adp.py``'s; this stage runs them where the engine does, at the
start of each iteration of the group:
1. Placement: an arriving request waits in the group's one FCFS queue (TensorRT-LLM's
   ``waiting_queue``, shared by all ranks), not on a rank; each step, before scheduling, the
   queue's head goes to ranks by the heap rule over the ranks' active counts and prompt tokens.
   So it replaces the vLLM-style balancer at arrival (``routers.VllmDpRouter``) that the other
   policies' DP groups use.
2. Balancing (when on): every rank plans its batch (``TrtllmPolicy.plan_step``: fetch, capacity
   and micro-batch schedulers), the group decides from the counts (``AdpBalance``), each rank
   told to hold drops its planned contexts, then the lockstep step runs as ``LockstepStage``'s.

Only the MoE (lockstep) DP engine of the ``trtllm`` policy is built so; a dense model's DP ranks
stay independent replicas behind the balancer (``dp_group.py``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tailserve.cluster.cluster import RoutingDecision, route_request
from tailserve.cluster.dp_group import ADP_PLACEMENT, LockstepStage
from tailserve.cluster.replica import Replica
from tailserve.core.request import Request
from tailserve.policies.trtllm_adp import AdpBalance, RankLoad, StepCounts, num_to_fetch, place_requests


@dataclass
class AdpLockstepStage(LockstepStage):
    """A ``trtllm`` attention-DP group (module docstring)."""

    max_num_active: int = 2048  # max_num_active_requests per rank: max_batch_size
    balance: AdpBalance | None = None  # attention_dp_config.enable_balance
    queue: deque[Request] = field(default_factory=deque)  # arrived, not yet on a rank
    num_held_steps: int = 0  # steps whose contexts the balancing held (a report, and the tests')

    def placement(self) -> str:
        return ADP_PLACEMENT

    def route(self, request: Request, t: float, release_time: float | None = None) -> Replica | None:  # type: ignore[override]
        """Into the group's waiting queue; the next step places it (``_place``)."""
        self.queue.append(request)
        return None

    def step(self) -> bool:
        now = self.now
        for replica in self.replicas:
            replica.engine.add_arrivals(now)  # the placed requests of earlier steps
        if self.queue:
            self._place(now)
        if self.balance is not None:
            self._balance(now)
        return super().step()

    def _place(self, now: float) -> None:
        """``_fetch_new_requests_attention_dp``: the queue's head onto ranks."""
        loads = [self._load(replica) for replica in self.replicas]
        count = min(len(self.queue), num_to_fetch(loads, self.max_num_active))
        new = [self.queue.popleft() for _ in range(count)]
        ranks = place_requests([r.prompt_len for r in new], loads)
        # Each rank takes its requests in the order placed (longest prompt first).
        for i in sorted(range(count), key=lambda i: -new[i].prompt_len):
            request, rank = new[i], ranks[i]
            waiting = [load.num_active for load in loads]
            least = min(range(len(waiting)), key=waiting.__getitem__)
            self.decisions.append(
                RoutingDecision(request.request_id, now, rank, waiting[rank], waiting[least], least)
            )
            self.router.on_routed(route_request(request), rank, now)
            self.replicas[rank].add(request, now)
        for replica in self.replicas:
            replica.engine.add_arrivals(now)

    @staticmethod
    def _load(replica: Replica) -> RankLoad:
        """The rank's active requests (fetched, not finished) and their prompt tokens."""
        sched = replica.engine.scheduler
        num, tokens = 0, 0
        for queue in (sched.running, sched.waiting):
            for request in queue:
                num += 1
                tokens += request.prompt_len  # py_orig_prompt_len: a pause does not change it
        return RankLoad(num, tokens)

    def _balance(self, now: float) -> None:
        """``_balance_adp_requests``: plan every rank's batch, then hold its contexts or not."""
        assert self.balance is not None
        counts: list[StepCounts] = []
        for replica in self.replicas:
            sched = replica.engine.scheduler
            counts.append(sched.policy.plan_step(sched))
        if any(r.engine.scheduler.has_unfinished for r in self.replicas):
            # An idle rank runs a dummy generation request (_pad_attention_dp_dummy_request).
            idle = StepCounts(0, 1)
            counts = [
                c if r.engine.scheduler.has_unfinished else idle
                for r, c in zip(self.replicas, counts, strict=True)
            ]
        if self.balance.hold_contexts(counts):
            if any(c.num_context for c in counts):
                self.num_held_steps += 1
            for replica in self.replicas:
                replica.engine.scheduler.policy.hold_contexts()
