"""Which CPU code path the real executor takes, decided once per process.

Five levels, highest first. Each names what the machine can execute and so which kernel each
operation gets (``paths``):

============  ==============================  ===========================  ======================
level         bf16 linear layers              bf16 attention               kernels compiled for
============  ==============================  ===========================  ======================
amx_bf16      tailserve's AMX kernel (tiles   dpbf16 decode, AMX prefill   x86-64-v4 + avx512bf16
              over the dpbf16 packing)                                     + amx-tile, amx-bf16
avx512_bf16   tailserve's dpbf16 kernel       dpbf16 decode and prefill    x86-64-v4 + avx512bf16
avx512        oneDNN, prepacked weights       portable decode, SDPA        x86-64-v4
avx2          tailserve's AVX2 kernel (bf16   AVX2 decode and prefill      x86-64-v3
              weights, float32 FMAs)
generic       PyTorch's generic ``F.linear``  portable decode, SDPA        the compiler's default
============  ==============================  ===========================  ======================

float32 models take ``F.linear`` (MKL) and PyTorch's norms everywhere: the path that must equal
``transformers`` token for token (their decode attention is the AVX2 kernel at avx2, float32
loops elsewhere). ``generic`` is every CPU that is not x86-64 with AVX2 (aarch64, older x86).
``amx_bf16`` (Sapphire Rapids and later) also needs the OS to grant the tile state
(``amx_permitted``); where it does not, the CPU runs at avx512_bf16, said in one line.
oneDNN's prepacked bf16 matmul needs avx512bw/vl/dq (or avx_ne_convert); called without them it
raises, which is why the level is read before any weight is packed.

The machine's level comes from CPUID (``torch.cpu.get_capabilities``, the cpuinfo library), not
``/proc/cpuinfo``: under an emulator (``qemu-x86_64 -cpu Haswell``) the file shows the host's
flags while the instructions that run are the emulated CPU's. ``TAILSERVE_CPU_ISA`` forces a lower
level, so that an AVX-512 machine runs the code an AVX2 or ARM machine runs (a level above the
machine's is refused with one line, not a crash later).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import sys
from dataclasses import dataclass

LEVELS = ("generic", "avx2", "avx512", "avx512_bf16", "amx_bf16")  # lowest first
ENV = "TAILSERVE_CPU_ISA"
log = logging.getLogger(__name__)

# The kernels are compiled for the level, never ``-march=native``: the level, not the compiling
# machine, decides the instructions (an emulated CPU runs g++ natively, which would otherwise
# target the host). ``-mtune=native`` only schedules and is safe anywhere.
_MARCH = {
    "amx_bf16": ["-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
    "avx512_bf16": ["-march=x86-64-v4", "-mavx512bf16"],
    "avx512": ["-march=x86-64-v4"],
    "avx2": ["-march=x86-64-v3"],
    "generic": [],
}


class CpuIsaError(ValueError):
    """``TAILSERVE_CPU_ISA`` names an unknown level or one the CPU cannot execute."""


@dataclass(frozen=True, slots=True)
class CpuIsa:
    native: str  # the highest level this CPU executes
    level: str  # the level tailserve uses: ``native`` or a lower one forced by TAILSERVE_CPU_ISA
    machine: str  # platform.machine(): x86_64, aarch64, ...

    @property
    def forced(self) -> bool:
        return self.level != self.native

    def at_least(self, level: str) -> bool:
        return LEVELS.index(self.level) >= LEVELS.index(level)

    @property
    def compile_flags(self) -> list[str]:
        if self.machine not in ("x86_64", "AMD64"):
            return []
        return [*_MARCH[self.level], "-mtune=native"] if self.level != "generic" else []

    @property
    def runnable(self) -> tuple[str, ...]:
        """Every level this CPU can execute, lowest first (what tests parametrise over)."""
        return LEVELS[: LEVELS.index(self.native) + 1]

    def label(self) -> str:
        forced = f", forced by {ENV} (the CPU has {self.native})" if self.forced else ""
        return f"{self.level}{forced}"


def _capabilities() -> dict[str, object]:
    import torch

    get = getattr(torch.cpu, "get_capabilities", None)
    if get is not None:
        return dict(get())
    # Older torch: the kernel's view of the flags (not emulator-proof, but only a fallback).
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    rename = {"avx512f": "avx512_f", "avx512bw": "avx512_bw", "avx512vl": "avx512_vl",
              "avx512dq": "avx512_dq", "fma": "fma3"}  # fmt: skip
    return {rename.get(f, f): True for f in flags}


def native_level(caps: dict[str, object] | None = None, machine: str | None = None) -> str:
    caps = _capabilities() if caps is None else caps
    machine = platform.machine() if machine is None else machine
    if machine not in ("x86_64", "AMD64"):
        return "generic"
    avx512 = all(caps.get(f) for f in ("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq"))
    if avx512 and caps.get("avx512_bf16") and caps.get("amx_bf16") and caps.get("amx_tile"):
        return "amx_bf16"
    if avx512 and caps.get("avx512_bf16"):
        return "avx512_bf16"
    if avx512:
        return "avx512"
    if caps.get("avx2") and caps.get("fma3"):
        return "avx2"
    return "generic"


def resolve(native: str, requested: str | None, machine: str) -> CpuIsa:
    """The level to use: ``requested`` (TAILSERVE_CPU_ISA, empty or ``auto`` for the machine's)."""
    if not requested or requested == "auto":
        return CpuIsa(native, native, machine)
    if requested not in LEVELS:
        raise CpuIsaError(f"{ENV}={requested!r}: expected one of auto, {', '.join(reversed(LEVELS))}")
    if LEVELS.index(requested) > LEVELS.index(native):
        raise CpuIsaError(
            f"{ENV}={requested}: this CPU executes at most {native} "
            f"(levels it can run: {', '.join(LEVELS[: LEVELS.index(native) + 1])})"
        )
    return CpuIsa(native, requested, machine)


def amx_permitted() -> bool:
    """Whether Linux grants this process the AMX tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA)``, kernel 5.16+): CPUID can show amx_bf16 in a guest or on an older
    kernel that never enables the tiles, and the first tile instruction would then fault."""
    import ctypes

    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        # SYS_arch_prctl (158 on x86-64), ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
        return libc.syscall(ctypes.c_long(158), ctypes.c_long(0x1023), ctypes.c_long(18)) == 0
    except Exception:  # no libc symbol, a sandbox refusing the call: no tiles, not a crash
        return False


@functools.cache
def _native() -> str:
    level = native_level()
    if level == "amx_bf16" and not amx_permitted():
        log.warning(
            "the CPU has AMX but the OS does not grant its tile state (Linux 5.16+ does): "
            "it runs as a CPU without AMX (level avx512_bf16)"
        )
        return "avx512_bf16"
    return level


def native() -> str:
    """The highest level this process can run: CPUID's (``native_level``), lowered to
    avx512_bf16 where the OS withholds the AMX tiles. What tests and benchmarks mean by "this
    CPU's level"."""
    return _native()


def detect() -> CpuIsa:
    """The level for this process: the CPU's, or the one ``TAILSERVE_CPU_ISA`` names. Read on
    every call (cheap) so a test can switch levels in one process; CPUID is read once."""
    return resolve(_native(), os.environ.get(ENV, "").strip().lower() or None, platform.machine())


def check_env() -> str | None:
    """The one-line error for a bad ``TAILSERVE_CPU_ISA``, or None (for CLI start-up)."""
    try:
        detect()
    except CpuIsaError as e:
        return str(e)
    return None


def torch_capability_env(level: str) -> dict[str, str]:
    """Environment that makes PyTorch's own kernels (ATen's dispatch, oneDNN) take the code a
    CPU of ``level`` takes. Only effective before torch runs its first kernel, so the CLI sets
    it at start-up (``apply_forced_level``); a process that switches levels later keeps
    torch's dispatch and switches only tailserve's own choices."""
    aten = {
        "amx_bf16": "avx512",
        "avx512_bf16": "avx512",
        "avx512": "avx512",
        "avx2": "avx2",
        "generic": "default",
    }[level]
    onednn = {
        "amx_bf16": "AVX512_CORE_AMX",
        "avx512_bf16": "AVX512_CORE_BF16",
        "avx512": "AVX512_CORE",
        "avx2": "AVX2",
        "generic": "SSE41",
    }
    return {"ATEN_CPU_CAPABILITY": aten, "ONEDNN_MAX_CPU_ISA": onednn[level]}


def apply_forced_level() -> None:
    """At CLI start-up, before torch is used: a forced lower level also lowers torch's dispatch."""
    level = os.environ.get(ENV, "").strip().lower()
    if level in LEVELS and level != LEVELS[-1]:
        for key, value in torch_capability_env(level).items():
            os.environ.setdefault(key, value)
