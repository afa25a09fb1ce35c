"""Pinning the OpenMP threads torch computes with, one core each, as vLLM's CPU worker does
(``VLLM_CPU_OMP_THREADS_BIND``: every OpenMP thread of the worker bound to one core).

GNU OpenMP keeps one pool of threads per thread that opens parallel regions (here the engine's
stepping thread) and gives team slot ``t`` to the same pool thread every time, so setting the
affinity of each slot once, from inside a parallel region, holds for every later torch op of
that thread: GEMMs (oneDNN/MKL), ``at::parallel_for`` loops and tailserve's kernels alike.

The function that does it is a few lines of C, compiled on first use with the system C compiler
(``cc -fopenmp``) into ``kernels/`` under tailserve's cache, keyed by its source, and loaded with
``ctypes``. Its ``libgomp.so.1`` is the one torch already loaded (the dynamic loader matches the
soname), so the slots it pins are torch's; ``team_affinity`` lets a test check that. Where it
cannot be built (no compiler, not Linux), ``available()`` is False and nothing is pinned.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

from tailserve.cache import cache_root

log = logging.getLogger(__name__)

_SOURCE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <omp.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Team slot t of a team of n gets the CPUs cpus[offsets[t] .. offsets[t + 1]); tids[t] is the
   kernel thread id that holds the slot (-1: the runtime gave a smaller team). 0 or an errno. */
int tailserve_pin_team(int n, const int *cpus, const int *offsets, long *tids) {
  int err = 0;
  for (int t = 0; t < n; ++t) tids[t] = -1;
#pragma omp parallel num_threads(n)
  {
    const int t = omp_get_thread_num();
    if (t < n) {
      cpu_set_t mask;
      CPU_ZERO(&mask);
      for (int i = offsets[t]; i < offsets[t + 1]; ++i) CPU_SET(cpus[i], &mask);
      if (sched_setaffinity(0, sizeof(mask), &mask) != 0) {
#pragma omp atomic write
        err = errno;
      }
      tids[t] = syscall(SYS_gettid);
    }
  }
  return err;
}

/* What each slot of a team of n runs on: its thread id and its mask's first 64 CPUs. */
void tailserve_team_affinity(int n, long *tids, unsigned long long *masks) {
  for (int t = 0; t < n; ++t) { tids[t] = -1; masks[t] = 0; }
#pragma omp parallel num_threads(n)
  {
    const int t = omp_get_thread_num();
    if (t < n) {
      cpu_set_t mask;
      CPU_ZERO(&mask);
      sched_getaffinity(0, sizeof(mask), &mask);
      unsigned long long bits = 0;
      for (int c = 0; c < 64; ++c) if (CPU_ISSET(c, &mask)) bits |= 1ull << c;
      masks[t] = bits;
      tids[t] = syscall(SYS_gettid);
    }
  }
}
"""

_FLAGS = ["-O2", "-fPIC", "-shared", "-fopenmp"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed: str | None = None


def library_path() -> Path:
    key = hashlib.sha256("\0".join((_SOURCE, *_FLAGS)).encode()).hexdigest()[:12]
    return cache_root() / "kernels" / f"tailserve_affinity_{key}.so"


def _load() -> ctypes.CDLL | None:
    global _lib, _failed
    if _lib is not None or _failed is not None:
        return _lib
    with _lock:
        if _lib is None and _failed is None:
            try:
                _lib = _build_and_open()
            except (OSError, subprocess.SubprocessError) as e:
                _failed = f"{type(e).__name__}: {e}"
                log.info("OpenMP thread pinning unavailable (%s)", _failed)
    return _lib


def _build_and_open() -> ctypes.CDLL:
    if not hasattr(os, "sched_setaffinity"):
        raise OSError("no sched_setaffinity on this platform")
    import torch  # noqa: F401  (its libgomp first, so ours resolves to it)

    path = library_path()
    if not path.is_file():
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise OSError("no C compiler (cc, gcc) on PATH")
        path.parent.mkdir(parents=True, exist_ok=True)
        # Concurrent builders (test workers, two engines) never share a file; the last rename wins.
        source = path.with_name(f"{path.stem}.{os.getpid()}.c")
        source.write_text(_SOURCE)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.so")
        try:
            subprocess.run(
                [compiler, *_FLAGS, str(source), "-o", str(tmp)], check=True, capture_output=True, timeout=120
            )
            tmp.replace(path)
        finally:  # a failed build leaves neither file behind
            source.unlink(missing_ok=True)
            tmp.unlink(missing_ok=True)
    lib = ctypes.CDLL(str(path))
    lib.tailserve_pin_team.restype = ctypes.c_int
    lib.tailserve_pin_team.argtypes = [
        ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_long)
    ]  # fmt: skip
    lib.tailserve_team_affinity.restype = None
    lib.tailserve_team_affinity.argtypes = [
        ctypes.c_int, ctypes.POINTER(ctypes.c_long), ctypes.POINTER(ctypes.c_ulonglong)
    ]  # fmt: skip
    return lib


def available() -> bool:
    return _load() is not None


def _require() -> ctypes.CDLL:
    lib = _load()
    if lib is None:
        raise OSError(f"OpenMP thread pinning unavailable ({_failed})")
    return lib


def pin_team(cpu_sets: list[list[int]]) -> list[int]:
    """Give team slot ``t`` of a parallel region opened by this thread the CPUs ``cpu_sets[t]``
    (slot 0 is this thread). Returns each slot's thread id; raises OSError when the library is
    missing or the kernel refuses a mask, ValueError when the runtime gave a smaller team."""
    lib = _require()
    n = len(cpu_sets)
    flat = [c for s in cpu_sets for c in s]
    offsets = [0]
    for s in cpu_sets:
        offsets.append(offsets[-1] + len(s))
    tids = (ctypes.c_long * n)()
    err = lib.tailserve_pin_team(
        n, (ctypes.c_int * len(flat))(*flat), (ctypes.c_int * (n + 1))(*offsets), tids
    )
    if err:
        raise OSError(err, f"sched_setaffinity: {os.strerror(err)}")
    if any(t < 0 for t in tids):
        raise ValueError(f"OpenMP gave a team of {sum(t >= 0 for t in tids)} threads, not {n}")
    return list(tids)


def team_affinity(n: int) -> list[tuple[int, set[int]]]:
    """(thread id, allowed CPUs among the first 64) of each slot of a team of ``n`` opened by
    this thread: what a test checks ``pin_team`` against."""
    lib = _require()
    tids = (ctypes.c_long * n)()
    masks = (ctypes.c_ulonglong * n)()
    lib.tailserve_team_affinity(n, tids, masks)
    return [(tids[t], {c for c in range(64) if masks[t] >> c & 1}) for t in range(n)]
