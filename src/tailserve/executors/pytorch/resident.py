"""Back a CPU tensor's pages before it is used, so that its first writes pay no page faults.

A tensor from ``torch.empty`` is backed page by page as it is first written. For the paged KV
cache that is during serving: a decode step at batch 64 of the tiny model reaches ~66 new 4 KiB
pages (one per 8 tokens a request adds, per layer's K and V), and each minor fault cost ~2.4 us
inside a step on this VM (docs/executor.md "r46"), ~0.15 ms a step until the whole cache has
been used once. vLLM's CPU backend allocates its cache with ``torch.zeros`` (``allocate_kv_cache`` in
``vllm/v1/worker/utils.py``), which backs every page at start-up the same way, one fault at a
time; ``madvise(MADV_POPULATE_WRITE)`` backs them in one call, without a fault per page.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from typing import Any

import torch

MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14 and later


@functools.cache
def _madvise() -> Any:
    f = ctypes.CDLL(None, use_errno=True).madvise
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


def populate(t: torch.Tensor) -> bool:
    """Back every page of the CPU tensor ``t`` now (its values do not change). False where that
    is not possible here (not Linux, a kernel before 5.14, not enough memory): the pages are then
    backed on first use, as before."""
    if sys.platform != "linux" or t.device.type != "cpu" or t.numel() == 0:
        return False
    page = mmap.PAGESIZE
    # Whole pages around the tensor's bytes; the ones it shares with its neighbours are mapped
    # memory too, and populating them only backs them.
    start = t.data_ptr() & ~(page - 1)
    end = t.data_ptr() + t.numel() * t.element_size()
    length = (end - start + page - 1) & ~(page - 1)
    return _madvise()(start, length, MADV_POPULATE_WRITE) == 0
