"""The CPU level decides each operation's path; every level this machine can execute serves
correct tokens (``TAILSERVE_CPU_ISA`` forces the lower ones), and the generic PyTorch backend —
CUDA's path — equals transformers too."""

from __future__ import annotations

import random

import pytest
import torch

from tailserve.executors.pytorch import cpu_isa
from tailserve.executors.pytorch.backend import TorchBackend, auto_dtype
from tailserve.llm import LLM, SamplingParams
from torch_helpers import hf_greedy, micro_model

CPU = torch.device("cpu")
NATIVE = cpu_isa.native()  # this CPU (and OS), whatever TAILSERVE_CPU_ISA says
RUNNABLE = cpu_isa.LEVELS[: cpu_isa.LEVELS.index(NATIVE) + 1]
KV_GIB = 4096 * 512 / 2**30
MAX_NEW = 8

ZEN3 = {"avx2": True, "fma3": True, "avx512_f": False}  # AMD EPYC Zen 3: AVX2, no AVX-512
SKYLAKE_SP = {"avx2": True, "fma3": True, **{f"avx512_{f}": True for f in ["f", "bw", "vl", "dq"]}}
ZEN4 = {**SKYLAKE_SP, "avx512_bf16": True}  # also Cooper Lake: bf16 dot products, no AMX
SAPPHIRE_RAPIDS = {**ZEN4, "amx_tile": True, "amx_bf16": True}


def test_native_level_from_the_cpus_features():
    assert cpu_isa.native_level(ZEN3, "x86_64") == "avx2"
    assert cpu_isa.native_level(SKYLAKE_SP, "x86_64") == "avx512"
    assert cpu_isa.native_level(ZEN4, "x86_64") == "avx512_bf16"
    assert cpu_isa.native_level(SAPPHIRE_RAPIDS, "x86_64") == "amx_bf16"
    assert cpu_isa.native_level({**ZEN4, "amx_tile": True}, "x86_64") == "avx512_bf16"  # int8 tiles only
    assert cpu_isa.native_level({"avx2": True}, "x86_64") == "generic"  # AVX2 without FMA
    assert cpu_isa.native_level(SAPPHIRE_RAPIDS, "aarch64") == "generic"  # Graviton, Apple M


def test_amx_the_os_does_not_grant_runs_at_avx512_bf16(monkeypatch, caplog):
    """CPUID shows AMX in guests and on kernels before 5.16 that never enable the tile state:
    the level stays at avx512_bf16, with one line, instead of a fault at the first tile load."""
    monkeypatch.setattr(cpu_isa, "native_level", lambda: "amx_bf16")
    monkeypatch.setattr(cpu_isa, "amx_permitted", lambda: False)
    cpu_isa._native.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="tailserve.executors.pytorch.cpu_isa"):
            assert cpu_isa._native() == "avx512_bf16"
        assert "does not grant its tile state" in caplog.text
        monkeypatch.setattr(cpu_isa, "amx_permitted", lambda: True)
        cpu_isa._native.cache_clear()
        assert cpu_isa._native() == "amx_bf16"
    finally:
        monkeypatch.undo()
        cpu_isa._native.cache_clear()
    assert cpu_isa._native() == NATIVE


def test_a_level_can_be_forced_down_never_up():
    isa = cpu_isa.resolve("avx512_bf16", "avx2", "x86_64")
    assert isa.forced and isa.level == "avx2" and isa.at_least("generic") and not isa.at_least("avx512")
    assert "forced by TAILSERVE_CPU_ISA (the CPU has avx512_bf16)" in isa.label()
    assert cpu_isa.resolve("avx2", "auto", "x86_64").level == "avx2"
    with pytest.raises(cpu_isa.CpuIsaError, match="executes at most avx2"):
        cpu_isa.resolve("avx2", "avx512_bf16", "x86_64")
    with pytest.raises(cpu_isa.CpuIsaError, match="expected one of auto, amx_bf16, avx512_bf16"):
        cpu_isa.resolve("avx2", "sse9", "x86_64")


def test_forcing_also_lowers_torchs_dispatch_at_start_up(monkeypatch):
    monkeypatch.setenv("TAILSERVE_CPU_ISA", "avx2")
    for key in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        # setenv first: delenv of an absent variable records nothing to restore, and the caps
        # left behind made oneDNN refuse a later test's AVX-512 bf16 reorder in this process
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    cpu_isa.apply_forced_level()
    import os

    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2" and os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"


def test_auto_dtype_is_float32_below_avx2_and_says_why(monkeypatch):
    _force(monkeypatch, "generic")
    dtype, why = auto_dtype(CPU)
    assert dtype == "float32" and "level is generic" in why


def test_auto_dtype_at_avx2_is_bfloat16_where_the_avx2_kernel_runs(monkeypatch):
    """bf16 weights through tailserve's AVX2 kernel (~2x float32's MKL at a decode batch of 64
    on a Zen 3); float32, said in one line, where that kernel is unavailable."""
    from tailserve.executors.pytorch import cpu_kernels

    _force(monkeypatch, "avx2")
    dtype, why = auto_dtype(CPU)
    if cpu_kernels.linear_avx2_kernel() is not None:
        assert (dtype, why) == ("bfloat16", None)
    else:
        assert dtype == "float32" and "level is avx2" in why


def test_auto_dtype_is_bfloat16_with_avx512(monkeypatch):
    _force(monkeypatch, "avx512")
    assert auto_dtype(CPU) == ("bfloat16", None)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"float32": micro_model(root), "bfloat16": micro_model(root, "bf16", dtype="bfloat16")}


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(11)
    return [[1] + [rng.randrange(3, 512) for _ in range(n - 1)] for n in (5, 40, 17, 60)]


@pytest.fixture(scope="module")
def reference(model_dirs, prompts):
    return hf_greedy(model_dirs["float32"], prompts, MAX_NEW)


def _generate(model_dir, prompts, dtype):
    llm = LLM(
        str(model_dir),
        dtype=dtype,
        kv_cache_memory_gib=KV_GIB,
        check_integrity=True,
        max_num_batched_tokens=24,  # chunked prefills share steps with decodes
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
    )
    return llm, [o.token_ids for o in outs]


def _force(monkeypatch, level: str) -> None:
    if level not in RUNNABLE:
        pytest.skip(f"this CPU executes at most {NATIVE}, not {level}")
    monkeypatch.setenv("TAILSERVE_CPU_ISA", level)


@pytest.mark.parametrize("level", cpu_isa.LEVELS)
def test_every_runnable_level_gives_transformers_tokens_in_float32(
    monkeypatch, model_dirs, prompts, reference, level
):
    _force(monkeypatch, level)
    llm, tokens = _generate(model_dirs["float32"], prompts, "float32")
    assert tokens == reference
    assert f"cpu path {level}" in llm.engine.description


@pytest.mark.parametrize("level", cpu_isa.LEVELS)
def test_every_runnable_level_serves_bfloat16(monkeypatch, model_dirs, prompts, level):
    """bf16 weights on any level: the path that level has (AMX, dpbf16, oneDNN, the AVX2 kernel
    or F.linear), no crash;
    the first token agrees with transformers in bf16 (later ones may differ by rounding)."""
    _force(monkeypatch, level)
    llm, tokens = _generate(model_dirs["bfloat16"], prompts, "bfloat16")
    want = hf_greedy(model_dirs["bfloat16"], prompts, 2, dtype=torch.bfloat16)
    assert [t[0] for t in tokens] == [w[0] for w in want]
    description = llm.engine.description
    expected = {
        "amx_bf16": "linear AMX kernel",
        "avx512_bf16": "linear dpbf16 kernel",
        "avx512": "linear oneDNN prepacked",
        "avx2": "linear bf16->fp32 FMA kernel (AVX2)",
        "generic": "linear F.linear (PyTorch's generic bf16 GEMM)",
    }[level]
    assert expected in description, description


def test_the_default_dtype_runs_here(model_dirs, prompts):
    """``dtype`` auto: bf16 where the CPU has a bf16 matmul, float32 (exact) elsewhere."""
    llm, tokens = _generate(model_dirs["bfloat16"], prompts[:2], "auto")
    resolved, _ = auto_dtype(CPU)
    assert f", {resolved}, cpu" in llm.engine.description
    assert all(len(t) == MAX_NEW for t in tokens)


def test_the_generic_torch_backend_cudas_path_matches_transformers(model_dirs, prompts):
    """``TorchBackend`` (SDPA decode over gathered context, per-chunk prefill SDPA, PyTorch's
    norms) on CPU: a chunk after cached context and decodes in one step, logits as transformers'."""
    from transformers import AutoModelForCausalLM

    from tailserve.executors.pytorch.attention import PagedKVCache, build_metadata
    from tailserve.executors.pytorch.loader import load_config, load_state_dict
    from tailserve.executors.pytorch.model import LlamaModel

    d = model_dirs["float32"]
    config = load_config(d)
    model = LlamaModel(
        config, load_state_dict(d, config, torch.float32), torch.float32, CPU, TorchBackend(CPU)
    )
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    a, b = torch.tensor(prompts[1]), torch.tensor(prompts[3])  # 40 and 60 tokens
    kv = PagedKVCache(
        config.num_hidden_layers, 16, 16, config.num_key_value_heads, config.head_dim, torch.float32, CPU
    )
    ta, tb = [0, 1, 2], [3, 4, 5, 6]
    with torch.inference_mode():
        # Step 1: a's first 39 tokens and b's first 30 (two prefills).
        meta = build_metadata([ta, tb], [39, 30], [0, 0], 0, 16, kv.null_slot, CPU)
        model.forward(torch.cat([a[:39], b[:30]]), torch.cat([torch.arange(39), torch.arange(30)]), meta, kv)
        # Step 2: a decodes its 40th token, b prefills the rest over its cached 30.
        meta = build_metadata([ta, tb], [1, 30], [39, 30], 1, 16, kv.null_slot, CPU)
        ids = torch.cat([a[39:], b[30:]])
        pos = torch.cat([torch.tensor([39]), torch.arange(30, 60)])
        got = model.compute_logits(model.forward(ids, pos, meta, kv, out_rows=torch.tensor([0, 30])))
        want = torch.stack([ref(a[None]).logits[0, -1], ref(b[None]).logits[0, -1]])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert TorchBackend(CPU).describe(torch.float32).startswith("cpu: PyTorch ops")


@pytest.mark.parametrize(
    "env,argv,message",
    [
        ({"TAILSERVE_CPU_ISA": "sse9"}, [], "TAILSERVE_CPU_ISA='sse9': expected one of auto"),
        ({}, ["--device", "bogus"], "--device 'bogus': not a torch device"),
        ({}, ["--device", "mps"], "device 'mps' was asked for but torch.mps.is_available() is False"),
    ],
)
def test_a_bad_level_or_device_is_one_line_and_exit_2(
    tmp_path, monkeypatch, capsys, model_dirs, env, argv, message
):
    from tailserve.cli import main

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    code = main(["run", "--model", str(model_dirs["float32"]), "--prompts", str(prompts), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("tailserve: error: ")
    assert message in err[0]
