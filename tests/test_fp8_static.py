"""Static-scale FP8 checkpoints (``fp8_static``): read from each config form that declares static
per-tensor activation scales, priced on the fused-MoE kernel vLLM 0.32 runs for them (FlashInfer
CUTLASS on Hopper, FlashInfer TRT-LLM on Blackwell) and on the dense FP8 GEMMs of ``fp8``."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from tests.test_model_configs import CATALOG_CONFIGS, LLAMA_3_1_8B

from tailserve.cli import main
from tailserve.executors.simulated.cost_model import BatchShape, CostModel
from tailserve.executors.simulated.deployment import Deployment
from tailserve.executors.simulated.hardware import engine_hardware, get_hardware
from tailserve.executors.simulated.hf_config import load_hf_config
from tailserve.executors.simulated.models import get_model
from tailserve.executors.simulated.precision import gemm_format, get_precision


def _write(tmp_path, cfg: dict, hf_quant: dict | None = None):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if hf_quant is not None:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return tmp_path


def _ct_group(weights: dict, acts: dict | None) -> dict:
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", **weights}}
    if acts is not None:
        group["input_activations"] = {"num_bits": 8, "type": "float", **acts}
    return {"quant_method": "compressed-tensors", "config_groups": {"group_0": group}}


@pytest.mark.parametrize(
    ("quantization", "expected"),
    [
        # ModelOpt in config.json (quant_algo upper-cased as vLLM does; kv_cache_scheme its KV form)
        ({"quant_method": "modelopt", "quant_algo": "FP8"}, ("fp8_static", "")),
        ({"quant_method": "modelopt", "quant_algo": "fp8", "kv_cache_scheme": {"num_bits": 8, "type": "float"}},
         ("fp8_static", "fp8")),
        ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}, ("fp8_static", "fp8")),
        # the fp8 method: AutoFP8's static activations, dynamic, absent (dynamic), 128 x 128 blocks
        ({"quant_method": "fp8", "activation_scheme": "static"}, ("fp8_static", "")),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, ("fp8", "")),
        ({"quant_method": "fp8"}, ("fp8", "")),
        ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, ("fp8_block", "")),
        ({"quant_method": "fbgemm_fp8"}, ("fp8", "")),
        # compressed-tensors: static per-tensor (explicit, and by its defaults), dynamic per token,
        # weight-only, block weights
        (_ct_group({"strategy": "tensor"}, {"strategy": "tensor", "dynamic": False}), ("fp8_static", "")),
        (_ct_group({}, {}), ("fp8_static", "")),
        (_ct_group({"strategy": "channel"}, {"strategy": "token", "dynamic": True}), ("fp8", "")),
        (_ct_group({"strategy": "tensor"}, None), ("fp8", "")),
        (_ct_group({"strategy": "block", "block_structure": [128, 128]}, {"strategy": "group", "dynamic": True}),
         ("fp8_block", "")),
    ],
)  # fmt: skip
def test_each_fp8_config_form_is_read(tmp_path, quantization, expected):
    m = load_hf_config(_write(tmp_path, {**LLAMA_3_1_8B, "quantization_config": quantization}))
    assert (m.weight_dtype, m.kv_dtype) == expected


def test_hf_quant_config_json_fp8_is_static(tmp_path):
    # NVIDIA's ModelOpt exports: hf_quant_config.json's quantization section replaces config.json's
    hf_quant = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                                                   "exclude_modules": ["lm_head"]}}  # fmt: skip
    m = load_hf_config(_write(tmp_path, CATALOG_CONFIGS["Qwen3-30B-A3B"], hf_quant))
    assert (m.weight_dtype, m.kv_dtype, m.module_dtypes) == ("fp8_static", "fp8", ())


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        ({"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"},
         r"quant_algo 'FP8_PER_CHANNEL_PER_TOKEN' is not read \(FP8, NVFP4\)"),
        ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"},
         r"kv_cache_quant_algo 'NVFP4' is not read"),
        ({"quant_method": "fp8", "activation_scheme": "per_token"}, r"activation_scheme 'per_token' is not read"),
        ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
         r"weight_block_size with activation_scheme 'static' is not read"),
        (_ct_group({"strategy": "channel"}, {"strategy": "tensor", "dynamic": False}),
         r"static tensor activations with channel FP8 weights are not read"),
        # a strategy left out is inferred from the group size, as compressed-tensors does
        (_ct_group({"group_size": -1}, {}), r"static tensor activations with channel FP8 weights"),
    ],
)  # fmt: skip
def test_unknown_fp8_combinations_are_refused_in_one_line(tmp_path, quantization, message):
    with pytest.raises(ValueError, match=message) as err:
        load_hf_config(_write(tmp_path, {**LLAMA_3_1_8B, "quantization_config": quantization}))
    assert "\n" not in str(err.value)


def test_fp8_static_is_fp8_but_for_its_moe_kernel():
    p = get_precision("fp8_static")
    assert (p.bytes, p.compute, gemm_format("fp8_static")) == (1.0, "fp8", "fp8")
    # vLLM's and SGLang's --quantization names of a ModelOpt FP8 checkpoint, and vLLM 0.32's online one
    assert get_precision("modelopt").name == get_precision("modelopt_fp8").name == "fp8_static"
    assert get_precision("fp8_per_tensor").name == "fp8"
    assert Deployment("Llama-3-8B", "H200", quantization="ModelOpt").quantization == "fp8_static"


@pytest.mark.parametrize("gpu", ["H100-SXM", "H200", "B200", "GB200", "B300", "H20", "A100-80GB"])
def test_dense_gemms_of_fp8_static_are_those_of_fp8(gpu):
    # vLLM 0.32 picks the FP8 linear kernel by the scales' group shape: per tensor either way
    hw = get_hardware(gpu)
    llama = get_model("Llama-3-8B")
    prefill = BatchShape(4096, 1, 4096 * 4097 // 2, 4096, 0, num_prefills=1)
    decode = BatchShape(32, 32, 0, 0, 32 * 1024, num_decodes=32)
    shapes = (prefill, decode)
    for shape in shapes:
        static = CostModel(replace(llama, weight_dtype="fp8_static"), hw, 1).iteration_time(shape)
        assert static == CostModel(replace(llama, weight_dtype="fp8"), hw, 1).iteration_time(shape)


# The kernel vLLM 0.32 runs for static per-tensor FP8 experts, per GPU (the curve's layer latency
# tells them apart from Triton's, which prices dynamic fp8)
STATIC_KERNEL_GPUS = ("H100-SXM", "H200", "B200", "GB200", "B300")


@pytest.mark.parametrize("gpu", STATIC_KERNEL_GPUS)
def test_static_fp8_experts_take_the_static_kernels_curve(gpu):
    hw = get_hardware(gpu)
    static, dynamic = hw.moe.curve_for("fp8_static"), hw.moe.curve_for("fp8")
    assert static is not None and static != dynamic
    assert static.math == "fp8"
    # under expert parallelism the same kernel's EP fit
    assert hw.moe.curve_for("fp8_static", expert_parallel=True) is not None
    qwen = get_model("Qwen3-235B-A22B")
    cm = CostModel(replace(qwen, weight_dtype="fp8_static", expert_dtype="fp8_static"), hw, 4)
    assert (cm._moe_fixed, cm._moe_tile_m) == (static.layer_latency, static.tile_m)
    ep = CostModel(replace(qwen, weight_dtype="fp8_static"), hw, 4, expert_parallel=True)
    assert ep._moe_fixed == hw.moe.curve_for("fp8_static", expert_parallel=True).layer_latency
    # the dense layers are fp8's: only the experts differ
    fp8 = CostModel(replace(qwen, weight_dtype="fp8"), hw, 4)
    assert cm._experts(64) != fp8._experts(64)
    assert cm.format_curve == fp8.format_curve


def test_without_a_static_curve_fp8_static_prices_as_fp8():
    # GPUs without fused-MoE tables (H20, A100) and the TensorRT-LLM / SGLang kernel sets, whose one
    # fused-MoE fit has no per-format curves: the factors, the same as fp8's
    qwen = get_model("Qwen3-235B-A22B")
    static, fp8 = (replace(qwen, weight_dtype=f) for f in ("fp8_static", "fp8"))
    for gpu in ("H20", "A100-80GB"):
        hw = get_hardware(gpu)
        assert CostModel(static, hw, 8)._experts(64) == CostModel(fp8, hw, 8)._experts(64)
    for engine in ("trtllm", "sglang"):
        hw, _ = engine_hardware(get_hardware("H200"), engine)
        assert CostModel(static, hw, 4)._experts(64) == CostModel(fp8, hw, 4)._experts(64)


def test_cli_reads_fp8_static_and_modelopt(capsys):
    assert main(["cost", "--model", "Qwen3-30B-A3B", "--hardware", "H200", "--quantization", "modelopt"]) == 0
    out = capsys.readouterr().out
    assert "fp8_static GEMMs on fp8's curve" in out
    assert (
        main(["cost", "--model", "Qwen3-30B-A3B", "--hardware", "H200", "--quantization", "fp8_dynamic"]) == 2
    )
    err = capsys.readouterr().err
    assert "unknown number format 'fp8_dynamic'" in err and "fp8_static" in err
