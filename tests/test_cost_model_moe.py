"""The 2026 model terms of the cost model (issue 32): routed experts priced by the experts a batch
touches, MLA's latent KV and absorbed decode, weights in FP8/FP4 at their tensor-core rate, and
the GPUs that have them."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailserve.executors.simulated.cost_model import BatchShape, CostModel, Efficiency
from tailserve.executors.simulated.hardware import HARDWARE, get_hardware
from tailserve.executors.simulated.models import ModelSpec, get_model
from tailserve.executors.simulated.moe import touched_experts
from tailserve.executors.simulated.precision import PRECISIONS, get_precision

# DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3): 61 layers, the first 3 dense, 256 routed
# experts (8 per token) and 1 shared of 2048, MLA with a 512 latent and 64 RoPE dims; FP8 weights.
DEEPSEEK_V3 = ModelSpec(
    "DeepSeek-V3", 7168, 61, 128, 128, 18432, 129280, 163840,
    num_experts=256, experts_per_token=8, moe_intermediate_size=2048, shared_intermediate_size=2048,
    first_dense_layers=3, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, weight_dtype="fp8",
)  # fmt: skip
# Mixtral-8x7B: 8 experts of 14336, 2 per token, GQA 8 KV heads, bf16.
MIXTRAL = ModelSpec(
    "Mixtral-8x7B", 4096, 32, 32, 8, 14336, 32000, 32768,
    num_experts=8, experts_per_token=2, moe_intermediate_size=14336,
)  # fmt: skip
LLAMA_70B = ModelSpec("Llama-2-70B", 8192, 80, 64, 8, 28672, 32000, 4096)


def test_parameter_counts_match_the_published_ones():
    # DeepSeek-V3: 671B total, 37B activated per token (its model card); Mixtral: 46.7B / 12.9B.
    assert DEEPSEEK_V3.num_params / 1e9 == pytest.approx(671, rel=0.01)
    embed = 2 * DEEPSEEK_V3.vocab_size * DEEPSEEK_V3.hidden_size
    assert (DEEPSEEK_V3.num_matmul_params + embed) / 1e9 == pytest.approx(37, rel=0.03)
    assert MIXTRAL.num_params / 1e9 == pytest.approx(46.7, rel=0.01)
    active = MIXTRAL.num_matmul_params + 2 * MIXTRAL.vocab_size * MIXTRAL.hidden_size
    assert active / 1e9 == pytest.approx(12.9, rel=0.01)
    assert DEEPSEEK_V3.num_moe_layers == 58 and MIXTRAL.num_moe_layers == 32


def test_mla_caches_one_latent_per_token_on_every_shard():
    # (512 + 64) x 61 layers x 2 bytes, whatever the TP degree: each rank keeps the whole latent.
    assert DEEPSEEK_V3.kv_bytes_per_token(1) == 576 * 61 * 2
    assert DEEPSEEK_V3.kv_bytes_per_token(8) == DEEPSEEK_V3.kv_bytes_per_token(1)
    fp8_kv = replace(DEEPSEEK_V3, kv_dtype="fp8")
    assert fp8_kv.kv_bytes_per_token(8) == 576 * 61


def test_fp8_weights_halve_the_weight_read_and_run_at_the_fp8_rate_where_there_is_one():
    fp8 = replace(LLAMA_70B, weight_dtype="fp8")
    for gpu in ("H200", "A100-80GB"):
        bf16_cm, fp8_cm = CostModel(LLAMA_70B, get_hardware(gpu), 8), CostModel(fp8, get_hardware(gpu), 8)
        # one decode's GEMMs are the weight read (the bf16 LM head stays), the launches stay
        one = BatchShape.of([], [128])
        assert fp8_cm.roofline(one).memory_s[0] < 0.52 * bf16_cm.roofline(one).memory_s[0]
        assert fp8_cm.decode_time(1, 128) < bf16_cm.decode_time(1, 128)
    long = BatchShape.of([(16384, 0)], [])
    # twice the peak, at the efficiency measured for FP8 GEMMs (the H200's FP8 curve,
    # hardware.H200_FORMAT_CURVES: vLLM's CUTLASS FP8 kernels reach 0.57 of the FP8 peak, the bf16
    # curve 0.746 of bf16's): ~0.66x the bf16 time
    h200 = CostModel(fp8, get_hardware("H200"), 8).linear_time(16384)
    assert 0.6 < h200 / CostModel(LLAMA_70B, get_hardware("H200"), 8).linear_time(16384) < 0.72
    # on the factors alone (no format curve: the form before) 0.63 of bf16's share: ~0.8x
    factors = replace(get_hardware("H200"), gemm=replace(get_hardware("H200").gemm, format_curves=()))
    assert (
        0.7
        < CostModel(fp8, factors, 8).linear_time(16384) / CostModel(LLAMA_70B, factors, 8).linear_time(16384)
        < 0.85
    )
    # the A100 has no FP8 tensor cores: weight-only kernels, bf16 math, the same compute time
    a100 = CostModel(fp8, get_hardware("A100-80GB"), 8)
    a100_bf16 = CostModel(LLAMA_70B, get_hardware("A100-80GB"), 8)
    assert a100.roofline(long).compute_s[0] == pytest.approx(a100_bf16.roofline(long).compute_s[0])
    assert a100.linear_time(16384) == pytest.approx(a100_bf16.linear_time(16384), rel=0.05)


def test_a_small_batch_reads_only_the_experts_it_touches():
    assert touched_experts(1, 256, 8) == pytest.approx(8)
    assert touched_experts(10_000, 256, 8) == pytest.approx(256)
    counts = [touched_experts(t, 256, 8) for t in (1, 2, 8, 32, 128, 1024)]
    assert counts == sorted(counts) and all(c <= 256 for c in counts)
    cm = CostModel(MIXTRAL, get_hardware("H100"), 1)
    one = cm.roofline(BatchShape.of([], [100])).memory_s[0]
    many = cm.roofline(BatchShape.of([], [100] * 64)).memory_s[0]
    # batch 1 reads attention + 2 of 8 experts per layer (42M + 2 x 176M parameters); 64 tokens
    # touch all 8 (42M + 8 x 176M): 3.7x the bytes
    assert 3.5 < many / one < 3.8
    # a dense model of Mixtral's total size reads everything even for one token
    dense_twin = replace(MIXTRAL, num_experts=0, experts_per_token=0, moe_intermediate_size=0,
                         intermediate_size=8 * 14336)  # fmt: skip
    assert cm.decode_time(1, 100) < 0.5 * CostModel(dense_twin, get_hardware("H100"), 1).decode_time(1, 100)


def test_decode_gets_dearer_with_the_batch_until_every_expert_is_touched():
    cm = CostModel(DEEPSEEK_V3, get_hardware("H200"), 8)
    times = [cm.decode_time(b, 2048) for b in (1, 4, 16, 64, 256)]
    assert times == sorted(times)
    # per token, a large batch is far cheaper: the experts' weights are shared by the batch
    assert times[-1] / 256 < times[0] / 8


@settings(max_examples=150, deadline=None)
@given(
    spec=st.sampled_from([DEEPSEEK_V3, MIXTRAL, replace(MIXTRAL, weight_dtype="fp8"),
                          replace(LLAMA_70B, weight_dtype="nvfp4"), replace(DEEPSEEK_V3, kv_dtype="fp8"),
                          # groups kept in bf16 (module_formats.py): NVIDIA's R1 NVFP4, an FP8 Llama
                          get_model("DeepSeek-R1-FP4-v2"),
                          replace(LLAMA_70B, weight_dtype="fp8", module_dtypes=(("attention", "bf16"),))]),
    hw=st.sampled_from(sorted(HARDWARE)),
    tp=st.sampled_from([1, 2, 4, 8]),
    prefill=st.lists(st.tuples(st.integers(1, 8192), st.integers(0, 16384)), max_size=3),
    decodes=st.lists(st.integers(0, 32768), max_size=32),
)  # fmt: skip
def test_an_uncalibrated_prediction_never_beats_its_roofline(spec, hw, tp, prefill, decodes):
    if spec.num_heads % tp:
        return
    cm = CostModel(spec, get_hardware(hw), tp)
    shape = BatchShape.of(prefill, decodes)
    if shape.num_tokens == 0:
        return
    roof = cm.roofline(shape)
    t = cm.iteration_time(shape)
    assert t >= sum(roof.compute_s) * (1 - 1e-9) or t >= roof.limit_s * (1 - 1e-9)
    assert t >= roof.limit_s * (1 - 1e-9)


def test_the_2026_gpus_have_their_formats():
    assert get_hardware("b200").peak_for("fp4") == 9000e12
    assert get_hardware("GB200-NVL72").nvlink_domain == 72
    assert get_hardware("mi355x").peak_for("fp8") == 5000e12
    assert get_hardware("H100").peak_for("fp4") == get_hardware("H100").peak_flops  # no FP4: bf16 math
    assert get_hardware("A100").peak_for("fp8") == get_hardware("A100").peak_flops
    for name in ("B200", "B300", "GB200", "H20", "MI325X", "MI355X"):
        assert name in HARDWARE


def test_formats_and_bad_fields_are_named():
    assert get_precision("bfloat16").bytes == 2.0 and get_precision("FP8").bytes == 1.0
    assert 0.5 < get_precision("mxfp4").bytes < 0.54
    assert set(PRECISIONS) >= {"bf16", "fp8", "int4", "mxfp4", "nvfp4"}
    with pytest.raises(ValueError, match="fp3"):
        replace(LLAMA_70B, weight_dtype="fp3")
    with pytest.raises(ValueError, match="experts_per_token"):
        replace(MIXTRAL, experts_per_token=9)
    with pytest.raises(ValueError, match="num_experts"):
        replace(LLAMA_70B, moe_intermediate_size=1024)
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        replace(LLAMA_70B, kv_lora_rank=512)
    with pytest.raises(ValueError, match="wave form"):
        from tailserve.executors.simulated.cost_model import Efficiency

        CostModel(MIXTRAL, get_hardware("H100"), 1, Efficiency(tile_n=128, tile_m=128))


def test_quantization_and_kv_cache_dtype_are_deployment_flags(capsys):
    from tailserve.cli import main
    from tailserve.executors.simulated.deployment import Deployment, build_cost_model
    from tailserve.policies.registry import parse_policy_list
    from tailserve.tune.commands import command_line

    dep = Deployment.of("Llama-2-70B", "h200", 8, "none", quantization="FP8", kv_cache_dtype="fp8")
    spec = dep.model_spec()
    assert (spec.weight_dtype, spec.kv_dtype) == ("fp8", "fp8")
    assert spec.kv_bytes_per_token(8) * 2 == get_model("Llama-2-70B").kv_bytes_per_token(8)
    bf16 = build_cost_model(Deployment.of("Llama-2-70B", "h200", 8, "none")).cost_model
    assert build_cost_model(dep).cost_model.decode_time(1, 128) < bf16.decode_time(1, 128)
    hw = get_hardware("h200")
    vllm = command_line(parse_policy_list("vllm")[0], dep, None, hw.device_info, 4096)
    assert "--quantization fp8" in vllm and "--kv-cache-dtype fp8" in vllm
    sglang = command_line(parse_policy_list("sglang")[0], dep, None, hw.device_info, 4096)
    assert "--quantization fp8" in sglang and "--kv-cache-dtype fp8_e4m3" in sglang
    assert Deployment.of("Llama-2-70B", "h200", 8, kv_cache_dtype="auto").kv_cache_dtype == ""
    argv = ["cost", "--model", "Llama-2-70B", "--hardware", "h200", "--tp", "8", "--quantization", "fp3"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--quantization: unknown number format 'fp3'" in err


def test_expert_parallel_waits_for_its_busiest_rank():
    from tailserve.executors.simulated.deployment import Deployment, build_cost_model
    from tailserve.executors.simulated.moe import grouped_gemm_parts
    from tailserve.policies.registry import parse_policy_list
    from tailserve.tune.commands import command_line

    kw = dict(weight_bytes=1.0, act_bytes=2.0, tile_m=64)
    # 4,096 tokens x 8 of 256 experts: every expert touched on every rank either way; TP ranks
    # each read all 32,768 routed rows (for their slices), the busiest EP rank ~4,218 of them
    # (more rows than its share: more FLOPs, and its experts' rows pad to a bigger tile)
    tp_flops, tp_bytes = grouped_gemm_parts(4096, 256, 8, 7168, 2048, moe_tp=8, **kw)
    ep_flops, ep_bytes = grouped_gemm_parts(4096, 256, 8, 7168, 2048, ep=8, **kw)
    assert ep_bytes < tp_bytes and 1.0 < ep_flops / tp_flops <= 1.5
    # one token: k rows over 8 ranks, the busiest gets several of them
    one_tp = grouped_gemm_parts(1, 256, 8, 7168, 2048, moe_tp=8, **kw)[1]
    one_ep = grouped_gemm_parts(1, 256, 8, 7168, 2048, ep=8, **kw)[1]
    assert 2.0 < one_ep / one_tp <= 8.0
    dep = Deployment.of("DeepSeek-V3", "h200", 8, expert_parallel=True)
    cm = build_cost_model(dep).cost_model
    assert (
        cm.expert_parallel
        and not build_cost_model(Deployment.of("DeepSeek-V3", "h200", 8)).cost_model.expert_parallel
    )
    assert not build_cost_model(
        Deployment.of("Llama-2-70B", "h200", 8, expert_parallel=True)
    ).cost_model.expert_parallel
    hw = get_hardware("h200")
    assert "--enable-expert-parallel" in command_line(
        parse_policy_list("vllm")[0], dep, None, hw.device_info, 4096
    )
    assert "--ep-size 8" in command_line(parse_policy_list("sglang")[0], dep, None, hw.device_info, 4096)


def test_a_curves_quantization_bytes_price_the_kernel_that_quantizes_each_gemms_input():
    # GemmCurve.quant_bytes: a separate kernel reads each dense GEMM's bf16 input and writes it in
    # the format (FP8 per tensor: 2 + 1 bytes per element) at the format's memory rate. Llama-2-70B
    # at TP 8: each layer's inputs are hidden (QKV) + 1,024 (o) + hidden (gate/up) + 3,584 (down).
    h200 = get_hardware("H200")
    quantized = replace(h200, gemm=replace(h200.gemm, quant_bytes=(("fp8", 3.0),)))
    fp8 = replace(LLAMA_70B, weight_dtype="fp8")
    tokens = 4096
    inputs = 80 * (8192 + 1024 + 8192 + 3584)
    _, fm = h200.gemm.factors_for("fp8")
    rate = h200.memory_bandwidth * h200.gemm.memory * fm
    extra = CostModel(fp8, quantized, 8).linear_time(tokens) - CostModel(fp8, h200, 8).linear_time(tokens)
    assert extra == pytest.approx(tokens * inputs * 3.0 / rate, rel=1e-9)
    # another format's GEMMs and bf16 weights pay nothing
    for spec in (LLAMA_70B, replace(LLAMA_70B, weight_dtype="nvfp4")):
        with_kernel, plain = CostModel(spec, quantized, 8), CostModel(spec, h200, 8)
        assert with_kernel.linear_time(tokens) == plain.linear_time(tokens)
    with pytest.raises(ValueError, match="quant_bytes for fp8"):
        replace(h200.gemm, quant_bytes=(("fp8", -1.0),))


def test_the_moe_kernels_row_term_moves_every_routed_row_whole_at_any_expert_tp():
    # MoeKernel.row_element: seconds per routed row (tokens x experts per token) and hidden
    # element, per MoE layer; tensor parallelism inside the experts does not split it.
    h200 = get_hardware("H200")
    h200 = replace(h200, moe=replace(h200.moe, format_curves=()))  # the factors' path
    assert h200.moe.row_element > 0  # the catalog's fit (hardware.MOE_H200)
    without = replace(h200, moe=replace(h200.moe, row_element=0.0))
    tokens = 2048
    for tp in (1, 4):
        catalog, plain = CostModel(MIXTRAL, h200, tp), CostModel(MIXTRAL, without, tp)
        extra = catalog.linear_time(tokens) - plain.linear_time(tokens)
        assert extra == pytest.approx(32 * tokens * 2 * 4096 * h200.moe.row_element, rel=1e-9)
    dense, dense_catalog = CostModel(LLAMA_70B, without, 8), CostModel(LLAMA_70B, h200, 8)
    assert dense.linear_time(tokens) == dense_catalog.linear_time(tokens)
    with pytest.raises(ValueError, match="row_element"):
        replace(h200.moe, row_element=-1.0)


def test_each_expert_format_takes_its_own_fused_moe_curve():
    # hardware.MoeCurve: the format's kernel on its own rates, tile, sharpness, fixed time and
    # row term, instead of the bf16 kernel's factors times the format's GEMM factors.
    from tailserve.executors.simulated.gemm import join
    from tailserve.executors.simulated.hardware import MoeCurve
    from tailserve.executors.simulated.moe import grouped_gemm_parts

    h200 = get_hardware("H200")
    factors = replace(h200, moe=replace(h200.moe, format_curves=()))
    tokens = 512
    for fmt in ("", "fp8", "fp8_block", "mxfp4"):
        spec = replace(MIXTRAL, expert_dtype=fmt)
        curve = h200.moe.curve_for(fmt or "bf16")
        assert curve is not None
        cm = CostModel(spec, h200, 4)
        flops, moved = grouped_gemm_parts(
            tokens, 8, 2, 4096, 14336, weight_bytes=spec.expert_bytes_per_param, act_bytes=2.0,
            tile_m=curve.tile_m, moe_tp=4,
        )  # fmt: skip
        layer = join(
            flops / (h200.peak_for(curve.math) * curve.compute),
            moved / (h200.memory_bandwidth * curve.memory),
            curve.sharpness,
        )
        layer += curve.layer_latency + tokens * 2 * 4096 * curve.row_element
        assert cm._experts(tokens) == pytest.approx(32 * layer, rel=1e-12)
        assert cm._experts(tokens) != CostModel(spec, factors, 4)._experts(tokens)
    # a format without a curve (GB200 NVFP4) and a calibrated efficiency keep the factors
    gb200 = get_hardware("GB200")
    nvfp4 = replace(MIXTRAL, expert_dtype="nvfp4")
    assert gb200.moe.curve_for("nvfp4") is None
    assert CostModel(nvfp4, gb200, 1)._experts(tokens) == CostModel(
        nvfp4, replace(gb200, moe=replace(gb200.moe, format_curves=())), 1
    )._experts(tokens)
    calibrated = Efficiency.for_hardware(h200)
    calibrated = replace(calibrated, compute=calibrated.compute * 0.9)
    assert CostModel(MIXTRAL, h200, 4, calibrated)._experts(tokens) == CostModel(
        MIXTRAL, factors, 4, calibrated
    )._experts(tokens)
    with pytest.raises(ValueError, match="MoeCurve memory"):
        MoeCurve(0.5, 1.2, 2.0, 64, 1e-6, 0.0, "bf16")


def test_online_fp8_experts_run_tritons_kernel_not_a_static_scale_one():
    # `--quantization fp8` on a bf16 checkpoint quantizes activations per tensor at run time;
    # vLLM 0.32's FlashInfer CUTLASS / TRT-LLM FP8 MoE kernels take static scales only, so it runs
    # Triton (hardware._TRITON_FP8_*): FP8 experts read half of bf16's bytes and run at FP8's
    # rate, so a decode-sized FP8 layer is cheaper than the bf16 one on every FP8 GPU (the
    # CUTLASS curve Hopper had priced it ~2.5x dearer than bf16).
    qwen = get_model("Qwen3-235B-A22B")
    fp8 = replace(qwen, weight_dtype="fp8", expert_dtype="fp8")
    for gpu in ("H100-SXM", "H200", "B200", "GB200", "B300"):
        hw = get_hardware(gpu)
        for tokens in (8, 64, 512):
            cheaper = CostModel(fp8, hw, 4)._experts(tokens) < CostModel(qwen, hw, 4)._experts(tokens)
            assert cheaper, (gpu, tokens)
    # one Triton curve per GPU family (the tables time Triton's FP8 per-tensor rows on the H200
    # and the B200 only)
    assert get_hardware("H100-SXM").moe.curve_for("fp8") == get_hardware("H200").moe.curve_for("fp8")
    assert get_hardware("GB200").moe.curve_for("fp8") == get_hardware("B200").moe.curve_for("fp8")


def test_block_fp8_with_expert_parallelism_takes_the_ep_kernels_curve_on_hopper():
    # vLLM 0.32 on Hopper: Triton for block FP8 under TP, FlashInfer's CUTLASS kernel first with
    # EP > 1 (MoeKernel.ep_format_curves); other formats and TP keep their curve.
    from tailserve.executors.simulated.hardware import MoeCurve, MoeKernel

    curve = MoeCurve(0.5, 0.5, 2.0, 64, 1e-6, 0.0, "fp8")
    ep = MoeCurve(0.4, 0.4, 2.0, 64, 2e-6, 0.0, "fp8")
    kernel = MoeKernel(1.0, 1.0, 0.0, "test", format_curves=(("fp8_block", curve),),
                       ep_format_curves=(("fp8_block", ep),))  # fmt: skip
    assert kernel.curve_for("fp8_block") is curve
    assert kernel.curve_for("fp8_block", expert_parallel=True) is ep
    assert kernel.curve_for("bf16", expert_parallel=True) is None
    spec = replace(get_model("Qwen3-235B-A22B"), weight_dtype="fp8_block", expert_dtype="fp8_block")
    for gpu in ("H100-SXM", "H200"):
        hw = get_hardware(gpu)
        tp_only = replace(hw, moe=replace(hw.moe, ep_format_curves=()))
        assert hw.moe.curve_for("fp8_block", True) != hw.moe.curve_for("fp8_block")
        assert CostModel(spec, hw, 8, expert_parallel=True)._experts(64) != CostModel(
            spec, tp_only, 8, expert_parallel=True
        )._experts(64)
        assert CostModel(spec, hw, 8)._experts(64) == CostModel(spec, tp_only, 8)._experts(64)
    # Blackwell runs FlashInfer's TRT-LLM kernel for block FP8 either way: no EP curve
    b200 = get_hardware("B200").moe
    assert b200.curve_for("fp8_block", expert_parallel=True) is b200.curve_for("fp8_block")


def test_gb300_is_b300_silicon_in_the_nvl72_rack():
    # --hardware GB300 (and GB300-NVL72): Blackwell Ultra's peaks at the rack's power (more FP4,
    # little INT8), the B300's kernel fits and the GB200's 72-GPU NVLink fabric.
    gb300, b300, gb200 = get_hardware("gb300-nvl72"), get_hardware("B300"), get_hardware("GB200")
    assert gb300.name == "GB300" and gb300.nvlink_domain == 72
    assert gb300.peak_for("fp4") > b300.peak_for("fp4") > gb200.peak_for("fp4")
    assert gb300.peak_for("int8") < gb300.peak_flops / 10  # Blackwell Ultra trades INT8 for FP4
    assert gb300.moe is b300.moe and gb300.gemm is b300.gemm and gb300.mla is b300.mla
    assert gb300.moe_exchange is gb200.moe_exchange
    spec = replace(get_model("Qwen3-235B-A22B"), weight_dtype="fp8", expert_dtype="fp8")
    assert CostModel(spec, gb300, 4)._experts(64) < CostModel(spec, b300, 4)._experts(64)  # higher peaks
