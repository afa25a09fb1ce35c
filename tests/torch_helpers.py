"""Tiny random models and a reference (Hugging Face transformers) for real-executor tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tailserve.executors.pytorch.init_model import init_model

MICRO = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
)


def micro_model(root: Path, name: str = "micro", dtype: str = "float32", **overrides: object) -> Path:
    out = root / name
    if not out.exists():
        init_model(out, preset="tiny", dtype=dtype, **{**MICRO, **overrides})
    return out


def edit_json(path: Path, **changes: object) -> None:
    """Set keys of a JSON file in a model directory; a None value removes the key."""
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def hf_greedy(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int, dtype=torch.float32
) -> list[list[int]]:
    """transformers' ``generate``, one prompt at a time, greedy, exactly ``max_new_tokens``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: EOS may be sampled, never stops
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs
