"""SGLang's HiCache sizing and write policy (``--enable-hierarchical-cache``), as SGLang 0.5.23
resolves them; the tree that uses them is ``kv/hiradix.py``.

- **Host pool size, per TP rank** (``mem_cache/pool_host/base.py:219-227@v0.5.23``): with
  ``--hicache-size GB`` > 0 the pool holds ``GB x 1e9 // bytes per token`` tokens (the rank's own
  shard of every layer's K and V: ``size_per_token``), overriding the ratio; otherwise ``device
  pool tokens x hicache_ratio``. Either way one padding page is added (``page_num = size //
  page_size + 1``). Every rank holds the same tokens of its own shard, so the pool's capacity in
  tokens is one figure for the engine.
- **Default ratio 2.0** (``arg_groups/hicache_hook.py:119-121@v0.5.23``, ``cache`` host-memory
  mode). SGLang then shrinks a *defaulted* ratio to fit 0.8 of the machine's free host memory
  (``hicache_host_memory_fraction``, ``mem_cache/hicache_auto_size.py:83-113@v0.5.23``); tailserve
  does not know the host's memory and keeps 2.0.
- **Write policy** (``arg_groups/fields/memory.py:121-127@v0.5.23``, default ``write_through``):
  a node is backed up to host when an insert has counted it ``write_through_threshold`` times,
  1 for ``write_through`` and 2 for ``write_through_selective``
  (``mem_cache/unified_radix_cache.py:558-560@v0.5.23``, ``_inc_hit_count_and_check`` in
  ``unified_cache/unified_tree_core.py:1104-1122@v0.5.23``); ``write_back`` backs a node up only
  when the GPU evicts it (``evict_device_leaf``, ``unified_tree_core.py:1788-1822@v0.5.23``).
"""

from __future__ import annotations

from dataclasses import dataclass

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
DEFAULT_HICACHE_RATIO = 2.0  # arg_groups/hicache_hook.py:119-121@v0.5.23
# A host hit shorter than this is recomputed, not loaded (``self.load_back_threshold = 10``,
# mem_cache/unified_radix_cache.py:576@v0.5.23, checked in ``_load_back_transfers``:1879).
LOAD_BACK_THRESHOLD = 10


@dataclass(frozen=True, slots=True)
class HiCacheSpec:
    """What the KV factory needs to build SGLang's host tier behind its radix tree."""

    ratio: float = DEFAULT_HICACHE_RATIO  # host tokens per device pool token
    size_gb: int = 0  # GB (1e9 bytes) per rank; > 0 overrides the ratio
    write_policy: str = "write_through"

    def __post_init__(self) -> None:
        if not self.ratio > 0:
            raise ValueError(f"hicache_ratio must be > 0, got {self.ratio}")
        if self.size_gb < 0:
            raise ValueError(f"hicache_size must be >= 0 GB, got {self.size_gb}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"hicache_write_policy must be one of {', '.join(WRITE_POLICIES)}, got {self.write_policy!r}"
            )

    def host_tokens(self, device_tokens: int, bytes_per_token: int, page_size: int = 1) -> int:
        """Tokens the host pool of one rank holds (``HostKVCache.__init__``): ``bytes_per_token``
        is the rank's KV bytes per token (all layers, K and V of its heads)."""
        if self.size_gb > 0:
            size = int(self.size_gb * 1e9 // bytes_per_token)
        else:
            size = int(device_tokens * self.ratio)
        return (size // page_size + 1) * page_size

    def describe(self) -> str:
        size = f"{self.size_gb} GB per rank" if self.size_gb > 0 else f"ratio {self.ratio:g}"
        return f"{size}, {self.write_policy}"
