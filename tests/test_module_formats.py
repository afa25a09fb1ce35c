"""Groups of linear layers a quantized checkpoint keeps in another format (module_formats.py,
quant_exclusions.py, group_terms.py): the config lists read as the engines match them, and each
group's weight bytes and GEMM time at its own format."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tailserve.executors.simulated.cost_model import BatchShape, CostModel, Efficiency
from tailserve.executors.simulated.deployment import Deployment
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.hf_config import load_hf_config
from tailserve.executors.simulated.model_spec import ModelSpec
from tailserve.executors.simulated.models import MODELS
from tailserve.executors.simulated.module_formats import group_dtypes, group_params

# A tiny GQA model: hidden 64, 2 layers, 4 heads of 16 (2 KV heads), MLP 128, vocab 100.
TINY = ModelSpec("tiny", 64, 2, 4, 2, 128, 100, 4096, weight_dtype="fp8")
ATTENTION = 2 * 64 * 16 * (2 * 4 + 2 * 2)  # q, o (4 heads) and k, v (2 heads) of 2 layers: 24,576
MLP = 2 * 3 * 64 * 128  # gate, up, down of 2 layers: 49,152
HEAD = 100 * 64  # the LM head (the embedding as large)


def _config(tmp_path: Path, quantization: dict, base: dict | None = None) -> Path:
    from test_model_configs import CATALOG_CONFIGS

    cfg = {**(base or CATALOG_CONFIGS["DeepSeek-V3"]), "quantization_config": quantization}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def _compressed(ignore: list) -> dict:
    group = {"weights": {"num_bits": 8, "type": "float"}, "targets": ["Linear"]}
    return {"quant_method": "compressed-tensors", "config_groups": {"group_0": group}, "ignore": ignore}


# ---- reading the lists ------------------------------------------------------------------
def test_compressed_tensors_ignore_regex_keeps_the_routers_in_bf16(tmp_path):
    # RedHatAI's llm-compressor FP8 MoE checkpoints: lm_head and every router
    m = load_hf_config(_config(tmp_path, _compressed(["lm_head", "re:.*mlp.gate$"])))
    assert m.weight_dtype == "fp8"
    assert m.module_dtypes == (("router", "bf16"),)  # lm_head: bf16 already, not a change
    assert group_dtypes(m)["shared_experts"] == "fp8"  # mlp.gate_proj / shared_experts: not matched


def test_compressed_tensors_exact_names_must_cover_every_layer(tmp_path):
    names = [f"model.layers.{i}.mlp.gate" for i in range(3, 61)]
    assert load_hf_config(_config(tmp_path, _compressed(names))).module_dtypes == (("router", "bf16"),)
    with pytest.raises(ValueError, match=r"excludes 57 of the 58 router modules.*two formats"):
        load_hf_config(_config(tmp_path, _compressed(names[1:])))


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        (_compressed([".*mlp.gate$"]), r"neither a module name nor a 're:' regex"),
        (_compressed(["model.layers.*.mlp.gate"]), r"neither a module name nor a 're:' regex"),
        (_compressed(["re:("]), r"not a valid regex"),
        (_compressed("lm_head"), r"must be a list"),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["re:.*gate$"]}, r"is a regex"),
        ({"quant_method": "fp8", "modules_to_not_convert": ["*.mlp.gate"]}, r"is a glob"),
    ],
)
def test_a_pattern_in_a_style_its_list_does_not_use_is_one_line(tmp_path, quantization, message):
    with pytest.raises(ValueError, match=message) as error:
        load_hf_config(_config(tmp_path, quantization))
    assert "\n" not in str(error.value) and "config.json" in str(error.value)


def test_modelopt_globs_in_config_json(tmp_path):
    q = {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "ignore": ["lm_head", "model.layers.*.self_attn*"],
    }
    m = load_hf_config(_config(tmp_path, q))
    assert m.weight_dtype == "nvfp4"
    assert dict(m.module_dtypes) == {"attention": "bf16", "mla": "bf16"}
    # a parent module excludes its children (vLLM's substring rule, TensorRT-LLM's ancestor walk)
    q["ignore"] = [f"model.layers.{i}.self_attn" for i in range(61)]
    assert dict(load_hf_config(_config(tmp_path, q)).module_dtypes) == {"attention": "bf16", "mla": "bf16"}


def test_fp8_modules_to_not_convert_and_awq_substrings(tmp_path):
    from test_model_configs import CATALOG_CONFIGS

    llama = CATALOG_CONFIGS["Llama-3.1-8B"]
    exact = {"quant_method": "fp8", "modules_to_not_convert": ["lm_head"]}
    assert load_hf_config(_config(tmp_path, exact, llama)).module_dtypes == ()
    awq = {"quant_method": "awq", "bits": 4, "modules_to_not_convert": ["self_attn"]}
    m = load_hf_config(_config(tmp_path, awq, llama))
    assert m.weight_dtype == "int4" and m.module_dtypes == (("attention", "bf16"),)


def test_hf_quant_config_beside_config_json_is_read(tmp_path):
    from test_model_configs import HF_QUANT_CONFIGS

    (tmp_path / "hf_quant_config.json").write_text(json.dumps(HF_QUANT_CONFIGS["DeepSeek-R1-FP4-v2"]))
    m = load_hf_config(_config(tmp_path, {"quant_method": "fp8", "weight_block_size": [128, 128]}))
    assert (m.weight_dtype, m.expert_dtype) == ("nvfp4", "")  # hf_quant_config.json wins
    assert (
        m.module_dtypes == (("mla", "bf16"), ("router", "bf16")) == MODELS["DeepSeek-R1-FP4-v2"].module_dtypes
    )
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": "NVFP4"}))
    with pytest.raises(ValueError, match=r"hf_quant_config\.json: quantization must be an object"):
        load_hf_config(tmp_path)


def test_gpt_oss_keeps_its_mxfp4_experts_and_bf16_rest(tmp_path):
    from test_model_configs import CATALOG_CONFIGS

    m = load_hf_config(
        _config(
            tmp_path, CATALOG_CONFIGS["gpt-oss-20b"]["quantization_config"], CATALOG_CONFIGS["gpt-oss-20b"]
        )
    )
    assert m.module_dtypes == () and group_dtypes(m) == {
        "attention": "bf16", "experts": "mxfp4", "router": "bf16", "lm_head": "bf16"
    }  # fmt: skip


def test_bad_module_dtypes_are_refused():
    with pytest.raises(ValueError, match="group 'lm_head' unknown"):
        replace(TINY, module_dtypes=(("lm_head", "fp8"),))
    with pytest.raises(ValueError, match="which this model has none of"):
        replace(TINY, module_dtypes=(("router", "bf16"),))
    with pytest.raises(ValueError, match="unknown number format"):
        replace(TINY, module_dtypes=(("attention", "fp5"),))


# ---- the deployment's --quantization ------------------------------------------------------
def test_quantization_keeps_a_checkpoints_excluded_groups():
    whole = Deployment.of("DeepSeek-R1", "B200", 1, quantization="nvfp4").model_spec()
    assert set(group_dtypes(whole).values()) == {"nvfp4", "bf16"} and group_dtypes(whole)["mla"] == "nvfp4"
    fp4 = Deployment.of("DeepSeek-R1-FP4-v2", "B200", 1, quantization="nvfp4").model_spec()
    assert group_dtypes(fp4) == {
        "attention": "nvfp4", "mla": "bf16", "dense_mlp": "nvfp4", "experts": "nvfp4",
        "shared_experts": "nvfp4", "router": "bf16", "lm_head": "bf16",
    }  # fmt: skip
    assert group_dtypes(MODELS["DeepSeek-R1-FP4"])["attention"] == "bf16"  # v1: o_proj too


# ---- bytes and times per group, by hand ----------------------------------------------------
def test_weight_bytes_count_each_group_at_its_format():
    assert TINY.weight_bytes_per_shard() == ATTENTION * 1 + MLP * 1 + 2 * HEAD * 2
    mixed = replace(TINY, module_dtypes=(("attention", "bf16"),))
    assert mixed.weight_bytes_per_shard() == ATTENTION * 2 + MLP * 1 + 2 * HEAD * 2
    assert group_params(mixed, 1)["attention"] == ATTENTION


def test_r1_exclusion_costs_its_bf16_bytes_per_gpu():
    v2, whole = MODELS["DeepSeek-R1-FP4-v2"], replace(MODELS["DeepSeek-R1-FP4-v2"], module_dtypes=())
    params = group_params(v2, 1)
    extra = (params["mla"] + params["router"]) * (2.0 - (0.5 + 1 / 16))
    assert v2.weight_bytes_per_shard(1, 8) - whole.weight_bytes_per_shard(1, 8) == pytest.approx(extra)
    assert 4.2e9 < params["mla"] + params["router"] < 4.5e9  # docs/fidelity.md's ~4.3e9


def test_gemm_times_per_group_by_hand():
    hw = replace(get_hardware("H100"), gemm=None)  # no fitted format factors: the rates are the peaks'
    eff = Efficiency()  # the plain roofline: max(compute, memory)
    mixed = replace(TINY, module_dtypes=(("attention", "bf16"),))
    cm = CostModel(mixed, hw, efficiency=eff)
    bf16, fp8 = hw.peak_flops * eff.compute, hw.peak_for("fp8") * eff.compute
    assert fp8 > bf16
    kv = mixed.kv_bytes_per_token()
    weights = ATTENTION * 2 + MLP * 1 + HEAD * 2  # the layers and the LM head (not the embedding)
    tokens = 4096  # compute-bound: each group's FLOPs at its own rate, the LM head's at bf16's
    compute = tokens * (2 * ATTENTION / bf16 + 2 * MLP / fp8) + 2 * HEAD / bf16
    memory = (weights + tokens * kv) / (hw.memory_bandwidth * eff.memory)
    assert compute > memory
    assert cm.linear_time(tokens, 1) == pytest.approx(compute, rel=1e-12)
    # memory-bound: one token reads every weight at its own size
    one = (weights + kv) / (hw.memory_bandwidth * eff.memory)
    assert cm.linear_time(1, 0) == pytest.approx(one, rel=1e-12)
    all_fp8 = CostModel(TINY, hw, efficiency=eff)
    assert all_fp8.linear_time(tokens, 1) < cm.linear_time(tokens, 1)
    roof = cm.roofline(BatchShape.of([(tokens, 0)], []))
    assert roof.compute_s[0] == pytest.approx(
        tokens * (2 * ATTENTION / hw.peak_flops + 2 * MLP / hw.peak_for("fp8")) + 2 * HEAD / hw.peak_flops
    )


def test_one_format_named_as_a_group_prices_as_before():
    """A group named in the weights' own format changes nothing (the same floats)."""
    v3 = replace(MODELS["DeepSeek-V3"], weight_dtype="nvfp4", expert_dtype="nvfp4")
    same = replace(v3, module_dtypes=(("mla", "nvfp4"),))
    for hw in ("B200", "H200"):
        a, b = (CostModel(m, get_hardware(hw), 1, expert_parallel=True, dp=8) for m in (v3, same))
        assert a.decode_time(156, 2700) == pytest.approx(b.decode_time(156, 2700), rel=1e-12)
        assert a.prefill_time(3000) == pytest.approx(b.prefill_time(3000), rel=1e-12)


@pytest.mark.parametrize("hardware", ["B200", "H200", "H100"])
def test_a_group_kept_in_bf16_lies_between_all_quantized_and_none(hardware):
    hw = get_hardware(hardware)
    base = MODELS["Llama-3.1-70B"]  # the FP8 format curve where the GPU has one
    fp8 = replace(base, weight_dtype="fp8")
    mixed = replace(fp8, module_dtypes=(("attention", "bf16"),))
    times = [CostModel(m, hw, 4).prefill_time(4096) for m in (fp8, mixed, base)]
    assert times[0] < times[1] < times[2]
    r1 = [
        CostModel(MODELS[n], hw, 1, expert_parallel=True, dp=8).decode_time(156, 2700)
        for n in ("DeepSeek-R1-FP4-v2", "DeepSeek-R1-FP4")
    ]
    whole = replace(MODELS["DeepSeek-R1-FP4"], module_dtypes=())
    assert CostModel(whole, hw, 1, expert_parallel=True, dp=8).decode_time(156, 2700) < r1[0] < r1[1]


def test_cost_json_shows_each_groups_format(tmp_path, capsys):
    from tailserve.cli.app import main

    out = tmp_path / "cost.json"
    argv = ["cost", "--model", "DeepSeek-R1-FP4-v2", "--hardware", "B200", "--tp", "1", "--dp", "8",
            "--enable-expert-parallel", "--decode", "16x1000", "--prefill", "512", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    formats = json.loads(out.read_text())["weight_formats"]
    assert formats["mla"] == formats["router"] == "bf16" and formats["experts"] == "nvfp4"
    assert "weight formats by group: attention nvfp4, mla bf16" in capsys.readouterr().out
