"""TensorRT-LLM's host KV pool, the scheduler's side: onboarding at admission and the copies'
time (``kv_cache_config.host_cache_size``; the pool itself: ``kv/secondary_pool.py``).

- **Onboarding** (``WindowBlockManager::loadOrAllocateBlocks``, ``kvCacheManager.cpp``): when a
  context's first chunk takes its blocks (``addSequence``, in ``prepare_resources``), the reuse
  tree is walked block by block; a matched block in host memory is onboarded: copied into a
  fresh GPU block (``getFreeBlock``, which may itself evict and offload a GPU block), its host
  slot freed. The request's prepopulated length counts those blocks as reused, so they count as
  prefix hits (``num_cached_tokens``) and the context starts past them. Here: the GPU hit first,
  then the host blocks right after it (``HashedKVCacheManager.secondary_lookup``).
- **Offloading**: a GPU block evicted by any allocation of the step (a context's blocks, a
  generation request's next block) is copied to the host pool (the pool's ``on_evict`` hook).
- **Time**: both directions are issued during ``prepare_resources`` on the transfer manager's
  two streams (``KVCacheTransferManager``: ``mOnboardManager`` H2D, ``mOffloadManager`` D2H),
  and ``prepare_resources`` ends with ``refresh_blocks`` -> ``syncTransfers``: "prefill and
  generation kernels wait for scheduled offload/onboard/partial copy work before launching"
  (``_torch/pyexecutor/resource_manager.py``). So the step's forward waits for the longer of
  the two directions (they run side by side; an onboard into a block whose offload is pending
  waits only for that block's copy): ``max(onboarded, offloaded tokens) x swap_time(1)``, each
  GPU moving its own shard over its host link (``CostModel.swap_time``). Under the overlap
  scheduler the copies run while the previous step's forward does (``SimExecutor``'s host part).
"""

from __future__ import annotations

from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import SchedulerOutput


class HostCacheCopies:
    """One engine's host-pool copies: what the step being scheduled onboards, and its price."""

    def __init__(self) -> None:
        # Seconds to move one token's KV shard between host and GPU (``bind_cost_model``); None
        # until a cost model prices it.
        self.seconds_per_token: float | None = None
        self._onboarded = 0  # tokens onboarded by the step being scheduled

    def onboard(self, sched: Scheduler, request: Request, hit: int) -> int:
        """Tokens the host pool gives ``request`` right after its GPU hit of ``hit``, taken out
        of the pool (before its GPU blocks are allocated); 0 when it has none."""
        kv = sched.kv_cache
        found = kv.secondary_lookup(request.request_id, hit, request.num_tokens)  # type: ignore[attr-defined]
        if found:
            kv.onboard(request.request_id, hit, found)  # type: ignore[attr-defined]
            pool = kv.secondary
            assert pool is not None
            pool.stats.num_onboards += 1
            pool.stats.num_onboarded_tokens += found
            self._onboarded += found
        return found

    def price(self, sched: Scheduler, out: SchedulerOutput) -> None:
        """The step's copies, once its allocations are done: the wait goes on ``out``."""
        pool = sched.kv_cache.secondary
        assert pool is not None
        offloaded = pool.take_offloaded() * pool.block_size
        tokens = max(self._onboarded, offloaded)
        self._onboarded = 0
        if not tokens:
            return
        if self.seconds_per_token is None:
            raise RuntimeError("host_cache_size needs a cost model to price its copies (bind_cost_model)")
        out.kv_copy_time = tokens * self.seconds_per_token
        pool.stats.num_copy_steps += 1
        pool.stats.copy_seconds += out.kv_copy_time
