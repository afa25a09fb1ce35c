"""Cost model: roofline bounds, calibration fits, the seed preset."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailserve.executors.simulated.calibration import PRESETS, calibrate, parse_points
from tailserve.executors.simulated.cost_model import BatchShape, CostModel, Efficiency
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.executors.simulated.hardware import HARDWARE, get_hardware
from tailserve.executors.simulated.kv_capacity import kv_capacity
from tailserve.executors.simulated.models import MODELS, get_model, load_hf_config


@settings(max_examples=200, deadline=None)
@given(
    model=st.sampled_from(sorted(MODELS)),
    hw=st.sampled_from(sorted(HARDWARE)),
    tp=st.sampled_from([1, 2, 4, 8]),
    prefill=st.lists(st.tuples(st.integers(1, 8192), st.integers(0, 16384)), max_size=4),
    decodes=st.lists(st.integers(0, 32768), max_size=64),
)
def test_uncalibrated_prediction_never_beats_the_roofline(model, hw, tp, prefill, decodes):
    spec = get_model(model)
    if spec.num_heads % tp:
        return
    cm = CostModel(spec, get_hardware(hw), tp)
    shape = BatchShape.of(prefill, decodes)
    if shape.num_tokens == 0:
        return
    roof = cm.roofline(shape)
    t = cm.iteration_time(shape)
    # The roofline's own limit: each part at its format's peak (gpt-oss's MXFP4 experts on a
    # B300 run at its FP4 rate, faster than the FLOPs at the bf16 peak would allow).
    assert t >= roof.limit_s * (1 - 1e-12)
    assert t >= roof.bytes / cm.hardware.memory_bandwidth * (1 - 1e-12)


def test_decode_run_vector_equals_scalar_bit_for_bit():
    cm = CostModel(get_model("Llama-3-70B"), get_hardware("H100-SXM"), 4)
    vec = cm.decode_run_times(37, 50_000, 300)
    lst = cm.decode_step_times(37, 50_000, 300)
    for j in (0, 1, 150, 299):
        step = cm.iteration_time(BatchShape(37, 37, 0, 0, 50_000 + 37 * j))
        assert vec[j] == step == lst[j]


@pytest.mark.parametrize("lead", [None, 1e6, 1e-6, 1.0, 1.0 + 1e-12, 1.0 - 1e-12, 1.0 + 1e-8])
def test_decode_step_times_takes_the_leading_side_as_the_loop_would(lead: float | None) -> None:
    """``decode_step_times`` takes the max of the decode attention's compute and memory sides
    once per call where one side's constant clearly leads: every step equals the step's own
    ``iteration_time`` bit for bit, memory-bound (the GPUs as they are), compute-bound, and with
    the two sides equal or within rounding of each other (the per-step comparison), from kv 0."""
    cm = CostModel(get_model("Llama-3-8B"), get_hardware("A100-80GB"), 1)
    if lead is not None:  # the memory side's rate set so memory / compute per token == lead
        flops_rate, _ = cm._decode_rates
        ratio = cm._kv_bytes_per_token / cm._decode_pair_flops * flops_rate
        cm._decode_rates = (flops_rate, ratio / lead)
    for n, context in ((1, 0), (7, 7), (24, 24 * 900 + 24), (256, 256 * 5000)):
        steps = cm.decode_step_times(n, context, 40)
        for j in range(40):
            assert steps[j] == cm.iteration_time(BatchShape(n, n, 0, 0, context + n * j))


def test_seed_preset_reproduces_the_essay_figures_and_warns_with_numbers():
    built = build_cost_model(Deployment("Llama-3-70B", "A100-80GB", 4, "seed"))
    cm = built.cost_model
    assert cm.prefill_time(4096) == pytest.approx(0.120, rel=0.05)
    assert cm.decode_time(10, 1024) == pytest.approx(0.018, rel=0.05)
    text = " ".join(built.fit.warnings)
    # 4,096 tokens x ~140 GFLOP per token needs >= 0.46 s on four A100s at 100% of peak.
    assert "prefill:4096" in text and "0.46" in text
    assert built.fit.efficiency.compute > 1


def test_seed_preset_at_another_tp_fits_at_tp4_and_applies_there():
    at4 = build_cost_model(Deployment("Llama-3-70B", "A100-80GB", 4, "seed")).cost_model
    at8 = build_cost_model(Deployment("Llama-3-70B", "A100-80GB", 8, "seed")).cost_model
    assert at8.efficiency == at4.efficiency
    assert at8.tp == 8 and at8.decode_time(10, 1024) < at4.decode_time(10, 1024)


def test_calibration_recovers_known_efficiencies_from_three_points():
    base = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    # The H100's fitted GEMM curve (p-norm, tiles, launches) with known efficiencies and overhead.
    truth = replace(base.efficiency, compute=0.55, memory=0.7, overhead=0.003)
    true_cm = base.with_efficiency(truth)
    text = ",".join(
        [
            f"prefill:8192={true_cm.prefill_time(8192)}",
            f"prefill:2048@4096={true_cm.prefill_time(2048, 4096)}",
            f"decode:1x512={true_cm.decode_time(1, 512)}",
            f"decode:64x2048={true_cm.decode_time(64, 2048)}",
        ]
    )
    fit = calibrate(base, parse_points(text))
    assert fit.efficiency.compute == pytest.approx(0.55, rel=1e-6)
    assert fit.efficiency.memory == pytest.approx(0.7, rel=1e-6)
    assert fit.efficiency.overhead == pytest.approx(0.003, rel=1e-6)
    assert fit.warnings == ()
    assert fit.max_relative_error < 1e-9


@pytest.mark.parametrize(
    "text", ["prefill=3", "prefill:-4=0.1", "decode:10=0.1", "decode:0x10=0.1", "prefill:10=-1", ""]
)
def test_bad_calibration_points_are_named(text):
    with pytest.raises(ValueError, match=r"calibration point|no calibration points"):
        parse_points(text)


def test_seed_points_are_the_essay_figures():
    assert PRESETS["seed"].points == "prefill:4096=0.120,decode:10x1024=0.018"


def test_kv_capacity_follows_memory_arithmetic():
    m, hw = get_model("Llama-3-70B"), get_hardware("A100-80GB")
    cap = kv_capacity(m, hw, 4, 0.9, 16, 2048)
    # Llama-3-70B: 80 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes = 320 KiB per token.
    assert m.kv_bytes_per_token() == 327_680
    assert cap.kv_bytes_per_token == 327_680 // 4
    assert cap.weights_gib == pytest.approx(70.55e9 * 2 / 4 / 2**30, rel=0.01)
    expected = (80 * 0.9 - cap.weights_gib - cap.activation_gib) * 2**30 / (16 * cap.kv_bytes_per_token)
    assert cap.num_blocks == int(expected)


def test_model_that_does_not_fit_names_the_problem_and_a_tp_that_works():
    with pytest.raises(ValueError, match=r"does not fit on A100-80GB at TP 1.*--tp 2"):
        kv_capacity(get_model("Llama-3-70B"), get_hardware("A100-80GB"), 1, 0.9, 16, 2048)


def test_hf_config_json_is_read(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,'
        ' "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,'
        ' "max_position_embeddings": 32768, "tie_word_embeddings": false}'
    )
    spec = load_hf_config(tmp_path)
    assert spec.num_params == get_model("Qwen2.5-7B").num_params
    assert get_model(str(tmp_path)).num_kv_heads == 4


def test_unknown_names_list_the_choices():
    with pytest.raises(ValueError, match=r"known: .*Llama-3-70B"):
        get_model("gpt-5")
    with pytest.raises(ValueError, match=r"known: .*H100-SXM"):
        get_hardware("TPUv5")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_catalog_parameter_counts_are_plausible(name):
    expected = {
        "Llama-2-7B": 6.7, "Llama-2-13B": 13.0, "Llama-2-70B": 69.0, "Llama-3-8B": 8.0,
        "Llama-3-70B": 70.6, "Llama-3.1-8B": 8.0, "Llama-3.1-70B": 70.6, "Mistral-7B": 7.2, "Yi-34B": 34.4, "Qwen2.5-7B": 7.6,
        "Qwen2.5-72B": 72.7, "Falcon-180B": 179.5, "OPT-13B": 12.9,
        # Published totals (tests/test_model_configs.py checks the active counts too).
        "Qwen3-8B": 8.2, "Qwen3-32B": 32.8, "phi-2": 2.78, "Qwen-72B": 72.3, "Mixtral-8x7B": 46.7,
        "Qwen3-30B-A3B": 30.5, "Qwen3-235B-A22B": 235.0, "gpt-oss-120b": 116.8, "gpt-oss-20b": 20.9,
        "Llama-4-Scout-17B-16E": 109.0, "Llama-4-Maverick-17B-128E": 400.0, "DeepSeek-V3": 671.0,
            "DeepSeek-R1-FP4": 671.0, "DeepSeek-R1-FP4-v2": 671.0,
        "Kimi-K2": 1000.0,  # the card's "1T" (1.03T counted)
    }[name]  # fmt: skip
    assert get_model(name).num_params / 1e9 == pytest.approx(expected, rel=0.03)


def test_tp_all_reduce_follows_the_ring_formula_and_its_efficiency():
    m, hw = get_model("Llama-3-70B"), get_hardware("A100-80GB")
    shape = BatchShape.of([(4096, 0)], [])
    one = CostModel(m, hw, 4, Efficiency(comm=1.0)).roofline(shape).comm_s
    half = CostModel(m, hw, 4, Efficiency(comm=0.5)).roofline(shape).comm_s
    # 2 all-reduces per layer of 4,096 x 8,192 bf16 activations, ring: 2 (tp-1)/tp of it per GPU.
    per_token = 2 * 80 * 1.5 * 8192 * 2 / hw.interconnect_bandwidth
    fixed = 2 * 80 * hw.allreduce_latency_at(4)
    assert one == pytest.approx(fixed + 4096 * per_token)
    assert half == pytest.approx(fixed + 2 * 4096 * per_token)
    assert CostModel(m, hw, 1).roofline(shape).comm_s == 0.0


def test_negative_overhead_is_pinned_at_zero_and_the_rest_refit():
    base = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    points = parse_points("prefill:4096=0.21,decode:32x1024=0.011,decode:1x128=0.008")
    fit = calibrate(base, points)
    assert fit.efficiency.overhead == 0.0
    assert 0 < fit.efficiency.compute < 1 and 0 < fit.efficiency.memory < 1
    # With overhead pinned, the two decode points are fitted by the memory efficiency alone.
    assert fit.max_relative_error < 0.3


def test_swap_cost_and_the_essays_per_gpu_figure(tmp_path):
    # Llama-3-70B has 8 KV heads: 0.33 MB of KV per token, 2.6 GB for 8,000 tokens, 0.33 GB per
    # GPU at TP 8 -> ~10 ms over PCIe 4 (32 GB/s).
    gqa = CostModel(get_model("Llama-3-70B"), get_hardware("A100-80GB"), 8)
    assert 8000 * get_model("Llama-3-70B").kv_bytes_per_token() == pytest.approx(2.62e9, rel=0.01)
    assert gqa.swap_time(8000) == pytest.approx(8000 * 327_680 / 8 / 32e9)
    # The essay's ~2.5 GB per GPU and ~0.1 s fit a 70B-class model without grouped-query
    # attention (64 KV heads, like LLaMA-65B).
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,'
        ' "num_key_value_heads": 64, "intermediate_size": 22016, "vocab_size": 32000,'
        ' "max_position_embeddings": 2048}'
    )
    mha = CostModel(load_hf_config(tmp_path), get_hardware("A100-80GB"), 8)
    assert 8000 * mha.model.kv_bytes_per_token(8) == pytest.approx(2.62e9, rel=0.01)
    assert mha.swap_time(8000) == pytest.approx(0.082, rel=0.02)


@settings(max_examples=100, deadline=None)
@given(
    model=st.sampled_from(["Llama-3-8B", "Llama-3-70B", "gpt-oss-20b"]),  # gpt-oss: sliding layers
    prefill=st.lists(st.tuples(st.integers(1, 8192), st.integers(0, 16384)), max_size=3),
    decodes=st.lists(st.integers(0, 32768), max_size=40),
)
def test_shape_time_equals_iteration_time_of_the_shape(model, prefill, decodes):
    """The chunk runs price BatchShape's fields without building one (``shape_time``): the
    same float as ``iteration_time`` of the shape, bit for bit."""
    cm = CostModel(get_model(model), get_hardware("H100-SXM"), 1)
    shape = BatchShape.of(prefill, decodes)
    fields = (shape.num_tokens, shape.num_logits, shape.prefill_pairs, shape.prefill_kv_tokens)
    rest = (shape.decode_kv_tokens, shape.num_prefills, shape.num_decodes)
    assert cm.shape_time(*fields, *rest) == cm.iteration_time(shape)


def test_per_logit_prices_each_sampled_row_on_every_path():
    # The host's work per sequence per step (sampling, detokenizing, streaming its token): each
    # sampled row adds per_logit, on the per-iteration, vectorised-decode and DP-group paths
    # alike; 0 (the default) leaves every time as it was.
    from tailserve.executors.simulated.cost_model import BatchShape, CostModel, Efficiency

    model, hw = get_model("Llama-3-8B"), get_hardware("A100-80GB")
    base = CostModel(model, hw, efficiency=Efficiency(compute=0.6, memory=0.7))
    per = CostModel(model, hw, efficiency=Efficiency(compute=0.6, memory=0.7, per_logit=3e-4))
    mixed = BatchShape(288, 33, 256 * 257 // 2, 256, 32 * 500, 1, 32)
    assert per.iteration_time(mixed) == pytest.approx(base.iteration_time(mixed) + 33 * 3e-4, rel=1e-12)
    runs = per.decode_run_times(16, 16 * 300, 5) - base.decode_run_times(16, 16 * 300, 5)
    assert runs == pytest.approx([16 * 3e-4] * 5, rel=1e-9)
    assert per.decode_step_times(16, 16 * 300, 5) == pytest.approx(
        list(per.decode_run_times(16, 16 * 300, 5))
    )
    chunk = BatchShape(512, 0, 512 * 513 // 2, 512, 0, 1, 0)  # a prefill chunk samples nothing
    assert per.iteration_time(chunk) == base.iteration_time(chunk)
    with pytest.raises(ValueError, match="per_logit must be >= 0"):
        Efficiency(per_logit=-1e-3)
