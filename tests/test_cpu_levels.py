"""The kernel and executor tests at every lower CPU level this machine can execute, each in a
process that runs as a CPU of that level would: ``TAILSERVE_CPU_ISA`` picks tailserve's paths
and kernel build, ``ATEN_CPU_CAPABILITY`` / ``ONEDNN_MAX_CPU_ISA`` PyTorch's own dispatch (read
once per process, hence the subprocess). The suite itself runs the machine's own level, so on
an AVX-512 bf16 machine this covers what an AVX-512, an AVX2 and an ARM/old-x86 CPU run; on an
AVX2 machine, the generic level. One test per level on every machine (same count everywhere)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO
from tailserve.executors.pytorch import cpu_isa

NATIVE = cpu_isa.native()

# The tests whose paths depend on the level: kernels, norms, packing, the model's out rows, and
# the executor end to end (float32 tokens vs transformers, bf16, the pure-PyTorch fallback).
TESTS = [
    "tests/test_cpu_kernel.py",
    "tests/test_cpu_kernels_fused.py",
    "tests/test_cpu_norm_exact.py",
    "tests/test_model_out_rows.py",
    "tests/test_packed_linear.py",
    "tests/test_cpu_avx2.py",
    "tests/test_torch_executor.py::test_logits_of_one_forward_match_transformers",
    "tests/test_torch_executor.py::test_bfloat16_runs_and_mostly_agrees",
    "tests/test_torch_executor.py::test_pytorch_attention_path_gives_the_same_tokens",
    "tests/test_cpu_isa.py::test_the_default_dtype_runs_here",
]


@pytest.mark.parametrize("level", cpu_isa.LEVELS)
def test_level_passes_the_kernel_and_executor_tests(level, tmp_path):
    if level == NATIVE:
        pytest.skip(f"{level} is this CPU's own level: the rest of the suite runs it")
    if cpu_isa.LEVELS.index(level) > cpu_isa.LEVELS.index(NATIVE):
        pytest.skip(f"this CPU executes at most {NATIVE}, not {level}")
    env = {**os.environ, cpu_isa.ENV: level, **cpu_isa.torch_capability_env(level)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
    assert done.returncode == 0, f"at TAILSERVE_CPU_ISA={level}:\n{tail}"
    assert " passed" in tail and " failed" not in tail, tail
