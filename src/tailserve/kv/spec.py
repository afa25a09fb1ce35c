"""What KV cache a policy needs, declared by the policy (``Policy.kv_spec``) and built by
``kv/factory.py``: generic assembly code never reads a policy's config to find out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tailserve.kv.hicache_spec import HiCacheSpec

KVKind = Literal["paged", "hashed", "radix"]
KV_KINDS: tuple[str, ...] = ("paged", "hashed", "radix")
RadixFlavour = Literal["sglang", "tgi"]
RADIX_FLAVOURS: tuple[str, ...] = ("sglang", "tgi")


@dataclass(frozen=True, slots=True)
class KVSpec:
    # paged: plain blocks; hashed: vLLM's automatic prefix caching (hashed full blocks, LRU);
    # radix: slots an SGLang/TGI radix tree holds references on.
    kind: KVKind = "paged"
    swap_space_gib: float = 0.0  # CPU swap pool per GPU (vLLM V0 --swap-space), GiB
    # radix: whose radix cache the manager builds (kv/radix_manager.py). "sglang": SGLang's
    # RadixCache, one key per token (no tree with larger pages), inserted as prefill progresses
    # and at finish; "tgi": TGI's RadixAllocator, one key per block, a request's computed prompt
    # blocks inserted whenever it leaves.
    radix: RadixFlavour = "sglang"
    # hashed: a CPU tier behind the prefix cache (vLLM --kv-offloading-size), GiB over all TP
    # ranks; 0 without one (kv/host_tier.py)
    offload_gib: float = 0.0
    # hashed: TensorRT-LLM's secondary (host) block pool behind the reuse pool
    # (kv_cache_config.host_cache_size), bytes per GPU; 0 without one (kv/secondary_pool.py)
    host_cache_bytes: int = 0
    # radix (sglang): SGLang's HiCache host tier behind the tree (--enable-hierarchical-cache,
    # kv/hiradix.py); None without one
    hicache: HiCacheSpec | None = None

    @property
    def host_tier_flag(self) -> str | None:
        """The flag that asked for a host tier behind the prefix cache (for a note), or None."""
        if self.offload_gib:
            return "kv_offloading_size"
        if self.host_cache_bytes:
            return "host_cache_size"
        return "enable_hierarchical_cache" if self.hicache is not None else None

    def __post_init__(self) -> None:
        if self.kind not in KV_KINDS:
            raise ValueError(f"KV cache kind must be one of {', '.join(KV_KINDS)}, got {self.kind!r}")
        if self.radix not in RADIX_FLAVOURS:
            raise ValueError(f"radix cache must be one of {', '.join(RADIX_FLAVOURS)}, got {self.radix!r}")
        if self.offload_gib < 0:
            raise ValueError(f"kv_offloading_size must be >= 0 GiB, got {self.offload_gib}")
        if self.offload_gib and self.kind != "hashed":
            raise ValueError(
                "a CPU offloading tier sits behind vLLM's hashed prefix cache: enable prefix caching"
            )
        if self.host_cache_bytes < 0:
            raise ValueError(f"host_cache_size must be >= 0 bytes, got {self.host_cache_bytes}")
        if self.host_cache_bytes and self.kind != "hashed":
            raise ValueError(
                "TensorRT-LLM's host KV pool holds blocks evicted from the reuse tree: enable block reuse"
            )
        if self.host_cache_bytes and self.offload_gib:
            raise ValueError(
                "one host KV tier per engine: vLLM's kv_offloading_size or TensorRT-LLM's host_cache_size"
            )
        if self.hicache is not None and (self.kind != "radix" or self.radix != "sglang"):
            raise ValueError("a HiCache host tier sits behind SGLang's radix cache: enable the radix cache")
        if self.swap_space_gib < 0:
            raise ValueError(f"swap_space_gib must be >= 0, got {self.swap_space_gib}")
