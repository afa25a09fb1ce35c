"""The paged KV cache is allocated without writing it: only the spare block (the null slot that
masked and padded reads land on) is zeroed, so building it does not write the whole cache (2 GiB
by default on CPU). On CPU the engine then backs its pages in one call (``populate``), so that
serving pays no page fault a block."""

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


def test_a_cache_larger_than_the_available_memory_is_refused_at_build(monkeypatch, tmp_path) -> None:
    """The size is checked against MemAvailable before any page of the cache is backed."""
    import pytest

    from tailserve.assemble import pytorch as assemble

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    1048576 kB\n")  # 1 GiB
    assert assemble.cpu_memory_available(meminfo) == 2**30
    assert assemble.cpu_memory_available(tmp_path / "missing") is None
    monkeypatch.setattr(assemble, "cpu_memory_available", lambda: 2**30)
    cpu = torch.device("cpu")
    assert assemble.kv_budget_bytes(None, cpu, 0.9, 0.5) == 0.5 * 2**30  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"KV cache \(2.00 GiB\) is larger than the memory this machine has"):
        assemble.kv_budget_bytes(None, cpu, 0.9, None)  # type: ignore[arg-type]  (the 2 GiB default)
    with pytest.raises(ValueError, match="lower kv_cache_memory_gib"):
        assemble.kv_budget_bytes(None, cpu, 0.9, 4.0)  # type: ignore[arg-type]


def test_populate_backs_every_page_and_keeps_the_values() -> None:
    num_blocks, block_size, heads, dim = 8192, 16, 4, 64  # 256 MiB in all
    kv = PagedKVCache(2, num_blocks, block_size, heads, dim, torch.bfloat16, torch.device("cpu"))
    k, _ = kv.slots(1)
    k[37] = 1.5
    before = _rss_bytes()
    if not kv.populate():
        import pytest

        pytest.skip("MADV_POPULATE_WRITE is not available here (Linux 5.14 and later)")
    grown = _rss_bytes() - before
    total = sum(t.numel() * t.element_size() for t in (*kv.k, *kv.v))
    assert grown > total - 16 * 2**20, f"populate backed {grown / 2**20:.0f} MiB of {total / 2**20:.0f}"
    assert bool((k[37] == 1.5).all()) and not k[38].any()
    for t in (*kv.k, *kv.v):
        assert not t[num_blocks].any()


def test_the_engine_populates_its_cpu_cache(monkeypatch, tmp_path) -> None:
    from tailserve.executors.pytorch import attention
    from tailserve.llm import LLM
    from torch_helpers import micro_model

    calls = []
    real = attention.PagedKVCache.populate
    monkeypatch.setattr(attention.PagedKVCache, "populate", lambda self: calls.append(self) or real(self))
    llm = LLM(str(micro_model(tmp_path)), dtype="float32", kv_cache_memory_gib=0.002)
    assert calls == [llm.engine.stop_checker.inner.kv]
