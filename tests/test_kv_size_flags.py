"""Engine flags that size the KV cache outright (``kv_capacity.KVSizeFlags``): vLLM's
``kv_cache_memory_bytes`` and ``num_gpu_blocks_override``, SGLang's ``max_total_tokens`` and
TensorRT-LLM's ``kv_cache_config.max_tokens``."""

from __future__ import annotations

import math

import pytest

from tailserve.assemble import BuildOptions, build_engine
from tailserve.engines.lint import lint
from tailserve.engines.translate import translate
from tailserve.executors.simulated.deployment import Deployment
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.kv_capacity import KVSizeFlags, kv_capacity
from tailserve.executors.simulated.models import get_model

DEP = Deployment("Llama-3-8B", "H100-SXM", 1, "none")


def _blocks(policy: str) -> int:
    built = build_engine(DEP, policy, "sim", BuildOptions(shares_prefixes=False))
    return built.scheduler.kv_cache.num_blocks


def test_each_flag_sizes_the_cache_as_its_engine_does():
    memory = _blocks("vllm")
    assert _blocks("vllm:num_gpu_blocks_override=777") == 777  # exactly
    assert _blocks(f"vllm:num_gpu_blocks_override={memory * 2}") == memory * 2  # even past the memory
    per_block = 16 * get_model("Llama-3-8B").kv_bytes_per_token(1)
    assert _blocks("vllm:kv_cache_memory_bytes=2000000000") == math.floor(2e9 / per_block)
    assert _blocks("vllm:kv_cache_memory_bytes=2000000000:gpu_memory_utilization=0.5") == math.floor(
        2e9 / per_block
    )
    sglang = _blocks("sglang")  # one-token pages
    assert _blocks("sglang:max_total_tokens=20000") == 20000  # at most
    assert _blocks(f"sglang:max_total_tokens={sglang * 3}") == sglang  # no more than memory gives
    trtllm = _blocks("trtllm")
    assert _blocks("trtllm:max_total_tokens=20000") == 20000 // 32  # 32-token blocks
    assert _blocks(f"trtllm:max_total_tokens={trtllm * 32 * 2}") == trtllm


def test_capacity_reports_the_cache_it_sized():
    model, gpu = get_model("Llama-3-8B"), get_hardware("H100-SXM")
    capped = kv_capacity(model, gpu, 1, 0.9, 16, 8192, sized=KVSizeFlags(num_gpu_blocks_override=100))
    assert capped.num_blocks == 100 and capped.kv_gib == pytest.approx(
        100 * 16 * model.kv_bytes_per_token(1) / 2**30
    )
    with pytest.raises(ValueError, match="holds no 16-token block"):
        kv_capacity(model, gpu, 1, 0.9, 16, 8192, sized=KVSizeFlags(kv_cache_memory_bytes=1000))
    with pytest.raises(ValueError, match="max_total_tokens must be >= 1"):
        KVSizeFlags(max_total_tokens=0)
    assert KVSizeFlags.of({"block_size": 16}) is None


def test_a_cache_smaller_than_one_sequence_names_the_flag():
    with pytest.raises(
        ValueError, match="max_total_tokens=2000 holds 2000 KV tokens, fewer than one sequence"
    ):
        build_engine(DEP, "sglang:max_total_tokens=2000", "sim", BuildOptions(shares_prefixes=False))


def test_launch_lines_carry_them(tmp_path):
    h100 = get_hardware("h100").device_info
    spec = translate(
        lint("vllm serve M --kv-cache-memory-bytes 20G --num-gpu-blocks-override 900"), h100
    ).spec
    assert spec.engine_flags["kv_cache_memory_bytes"] == 20 * 2**30
    assert spec.engine_flags["num_gpu_blocks_override"] == 900
    spec = translate(
        lint("python -m sglang.launch_server --model-path M --max-total-tokens 30000"), h100
    ).spec
    assert spec.engine_flags["max_total_tokens"] == 30000
    options = tmp_path / "o.yaml"
    options.write_text("kv_cache_config:\n  max_tokens: 40000\n")
    spec = translate(lint(f"trtllm-serve M --config {options}"), h100).spec
    assert spec.engine_flags["max_total_tokens"] == 40000
    assert (
        "num_gpu_blocks_override"
        in translate(lint("vllm serve M --num-gpu-blocks-override 9"), h100).spec.engine_flags
    )
    assert lint("vllm serve M --kv-cache-memory-bytes 8G", "0.8.5").refused  # not a flag there


def test_the_real_executor_refuses_them_before_loading(tmp_path):
    with pytest.raises(ValueError, match="num_gpu_blocks_override sizes the simulated KV cache"):
        build_engine(tmp_path / "no-model-here", "vllm:num_gpu_blocks_override=10", "torch")


@pytest.mark.parametrize(
    "text",
    [
        "vllm:num_gpu_blocks_override=900:kv_cache_memory_bytes=2000000000:gpu_memory_utilization=0.85:max_model_len=8192:block_size=32",
        "sglang:max_total_tokens=20000:gpu_memory_utilization=0.8:block_size=16:max_model_len=8192",
        "trtllm:max_total_tokens=40000:max_model_len=8192:gpu_memory_utilization=0.85:block_size=64",
    ],
)
def test_tunes_printed_line_carries_the_engine_flags_back(text, tmp_path, monkeypatch):
    """The line `tune` prints with the engine-wide flags a run set reads back to them."""
    import subprocess

    from tailserve.policies.registry import parse_policy_list
    from tailserve.tune.commands import command_line

    spec = parse_policy_list(text)[0]
    h100 = get_hardware("h100").device_info
    line = command_line(spec, Deployment.of("Llama-3-8B", "H100", 1), None, h100, 8192)
    assert line is not None
    monkeypatch.chdir(tmp_path)
    if " && " in line:  # TensorRT-LLM's YAML, written first
        setup, _, line = line.partition(" && ")
        subprocess.run(setup, shell=True, check=True)
    back = translate(lint(line), h100).spec
    assert back.engine_flags == spec.engine_flags
