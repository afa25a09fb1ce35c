"""Keep the pages of freed activations in the process: glibc's malloc tuned when a CPU engine is
built, so that a step's tensors reuse the memory the last step freed instead of faulting it in
again.

A forward pass allocates its activations with ``torch.empty`` (glibc's ``posix_memalign``) and
frees them by the end of the step; at a 2,048-token prefill of the tiny model they are 4-13 MB
each. With its defaults glibc hands the free top of its heap back to the kernel once it passes a
threshold (twice the largest block it has mapped, moving as it sees them), so a step that frees a
few such blocks together gives their pages back and the next step faults every one in again —
or does not, depending on how the thresholds have drifted (three 12 MiB blocks in a loop: 9,184
faults a round in 6 of 12 runs of the same process, none in the others). On a 2-core Zen 3 (2026-12-06, docs/executor.md "Page faults in
the prefill step") W's prefill step took a median of 4,745-9,344 faults a run, up to 37,618 in
one step, and a median of 10-30 ms of kernel CPU time a step (up to 100). vLLM's CPU platform preloads a tcmalloc when
its wheel bundles one (``vllm/platforms/cpu.py``); a process cannot change its allocator once
started, so tailserve sets glibc's own knobs:

- blocks up to 32 MiB (``M_MMAP_THRESHOLD``, the most glibc takes) come from a heap, and a heap's
  free top is kept up to 1 GiB (``M_TRIM_THRESHOLD``): what one step frees serves the next;
- one arena (``M_ARENA_MAX``): every thread allocates from the main heap, whose top obeys that
  threshold. A thread's own arena lives in 64 MiB heaps that glibc unmaps whenever one is wholly
  free, whatever the threshold, and ``tailserve serve`` steps its engine in a thread of its own.
  The threads that allocate are the engine's and the kernels' (a few small buffers per task);
  glibc's per-thread cache serves small blocks without the arena's lock.

Larger blocks are still mapped per use: the GEMM that fills one does ~4,000 FLOPs a byte at a
model width of 4,096 (its faults a few percent of its time), and glibc 2.36's aligned allocations
keep several times a block's size in the heap before they reuse one, a poor trade at 100 MB. The
process keeps up to 1 GiB of freed heap, as a caching allocator does.

Nothing is set, and the description says why, with ``TAILSERVE_MALLOC=system``, where the
allocator is not glibc's (musl, macOS, or tcmalloc / jemalloc in ``LD_PRELOAD``), or where the
environment already tunes glibc's malloc (``GLIBC_TUNABLES`` with ``glibc.malloc.*``,
``MALLOC_*_``).
"""

from __future__ import annotations

import ctypes
import os
import sys

ENV = "TAILSERVE_MALLOC"
CHOICES = ("tuned", "system")
# <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
KNOBS = (
    ("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, 32 << 20),  # glibc refuses more (HEAP_MAX_SIZE / 2)
    ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, 1 << 30),
    ("M_ARENA_MAX", M_ARENA_MAX, 1),
)
DESCRIPTION = "glibc, freed blocks kept (up to 32 MiB from one heap, trimmed above 1 GiB)"
# glibc's own environment for the same knobs: a user's setting wins.
GLIBC_ENV = (
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
    "MALLOC_ARENA_MAX",
)

_done: str | None = None  # what the first ``tune`` did


class CpuMallocError(ValueError):
    """A bad ``TAILSERVE_MALLOC``."""


def requested() -> str:
    """``tuned`` (the default) or ``system``; a CpuMallocError names any other value."""
    value = os.environ.get(ENV, "").strip().lower() or "tuned"
    if value not in CHOICES:
        raise CpuMallocError(f"{ENV}={value!r}: expected one of {', '.join(CHOICES)}")
    return value


def tune() -> str:
    """Set glibc's knobs at the first call, as ``TAILSERVE_MALLOC`` says then (process-wide, and
    not undone); every call checks the variable and returns what the first one did, in words."""
    global _done
    choice = requested()
    if _done is None:
        _done = _apply(choice)
    return _done


def _apply(choice: str) -> str:
    if choice == "system":
        return f"glibc defaults ({ENV}=system)"
    libc = _glibc()
    if libc is None:
        return "the platform's allocator (not glibc: nothing tuned)"
    if _interposed(libc):
        return "an allocator in LD_PRELOAD (not glibc's: nothing tuned)"
    named = [name for name in GLIBC_ENV if name in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        named.append("GLIBC_TUNABLES")
    if named:
        return f"glibc as {', '.join(named)} set{'s' if len(named) == 1 else ''} it (nothing tuned)"
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # All three are set: setting either threshold also stops glibc moving the other.
    refused = [name for name, knob, value in KNOBS if mallopt(knob, value) != 1]
    if refused:
        return f"glibc, partly tuned (mallopt refused {', '.join(refused)})"
    return DESCRIPTION


def _glibc() -> ctypes.CDLL | None:
    """glibc, where it is this process's C library (``gnu_get_libc_version`` is glibc's own)."""
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 (an AttributeError where it is not glibc)
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def _interposed(libc: ctypes.CDLL) -> bool:
    """Whether ``malloc`` resolves to another library than glibc (tcmalloc, jemalloc preloaded):
    glibc's knobs would then tune an allocator nobody calls."""
    try:
        process = ctypes.CDLL(None).malloc
    except (OSError, AttributeError):
        return False
    return ctypes.cast(process, ctypes.c_void_p).value != ctypes.cast(libc.malloc, ctypes.c_void_p).value
