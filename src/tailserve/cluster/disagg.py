"""Disaggregated prefill/decode: prompts run on prefill replicas, their KV moves over a link to
a decode replica, which generates the rest.

One request's path (times on the cluster clock)::

    arrival ─► prefill router ─► prefill replica: queue, prefill (a copy with max_tokens=1)
      prefill_done ─► the prefill replica's link (FIFO: one transfer at a time per replica)
      transfer_done = link free + latency + KV bytes / bandwidth
      ─► decode router ─► decode replica: waits for KV room, then computes the last prompt
         token (its KV for prompt_len - 1 tokens arrived) and samples the first output token

as vLLM's P/D connectors do: the decode instance loads the prompt's KV but for its last token,
so its first iteration produces the client's first token. TTFT therefore includes the prefill,
the transfer and the decode-side wait. KV bytes are ``prompt_len x`` the model's KV bytes per
token on one prefill GPU's tensor-parallel shard, each GPU sending its shard over its own NIC.
A request with ``max_tokens == 1`` finishes on its prefill replica (nothing to decode). The
prefill replica keeps a request's KV until its transfer is done (``core/kv_hold.py``: vLLM's
connector delays freeing a ``do_remote_decode`` request's blocks until they are sent), so a slow
or busy link holds prefill memory.

The event loop: before routing an arrival at ``t`` the prefill replicas advance to ``t``; the
prefills they finish schedule transfers; every transfer done by ``t`` is routed, in time order,
after the decode replicas advanced to its time. Decode replicas never affect prefill ones, so
this order is exact.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tailserve.cluster.cluster import ClusterRun, PdTimes, Stage
from tailserve.core.gc_pause import paused_gc
from tailserve.core.request import Request, RequestStatus
from tailserve.executors.simulated.hardware import Link, get_link

# Policies whose admission accepts a request whose KV (but for one token) is already computed.
DECODE_POLICIES = ("vllm", "sarathi")
# Decode servers with their own P/D protocol (``sglang_pd.py``): SGLang pre-allocates KV first.
PAIRED_DECODE_POLICIES = ("sglang",)


@dataclass(frozen=True, slots=True, order=True)
class _Transfer:
    done: float
    seq: int  # ties in arrival order; ``request`` is never compared
    request: Request = field(compare=False)  # the decode-side copy


class PdCluster:
    decode_policies: tuple[str, ...] = DECODE_POLICIES

    def __init__(self, prefill: Stage, decode: Stage, link: str = "ib-ndr") -> None:
        for replica in decode.replicas:
            if replica.spec.policy.name not in self.decode_policies:
                raise ValueError(
                    f"--decode-policy {replica.spec.policy.name}: a decode replica must admit requests whose "
                    f"KV arrives from a prefill replica; supported: "
                    f"{', '.join([*DECODE_POLICIES, *PAIRED_DECODE_POLICIES])}"
                )
        self.prefill = prefill
        self.decode = decode
        self.links: list[Link] = [
            get_link(link, r.engine.executor.cost_model.hardware) for r in prefill.replicas
        ]
        self._link_free = [0.0] * len(prefill.replicas)
        self._transfers: list[_Transfer] = []
        self._seq = 0
        self.timeline: dict[str, PdTimes] = {}
        self._originals: dict[str, Request] = {}
        self.final: dict[str, Request] = {}
        for replica in prefill.replicas:
            replica.source.finish_hooks.append(self._prefill_hook(replica.index))
            # vLLM's connector and SGLang's prefill server keep a finished request's KV until
            # it is sent (``core/kv_hold.py``)
            replica.engine.scheduler.hold_kv_until_sent()

    def transfer_time(self, request: Request, prefill_index: int) -> float:
        return self.transfer_seconds(request.prompt_len, prefill_index)

    def transfer_seconds(self, num_tokens: int, prefill_index: int) -> float:
        """``num_tokens`` tokens' KV over prefill replica ``prefill_index``'s link."""
        link = self.links[prefill_index]
        if math.isinf(link.bandwidth):
            return link.latency
        cost_model = self.prefill.replicas[prefill_index].engine.executor.cost_model
        num_bytes = num_tokens * cost_model.model.kv_bytes_per_token(cost_model.tp)
        return link.latency + num_bytes / link.bandwidth

    def send_kv(self, request_id: str, num_tokens: int, index: int, now: float) -> float:
        """Queue ``num_tokens`` of the request's KV on prefill replica ``index``'s link at ``now``
        (one transfer at a time, FIFO): its timeline gets the transfer's start and end, and the
        prefill replica frees its copy at the end, returned."""
        start = max(now, self._link_free[index])
        done = start + self.transfer_seconds(num_tokens, index)
        self._link_free[index] = done
        times = self.timeline[request_id]
        times.transfer_start, times.transfer_done = start, done
        self.prefill.replicas[index].engine.scheduler.release_sent(request_id, done)
        return done

    def _leaves_prefill(self, copy: Request, index: int, now: float) -> bool:
        """The prefill copy's end in the timeline; True when the request ends there (refused,
        aborted, or nothing left to decode: the client's answer, its KV freed now)."""
        times = self.timeline[copy.request_id]
        times.prefill_scheduled = copy.first_scheduled_time
        if (
            copy.status is not RequestStatus.FINISHED_LENGTH
            or self._originals[copy.request_id].max_tokens == 1
        ):
            self.final[copy.request_id] = copy
            times.prefill_done = copy.finish_time if copy.token_times else None
            if copy.status is RequestStatus.FINISHED_LENGTH:  # nothing to send
                self.prefill.replicas[index].engine.scheduler.release_sent(copy.request_id, now)
            return True
        times.prefill_done = now
        return False

    def _prefill_hook(self, index: int):
        def on_finish(copy: Request, now: float) -> None:
            if self._leaves_prefill(copy, index, now):
                return
            original = self._originals[copy.request_id]
            done = self.send_kv(copy.request_id, copy.prompt_len, index, now)
            decode_copy = copy_request(original, max_tokens=original.max_tokens)
            decode_copy.num_computed_tokens = original.prompt_len - 1
            self._seq += 1
            heapq.heappush(self._transfers, _Transfer(done, self._seq, decode_copy))

        return on_finish

    def _route_transfers(self, until: float) -> None:
        while self._transfers and self._transfers[0].done <= until:
            transfer = heapq.heappop(self._transfers)
            self.decode.advance_to(transfer.done)
            replica = self.decode.route(transfer.request, transfer.done)
            self.timeline[transfer.request.request_id].decode_replica = replica.index
            self.final[transfer.request.request_id] = transfer.request

    def run(self, requests: Sequence[Request]) -> ClusterRun:
        ordered = sorted(requests, key=lambda r: r.arrival_time)
        t0, c0 = time.perf_counter(), time.process_time()
        with paused_gc():
            for request in ordered:
                t = request.arrival_time
                self.prefill.advance_to(t)
                self._route_transfers(t)
                self._originals[request.request_id] = request
                copy = copy_request(request, max_tokens=1)
                replica = self.prefill.route(copy, t)
                self.timeline[request.request_id] = PdTimes(replica.index)
            self.prefill.advance_to(None)
            self._route_transfers(math.inf)
            self.decode.advance_to(None)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        out = [self.final[request.request_id] for request in ordered]
        return ClusterRun(out, {"prefill": self.prefill, "decode": self.decode}, wall, self.timeline, cpu)


def copy_request(r: Request, *, max_tokens: int) -> Request:
    """The copy of a client's request one side of the pair serves."""
    return Request(
        request_id=r.request_id,
        prompt_len=r.prompt_len,
        max_tokens=max_tokens,
        arrival_time=r.arrival_time,
        priority=r.priority,
        tenant_id=r.tenant_id,
        prompt_token_ids=r.prompt_token_ids,
        prefix_block_hashes=r.prefix_block_hashes,
        planned_output_token_ids=r.planned_output_token_ids,
    )


def pd_specs(prefill: Sequence[Any], decode: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """The two sides' replica specs as the pair runs them: SGLang servers told which side they
    are (``disaggregation_mode``), which the decode side's scheduling follows; others as given."""

    def side(specs: Sequence[Any], mode: str) -> list[Any]:
        out = []
        for spec in specs:
            policy = spec.policy
            if policy.name == "sglang" and policy.flags.get("disaggregation_mode", "null") != mode:
                policy = replace(policy, flags={**policy.flags, "disaggregation_mode": mode})
                spec = replace(spec, policy=policy)
            out.append(spec)
        return out

    if not any(s.policy.name in PAIRED_DECODE_POLICIES for s in decode):
        return list(prefill), list(decode)
    return side(prefill, "prefill"), side(decode, "decode")


def make_pd_cluster(prefill: Stage, decode: Stage, link: str = "ib-ndr") -> PdCluster:
    """The pair for its decode side: SGLang's protocol (``sglang_pd.py``) or the vLLM-style one."""
    names = {r.spec.policy.name for r in decode.replicas}
    if names & set(PAIRED_DECODE_POLICIES):
        from tailserve.cluster.sglang_pd import SglangPdCluster

        return SglangPdCluster(prefill, decode, link)
    if names == {"vllm"}:
        from tailserve.cluster.vllm_pd import VllmPdCluster

        return VllmPdCluster(prefill, decode, link)
    return PdCluster(prefill, decode, link)
