"""The KV cache manager a policy's config asks for, shared by the simulator and real engines.

vLLM-style configs with ``enable_prefix_caching`` get a hashed block pool; SGLang/TGI-style
configs with ``disable_radix_cache=False`` get slots a radix tree can hold. Prefix caching needs
token identities: a workload of bare lengths could never share, so it gets a plain manager.
"""

from __future__ import annotations

from typing import Any

from tailserve.core.kv_cache import KVCacheManager
from tailserve.core.radix_kv_cache import RadixKVCacheManager


def make_kv_cache(
    config: Any, num_blocks: int, block_size: int, num_cpu_blocks: int, shares_prefixes: bool
) -> KVCacheManager:
    prefix_caching = bool(getattr(config, "enable_prefix_caching", False)) and shares_prefixes
    radix = getattr(config, "disable_radix_cache", True) is False and shares_prefixes
    if radix:
        return RadixKVCacheManager(num_blocks, block_size, num_cpu_blocks)
    return KVCacheManager(num_blocks, block_size, num_cpu_blocks, prefix_caching)
