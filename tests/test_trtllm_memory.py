"""TensorRT-LLM's ``free_gpu_memory_fraction``: the fraction of the memory left after the weights
and the profiled activations (``KvCacheCreator._cal_max_tokens`` in ``_torch/pyexecutor/_util.py``:
``(total_gpu_memory - peak_memory + allocated_kv) * fraction``), not vLLM's fraction of the whole."""

from __future__ import annotations

import math

import pytest

from tailserve.assemble.simulated import policy_kv_capacity
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.executors.simulated.drafter_memory import DrafterMemory
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.kv_capacity import GIB, activation_reserve_bytes, kv_capacity
from tailserve.executors.simulated.models import get_model
from tailserve.executors.simulated.spec_decode import draft_layer_weight_bytes
from tailserve.policies.registry import PolicySpec
from tailserve.policies.trtllm import TrtllmPolicy


def test_the_fraction_is_of_what_weights_and_activations_leave():
    model, h200 = get_model("Llama-3-8B"), get_hardware("H200")
    weights = model.weight_bytes_per_shard(1)
    activation = activation_reserve_bytes(model, 1, 8192)
    trt = kv_capacity(model, h200, 1, 0.9, 32, 8192, of_free_memory=True)
    vllm = kv_capacity(model, h200, 1, 0.9, 32, 8192)
    # By hand: (M - W - A) x 0.9 against M x 0.9 - W - A; the difference is 0.1 x (W + A).
    assert trt.kv_gib * GIB == pytest.approx((h200.memory_bytes - weights - activation) * 0.9)
    assert vllm.kv_gib * GIB == pytest.approx(h200.memory_bytes * 0.9 - weights - activation)
    assert (trt.kv_gib - vllm.kv_gib) * GIB == pytest.approx(0.1 * (weights + activation))
    assert trt.num_blocks == math.floor(trt.kv_gib * GIB / (32 * model.kv_bytes_per_token(1)))
    assert trt.num_blocks > vllm.num_blocks


def test_the_trtllm_policy_sizes_its_pool_by_that_rule():
    built = build_cost_model(Deployment.of("Llama-3-8B", "H200", 1), "trtllm")
    spec = PolicySpec.make("trtllm", {})
    config = TrtllmPolicy.default_config(get_hardware("H200").device_info, 8192)
    got = policy_kv_capacity(built.cost_model, spec, config, 8192)
    want = kv_capacity(get_model("Llama-3-8B"), get_hardware("H200"), 1, 0.9, 32, 8192, of_free_memory=True)
    assert got.num_blocks == want.num_blocks
    # gpu_memory_utilization (the engine-wide flag) is that fraction: 0.5 halves the pool.
    half = policy_kv_capacity(
        built.cost_model, PolicySpec.make("trtllm", {"gpu_memory_utilization": 0.5}), config, 8192
    )
    assert half.kv_gib == pytest.approx(want.kv_gib * 0.5 / 0.9)


def test_draft_layers_add_their_kv_to_every_token():
    model, h200 = get_model("Llama-3-8B"), get_hardware("H200")
    plain = kv_capacity(model, h200, 1, 0.9, 32, 8192, of_free_memory=True)
    one = kv_capacity(model, h200, 1, 0.9, 32, 8192, of_free_memory=True, drafter=DrafterMemory(0, 1))
    # 32 layers + one draft layer: 33/32 of the bytes per token.
    assert one.kv_bytes_per_token == plain.kv_bytes_per_token * 33 // 32
    assert one.num_blocks == math.floor(plain.kv_gib * GIB / (32 * one.kv_bytes_per_token))


def test_a_model_that_does_not_fit_says_so_in_one_line():
    with pytest.raises(ValueError, match="does not fit") as error:
        kv_capacity(
            get_model("Llama-3-70B"), get_hardware("A100-80GB"), 1, 0.9, 32, 8192, of_free_memory=True
        )
    assert "\n" not in str(error.value) and "GiB is there" in str(error.value)


def _trtllm_capacity(flags: dict[str, object]):
    built = build_cost_model(
        Deployment.of("DeepSeek-V3", "H200", 8, "none", quantization="fp8", expert_parallel=True),
        "trtllm",
    )
    spec = PolicySpec.make("trtllm", flags)
    config = TrtllmPolicy.default_config(get_hardware("H200").device_info, 8192, **spec.flags)
    return built.cost_model.model, policy_kv_capacity(built.cost_model, spec, config, 8192)


def test_mtp_loads_one_module_but_sizes_kv_for_every_draft():
    # MTP-Eagle one-model (DeepSeek-V3's one MTP module, run once per draft): one MoE decoder
    # layer + eh_proj (2h x h, bf16, row-parallel) off the memory, num_nextn_predict_layers
    # layers of KV per token (get_num_spec_layers at 1.2).
    model, plain = _trtllm_capacity({})
    _, mtp = _trtllm_capacity(
        {"decoding_type": "MTP", "num_nextn_predict_layers": "3", "synthetic_acceptance_length": "2.5"}
    )
    layer = draft_layer_weight_bytes(model, 8)
    eh_proj = 2 * model.hidden_size**2 * 2 / 8
    assert mtp.weights_gib == pytest.approx(plain.weights_gib + (layer + eh_proj) / GIB)
    assert mtp.weights_gib - plain.weights_gib > 1.0  # an MoE layer's experts: over a GiB per GPU
    one_layer = plain.kv_bytes_per_token // model.num_layers
    assert mtp.kv_bytes_per_token == plain.kv_bytes_per_token + 3 * one_layer
    # The pool: (memory - weights - activations) x fraction, over the larger per-token bytes.
    assert mtp.kv_gib == pytest.approx(plain.kv_gib - (layer + eh_proj) / GIB * 0.9)
    assert mtp.num_blocks == math.floor(mtp.kv_gib * GIB / (32 * mtp.kv_bytes_per_token))


def test_eagle3_loads_its_draft_layer_and_one_layer_of_kv():
    model, plain = _trtllm_capacity({})
    _, eagle = _trtllm_capacity(
        {"decoding_type": "Eagle3", "max_draft_len": "3", "synthetic_acceptance_length": "2.0"}
    )
    layer = draft_layer_weight_bytes(model, 8)
    assert eagle.weights_gib == pytest.approx(plain.weights_gib + layer / GIB)
    assert eagle.kv_bytes_per_token == plain.kv_bytes_per_token + plain.kv_bytes_per_token // model.num_layers


def test_drafter_memory_rejects_negative_layers_in_one_line():
    with pytest.raises(ValueError, match="weight_layers must be >= 0"):
        DrafterMemory(-1, 1)
    with pytest.raises(ValueError, match="kv_layers must be >= 0"):
        DrafterMemory(1, -2)
