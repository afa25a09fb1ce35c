"""Building the CPU kernel says so in one line, and its cache is keyed by the install."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.utils.cpp_extension

from tailserve.executors.pytorch import cpu_isa, cpu_kernels


def _fake_build(calls: list[dict]):
    def load_inline(**kwargs):
        calls.append(kwargs)
        Path(kwargs["build_directory"], f"{kwargs['name']}.so").touch()
        return object()

    return load_inline


def test_first_build_prints_one_line_and_later_loads_are_silent(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TAILSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("TAILSERVE_CPU_KERNEL", "1")
    calls: list[dict] = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", _fake_build(calls))
    monkeypatch.setattr(cpu_kernels, "_modules", {})
    monkeypatch.setattr(cpu_kernels, "_failures", {})
    assert cpu_kernels.load() is not None
    err = capsys.readouterr().err.splitlines()
    level = cpu_isa.detect().level
    assert len(err) == 1 and f"building the fused CPU kernels for {level}, ~1 min, once" in err[0]
    assert calls[0]["build_directory"] == str(tmp_path / "kernels" / cpu_kernels.build_name())
    assert "-march=native" not in calls[0]["extra_cflags"]  # the level decides the instructions
    monkeypatch.setattr(cpu_kernels, "_modules", {})  # a new process: the build is on disk
    assert cpu_kernels.load() is not None
    assert capsys.readouterr().err == "" and len(calls) == 2


def test_build_is_keyed_by_torch_version_and_source(monkeypatch):
    name = cpu_kernels.build_name()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    other_torch = cpu_kernels.build_name()
    monkeypatch.setattr(cpu_kernels, "_SOURCE", cpu_kernels._SOURCE + "// changed\n")
    assert len({name, other_torch, cpu_kernels.build_name()}) == 3


def test_each_cpu_level_is_its_own_build(monkeypatch):
    """A forced lower level compiles for that level (its -march) into its own build."""
    native = cpu_isa.detect().native
    names = {}
    for level in cpu_isa.LEVELS:
        isa = cpu_isa.CpuIsa(native, level, "x86_64")
        names[level] = cpu_kernels.build_name(isa)
    assert len(set(names.values())) == len(cpu_isa.LEVELS)
    assert cpu_isa.CpuIsa("avx2", "avx2", "x86_64").compile_flags[0] == "-march=x86-64-v3"
    assert cpu_isa.CpuIsa("avx512", "generic", "x86_64").compile_flags == []
    assert cpu_isa.CpuIsa("generic", "generic", "aarch64").compile_flags == []


def test_a_compiler_without_amx_gets_the_avx512_bf16_build(tmp_path, monkeypatch, caplog):
    """GCC before 11 knows no -mamx-tile: at amx_bf16 the build falls back to avx512_bf16's
    (every kernel but the AMX ones) with one line, instead of losing all the kernels."""
    monkeypatch.setenv("TAILSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("TAILSERVE_CPU_KERNEL", "1")
    amx = cpu_isa.CpuIsa("amx_bf16", "amx_bf16", "x86_64")
    monkeypatch.setattr(cpu_isa, "detect", lambda: amx)
    calls: list[dict] = []
    fake = _fake_build(calls)

    def load_inline(**kwargs):
        if "-mamx-tile" in kwargs["extra_cflags"]:
            raise RuntimeError("g++: error: unrecognized command-line option '-mamx-tile'")
        return fake(**kwargs)

    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", load_inline)
    monkeypatch.setattr(cpu_kernels, "_modules", {})
    monkeypatch.setattr(cpu_kernels, "_failures", {})
    monkeypatch.setattr(cpu_kernels, "_amx_failure", [])
    with caplog.at_level("WARNING", logger="tailserve.executors.pytorch.cpu_kernels"):
        assert cpu_kernels.load() is not None
    assert "CPU kernels for amx_bf16 unavailable" in caplog.text and "unrecognized" in caplog.text
    assert len(calls) == 1 and "-mavx512bf16" in calls[0]["extra_cflags"]
    assert "-mamx-tile" not in calls[0]["extra_cflags"]
    assert cpu_kernels.failure("amx_bf16") is None and "unrecognized" in cpu_kernels.amx_failure()
    assert cpu_kernels.load() is not None and len(calls) == 1  # kept for the process
