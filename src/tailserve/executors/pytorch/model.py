"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2) over flattened, paged batches.

Numerics follow Hugging Face's ``LlamaForCausalLM`` (RMSNorm in float32 then cast, RoPE tables in
float32 then cast, SiLU-gated MLP, residual adds in the model dtype), so greedy decoding gives the
same tokens as ``transformers`` on the same weights. Projections that share an input are fused
at load time (q/k/v into one matrix, gate/up into one) — fewer, larger matmuls on CPU. The model
knows no device: its linear layers, norms, RoPE and attention come from a ``Backend``
(``backend.py``). On CPU a bf16/fp16 model runs RMSNorm (with the residual add before it) and
SiLU-mul as fused kernels that give the PyTorch ops' bits (``cpu_norm.py``), RoPE fused with the
q/k/v split, and prepacked weights where the CPU's level has a bf16 GEMM (``cpu_backend.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tailserve.executors.pytorch.attention import AttentionMetadata, PagedKVCache, paged_attention
from tailserve.executors.pytorch.backend import TorchBackend, backend_for
from tailserve.executors.pytorch.rope import RotaryEmbedding

Weight = torch.Tensor  # or a backend's prepacked form, a callable (x, bias): call through ``linear``


@dataclass(slots=True)
class LayerWeights:
    qkv: Weight  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    o: Weight
    o_bias: torch.Tensor | None
    gate_up: Weight  # [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    down: Weight
    down_bias: torch.Tensor | None
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    return weight(x, bias)  # prepacked by the backend (cpu_backend.PackedLinear)


class LlamaModel:
    def __init__(
        self,
        config,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        backend: TorchBackend | None = None,
    ) -> None:
        """``config``: a ``loader.ModelConfig``; ``state``: HF-named tensors already in ``dtype``;
        ``backend``: the device's operations (default: ``backend_for(device)``)."""
        if getattr(config, "sliding_window", None) and config.sliding_window < config.max_position_embeddings:
            raise ValueError(
                f"sliding-window attention (sliding_window={config.sliding_window} < "
                f"max_position_embeddings={config.max_position_embeddings}) is not supported"
            )
        self.config = config
        self.dtype = dtype
        self.device = device
        self.backend = backend_for(device) if backend is None else backend
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.embed = state["model.embed_tokens.weight"]
        self.norm = state["model.norm.weight"]
        self.lm_head: torch.Tensor | None = (
            self.embed if config.tie_word_embeddings else state["lm_head.weight"]
        )
        self.layers: list[LayerWeights] = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = gate_up_bias = None
            if config.attention_bias:
                bias = torch.cat([state[a + f"{n}_proj.bias"] for n in "qkv"])
            if getattr(config, "mlp_bias", False):
                gate_up_bias = torch.cat([state[p + "mlp.gate_proj.bias"], state[p + "mlp.up_proj.bias"]])
            self.layers.append(
                LayerWeights(
                    qkv=torch.cat([state[a + f"{n}_proj.weight"] for n in "qkv"]).contiguous(),
                    qkv_bias=bias,
                    o=state[a + "o_proj.weight"],
                    o_bias=state.get(a + "o_proj.bias"),
                    gate_up=torch.cat(
                        [state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]
                    ).contiguous(),
                    gate_up_bias=gate_up_bias,
                    down=state[p + "mlp.down_proj.weight"],
                    down_bias=state.get(p + "mlp.down_proj.bias"),
                    input_norm=state[p + "input_layernorm.weight"],
                    post_attention_norm=state[p + "post_attention_layernorm.weight"],
                )
            )
        self.rope = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            dtype,
            device,
        )
        # bf16/fp16 on CPU: one fused pass for RoPE + split (None: PyTorch's ops), and the
        # norms and SiLU-mul fused wherever their kernels reproduce PyTorch's bits here.
        be = self.backend
        self.fused = be.rope_split(dtype)
        self.norm_ops = be.norm_ops(self.eps, dtype, config.hidden_size, config.intermediate_size)
        self._num_parameters = self._count_parameters()
        self.lm_head_weight: Weight = self.lm_head  # what compute_logits multiplies by
        for w in self.layers:
            w.qkv, w.o = be.prepare_linear(w.qkv, dtype), be.prepare_linear(w.o, dtype)
            w.gate_up, w.down = be.prepare_linear(w.gate_up, dtype), be.prepare_linear(w.down, dtype)
        # A row's output is independent of the batch (prepacked weights): see ``_rows_needed``.
        self.packed = bool(self.layers) and be.rows_independent(self.layers[-1].down)
        if self.lm_head is not self.embed:  # a tied head stays one matrix with the embedding
            self.lm_head_weight = be.prepare_linear(self.lm_head, dtype)
            if self.lm_head_weight is not self.lm_head:
                self.lm_head = None  # the packed copy replaces it (memory)

    def _count_parameters(self) -> int:
        n = self.embed.numel() + self.norm.numel()
        if self.lm_head is not self.embed:
            n += self.lm_head.numel()
        for w in self.layers:
            n += sum(t.numel() for t in (w.qkv, w.o, w.gate_up, w.down, w.input_norm, w.post_attention_norm))
            for b in (w.qkv_bias, w.o_bias, w.gate_up_bias, w.down_bias):
                n += 0 if b is None else b.numel()
        return n

    @property
    def num_parameters(self) -> int:
        return self._num_parameters

    @property
    def kv_bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * len(self.layers) * self.num_kv_heads * self.head_dim * itemsize

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: PagedKVCache,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [tokens, hidden], or only the rows ``out_rows``
        lists (in its order): the rows whose logits are wanted."""
        if self.fused is not None:
            return self._forward_fused(input_ids, positions, meta, kv, out_rows)
        h, kvh, d, norm = self.num_heads, self.num_kv_heads, self.head_dim, self.norm_ops
        x = F.embedding(input_ids, self.embed)
        cos = self.rope.cos[positions].unsqueeze(1)
        sin = self.rope.sin[positions].unsqueeze(1)
        n = x.shape[0]
        y = norm.rms_norm(x, self.layers[0].input_norm)
        for i, w in enumerate(self.layers):
            qkv = linear(y, w.qkv, w.qkv_bias)
            q = qkv[:, : h * d].view(n, h, d)
            k = qkv[:, h * d : (h + kvh) * d].view(n, kvh, d)
            v = qkv[:, (h + kvh) * d :].view(n, kvh, d)
            q = self.rope.apply(q, cos, sin)
            k = self.rope.apply(k, cos, sin)
            k_slots, v_slots = kv.slots(i)
            attn = paged_attention(q, k, v.contiguous(), k_slots, v_slots, meta, self.backend)
            x, attn = self._rows_needed(i, x, attn.view(n, h * d), out_rows)
            x, y = self._layer_rest(x, attn, w, self._next_norm(i))
        return self._output_rows(y, out_rows)

    def _forward_fused(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: PagedKVCache,
        out_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """``forward`` with RoPE applied while q, k and v are split out of the fused projection
        (one pass instead of slices, a concatenation and four products per tensor), bit for bit
        the PyTorch path's result, as the fused norms and SiLU-mul of ``norm_ops`` are."""
        ops, h, kvh, d = self.fused, self.num_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(input_ids, self.embed)
        n = x.shape[0]
        y = self.norm_ops.rms_norm(x, self.layers[0].input_norm)
        for i, w in enumerate(self.layers):
            qkv = linear(y, w.qkv, w.qkv_bias)
            q, k, v = ops.rope_split(qkv, self.rope.cos, self.rope.sin, positions, h, kvh, d)
            k_slots, v_slots = kv.slots(i)
            attn = paged_attention(q, k, v, k_slots, v_slots, meta, self.backend)
            x, attn = self._rows_needed(i, x, attn.view(n, h * d), out_rows)
            x, y = self._layer_rest(x, attn, w, self._next_norm(i))
        return self._output_rows(y, out_rows)

    def _rows_needed(
        self, i: int, x: torch.Tensor, attn: torch.Tensor, out_rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream and attention output the rest of layer i needs. After the last
        layer's attention (its K/V are stored) only the output rows matter, so with prepacked
        weights its output projection and MLP run on those rows alone — a prefill step samples
        one row per prompt, so this skips most of a layer (~1/num_layers of the prefill's
        matmuls). oneDNN computes a row of a prepacked bf16 matmul the same whatever the other
        rows (checked bit for bit at 7-2,048 rows; tests/test_model_out_rows.py), and the norms
        are per row, so the outputs do not change. float32 weights (MKL, the transformers
        reference) give a row different bits at a different row count, so they keep every row."""
        if out_rows is None or i + 1 < len(self.layers) or not self.packed:
            return x, attn
        return x[out_rows], attn[out_rows]

    def _output_rows(self, y: torch.Tensor, out_rows: torch.Tensor | None) -> torch.Tensor:
        if out_rows is None or self.packed:  # packed: ``_rows_needed`` already selected them
            return y
        return y[out_rows]

    def _next_norm(self, i: int) -> torch.Tensor:
        """The weight of the norm after layer i: the next layer's input norm, or the final one."""
        return self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm

    def _layer_rest(
        self, residual: torch.Tensor, attn: torch.Tensor, w: LayerWeights, next_norm: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer after attention, shared by both forward paths: output projection and residual,
        the SwiGLU MLP and its residual, each residual add fused with the norm after it (vLLM's
        ``fused_add_rms_norm`` shape; the same PyTorch ops in the same order where unfused).
        Returns the residual stream and its norm under ``next_norm``."""
        norm = self.norm_ops
        x, y = norm.add_rms_norm(residual, linear(attn, w.o, w.o_bias), w.post_attention_norm)
        down = linear(norm.silu_and_mul(linear(y, w.gate_up, w.gate_up_bias)), w.down, w.down_bias)
        return norm.add_rms_norm(x, down, next_norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the rows that sample, [rows, vocab]."""
        return linear(hidden, self.lm_head_weight, None).float()
