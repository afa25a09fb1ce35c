"""The host facts printed beside every timing: the CPU's SIMD features (AVX-512, AMX), since
tailserve's and the peers' ratios depend on them."""

from __future__ import annotations

from pathlib import Path


def simd_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The CPU's AVX-512 and AMX flags, sorted; [] where /proc/cpuinfo is unreadable."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith("flags"):
            return sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx512", "amx")))
    return []
