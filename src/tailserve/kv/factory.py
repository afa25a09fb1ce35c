"""The one place a KV cache manager is made, from the ``KVSpec`` a policy declares, with its
prefix cache: vLLM's hashed block pool (``hashed``) or the radix tree of the engine ``spec.radix``
names (``radix``: SGLang's RadixCache or TGI's RadixAllocator). Policies never build or attach one.

Prefix sharing needs token identities: a workload of bare lengths (``shares_prefixes=False``)
could never share, so it gets the plain manager whatever the policy asks for.
"""

from __future__ import annotations

from tailserve.kv.hashed import HashedKVCacheManager
from tailserve.kv.hiradix_manager import HiRadixKVCacheManager
from tailserve.kv.host_tier import HostKVTier
from tailserve.kv.paged import KVCacheManager
from tailserve.kv.radix_manager import RadixKVCacheManager
from tailserve.kv.secondary_pool import SecondaryBlockPool
from tailserve.kv.spec import KVSpec


def make_kv_cache(
    spec: KVSpec,
    num_blocks: int,
    block_size: int,
    num_cpu_blocks: int = 0,
    shares_prefixes: bool = True,
    num_host_blocks: int = 0,
) -> KVCacheManager:
    """``num_host_blocks``: the host tier's size, by the assembler: vLLM's CPU offloading chunks
    (``spec.offload_gib``), TensorRT-LLM's secondary pool blocks (``spec.host_cache_bytes``) or
    SGLang's HiCache host pool in tokens; a workload without token identities gets no tier, as it
    gets no prefix cache."""
    if shares_prefixes and spec.kind == "hashed":
        host = HostKVTier(num_host_blocks, block_size, spec.offload_gib) if spec.offload_gib else None
        secondary = (
            SecondaryBlockPool(num_host_blocks, block_size, spec.host_cache_bytes)
            if spec.host_cache_bytes
            else None
        )
        return HashedKVCacheManager(num_blocks, block_size, num_cpu_blocks, host, secondary)
    if shares_prefixes and spec.kind == "radix" and spec.hicache is not None:
        # SGLang's HiCache: ``num_host_blocks`` is its host pool in tokens (one-token pages)
        return HiRadixKVCacheManager(num_blocks, block_size, num_cpu_blocks, spec.hicache, num_host_blocks)
    if shares_prefixes and spec.kind == "radix":
        return RadixKVCacheManager(num_blocks, block_size, num_cpu_blocks, spec.radix)
    return KVCacheManager(num_blocks, block_size, num_cpu_blocks)
