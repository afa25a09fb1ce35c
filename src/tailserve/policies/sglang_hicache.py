"""SGLang's HiCache, the scheduler's side: load-backs priced into the prefill batch that uses them.

Followed from SGLang 0.5.23 (``managers/schedule_policy.py``, ``managers/scheduler.py``,
``mem_cache/unified_radix_cache.py``, all ``@v0.5.23``):

- **Admission** (``PrefillAdder.add_one_req``, ``schedule_policy.py:1398-1560``): a waiting
  request's match is its GPU prefix plus a host hit (``host_hit_length``). The KV budget is
  checked for everything after the GPU prefix (``len(fill_ids) - prefix_len``, loaded tokens
  included: they need GPU slots), the input and chunk budgets for what is computed after the host
  hit (``_select_prefill_admission``: ``prefix_len + host_hit_length``, :1603). Only then is the
  load queued (``init_load_back``): slots allocated at once (evicting for them), the nodes given
  them and locked, the request's prefix extended to the loaded node. A load that finds no room
  loads nothing and the request is re-checked as a plain recompute (:1556-1560).
- **The transfer** (``ready_to_load_host_cache``, ``scheduler.py:4351-4355``): the batch's loads
  are merged into one host->device copy started as the batch launches, on its own stream, layer
  by layer; the forward waits per layer (``executors/simulated/layerwise_load.py``). Priced as
  ``CostModel.swap_time`` of the batch's loaded tokens (each rank moves its own shard over its
  host link, in parallel), overlapped with the batch's forward pass.

Stores (GPU->host backups) run on another stream after the batch and are not priced: they
delay no step (``HiCacheController.write``/``start_writing``, ``cache_controller.py:864-920``).
"""

from __future__ import annotations

from typing import Any

from tailserve.core.scheduler_output import SchedulerOutput
from tailserve.kv.hicache_spec import DEFAULT_HICACHE_RATIO, HiCacheSpec
from tailserve.policies.sglang_config import SglangConfig


def hicache_spec(config: SglangConfig) -> HiCacheSpec | None:
    """The host tier ``config`` asks for; None with ``enable_hierarchical_cache`` off."""
    if not config.enable_hierarchical_cache:
        return None
    ratio = config.hicache_ratio if config.hicache_ratio is not None else DEFAULT_HICACHE_RATIO
    return HiCacheSpec(ratio, config.hicache_size, config.hicache_write_policy)


class HiCacheLoads:
    """Prices each prefill batch's load-backs: ``seconds_per_token`` from the cost model
    (``bind``), the batch's loaded tokens counted by the adder."""

    def __init__(self) -> None:
        self.seconds_per_token: float | None = None
        self.num_batches = 0  # prefill batches that loaded
        self.load_seconds = 0.0  # their copies' summed time (overlapped with their forwards)

    def bind(self, cost_model: Any) -> None:
        if cost_model is not None:
            self.seconds_per_token = cost_model.swap_time(1)

    def charge(self, out: SchedulerOutput, num_tokens: int) -> None:
        """The batch in ``out`` consumes ``num_tokens`` loaded tokens."""
        if not num_tokens:
            return
        if self.seconds_per_token is None:
            raise RuntimeError(
                "sglang hierarchical cache needs a cost model to price its loads (bind_cost_model)"
            )
        seconds = num_tokens * self.seconds_per_token
        out.host_load_seconds = seconds
        self.num_batches += 1
        self.load_seconds += seconds
