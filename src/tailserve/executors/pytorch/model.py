"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2; Mixtral and Qwen3-MoE's sparse MLPs) over
flattened, paged batches.

Numerics follow Hugging Face's ``LlamaForCausalLM`` (RMSNorm in float32 then cast, RoPE tables in
float32 then cast, SiLU-gated MLP, residual adds in the model dtype), so greedy decoding gives the
same tokens as ``transformers`` on the same weights. Projections that share an input are fused
at load time (q/k/v into one matrix, gate/up into one) — fewer, larger matmuls on CPU. The model
knows no device: its linear layers, norms, RoPE and attention come from a ``Backend``
(``backend.py``). On CPU a bf16/fp16 model runs RMSNorm (with the residual add before it) and
SiLU-mul as fused kernels that give the PyTorch ops' bits (``cpu_norm.py``), RoPE fused with the
q/k/v split, and prepacked weights where the CPU's level has a bf16 GEMM (``cpu_backend.py``).

A mixture-of-experts layer (``MoeWeights``) routes each token as transformers' router does
(softmax in float32 over all experts, top-k, renormalised for Mixtral and for Qwen3-MoE with
``norm_topk_prob``) and runs each expert once on the tokens routed to it (gathered with
``index_select``, the weighted outputs summed back with ``index_add_``): no fused MoE kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tailserve.executors.pytorch.attention import AttentionMetadata, PagedKVCache, paged_attention
from tailserve.executors.pytorch.backend import TorchBackend, backend_for, rms_norm, silu_and_mul
from tailserve.executors.pytorch.rope import RotaryEmbedding

Weight = torch.Tensor  # or a backend's prepacked form, a callable (x, bias): call through ``linear``


@dataclass(slots=True)
class MoeWeights:
    """A sparse MoE block: the router and each expert's SwiGLU MLP (no biases in either family)."""

    router: Weight  # [experts, hidden]
    gate_up: list[Weight]  # per expert, [2 * moe_intermediate, hidden]
    down: list[Weight]  # per expert, [hidden, moe_intermediate]
    top_k: int
    renormalise: bool  # divide the top-k weights by their sum
    weights_in_model_dtype: bool  # Qwen3-MoE casts them to the model dtype; Mixtral keeps float32


@dataclass(slots=True)
class LayerWeights:
    qkv: Weight  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    o: Weight
    o_bias: torch.Tensor | None
    gate_up: Weight | None  # [2 * intermediate, hidden]; None in a MoE layer
    gate_up_bias: torch.Tensor | None
    down: Weight | None
    down_bias: torch.Tensor | None
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    moe: MoeWeights | None = None
    q_norm: torch.Tensor | None = None  # Qwen3: per-head RMSNorm of q and k before RoPE
    k_norm: torch.Tensor | None = None


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
            moe = self._moe_weights(config, state, i) if i in getattr(config, "moe_layers", ()) else None
            qk_norm = getattr(config, "qk_norm", False)
            self.layers.append(
                LayerWeights(
                    qkv=torch.cat([state[a + f"{n}_proj.weight"] for n in "qkv"]).contiguous(),
                    qkv_bias=bias,
                    o=state[a + "o_proj.weight"],
                    o_bias=state.get(a + "o_proj.bias"),
                    gate_up=None
                    if moe
                    else torch.cat(
                        [state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]
                    ).contiguous(),
                    gate_up_bias=gate_up_bias,
                    down=None if moe else state[p + "mlp.down_proj.weight"],
                    down_bias=state.get(p + "mlp.down_proj.bias"),
                    input_norm=state[p + "input_layernorm.weight"],
                    post_attention_norm=state[p + "post_attention_layernorm.weight"],
                    moe=moe,
                    q_norm=state[a + "q_norm.weight"] if qk_norm else None,
                    k_norm=state[a + "k_norm.weight"] if qk_norm else None,
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
        if any(w.q_norm is not None for w in self.layers):
            self.fused = None  # the fused RoPE split has no q/k norm: PyTorch's ops
        self.norm_ops = be.norm_ops(self.eps, dtype, config.hidden_size, config.intermediate_size)
        self._num_parameters = self._count_parameters()
        self.lm_head_weight: Weight = self.lm_head  # what compute_logits multiplies by
        for w in self.layers:
            w.qkv, w.o = be.prepare_linear(w.qkv, dtype), be.prepare_linear(w.o, dtype)
            if w.moe is None:
                w.gate_up, w.down = be.prepare_linear(w.gate_up, dtype), be.prepare_linear(w.down, dtype)
            else:
                m = w.moe
                m.router = be.prepare_linear(m.router, dtype)
                m.gate_up = [be.prepare_linear(t, dtype) for t in m.gate_up]
                m.down = [be.prepare_linear(t, dtype) for t in m.down]
        # A row's output is independent of the batch (prepacked weights): see ``_rows_needed``.
        # (Routing is per row too, so a MoE layer's rows are as independent as its matmuls.)
        self.packed = bool(self.layers) and be.rows_independent(self.layers[-1].o)
        if self.lm_head is not self.embed:  # a tied head stays one matrix with the embedding
            self.lm_head_weight = be.prepare_linear(self.lm_head, dtype)
            if self.lm_head_weight is not self.lm_head:
                self.lm_head = None  # the packed copy replaces it (memory)

    @staticmethod
    def _moe_weights(config, state: dict[str, torch.Tensor], i: int) -> MoeWeights:
        router, (gate, up, down) = config.moe_names(i)
        experts = range(config.num_experts)
        return MoeWeights(
            router=state[router],
            gate_up=[torch.cat([state[gate.format(e)], state[up.format(e)]]).contiguous() for e in experts],
            down=[state[down.format(e)] for e in experts],
            top_k=config.num_experts_per_tok,
            renormalise=config.norm_topk_prob,
            weights_in_model_dtype=config.model_type != "mixtral",
        )

    def _count_parameters(self) -> int:
        n = self.embed.numel() + self.norm.numel()
        if self.lm_head is not self.embed:
            n += self.lm_head.numel()
        for w in self.layers:
            tensors = [w.qkv, w.o, w.input_norm, w.post_attention_norm, w.q_norm, w.k_norm]
            tensors += [w.qkv_bias, w.o_bias, w.gate_up_bias, w.down_bias]
            if w.moe is None:
                tensors += [w.gate_up, w.down]
            else:
                tensors += [w.moe.router, *w.moe.gate_up, *w.moe.down]
            n += sum(0 if t is None else t.numel() for t in tensors)
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
            if w.q_norm is not None:
                q, k = rms_norm(q, w.q_norm, self.eps), rms_norm(k, w.k_norm, self.eps)
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
        if w.moe is not None:
            down = self._moe(y, w.moe)
        else:
            down = linear(norm.silu_and_mul(linear(y, w.gate_up, w.gate_up_bias)), w.down, w.down_bias)
        return norm.add_rms_norm(x, down, next_norm)

    @staticmethod
    def _moe(y: torch.Tensor, m: MoeWeights) -> torch.Tensor:
        """A sparse MoE block on the normed rows ``y``, as transformers computes it: router logits
        in the model dtype, softmax in float32 over every expert, top-k, renormalised when the
        family does, then each routed expert's SwiGLU output times its weight summed per token.
        Each expert runs once on its tokens; a token's contributions are added in expert order,
        transformers' order (its loop over experts ``index_add_``s into zeros)."""
        probs = torch.softmax(linear(y, m.router, None).float(), dim=-1)
        top, experts = torch.topk(probs, m.top_k, dim=-1)  # [tokens, k]
        if m.renormalise:
            top /= top.sum(dim=-1, keepdim=True)
        if m.weights_in_model_dtype:
            top = top.to(y.dtype)
        flat = experts.view(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens ascending
        counts = torch.bincount(flat, minlength=len(m.down)).tolist()
        tokens = order // m.top_k
        weights = top.view(-1).index_select(0, order).unsqueeze(1)
        out = torch.zeros_like(y)
        start = 0
        for e, count in enumerate(counts):
            if not count:
                continue
            rows = tokens[start : start + count]
            h = linear(silu_and_mul(linear(y.index_select(0, rows), m.gate_up[e], None)), m.down[e], None)
            out.index_add_(0, rows, (h * weights[start : start + count]).to(out.dtype))
            start += count
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the rows that sample, [rows, vocab]."""
        return self.logits(hidden).float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits in the model dtype, [rows, vocab]: what the sampler reads (its
        greedy argmax is the float32 copy's, without the copy: ~0.03-0.3 ms at 64 x 8,192)."""
        return linear(hidden, self.lm_head_weight, None)
