"""Calibration round trips: the host fit recovers a known CPU model from synthetic points, a
calibration file loads back to the same cost model everywhere, and the recorder's batch shape
prices exactly like the simulated executor."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tailserve.core.request import Request
from tailserve.core.scheduler_output import PaddingSlot, ScheduledRequest, SchedulerOutput
from tailserve.executors.simulated.calibration import MeasuredBatch
from tailserve.executors.simulated.calibration_files import (
    CalibrationFile,
    read_calibration_file,
    write_calibration_file,
)
from tailserve.executors.simulated.cost_model import BatchShape, CostModel, Efficiency
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.executors.simulated.executor import SimExecutor, batch_shape
from tailserve.executors.simulated.hardware import Hardware
from tailserve.executors.simulated.models import ModelSpec
from tailserve.fidelity.torch_calibrate import fit_host

TINY = ModelSpec("tiny", 512, 4, 8, 4, 1536, 8192, 2048)
CPU = Hardware("cpu", 150e9, 15e9, 64.0, 15e9, 15e9, vendor="cpu")
TRUTH = Efficiency(
    compute=0.8, memory=0.7, overhead=0.004, per_token=3e-5, sharpness=2.0, prefill_attention=0.2,
    decode_attention=0.5, per_logit=3e-4,
)  # fmt: skip


def grid_shapes() -> list[BatchShape]:
    shapes = [BatchShape.of([(q, c)], []) for q in (16, 64, 256, 512) for c in (0, 256, 1024)]
    shapes += [BatchShape.of([], [c] * b) for b in (1, 8, 32, 64) for c in (16, 512, 1024)]
    shapes += [BatchShape.of([(q, c)], [300] * b) for q, c, b in ((64, 0, 8), (200, 128, 16), (400, 0, 30))]
    return shapes


def test_host_fit_recovers_a_known_cpu_model():
    truth = CostModel(TINY, CPU, 1, TRUTH)
    points = [MeasuredBatch(s, truth.iteration_time(s)) for s in grid_shapes()]
    fit = fit_host(TINY, CPU, points)
    e = fit.efficiency
    for name in ("compute", "memory", "overhead", "per_token", "per_logit", "prefill_attention", "decode_attention"):
        assert getattr(e, name) == pytest.approx(getattr(TRUTH, name), rel=2e-3), name
    assert fit.max_relative_error < 1e-4


def test_host_fit_ignores_a_preempted_outlier():
    truth = CostModel(TINY, CPU, 1, TRUTH)
    points = [MeasuredBatch(s, truth.iteration_time(s)) for s in grid_shapes()]
    points[5] = MeasuredBatch(points[5].batch, points[5].seconds * 20)  # another process ran
    fit = fit_host(TINY, CPU, points)
    assert fit.efficiency.compute == pytest.approx(TRUTH.compute, rel=1e-2)
    errors = sorted(abs(p / q.seconds - 1) for p, q in zip(fit.predicted, fit.points))
    assert errors[-2] < 1e-2 and errors[-1] > 0.9  # every point predicted; the outlier stays off


def test_calibration_file_round_trip_and_load_everywhere(tmp_path):
    path = tmp_path / "cpu.json"
    points = tuple(MeasuredBatch(s, 0.01, "p") for s in grid_shapes()[:3])
    write_calibration_file(path, CalibrationFile(CPU, TRUTH, "tiny", 1, "synthetic", points))
    back = read_calibration_file(path)
    assert back.hardware == CPU and back.efficiency == TRUTH and back.points == points
    config = tmp_path / "model"
    config.mkdir()
    (config / "config.json").write_text(
        json.dumps(
            {"model_type": "llama", "hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
             "num_key_value_heads": 4, "intermediate_size": 1536, "vocab_size": 8192,
             "max_position_embeddings": 2048, "_name_or_path": "tiny"}
        )
    )  # fmt: skip
    built = build_cost_model(Deployment(str(config), "A100-80GB", 1, str(path)))
    assert built.cost_model.hardware == CPU and built.cost_model.efficiency == TRUTH
    assert any("replaces A100-80GB" in n for n in built.notes)
    assert built.fit is not None and len(built.fit.predicted) == 3


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("{", r"cpu\.json:1: not valid JSON"),
        ('{"format": "other"}', "not a tailserve calibration file"),
        ('{"format": "tailserve-calibration", "version": 9}', "version 9"),
        ('{"format": "tailserve-calibration", "version": 1, "model": "m", "tp": 1, "source": "s"}', "missing key 'hardware'"),
    ],
)  # fmt: skip
def test_bad_calibration_files_are_named(tmp_path, body, message):
    path = tmp_path / "cpu.json"
    path.write_text(body)
    with pytest.raises(ValueError, match=message):
        read_calibration_file(path)
    with pytest.raises(ValueError, match="does not exist"):
        read_calibration_file(tmp_path / "missing.json")


def test_recorded_batch_shape_prices_like_the_simulated_executor():
    a = Request("a", 300, 10, 0.0)
    b = Request("b", 40, 10, 0.0)
    b.num_computed_tokens, b.num_output_tokens = 45, 6  # decoding: its 46th token samples
    out = SchedulerOutput(
        scheduled=[ScheduledRequest(a, 128, 64), ScheduledRequest(b, 1, 45)], padding=[PaddingSlot(1, 20)]
    )
    cm = CostModel(TINY, CPU, 1, replace(TRUTH))
    assert SimExecutor(cm).execute(out).duration == cm.iteration_time(batch_shape(out))
    assert batch_shape(out) == BatchShape(130, 2, 128 * 64 + 128 * 129 // 2, 192, 46 + 21, 1, 2)


def test_generic_calibration_is_the_roofline_before_the_fitted_curves():
    built = build_cost_model(Deployment("Llama-3-70B", "A100-80GB", 4, "generic"))
    cm = built.cost_model
    assert cm.efficiency == Efficiency() and cm.hardware.gemm is None
    assert cm.hardware.allreduce_latency_at(4) == 8e-6
    # The figures docs/cost_model.md quoted before the fitted curves: 849 ms and 25.3 ms.
    assert cm.prefill_time(4096) == pytest.approx(0.8486, rel=1e-3)
    assert cm.decode_time(10, 1024) == pytest.approx(0.02526, rel=1e-3)


# ---- calibrate --executor torch --dtype ---------------------------------------------------------
def test_calibrate_torch_takes_the_engines_dtypes_and_default():
    from tailserve.cli.app import build_parser
    from tailserve.llm.engine_args import DTYPES, EngineArgs

    def parse(*argv: str):
        return build_parser().parse_known_args(["calibrate", "--executor", "torch", *argv])[0]

    assert parse().dtype == EngineArgs().dtype
    assert [parse("--dtype", d).dtype for d in DTYPES] == list(DTYPES)
    with pytest.raises(SystemExit):
        parse("--dtype", "int3")


def test_calibrate_torch_profiles_in_the_dtype_given(tmp_path, monkeypatch):
    # The profiling engine is built by run_scenario: stop there, having seen the dtype it got.
    import tailserve.fidelity.torch_calibrate as torch_calibrate
    from tailserve.cli import main

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
              "intermediate_size": 1536, "vocab_size": 8192, "max_position_embeddings": 2048}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    seen: list[str] = []

    def run_scenario(model_dir, scenario, seed, dtype="bfloat16", cpu_clock=False):
        seen.append(dtype)
        raise ValueError("stop: the dtype is seen")

    def measure_host(cpu_clock=False, dtype="bfloat16"):
        seen.append(f"host {dtype}")  # the GEMM rate is measured in the dtype calibrated
        return CPU

    monkeypatch.setattr(torch_calibrate, "measure_host", measure_host)
    monkeypatch.setattr(torch_calibrate, "run_scenario", run_scenario)
    argv = ["calibrate", "--executor", "torch", "--model", str(tmp_path), "--out", str(tmp_path / "c.json")]
    assert main([*argv, "--dtype", "float32"]) == 2
    assert seen == ["host float32", "float32"]


@pytest.mark.parametrize("gpu", ["H200", "B200"])
def test_a_gpu_with_fitted_mla_and_exchange_round_trips(tmp_path, gpu):
    """The MLA block and the MoE exchange come back as the catalog's objects, so a DeepSeek
    model is priced from the file as from the catalog."""
    from tailserve.executors.simulated.hardware import get_hardware
    from tailserve.executors.simulated.models import get_model

    hw = get_hardware(gpu)
    assert (
        hw.mla is not None and hw.moe_exchange is not None and hw.engine_kernels
    )  # TensorRT-LLM's, SGLang's
    path = tmp_path / "gpu.json"
    write_calibration_file(
        path, CalibrationFile(hw, Efficiency.for_hardware(hw), "deepseek-v3", 8, "catalog")
    )
    back = read_calibration_file(path).hardware
    assert back == hw
    shape = BatchShape.of([(512, 0)] * 2, [2000] * 16)
    model = get_model("deepseek-v3")
    assert CostModel(model, back, 8).iteration_time(shape) == CostModel(model, hw, 8).iteration_time(shape)


def test_a_gemm_curve_with_a_quantization_kernel_round_trips(tmp_path):
    from dataclasses import replace

    from tailserve.executors.simulated.hardware import GemmCurve, get_hardware

    hw = get_hardware("H200")
    tiled = GemmCurve(
        0.5, 0.8, 4.0, 128, 7e-6, "test", tile_n=128, m_tiles=((16, 0, 16, 64), (64, 1280, 16, 64))
    )
    hw = replace(
        hw, gemm=replace(hw.gemm, quant_bytes=(("fp8", 3.0), ("nvfp4", 2.5)), format_curves=(("fp8", tiled),))
    )
    path = tmp_path / "gpu.json"
    write_calibration_file(path, CalibrationFile(hw, Efficiency.for_hardware(hw), "Llama-3-8B", 1, "catalog"))
    back = read_calibration_file(path).hardware
    assert back == hw and back.gemm.quant_bytes_for("fp8") == 3.0
    assert back.gemm.curve_for("fp8").m_tiles == ((16, 0, 16, 64), (64, 1280, 16, 64))
