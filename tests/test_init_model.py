"""init_model writes directories that transformers loads unchanged, deterministically; the CLI wraps it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tailserve.cli import main
from tailserve.executors.pytorch import init_model as init_module
from tailserve.executors.pytorch.init_model import PRESETS, default_model_dir, init_model, model_config
from tailserve.executors.pytorch.loader import expected_tensor_shapes, load_config, load_state_dict

MICRO = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 384,
    "max_position_embeddings": 256,
}

VARIANTS = {
    "llama": ("llama", {}),
    "llama-biased-tied": ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
    "llama-rope-llama3": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
        },
    ),
    "mistral": ("mistral", {"head_dim": 32}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_transformers_loads_the_directory_with_our_tensors(tmp_path: Path, variant: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    architecture, extra = VARIANTS[variant]
    out = init_model(tmp_path / variant, architecture=architecture, dtype="float32", seed=3, **MICRO, **extra)
    ours = load_config(out)
    hf_config = AutoConfig.from_pretrained(out)
    assert type(hf_config).__name__ == ours.architecture.replace("ForCausalLM", "Config")
    assert hf_config.rope_parameters["rope_theta"] == ours.rope_theta
    if ours.rope_scaling:
        assert hf_config.rope_parameters["rope_type"] == ours.rope_scaling["rope_type"]
        assert hf_config.rope_parameters["factor"] == ours.rope_scaling["factor"]
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert type(hf).__name__ == ours.architecture
    hf_state = {k: v for k, v in hf.state_dict().items() if not k.endswith("inv_freq")}
    if ours.tie_word_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
        hf_state.pop("lm_head.weight")
    state = load_state_dict(out, ours, torch.float32)
    assert list(state) == list(expected_tensor_shapes(ours))
    assert set(state) == set(hf_state)
    for name, tensor in state.items():
        assert tensor.shape == hf_state[name].shape, name
        assert torch.equal(tensor, hf_state[name]), name
    assert ours.num_params == sum(p.numel() for p in hf.parameters())
    # The biases and norms are initialised as documented: biases drawn, norms one.
    if ours.attention_bias:
        assert state["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0
    assert torch.equal(state["model.norm.weight"], torch.ones(MICRO["hidden_size"]))
    std = state["model.layers.1.mlp.up_proj.weight"].std().item()
    assert 0.015 < std < 0.025


def test_hf_forward_runs_on_the_written_model(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = init_model(tmp_path / "m", dtype="bfloat16", **MICRO)
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert hf.dtype == torch.bfloat16
    with torch.no_grad():
        logits = hf(torch.tensor([[1, 50, 60, 70]])).logits
    assert logits.shape == (1, 4, MICRO["vocab_size"])
    assert torch.isfinite(logits).all()


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    a = init_model(tmp_path / "a", seed=7, **MICRO)
    b = init_model(tmp_path / "b", seed=7, **MICRO)
    c = init_model(tmp_path / "c", seed=8, **MICRO)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_presets_have_the_documented_shapes() -> None:
    tiny = model_config("tiny")
    assert (tiny.hidden_size, tiny.intermediate_size, tiny.num_hidden_layers) == (512, 1536, 4)
    assert (tiny.num_attention_heads, tiny.num_key_value_heads, tiny.head_dim) == (8, 4, 64)
    assert (tiny.vocab_size, tiny.max_position_embeddings, tiny.tie_word_embeddings) == (8192, 2048, False)
    # embeddings + lm_head + 4 x (q, k, v, o, gate, up, down, two norms) + final norm
    per_layer = 512 * 512 * 2 + 512 * 256 * 2 + 3 * 512 * 1536 + 2 * 512
    assert tiny.num_params == 2 * 8192 * 512 + 4 * per_layer + 512 == 20_976_128
    small = model_config("small")
    assert 95e6 < small.num_params < 105e6


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"preset": "huge"}, "unknown preset 'huge'"),
        ({"architecture": "gpt2"}, "unknown architecture 'gpt2'"),
        ({"dtype": "int8"}, "unknown dtype 'int8'"),
        ({"num_layers": 2}, "unknown config field(s) num_layers"),
        ({"hidden_size": "64"}, "hidden_size must be a positive integer"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
        ({"rope_scaling": {"factor": 2.0}}, "rope_scaling must be null or an object"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"hidden_size": 66}, "divisible by num_attention_heads"),
        ({"vocab_size": 100}, "vocab_size must be >= 261"),
        ({"vocab_size": 500_000}, "the shipped corpus supports at most"),
        ({"architecture": "qwen2", "attention_bias": True}, "Llama options"),
        ({"sliding_window": 128}, "Mistral / Qwen2 option"),
    ],
)
def test_bad_arguments_raise_value_error(tmp_path: Path, kwargs: dict, message: str) -> None:
    args = {**MICRO, **kwargs}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        init_model(tmp_path / "m", **args)
    assert not (tmp_path / "m").exists()


def test_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not an empty directory"):
        init_model(tmp_path, **MICRO)
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_default_model_dir_is_created_once_even_when_raced(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TAILSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(PRESETS, "micro", dict(MICRO))
    calls: list[Path] = []
    real_init = init_module.init_model

    def counting_init(out_dir, *args, **kwargs):
        calls.append(Path(out_dir))
        return real_init(out_dir, *args, **kwargs)

    monkeypatch.setattr(init_module, "init_model", counting_init)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(default_model_dir("micro"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = tmp_path / "cache" / "models" / "micro"
    assert results == [final] * 3
    assert load_config(final).hidden_size == 64
    # Losers' temporary directories are gone; only the winner remains.
    assert [p.name for p in final.parent.iterdir()] == ["micro"]
    before = len(calls)
    assert default_model_dir("micro") == final
    assert len(calls) == before  # reused, not rebuilt
    with pytest.raises(ValueError, match="unknown preset"):
        default_model_dir("nope")


def test_cli_model_init_tiny_writes_a_loadable_directory(tmp_path: Path, capsys) -> None:
    out = tmp_path / "tiny"
    assert main(["model", "init", "--out", str(out), "--preset", "tiny"]) == 0
    printed = capsys.readouterr().out
    assert "20,976,128 parameters" in printed and str(out) in printed
    config = load_config(out)
    assert (config.hidden_size, config.vocab_size, config.torch_dtype) == (512, 8192, "bfloat16")
    state = load_state_dict(out, config, torch.bfloat16)
    assert sum(t.numel() for t in state.values()) == 20_976_128


def test_cli_model_init_overrides_and_errors(tmp_path: Path, capsys) -> None:
    out = tmp_path / "m"
    argv = ["model", "init", "--out", str(out), "--architecture", "qwen2", "--dtype", "float32"]
    for key, value in MICRO.items():
        argv += ["--set", f"{key}={value}"]
    assert main([*argv, "--set", "tie_word_embeddings=true"]) == 0
    config = load_config(out)
    assert (config.model_type, config.tie_word_embeddings, config.torch_dtype) == ("qwen2", True, "float32")
    capsys.readouterr()
    assert main(argv) == 2  # the directory is no longer empty
    assert "tailserve: error:" in capsys.readouterr().err
    assert main(["model", "init", "--out", str(tmp_path / "x"), "--set", "hidden_size"]) == 2
    assert "expected FIELD=VALUE" in capsys.readouterr().err
    assert main(["model", "init", "--out", str(tmp_path / "y"), "--preset", "huge"]) == 2
    assert "unknown preset 'huge'; known: tiny, small, tiny-moe, tiny-qwen3-moe" in capsys.readouterr().err
