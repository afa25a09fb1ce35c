"""``ModelSpec``: the shapes of one model that decide FLOPs, weight bytes and KV bytes, per
tensor-parallel shard (dense, MoE, MLA, sliding-window layers, number formats). The catalog of
built-in models is ``models.py``; ``hf_config.py`` reads one from a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tailserve.executors.simulated.module_formats import (
    check_module_dtypes,
    dense_bytes_per_shard,
    group_dtype,
)
from tailserve.executors.simulated.precision import get_precision


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    head_dim: int | None = None  # None: hidden_size // num_heads
    gated_mlp: bool = True  # SwiGLU (3 matrices) vs a plain 2-matrix MLP (Falcon)
    tie_word_embeddings: bool = False
    dtype_bytes: int = 2  # activations (and weights, KV when their formats below are unset): bf16 / fp16
    # Mixture of experts (num_experts 0: dense). An MoE layer replaces the dense MLP by
    # ``num_experts`` gated experts of ``moe_intermediate_size``, each token routed to
    # ``experts_per_token`` of them, plus always-on shared experts of ``shared_intermediate_size``
    # in all (DeepSeek, Qwen2-MoE, Llama 4). Layers below ``first_dense_layers`` (DeepSeek's
    # first_k_dense_replace) and off ``moe_layer_step`` (Llama 4's interleave step: layer i is MoE
    # when (i + 1) % step == 0) keep the dense MLP of ``intermediate_size``.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    first_dense_layers: int = 0
    moe_layer_step: int = 1
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi K2; kv_lora_rank 0: plain MHA/GQA). The KV
    # cache holds one latent of kv_lora_rank + qk_rope_head_dim per token and layer, shared by
    # every head and every tensor-parallel rank.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Sliding-window layers (gpt-oss, Gemma 2/3): ``num_sliding_layers`` of the layers attend to
    # the last ``sliding_window`` tokens only.
    sliding_window: int = 0
    num_sliding_layers: int = 0
    # Number formats (``precision.py``): of the dense weights, of the routed experts (gpt-oss:
    # MXFP4 experts, bf16 attention), of the KV cache; "" follows ``dtype_bytes``. Embeddings and
    # the LM head stay in the activation format, as FP8/FP4 checkpoints keep them.
    weight_dtype: str = ""
    expert_dtype: str = ""
    kv_dtype: str = ""
    # Groups of linear layers a quantized checkpoint keeps in another format ((group, format)
    # pairs, module_formats.py): NVIDIA's R1 NVFP4 keeps MLA's projections and the router in bf16.
    # Every group not named takes weight_dtype (expert_dtype for the routed experts).
    module_dtypes: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"model {self.name}: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model {self.name}: num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        for name in ("weight_dtype", "expert_dtype", "kv_dtype"):
            if getattr(self, name):
                try:
                    get_precision(getattr(self, name))
                except ValueError as error:
                    raise ValueError(f"model {self.name}: {name}: {error}") from None
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise ValueError(
                    f"model {self.name}: experts_per_token must be in 1..num_experts "
                    f"({self.num_experts}), got {self.experts_per_token}"
                )
            if self.moe_intermediate_size < 1 or self.moe_layer_step < 1:
                raise ValueError(
                    f"model {self.name}: an MoE model needs moe_intermediate_size and moe_layer_step >= 1"
                )
            if not 0 <= self.first_dense_layers < self.num_layers:
                raise ValueError(f"model {self.name}: first_dense_layers must be below num_layers")
        elif self.experts_per_token or self.moe_intermediate_size or self.shared_intermediate_size:
            raise ValueError(f"model {self.name}: expert fields given without num_experts")
        if self.kv_lora_rank and min(self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim) < 1:
            raise ValueError(
                f"model {self.name}: MLA (kv_lora_rank) needs qk_rope_head_dim, qk_nope_head_dim and v_head_dim"
            )
        if not 0 <= self.num_sliding_layers <= self.num_layers or (
            self.num_sliding_layers and self.sliding_window < 1
        ):
            raise ValueError(
                f"model {self.name}: num_sliding_layers must be in 0..num_layers, with a sliding_window >= 1"
            )
        if self.num_sliding_layers and self.is_mla:
            # vLLM's SlidingWindowSpec asserts it (kv_cache_interface.py): no engine runs both.
            raise ValueError(f"model {self.name}: sliding-window layers with MLA are not supported")
        if self.module_dtypes:  # after the shapes: it counts each group's parameters
            check_module_dtypes(self)

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attention_params_per_layer(self) -> int:
        """The attention projections of one layer: q, k, v, o (MLA: q's low-rank pair or its one
        matrix, the joint KV down-projection with the RoPE key, the KV up-projection, o)."""
        h = self.hidden_size
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = h * self.num_heads * qk
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank * self.num_heads * qk
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            kv_b = self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv_a + kv_b + self.num_heads * self.v_head_dim * h
        return h * self.dim_per_head * (2 * self.num_heads + 2 * self.num_kv_heads)

    @property
    def mla_replicated_params_per_layer(self) -> int:
        """MLA's down-projections (q_a, and kv_a with the RoPE key), which vLLM and SGLang keep
        whole on every TP rank (``ReplicatedLinear`` in their deepseek_v2.py); 0 for other models."""
        if not self.is_mla:
            return 0
        return self.hidden_size * (self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim)

    def attention_params_per_shard(self, tp: int) -> float:
        """One layer's attention projections on one TP rank (MLA's down-projections whole)."""
        replicated = self.mla_replicated_params_per_layer
        return (self.attention_params_per_layer - replicated) / tp + replicated

    def dense_matmul_params_per_shard(self, tp: int) -> float:
        """``num_dense_matmul_params`` on one TP rank: sliced by ``tp`` but for MLA's replicated
        down-projections. A dense model's (no MLA) is exactly ``num_dense_matmul_params / tp``."""
        replicated = self.num_layers * self.mla_replicated_params_per_layer
        return (self.num_dense_matmul_params - replicated) / tp + replicated

    @property
    def num_full_layers(self) -> int:
        """Layers attending to the whole context (the others to the last ``sliding_window``)."""
        return self.num_layers - self.num_sliding_layers

    @property
    def dense_mlp_params(self) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size

    @property
    def params_per_layer(self) -> int:
        """A dense layer's matrices (an MoE model's non-expert layers)."""
        d = self.dim_per_head
        if self.is_mla:
            return self.attention_params_per_layer + self.dense_mlp_params
        attn = self.hidden_size * d * (2 * self.num_heads + 2 * self.num_kv_heads)  # q, o, k, v
        mlp = (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size
        return attn + mlp

    @property
    def num_moe_layers(self) -> int:
        if not self.is_moe:
            return 0
        return sum(
            1 for i in range(self.first_dense_layers, self.num_layers) if (i + 1) % self.moe_layer_step == 0
        )

    @property
    def expert_params(self) -> int:
        """One routed expert's matrices (gate, up, down)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def num_dense_matmul_params(self) -> int:
        """Matrices every token multiplies through, routed experts excepted: attention, dense
        MLPs, shared experts and routers (all layers, no embeddings)."""
        if not self.is_moe:
            return self.num_layers * self.params_per_layer
        moe = self.num_moe_layers
        per_moe_layer = (
            3 * self.hidden_size * self.shared_intermediate_size + self.hidden_size * self.num_experts
        )
        return (
            self.num_layers * self.attention_params_per_layer
            + (self.num_layers - moe) * self.dense_mlp_params
            + moe * per_moe_layer
        )

    @property
    def num_expert_params(self) -> int:
        """All routed experts' matrices (all MoE layers)."""
        return self.num_moe_layers * self.num_experts * self.expert_params

    @property
    def num_matmul_params(self) -> int:
        """Parameters every token multiplies through (all layers, no embeddings); an MoE model's
        active ones (its experts_per_token experts of each MoE layer)."""
        if not self.is_moe:
            return self.num_layers * self.params_per_layer
        return (
            self.num_dense_matmul_params + self.num_moe_layers * self.experts_per_token * self.expert_params
        )

    @property
    def num_params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        total = (
            self.num_dense_matmul_params + self.num_expert_params if self.is_moe else self.num_matmul_params
        )
        return total + embed * (1 if self.tie_word_embeddings else 2)

    @property
    def num_active_params(self) -> int:
        """Parameters one token uses: ``num_matmul_params`` (an MoE model's routed experts: its
        experts_per_token of them) plus the embedding and LM head, counted as ``num_params``
        counts them (most model cards' convention; OpenAI's gpt-oss figures leave out the input
        embedding). A dense model's equals ``num_params``."""
        embed = self.vocab_size * self.hidden_size
        return self.num_matmul_params + embed * (1 if self.tie_word_embeddings else 2)

    @property
    def weight_bytes_per_param(self) -> float:
        """Bytes of one dense-layer weight (scales included)."""
        return get_precision(self.weight_dtype).bytes if self.weight_dtype else float(self.dtype_bytes)

    @property
    def expert_bytes_per_param(self) -> float:
        if self.module_dtypes:
            return get_precision(group_dtype(self, "experts")).bytes
        if self.expert_dtype:
            return get_precision(self.expert_dtype).bytes
        return self.weight_bytes_per_param

    @property
    def kv_bytes_per_element(self) -> float:
        return get_precision(self.kv_dtype).bytes if self.kv_dtype else float(self.dtype_bytes)

    def kv_heads_per_shard(self, tp: int) -> int:
        # With more shards than KV heads, vLLM replicates each KV head on several GPUs.
        return max(1, self.num_kv_heads // tp) if self.num_kv_heads >= tp else 1

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """KV-cache bytes one token occupies on one tensor-parallel shard (K and V, all layers;
        MLA: the latent, the same on every shard)."""
        kv_bytes = self.kv_bytes_per_element if self.kv_dtype else self.dtype_bytes
        if self.is_mla:
            return int(self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * kv_bytes)
        return int(2 * self.num_layers * self.kv_heads_per_shard(tp) * self.dim_per_head * kv_bytes)

    def weight_bytes_per_shard(self, tp: int = 1, dp: int = 1) -> float:
        """Weight bytes on one GPU at TP ``tp``; with data-parallel attention (``dp`` > 1, an
        MoE model) each DP rank holds the dense weights at TP ``tp`` and the routed experts are
        spread over all ``dp x tp`` GPUs."""
        if not (self.is_moe or self.weight_dtype or self.expert_dtype or self.module_dtypes):
            return self.num_params * self.dtype_bytes / tp
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        experts = self.num_expert_params * self.expert_bytes_per_param
        if self.module_dtypes:  # each group at its own format (module_formats.py)
            return dense_bytes_per_shard(self, tp) + embed * self.dtype_bytes / tp + experts / (tp * dp)
        if self.is_mla:  # the down-projections whole on every rank
            return (
                self.dense_matmul_params_per_shard(tp) * self.weight_bytes_per_param
                + embed * self.dtype_bytes / tp
                + experts / (tp * dp)
            )
        if dp > 1:
            return (
                self.num_dense_matmul_params * self.weight_bytes_per_param + embed * self.dtype_bytes
            ) / tp + (experts / (tp * dp))
        return (
            self.num_dense_matmul_params * self.weight_bytes_per_param
            + self.num_expert_params * self.expert_bytes_per_param
            + embed * self.dtype_bytes
        ) / tp

    def pipeline_stage(self, pp: int) -> ModelSpec:
        """The pipeline stage that holds the most layers (vLLM's ``get_pp_indices`` split), for
        its weights and KV: the KV cache of a pipeline-parallel engine is sized per stage, and the
        fullest one bounds it. Its layers are counted as MoE where the model has MoE layers (the
        dense ones of DeepSeek's first_k_dense_replace sit on the first stage only), and it keeps
        both embedding matrices (the first stage's input, the last one's LM head): an upper
        bound on any stage's weights."""
        if pp == 1:
            return self
        n = -(-self.num_layers // pp)  # the partition's largest stage
        sliding = round(self.num_sliding_layers * n / self.num_layers)
        return replace(self, num_layers=n, first_dense_layers=0, num_sliding_layers=sliding)

    def check_tp(self, tp: int) -> None:
        if tp < 1:
            raise ValueError(f"tensor parallel size must be >= 1, got {tp}")
        if self.num_heads % tp:
            raise ValueError(f"{self.name} has {self.num_heads} attention heads, not divisible by --tp {tp}")
