"""The free-block queue of vLLM's block pool (``FreeKVCacheBlockQueue``), batched per request.

vLLM keeps free blocks in one doubly linked list and touches them one at a time; at Mooncake
scale (~750 blocks per request, every one allocated, cached and freed) that per-block Python
work was most of a cluster simulation. This queue keeps the same order in two parts that numpy
and list slicing move a request's blocks through at once::

    front (reused first)                                                      back (reused last)
    [ the front stack, top first | the ring: blocks put at the back, oldest first ]

- the front stack (a list whose END is the queue's front) receives ``push_front``: the pool's
  keyless blocks, and at construction every block;
- the ring (a numpy array with a head and a tail) receives ``push_back``; taking a block out of
  the middle (a cache hit on a free block) only marks its entry stale (``_pos[block]`` no longer
  points at it), and stale entries are skipped when popped and dropped when the ring is compacted.

Every block is in the queue at most once; ``pop_front`` hands out the queue's first blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_NOT_IN_RING = -1


class FreeBlockQueue:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._front: list[int] = list(range(num_blocks - 1, -1, -1))  # block 0 first
        self._ring = np.empty(2 * num_blocks + 64, dtype=np.int64)
        self._head = 0  # first ring position that may hold a live entry
        self._tail = 0  # next ring position to write
        # ring position of each block's live entry, or _NOT_IN_RING
        self._pos = np.full(num_blocks, _NOT_IN_RING, dtype=np.int64)
        self._num_ring = 0  # live ring entries

    def __len__(self) -> int:
        return len(self._front) + self._num_ring

    @property
    def num_front(self) -> int:
        """Blocks in the front stack (ahead of every ring block)."""
        return len(self._front)

    def push_front(self, block_ids: Sequence[int]) -> None:
        """Put the blocks at the front, ``block_ids[0]`` first (vLLM's ``prepend_n``)."""
        self._front.extend(reversed(block_ids))

    def push_back(self, block_ids: np.ndarray) -> None:
        """Append the blocks at the back, in the given order."""
        n = len(block_ids)
        if not n:
            return
        if self._tail + n > len(self._ring):
            self._compact()
        tail = self._tail
        self._ring[tail : tail + n] = block_ids
        self._pos[block_ids] = np.arange(tail, tail + n)
        self._tail = tail + n
        self._num_ring += n

    def pop_front(self, n: int) -> tuple[list[int], np.ndarray | None]:
        """Take the first ``n`` blocks (``n <= len(self)``): those from the front stack as a list,
        then those from the ring as an array (None when the stack sufficed)."""
        front = self._front
        if n <= len(front):
            if n == 1:
                return [front.pop()], None
            taken = front[len(front) - n :]
            del front[len(front) - n :]
            taken.reverse()
            return taken, None
        taken = front[::-1]
        front.clear()
        return taken, self._pop_ring(n - len(taken))

    def _pop_ring(self, m: int) -> np.ndarray:
        ring, pos = self._ring, self._pos
        head, tail = self._head, self._tail
        parts: list[np.ndarray] = []
        while m:
            end = min(tail, head + 2 * m + 16)  # a few stale entries are usual; scan a margin
            window = ring[head:end]
            live = np.flatnonzero(pos[window] == np.arange(head, end))
            if len(live) >= m:
                live = live[:m]
                head += int(live[-1]) + 1
            else:
                head = end
            parts.append(window[live])
            m -= len(live)
        self._head = head
        out = parts[0] if len(parts) == 1 else np.concatenate(parts)
        pos[out] = _NOT_IN_RING
        self._num_ring -= len(out)
        return out

    def remove(self, block_ids: np.ndarray) -> None:
        """Take these blocks (each in the queue) out wherever they are."""
        pos = self._pos
        in_ring = pos[block_ids] != _NOT_IN_RING
        num_in_ring = int(np.count_nonzero(in_ring))
        if num_in_ring:
            pos[block_ids[in_ring]] = _NOT_IN_RING
            self._num_ring -= num_in_ring
        if num_in_ring < len(block_ids):  # in the front stack: rare (a stale match's blocks)
            for block_id in block_ids[~in_ring].tolist():
                self._front.remove(block_id)

    def ring_blocks(self) -> np.ndarray:
        """The ring's blocks, front first (a copy)."""
        head, tail = self._head, self._tail
        window = self._ring[head:tail]
        return window[self._pos[window] == np.arange(head, tail)]

    def to_list(self) -> list[int]:
        """The whole queue, front first. O(n): for tests, integrity checks and ``evict``."""
        return self._front[::-1] + self.ring_blocks().tolist()

    def _compact(self) -> None:
        """Move the live ring entries to the start of the array (at most ``num_blocks`` of them,
        so the array has room for any one push afterwards)."""
        live = self.ring_blocks()
        n = len(live)
        self._ring[:n] = live
        self._pos[live] = np.arange(n)
        self._head, self._tail = 0, n

    def check_integrity(self) -> str | None:
        """What is wrong with the queue's own bookkeeping, or None."""
        ring = self.ring_blocks()
        if len(ring) != self._num_ring:
            return f"the ring holds {len(ring)} live blocks but its counter says {self._num_ring}"
        listed = self._front + ring.tolist()
        if len(set(listed)) != len(listed):
            return "a block appears twice in the free queue"
        if any(self._pos[b] != _NOT_IN_RING for b in self._front):
            return "a block is both in the front stack and the ring"
        return None
