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
    if level not in cpu_isa.LEVELS[: cpu_isa.LEVELS.index(cpu_isa.native()) + 1]:
        pytest.skip(f"this CPU executes at most {cpu_isa.native()}")
    from benchmarks.engine_cpu import limit_gemm_dtype

    monkeypatch.setenv("TAILSERVE_CPU_ISA", level)
    assert limit_gemm_dtype("bfloat16") == ("float32" if level == "avx2" else "bfloat16")
    assert limit_gemm_dtype("float32") == "float32"


def test_also_levels_takes_only_levels_that_run_true_in_one_process(monkeypatch):
    """``engine_cpu --also-levels``: tailserve again at a lower level in the same process (an
    AMX CPU's avx512_bf16 path beside its own). PyTorch's dispatch is read once, so only a level
    that makes no oneDNN call is allowed; its own level, a higher one or a typo is refused."""
    from benchmarks.engine_cpu import IN_PROCESS_LEVELS, check_args, parse_args

    monkeypatch.delenv("TAILSERVE_CPU_ISA", raising=False)
    run = cpu_isa.detect().level
    for bad in (run, "avx2", "avx1024"):
        with pytest.raises(ValueError, match=f"--also-levels: '{bad}' cannot run beside this run's {run}"):
            check_args(parse_args(["--models", "tiny", "--also-levels", bad]))
    if "avx512_bf16" in cpu_isa.LEVELS[: cpu_isa.LEVELS.index(cpu_isa.native()) + 1]:
        monkeypatch.setenv("TAILSERVE_CPU_ISA", "avx512_bf16")  # a forced run: nothing below it
        with pytest.raises(ValueError, match="can: none"):
            check_args(parse_args(["--models", "tiny", "--also-levels", "avx512"]))
        monkeypatch.delenv("TAILSERVE_CPU_ISA")
    assert IN_PROCESS_LEVELS == {"amx_bf16": ("avx512_bf16",)}
    if run == "amx_bf16":
        args = parse_args(["--models", "tiny", "--also-levels", " avx512_bf16, "])
        check_args(args)
        assert args.also_levels == ["avx512_bf16"]
