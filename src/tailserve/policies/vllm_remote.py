"""vLLM as the decode side of a P/D pair, the scheduler's side: a remote prefill's KV pulled
after the request is admitted (``NixlConnector``, ``kv_connector/v1/nixl/pull_scheduler.py``).

Followed from vLLM 0.32: the proxy sends the request to the decode instance once the prefill
instance answered (``do_remote_prefill`` with the prefill's block ids). The decode scheduler
treats it as a load, the same path as a CPU tier's (``vllm_offload.py``): in the waiting pass,
after its local prefix hit, ``get_num_new_matched_tokens`` answers the prompt's tokens not hit
locally (``_get_remote_prefill_token_count``: the whole prompt, no back-off for attention
models), loaded asynchronously; the request gets blocks for all of them (the same gates), leaves
for ``WAITING_FOR_REMOTE_KVS`` and its worker starts reading them from the prefill instance with
the step (``update_state_after_alloc``). When the read is done the prefill instance frees its
copy (``finished_sending``) and the request is back at the waiting queue's front, computing its
last prompt token (the loaded prompt was all of it) to sample the first token.

The read's time is the pair's (``cluster/vllm_pd.py``: the prefill replica's link), handed over
with each request (``expect``); it reads the prompt tokens the decode side's own prefix cache
does not hold (that hit leaves at least one token, so it always reads).
"""

from __future__ import annotations

from collections.abc import Callable

from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.policies.vllm_offload import OffloadLoads, _Load

# (request, tokens to read, when the read starts) -> when it is done
Pull = Callable[[Request, int, float], float]


class RemoteLoads(OffloadLoads):
    """The remote prefills a decode replica reads, in flight or expected."""

    uses_host_tier = False  # its KV comes from a prefill replica, not the KV manager's CPU tier

    def __init__(self, async_scheduling: bool, advanced: bool) -> None:
        super().__init__(async_scheduling, advanced)
        self._expected: dict[str, tuple[int, Pull]] = {}  # request id -> (remote tokens, its read)
        self._read: dict[Request, int] = {}  # tokens each load in flight reads
        self._hit: dict[Request, int] = {}  # its local prefix hit

    def __bool__(self) -> bool:
        return super().__bool__() or bool(self._expected)  # stepped while any is expected

    def expect(self, request_id: str, num_tokens: int, pull: Pull) -> None:
        """The request's prompt (``num_tokens``) is on a prefill replica; ``pull`` reads it."""
        self._expected[request_id] = (num_tokens, pull)

    def lookup(self, sched: Scheduler, request: Request, hit: int) -> int:
        entry = self._expected.get(request.request_id)
        # The local hit leaves at least one prompt token to compute (``cached_prefix``), so an
        # expected request always reads something.
        return 0 if entry is None else entry[0] - hit

    def begin(
        self, sched: Scheduler, request: Request, hit: int, num_load: int, now: float
    ) -> tuple[list[int], float]:
        _, pull = self._expected.pop(request.request_id)
        self._read[request] = num_load
        self._hit[request] = hit
        return [], pull(request, num_load, now)

    def end(self, sched: Scheduler, load: _Load) -> None:
        return None

    def loaded_tokens(self, request: Request, load: _Load, block_size: int) -> int:
        return self._read.pop(request, 0)

    def cached_tokens(self, request: Request) -> int:
        # The read tokens are the prefill side's, not this replica's prefix cache: its hit rate
        # counts its own hit (vLLM reports them apart: ``external_prefix_cache_*``).
        return self._hit.pop(request, 0)

    def forget(self, sched: Scheduler, finished: list[Request]) -> None:
        super().forget(sched, finished)
        for request in finished:
            self._read.pop(request, None)
            self._hit.pop(request, None)
            self._expected.pop(request.request_id, None)
