"""``LlamaModel.forward(..., out_rows=...)``: only the rows whose logits are wanted come out, and
with prepacked bf16 weights the last layer's output projection and MLP run on those rows alone —
with the same bits as the full forward pass."""

from __future__ import annotations

import pytest
import torch

from tailserve.executors.pytorch import model as model_mod
from tailserve.executors.pytorch.attention import PagedKVCache, build_metadata
from tailserve.executors.pytorch.cpu_backend import can_pack
from tailserve.executors.pytorch.init_model import init_model
from tailserve.executors.pytorch.loader import load_config, load_state_dict
from tailserve.executors.pytorch.model import LlamaModel

CPU = torch.device("cpu")


def _model(tmp_path, dtype: torch.dtype, preset: str = "tiny") -> LlamaModel:
    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    model_dir = tmp_path / name
    init_model(model_dir, preset, dtype=name, num_hidden_layers=2)
    config = load_config(model_dir)
    return LlamaModel(config, load_state_dict(model_dir, config, dtype, CPU), dtype, CPU)


def _step(model: LlamaModel, out_rows: torch.Tensor | None) -> torch.Tensor:
    """Two decodes and two prefill chunks (one after cached context) in one forward pass."""
    c = model.config
    kv = PagedKVCache(c.num_hidden_layers, 16, 16, c.num_key_value_heads, c.head_dim, model.dtype, CPU)
    g = torch.Generator().manual_seed(7)
    for t in (*kv.k, *kv.v):
        t[:16] = torch.randn(t[:16].shape, generator=g).to(model.dtype)
    new, ctx = [1, 1, 37, 20], [20, 9, 0, 18]
    tables = [[0, 1], [2], [3, 4, 5], [6, 7, 8]]
    meta = build_metadata(tables, new, ctx, 2, 16, kv.null_slot, CPU)
    ids = torch.randint(3, c.vocab_size, (sum(new),), generator=g)
    pos = torch.cat([torch.arange(x, x + n) for x, n in zip(ctx, new)])
    with torch.inference_mode():
        return model.forward(ids, pos, meta, kv, out_rows=out_rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_out_rows_equal_the_full_pass_rows(tmp_path, dtype) -> None:
    model = _model(tmp_path, dtype)
    assert model.packed == (dtype == torch.bfloat16 and can_pack(dtype, CPU))
    full = _step(model, None)
    rows = torch.tensor([0, 1, 38, 58, 40])  # the decodes, each chunk's last token, and one more
    got = _step(model, rows)
    assert got.shape == (5, model.config.hidden_size)
    assert torch.equal(got, full[rows])  # bit for bit: rows of a packed matmul are independent
    empty = _step(model, torch.empty(0, dtype=torch.long))
    assert empty.shape == (0, model.config.hidden_size)


def test_packed_last_layer_runs_only_the_output_rows(tmp_path, monkeypatch) -> None:
    model = _model(tmp_path, torch.bfloat16)
    if not model.packed:
        pytest.skip("bf16 weights are not prepacked here (no oneDNN)")
    seen: list[int] = []
    real = model_mod.linear

    def counting(x, weight, bias):
        seen.append(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(model_mod, "linear", counting)
    _step(model, torch.tensor([0, 1, 38, 58]))
    # Per layer: qkv, o, gate_up, down. Layer 0 all 59 tokens; layer 1's qkv too (its K/V are
    # stored), then o, gate_up and down on the 4 output rows.
    assert seen == [59, 59, 59, 59, 59, 4, 4, 4]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("preset", ["tiny", "tiny-moe", "tiny-qwen3-moe"])
def test_the_benchmarks_roofline_counts_the_flops_the_forward_pass_runs(
    tmp_path, monkeypatch, dtype, preset
) -> None:
    """``engine_cpu``'s prefill limit (``ModelCounts.prefill_flops``) is the matmul work the
    forward pass does: with packed weights the last layer's o_proj and MLP on the output rows
    alone, and of a MoE layer's experts the top-k a token is routed to (before r61 it counted
    both on every token: 1.26x the tiny model's work at W's prefill)."""
    from benchmarks._roofline import ModelCounts

    model = _model(tmp_path, dtype, preset)
    flops: list[int] = []
    real = model_mod.linear

    def counting(x, weight, bias):
        y = real(x, weight, bias)
        flops.append(2 * x.shape[0] * x.shape[1] * y.shape[1])
        return y

    monkeypatch.setattr(model_mod, "linear", counting)
    rows = torch.tensor([0, 1, 38, 58])
    _step(model, rows)
    counts = ModelCounts.from_config(model.config, torch.empty((), dtype=dtype).element_size())
    head = 2 * counts.num_lm_head_params * len(rows)  # the head is the executor's, not forward's
    assert sum(flops) == pytest.approx(counts.prefill_flops(59, len(rows), model.packed) - head, rel=1e-9)
