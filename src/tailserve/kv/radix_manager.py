"""A page-size-1 KV cache whose slots may also be held by an SGLang radix tree.

``KVCacheManager`` counts one reference per block-table entry. SGLang's radix cache keeps KV
slots alive after the requests that computed them leave, and hands cached slots to new requests;
here the tree owns one reference on every slot it caches (``hold`` / ``release``), a request owns
one per table entry (``share`` appends cached slots to its table), and a slot returns to the free
list when its last reference goes. ``check_integrity`` counts the tree's references too.

``on_free`` (set by the policy) is called with a request id just before ``free`` drops that
request's references, so the policy can insert a finished request's tokens into the tree (or
unlock a retracted one) while its slots are still held. ``kv/factory.py`` builds this class for
a policy that declares a radix cache; the policy hooks its tree in when the first request with
token identities arrives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from tailserve.kv.paged import KVCacheIntegrityError, KVCacheManager

if TYPE_CHECKING:
    from tailserve.kv.prefix import PrefixCacheStats
    from tailserve.kv.radix import RadixCache


class RadixKVCacheManager(KVCacheManager):
    """``KVCacheManager`` plus references held by a radix tree (no hashed pool, no CPU pool use)."""

    shares_prefixes: ClassVar[bool] = True

    def __init__(self, num_blocks: int, block_size: int = 1, num_cpu_blocks: int = 0) -> None:
        super().__init__(num_blocks, block_size, num_cpu_blocks)
        # The tree whose node values are the references counted by ``hold``; set by the policy.
        self.tree: RadixCache | None = None
        self.on_free: Callable[[str], None] | None = None
        self._tree_refs = 0

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        return self.tree.stats if self.tree is not None else None

    # ---- references ------------------------------------------------------------------------
    def share(self, request_id: str, block_ids: list[int]) -> None:
        """Append already-referenced blocks (cached slots) to the request's table, ref += 1."""
        refs = self._ref_counts
        for block_id in block_ids:
            if refs[block_id] <= 0:
                raise ValueError(f"block {block_id} is free; only held blocks can be shared")
            refs[block_id] += 1
        self.block_tables.setdefault(request_id, []).extend(block_ids)

    def hold(self, block_ids: list[int]) -> None:
        """One reference for the tree on each (already referenced) block."""
        refs = self._ref_counts
        for block_id in block_ids:
            if refs[block_id] <= 0:
                raise ValueError(f"block {block_id} is free; the tree can only adopt held blocks")
            refs[block_id] += 1
        self._tree_refs += len(block_ids)

    def release(self, block_ids: list[int]) -> None:
        """Drop the tree's reference on each block (``RadixCache.evict``'s ``free_fn``)."""
        refs = self._ref_counts
        free = self._free
        for block_id in block_ids:
            refs[block_id] -= 1
            if refs[block_id] == 0:
                free.append(block_id)
        self._tree_refs -= len(block_ids)

    def free(self, request_id: str) -> int:
        if self.on_free is not None:
            self.on_free(request_id)
        return super().free(request_id)

    # ---- invariants ------------------------------------------------------------------------
    def _external_refs(self) -> dict[int, int]:
        return self.tree_refs()

    def tree_refs(self) -> dict[int, int]:
        """References the tree holds, per block (from its nodes)."""
        counted: dict[int, int] = {}
        tree = self.tree
        if tree is None:
            return counted
        for node in tree._nodes():
            if node is tree.root:
                continue
            for slot in node.value:
                counted[slot] = counted.get(slot, 0) + 1
        return counted

    def check_integrity(self) -> None:
        """As ``KVCacheManager``, counting the tree's references next to the tables; the tree's
        own invariants hold; the tree holds exactly the references ``hold`` took."""
        if self.tree is not None:
            self.tree.check_integrity()
        held = self.tree_refs()
        if sum(held.values()) != self._tree_refs:
            raise KVCacheIntegrityError(
                f"the tree caches {sum(held.values())} slots but holds {self._tree_refs} references"
            )
        super().check_integrity()
