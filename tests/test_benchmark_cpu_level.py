"""The CPU benchmarks name the AVX2 level's flags and set the AVX2 path against the right limit."""

from __future__ import annotations

import pytest

from tailserve.executors.pytorch import cpu_isa


def test_simd_flags_name_avx2_fma_f16c_beside_avx512(tmp_path):
    from benchmarks._common import simd_flags

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "model name\t: X\nflags\t\t: fpu sse2 avx f16c fma avx2 bmi2 avx512f avx512_bf16 amx_tile\n"
    )
    assert simd_flags(cpuinfo) == ["amx_tile", "avx2", "avx512_bf16", "avx512f", "f16c", "fma"]
    cpuinfo.write_text("flags\t\t: fpu sse2 avx f16c fma avx2\n")  # Zen 3: the avx2 level alone
    assert simd_flags(cpuinfo) == ["avx2", "f16c", "fma"]


@pytest.mark.parametrize("level", ["avx2", "generic"])
def test_the_prefill_limit_at_avx2_is_the_float32_gemm_rate(monkeypatch, level):
    """tailserve's AVX2 kernel multiplies bf16 weights with float32 FMAs: its limit is float32's
    rate (PyTorch's bf16 matmul there is the slow generic one); elsewhere the model's dtype."""
    if level not in cpu_isa.LEVELS[: cpu_isa.LEVELS.index(cpu_isa.native_level()) + 1]:
        pytest.skip(f"this CPU executes at most {cpu_isa.native_level()}")
    from benchmarks.engine_cpu import limit_gemm_dtype

    monkeypatch.setenv("TAILSERVE_CPU_ISA", level)
    assert limit_gemm_dtype("bfloat16") == ("float32" if level == "avx2" else "bfloat16")
    assert limit_gemm_dtype("float32") == "float32"
