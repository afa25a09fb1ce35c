"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, per-request block tables.

GPU blocks hold the KV the model reads; an optional CPU pool (vLLM V0's ``--swap-space``) holds
the KV of requests preempted by swapping. The manager decides and counts; an executor that owns
real KV tensors only stores into the block ids ``SchedulerOutput`` gives it. The same object
drives the simulator and the PyTorch executor.

One manager class per kind (``kv/factory.py`` builds the one a policy declares): this plain one,
``HashedKVCacheManager`` (``kv/hashed.py``, vLLM's automatic prefix caching) and
``RadixKVCacheManager`` (``kv/radix_manager.py``, slots a radix tree it owns holds references
on). Each manager owns its prefix cache. Generic code asks a manager what it can do through the
class attributes ``prefix_caching`` (the scheduler registers hashed block keys),
``shares_prefixes`` (any prefix cache) and ``holds_by_table_length`` (``holds`` reads the table
length alone) and the ``can_drop_cached`` property, never by looking
inside it or testing its class. The prefix-cache methods here are the plain manager's answers: no
match, nothing to register, nothing cached.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:
    from tailserve.kv.hicache_spec import HiCacheSpec
    from tailserve.kv.host_tier import HostKVTier
    from tailserve.kv.prefix import PrefixCacheStats, PrefixMatch
    from tailserve.kv.radix import RadixCache
    from tailserve.kv.secondary_pool import SecondaryBlockPool


# Below this many ids a Python loop sets reference counts faster than numpy, whose fixed cost
# (~1.5 us: converting the ids, indexing) equals the loop's at ~48 ids of a typed array
# (measured r47, 2026-12-05: 32 ids 1.2 vs 1.7 us, 64 ids 3.1 vs 2.7 us).
_VECTOR_MIN = 48


def int64s(ids: Sequence[int]) -> np.ndarray:
    """``ids`` as an int64 numpy array (read-only; a typed array's own bytes). ``struct.pack``
    converts a list's ints at half the cost per id of ``np.fromiter`` (1,500 ids: 11 vs 19 us,
    r47), which a radix manager pays on every admission and release (its tables are lists)."""
    if isinstance(ids, array):
        return np.frombuffer(ids, dtype=np.int64)
    return np.frombuffer(struct.pack(f"{len(ids)}q", *ids), dtype=np.int64)


# ``registers_from``'s answer for a request absent from it: above any token count.
NEVER = 1 << 62


class KVCacheIntegrityError(AssertionError):
    """Raised by ``check_integrity`` with the numbers that do not add up."""


class KVCacheManager:
    """GPU KV blocks of ``block_size`` tokens each, handed out to requests by id."""

    prefix_caching: ClassVar[bool] = False  # hashed full-block keys (the scheduler registers them)
    # One-token blocks kept in typed arrays (``__init__``): tables, the free stack, the slots a
    # radix tree keeps. False for a subclass whose blocks other structures hold as lists.
    typed_slots: ClassVar[bool] = True
    shares_prefixes: ClassVar[bool] = False  # some prefix cache shares blocks between requests
    # ``holds`` answers from the length of the request's table alone (a policy's per-request
    # loop may read ``block_tables`` itself); a manager that overrides ``holds`` says False.
    holds_by_table_length: ClassVar[bool] = True
    # vLLM's CPU offloading tier (``kv/host_tier.py``): only the hashed manager has one.
    host: HostKVTier | None = None
    # TensorRT-LLM's secondary (host) block pool (``kv/secondary_pool.py``): only the hashed
    # manager has one.
    secondary: SecondaryBlockPool | None = None
    # SGLang's HiCache host tier behind the radix tree (``kv/hiradix_manager.py``): only that
    # manager has one.
    hicache: HiCacheSpec | None = None

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
        # With one-token blocks (SGLang's slots) the plain manager keeps its ids in typed
        # arrays: slicing and extending them copies machine integers, where lists touch one int
        # object per slot, scattered in memory (~20% of an SGLang simulation). Not for larger
        # blocks: an array reallocates whenever it shrinks by 16 or more entries, which costs
        # more there than the few int objects a block table holds. A subclass says whether its
        # tables may be typed (``typed_slots``: the radix one, whose tree keeps slices of them).
        self._compact = self.typed_slots and block_size == 1
        # The compact stack's height: its free ids are ``_free[:_top]`` (None: a list stack, all
        # of it free). The typed array keeps its length, because CPython reallocates an array
        # that shrinks by 16 or more entries: SGLang's ~6 MB pool was moved by ``mremap`` in
        # nearly every decode run (3,078 times in a 2,000-request run; kernel time, r41).
        self._top: int | None = None
        if self._compact:
            # The same ids from numpy's bytes: ``array("q", range(...))`` converts each int
            # through ``PyArg_Parse`` (~300 instructions an id; SGLang's pools hold ~800k
            # slots: 13% of a 2,000-request simulation's instructions went here).
            ids = np.arange(num_blocks - 1, -1, -1, dtype=np.int64)
            self._free: list[int] = array("q", ids.tobytes())  # type: ignore[assignment]
            self._top = num_blocks
        else:
            self._free = list(range(num_blocks - 1, -1, -1))
        # Until something shares a block every held block has exactly one reference, its
        # request's, so the counts are not kept until something asks for them (``_live_refs``:
        # the radix subclass when its tree is built, check_integrity): writing one count per
        # block on every allocate and free was the simulator's hottest loop with SGLang's
        # one-token slots, and a radix manager whose requests carry no token ids never builds
        # its tree (sim_memory's prompts: ~0.25 ms a request converting tables for the counts,
        # r48); the hashed subclass keeps its own in its pool. Once kept they are a typed array
        # (machine integers), so a request's whole table is released by numpy in one gather and
        # one scatter (``_unref``): the per-slot loop over an SGLang table (mean 1,585 slots on
        # sim_memory's prompts) cost ~0.46 ms a request (r47).
        self._refs: array | None = None
        self.block_tables: dict[str, list[int]] = {}
        # request id -> the fewest computed tokens for which ``register_computed`` can make
        # anything matchable; a request absent from it registers nothing whatever it is called
        # with. The hashed manager keeps it; a plain manager registers nothing (an empty dict);
        # None where any call may register (a radix tree inserts tokens). Per-step callers test
        # it before calling (vLLM's async pass: ``Scheduler.update_advanced``).
        self.registers_from: dict[str, int] | None = {}
        self.num_cpu_blocks = num_cpu_blocks
        self._cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.cpu_block_tables: dict[str, list[int]] = {}

    def _new_table(self) -> list[int]:
        """An empty block table (a typed array in the plain manager: it reads like a list)."""
        return array("q") if self._compact else []  # type: ignore[return-value]

    def _live_refs(self) -> array:
        """The reference counts the manager keeps (a typed array, one per GPU block; change
        them in place); counted from the tables the first time they are asked for, kept from
        then on."""
        refs = self._refs
        if refs is None:
            counts = [0] * self.num_blocks
            for table in self.block_tables.values():
                for block_id in table:
                    counts[block_id] += 1
            refs = self._refs = array("q", counts)
        return refs

    @property
    def _ref_counts(self) -> list[int]:
        """Reference count per GPU block, a list copy (for checks; ``_live_refs`` to change
        them)."""
        return self._live_refs().tolist()

    def free_block_count(self) -> int:
        """Blocks an allocation can take (with prefix caching: free plus evictable cached); the
        one definition, which ``num_free_blocks`` reads and a subclass overrides. A method for
        the simulator's loop, which reads the count a few times an event (the policies' passes,
        every fast path): a property read passes through C (``property_descr_get``, ~950
        instructions, which Python 3.11 does not specialise; 2.4% of a Sarathi loop), a method
        call stays in the interpreter."""
        top = self._top
        return len(self._free) if top is None else top

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take (``free_block_count``)."""
        return self.free_block_count()

    def free_ids(self) -> list[int]:
        """The free stack, bottom first (the next allocation takes from the end)."""
        top = self._top
        return list(self._free) if top is None else list(self._free[:top])

    def used_block_count(self) -> int:
        """Blocks not free (``num_used_blocks``; a method for the same reason as
        ``free_block_count``)."""
        return self.num_blocks - self.free_block_count()

    @property
    def num_used_blocks(self) -> int:
        return self.used_block_count()

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu_free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def num_held(self, request_id: str) -> int:
        table = self.block_tables.get(request_id)
        return len(table) if table else 0

    def num_blocks_needed(self, request_id: str, num_total_tokens: int) -> int:
        """New blocks ``request_id`` needs so that it can hold ``num_total_tokens`` tokens."""
        # ``blocks_for`` less ``num_held``, without the two calls and ``max`` (the builtin parses
        # its arguments as keywords): every admission's KV check asks this.
        table = self.block_tables.get(request_id)
        need = -(-num_total_tokens // self.block_size) - (len(table) if table else 0)
        return need if need > 0 else 0

    def can_allocate(self, request_id: str, num_total_tokens: int, reserve: int = 0) -> bool:
        return self.num_blocks_needed(request_id, num_total_tokens) + reserve <= self.free_block_count()

    def allocate(self, request_id: str, num_total_tokens: int) -> list[int] | None:
        """Grow the request's block table to hold ``num_total_tokens`` tokens.

        Returns the newly allocated block ids (possibly empty), or None when there is no room;
        on None nothing changed. Read the ids, do not change or keep them: for a request's
        first blocks in the compact (one-token-slot) manager they are its table itself.
        """
        table = self.block_tables.get(request_id)
        held = len(table) if table is not None else 0
        need = -(-num_total_tokens // self.block_size) - held
        if need <= 0:
            if table is None:
                self.block_tables[request_id] = self._new_table()
            return []
        free = self._free
        top = self._top  # the compact stack's height (None: a list stack, all of it free)
        if need > (len(free) if top is None else top):
            return None
        if top is None:
            new = free[-need:]
            del free[-need:]
        else:  # the compact stack: its height moves, the array stays
            new = free[top - need : top]
            self._top = top - need
        refs = self._refs
        if refs is not None:
            if need < _VECTOR_MIN:
                for block_id in new:
                    refs[block_id] = 1
            else:  # an admission (a radix manager's prompt: a slot a token)
                np.frombuffer(refs, dtype=np.int64)[int64s(new)] = 1
        if table is None:
            if top is not None:
                # A new request's slots in the compact stack (an SGLang admission, ~1,000 ids)
                # are the slice itself, not copied a second time into an empty table; returned
                # as it is, which the caller reads and does not keep, as any result here.
                self.block_tables[request_id] = new
                return new
            table = self.block_tables[request_id] = self._new_table()
        table.extend(new)
        return new

    def allocate_each(self, request_ids: Sequence[str], num_total_tokens: Sequence[int]) -> None:
        """``allocate`` for each request in order (each already holds a table), where the
        caller knows every one fits (the simulator's runs checked the free blocks first). A
        manager whose ``allocate`` is this one's (the plain one, the radix one: its tree takes
        nothing on allocation) hands each request the ids its own ``allocate`` would have taken, sliced
        straight off its free stack, and cuts the stack once: this runs once per decode run and
        showed in every one (SGLang's one-token slots above all). A caller that broke the
        precondition gets a RuntimeError and a manager whose tables hold blocks still listed
        free: a bug to fix, not a state to go on from."""
        if type(self).allocate is not KVCacheManager.allocate:  # caches or evicts per allocation
            for request_id, total in zip(request_ids, num_total_tokens):
                if self.allocate(request_id, total) is None:
                    raise RuntimeError(f"allocate_each: no room for {request_id}")
            return
        tables = self.block_tables
        block_size = self.block_size
        free = self._free
        # ``allocate`` takes from the top of the stack: the first request the topmost ids. One
        # pass, each table extended straight from the stack, which is cut once at the end.
        top = self._top
        end = len(free) if top is None else top
        if block_size == 1:
            # SGLang's one-token slots need no rounding: the three int operations of the
            # rounding allocate an int object each (counts past 256), for every decode per run;
            # a loop of its own, without the test per request.
            for request_id, total in zip(request_ids, num_total_tokens):
                table = tables[request_id]
                need = total - len(table)
                if need > 0:
                    if need > end:
                        raise RuntimeError(
                            f"allocate_each: no room for {request_id} ({need} blocks, {end} left)"
                        )
                    table += free[end - need : end]
                    end -= need
        else:
            for request_id, total in zip(request_ids, num_total_tokens):
                table = tables[request_id]
                need = -(-total // block_size) - len(table)
                if need == 1 and end:
                    # The common case (a run shorter than a block): the id itself, no slice.
                    end -= 1
                    table.append(free[end])
                elif need > 0:
                    if need > end:
                        raise RuntimeError(
                            f"allocate_each: no room for {request_id} ({need} blocks, {end} left)"
                        )
                    table += free[end - need : end]
                    end -= need
        height = len(free) if top is None else top
        if end == height:
            return  # nothing taken
        refs = self._refs
        if refs is not None:
            taken = free[end:height]
            if height - end < _VECTOR_MIN:
                for block_id in taken:
                    refs[block_id] = 1
            else:
                np.frombuffer(refs, dtype=np.int64)[int64s(taken)] = 1
        if top is None:
            del free[end:]
        else:
            self._top = end  # the compact stack: cut by its height

    def free(self, request_id: str, num_computed_tokens: int = 0, finished: bool = False) -> int:
        """Release every block the request holds (GPU and CPU); returns how many GPU blocks
        reached ref count 0. ``num_computed_tokens`` (its tokens with KV) and ``finished`` (it
        finished, as opposed to being preempted, aborted or put back) tell a radix cache what to
        keep of it first; the other kinds ignore them."""
        cpu = self.cpu_block_tables.pop(request_id, None)
        if cpu:
            self._cpu_free.extend(reversed(cpu))
        table = self.block_tables.pop(request_id, None)
        if not table:
            return 0
        return self._release(table)

    def detach(self, request_id: str, key: str) -> None:
        """Move the request's GPU blocks, still referenced, to the table ``key`` (freed later by
        ``free(key)``): the request holds none from now (vLLM's ``pop_blocks_for_free``)."""
        table = self.block_tables.pop(request_id, None)
        if table:
            self.block_tables[key] = table

    def _release(self, table: list[int]) -> int:
        """Drop one reference on each block of ``table`` (tail first); returns how many reached
        ref count 0."""
        if self._refs is None:  # one reference each: every block is released, tail first as below
            free = self._free
            top = self._top
            if top is not None:
                # Written back above the stack's height, reversed by numpy (a typed array's
                # ``[::-1]`` calls ``memcpy`` once per id), in one strided copy.
                end = top + len(table)
                np.frombuffer(free, dtype=np.int64)[top:end] = np.frombuffer(table, dtype=np.int64)[::-1]
                self._top = end
            else:
                free.extend(table[::-1])
            return len(table)
        # Tail first, like vLLM: the end of a sequence is the least likely to be shared.
        return self._unref(int64s(table)[::-1])

    def _unref(self, ids: np.ndarray) -> int:
        """Drop one reference on each block of ``ids`` (distinct ids, as in a block table or a
        tree node); the blocks that reach ref count 0 go onto the free stack in the order of
        ``ids``. Returns how many did. Vectorised: one gather, one scatter and one push for the
        whole table, where a loop paid ~0.3 us a slot (an SGLang request held 1,585 on average
        on sim_memory's prompts, r47)."""
        refs = np.frombuffer(self._refs, dtype=np.int64)
        left = refs[ids] - 1
        refs[ids] = left  # distinct ids: each count drops by exactly one
        zero = ids[left == 0]
        n = len(zero)
        top = self._top
        if top is None:
            self._free.extend(zero.tolist())
        elif n:
            np.frombuffer(self._free, dtype=np.int64)[top : top + n] = zero
            self._top = top + n
        return n

    # ---- prefix caching: the plain manager has none (hashed and radix managers override) ----
    # The prefix cache is the manager's own (built with it from the policy's ``KVSpec``); a
    # policy reaches these through ``Scheduler`` (``cached_prefix``, ``allocate_with_cached_prefix``,
    # ``cache_computed``, ...), never by looking inside a manager or asking which class it is.
    def set_host_range(self, request_id: str, num_prompt_tokens: int) -> None:
        """The prompt blocks a request may offload to the CPU tier (only a manager with one)."""

    def host_preempted(self, request_id: str) -> None:
        """The request was preempted in this pass (only a manager with a CPU tier: no store)."""

    def host_finished(self, request_id: str, num_tokens: int) -> None:
        """The request left with ``num_tokens`` of its prompt computed (only a manager with a
        CPU tier: its last offer to it)."""

    def set_prefix_keys(self, request_id: str, keys: list, token_ids: Sequence[int] | None = None) -> None:
        """The request's prefix keys (hashed: full-block content keys, set by the scheduler at
        arrival; radix: the keys the engine's tree uses, set by the policy); ignored here."""

    def forget_prefix_keys(self, request_id: str) -> None:
        """The request left; a manager with a prefix cache forgets its keys."""

    def match_prefix(self, request_id: str, num_tokens: int) -> PrefixMatch | None:
        """Longest cached prefix of the request, capped so at least one of its ``num_tokens``
        tokens is computed; None here (no prefix cache)."""
        return None

    def allocate_with_prefix(
        self, request_id: str, match: PrefixMatch, num_total_tokens: int, limit: int | None = None
    ) -> bool:
        """Take the match's cached blocks and allocate the rest up to ``num_total_tokens``;
        False when that does not fit. Without a prefix cache there is no match to take.
        ``limit``: a radix cache's cap on what ``register_computed`` inserts."""
        return self.allocate(request_id, num_total_tokens) is not None

    def register_computed(self, request_id: str, num_computed_tokens: int) -> None:
        """Make the request's computed blocks matchable (hashed: full blocks registered under
        their keys; radix: tokens inserted into the tree); nothing to do here."""

    def num_registered(self, request_id: str) -> int:
        """Leading blocks of the request's table registered in a prefix cache."""
        return 0

    def holds(self, request_id: str, num_total_tokens: int) -> bool:
        """True when ``allocate(request_id, num_total_tokens)`` would change nothing: the
        request's blocks already hold the tokens (a hashed manager says False: a block that
        fills must still be registered)."""
        table = self.block_tables.get(request_id)
        return table is not None and len(table) * self.block_size >= num_total_tokens

    def host_tier_report(self) -> tuple[dict[str, Any], str] | None:
        """A host tier's figures for the run's JSON (``prefix_cache.cpu_tier``) and its note line;
        None without one (vLLM's CPU tier, TensorRT-LLM's host pool, SGLang's HiCache)."""
        return None

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Lookups, hits and evictions of the prefix cache; None without one."""
        return None

    def num_cached_prefix(self, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` cached now (a router's look, not counted as a lookup)."""
        return 0

    def num_reusable_tokens(self, request_id: str, num_tokens: int) -> int:
        """Tokens of the request's first ``num_tokens`` that a first chunk would find reusable
        now (cached leading blocks, at least one token left to compute); not counted as a
        lookup. 0 here (no prefix cache)."""
        return 0

    def new_context_block(self, request_id: str, num_tokens: int) -> int | None:
        """The key of the first of the request's full blocks (of its first ``num_tokens`` tokens)
        that is not cached now, or None when all are cached or it has no keys (TensorRT-LLM's
        ``findNewContextBlock``); not counted as a lookup. None here (no prefix cache)."""
        return None

    def take_kv_events(self) -> list[tuple]:
        """vLLM-style KV events (stored / removed blocks) since the last call; recording starts
        with the first call. None are recorded without hashed prefix caching."""
        return []

    def drop_cached(self) -> None:
        """Forget every cached block nobody holds (after a failed step, none may be matched)."""

    @property
    def can_drop_cached(self) -> bool:
        """True when ``drop_cached`` leaves nothing of a failed step matchable, so an engine can
        abort that step's requests and go on (False: a radix tree holds slots it never wrote)."""
        return True

    # radix-tree questions (``RadixKVCacheManager``); without a tree: nothing cached, no locks.
    @property
    def radix_tree(self) -> RadixCache | None:
        """The radix tree this manager owns, if any (read it; only the manager changes it)."""
        return None

    def prefix_keys(self, request_id: str, num_keys: int | None = None) -> list | None:
        return None

    def match_whole_prefix(self, request_id: str, num_tokens: int) -> PrefixMatch | None:
        return None

    def peek_prefix(self, request_id: str, num_tokens: int) -> tuple[int, int]:
        return 0, 0

    def lock_prefix(self, match: PrefixMatch) -> None:
        """Protect a match from eviction until ``unlock_prefix``."""

    def unlock_prefix(self, match: PrefixMatch) -> None:
        """Undo one ``lock_prefix``."""

    def holds_prefix(self, request_id: str) -> bool:
        return False

    @property
    def evictable_tokens(self) -> int:
        """Cached tokens nobody holds, which an allocation may evict."""
        return 0

    def evict_cached(self, num_blocks: int) -> None:
        """Evict at least ``num_blocks`` blocks of unheld cache (least recently used first)."""

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
        pairs = list(zip(table, cpu))
        self._release(table)
        return pairs

    def can_swap_in(self, request_id: str, reserve: int = 0) -> bool:
        return len(self.cpu_block_tables.get(request_id, ())) + reserve <= self.free_block_count()

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
        free = self.free_ids()
        if len(set(free)) != len(free):
            raise KVCacheIntegrityError("a block id appears twice in the free list")
        counted = [0] * self.num_blocks
        for table in self.block_tables.values():
            for block_id in table:
                counted[block_id] += 1
        for block_id, n in self._external_refs().items():
            counted[block_id] += n
        refs = self._ref_counts  # a copy: taken once
        for block_id in free:
            if counted[block_id] or refs[block_id]:
                raise KVCacheIntegrityError(
                    f"block {block_id} is free but referenced (tables and other owners: {counted[block_id]}, "
                    f"ref count: {refs[block_id]})"
                )
        if counted != refs:
            bad = next(i for i, (a, b) in enumerate(zip(counted, refs)) if a != b)
            raise KVCacheIntegrityError(
                f"block {bad}: ref count {refs[bad]} but {counted[bad]} references from tables and other owners"
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
