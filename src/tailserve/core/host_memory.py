"""The host's memory the kernel says can still be allocated: read by the real executor sizing
its CPU KV cache and by the CLI refusing a workload that would not fit (no torch here: the
simulator never imports it)."""

from __future__ import annotations

from pathlib import Path


def cpu_memory_available(meminfo: Path = Path("/proc/meminfo")) -> float | None:
    """Bytes the kernel says can be allocated without swapping (``MemAvailable``); None where
    unknown (not Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
