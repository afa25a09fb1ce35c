"""TensorRT-LLM's secondary (host) KV block pool: ``kv_cache_config.host_cache_size``.

Read in TensorRT-LLM's 1.x C++ KV cache manager (``cpp/tensorrt_llm/batch_manager/
kvCacheManager.cpp``, ``evictionPolicy.cpp``, ``kvCacheTransferManager.cpp``, stored copies of
the 1.x line; ``tensorrt_llm/_torch/pyexecutor/resource_manager.py`` for the sizing). Where it
differs from vLLM's CPU tier (``kv/host_tier.py``), TensorRT-LLM's is followed:

- **Size**: bytes *per GPU* (each rank allocates its own pinned pool):
  ``blocks_in_secondary_pool = int(host_cache_size / cache_size_bytes_per_token /
  tokens_per_block)`` (``KVCacheManager.calculate_max_num_blocks``, resource_manager.py), where
  the bytes per token are the rank's own (its KV heads after the TP split; MLA's latent whole).
- **Exclusive, filled on eviction** (not write-through): a GPU block is copied to the host only
  when an allocation evicts it (``WindowBlockManager::getFreeBlock``: the block has tokens, its
  priority is at least ``secondary_offload_min_priority`` -- 30 unless set, and every block has
  the default 35, ``evictionPolicy.cpp`` ``kDefaultSecondaryOffloadMinPriority`` and
  ``executor.h`` ``kDefaultRetentionPriority`` -- and ``onboard_blocks`` is on). The block keeps
  its place in the reuse tree, now in host memory; a later match *onboards* it
  (``WindowBlockManager::onboardBlock``): copied back into a fresh GPU block, its host slot freed.
  A block is in one of the two pools, never both.
- **Slots in LRU order** (``LRUEvictionPolicy``, one queue per cache level): every host slot,
  holding a block or not, sits in one queue; an offload takes the slot at the front (dropping the
  block it held, with its descendants in the tree) and puts it at the back; an onboard puts the
  freed slot at the back *empty*. So a freed slot is reused only after every older one, as in the
  engine (``getFreeBlock(kSecondaryLevel)`` returns the queue's front).

Copies are the scheduler's to price (``policies/trtllm_host_cache.py``): both directions are
issued during ``prepare_resources`` and the step's kernels wait for them (``refresh_blocks`` ->
``KVCacheTransferManager::syncTransfers``), so nothing is in flight across steps and no slot is
pinned.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tailserve.kv.paged import KVCacheIntegrityError

# KvCacheRetentionConfig::kDefaultRetentionPriority (cpp/include/tensorrt_llm/executor/executor.h):
# the priority of every block of a request that sets no retention config (all of tailserve's).
DEFAULT_RETENTION_PRIORITY = 35
# evictionPolicy.cpp kDefaultSecondaryOffloadMinPriority: secondary_offload_min_priority unset
DEFAULT_SECONDARY_OFFLOAD_MIN_PRIORITY = 30


def secondary_pool_blocks(host_cache_size: int, bytes_per_token: int, tokens_per_block: int) -> int:
    """Host blocks ``host_cache_size`` bytes hold on one GPU, as ``calculate_max_num_blocks``
    computes them (float division, then truncated)."""
    return max(0, int(host_cache_size / bytes_per_token / tokens_per_block))


@dataclass(slots=True)
class SecondaryPoolStats:
    """Counters since construction."""

    num_onboarded_tokens: int = 0  # reused from the host pool (counted as prefix hits)
    num_onboards: int = 0  # admissions that onboarded blocks
    num_offloaded_blocks: int = 0
    num_evicted_blocks: int = 0  # blocks dropped from the host pool by a later offload
    num_copy_steps: int = 0  # steps whose forward waited for host copies
    copy_seconds: float = 0.0  # summed waits of those steps


class SecondaryBlockPool:
    """The host slots of one GPU's pool: content keys (the GPU pool's chained block keys), or
    None for an empty slot, in the eviction queue's order (front: next to be overwritten)."""

    def __init__(self, num_blocks: int, block_size: int, size_bytes: int) -> None:
        if num_blocks < 1:
            raise ValueError(
                f"host_cache_size={size_bytes:,} bytes holds no KV block of this model "
                f"({block_size} tokens per block): give at least one block's size per GPU"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.size_bytes = size_bytes
        # slot -> key held (None: empty); every slot starts empty, in id order (initialize)
        self._queue: OrderedDict[int, int | None] = OrderedDict((slot, None) for slot in range(num_blocks))
        self._slot_of: dict[int, int] = {}  # key -> its slot
        self._pending_offloads = 0  # blocks offloaded since ``take_offloaded``
        self.stats = SecondaryPoolStats()

    def __len__(self) -> int:
        """Blocks held (slots with a key)."""
        return len(self._slot_of)

    def __contains__(self, key: int) -> bool:
        return key in self._slot_of

    def lookup(self, keys: Sequence[int], start: int, stop: int) -> int:
        """How many of ``keys[start:stop]`` the pool holds, consecutively from ``start``."""
        held = self._slot_of
        n = start
        while n < stop and keys[n] in held:
            n += 1
        return n - start

    def offload(self, keys: Sequence[int]) -> None:
        """Blocks the GPU pool just evicted, in eviction order: each takes the front slot (its
        block dropped) and goes to the back. A key the pool already holds is not stored again
        (the engine's tree holds one block per key)."""
        queue, held = self._queue, self._slot_of
        stats = self.stats
        for key in keys:
            if key in held:
                continue
            slot, old = queue.popitem(last=False)
            if old is not None:
                del held[old]
                stats.num_evicted_blocks += 1
            queue[slot] = key
            held[key] = slot
            stats.num_offloaded_blocks += 1
            self._pending_offloads += 1

    def onboard(self, keys: Sequence[int]) -> None:
        """Blocks a request reuses from the pool: their slots go to the back, empty."""
        queue, held = self._queue, self._slot_of
        for key in keys:
            slot = held.pop(key)
            del queue[slot]
            queue[slot] = None

    def take_offloaded(self) -> int:
        """Blocks offloaded since the last call (the step's D2H copies)."""
        n, self._pending_offloads = self._pending_offloads, 0
        return n

    def check_integrity(self) -> None:
        if len(self._queue) != self.num_blocks:
            raise KVCacheIntegrityError(f"host pool has {len(self._queue)} slots, not {self.num_blocks}")
        held = {key: slot for slot, key in self._queue.items() if key is not None}
        if held != self._slot_of:
            raise KVCacheIntegrityError("host pool: its key index does not match its slots")

    def summary(self) -> dict[str, float | int]:
        """The pool's figures for a run's JSON (``prefix_cache.cpu_tier``)."""
        st = self.stats
        return {
            "size_bytes": self.size_bytes,
            "num_blocks": self.num_blocks,
            "onboarded_tokens": st.num_onboarded_tokens,
            "num_onboards": st.num_onboards,
            "offloaded_blocks": st.num_offloaded_blocks,
            "evicted_blocks": st.num_evicted_blocks,
            "copy_steps": st.num_copy_steps,
            "copy_seconds": st.copy_seconds,
        }

    def note(self) -> str:
        """One line on what the pool did in a run."""
        st = self.stats
        gib = self.size_bytes / (1 << 30)
        wait = (
            f"; {st.num_copy_steps:,} steps waited {st.copy_seconds:.2f} s in all for host copies"
            if st.num_copy_steps
            else ""
        )
        return (
            f"TensorRT-LLM host KV pool ({gib:.3g} GiB per GPU, {self.num_blocks:,} blocks of "
            f"{self.block_size} tokens): {st.num_onboarded_tokens:,} prompt tokens onboarded in "
            f"{st.num_onboards:,} admissions; {st.num_offloaded_blocks:,} evicted GPU blocks offloaded, "
            f"{st.num_evicted_blocks:,} dropped from the host{wait}"
        )
