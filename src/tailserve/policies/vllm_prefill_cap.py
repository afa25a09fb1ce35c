"""vLLM V1's per-request chunk cap for one scheduling pass (``long_prefill_token_threshold``).

``Scheduler.schedule`` (``vllm/v1/core/sched/scheduler.py:640-655@v0.32.0``): the threshold is off
when there is only one request in all (running + waiting + those holding KV while they wait:
"nobody to starve"); with ``long_prefill_token_threshold_adaptive`` (0.32) it is floored at a fair
share of the pass's input budget, ``max_num_batched_tokens // requests``, so a few requests may
take larger chunks than the threshold while many cut them to it.
"""

from __future__ import annotations

from typing import Any


def prefill_cap(cfg: Any, num_requests: int) -> int:
    """The pass's cap on a request's new tokens (0: none), for a ``VllmConfig`` whose threshold is
    set, with ``num_requests`` running and waiting."""
    if num_requests <= 1:
        return 0
    cap = cfg.long_prefill_token_threshold
    if cfg.long_prefill_token_threshold_adaptive:
        cap = max(cap, cfg.max_num_batched_tokens // num_requests)
    return cap
