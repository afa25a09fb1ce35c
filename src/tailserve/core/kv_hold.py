"""KV a finished request keeps until it has been sent: the prefill side of a P/D pair.

Both engines' prefill servers keep a finished request's KV until the decode side has it: vLLM's
``NixlConnector.request_finished`` answers ``delay_free_blocks`` for a ``do_remote_decode``
request that finished, and the blocks are freed when the worker reports ``finished_sending``
(``v1/core/sched/scheduler.py`` ``_update_from_kv_xfer_finished``); SGLang's prefill server
moves the request to ``disagg_prefill_inflight_queue`` after its forward and releases its KV
(``release_kv_cache``: into the radix tree, unlocked) when the transfer polls done
(``process_disagg_prefill_inflight_queue``, ``disaggregation/prefill.py@v0.5.23``). The pair knows
when the transfer ends (its link, ``cluster/disagg.py``) and tells the prefill replica's
scheduler; the KV is freed at the replica's first iteration at or after that time, as both
engines poll their transfers once per turn.

vLLM also keeps the blocks of a request aborted while a connector was loading KV into them (a
P/D decode side's read, a CPU tier's load) until the worker reports the load done
(``finish_requests``' ``delay_free_blocks`` for ``WAITING_FOR_REMOTE_KVS``, freed at
``finished_recving``): the same hold, its blocks freed as an aborted request's.
"""

from __future__ import annotations

import heapq

from tailserve.core.request import Request


class HeldKV:
    """Finished requests whose KV stays allocated until a release time."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}
        self._aborted: set[str] = set()  # held ones that did not complete (freed as aborted)
        self._due: list[tuple[float, str]] = []  # (release time, request id), a heap

    def __bool__(self) -> bool:
        return bool(self.requests)

    def hold(self, request: Request, completed: bool = True) -> None:
        self.requests[request.request_id] = request
        if not completed:
            self._aborted.add(request.request_id)

    def release_at(self, request_id: str, t: float) -> None:
        """Its transfer ends at ``t``: free its KV at the first iteration from then."""
        if request_id not in self.requests:
            raise KeyError(f"request {request_id} holds no sent KV here")
        heapq.heappush(self._due, (t, request_id))

    def due(self, now: float) -> list[tuple[Request, bool]]:
        """The held requests whose release time has come, in release order, each with whether
        it completed; forgotten here."""
        out = []
        due = self._due
        while due and due[0][0] <= now:
            rid = heapq.heappop(due)[1]
            completed = rid not in self._aborted
            if not completed:
                self._aborted.remove(rid)
            out.append((self.requests.pop(rid), completed))
        return out

    def next_release(self) -> float | None:
        return self._due[0][0] if self._due else None
