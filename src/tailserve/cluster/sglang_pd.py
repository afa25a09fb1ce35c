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

    def _bootstrap_hook(self):
        def on_prealloc(request: Request, now: float) -> None:
            prefill_replica, copy = self._unbootstrapped.pop(request.request_id)
            times = self.timeline[request.request_id]
            times.bootstrapped = now
            self._reaches_back(times.decode_replica, -1)
            prefill_replica.add(copy, now)
            self._wake(prefill_replica, now)

        return on_prealloc

    def _decode_hook(self, request: Request, now: float) -> None:
        rid = request.request_id
        self.final.setdefault(rid, request)
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
                    decode_replica.source.on_finish(failed, now)
                return
            times.prefill_done = now
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
        self._unbootstrapped[rid] = (prefill_replica, prefill_copy)
        decode_replica = self.decode.route(copy_request(request, max_tokens=request.max_tokens), t)
        self.timeline[rid].decode_replica = decode_replica.index
        self._reaches_back(decode_replica.index, 1)  # its pre-allocation starts the prefill
        self._decode_of[rid] = decode_replica
        self._wake(decode_replica, t)
