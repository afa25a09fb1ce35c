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
(``PdTimes.bootstrapped``), which ``--explain`` reports as "decode prealloc wait". Under
``disaggregation_decode_allocation_policy=prefill_complete`` the order turns: the prefill starts
at once and holds the KV until the decode server reserves it (``_deferred_prealloc``), so a
decode server short of KV holds prefill memory instead.

The two sides depend on each other (prefill start on the decode server's pre-allocation, decode
admission on the prefill's finish), so the replicas advance in lockstep (``lockstep_pd.py``).
The prefill server keeps a request's KV until it is sent (``disagg_prefill_inflight_queue``:
``core/kv_hold.py``, as in the vLLM pair). The bootstrap handshake's own network time is not
modelled.
"""

from __future__ import annotations

from tailserve.cluster.cluster import PdTimes, Stage
from tailserve.cluster.disagg import copy_request
from tailserve.cluster.lockstep_pd import LockstepPdCluster, scrape
from tailserve.cluster.replica import Replica
from tailserve.core.request import Request, RequestStatus
from tailserve.policies.sglang_decode import SglangDecodePolicy


class SglangPdCluster(LockstepPdCluster):
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
        self._unbootstrapped: dict[str, tuple[Replica, Request]] = {}  # prefill side, not released yet
        self._decode_of: dict[str, Replica] = {}
        # ``prefill_complete`` (set on every decode server): prefills start at once, and the KV
        # is sent once the decode server reserved it after the prefill (``_deferred_prealloc``).
        policies = [r.engine.scheduler.policy for r in decode.replicas]
        self.deferred = any(isinstance(p, SglangDecodePolicy) and p.deferred for p in policies)
        late = [
            r.name
            for r in prefill.replicas
            if getattr(r.engine.scheduler.policy.config, "disaggregation_decode_allocation_policy", "early")
            == "prefill_complete"
        ]
        if late and not self.deferred:
            raise ValueError(
                f"disaggregation_decode_allocation_policy=prefill_complete on prefill replica {late[0]} but not "
                "on the decode servers: SGLang needs it on both (--decode-policy sglang:"
                "disaggregation_decode_allocation_policy=prefill_complete)"
            )
        self._refused: set[str] = set()  # refused by the decode server, prefill not done yet

    def _bootstrap_hook(self):
        def on_prealloc(request: Request, now: float) -> None:
            if self.deferred:
                self._deferred_prealloc(request, now)
                return
            prefill_replica, copy = self._unbootstrapped.pop(request.request_id)
            times = self.timeline[request.request_id]
            times.bootstrapped = now
            self._reaches_back(times.decode_replica, -1)
            prefill_replica.add(copy, now)
            self._wake(prefill_replica, now)

        return on_prealloc

    def _free_refused(self, rid: str, index: int, now: float) -> None:
        """The prefill copy of a request its decode server refused is freed, never sent."""
        self._refused.discard(rid)
        self.prefill.replicas[index].engine.scheduler.release_sent(rid, now)
        self._wake(self.prefill.replicas[index], now)

    def _deferred_prealloc(self, request: Request, now: float) -> None:
        """``prefill_complete``: the decode server reserved KV for a request whose prefill is
        done; its KV leaves the prefill server now (over that replica's link, FIFO)."""
        rid = request.request_id
        times = self.timeline[rid]
        times.bootstrapped = now
        self._reaches_back(times.decode_replica, -1)
        done = self.send_kv(rid, request.prompt_len, times.prefill_replica, now)
        policy = self._decode_of[rid].engine.scheduler.policy
        assert isinstance(policy, SglangDecodePolicy)
        policy.kv_arrives(rid, done)
        self._wake(self._decode_of[rid], done)
        self._wake(self.prefill.replicas[times.prefill_replica], done)  # its copy freed then

    def _decode_hook(self, request: Request, now: float) -> None:
        rid = request.request_id
        self.final.setdefault(rid, request)
        times = self.timeline.get(rid)
        if self.deferred and times is not None and times.bootstrapped is None and rid not in self._refused:
            # Refused by the decode server before it reserved the KV: the prefill's copy is
            # freed when the prefill is done (now, if it is).
            self._reaches_back(times.decode_replica, -1)
            self._refused.add(rid)
            if times.prefill_done is not None:
                self._free_refused(rid, times.prefill_replica, now)
            return
        pending = self._unbootstrapped.pop(rid, None)
        if pending is not None:  # refused by the decode server before its prefill could start
            self._reaches_back(self.timeline[rid].decode_replica, -1)
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
                    decode_replica.source.on_finish(failed, now)  # (the decode hook counts it out)
                self._refused.discard(rid)  # a failed prefill holds nothing
                return
            times.prefill_done = now
            if rid in self._refused:  # the decode server refused it meanwhile
                self._free_refused(rid, index, now)
                return
            if self.deferred:  # the decode server may reserve its KV now; the send waits for it
                policy.prefill_completed(rid, now)
                self._wake(decode_replica, now)
                return
            done = self.send_kv(rid, copy.prompt_len, index, now)
            policy.kv_arrives(rid, done)
            self._wake(decode_replica, done)

        return on_finish

    # ---- the run ----------------------------------------------------------------------------
    def _dispatch(self, request: Request, t: float) -> None:
        rid = request.request_id
        for stage in (self.prefill, self.decode):
            scrape(stage, t)
        prefill_copy = copy_request(request, max_tokens=1)
        prefill_replica = self.prefill.route(prefill_copy, t, hand_over=False)
        self.timeline[rid] = PdTimes(prefill_replica.index)
        if not self.deferred:
            self._unbootstrapped[rid] = (prefill_replica, prefill_copy)
        decode_replica = self.decode.route(copy_request(request, max_tokens=request.max_tokens), t)
        self.timeline[rid].decode_replica = decode_replica.index
        self._decode_of[rid] = decode_replica
        # Its pre-allocation starts the prefill (early), or sends the KV (prefill_complete).
        self._reaches_back(decode_replica.index, 1)
        if self.deferred:
            prefill_replica.add(prefill_copy, t)
            self._wake(prefill_replica, t)
        self._wake(decode_replica, t)
