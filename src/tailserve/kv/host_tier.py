"""A CPU tier behind the GPU prefix cache: vLLM's native KV offloading (``--kv-offloading-size``).

vLLM 0.32 turns ``--kv-offloading-size GIB`` into its ``OffloadingConnector`` with a CPU backend
(``vllm/config/vllm.py:1105-1136@v0.32.0``). What tailserve follows of it:

- **Capacity** (``v1/kv_offload/cpu/spec.py:102-126``): the GiB are the total over the
  tensor-parallel ranks; each chunk (one GPU block by default) costs every rank's shard of the
  block, or one copy where the ranks replicate it (MLA under TP): ``chunks = bytes // (block bytes
  per rank x copies)``, each chunk rounded up to a memory page.
- **Stores** (``offloading/scheduler.py:1570-1844``, ``_calc_num_offloadable_tokens``): the full
  blocks of a request's *prompt* (``offload_prompt_only`` is on by default) are offered as they are
  computed, from block 0 (its GPU hit's included) or, after a load, past the loaded ones; a block
  already in the tier is not stored again. A store that needs room evicts unpinned chunks other
  than the offered ones, least recently used first, or is skipped when not enough are unpinned
  (``cpu/manager.py:prepare_store``), and offered again with the request's next full block.
- **Lookups** (``_lookup_complete_chunks``): consecutive chunks after the request's GPU hit, up
  to its whole prompt; the scheduler recomputes the last prompt token when the hit covers it.
- **Recency** (``cpu/policies/lru.py``): a chunk is newest when stored; when a request finishes,
  what its failed stores left is offered once more, then every chunk it loaded or offered (and
  found ready or stored) is made newer, its first block newest (``on_request_finished`` ranks
  them in reverse), so shared prefixes are evicted last.
- **Pins**: chunks being loaded cannot be evicted until their load completes.

A store is found from the scheduling pass after the one that issued it: vLLM builds a step's
store jobs at the end of its pass (``build_connector_meta``) and marks the chunks ready when the
worker reports them done with the step's output. A real worker submits them at the next step's
start (``offloading/worker.py``), so they are ready one pass later still (vLLM answers a lookup
then ``HIT_PENDING`` and skips the request, as ``lookup`` does for a chunk still pending here);
tailserve takes the earlier time, as the differential harness's worker does (docs/validation.md).
The H2D load time is the scheduler's (``policies/vllm_offload.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tailserve.kv.paged import KVCacheIntegrityError

PAGE_BYTES = 4096  # mmap.PAGESIZE: each CPU chunk is rounded up to it (SharedOffloadRegion)


def host_tier_chunks(size_gib: float, block_bytes_per_rank: int, num_copies: int) -> int:
    """Chunks (of one GPU block) ``size_gib`` of CPU memory holds: vLLM's ``CPUOffloadingSpec``."""
    chunk = block_bytes_per_rank * num_copies
    chunk = -(-chunk // PAGE_BYTES) * PAGE_BYTES
    return int(size_gib * (1 << 30)) // chunk


@dataclass(slots=True)
class _Offer:
    """A request's chunks ``keys[span[0]:stop]`` offered to the tier; ``span[0]`` is its next
    unstored index (moved on a successful store); ``seen`` collects the indices it accessed."""

    keys: list[int]
    span: list[int]
    stop: int
    seen: dict[int, None]


@dataclass(slots=True)
class HostTierStats:
    """Counters since construction, in tokens unless named otherwise."""

    num_hits: int = 0  # tokens loaded from the tier (vLLM's external prefix-cache hits)
    num_loads: int = 0  # requests that loaded
    num_stored_blocks: int = 0
    num_skipped_blocks: int = 0  # stores skipped: every chunk pinned
    num_evicted_blocks: int = 0
    load_seconds: float = 0.0  # summed arrival-to-ready wait of the loads (link queueing included)


class HostKVTier:
    """The CPU tier's chunks: content keys (the GPU cache's chained block keys) in LRU order."""

    def __init__(self, num_blocks: int, block_size: int, size_gib: float) -> None:
        if num_blocks < 1:
            raise ValueError(
                f"kv_offloading_size={size_gib:g} GiB holds no KV block of this model "
                f"({block_size} tokens per block): give at least one block's size"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.size_gib = size_gib
        # key -> the scheduling pass that stored it, oldest first: a chunk is found from the pass
        # after (vLLM builds a step's store jobs at the end of its scheduling pass, and the chunk
        # is ready once the worker reports the store done, with the step's output)
        self._lru: OrderedDict[int, int] = OrderedDict()
        self._pass = 0
        # Stores offered during this pass, made at its end as vLLM's store jobs are (their
        # evictions too: a later request of the same pass still finds what they would evict):
        # one per request (by its span's identity), in the order of its first offer, the largest
        # (vLLM makes one store job of a request's chunks per step, all stored or none)
        self._offers: dict[int, _Offer] = {}
        # Finished requests' last offers (``finish``): vLLM makes them in the scheduling pass
        # after the finish, after that pass's other stores (``_build_store_jobs`` walks
        # ``finished_req_ids`` after the scheduled requests), then ``on_request_finished`` makes
        # the chunks each request touched newest. Queued at the finish, ready at the next pass,
        # applied at the one after (before anything of the next evicts).
        self._finish_queued: list[_Offer] = []
        self._finish_ready: list[_Offer] = []
        self._pins: dict[int, int] = {}  # key -> loads in flight
        # Passes a store stays pending after the one that stored it: 0, or 1 under async
        # scheduling, where the worker's report of a step's stores is read only after the next
        # step is scheduled; a pending chunk is neither found nor evicted (vLLM's ``is_ready``)
        self.pending_passes = 0
        self.stats = HostTierStats()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: int) -> bool:
        return key in self._lru

    def new_pass(self) -> None:
        """A scheduling pass begins. The last pass's offers are stored now, then the last
        offers of the requests that finished before it, whose chunks then become newest (vLLM's
        ``build_connector_meta`` at the last pass's end); found from this pass on."""
        offers = self._offers
        if offers:
            self._offers = {}
            for offer in offers.values():
                self._make(offer)
        finished = self._finish_ready
        if finished:
            for offer in finished:
                self._make(offer)
            for offer in finished:
                keys = offer.keys
                self.touch([keys[i] for i in sorted(offer.seen)])
        self._finish_ready, self._finish_queued = self._finish_queued, []
        self._pass += 1

    def _make(self, offer: _Offer) -> None:
        """One request's store job (``prepare_store``): its chunks from its next unstored one to
        ``stop``, each recorded as its access if the tier lacks it or holds it ready (vLLM
        records a chunk still being stored as neither), stored or none; on success its next
        unstored index moves to ``stop`` (a failed store is offered again: vLLM keeps it)."""
        span, stop, keys = offer.span, offer.stop, offer.keys
        start = span[0]
        if start >= stop:
            return
        lru, seen = self._lru, offer.seen
        ready = self._pass - self.pending_passes
        for i in range(start, stop):
            stored = lru.get(keys[i])
            if stored is None or stored < ready:
                seen[i] = None
        if self.store(keys[start:stop]):
            span[0] = stop

    def offer(self, keys: list[int], span: list[int], stop: int, seen: dict[int, None]) -> None:
        """A request offers its ``keys`` from its next unstored one (``span[0]``) to ``stop``,
        stored when this pass ends; the indices it accesses go to ``seen``."""
        earlier = self._offers.get(id(span))
        if earlier is None or earlier.stop < stop:
            self._offers[id(span)] = _Offer(keys, span, stop, seen)

    def withdraw(self, span: list[int]) -> None:
        """The request's grant of this pass was taken back (preempted): vLLM builds no store job
        for a request the pass did not schedule."""
        self._offers.pop(id(span), None)

    def finish(self, keys: list[int], span: list[int], stop: int, seen: dict[int, None]) -> None:
        """A request finished: ``offer`` once more, in the next pass, then the chunks it
        accessed (``seen``) become newest, its first block newest of all."""
        self._finish_queued.append(_Offer(keys, span, stop, seen))

    def lookup(self, keys: Sequence[int], start: int, stop: int) -> int | None:
        """How many of ``keys[start:stop]`` the tier holds, consecutively from ``start``; None
        when one of them is still being stored (vLLM's ``HIT_PENDING``: the lookup is deferred,
        the request skipped for the pass)."""
        lru = self._lru
        now = self._pass - self.pending_passes
        n = start
        pending = False
        while n < stop:
            stored = lru.get(keys[n])
            if stored is None:
                break
            if stored >= now:
                pending = True
            n += 1
        return None if pending else n - start

    def store(self, keys: Sequence[int]) -> bool:
        """Store the chunks of ``keys`` not in the tier yet, evicting the least recently used
        unpinned ones (none of ``keys``) for room; all of them skipped, and False, when that many
        cannot be evicted."""
        lru = self._lru
        new = [k for k in keys if k not in lru]
        if not new:
            return True
        need = len(lru) + len(new) - self.num_blocks
        if need > 0:
            pins = self._pins
            offered = set(keys)  # vLLM protects the offered chunks (``prepare_store``)
            ready = self._pass - self.pending_passes  # stored before this pass: not pending
            victims = []
            for key, stored in lru.items():  # oldest first
                if key not in pins and key not in offered and stored < ready:
                    victims.append(key)
                    if len(victims) == need:
                        break
            if len(victims) < need:
                self.stats.num_skipped_blocks += len(new)
                return False
            for key in victims:
                del lru[key]
            self.stats.num_evicted_blocks += need
        stored = self._pass
        for key in new:
            lru[key] = stored
        self.stats.num_stored_blocks += len(new)
        return True

    def pin(self, keys: Sequence[int]) -> None:
        pins = self._pins
        for key in keys:
            pins[key] = pins.get(key, 0) + 1

    def pinned(self, keys: Sequence[int]) -> bool:
        """Whether a load in flight holds any of ``keys`` (vLLM's ``_chunks_being_loaded``)."""
        pins = self._pins
        return any(key in pins for key in keys)

    def unpin(self, keys: Sequence[int]) -> None:
        pins = self._pins
        for key in keys:
            left = pins[key] - 1
            if left:
                pins[key] = left
            else:
                del pins[key]

    def touch(self, keys: Sequence[int]) -> None:
        """A finished request's chunks become the newest, its first one newest of all."""
        lru = self._lru
        for key in reversed(keys):
            if key in lru:
                lru.move_to_end(key)

    def check_integrity(self) -> None:
        if len(self._lru) > self.num_blocks:
            raise KVCacheIntegrityError(
                f"CPU tier holds {len(self._lru)} chunks, more than its {self.num_blocks}"
            )
        for key, count in self._pins.items():
            if count < 1 or key not in self._lru:
                raise KVCacheIntegrityError(f"CPU tier: chunk {key} pinned {count} times but not held")

    def summary(self) -> dict[str, float | int]:
        """The tier's figures for a run's JSON (``prefix_cache.cpu_tier``)."""
        st = self.stats
        return {
            "size_gib": self.size_gib,
            "num_blocks": self.num_blocks,
            "loaded_tokens": st.num_hits,
            "num_loads": st.num_loads,
            "mean_load_wait_s": st.load_seconds / st.num_loads if st.num_loads else 0.0,
            "stored_blocks": st.num_stored_blocks,
            "evicted_blocks": st.num_evicted_blocks,
            "skipped_blocks": st.num_skipped_blocks,
        }

    def note(self) -> str:
        """One line on what the tier did in a run."""
        st = self.stats
        wait = f" (mean wait {st.load_seconds / st.num_loads * 1e3:.1f} ms)" if st.num_loads else ""
        skipped = (
            f", {st.num_skipped_blocks:,} not stored (every chunk pinned)" if st.num_skipped_blocks else ""
        )
        return (
            f"CPU KV tier ({self.size_gib:g} GiB, {self.num_blocks:,} blocks of {self.block_size} tokens): "
            f"{st.num_hits:,} prompt tokens loaded in {st.num_loads:,} loads{wait}; {st.num_stored_blocks:,} "
            f"blocks stored, {st.num_evicted_blocks:,} evicted{skipped}"
        )
