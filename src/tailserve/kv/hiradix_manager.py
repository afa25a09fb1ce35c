"""The ``sglang`` radix KV manager with SGLang's host tier behind its tree (HiCache).

``RadixKVCacheManager`` (flavour ``sglang``) over a ``HiRadixCache`` (``kv/hiradix.py``): the tree
holds one reference on each GPU slot it caches, as before; a host-only node holds none (its KV
is in the host pool, counted by the tree). What this class adds:

- inserts pass the request's already-inserted length (SGLang's ``inserted_len``), so each node is
  counted once per request toward its write-through backup, and host-only nodes an insert walks
  over take the request's slots (the tree's ``adopt`` is ``hold``);
- ``load_back``: the host part of a match gets fresh slots (``init_load_back`` /
  ``load_back``, ``mem_cache/unified_radix_cache.py:3586-3620, 1820-1937@v0.5.23``): the host path
  is pinned, the tree evicts for the slots (``evict_for_alloc``), the slots go to the nodes and
  the caller's lock moves from the GPU prefix's node to the loaded one. A hit under
  ``LOAD_BACK_THRESHOLD`` tokens, or one the freed slots cannot hold, is not loaded (recomputed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tailserve.kv.hicache_spec import LOAD_BACK_THRESHOLD, HiCacheSpec
from tailserve.kv.hiradix import HiPrefixMatch, HiRadixCache
from tailserve.kv.paged import KVCacheIntegrityError, KVCacheManager
from tailserve.kv.prefix import PrefixMatch
from tailserve.kv.radix_manager import RadixKVCacheManager, _Held

if TYPE_CHECKING:
    from tailserve.kv.hiradix import HiCacheStats

_LOADER = "\0hicache-load"  # the owner of a load's slots until the tree takes them


class HiRadixKVCacheManager(RadixKVCacheManager):
    """SGLang's radix cache with its HiCache host pool of ``host_tokens`` tokens."""

    def __init__(
        self, num_blocks: int, block_size: int, num_cpu_blocks: int, spec: HiCacheSpec, host_tokens: int
    ) -> None:
        if block_size != 1:
            raise ValueError("hierarchical cache: tailserve models SGLang's radix cache with page_size 1")
        super().__init__(num_blocks, block_size, num_cpu_blocks, "sglang")
        self.hicache = spec
        self.host_tokens = host_tokens

    def _build_tree(self) -> None:
        tree = HiRadixCache(self.host_tokens, self.hicache.write_policy, self.block_size, self._compact)
        tree.adopt = self.hold
        self.tree = tree
        self._live_refs()

    @property
    def hicache_stats(self) -> HiCacheStats | None:
        return self.tree.host_stats if self.tree is not None else None  # type: ignore[attr-defined]

    def _tree_insert(self, keys: list, slots: list[int], held: _Held) -> int:
        """The request's inserted length passed on (SGLang's ``inserted_len``): the tree counts
        each node once per request toward its write-through backup."""
        return self.tree.insert(keys, slots, held.inserted)  # type: ignore[call-arg]

    def load_back(self, match: PrefixMatch) -> PrefixMatch | None:
        """Load the host part of ``match`` (a locked ``HiPrefixMatch``) to the GPU: the longer
        match, its node locked in place of ``match.node``; None when nothing is loaded."""
        if not isinstance(match, HiPrefixMatch) or not match.host_tokens:
            return None
        tree: HiRadixCache = self.tree  # type: ignore[assignment]
        stats = tree.host_stats
        num = match.host_tokens
        if num < LOAD_BACK_THRESHOLD:
            stats.num_short_hits += 1
            return None
        path = tree.host_path(match)
        tree.pin(path)
        short = num - self.num_free_blocks
        if short > 0:
            self.evict_cached(short)
        tree.unpin(path)
        if self.num_free_blocks < num:
            stats.num_failed_loads += 1
            return None
        self.allocate(_LOADER, num)
        slots = self.block_tables[_LOADER][:num]
        tree.load_back(path, slots)
        self.hold(slots)
        KVCacheManager.free(self, _LOADER)
        tree.inc_lock_ref(match.host_node)  # type: ignore[arg-type]
        tree.dec_lock_ref(match.node)  # type: ignore[arg-type]
        stats.num_loads += 1
        stats.loaded_tokens += num
        return PrefixMatch(match.num_tokens + num, match.kv_indices + slots, match.host_node)

    def host_tier_report(self) -> tuple[dict[str, Any], str] | None:
        return self.host_summary(), self.host_note()

    def host_summary(self) -> dict[str, Any]:
        """The host tier's figures for a run's JSON (``prefix_cache.cpu_tier``)."""
        st = self.hicache_stats
        out: dict[str, Any] = {"host_tokens": self.host_tokens, "write_policy": self.hicache.write_policy}
        if st is not None:
            out.update(
                loaded_tokens=st.loaded_tokens,
                num_loads=st.num_loads,
                failed_loads=st.num_failed_loads,
                backed_up_tokens=st.backed_up_tokens,
                skipped_backup_tokens=st.skipped_backup_tokens,
                demoted_tokens=st.demoted_tokens,
                host_evicted_tokens=st.host_evicted_tokens,
            )
        return out

    def host_note(self) -> str:
        """One line on what the tier did in a run."""
        st = self.hicache_stats
        head = f"sglang HiCache ({self.hicache.describe()}, {self.host_tokens:,} host tokens)"
        if st is None:
            return f"{head}: no request carried token identities, the tree was never built"
        return (
            f"{head}: {st.loaded_tokens:,} tokens loaded back in {st.num_loads:,} loads"
            f" ({st.num_failed_loads:,} host hits recomputed for lack of GPU room, {st.num_short_hits:,} under"
            f" {LOAD_BACK_THRESHOLD} tokens); {st.backed_up_tokens:,} tokens backed up"
            f" ({st.skipped_backup_tokens:,} skipped, host pool full), {st.demoted_tokens:,} demoted from the GPU,"
            f" {st.host_evicted_tokens:,} evicted from the host"
        )

    def check_integrity(self) -> None:
        if _LOADER in self.block_tables:
            raise KVCacheIntegrityError("a HiCache load's slots were left unowned")
        super().check_integrity()
