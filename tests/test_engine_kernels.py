"""Per-engine kernel sets (issue 32): ``--kernels`` and the policy's engine pick whose GEMM and
fused-MoE curves price a deployment (hardware.EngineKernels, deployment.kernel_engine)."""

from __future__ import annotations

import json

import pytest

from tailserve.cli import main
from tailserve.executors.simulated.cost_model import BatchShape
from tailserve.executors.simulated.deployment import Deployment, build_cost_model, kernel_engine
from tailserve.executors.simulated.hardware import HARDWARE, engine_hardware, get_hardware


def _fp8_70b(hardware: str = "H200", kernels: str = "auto") -> Deployment:
    return Deployment("Llama-2-70B", hardware, 1, "none", quantization="fp8", kernels=kernels)


def _set(hardware: str, engine: str):
    return next(k for k in get_hardware(hardware).engine_kernels if k.engine == engine)


def test_auto_takes_the_policy_engine():
    assert kernel_engine("auto", "trtllm") == "trtllm"
    assert kernel_engine("auto", "sglang") == "sglang"
    for policy in ("vllm", "vllm-v0", "sarathi", "orca", "tgi", "static", "slo", ""):
        assert kernel_engine("auto", policy) == "vllm"
    assert kernel_engine("vllm", "trtllm") == "vllm"  # an explicit choice wins over the policy's
    assert kernel_engine("sglang", "vllm") == "sglang"


@pytest.mark.parametrize("policy,engine", [("trtllm", "trtllm"), ("sglang", "sglang"), ("vllm", "vllm")])
def test_auto_prices_with_the_policy_engines_curves(policy, engine):
    built = build_cost_model(_fp8_70b(), policy)
    hw = built.cost_model.hardware
    assert built.kernels == engine
    assert not built.notes
    if engine == "vllm":
        assert hw == get_hardware("H200")
    else:
        kernels = _set("H200", engine)
        assert hw.gemm == kernels.gemm and hw.gemm != get_hardware("H200").gemm
        assert hw.moe == (kernels.moe or get_hardware("H200").moe)


def test_a_gpu_without_the_engines_set_falls_back_with_a_note():
    assert not get_hardware("A100-80GB").engine_kernels
    built = build_cost_model(Deployment("Llama-3-8B", "A100-80GB", 1, "none"), "trtllm")
    assert built.kernels == "vllm"
    assert built.cost_model.hardware == get_hardware("A100-80GB")
    assert len(built.notes) == 1
    assert (
        "A100-80GB has no TensorRT-LLM kernel set" in built.notes[0]
        and "the GPU's own curves" in built.notes[0]
    )
    hw, note = engine_hardware(get_hardware("H200"), "vllm")
    assert hw is get_hardware("H200") and note == ""


def test_a_trtllm_set_prices_fp8_gemms_as_its_fit_says():
    """The H200 TensorRT-LLM FP8 GEMMs run at a higher share of the FP8 peak than vLLM's
    (benchmarks/fidelity_aisim.py --framework trtllm): an FP8 prefill is priced faster with its set,
    and by no more than the ratio of the two compute factors."""
    vllm_factor = get_hardware("H200").gemm.factors_for("fp8")[0]
    trt_factor = _set("H200", "trtllm").gemm.factors_for("fp8")[0]
    assert trt_factor > vllm_factor
    shape = BatchShape.of([(4096, 0)], [])
    vllm = build_cost_model(_fp8_70b(kernels="vllm")).cost_model.iteration_time(shape)
    trt = build_cost_model(_fp8_70b(kernels="trtllm")).cost_model.iteration_time(shape)
    assert trt < vllm
    assert vllm / trt <= trt_factor / vllm_factor + 1e-9


def test_bf16_hopper_prices_are_the_same_for_every_engine():
    """On Hopper the engines' sets keep the catalog's bf16 curve (Vidur's) and change only the
    quantized formats' factors and the fused-MoE kernel: a bf16 dense model prices alike."""
    shape = BatchShape.of([(2048, 0)], [512] * 8)
    times = {
        k: build_cost_model(
            Deployment("Llama-3-8B", "H100-SXM", 1, "none", kernels=k)
        ).cost_model.iteration_time(shape)
        for k in ("vllm", "sglang", "trtllm")
    }
    assert len(set(times.values())) == 1


def test_every_set_names_its_engine_and_source():
    for hw in HARDWARE.values():
        engines = [k.engine for k in hw.engine_kernels]
        assert len(engines) == len(set(engines))
        for k in hw.engine_kernels:
            assert k.engine in ("sglang", "trtllm") and k.source
            assert k.gemm is not None or k.moe is not None


def test_bad_kernels_value_is_one_line(capsys):
    assert main(["cost", "--kernels", "tensorflow"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("tailserve: error: --kernels: unknown 'tensorflow'; choose from auto, vllm")


def test_cost_and_run_json_name_the_kernels(tmp_path, capsys):
    out = tmp_path / "cost.json"
    args = ["cost", "--model", "Llama-2-70B", "--hardware", "H200", "--quantization", "fp8", "--json"]
    assert main([*args, str(out), "--kernels", "trtllm"]) == 0
    assert "TensorRT-LLM kernels" in " ".join(capsys.readouterr().out.split())  # the title, however wrapped
    assert json.loads(out.read_text())["kernels"] == "trtllm"
    assert main([*args, str(out)]) == 0  # no policy: vLLM's, the catalog's own, not named
    assert "kernels" not in json.loads(out.read_text())
    run = tmp_path / "run.json"
    sim = ["simulate", "--model", "Llama-2-70B", "--hardware", "H200", "--quantization", "fp8",
           "--save-run", str(run)]  # fmt: skip
    assert main([*sim, "--policy", "trtllm"]) == 0
    assert json.loads(run.read_text())["config"]["kernels"] == "trtllm"
    assert main([*sim, "--policy", "trtllm", "--kernels", "vllm"]) == 0
    assert "kernels" not in json.loads(run.read_text())["config"]


def test_hardware_lists_each_gpus_sets(capsys):
    assert main(["hardware"]) == 0
    rows: dict[str, str] = {}  # a row's cells, its wrapped continuation lines joined on
    name = ""
    for line in capsys.readouterr().out.splitlines():
        if line.count("│") > 2:
            name = line.split("│")[1].strip() or name
            rows[name] = rows.get(name, "") + line
    assert "trtllm" in rows["H200"] and "sglang" in rows["H200"]
    assert "trtllm" not in rows["A100-80GB"] and "vllm" in rows["A100-80GB"]


def test_compare_says_which_rows_their_own_engines_kernels_priced(capsys):
    """A compare row that differs by its GEMMs rather than its scheduling says so; with
    ``--kernels vllm`` every row is vLLM's and nothing is said."""
    args = ["compare", "--model", "Llama-3-8B", "--hardware", "H200", "--quantization", "fp8",
            "--policies", "vllm,sglang,trtllm", "--workload", "random", "--num-requests", "20"]  # fmt: skip
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "own engine's GEMM and fused-MoE kernels: sglang (SGLang's), trtllm (TensorRT-LLM's)" in err
    assert main([*args, "--kernels", "vllm"]) == 0
    assert "own engine's" not in capsys.readouterr().err
