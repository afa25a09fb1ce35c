"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, per-request block tables.

GPU blocks hold the KV the model reads; an optional CPU pool (vLLM V0's ``--swap-space``) holds
the KV of requests preempted by swapping. The manager decides and counts; an executor that owns
real KV tensors only stores into the block ids it is given. The same object drives the
simulator and the PyTorch executor.

With ``enable_prefix_caching`` the GPU blocks live in a ``HashedBlockPool`` (vLLM's automatic
prefix caching): full prompt blocks are registered under content keys as they are computed,
freed blocks stay cached in an LRU free queue until reused, and ``match_prefix`` finds a
request's longest cached chain. Keys come from the prompt's token ids, or from Mooncake-style
``prefix_block_hashes``; a request with neither never shares.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tailserve.core.prefix_cache import PrefixMatch


class KVCacheIntegrityError(AssertionError):
    """Raised by ``check_integrity`` with the numbers that do not add up."""


class KVCacheManager:
    """GPU KV blocks of ``block_size`` tokens each, handed out to requests by id."""

    def __init__(
        self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0, enable_prefix_caching: bool = False
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack: freed blocks are reused first, which keeps hot blocks hot on a real GPU.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # In a plain manager every held block has exactly one reference (only the radix
        # subclass shares), so the counts are not kept until something reads ``_ref_counts``
        # (the radix subclass on adoption, check_integrity): writing one count per block on
        # every allocate and free was the simulator's hottest loop with SGLang's one-token slots.
        self._refs: list[int] | None = None if type(self) is KVCacheManager else [0] * num_blocks
        self.block_tables: dict[str, list[int]] = {}
        self.num_cpu_blocks = num_cpu_blocks
        self._cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.cpu_block_tables: dict[str, list[int]] = {}
        self.pool = None
        if enable_prefix_caching:
            from tailserve.core.hashed_block_cache import HashedBlockPool  # imports this module

            self.pool = HashedBlockPool(num_blocks, block_size)
            self._free = []  # unused: the pool owns free blocks and ref counts
        self._keys: dict[str, list[int]] = {}  # request id -> full-block keys (prefix caching)
        self._num_registered: dict[str, int] = {}  # request id -> blocks registered in the pool

    @property
    def _ref_counts(self) -> list[int]:
        """Reference count per GPU block; counted from the tables the first time it is read,
        kept from then on."""
        refs = self._refs
        if refs is None:
            refs = [0] * self.num_blocks
            for table in self.block_tables.values():
                for block_id in table:
                    refs[block_id] += 1
            self._refs = refs
        return refs

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take (with prefix caching: free plus evictable cached)."""
        return self.pool.num_free_blocks if self.pool is not None else len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu_free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def prefix_caching(self) -> bool:
        return self.pool is not None

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def num_held(self, request_id: str) -> int:
        table = self.block_tables.get(request_id)
        return len(table) if table else 0

    def num_blocks_needed(self, request_id: str, num_total_tokens: int) -> int:
        """New blocks ``request_id`` needs so that it can hold ``num_total_tokens`` tokens."""
        return max(0, self.blocks_for(num_total_tokens) - self.num_held(request_id))

    def can_allocate(self, request_id: str, num_total_tokens: int, reserve: int = 0) -> bool:
        return self.num_blocks_needed(request_id, num_total_tokens) + reserve <= self.num_free_blocks

    def allocate(self, request_id: str, num_total_tokens: int) -> list[int] | None:
        """Grow the request's block table to hold ``num_total_tokens`` tokens.

        Returns the newly allocated block ids (possibly empty), or None when there is no room;
        on None nothing changed.
        """
        table = self.block_tables.get(request_id)
        held = len(table) if table is not None else 0
        need = -(-num_total_tokens // self.block_size) - held
        if need <= 0:
            if table is None:
                self.block_tables[request_id] = []
            return []
        if self.pool is not None:
            new_blocks = self.pool.allocate(need)
            if new_blocks is None:
                return None
            self.block_tables.setdefault(request_id, []).extend(new_blocks)
            return new_blocks
        free = self._free
        if need > len(free):
            return None
        if table is None:
            table = self.block_tables[request_id] = []
        new = free[-need:]
        del free[-need:]
        refs = self._refs
        if refs is not None:
            for block_id in new:
                refs[block_id] = 1
        table.extend(new)
        return new

    def free(self, request_id: str) -> int:
        """Release every block the request holds (GPU and CPU); returns how many GPU blocks
        reached ref count 0."""
        cpu = self.cpu_block_tables.pop(request_id, None)
        if cpu:
            self._cpu_free.extend(reversed(cpu))
        table = self.block_tables.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        if not table:
            return 0
        if self.pool is not None:
            before = self.pool.num_free_blocks
            self.pool.free(table)  # tail first; cached blocks stay matchable until reused
            return self.pool.num_free_blocks - before
        refs = self._refs
        free = self._free
        if refs is None:  # one reference each: every block is released, tail first as below
            free.extend(reversed(table))
            return len(table)
        released = 0
        # Tail first, like vLLM: the end of a sequence is the least likely to be shared.
        for block_id in reversed(table):
            refs[block_id] -= 1
            if refs[block_id] == 0:
                free.append(block_id)
                released += 1
        return released

    # ---- prefix caching (vLLM automatic prefix caching) ----------------------------------
    def set_prefix_keys(self, request_id: str, keys: list[int]) -> None:
        """The request's full-block content keys (``prefix_cache.block_hashes`` or
        ``keys_from_hash_ids``); without keys a request neither hits nor registers blocks."""
        self._keys[request_id] = keys

    def forget_prefix_keys(self, request_id: str) -> None:
        if self._keys:
            self._keys.pop(request_id, None)

    def match_prefix(self, request_id: str, num_tokens: int) -> PrefixMatch | None:
        """Longest cached chain of the request's blocks, capped so at least one of its
        ``num_tokens`` tokens is computed; None without prefix caching or keys. Counts a query
        in the pool's stats; changes nothing else."""
        keys = self._keys.get(request_id)
        if self.pool is None or not keys:
            return None
        return self.pool.get_computed_blocks(keys, num_tokens)

    def num_blocks_needed_after_hit(self, match: PrefixMatch, num_total_tokens: int) -> int:
        """Free blocks an admission with this hit consumes: the new blocks, plus the hit blocks
        that sit evictable in the free queue (touching them takes them out of it)."""
        pool = self.pool
        evictable_hits = sum(1 for b in match.kv_indices if pool.ref_count(b) == 0)
        return self.blocks_for(num_total_tokens) - len(match.kv_indices) + evictable_hits

    def allocate_with_prefix(self, request_id: str, match: PrefixMatch, num_total_tokens: int) -> bool:
        """Take the hit blocks and allocate the rest up to ``num_total_tokens``; False (nothing
        changed) when that does not fit. The request must hold no blocks yet."""
        if self.num_blocks_needed_after_hit(match, num_total_tokens) > self.pool.num_free_blocks:
            return False
        self.pool.touch(match.kv_indices)
        self.block_tables[request_id] = list(match.kv_indices)
        self._num_registered[request_id] = len(match.kv_indices)
        allocated = self.allocate(request_id, num_total_tokens)
        assert allocated is not None  # checked above
        return True

    def num_registered(self, request_id: str) -> int:
        """Leading blocks of the request's table registered in the pool (prefix caching)."""
        return self._num_registered.get(request_id, 0)

    def register_computed(self, request_id: str, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full once ``num_computed_tokens`` are computed
        (only blocks with keys: outputs are keyed only when the workload planned them)."""
        keys = self._keys.get(request_id)
        if self.pool is None or not keys:
            return
        done = self._num_registered.get(request_id, 0)
        full = min(
            num_computed_tokens // self.block_size, len(keys), len(self.block_tables.get(request_id, ()))
        )
        if full > done:
            table = self.block_tables[request_id]
            self.pool.cache_full_blocks(table[done:full], keys[done:full])
            self._num_registered[request_id] = full

    # ---- swap (vLLM V0 ``--preemption-mode swap``) ---------------------------------------
    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move the request's GPU blocks to the CPU pool; returns the (GPU block, CPU block)
        pairs whose contents an executor copies, or None (nothing changed) when the CPU pool
        lacks room."""
        table = self.block_tables.pop(request_id, [])
        n = len(table)
        if n > len(self._cpu_free):
            if table:
                self.block_tables[request_id] = table
            return None
        cpu = self._cpu_free[len(self._cpu_free) - n :]
        del self._cpu_free[len(self._cpu_free) - n :]
        self.cpu_block_tables[request_id] = cpu
        self._num_registered.pop(request_id, None)
        pairs = list(zip(table, cpu))
        if self.pool is not None:
            self.pool.free(table)
            return pairs
        refs = self._refs
        if refs is None:
            self._free.extend(reversed(table))
            return pairs
        for block_id in reversed(table):
            refs[block_id] -= 1
            if refs[block_id] == 0:
                self._free.append(block_id)
        return pairs

    def can_swap_in(self, request_id: str, reserve: int = 0) -> bool:
        return len(self.cpu_block_tables.get(request_id, ())) + reserve <= self.num_free_blocks

    def swap_in(self, request_id: str) -> list[tuple[int, int]] | None:
        """Bring a swapped request's blocks back to the GPU; returns the (CPU block, GPU block)
        pairs whose contents an executor copies, or None (nothing changed) when the GPU lacks
        room."""
        cpu = self.cpu_block_tables.get(request_id)
        if cpu is None:
            raise KeyError(f"request {request_id} is not swapped out")
        if len(cpu) > self.num_free_blocks:
            return None
        n = len(cpu)
        del self.cpu_block_tables[request_id]
        self._cpu_free.extend(reversed(cpu))
        self.block_tables.pop(request_id, None)
        self.allocate(request_id, n * self.block_size)
        return list(zip(cpu, self.block_tables[request_id]))

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self.cpu_block_tables

    def check_integrity(self) -> None:
        """Blocks in use + free blocks = total (GPU and CPU); ref counts match the tables."""
        if self.pool is not None:
            self._check_pool()
            self._check_cpu()
            return
        free = self._free
        if len(set(free)) != len(free):
            raise KVCacheIntegrityError("a block id appears twice in the free list")
        counted = [0] * self.num_blocks
        for table in self.block_tables.values():
            for block_id in table:
                counted[block_id] += 1
        for block_id, n in self._external_refs().items():
            counted[block_id] += n
        for block_id in free:
            if counted[block_id] or self._ref_counts[block_id]:
                raise KVCacheIntegrityError(
                    f"block {block_id} is free but referenced (tables and other owners: {counted[block_id]}, "
                    f"ref count: {self._ref_counts[block_id]})"
                )
        if counted != self._ref_counts:
            bad = next(i for i, (a, b) in enumerate(zip(counted, self._ref_counts)) if a != b)
            raise KVCacheIntegrityError(
                f"block {bad}: ref count {self._ref_counts[bad]} but {counted[bad]} references from tables and other owners"
            )
        in_use = sum(1 for c in counted if c > 0)
        if in_use + len(free) != self.num_blocks:
            raise KVCacheIntegrityError(
                f"{in_use} blocks in use + {len(free)} free != {self.num_blocks} total"
            )
        self._check_cpu()

    def _external_refs(self) -> dict[int, int]:
        """References held by owners other than requests' block tables (a radix tree)."""
        return {}

    def _check_pool(self) -> None:
        pool = self.pool
        pool.check_integrity()
        counted: dict[int, int] = {}
        for table in self.block_tables.values():
            for block_id in table:
                counted[block_id] = counted.get(block_id, 0) + 1
        for block_id in range(self.num_blocks):
            if pool.ref_count(block_id) != counted.get(block_id, 0):
                raise KVCacheIntegrityError(
                    f"block {block_id}: pool ref count {pool.ref_count(block_id)} but "
                    f"{counted.get(block_id, 0)} table entries"
                )

    def _check_cpu(self) -> None:
        cpu_used = [b for t in self.cpu_block_tables.values() for b in t]
        if len(set(cpu_used)) != len(cpu_used) or set(cpu_used) & set(self._cpu_free):
            raise KVCacheIntegrityError("a CPU block is held twice or both held and free")
        if len(cpu_used) + len(self._cpu_free) != self.num_cpu_blocks:
            raise KVCacheIntegrityError(
                f"{len(cpu_used)} CPU blocks in use + {len(self._cpu_free)} free != {self.num_cpu_blocks} total"
            )
        both = set(self.cpu_block_tables) & {k for k, t in self.block_tables.items() if t}
        if both:
            raise KVCacheIntegrityError(f"requests hold GPU and CPU blocks at once: {sorted(both)}")
