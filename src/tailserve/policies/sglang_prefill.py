"""SGLang 0.5.23 as the prefill server of a P/D pair (``--disaggregation-mode prefill``).

Its turns are the ``sglang`` policy's prefill passes (a request leaves after its first token,
the pair's copy with ``max_tokens=1``), with one difference of its loop:
``get_next_disagg_prefill_batch_to_run`` (``disaggregation/prefill.py@v0.5.23``) clears
``batch_is_full`` at every turn ("we never enter update_running_batch which resets it"), so a
pass that found no room does not stop the next from trying: the room comes back when a finished
request's KV has been sent (``core/kv_hold.py``), not when a request leaves a running batch.
Requests reach it only once their decode server pre-allocated them (``cluster/sglang_pd.py``).
Not modelled: a finished request keeps its request slot until its KV is sent (SGLang's
``disagg_prefill_inflight_queue``; here only its KV is kept).
"""

from __future__ import annotations

from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import SchedulerOutput
from tailserve.policies.sglang import SglangPolicy


class SglangPrefillPolicy(SglangPolicy):
    """SGLang's prefill server: every turn tries a prefill batch."""

    summary = "SGLang prefill server (P/D): prefill passes, every turn tried"

    def schedule(self, sched: Scheduler, now: float) -> SchedulerOutput:
        self.batch_is_full = False
        return super().schedule(sched, now)
