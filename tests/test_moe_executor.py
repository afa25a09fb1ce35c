"""Mixture-of-experts models in the real executor (Mixtral and Qwen3-MoE layouts): float32 logits
and greedy tokens equal transformers' under every policy, with chunked prefill and several
requests at once; both expert layouts transformers reads load alike; other MoE layouts and bad
expert configs are refused in one line; ``model init --preset tiny-moe`` and ``run`` work."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tailserve.cli import main
from tailserve.executors.pytorch.init_model import init_model, model_config
from tailserve.executors.pytorch.loader import ModelLoadError, load_config, load_state_dict
from tailserve.executors.pytorch.model import LlamaModel
from tailserve.llm import LLM, SamplingParams
from tailserve.policies.registry import POLICIES
from torch_helpers import edit_json, hf_greedy

MAX_NEW = 10
SMALL = {"vocab_size": 512, "max_position_embeddings": 256}  # a quick tokenizer; the shapes stay
KV_GIB = 4096 * 256 / 2**30


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {
        preset: init_model(root / preset, preset=preset, dtype="float32", **SMALL)
        for preset in ("tiny-moe", "tiny-qwen3-moe")
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(11)
    ps = [[1] + [rng.randrange(3, 512) for _ in range(n - 1)] for n in (5, 17, 40, 33, 8, 60, 1)]
    ps.append([*ps[2][:32], 7, 8, 9])  # a prefix hit on prompt 2's first two blocks
    return ps


@pytest.fixture(scope="module")
def references(models, prompts) -> dict[str, list[list[int]]]:
    return {preset: hf_greedy(d, prompts, MAX_NEW) for preset, d in models.items()}


def _generate(model_dir: Path, prompts, policy: str = "vllm", **flags) -> list[list[int]]:
    flags.setdefault("kv_cache_memory_gib", KV_GIB)
    llm = LLM(str(model_dir), policy=policy, dtype="float32", check_integrity=True, **flags)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
    )
    assert not llm.engine.has_unfinished_requests()
    return [o.token_ids for o in outs]


def _ours(model_dir: Path) -> LlamaModel:
    config = load_config(model_dir)
    state = load_state_dict(model_dir, config, torch.float32)
    return LlamaModel(config, state, torch.float32, torch.device("cpu"))


def test_presets_have_the_documented_shapes() -> None:
    mix = model_config("tiny-moe")
    assert (mix.architecture, mix.num_experts, mix.num_experts_per_tok) == ("MixtralForCausalLM", 8, 2)
    assert (mix.hidden_size, mix.moe_intermediate_size, mix.moe_layers) == (64, 128, (0, 1, 2, 3))
    # embeddings + lm_head + 4 x (q, k, v, o, router, 8 x (w1, w3, w2), two norms) + final norm
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 8 * 64 + 8 * 3 * 64 * 128 + 2 * 64
    assert mix.num_params == 2 * 8192 * 64 + 4 * per_layer + 64 == 1_886_784
    qwen = model_config("tiny-qwen3-moe")
    assert (qwen.model_type, qwen.qk_norm, qwen.norm_topk_prob) == ("qwen3_moe", True, True)
    assert (qwen.moe_layers, qwen.moe_intermediate_size) == ((0, 2, 3), 64)
    with pytest.raises(ValueError, match="mixture-of-experts model"):
        model_config("tiny-moe", "llama")
    with pytest.raises(ValueError, match="num_experts_per_tok 9 is more than num_local_experts 8"):
        model_config("tiny-moe", num_experts_per_tok=9)


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-qwen3-moe"])
def test_config_and_parameter_count_round_trip(models, preset) -> None:
    config = load_config(models[preset])
    want = model_config(preset, dtype="float32", **SMALL)
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"):
        assert getattr(config, field) == getattr(want, field), field
    assert (config.moe_layers, config.qk_norm) == (want.moe_layers, want.qk_norm)
    assert _ours(models[preset]).num_parameters == config.num_params


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-qwen3-moe"])
def test_logits_of_one_forward_match_transformers(models, prompts, preset) -> None:
    from transformers import AutoModelForCausalLM

    from tailserve.executors.pytorch.attention import PagedKVCache, build_metadata

    d = models[preset]
    ours = _ours(d)
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = torch.tensor(prompts[5])
    kv = PagedKVCache(4, 8, 16, 2, 16, torch.float32, torch.device("cpu"))
    meta = build_metadata([[6, 2, 7, 0]], [len(ids)], [0], 0, 16, kv.null_slot, torch.device("cpu"))
    with torch.inference_mode():
        got = ours.compute_logits(ours.forward(ids, torch.arange(len(ids)), meta, kv))
        want = ref(ids[None]).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_gives_transformers_tokens(models, prompts, references, policy) -> None:
    assert _generate(models["tiny-moe"], prompts, policy) == references["tiny-moe"]


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-qwen3-moe"])
@pytest.mark.parametrize("budget", [5, 16])
def test_chunked_prefill_and_batching_match(models, prompts, references, preset, budget) -> None:
    got = _generate(models[preset], prompts, max_num_batched_tokens=budget, max_num_seqs=4)
    assert got == references[preset]


def test_qwen3_moe_under_sglang(models, prompts, references) -> None:
    assert _generate(models["tiny-qwen3-moe"], prompts, "sglang") == references["tiny-qwen3-moe"]


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-qwen3-moe"])
def test_fused_expert_layout_loads_like_per_expert(models, preset, tmp_path) -> None:
    """transformers' in-memory layout (experts fused into gate_up_proj / down_proj, router at
    mlp.gate) as a checkpoint: the same tensors, split per expert."""
    from transformers import AutoModelForCausalLM

    d = models[preset]
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    out = tmp_path / "fused"
    out.mkdir()
    for name in ("config.json", "generation_config.json"):
        (out / name).write_bytes((d / name).read_bytes())
    save_file(state, str(out / "model.safetensors"))
    config = load_config(d)
    a = load_state_dict(d, config, torch.float32)
    b = load_state_dict(out, config, torch.float32)
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _copy(models: dict[str, Path], preset: str, folder: Path) -> Path:
    shutil.copytree(models[preset], folder)
    return folder


def _refusal(d: Path, message: str, what: str = "config") -> str:
    """The loader's error for ``d`` (it must match ``message``)."""
    with pytest.raises(ModelLoadError, match=message) as err:
        config = load_config(d)
        if what == "weights":
            load_state_dict(d, config, torch.float32)
    return str(err.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": ["Qwen2MoeForCausalLM"]}, "mixture-of-experts architecture Qwen2MoeForCausalLM"),
        (
            {"architectures": ["DeepseekV3ForCausalLM"]},
            "supported MoE: MixtralForCausalLM, Qwen3MoeForCausalLM",
        ),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 is more than the 8 experts"),
        ({"num_local_experts": 0}, "'num_local_experts' must be an integer >= 1"),
        ({"num_local_experts": 10**6}, "'num_local_experts' must be at most 4,096"),
    ],
)
def test_mixtral_config_refusals_are_one_line(models, tmp_path, changes, message) -> None:
    d = _copy(models, "tiny-moe", tmp_path / "m")
    edit_json(d / "config.json", **changes)
    line = _refusal(d, message)
    assert "\n" not in line and str(d) in line


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"mlp_only_layers": [7]}, "'mlp_only_layers' must be a list of layer indices below 4"),
        ({"decoder_sparse_step": 0}, "'decoder_sparse_step' must be an integer >= 1"),
        ({"num_experts": 4}, r"unexpected tensor model\.layers\.0\.mlp\.experts\.4\."),
        (
            {"moe_intermediate_size": 32},
            r"experts\.0\.gate_proj\.weight has shape \[64, 64\], config\.json implies \[32, 64\]",
        ),
        (
            {"mlp_only_layers": [0, 1]},
            r"missing tensor\(s\) model\.layers\.0\.mlp\.gate_proj\.weight",
        ),
    ],
)
def test_qwen3_moe_refusals_are_one_line(models, tmp_path, changes, message) -> None:
    d = _copy(models, "tiny-qwen3-moe", tmp_path / "q")
    edit_json(d / "config.json", **changes)
    line = _refusal(d, message, "weights")
    assert "\n" not in line and str(d) in line


def test_shared_experts_are_refused_as_unexpected_tensors(models, tmp_path) -> None:
    """A Qwen2-MoE-style shared expert in a Qwen3-MoE directory is a layout the model lacks."""
    d = _copy(models, "tiny-qwen3-moe", tmp_path / "shared")
    state = load_file(str(d / "model.safetensors"))
    state["model.layers.0.mlp.shared_expert.gate_proj.weight"] = torch.zeros(64, 64)
    save_file(state, str(d / "model.safetensors"))
    line = _refusal(
        d, r"unexpected tensor model\.layers\.0\.mlp\.shared_expert\.gate_proj\.weight", "weights"
    )
    assert "\n" not in line and str(d) in line


def test_cli_model_init_and_run(tmp_path, capsys) -> None:
    out = tmp_path / "tm"
    argv = ["model", "init", "--out", str(out), "--preset", "tiny-moe", "--dtype", "float32"]
    assert main([*argv, "--set", "vocab_size=512"]) == 0
    assert "MixtralForCausalLM" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["num_local_experts"] == 8
    prompts = Path(__file__).resolve().parents[1] / "examples" / "prompts.txt"
    assert main(["run", "--model", str(out), "--prompts", str(prompts), "--max-tokens", "16"]) == 0
