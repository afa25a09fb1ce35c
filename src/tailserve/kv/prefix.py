"""Prefix caches: the interface both engines' caches share, and the keys they are looked up by.

Two structures implement :class:`PrefixCache`:

- :class:`~tailserve.kv.block_pool.HashedBlockPool` (vLLM V1 automatic prefix caching):
  the *allocator itself*. It owns every KV block; full blocks are cached under a chained hash and
  stay cached after their last user frees them, until allocation reuses them (LRU).
  Unit: one block of ``block_size`` tokens.
- :class:`~tailserve.kv.radix.RadixCache` (SGLang RadixAttention): a token-level radix
  tree over the KV slots an outside allocator handed out; it never allocates, it only decides
  which unreferenced slots to give back (``evict``). Unit: one token (``block_size == 1``), or
  one page of ``page_size`` tokens (SGLang's paged mode, TGI's block-aligned trie).

A *key* names the content of one unit including everything before it, so that two requests
share a unit exactly when they share the whole prefix up to and including it. Keys come from
token ids (:func:`block_hashes`) or, for traces without text, from Mooncake ``hash_ids``
(:func:`keys_from_hash_ids`, :func:`token_keys_from_hash_ids`). A radix tree compares keys along
a path from the root, so it may also be fed plain token ids.

Hashing scheme (deterministic, documented, no ``hashlib``/``xxhash``): block ``i`` of a sequence
has key ``hash((key[i-1], extra_key, *token_ids_of_block_i))`` with ``key[-1] = NONE_HASH``
(Mooncake keys: :func:`keys_from_hash_ids`).
CPython hashes an ``int`` as ``x mod (2**61 - 1)`` (sign kept) and a tuple with an xxHash64-style
combiner (3.8+); neither depends on ``PYTHONHASHSEED`` (only ``str``/``bytes`` are salted), so the
keys are the same in every process of the same 64-bit CPython. Inputs must be ``int`` (``None``
hashes by address before 3.12 and ``str`` is salted, so neither may appear). Collisions are
possible in principle (64-bit) and would merge two prefixes; at simulator scale (~1e7 keys) the
chance is ~1e-5.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from tailserve.kv.paged import KVCacheIntegrityError

if TYPE_CHECKING:
    from tailserve.kv.radix import RadixNode

# Parent key of the first block (vLLM seeds its NONE_HASH the same way: a fixed value).
NONE_HASH: int = 0x7A11_5E4E_0F1C_ACE5

MOONCAKE_BLOCK_SIZE = 512  # tokens per Mooncake ``hash_ids`` entry


class PrefixCacheIntegrityError(KVCacheIntegrityError):
    """Raised by ``check_integrity`` with the numbers that do not add up."""


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest cached prefix of a request, and what is needed to lock it.

    ``num_tokens`` is always a multiple of the cache's ``block_size``. ``kv_indices`` holds one
    entry per unit (``num_tokens // block_size`` of them): block ids (hashed pool) or the slot /
    page indices the radix tree was given at insert. ``node`` is the radix tree's last matched
    node (the lock handle); ``None`` for the hashed pool.
    """

    num_tokens: int  # tokens
    kv_indices: list[int]
    node: RadixNode | None = None


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters since construction. Every ``match_prefix`` call counts, so call it once per
    admission attempt if the hit rate should mean what vLLM's ``prefix_cache_hit_rate`` means."""

    num_lookups: int = 0  # match_prefix calls
    num_query_tokens: int = 0  # tokens asked for (the request's num_tokens when given)
    num_hit_tokens: int = 0  # tokens found
    num_evicted_tokens: int = 0  # tokens dropped from the cache by eviction

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class PrefixCache(ABC):
    """Longest-prefix lookup over cached KV, with locking and LRU eviction of unlocked entries.

    Lifecycle of one request (the same for both implementations)::

        m = cache.match_prefix(keys, request.num_tokens)  # read-only, apart from LRU clock/stats
        cache.lock(m)                                     # m.kv_indices now safe from eviction
        ...compute tokens m.num_tokens.., get KV for them...
        cache.insert(keys, kv_indices)                    # share what was computed
        cache.unlock(m)                                   # (pool: free all the request's blocks)

    Units: ``block_size`` tokens each (the radix tree's ``page_size``, usually 1). Counts are in
    units; ``PrefixMatch.num_tokens`` and the stats are in tokens.
    """

    block_size: int  # tokens per unit

    @abstractmethod
    def match_prefix(self, keys: Sequence[Hashable], num_tokens: int | None = None) -> PrefixMatch:
        """Longest cached prefix of ``keys`` (one key per unit).

        ``num_tokens`` is the request's total token count; when given, the hit is capped at
        ``num_tokens - 1`` tokens (rounded down to a unit) so that at least one token is computed
        and produces logits — vLLM and SGLang both do this. Mutates nothing a caller can observe
        except stats and LRU recency (the radix tree may split a node; sizes do not change).
        Locks nothing: call :meth:`lock` before anything can evict.
        """

    @abstractmethod
    def lock(self, match: PrefixMatch) -> None:
        """Protect the matched prefix from eviction (radix: ``inc_lock_ref`` on the path; pool:
        ``touch``, i.e. ref count + 1 and out of the free queue). May be called several times.
        Lock before anything else allocates or evicts: until then the match may go stale (the
        radix tree raises ``ValueError`` for an evicted node; the pool cannot tell)."""

    @abstractmethod
    def unlock(self, match: PrefixMatch) -> None:
        """Undo one :meth:`lock`. The prefix stays cached and becomes evictable once no one holds
        it. Raises ``ValueError`` on an unlock without a matching lock."""

    @abstractmethod
    def insert(self, keys: Sequence[Hashable], kv_indices: Sequence[int]) -> int:
        """Cache computed units: ``kv_indices[i]`` holds the KV of the unit named ``keys[i]``.

        Returns how many leading units were already cached before the call. Radix: the tree keeps
        its own copies of those, so the caller frees its duplicates
        ``kv_indices[len(own match):returned]``. Pool: vLLM keeps duplicate blocks cached too, so
        nothing needs freeing. Does not lock anything.
        """

    @abstractmethod
    def evict(self, num: int) -> int:
        """Drop at least ``num`` units of unlocked cache, least recently used first, or all of it
        if there is less. Returns the number dropped (the radix tree drops whole leaves, so it may
        drop more than ``num``). Locked/referenced entries are never dropped."""

    @property
    @abstractmethod
    def num_cached(self) -> int:
        """Units currently cached (locked or not)."""

    @property
    @abstractmethod
    def num_evictable(self) -> int:
        """Cached units no one holds: evictable now, and counted as available memory."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Recompute every counter and invariant from scratch; raise
        :class:`PrefixCacheIntegrityError` naming the numbers that disagree."""


def block_hashes(
    token_ids: Sequence[int], block_size: int, parent: int | None = None, extra_key: int = 0
) -> list[int]:
    """Chained keys of the FULL blocks of ``token_ids`` (a trailing partial block gets none).

    ``parent`` is the key of the block before ``token_ids[0]`` (``None``: start of sequence);
    ``extra_key`` separates namespaces (LoRA id, cache salt) and must be an ``int``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    key = NONE_HASH if parent is None else parent
    keys: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        key = hash((key, extra_key, *token_ids[start : start + block_size]))
        keys.append(key)
    return keys


class TraceBlockKeys(Sequence[int]):
    """A prompt's block keys from Mooncake ``hash_ids`` when a trace block is ``per > 1`` pool
    blocks: ``per`` keys per trace block, fixed by the trace block's first key and their place
    in it (so two prompts share key ``i`` exactly when they share key ``i - i % per``).

    A read-only sequence of ints over one int64 array (``array``): a prompt's ~750 keys as
    Python ints cost more to make and to free than the pool's work on them. The hashed block
    pool indexes such keys one trace block at a time (``kv/trace_block_index.py``); hand it the
    whole sequence (``cache_full_blocks(..., start=)``), never a slice, which is a plain list
    and would be indexed apart.
    """

    __slots__ = ("array", "per")

    def __init__(self, array: np.ndarray, per: int) -> None:
        self.array = array
        self.per = per

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return self.array[i].tolist()
        return int(self.array[i])

    def __iter__(self):
        return iter(self.array.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TraceBlockKeys):
            return self.per == other.per and bool(np.array_equal(self.array, other.array))
        if isinstance(other, (list, tuple)):
            return self.array.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TraceBlockKeys({self.array.tolist()!r}, per={self.per})"

    def __reduce__(self) -> tuple:
        return (TraceBlockKeys, (self.array, self.per))


def keys_from_hash_ids(
    hash_ids: Sequence[int],
    input_length: int,
    trace_block_size: int = MOONCAKE_BLOCK_SIZE,
    block_size: int = 16,
) -> list[int] | TraceBlockKeys:
    """Per-``block_size`` keys for a prompt described by Mooncake ``hash_ids``.

    ``hash_ids[j]`` names trace block ``j`` (``trace_block_size`` tokens; the last one is partial
    unless ``input_length`` is a multiple). Only the tokens of FULL trace blocks get keys, so the
    result has ``(input_length // trace_block_size) * trace_block_size // block_size`` keys; the
    partial last block is never shared (its content is unknown beyond its length). Two prompts
    get equal keys exactly for the blocks whose trace-block ancestors (and own trace block) they
    share:

    - when a trace block is ``per`` whole pool blocks, trace block ``j`` has the chained key
      ``c[j] = hash((c[j-1], hash_ids[j]))`` (``c[-1] = NONE_HASH``; at ``per == 1`` these are the
      keys), and its pool block ``s`` the key ``_slot_keys(c[j], s)``: a bijective 64-bit mix,
      so keys differ within a trace block and are equal across prompts exactly when ``c[j]``
      is. The result is a :class:`TraceBlockKeys`. (One Python hash per trace block and one
      numpy pass per prompt: chaining all ``per`` keys in Python cost ~1 s of a 16-replica
      Mooncake run, and only equality matters to a pool or a router.)
    - otherwise key ``b`` covers tokens ``[b*block_size, (b+1)*block_size)`` and chains every
      hash id those tokens touch.
    """
    if block_size < 1 or trace_block_size < 1:
        raise ValueError(f"block sizes must be >= 1, got {block_size} and {trace_block_size}")
    if input_length < 0:
        raise ValueError(f"input_length must be >= 0, got {input_length}")
    num_full = min(input_length // trace_block_size, len(hash_ids))
    end_of_full = num_full * trace_block_size
    key = NONE_HASH
    keys: list[int] = []
    if trace_block_size % block_size == 0:
        for j in range(num_full):
            key = hash((key, hash_ids[j]))
            keys.append(key)
        per = trace_block_size // block_size
        if per == 1:
            return keys
        return TraceBlockKeys(_slot_keys(keys, per), per)
    for end in range(block_size, end_of_full + 1, block_size):
        first = (end - block_size) // trace_block_size
        last = (end - 1) // trace_block_size
        key = hash((key, end, *hash_ids[first : last + 1]))
        keys.append(key)
    return keys


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_NOT_MINUS_ONE = 0x2545F4914F6CDD1D  # -1 marks a keyless block in the pool


def _slot_keys(chained: list[int], per: int) -> np.ndarray:
    """``per`` keys for each chained trace-block key, trace block by trace block: SplitMix64's
    finaliser (a bijection of 64-bit words) of ``c + (s + 1) * golden``, as int64."""
    c = np.asarray(chained, dtype=np.int64).view(np.uint64)
    x = c[:, None] + np.arange(1, per + 1, dtype=np.uint64)[None, :] * _GOLDEN  # wraps mod 2**64
    x ^= x >> _S30
    x *= _MIX1
    x ^= x >> _S27
    x *= _MIX2
    x ^= x >> _S31
    keys = x.view(np.int64).ravel()
    keys[keys == -1] = _NOT_MINUS_ONE
    return keys


def token_keys_from_hash_ids(
    hash_ids: Sequence[int], input_length: int, trace_block_size: int = MOONCAKE_BLOCK_SIZE
) -> list[int]:
    """Per-token keys for a radix tree: each token of a FULL trace block gets its block's chained
    key (a tree compares keys along the path, so repeating one key per block is enough). The
    partial last block gets none. Length: ``(input_length // trace_block_size) * trace_block_size``.
    """
    block_keys = keys_from_hash_ids(hash_ids, input_length, trace_block_size, trace_block_size)
    # Each block's run of keys made in C (``[k] * size``, chained), 2.4x the comprehension's
    # rate: once per request at arrival, 7% of SGLang's loop on the Mooncake trace (r50).
    return list(chain.from_iterable([k] * trace_block_size for k in block_keys))
