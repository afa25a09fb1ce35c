"""The replicas of a P/D pair whose two sides depend on each other, advanced in lockstep.

In SGLang's pair a prefill starts only once its decode server pre-allocated it; in vLLM's, a
prefill replica frees a request's KV only once its decode replica pulled it, which that replica
does only once it admits the request. Neither side can run ahead: the replica whose next
iteration starts first runs it (the decode side first at equal times), and an idle one waits no
further than the next iteration of any other. An iteration sees what others handed it before it
started, as the servers' queues are polled once per turn of their event loops: each hand-over is
exact to the iteration. With ``--scrape-interval`` the routers read the replicas' state at the
first decision after each tick rather than at the tick.

A decode replica acts on the other side only through requests handed to it that can still reach
back (vLLM's: not yet read from their prefill replica, whose link the reads share; SGLang's: not
yet pre-allocated). One holding none changes nothing elsewhere, and nothing reads a decode
replica or hands it anything before the prefill side's next iteration (whose hand-overs come at
its end) or the next arrival (a router's decision), so every decode replica runs up to the
earliest of those and of the other decode replicas that hold some, not to every replica's next
iteration: the same iterations in the same order for each replica, in fewer turns.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence

from tailserve.cluster.cluster import ClusterRun, Stage
from tailserve.cluster.disagg import PdCluster
from tailserve.cluster.replica import Replica
from tailserve.core.gc_pause import paused_gc
from tailserve.core.request import Request


class LockstepPdCluster(PdCluster):
    """The loop; a pair says what an arrival does (``_dispatch``) and hands requests over by
    ``_wake``-ing the replica it gave them to."""

    def __init__(self, prefill: Stage, decode: Stage, link: str = "ib-ndr") -> None:
        super().__init__(prefill, decode, link)
        self._replicas: list[Replica] = [*decode.replicas, *prefill.replicas]  # decode first at ties
        # When each replica next runs an iteration (inf: nothing known), and the same as a heap of
        # (time, slot, version) entries, stale ones skipped: the loop's pick is O(log replicas).
        self._ready: list[float] = [math.inf] * len(self._replicas)
        self._version = [0] * len(self._replicas)
        self._heap: list[tuple[float, int, int]] = []
        self._slot = {id(r): i for i, r in enumerate(self._replicas)}
        self._stepping: Replica | None = None  # the replica running an iteration now
        # Per decode replica (its slot): requests handed to it that can still act on the prefill
        # side (``_reaches_back``; the module docstring).
        self._num_decode = len(decode.replicas)
        self._reaching = [0] * self._num_decode

    def _dispatch(self, request: Request, t: float) -> None:
        raise NotImplementedError

    # ---- hand-overs -------------------------------------------------------------------------
    def _set_ready(self, i: int, t: float) -> None:
        self._ready[i] = t
        version = self._version[i] = self._version[i] + 1
        if t < math.inf:
            heapq.heappush(self._heap, (t, i, version))

    def _first(self) -> tuple[float, int]:
        """The earliest ready replica (the lowest slot at equal times: decode first) without
        taking it; (inf, -1) when none is."""
        heap, version = self._heap, self._version
        while heap:
            t, i, v = heap[0]
            if v == version[i]:
                return t, i
            heapq.heappop(heap)
        return math.inf, -1

    def _reaches_back(self, decode_index: int, change: int) -> None:
        """A request handed to decode replica ``decode_index`` that can act on the prefill side
        (+1), or that no longer can (-1)."""
        self._reaching[decode_index] += change

    def _coupled_first(self, i: int) -> float:
        """The earliest next iteration that can hand decode replica ``i`` something, read it or
        use a link it reads over: any prefill replica's, or another decode replica's that holds
        requests reaching back."""
        ready, nd = self._ready, self._num_decode
        first = min(ready[nd:], default=math.inf)
        reaching = self._reaching
        for j in range(nd):
            if reaching[j] and ready[j] < first and j != i:
                first = ready[j]
        return first

    def _wake(self, replica: Replica, t: float) -> None:
        i = self._slot[id(replica)]
        at = max(replica.now, t)
        if at < self._ready[i]:
            self._set_ready(i, at)
        stepping = self._stepping
        if stepping is not None and stepping is not replica:
            # Handed over inside the stepping replica's iteration: it must not idle past it.
            horizon = stepping.source.horizon
            stepping.source.horizon = t if horizon is None else min(horizon, t)

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
        self._set_ready(i, engine.clock.now if worked else self._own_next(replica, looked))

    def run(self, requests: Sequence[Request]) -> ClusterRun:
        ordered = sorted(requests, key=lambda r: r.arrival_time)
        t0, c0 = time.perf_counter(), time.process_time()
        with paused_gc():
            n = 0
            while True:
                t_arrival = ordered[n].arrival_time if n < len(ordered) else math.inf
                t, i = self._first()
                if t_arrival <= t:
                    if math.isinf(t_arrival):
                        break
                    self._dispatch(ordered[n], t_arrival)
                    n += 1
                    continue
                # It leaves the heap (it is re-entered once stepped); the next one bounds it, or
                # for a decode replica, the next that can hand it something or share a link
                # with it (a decode replica holding nothing that reaches back does neither).
                heapq.heappop(self._heap)
                self._version[i] += 1
                self._ready[i] = math.inf
                bound = self._coupled_first(i) if i < self._num_decode else self._first()[0]
                self._step(i, t, min(t_arrival, bound))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        missing = [r.request_id for r in ordered if r.request_id not in self.final]
        if missing:
            raise RuntimeError(f"P/D: {len(missing)} requests never left the pair (first {missing[0]})")
        out = [self.final[request.request_id] for request in ordered]
        return ClusterRun(out, {"prefill": self.prefill, "decode": self.decode}, wall, self.timeline, cpu)


def scrape(stage: Stage, t: float) -> None:
    """What ``Stage.advance_to`` does at a scrape tick, for replicas this pair advances itself."""
    interval = stage.scrape_interval
    if interval > 0:
        tick = math.floor(t / interval) * interval
        if tick > stage._scraped_at:
            stage._states = [r.state(tick) for r in stage.replicas]
            stage._scraped_at = tick
