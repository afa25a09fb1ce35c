"""The block pool's content index for Mooncake keys: one entry per trace block, not per block.

A Mooncake trace block (512 tokens) is ``per`` pool blocks (32 at block size 16), and the keys
``prefix.keys_from_hash_ids`` gives them are fixed by the trace block's first key and their
place in it: prompts that share a trace block's first key share all of its keys (the keys are
chained, so the first key names every trace block up to this one). This index keeps one dict
entry per trace block — its first key (the *head*) -> a row of ``per`` slots, slot ``s`` holding
the oldest block that holds the key at place ``s``, or ``NO_BLOCK`` — and each block's row and
slot in flat arrays (as one *cell*, ``row * per + slot``). A request's ~750 blocks go in and
come out with ~24 dict operations and a few array operations instead of ~750 dict operations
each way; those (cache misses into 16 pools' tables) were half the CPU of a 16-replica cluster
run on the Mooncake trace.

What it holds is exactly what ``BlockIndex`` holds — each key's holders, oldest first — only laid
out differently, so every hit, eviction and KV event is the same:

- vLLM evicts pool blocks one at a time from the free queue's head, so a trace block can be
  partly cached: a slot is empty while later slots still hold blocks. A hit walk stops at the
  first empty slot, as the per-key walk stops at the first key nobody holds.
- A key computed twice at once (two requests prefilling the same prefix) has later holders;
  they are listed in ``_more`` by key, as ``BlockIndex`` does, and ``_extra`` counts them per
  slot, so removal looks a block up in ``_more`` only when its slot has later holders.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tailserve.kv.block_index import NO_KEY

NO_BLOCK = -1  # an empty slot, or a block this index does not hold
_NO_POSITIONS = np.empty(0, dtype=np.int64)


class TraceBlockIndex:
    def __init__(self, num_blocks: int, per: int) -> None:
        if per < 2:
            raise ValueError(f"a trace block spans at least 2 pool blocks here, got {per}")
        self.per = per
        self._row_of: dict[int, int] = {}  # head key -> row
        self._heads: list[int] = []  # row -> its head key (a free row keeps its last one)
        self._free_rows: list[int] = []
        rows = 64  # grows by doubling; ~1 row per 32 cached blocks
        # per cell (row * per + slot): the first holder, and how many later holders there are
        self._holder = np.full(rows * per, NO_BLOCK, dtype=np.int64)
        self._extra = np.zeros(rows * per, dtype=np.int32)
        self._count = np.zeros(rows, dtype=np.int64)  # slots with a holder; 0: the row is free
        self._cell = np.full(num_blocks, NO_BLOCK, dtype=np.int64)  # block -> its cell
        self._more: dict[int, list[int]] = {}  # key -> later holders, oldest first

    def holds(self, block_ids: np.ndarray) -> np.ndarray:
        """Which of the blocks are indexed here (a boolean mask)."""
        return self._cell[block_ids] != NO_BLOCK

    # ---- lookup -------------------------------------------------------------------------------
    def first_holders(self, keys: Sequence[int], max_blocks: int) -> list[int]:
        """The first holder of each of ``keys[:max_blocks]`` (a request's keys from position 0),
        up to the first key nobody holds."""
        per = self.per
        row_of, holder, count = self._row_of, self._holder, self._count
        found: list[int] = []
        for start in range(0, max_blocks, per):
            row = row_of.get(keys[start])
            if row is None:
                break
            cut = min(per, max_blocks - start)
            slots = holder[row * per : row * per + cut].tolist()
            # count[row] == per: the whole trace block is cached (the usual case), no gap to find
            if count[row] < per and NO_BLOCK in slots:
                found += slots[: slots.index(NO_BLOCK)]
                break
            found += slots
        return found

    def prefix_length(self, keys: Sequence[int]) -> int:
        """How many leading keys of ``keys`` (a request's, from position 0) are held."""
        per = self.per
        row_of, holder, count = self._row_of, self._holder, self._count
        n = len(keys)
        found = 0
        for start in range(0, n, per):
            row = row_of.get(keys[start])
            if row is None:
                break
            cut = min(per, n - start)
            if count[row] < per:  # partly cached: the walk stops at its first empty slot
                slots = holder[row * per : row * per + cut].tolist()
                if NO_BLOCK in slots:
                    return found + slots.index(NO_BLOCK)
            found += cut
        return found

    # ---- insert -------------------------------------------------------------------------------
    def add(self, block_ids: np.ndarray, keys: Sequence[int], positions: np.ndarray) -> np.ndarray:
        """Index blocks that were just given keys: ``block_ids[i]`` holds ``keys[positions[i]]``
        (``keys``: the request's whole key list; ``positions`` ascending). Returns the indices
        ``i`` whose key already had a holder (it becomes a later holder)."""
        per = self.per
        groups = positions // per
        slots = positions - groups * per
        first, last = int(groups[0]), int(groups[-1])
        if int(positions[-1]) - int(positions[0]) + 1 == len(positions):  # one span: every group
            heads = range(first, last + 1)
            where = groups - first
        else:  # blocks skipped (already cached): only the groups that have one
            heads, where = np.unique(groups, return_inverse=True)
            heads = heads.tolist()
        rows = np.asarray(self._rows_for([keys[g * per] for g in heads]), dtype=np.int64)
        cells = (rows * per)[where] + slots
        holder = self._holder
        self._cell[block_ids] = cells
        clash = holder[cells] != NO_BLOCK
        if not clash.any():
            holder[cells] = block_ids
            self._count[rows] += np.bincount(where, minlength=len(rows))
            return _NO_POSITIONS
        fresh = ~clash
        holder[cells[fresh]] = block_ids[fresh]
        self._count[rows] += np.bincount(where[fresh], minlength=len(rows))
        self._extra[cells[clash]] += 1  # distinct cells: one key each
        clashes = np.flatnonzero(clash)
        more = self._more
        for i in clashes.tolist():
            more.setdefault(keys[int(positions[i])], []).append(int(block_ids[i]))
        return clashes

    def _rows_for(self, heads: list[int]) -> list[int]:
        """The row of each trace block, given by its head key; new rows for new ones."""
        row_of = self._row_of
        rows = []
        for head in heads:
            row = row_of.get(head)
            if row is None:
                if self._free_rows:
                    row = self._free_rows.pop()
                    self._heads[row] = head
                else:
                    row = len(self._heads)
                    self._heads.append(head)
                    if row == len(self._count):
                        self._grow()
                row_of[head] = row
            rows.append(row)
        return rows

    def _grow(self) -> None:
        """Twice the rows: the new ones empty."""
        n = len(self._count)
        self._holder = np.concatenate([self._holder, np.full(n * self.per, NO_BLOCK, dtype=np.int64)])
        self._extra = np.concatenate([self._extra, np.zeros(n * self.per, dtype=np.int32)])
        self._count = np.concatenate([self._count, np.zeros(n, dtype=np.int64)])

    # ---- remove -------------------------------------------------------------------------------
    def remove(self, block_ids: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """The blocks (each indexed here) lose their keys, in this order; a key with later
        holders hands over to the next one. Returns a mask of the keys no block holds any more."""
        cells = self._cell[block_ids]
        self._cell[block_ids] = NO_BLOCK
        gone = np.ones(len(block_ids), dtype=bool)
        if self._more:
            shared = np.flatnonzero(self._extra[cells] > 0)
            if len(shared):
                # A slot with later holders: walk those blocks in order (the second of two
                # holders removed in one call finds the slot already handed over to it).
                left = np.ones(len(block_ids), dtype=bool)
                for i in shared.tolist():
                    if self._remove_shared(int(block_ids[i]), int(keys[i]), int(cells[i])):
                        gone[i] = False
                        left[i] = False
                cells = cells[left]
        if not len(cells):
            return gone
        self._holder[cells] = NO_BLOCK
        # per-row counts over every row in use (~1 per 32 cached blocks): cheaper than sorting
        used = len(self._heads)
        lost = np.bincount(cells // self.per, minlength=used)
        count = self._count[:used]
        count -= lost
        emptied = np.flatnonzero((count == 0) & (lost > 0))
        if len(emptied):
            row_of, heads = self._row_of, self._heads
            for row in emptied.tolist():
                del row_of[heads[row]]
            self._free_rows += emptied.tolist()
        return gone

    def _remove_shared(self, block_id: int, key: int, cell: int) -> bool:
        """Remove one block from a slot that had later holders when the call began. True when
        the key is still held; False when this was its last holder (the caller empties the slot)."""
        others = self._more.get(key)
        if others is None:  # handed over to this block earlier in the same call: the last one
            return False
        if self._holder[cell] == block_id:
            self._holder[cell] = others.pop(0)
        else:
            others.remove(block_id)
        self._extra[cell] -= 1
        if not others:
            del self._more[key]
        return True

    # ---- checks -------------------------------------------------------------------------------
    def check_integrity(self, block_keys: list[int]) -> str | None:
        """What is wrong, or None: every row is under its head, counts its holders, every holder
        has the slot's key and is indexed at that slot, one slot per key, and every block this
        index claims is a holder."""
        per = self.per
        holder = self._holder.reshape(-1, per).tolist()
        extra = self._extra.reshape(-1, per).tolist()
        slot_of_key: dict[int, tuple[int, int]] = {}
        indexed = 0
        for head, row in self._row_of.items():
            if self._heads[row] != head:
                return f"row {row} is under head {head!r} but names {self._heads[row]!r}"
            held = [b for b in holder[row] if b != NO_BLOCK]
            if not held or len(held) != self._count[row]:
                return f"row {row} holds {len(held)} blocks but counts {self._count[row]}"
            for slot, first in enumerate(holder[row]):
                if first == NO_BLOCK:
                    if extra[row][slot]:
                        return f"row {row} slot {slot} is empty but counts later holders"
                    continue
                key = block_keys[first]
                if key == NO_KEY:
                    return f"block {first} is indexed at row {row} slot {slot} without a key"
                if key in slot_of_key:
                    return f"key {key!r} is at {slot_of_key[key]} and at {(row, slot)}"
                slot_of_key[key] = (row, slot)
                holders = [first, *self._more.get(key, ())]
                if len(holders) - 1 != extra[row][slot] or len(set(holders)) != len(holders):
                    return f"key {key!r} has holders {holders} but its slot counts {extra[row][slot]} more"
                for block_id in holders:
                    if block_keys[block_id] != key:
                        return (
                            f"block {block_id} is indexed under {key!r} but has key {block_keys[block_id]!r}"
                        )
                    if self._cell[block_id] != row * per + slot:
                        return f"block {block_id} holds row {row} slot {slot} but points elsewhere"
                indexed += len(holders)
        if set(self._more) - set(slot_of_key):
            return f"keys {sorted(set(self._more) - set(slot_of_key))[:5]} have later holders but no slot"
        claimed = int(np.count_nonzero(self._cell != NO_BLOCK))
        if claimed != indexed:
            return f"{claimed} blocks point at a row but {indexed} are holders"
        if len(self._row_of) + len(self._free_rows) != len(self._heads):
            return f"{len(self._row_of)} rows in use + {len(self._free_rows)} free != {len(self._heads)}"
        return None
