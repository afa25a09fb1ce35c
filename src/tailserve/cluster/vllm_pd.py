"""A vLLM prefill/decode pair as vLLM 0.32 with its ``NixlConnector`` and a P/D proxy runs one.

One request's path (times on the cluster clock)::

    arrival ─► prefill router ─► prefill replica: queue, prefill (a copy with max_tokens=1,
      ``do_remote_decode``); it answers the proxy, keeping the prompt's KV (``delay_free_blocks``)
      prefill_done ─► decode router ─► decode replica: waiting queue; admitted as a load
        (``WAITING_FOR_REMOTE_KVS``: blocks for the prompt), its worker reads the KV from the
        prefill replica over that replica's link (FIFO) ─► transfer_done: the prefill replica
        frees its copy (``finished_sending``); the next pass puts the request back at the
        waiting queue's front, it computes its last prompt token and samples the client's first

(``kv_connector/v1/nixl/pull_scheduler.py``, ``v1/core/sched/scheduler.py``; the decode side's
load is ``policies/vllm_remote.py``.) So a decode replica short of KV leaves the prompt on its
prefill replica, whose memory then holds back the next prefills: the two sides depend on each
other and advance in lockstep (``lockstep_pd.py``). TTFT = prefill wait + prefill + decode wait
(to be admitted: ``link_wait`` counts from the prefill's end to the read's start) + the read +
the first decode pass. A request with ``max_tokens == 1`` finishes on its prefill replica.
Not modelled: the proxy's own time, the abort timeout that frees a prefill copy nobody read
(``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``), vLLM's push mode.
"""

from __future__ import annotations

from tailserve.cluster.cluster import PdTimes, Stage
from tailserve.cluster.disagg import copy_request
from tailserve.cluster.lockstep_pd import LockstepPdCluster, scrape
from tailserve.cluster.replica import Replica
from tailserve.core.request import Request
from tailserve.policies.vllm import VllmPolicy


class VllmPdCluster(LockstepPdCluster):
    decode_policies = ("vllm",)

    def __init__(self, prefill: Stage, decode: Stage, link: str = "ib-ndr") -> None:
        super().__init__(prefill, decode, link)
        for replica in decode.replicas:
            replica.source.finish_hooks.append(self._decode_hook)
        self._unread: dict[str, int] = {}  # request id -> prefill replica keeping its prompt's KV

    def _dispatch(self, request: Request, t: float) -> None:
        rid = request.request_id
        self._originals[rid] = request
        scrape(self.prefill, t)
        replica = self.prefill.route(copy_request(request, max_tokens=1), t)
        self.timeline[rid] = PdTimes(replica.index)
        self._wake(replica, t)

    def _prefill_hook(self, index: int):
        def on_finish(copy: Request, now: float) -> None:
            if self._leaves_prefill(copy, index, now):
                return
            rid = copy.request_id
            original = self._originals[rid]
            times = self.timeline[rid]
            self._unread[rid] = index
            scrape(self.decode, now)
            decode_copy = copy_request(original, max_tokens=original.max_tokens)
            replica = self.decode.route(decode_copy, now)
            times.decode_replica = replica.index
            self._reaches_back(replica.index, 1)  # its read frees the prefill copy
            policy = replica.engine.scheduler.policy
            assert isinstance(policy, VllmPolicy)
            policy.expect_remote_kv(rid, original.prompt_len, self._pull)
            self._wake(replica, now)

        return on_finish

    def _pull(self, request: Request, num_tokens: int, now: float) -> float:
        """The decode replica starts reading ``num_tokens`` of the prompt at ``now``: when the
        read is done, the prefill replica frees its copy."""
        index = self._unread.pop(request.request_id)
        times = self.timeline[request.request_id]
        times.decode_admitted = now
        self._reaches_back(times.decode_replica, -1)
        done = self.send_kv(request.request_id, num_tokens, index, now)
        self._wake(self.prefill.replicas[index], done)
        return done

    def _decode_hook(self, request: Request, now: float) -> None:
        rid = request.request_id
        self.final.setdefault(rid, request)
        index = self._unread.pop(rid, None)
        if index is not None:  # refused before its read started: the prefill copy is freed
            self._reaches_back(self.timeline[rid].decode_replica, -1)
            prefill: Replica = self.prefill.replicas[index]
            prefill.engine.scheduler.release_sent(rid, now)
            self._wake(prefill, now)
