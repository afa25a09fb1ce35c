"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, per-request block tables.

GPU blocks hold the KV the model reads; an optional CPU pool (vLLM V0's ``--swap-space``) holds
the KV of requests preempted by swapping. The manager decides and counts; an executor that owns
real KV tensors only stores into the block ids it is given. The same object drives the
simulator and the PyTorch executor.
"""

from __future__ import annotations

from dataclasses import dataclass


class KVCacheIntegrityError(AssertionError):
    """Raised by ``check_integrity`` with the numbers that do not add up."""


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (vLLM's ``kv_cache_usage_perc``)."""
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0


class KVCacheManager:
    """GPU KV blocks of ``block_size`` tokens each, handed out to requests by id."""

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
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
        self._ref_counts: list[int] = [0] * num_blocks
        self.block_tables: dict[str, list[int]] = {}
        self.num_cpu_blocks = num_cpu_blocks
        self._cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.cpu_block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu_free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def stats(self) -> KVCacheStats:
        return KVCacheStats(self.num_blocks, self.num_free_blocks, self.num_used_blocks)

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
        return self.num_blocks_needed(request_id, num_total_tokens) + reserve <= len(self._free)

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
        free = self._free
        if need > len(free):
            return None
        if table is None:
            table = self.block_tables[request_id] = []
        new = free[-need:]
        del free[-need:]
        refs = self._ref_counts
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
        if not table:
            return 0
        refs = self._ref_counts
        free = self._free
        released = 0
        # Tail first, like vLLM: the end of a sequence is the least likely to be shared.
        for block_id in reversed(table):
            refs[block_id] -= 1
            if refs[block_id] == 0:
                free.append(block_id)
                released += 1
        return released

    # ---- swap (vLLM V0 ``--preemption-mode swap``) ---------------------------------------
    def swap_out(self, request_id: str) -> int | None:
        """Move the request's GPU blocks to the CPU pool; returns the number of blocks moved, or
        None (nothing changed) when the CPU pool lacks room."""
        table = self.block_tables.pop(request_id, [])
        n = len(table)
        if n > len(self._cpu_free):
            if table:
                self.block_tables[request_id] = table
            return None
        cpu = self._cpu_free[len(self._cpu_free) - n :]
        del self._cpu_free[len(self._cpu_free) - n :]
        self.cpu_block_tables[request_id] = cpu
        refs = self._ref_counts
        for block_id in reversed(table):
            refs[block_id] -= 1
            if refs[block_id] == 0:
                self._free.append(block_id)
        return n

    def can_swap_in(self, request_id: str, reserve: int = 0) -> bool:
        return len(self.cpu_block_tables.get(request_id, ())) + reserve <= len(self._free)

    def swap_in(self, request_id: str) -> int | None:
        """Bring a swapped request's blocks back to the GPU; returns the number of blocks moved,
        or None (nothing changed) when the GPU lacks room."""
        cpu = self.cpu_block_tables.get(request_id)
        if cpu is None:
            raise KeyError(f"request {request_id} is not swapped out")
        if len(cpu) > len(self._free):
            return None
        n = len(cpu)
        del self.cpu_block_tables[request_id]
        self._cpu_free.extend(reversed(cpu))
        self.block_tables.pop(request_id, None)
        self.allocate(request_id, n * self.block_size)
        return n

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self.cpu_block_tables

    def check_integrity(self) -> None:
        """Blocks in use + free blocks = total (GPU and CPU); ref counts match the tables."""
        free = self._free
        if len(set(free)) != len(free):
            raise KVCacheIntegrityError("a block id appears twice in the free list")
        counted = [0] * self.num_blocks
        for table in self.block_tables.values():
            for block_id in table:
                counted[block_id] += 1
        for block_id in free:
            if counted[block_id] or self._ref_counts[block_id]:
                raise KVCacheIntegrityError(
                    f"block {block_id} is free but referenced (tables: {counted[block_id]}, "
                    f"ref count: {self._ref_counts[block_id]})"
                )
        if counted != self._ref_counts:
            bad = next(i for i, (a, b) in enumerate(zip(counted, self._ref_counts)) if a != b)
            raise KVCacheIntegrityError(
                f"block {bad}: ref count {self._ref_counts[bad]} but {counted[bad]} table entries"
            )
        in_use = sum(1 for c in counted if c > 0)
        if in_use + len(free) != self.num_blocks:
            raise KVCacheIntegrityError(
                f"{in_use} blocks in use + {len(free)} free != {self.num_blocks} total"
            )
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
