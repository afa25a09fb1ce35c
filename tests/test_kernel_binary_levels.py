"""Each CPU level's compiled kernels hold no instruction above that level.

Tests run a lower level by forcing it (``TAILSERVE_CPU_ISA``) on whatever machine CI has, so a
kernel that slipped an AVX-512 instruction into the AVX2 build (an intrinsic outside its
``#if``, a ``-march`` too high) would pass every test on an AVX-512 machine and die with SIGILL
on the AVX2-only Zen 3 the next session may get. The disassembly says it here instead: in 64-bit
code an instruction that starts with 0x62 is EVEX (AVX-512), with 0xC4/0xC5 VEX (AVX/AVX2).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tailserve.executors.pytorch import cpu_isa, cpu_kernels

RUNNABLE = cpu_isa.LEVELS[: cpu_isa.LEVELS.index(cpu_isa.native()) + 1]
_SEGMENT_OR_ADDRESS = {"26", "2e", "36", "3e", "64", "65", "67"}  # prefixes allowed before VEX/EVEX
_BF16 = re.compile(r"^(vdpbf16ps|vcvtne2ps2bf16|vcvtneps2bf16)\b")
_AMX = re.compile(r"^(ldtilecfg|sttilecfg|tile\w+|tdp\w+)\b")


def _instructions(so: Path) -> list[tuple[list[str], str]]:
    """(bytes, mnemonic and operands) of every instruction in ``so``'s code."""
    text = subprocess.run(
        ["objdump", "-d", "--insn-width=16", str(so)], check=True, capture_output=True, text=True
    ).stdout
    out = []
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) < 3 or not parts[0].rstrip().endswith(":"):
            continue  # headers, labels, padding with no mnemonic
        out.append((parts[1].split(), parts[2].strip()))
    return out


def _encoding(raw: list[str]) -> str:
    rest = raw
    while rest and rest[0] in _SEGMENT_OR_ADDRESS:
        rest = rest[1:]
    if not rest:
        return "legacy"
    return {"62": "evex", "c4": "vex", "c5": "vex"}.get(rest[0], "legacy")


@pytest.fixture()
def kernels_at(monkeypatch):
    def build(level: str) -> Path:
        if level not in RUNNABLE:
            pytest.skip(f"this CPU executes at most {RUNNABLE[-1]}, not {level}")
        if shutil.which("objdump") is None:
            pytest.skip("no objdump (binutils) on PATH")
        monkeypatch.setenv("TAILSERVE_CPU_ISA", level)
        module = cpu_kernels.load()
        if module is None:
            pytest.skip(f"the kernels did not build here: {cpu_kernels.failure(level)}")
        return Path(module.__file__)

    return build


def test_the_generic_build_has_no_vex_or_evex_instruction(kernels_at):
    """The compiler's default target (x86-64, SSE2): what an old x86 without AVX2 executes."""
    found = [(raw, asm) for raw, asm in _instructions(kernels_at("generic")) if _encoding(raw) != "legacy"]
    assert not found, f"{len(found)} AVX instructions in the generic build, first: {found[:3]}"


def test_the_avx2_build_uses_avx2_fmas_and_no_avx512_instruction(kernels_at):
    instructions = _instructions(kernels_at("avx2"))
    evex = [(raw, asm) for raw, asm in instructions if _encoding(raw) == "evex"]
    assert not evex, f"{len(evex)} AVX-512 (EVEX) instructions in the avx2 build, first: {evex[:3]}"
    # The AVX2 kernels really are in it (else the check above proves nothing).
    assert any(asm.startswith("vfmadd") and "%ymm" in asm for _, asm in instructions)


def test_the_avx512_build_has_no_bf16_instruction(kernels_at):
    """Level avx512 is Skylake-SP/Ice Lake: AVX-512 F/BW/VL/DQ without AVX512_BF16."""
    instructions = _instructions(kernels_at("avx512"))
    bf16 = [asm for _, asm in instructions if _BF16.match(asm)]
    assert not bf16, f"{len(bf16)} AVX512_BF16 instructions in the avx512 build, first: {bf16[:3]}"
    assert any(_encoding(raw) == "evex" and "%zmm" in asm for raw, asm in instructions)


def test_the_avx512_bf16_build_uses_dpbf16(kernels_at):
    """The first level allowed bf16 dot products uses them (the decode attention and the linear)."""
    assert any(_BF16.match(asm) for _, asm in _instructions(kernels_at("avx512_bf16")))


def test_the_avx512_bf16_build_has_no_tile_instruction(kernels_at):
    """Zen 4 and Cooper Lake have avx512_bf16 but no AMX: their build must not touch a tile."""
    tiles = [asm for _, asm in _instructions(kernels_at("avx512_bf16")) if _AMX.match(asm)]
    assert not tiles, f"{len(tiles)} AMX instructions in the avx512_bf16 build, first: {tiles[:3]}"


def test_the_amx_build_uses_tiles(kernels_at):
    amx = {asm.split()[0] for _, asm in _instructions(kernels_at("amx_bf16")) if _AMX.match(asm)}
    assert {"ldtilecfg", "tileloadd", "tdpbf16ps", "tilestored", "tilerelease"} <= amx, amx


def test_the_encoding_reader_on_known_bytes():
    assert _encoding(["62", "f1", "7c", "48", "58", "c1"]) == "evex"  # vaddps %zmm1,%zmm0,%zmm0
    assert _encoding(["67", "62", "f2", "7d", "48", "18", "00"]) == "evex"
    assert _encoding(["c5", "fc", "58", "c1"]) == "vex"  # vaddps %ymm1,%ymm0,%ymm0
    assert _encoding(["c4", "e2", "7d", "b8", "c1"]) == "vex"  # vfmadd231ps
    assert _encoding(["0f", "58", "c1"]) == "legacy"  # addps %xmm1,%xmm0
    assert _encoding(["66", "0f", "58", "c1"]) == "legacy"  # addpd
