"""``HashedKVCacheManager``: paged KV whose GPU blocks live in vLLM's hashed block pool.

vLLM's automatic prefix caching (``kv/block_pool.py``): full prompt blocks are registered under
content keys as they are computed, freed blocks stay cached in an LRU free queue until reused,
and ``match_prefix`` finds a request's longest cached chain. Keys come from the prompt's token
ids, or from Mooncake-style ``prefix_block_hashes`` (``kv/prefix.py``; the scheduler computes
them at arrival and hands them over with ``set_prefix_keys``); a request with neither never
shares. The pool owns free blocks and reference counts; this class keeps the block tables, the
CPU swap pool (inherited) and which leading blocks of each table are registered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from tailserve.kv.block_pool import HashedBlockPool
from tailserve.kv.host_tier import HostKVTier
from tailserve.kv.paged import KVCacheIntegrityError, KVCacheManager
from tailserve.kv.prefix import PrefixCacheStats, PrefixMatch
from tailserve.kv.secondary_pool import SecondaryBlockPool


class HashedKVCacheManager(KVCacheManager):
    prefix_caching: ClassVar[bool] = True
    shares_prefixes: ClassVar[bool] = True
    typed_slots: ClassVar[bool] = False  # its pool and hashes hold block ids as lists
    holds_by_table_length: ClassVar[bool] = False  # ``holds`` below: always False

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        host: HostKVTier | None = None,
        secondary: SecondaryBlockPool | None = None,
    ) -> None:
        super().__init__(num_blocks, block_size, num_cpu_blocks)
        # vLLM's CPU offloading tier behind the pool (``kv/host_tier.py``), None without one;
        # with it, per request with keys, block indexes: [the first it stores (past its hits),
        # its prompt's full blocks (none past them is offloaded), the first past its GPU hit].
        self.host = host
        self._host_range: dict[str, list[int]] = {}
        # per request: the block indexes it loaded, or offered to the tier while there or stored
        # (vLLM's per-request cache accesses, made newest when it finishes), in insertion order
        self._host_seen: dict[str, dict[int, None]] = {}
        self.pool = HashedBlockPool(num_blocks, block_size)
        # TensorRT-LLM's secondary (host) pool, None without one: the blocks an allocation
        # evicts go there (kv/secondary_pool.py); ``secondary_lookup`` and ``onboard`` below.
        self.secondary = secondary
        if secondary is not None:
            self.pool.on_evict = secondary.offload
        self._free = []  # unused: the pool owns free blocks and ref counts
        self._keys: dict[str, list[int]] = {}  # request id -> full-block keys
        # request id -> the token ids its keys were made from (KV events' ``token_ids``)
        self._tokens: dict[str, Sequence[int]] = {}
        self._num_registered: dict[str, int] = {}  # request id -> blocks registered in the pool
        # ``registers_from`` (the base class's): one block past those registered, for a request
        # with keys left to register (``_set_registered``). vLLM's async pass and its update ask
        # to register once per request per step, while a block fills once in ``block_size``
        # steps (or never: a request without keys); testing this first is a dict lookup instead
        # of two Python calls (1,777,077 calls in a 5,000-request run, issue 35).
        self.registers_from: dict[str, int] = {}

    def free_block_count(self) -> int:
        """Free plus evictable cached blocks: what an allocation can take."""
        return self.pool.num_free_blocks

    def host_tier_report(self) -> tuple[dict[str, Any], str] | None:
        tier = self.host if self.host is not None else self.secondary
        return (tier.summary(), tier.note()) if tier is not None else None

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.pool.stats

    def allocate(self, request_id: str, num_total_tokens: int) -> list[int] | None:
        table = self.block_tables.get(request_id)
        held = len(table) if table is not None else 0
        need = -(-num_total_tokens // self.block_size) - held
        if need <= 0:
            if table is None:
                self.block_tables[request_id] = []
            return []
        new_blocks = self.pool.allocate(need)
        if new_blocks is None:
            return None
        self.block_tables.setdefault(request_id, []).extend(new_blocks)
        return new_blocks

    def free(self, request_id: str, num_computed_tokens: int = 0, finished: bool = False) -> int:
        if self._keys:
            self._set_registered(request_id, 0)
        else:  # no request has keys, so ``registers_from`` is empty (a call less per request)
            self._num_registered.pop(request_id, None)
        return super().free(request_id)

    def detach(self, request_id: str, key: str) -> None:
        if self._keys:
            self._set_registered(request_id, 0)
        else:
            self._num_registered.pop(request_id, None)
        super().detach(request_id, key)

    def _release(self, table: list[int]) -> int:
        before = self.pool.num_free_blocks
        self.pool.free(table)  # tail first; cached blocks stay matchable until reused
        return self.pool.num_free_blocks - before

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        pairs = super().swap_out(request_id)
        if pairs is not None:
            self._set_registered(request_id, 0)
        return pairs

    def drop_cached(self) -> None:
        self.pool.evict(self.pool.num_evictable)

    def num_cached_prefix(self, keys: Sequence[int]) -> int:
        return self.pool.num_cached_prefix(keys)

    def new_context_block(self, request_id: str, num_tokens: int) -> int | None:
        keys = self._keys.get(request_id)
        if not keys:
            return None
        full = min(len(keys), num_tokens // self.block_size)
        cached = self.pool.num_cached_prefix(keys)  # the whole sequence: Mooncake keys index apart
        if self.secondary is not None and cached < full:
            # findNewContextBlock walks the reuse tree, whose blocks may be in host memory
            cached += self.secondary.lookup(keys, cached, full)
        # A chain key names its whole prefix, so two requests share it exactly when they share
        # every block up to it (TensorRT-LLM's BlockKey accumulates those tokens the same way).
        return keys[cached] if cached < full else None

    def num_reusable_tokens(self, request_id: str, num_tokens: int) -> int:
        """Tokens of the request's first ``num_tokens`` that a first chunk would find reusable now
        (TensorRT-LLM's estimated reusable tokens): its cached leading blocks, then the host
        pool's right after them, capped as the match at admission is (at least one token
        computed); not counted as a lookup."""
        keys = self._keys.get(request_id)
        if not keys:
            return 0
        cap = min(len(keys), max(num_tokens - 1, 0) // self.block_size)
        cached = min(self.pool.num_cached_prefix(keys), cap)
        if self.secondary is not None and cached < cap:
            cached += self.secondary.lookup(keys, cached, cap)
        return cached * self.block_size

    def take_kv_events(self) -> list[tuple]:
        return self.pool.take_events()

    # ---- prefix caching ---------------------------------------------------------------------
    def set_prefix_keys(
        self, request_id: str, keys: list[int], token_ids: Sequence[int] | None = None
    ) -> None:
        """The request's full-block content keys (``prefix.block_hashes`` or
        ``keys_from_hash_ids``); without keys a request neither hits nor registers blocks.
        ``token_ids``: the tokens the keys were made from, block after block, when known; the
        pool's KV events then carry each stored block's tokens, as vLLM's do."""
        self._keys[request_id] = keys
        if token_ids is not None:
            self._tokens[request_id] = token_ids
        self._set_registered(request_id, self._num_registered.get(request_id, 0))

    def forget_prefix_keys(self, request_id: str) -> None:
        if self._host_range:
            # The scheduler calls ``host_finished`` first with what the request computed; here
            # (no one did) it offers nothing more, only makes its chunks newest.
            self.host_finished(request_id, 0)
        if self._keys:
            self._keys.pop(request_id, None)
            self.registers_from.pop(request_id, None)
        if self._tokens:
            self._tokens.pop(request_id, None)

    def match_prefix(self, request_id: str, num_tokens: int) -> PrefixMatch | None:
        """Longest cached chain of the request's blocks, capped so at least one of its
        ``num_tokens`` tokens is computed; None without keys. Counts a query in the pool's
        stats; changes nothing else."""
        keys = self._keys.get(request_id)
        if not keys:
            return None
        return self.pool.get_computed_blocks(keys, num_tokens)

    def num_blocks_needed_after_hit(self, match: PrefixMatch, num_total_tokens: int) -> int:
        """Free blocks an admission with this hit consumes: the new blocks, plus the hit blocks
        that sit evictable in the free queue (touching them takes them out of it)."""
        evictable_hits = self.pool.num_unreferenced(match.kv_indices)
        return self.blocks_for(num_total_tokens) - len(match.kv_indices) + evictable_hits

    def allocate_with_prefix(
        self, request_id: str, match: PrefixMatch, num_total_tokens: int, limit: int | None = None
    ) -> bool:
        """Take the hit blocks and allocate the rest up to ``num_total_tokens``; False (nothing
        changed) when that does not fit. The request must hold no blocks yet."""
        if self.num_blocks_needed_after_hit(match, num_total_tokens) > self.pool.num_free_blocks:
            return False
        self.pool.touch(match.kv_indices)
        self.block_tables[request_id] = list(match.kv_indices)
        self._set_registered(request_id, len(match.kv_indices))
        allocated = self.allocate(request_id, num_total_tokens)
        assert allocated is not None  # checked above
        return True

    def num_registered(self, request_id: str) -> int:
        return self._num_registered.get(request_id, 0)

    def register_computed(self, request_id: str, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full once ``num_computed_tokens`` are computed
        (only blocks with keys: outputs are keyed only when the workload planned them)."""
        keys = self._keys.get(request_id)
        if not keys:
            return
        done = self._num_registered.get(request_id, 0)
        full = min(
            num_computed_tokens // self.block_size, len(keys), len(self.block_tables.get(request_id, ()))
        )
        if full > done:
            table = self.block_tables[request_id]
            # the whole key list and where the blocks start in it (Mooncake keys are indexed
            # one trace block at a time: kv/trace_block_index.py)
            self.pool.cache_full_blocks(
                table[done:full], keys, keys[done - 1] if done else None, start=done,
                token_ids=self._tokens.get(request_id),
            )  # fmt: skip
            self._set_registered(request_id, full)
        if self.host is not None:
            # Offered whether or not a block filled now: vLLM offers a scheduled request's
            # prompt chunks from its next unstored one every step (a GPU hit's included)
            span = self._host_range.get(request_id)
            if span is not None:
                self._host_offer(request_id, keys, full, span)

    # ---- the CPU tier (vLLM's native KV offloading) -------------------------------------------
    def set_host_range(self, request_id: str, num_prompt_tokens: int) -> None:
        """A request with keys may store its prompt's full blocks in the CPU tier."""
        if self.host is not None and request_id in self._keys:
            self._host_range[request_id] = [0, num_prompt_tokens // self.block_size, 0]

    def host_lookup(self, request_id: str, num_hit_tokens: int, num_tokens: int) -> int:
        """Tokens the CPU tier holds right after the request's GPU hit of ``num_hit_tokens``
        (whole blocks, up to its ``num_tokens``); -1 when some of them are still being stored
        or a load in flight holds some (vLLM skips the request for this pass)."""
        keys = self._keys.get(request_id)
        span = self._host_range.get(request_id)
        if self.host is None or not keys or span is None:
            return 0
        start = num_hit_tokens // self.block_size
        stop = min(len(keys), num_tokens // self.block_size)
        found = self.host.lookup(keys, start, stop) if stop > start else 0
        if found is None:
            return -1  # some still being stored: "not now" (``HIT_PENDING``)
        if found and self.host.pinned(keys[start : start + found]):
            # vLLM 0.32 delays a request whose hit chunks another request is loading
            # (``_lookup_complete_chunks``: ``_chunks_being_loaded``): -1, "not now".
            return -1
        return found * self.block_size

    def host_keys(self, request_id: str, num_hit_tokens: int, num_tokens: int) -> list[int]:
        """The keys of the blocks ``[num_hit_tokens, num_hit_tokens + num_tokens)``, a load that
        starts: past them the request offers its blocks to the tier (vLLM's
        ``update_state_after_alloc`` moves ``next_stored_chunk_idx`` there; without a load it
        stays at 0, so the GPU hit's blocks are offered too), and they count as its accesses."""
        bs = self.block_size
        start = num_hit_tokens // bs
        keys = self._keys[request_id][start : start + num_tokens // bs]
        span = self._host_range.get(request_id)
        if span is not None:
            # Set, not raised: a request preempted after storing its prompt and loading again
            # offers what follows this load anew (vLLM assigns ``next_stored_chunk_idx``).
            span[0] = start + len(keys)
            self._host_seen.setdefault(request_id, {}).update(dict.fromkeys(range(start, start + len(keys))))
        return keys

    def _host_offer(self, request_id: str, keys: list[int], full: int, span: list[int]) -> None:
        """Offer the prompt's full blocks from the request's next unstored one (``span[0]``: 0, or
        past its load; its GPU hit's blocks included, as vLLM's ``_build_store_jobs`` offers from
        ``next_stored_chunk_idx``) to its ``full`` computed ones to the tier (``prepare_store``,
        made at the pass's end; each offered block counts as the request's access, stored or
        not). A store the tier cannot make room for is offered again with the request's next
        full block (vLLM leaves ``next_stored_chunk_idx``)."""
        host = self.host
        assert host is not None
        stop = full if full < span[1] else span[1]
        if stop > span[0]:
            host.offer(keys, span, stop, self._host_seen.setdefault(request_id, {}))

    def host_preempted(self, request_id: str) -> None:
        """The request was preempted in this pass: no store of its blocks comes of it."""
        span = self._host_range.get(request_id)
        if span is not None and self.host is not None:
            self.host.withdraw(span)

    # ---- TensorRT-LLM's secondary (host) pool ------------------------------------------------
    def secondary_lookup(self, request_id: str, num_hit_tokens: int, num_tokens: int) -> int:
        """Tokens the host pool holds right after the request's GPU hit of ``num_hit_tokens``:
        whole blocks, capped as the GPU match is (at least one of ``num_tokens`` computed)."""
        keys = self._keys.get(request_id)
        if self.secondary is None or not keys:
            return 0
        start = num_hit_tokens // self.block_size
        stop = min(len(keys), max(num_tokens - 1, 0) // self.block_size)
        return self.secondary.lookup(keys, start, stop) * self.block_size if stop > start else 0

    def onboard(self, request_id: str, num_hit_tokens: int, num_tokens: int) -> None:
        """The request reuses the host pool's blocks ``[num_hit_tokens, + num_tokens)``: they
        leave it (their slots freed) before its GPU blocks are taken, so that allocation cannot
        offload over them (the engine claims a matched block before onboarding it)."""
        assert self.secondary is not None
        start = num_hit_tokens // self.block_size
        self.secondary.onboard(self._keys[request_id][start : start + num_tokens // self.block_size])

    def host_finished(self, request_id: str, num_tokens: int) -> None:
        """The request finished with ``num_tokens`` of its prompt's KV computed (all of it, or
        what an abort left): vLLM's ``_build_store_jobs`` offers its prompt blocks from its next
        unstored one once more in the pass after the finish (a store that failed for want of
        room may fit now), then ``on_request_finished`` makes the chunks it loaded, found or
        stored newest, its first block newest of all."""
        span = self._host_range.pop(request_id, None)
        seen = self._host_seen.pop(request_id, {})
        keys = self._keys.get(request_id)
        if span is None or not keys or self.host is None:
            return
        stop = min(span[1], num_tokens // self.block_size, len(keys))
        if seen or stop > span[0]:  # (nothing to store or make newest: nothing to queue)
            self.host.finish(keys, span, stop, seen)

    def _set_registered(self, request_id: str, num_blocks: int) -> None:
        """The request's first ``num_blocks`` blocks are registered (0: none, its table freed);
        ``registers_from`` follows, the one place it is set."""
        if num_blocks:
            self._num_registered[request_id] = num_blocks
        else:
            self._num_registered.pop(request_id, None)
        keys = self._keys.get(request_id)
        if keys and num_blocks < len(keys):
            self.registers_from[request_id] = (num_blocks + 1) * self.block_size
        else:
            self.registers_from.pop(request_id, None)

    def holds(self, request_id: str, num_total_tokens: int) -> bool:
        return False  # a block that fills must be registered: always go through ``allocate``

    def check_integrity(self) -> None:
        """The pool's own invariants, its ref counts equal to the table entries, and the CPU pool."""
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
        self._check_cpu()
        if self.host is not None:
            self.host.check_integrity()
        if self.secondary is not None:
            self.secondary.check_integrity()
        # ``registers_from``, which callers trust to skip ``register_computed``: below it no
        # block can be registered, at it the next key's block can (the table permitting).
        for request_id in self._keys.keys() | self.registers_from.keys():
            keys = self._keys.get(request_id)
            done = self._num_registered.get(request_id, 0)
            want = (done + 1) * self.block_size if keys and done < len(keys) else None
            if self.registers_from.get(request_id) != want:
                raise KVCacheIntegrityError(
                    f"request {request_id}: registers_from {self.registers_from.get(request_id)} "
                    f"but {done} of {len(keys or ())} keyed blocks registered"
                )
