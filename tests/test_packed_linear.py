"""bf16 weights prepacked for this level's matmul (``cpu_backend.PackedLinear``: tailserve's dpbf16 or
AVX2 kernel, or oneDNN) compute what ``F.linear`` does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tailserve.executors.pytorch.cpu_backend import PackedLinear, can_pack
from tailserve.executors.pytorch.model import LlamaModel, linear

BF16 = torch.bfloat16
CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    not can_pack(BF16, CPU), reason="no weight packing at this level (or no oneDNN in this torch)"
)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("shape", [(1536, 512), (512, 768), (96, 64)])
def test_packed_linear_matches_f_linear(rows, shape):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(*shape, generator=g).to(BF16)
    b = torch.randn(shape[0], generator=g).to(BF16)
    x = torch.randn(rows, shape[1], generator=g).to(BF16)
    packed = PackedLinear(w)
    assert (packed.out_features, packed.in_features, packed.numel) == (*shape, w.numel())
    for bias in (None, b):
        got, want = linear(x, packed, bias), F.linear(x, w, bias)
        assert got.dtype == BF16 and got.shape == want.shape
        # Both accumulate in float32 and round once; equal here, one bf16 step at most elsewhere.
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_only_bf16_cpu_weights_are_packed(monkeypatch):
    assert not can_pack(torch.float32, CPU)
    monkeypatch.setenv("TAILSERVE_PACK_WEIGHTS", "0")
    assert not can_pack(BF16, CPU)


def test_packed_model_logits_and_parameter_count(tmp_path, monkeypatch):
    from tailserve.executors.pytorch.attention import PagedKVCache, build_metadata
    from tailserve.executors.pytorch.init_model import init_model
    from tailserve.executors.pytorch.loader import load_config, load_state_dict

    model_dir = tmp_path / "m"
    init_model(model_dir, "tiny", dtype="bfloat16")
    config = load_config(model_dir)
    state = load_state_dict(model_dir, config, BF16, CPU)
    packed = LlamaModel(config, state, BF16, CPU)
    monkeypatch.setenv("TAILSERVE_PACK_WEIGHTS", "0")
    plain = LlamaModel(config, state, BF16, CPU)
    assert packed.packed and not plain.packed
    assert isinstance(packed.layers[0].qkv, PackedLinear) and isinstance(plain.layers[0].qkv, torch.Tensor)
    assert packed.num_parameters == plain.num_parameters == config.num_params
    ids = torch.randint(3, config.vocab_size, (40,), generator=torch.Generator().manual_seed(5))
    logits = []
    for model in (packed, plain):
        kv = PagedKVCache(
            config.num_hidden_layers, 8, 16, config.num_key_value_heads, config.head_dim, BF16, CPU
        )
        meta = build_metadata([[0, 1, 2]], [40], [0], 0, 16, kv.null_slot, CPU)
        with torch.inference_mode():
            logits.append(model.compute_logits(model.forward(ids, torch.arange(40), meta, kv)))
    torch.testing.assert_close(logits[0], logits[1], rtol=0.05, atol=0.05)
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean() >= 0.9
