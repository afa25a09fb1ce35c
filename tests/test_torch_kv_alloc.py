"""The paged KV cache is allocated without writing it: only the spare block (the null slot that
masked and padded reads land on) is zeroed, so building an engine does not touch the whole
cache (2 GiB by default on CPU)."""

from __future__ import annotations

import os

import torch

from tailserve.executors.pytorch.attention import PagedKVCache


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_building_the_cache_backs_only_the_spare_block() -> None:
    num_blocks, block_size, heads, dim = 8192, 16, 4, 64  # 64 MiB per tensor, 256 MiB in all
    before = _rss_bytes()
    kv = PagedKVCache(2, num_blocks, block_size, heads, dim, torch.bfloat16, torch.device("cpu"))
    grown = _rss_bytes() - before
    total = sum(t.numel() * t.element_size() for t in (*kv.k, *kv.v))
    assert total > 256 * 2**20
    assert grown < 16 * 2**20, f"building the cache backed {grown / 2**20:.0f} MiB of {total / 2**20:.0f}"
    for t in (*kv.k, *kv.v):
        assert not t[num_blocks].any()  # the null slot reads zeros
    assert kv.null_slot == num_blocks * block_size
