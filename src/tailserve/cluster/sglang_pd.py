"""An SGLang prefill/decode pair, as SGLang 0.5.23 and its router run one.

One request's path (times on the cluster clock)::

    arrival ─► the router picks a prefill and a decode server at once
      decode server: pre-allocation queue ─► KV for the prompt pre-allocated (bootstrapped)
      prefill server: bootstrap queue ─► (once bootstrapped) waiting queue, prefill
      prefill_done ─► the prefill replica's link (FIFO) ─► transfer_done
      decode server: KV polled ─► waiting queue ─► prebuilt into the running batch: the first
        token (sampled by the prefill server) is emitted, then it decodes

(``disaggregation/decode.py``, ``prefill.py@v0.5.23``; the decode server's rules are
``policies/sglang_decode.py``.) Unlike the vLLM pair (``disagg.py``), where the decode side
admits a request only after its KV arrived, the decode server holds KV for a request *before*
its prefill starts, and the prefill server may not start it until then
(``PrefillBootstrapQueue.pop_bootstrapped``: ``KVPoll.WaitingForInput`` comes with the decode
server's KV indices). So a decode server short of KV holds back prefills: TTFT includes that wait
(``PdTimes.bootstrapped``), which ``--explain`` reports as "decode prealloc wait".

The two sides now depend on each other (prefill start on the decode server's pre-allocation,
decode admission on the prefill's finish), so the replicas advance in lockstep: the replica whose
next iteration starts first runs it (the decode side first at equal times), and an idle one waits
no further than the next iteration of any other. An iteration sees what others handed it before
it started, as the servers' queues are polled once per turn of their event loops: each hand-over
is exact to the iteration. The prefill server keeps a request's KV until it is sent
(``disagg_prefill_inflight_queue``: ``core/kv_hold.py``, as in the vLLM pair). The bootstrap
handshake's own network time is not modelled; with ``--scrape-interval`` the routers read the
replicas' state at the first decision after each tick rather than at the tick.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from tailserve.cluster.cluster import ClusterRun, PdTimes, Stage
from tailserve.cluster.disagg import PdCluster, copy_request
from tailserve.cluster.replica import Replica
from tailserve.core.gc_pause import paused_gc
from tailserve.core.request import Request, RequestStatus
from tailserve.policies.sglang_decode import SglangDecodePolicy


class SglangPdCluster(PdCluster):
    decode_policies = ("sglang",)

    def __init__(self, prefill: Stage, decode: Stage, link: str = "ib-ndr") -> None:
        for replica in prefill.replicas:
            if replica.spec.policy.name != "sglang":
                raise ValueError(
                    f"--prefill-policy {replica.spec.policy.name}: an SGLang decode server pairs with SGLang "
                    "prefill servers (the bootstrap handshake and KV layout are SGLang's)"
                )
        super().__init__(prefill, decode, link)
        for replica in decode.replicas:
            policy = replica.engine.scheduler.policy
            if not isinstance(policy, SglangDecodePolicy):
                raise ValueError("the decode replicas must run sglang with disaggregation_mode=decode")
            policy.on_prealloc = self._bootstrap_hook()
            replica.source.finish_hooks.append(self._decode_hook)
        self._replicas: list[Replica] = [*decode.replicas, *prefill.replicas]  # decode first at ties
        self._ready: list[float] = [math.inf] * len(self._replicas)
        self._slot = {id(r): i for i, r in enumerate(self._replicas)}
        self._unbootstrapped: dict[str, tuple[Replica, Request]] = {}  # prefill side, not released yet
        self._decode_of: dict[str, Replica] = {}
        self._stepping: Replica | None = None  # the replica running an iteration now

    # ---- hand-overs -------------------------------------------------------------------------
    def _wake(self, replica: Replica, t: float) -> None:
        i = self._slot[id(replica)]
        self._ready[i] = min(self._ready[i], max(replica.now, t))
        stepping = self._stepping
        if stepping is not None and stepping is not replica:
            # Handed over inside the stepping replica's iteration: it must not idle past it.
            horizon = stepping.source.horizon
            stepping.source.horizon = t if horizon is None else min(horizon, t)

    def _bootstrap_hook(self):
        def on_prealloc(request: Request, now: float) -> None:
            prefill_replica, copy = self._unbootstrapped.pop(request.request_id)
            self.timeline[request.request_id].bootstrapped = now
            prefill_replica.add(copy, now)
            self._wake(prefill_replica, now)

        return on_prealloc

    def _decode_hook(self, request: Request, now: float) -> None:
        rid = request.request_id
        self.final.setdefault(rid, request)
        pending = self._unbootstrapped.pop(rid, None)
        if pending is not None:  # refused by the decode server before its prefill could start
            self.prefill.router.on_finished(rid, pending[0].index, now)

    def _prefill_hook(self, index: int):
        def on_finish(copy: Request, now: float) -> None:
            rid = copy.request_id
            times = self.timeline[rid]
            times.prefill_scheduled = copy.first_scheduled_time
            decode_replica = self._decode_of[rid]
            sched = decode_replica.engine.scheduler
            policy = sched.policy
            assert isinstance(policy, SglangDecodePolicy)
            if copy.status is not RequestStatus.FINISHED_LENGTH:  # refused or aborted: the client's answer
                self.final[rid] = copy
                times.prefill_done = copy.finish_time if copy.token_times else None
                failed = policy.prefill_failed(sched, rid, copy.status_reason or copy.status.name, now)
                if failed is not None:
                    decode_replica.source.on_finish(failed, now)
                return
            times.prefill_done = now
            done = self.send_kv(copy, index, now)
            policy.kv_arrives(rid, done)
            self._wake(decode_replica, done)

        return on_finish

    # ---- the run ----------------------------------------------------------------------------
    def _dispatch(self, request: Request, t: float) -> None:
        rid = request.request_id
        for stage in (self.prefill, self.decode):
            _scrape(stage, t)
        prefill_copy = copy_request(request, max_tokens=1)
        prefill_replica = self.prefill.route(prefill_copy, t, hand_over=False)
        self.timeline[rid] = PdTimes(prefill_replica.index)
        self._unbootstrapped[rid] = (prefill_replica, prefill_copy)
        decode_replica = self.decode.route(copy_request(request, max_tokens=request.max_tokens), t)
        self.timeline[rid].decode_replica = decode_replica.index
        self._decode_of[rid] = decode_replica
        self._wake(decode_replica, t)

    def _own_next(self, replica: Replica, since: float) -> float:
        """When the replica next has something to do by what it knows now (inf: nothing): its
        first event after ``since``, its last look (an idle turn may have waited past it)."""
        engine = replica.engine
        replica.source.horizon = None
        wake = engine.next_wake(since)
        if wake is None:
            return math.inf
        return max(wake, engine.clock.now)

    def _step(self, i: int, t: float, horizon: float) -> None:
        replica = self._replicas[i]
        engine = replica.engine
        if engine.clock.now < t:
            engine.clock.wait_until(t)
        replica.source.horizon = None if math.isinf(horizon) else horizon
        sched = engine.scheduler
        looked = engine.clock.now
        last, flight = sched.last_output, engine.in_flight
        seen = (engine.num_requests_seen, len(sched.finished) + sched.num_released)
        self._stepping = replica
        more = engine.step()
        out = sched.last_output
        worked = (
            (out is not last and out is not None and not out.is_empty)
            or (flight is not None and engine.in_flight is not flight)  # the step in flight applied
            or (engine.num_requests_seen, len(sched.finished) + sched.num_released) != seen
        )
        if more and worked:
            replica.driver.fast_forward()
        self._stepping = None
        # An idle turn (nothing scheduled, nothing applied) waits for its own next event, not for
        # the next iteration elsewhere: a hand-over wakes it (``_wake``).
        self._ready[i] = engine.clock.now if worked else self._own_next(replica, looked)

    def run(self, requests: Sequence[Request]) -> ClusterRun:
        ordered = sorted(requests, key=lambda r: r.arrival_time)
        ready = self._ready
        t0, c0 = time.perf_counter(), time.process_time()
        with paused_gc():
            n = 0
            while True:
                t_arrival = ordered[n].arrival_time if n < len(ordered) else math.inf
                i = min(range(len(ready)), key=ready.__getitem__)
                t = ready[i]
                if t_arrival <= t:
                    if math.isinf(t_arrival):
                        break
                    self._dispatch(ordered[n], t_arrival)
                    n += 1
                    continue
                horizon = min(
                    t_arrival, min((ready[j] for j in range(len(ready)) if j != i), default=math.inf)
                )
                self._step(i, t, horizon)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        missing = [r.request_id for r in ordered if r.request_id not in self.final]
        if missing:
            raise RuntimeError(
                f"SGLang P/D: {len(missing)} requests never left the pair (first {missing[0]})"
            )
        out = [self.final[request.request_id] for request in ordered]
        return ClusterRun(out, {"prefill": self.prefill, "decode": self.decode}, wall, self.timeline, cpu)


def _scrape(stage: Stage, t: float) -> None:
    """What ``Stage.advance_to`` does at a scrape tick, for replicas this pair advances itself."""
    interval = stage.scrape_interval
    if interval > 0:
        tick = math.floor(t / interval) * interval
        if tick > stage._scraped_at:
            stage._states = [r.state(tick) for r in stage.replicas]
            stage._scraped_at = tick
