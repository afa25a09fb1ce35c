"""load_config / load_state_dict: both config generations, sharded checkpoints, and every failure named."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tailserve.executors.pytorch.init_model import init_model, model_config
from tailserve.executors.pytorch.loader import (
    ModelConfig,
    ModelLoadError,
    expected_tensor_shapes,
    load_config,
    load_state_dict,
)
from torch_helpers import edit_json

MICRO = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 320,
    "max_position_embeddings": 256,
}


@pytest.fixture(scope="module")
def micro_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "micro", seed=1, **MICRO)


@pytest.fixture
def model_dir(micro_dir: Path, tmp_path: Path) -> Path:
    """A private copy each test may damage."""
    return Path(shutil.copytree(micro_dir, tmp_path / "copy"))


def _edit_config(model_dir: Path, **changes: object) -> None:
    edit_json(model_dir / "config.json", **changes)


@pytest.mark.parametrize(
    ("architecture", "extra"),
    [
        ("llama", {}),
        ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 1e6}),
        ("mistral", {"sliding_window": 4096}),
        ("qwen2", {"head_dim": 8}),
    ],
)
def test_config_round_trip(tmp_path: Path, architecture: str, extra: dict) -> None:
    written = model_config("tiny", architecture, "float32", **MICRO, **extra)
    out = init_model(tmp_path / "m", architecture=architecture, dtype="float32", **MICRO, **extra)
    assert load_config(out) == dataclasses.replace(written, name="m")


def test_legacy_rope_keys_and_eos_lists(model_dir: Path) -> None:
    # transformers 4.x style: top-level rope_theta, rope_scaling with "type"; eos as a list
    _edit_config(
        model_dir,
        rope_parameters=None,
        rope_theta=500000.0,
        rope_scaling={"type": "dynamic", "factor": 4.0},
        eos_token_id=[2, 9],
    )
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 4, 2]}))
    config = load_config(model_dir)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "dynamic", "factor": 4.0}
    assert config.eos_token_ids == (2, 9, 4)
    _edit_config(model_dir, rope_scaling={"rope_type": "default"}, rope_theta=None)
    config = load_config(model_dir)
    assert (config.rope_theta, config.rope_scaling) == (10000.0, None)


def test_rope_parameters_win_over_legacy_keys(model_dir: Path) -> None:
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,  # required, as in transformers' llama3 RoPE
    }
    _edit_config(model_dir, rope_parameters={**llama3, "rope_theta": 500000.0}, rope_theta=1.0)
    config = load_config(model_dir)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == llama3


def test_a_real_llama3_style_config(tmp_path: Path) -> None:
    """The keys Meta's Llama-3.1-8B-Instruct config.json has (no weights needed for the config)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 128256,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_config(tmp_path)
    assert (loaded.head_dim, loaded.num_key_value_heads, loaded.torch_dtype) == (128, 8, "bfloat16")
    assert loaded.eos_token_ids == (128001, 128008, 128009) and loaded.bos_token_id == 128000
    assert loaded.rope_scaling is not None and loaded.rope_scaling["rope_type"] == "llama3"
    assert 7.9e9 < loaded.num_params < 8.1e9


def test_qwen2_sliding_window_only_when_used(tmp_path: Path) -> None:
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_config(tmp_path)
    assert (loaded.sliding_window, loaded.attention_bias, loaded.o_proj_bias) == (None, True, False)
    config["use_sliding_window"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_config(tmp_path).sliding_window == 32768


def test_mistral_sliding_window_defaults_like_transformers(tmp_path: Path) -> None:
    out = init_model(tmp_path / "m", architecture="mistral", **MICRO)
    assert load_config(out).sliding_window is None  # written as null: full attention
    _edit_config(out, sliding_window=None)  # key absent: MistralConfig's default
    assert load_config(out).sliding_window == 4096
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(out).sliding_window == 4096


def test_dtype_from_the_weights_when_the_config_has_none(model_dir: Path) -> None:
    _edit_config(model_dir, torch_dtype=None, dtype=None)
    assert load_config(model_dir).torch_dtype == "bfloat16"


def test_state_dict_casts_and_keeps_hf_names(micro_dir: Path) -> None:
    config = load_config(micro_dir)
    stored = load_file(str(micro_dir / "model.safetensors"))
    state = load_state_dict(micro_dir, config, torch.float32)
    assert list(state) == list(expected_tensor_shapes(config))
    assert state["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, stored[name].float())


def test_sharded_checkpoint_loads_like_a_single_file(micro_dir: Path, tmp_path: Path) -> None:
    sharded = Path(shutil.copytree(micro_dir, tmp_path / "sharded"))
    stored = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(stored)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: stored[n] for n in part}, str(sharded / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    config = load_config(micro_dir)
    single = load_state_dict(micro_dir, config, torch.bfloat16)
    split = load_state_dict(sharded, config, torch.bfloat16)
    assert list(split) == list(single)
    assert all(torch.equal(split[n], single[n]) for n in single)
    # A shard named by the index but missing is named in the error.
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        ModelLoadError, match=r"names shard model-00002-of-00002\.safetensors, which is missing"
    ):
        load_state_dict(sharded, config, torch.bfloat16)


def test_harmless_extras_are_ignored(model_dir: Path) -> None:
    stored = load_file(str(model_dir / "model.safetensors"))
    stored["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(stored, str(model_dir / "model.safetensors"))
    config = load_config(model_dir)
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in load_state_dict(
        model_dir, config, torch.float32
    )
    # A tied model whose file also holds lm_head.weight (some exporters write it) loads too.
    _edit_config(model_dir, tie_word_embeddings=True)
    tied = load_state_dict(model_dir, load_config(model_dir), torch.float32)
    assert "lm_head.weight" not in tied


def _resave(model_dir: Path, edit) -> None:
    stored = load_file(str(model_dir / "model.safetensors"))
    edit(stored)
    save_file(stored, str(model_dir / "model.safetensors"))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "config.json").unlink(), r"config\.json: file not found"),
        (lambda d: (d / "config.json").write_text("{not json"), r"config\.json: not readable JSON"),
        (
            lambda d: _edit_config(d, architectures=["GPT2LMHeadModel"]),
            "unsupported architecture GPT2LMHeadModel; supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM",
        ),
        (lambda d: _edit_config(d, architectures=None), "'architectures' is missing"),
        (lambda d: _edit_config(d, hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
        (lambda d: _edit_config(d, num_key_value_heads=3), "not a multiple of num_key_value_heads 3"),
        (lambda d: _edit_config(d, hidden_size=-1), "'hidden_size' must be an integer >= 1, got -1"),
        (lambda d: _edit_config(d, vocab_size=None), "'vocab_size' is missing"),
        (lambda d: _edit_config(d, torch_dtype="int8", dtype=None), "dtype 'int8' is not supported"),
        (lambda d: _edit_config(d, quantization_config={"quant_method": "awq"}), "quantized checkpoints"),
    ],
)
def test_config_errors_name_the_file_and_the_problem(model_dir: Path, damage, message: str) -> None:
    damage(model_dir)
    with pytest.raises(ModelLoadError, match=message) as err:
        load_config(model_dir)
    assert str(model_dir) in str(err.value)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a model directory"):
        load_config(tmp_path / "nowhere")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda d: (d / "model.safetensors").unlink(),
            r"no model\.safetensors or model\.safetensors\.index\.json",
        ),
        (
            lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"),
            r"PyTorch pickle weights \(pytorch_model\.bin\).*convert them to safetensors",
        ),
        (lambda d: (d / "model.safetensors").write_bytes(b"garbage"), "not a readable safetensors file"),
        (
            lambda d: _resave(d, lambda s: s.pop("model.layers.1.mlp.down_proj.weight")),
            r"missing tensor\(s\) model\.layers\.1\.mlp\.down_proj\.weight",
        ),
        (
            lambda d: _resave(
                d, lambda s: s.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})
            ),
            r"unexpected tensor model\.layers\.0\.self_attn\.q_proj\.bias",
        ),
        (
            lambda d: _resave(d, lambda s: s.update({"model.norm.weight": torch.ones(65)})),
            r"tensor model\.norm\.weight has shape \[65\], config\.json implies \[64\]",
        ),
        (
            lambda d: _resave(
                d, lambda s: s.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)})
            ),
            r"model\.norm\.weight is stored as I32",
        ),
    ],
)
def test_weight_errors_name_the_tensor_and_file(model_dir: Path, damage, message: str) -> None:
    config = load_config(model_dir)
    damage(model_dir)
    with pytest.raises(ModelLoadError, match=message) as err:
        load_state_dict(model_dir, config, torch.float32)
    assert str(model_dir) in str(err.value)


def test_shape_error_from_a_config_that_disagrees(model_dir: Path) -> None:
    _edit_config(model_dir, intermediate_size=128)
    with pytest.raises(
        ModelLoadError, match=r"mlp\.gate_proj\.weight has shape \[96, 64\], config\.json implies \[128, 64\]"
    ):
        load_state_dict(model_dir, load_config(model_dir), torch.float32)


def test_model_load_error_is_a_value_error() -> None:
    # The CLI turns ValueError into "tailserve: error: ..." with exit status 2.
    assert issubclass(ModelLoadError, ValueError)
    assert ModelConfig.__dataclass_params__.frozen  # type: ignore[attr-defined]
