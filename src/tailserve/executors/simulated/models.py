"""Model catalog: the shapes that decide FLOPs, weight bytes and KV bytes, per tensor-parallel shard.

Built-in entries copy the public Hugging Face ``config.json`` of each model; any other model is
read from a local ``config.json`` path (or a directory holding one).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tailserve.executors.simulated.hf_config import load_hf_config as _read_hf_config
from tailserve.executors.simulated.model_spec import ModelSpec

__all__ = ["HF_REPOS", "MODELS", "ModelSpec", "get_model", "load_hf_config", "resolve_model_name"]


# DeepSeek-V3 (deepseek-ai/DeepSeek-V3; R1 has the same shapes): MLA (q_lora 1536,
# kv_lora 512, rope 64, nope 128, v 128), 3 dense layers of 18432, then 256 experts of
# 2048 (top 8) and 1 shared; FP8 weights as released (quant_method fp8, 128x128 blocks).
# The MTP layer (num_nextn_predict_layers) runs only for speculative decoding: not counted.
_DEEPSEEK_V3 = ModelSpec(
    "DeepSeek-V3", 7168, 61, 128, 128, 18432, 129280, 163840,
    num_experts=256, experts_per_token=8, moe_intermediate_size=2048,
    shared_intermediate_size=2048, first_dense_layers=3,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, weight_dtype="fp8_block",
)  # fmt: skip

MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("Llama-2-7B", 4096, 32, 32, 32, 11008, 32000, 4096),
        ModelSpec("Llama-2-13B", 5120, 40, 40, 40, 13824, 32000, 4096),
        ModelSpec("Llama-2-70B", 8192, 80, 64, 8, 28672, 32000, 4096),
        ModelSpec("Llama-3-8B", 4096, 32, 32, 8, 14336, 128256, 8192),
        ModelSpec("Llama-3-70B", 8192, 80, 64, 8, 28672, 128256, 8192),
        # Llama 3.1: the same shapes with a 128K context (RoPE scaling), for long-prompt traces.
        ModelSpec("Llama-3.1-8B", 4096, 32, 32, 8, 14336, 128256, 131072),
        ModelSpec("Llama-3.1-70B", 8192, 80, 64, 8, 28672, 128256, 131072),
        ModelSpec("Mistral-7B", 4096, 32, 32, 8, 14336, 32000, 32768),
        ModelSpec("Yi-34B", 7168, 60, 56, 8, 20480, 64000, 4096),
        ModelSpec("Qwen2.5-7B", 3584, 28, 28, 4, 18944, 152064, 32768),
        ModelSpec("Qwen2.5-72B", 8192, 80, 64, 8, 29568, 152064, 32768),
        ModelSpec("Falcon-180B", 14848, 80, 232, 8, 59392, 65024, 2048, gated_mlp=False),
        # OPT-13B (facebook/opt-13b): ReLU MLP (2 matrices), tied embeddings; the Anyscale benchmark's model.
        ModelSpec("OPT-13B", 5120, 40, 40, 40, 20480, 50272, 2048, gated_mlp=False, tie_word_embeddings=True),
        # The entries below copy each model's public config.json field for field (the test
        # tests/test_model_configs.py reads the same fields through load_hf_config).
        # Qwen3 dense (Qwen/Qwen3-8B, Qwen/Qwen3-32B): head_dim 128 (32B: wider than 5120 / 64).
        ModelSpec("Qwen3-8B", 4096, 36, 32, 8, 12288, 151936, 40960),
        ModelSpec("Qwen3-32B", 5120, 64, 64, 8, 25600, 151936, 40960, head_dim=128),
        # phi-2 (microsoft/phi-2): fc1 -> gelu_new -> fc2, float16 checkpoint.
        ModelSpec("phi-2", 2560, 32, 32, 32, 10240, 51200, 2048, gated_mlp=False),
        # Qwen-72B v1 (Qwen/Qwen-72B, remote code): intermediate_size 49152 counts w1 and w2, each
        # 24576 wide; MHA with kv_channels 128.
        ModelSpec("Qwen-72B", 8192, 80, 64, 64, 24576, 152064, 32768),
        # Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1): 8 experts of 14336, top 2, every layer.
        ModelSpec(
            "Mixtral-8x7B", 4096, 32, 32, 8, 14336, 32000, 32768,
            num_experts=8, experts_per_token=2, moe_intermediate_size=14336,
        ),
        # Qwen3 MoE (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B): 128 experts, top 8, every layer,
        # no shared expert; intermediate_size is the (unused) dense width of the config.
        ModelSpec(
            "Qwen3-30B-A3B", 2048, 48, 32, 4, 6144, 151936, 40960, head_dim=128,
            num_experts=128, experts_per_token=8, moe_intermediate_size=768,
        ),
        ModelSpec(
            "Qwen3-235B-A22B", 4096, 94, 64, 4, 12288, 151936, 40960, head_dim=128,
            num_experts=128, experts_per_token=8, moe_intermediate_size=1536,
        ),
        # gpt-oss (openai/gpt-oss-120b, -20b): experts of intermediate_size 2880, top 4, MXFP4
        # experts (quantization_config mxfp4), bf16 attention; layer_types alternates a 128-token
        # sliding window and full attention.
        ModelSpec(
            "gpt-oss-120b", 2880, 36, 64, 8, 2880, 201088, 131072, head_dim=64,
            num_experts=128, experts_per_token=4, moe_intermediate_size=2880,
            sliding_window=128, num_sliding_layers=18, expert_dtype="mxfp4",
        ),
        ModelSpec(
            "gpt-oss-20b", 2880, 24, 64, 8, 2880, 201088, 131072, head_dim=64,
            num_experts=32, experts_per_token=4, moe_intermediate_size=2880,
            sliding_window=128, num_sliding_layers=12, expert_dtype="mxfp4",
        ),
        # Llama 4 (meta-llama/Llama-4-*-Instruct, text_config): every layer (Scout) or every
        # second layer (Maverick, interleave_moe_layer_step 2) routes to one of the experts of
        # intermediate_size 8192 plus one shared expert of the same width; Maverick's other layers
        # have a dense MLP of intermediate_size_mlp 16384 (Scout has none, its 16384 unused).
        ModelSpec(
            "Llama-4-Scout-17B-16E", 5120, 48, 40, 8, 16384, 202048, 10485760,
            num_experts=16, experts_per_token=1, moe_intermediate_size=8192,
            shared_intermediate_size=8192,
        ),
        ModelSpec(
            "Llama-4-Maverick-17B-128E", 5120, 48, 40, 8, 16384, 202048, 1048576,
            num_experts=128, experts_per_token=1, moe_intermediate_size=8192,
            shared_intermediate_size=8192, moe_layer_step=2,
        ),
        _DEEPSEEK_V3,
        # NVIDIA's NVFP4 DeepSeek-R1 checkpoints (TensorRT Model Optimizer): the routed and shared
        # experts, the dense layers' MLPs in NVFP4; MLA's projections (fused_a = q_a + kv_a,
        # q_b_proj, kv_b_proj), the routers (mlp.gate) and the LM head in bf16. -v2 with the
        # hf_quant_config.json MLPerf v5.1 substitutes into it (mlcommons/inference_results_v5.1
        # closed/NVIDIA/code/deepseek-r1/tensorrt/hf_quant_config.json:10-490 @965182b0, README.md:34-41):
        # o_proj ("WO_GEMM") in NVFP4. nvidia/DeepSeek-R1-FP4 (the README's first checkpoint,
        # README.md:28-31) predates that: "the weight of WO_GEMM is additionally quantized to FP4"
        # in v2 (README.md:34), so its o_proj is bf16 too. KV format: the deployment's flag.
        replace(
            _DEEPSEEK_V3, name="DeepSeek-R1-FP4", weight_dtype="nvfp4",
            module_dtypes=(("attention", "bf16"), ("mla", "bf16"), ("router", "bf16")),
        ),
        replace(
            _DEEPSEEK_V3, name="DeepSeek-R1-FP4-v2", weight_dtype="nvfp4",
            module_dtypes=(("mla", "bf16"), ("router", "bf16")),
        ),
        # Kimi-K2 (moonshotai/Kimi-K2-Instruct, model_type kimi_k2 with DeepSeek-V3's fields):
        # 64 heads, 384 experts (top 8) and 1 shared, 1 dense layer; FP8 as released.
        ModelSpec(
            "Kimi-K2", 7168, 61, 64, 64, 18432, 163840, 131072,
            num_experts=384, experts_per_token=8, moe_intermediate_size=2048,
            shared_intermediate_size=2048, first_dense_layers=1,
            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
            v_head_dim=128, weight_dtype="fp8_block",
        ),
    )
}  # fmt: skip


def load_hf_config(path: str | Path) -> ModelSpec:
    """A ``ModelSpec`` from a Hugging Face ``config.json``, read by its ``model_type``'s reader
    (``hf_config.READERS``); ValueError naming the supported families otherwise."""
    return _read_hf_config(path)


# Hugging Face repositories of the catalog's models: ``tune`` prints them in engine command lines,
# and ``--model`` accepts them (and their -Instruct / -chat variants, which share the shapes).
HF_REPOS: dict[str, str] = {
    "Llama-2-7B": "meta-llama/Llama-2-7b-hf",
    "Llama-2-13B": "meta-llama/Llama-2-13b-hf",
    "Llama-2-70B": "meta-llama/Llama-2-70b-hf",
    "Llama-3-8B": "meta-llama/Meta-Llama-3-8B",
    "Llama-3-70B": "meta-llama/Meta-Llama-3-70B",
    "Llama-3.1-8B": "meta-llama/Llama-3.1-8B",
    "Llama-3.1-70B": "meta-llama/Llama-3.1-70B",
    "Mistral-7B": "mistralai/Mistral-7B-v0.1",
    "Yi-34B": "01-ai/Yi-34B",
    "Qwen2.5-7B": "Qwen/Qwen2.5-7B",
    "Qwen2.5-72B": "Qwen/Qwen2.5-72B",
    "Falcon-180B": "tiiuae/falcon-180B",
    "Qwen3-8B": "Qwen/Qwen3-8B",
    "Qwen3-32B": "Qwen/Qwen3-32B",
    "phi-2": "microsoft/phi-2",
    "Qwen-72B": "Qwen/Qwen-72B",
    "Mixtral-8x7B": "mistralai/Mixtral-8x7B-v0.1",
    "Qwen3-30B-A3B": "Qwen/Qwen3-30B-A3B",
    "Qwen3-235B-A22B": "Qwen/Qwen3-235B-A22B",
    "gpt-oss-120b": "openai/gpt-oss-120b",
    "gpt-oss-20b": "openai/gpt-oss-20b",
    "Llama-4-Scout-17B-16E": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    "Llama-4-Maverick-17B-128E": "meta-llama/Llama-4-Maverick-17B-128E-Instruct",
    "DeepSeek-V3": "deepseek-ai/DeepSeek-V3",
    "DeepSeek-R1-FP4": "nvidia/DeepSeek-R1-FP4",
    "DeepSeek-R1-FP4-v2": "nvidia/DeepSeek-R1-FP4-v2",
    "Kimi-K2": "moonshotai/Kimi-K2-Instruct",
}

# Other repositories whose config.json has exactly a catalog entry's shapes and formats.
HF_SAME_SHAPES: dict[str, str] = {
    "deepseek-ai/DeepSeek-R1": "DeepSeek-V3",
    "deepseek-ai/DeepSeek-R1-0528": "DeepSeek-V3",
    "deepseek-ai/DeepSeek-V3-0324": "DeepSeek-V3",
}

# Suffixes of a repository name that leave the architecture as it is (fine-tunes, format tags,
# Mistral's point releases). Anything else ("-200K", "-1M") may change the shape: not matched.
_HF_SUFFIXES = (
    "-instruct", "-chat", "-hf", "-it", "-base", "-v0.1", "-v0.2", "-v0.3", "-fp16", "-bf16",
)  # fmt: skip


def _hf_key(text: str) -> str:
    """``meta-llama/Meta-Llama-3-8B-Instruct`` -> ``llama-3-8b``: no organisation, no ``Meta-``
    prefix, fine-tune suffixes dropped, lower case; catalog names reduce to themselves."""
    key = text.strip().rsplit("/", 1)[-1].lower()
    key = key.removeprefix("meta-")
    stripped = True
    while stripped:
        stripped = False
        for suffix in _HF_SUFFIXES:
            if key.endswith(suffix):
                key, stripped = key[: -len(suffix)], True
    return key.replace("llama3", "llama-3").replace("llama2", "llama-2")


def resolve_model_name(name_or_path: str) -> str:
    """The catalog name for any accepted spelling (any case, or a Hugging Face id of a catalog
    model when exactly one entry matches), else the path to a local config; ValueError otherwise.
    Everything downstream (defaults, labels, JSON) reads the result, never the spelling."""
    key = name_or_path.strip()
    for known in MODELS:
        if known.lower() == key.lower():
            return known
    if key and Path(key).exists():
        return key
    for known, repo in HF_REPOS.items():
        if repo.lower() == key.lower():
            return known
    for repo, known in HF_SAME_SHAPES.items():
        # the repository or its bare name ("DeepSeek-R1"), as a catalog model's is taken below
        if repo.lower() == key.lower() or _hf_key(repo) == _hf_key(key):
            return known
    matches = [known for known in MODELS if _hf_key(known) == _hf_key(key)]
    if key and len(matches) == 1:
        return matches[0]
    raise ValueError(
        f"unknown model {name_or_path!r}; known: {', '.join(MODELS)} "
        f"(their Hugging Face ids; the same shapes as one: {', '.join(r.rsplit('/', 1)[-1] for r in HF_SAME_SHAPES)}; "
        "or a path to a Hugging Face config.json)"
    )


def get_model(name_or_path: str) -> ModelSpec:
    name = resolve_model_name(name_or_path)
    return MODELS[name] if name in MODELS else load_hf_config(name)
