"""This machine's roofline, measured, and a Llama checkpoint's bytes and FLOPs per step.

The decode limit is the time to read every weight a decode step touches (plus, separately, the KV
it attends over) at the copy bandwidth measured here; the prefill limit is its matmul FLOPs at the
bf16 GEMM rate measured here. Both rates are best-of-N on large operands, so they are what this
CPU can reach through PyTorch, not datasheet peaks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tailserve.executors.pytorch.loader import ModelConfig, expected_tensor_shapes


def measure_copy_bandwidth(size_mib: int = 512, reps: int = 5) -> float:
    """Bytes/s of ``dst.copy_(src)`` on a buffer far larger than the caches (read + write)."""
    src = torch.ones(size_mib * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page first
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() / best


GEMM_N, GEMM_REPS = 2048, 3  # the GEMM rate: the best of 3 timed 2,048^3 matmuls after one untimed
SLOW_MATMUL_S = 5.0  # a first matmul slower than this is announced with the time the rest takes


def gemm_notice(level: str | None = None, dtype: torch.dtype = torch.bfloat16) -> str:
    """What the GEMM measurement does and how long it may take (it prints nothing meanwhile):
    seconds in float32, and in bf16 where the CPU has a native bf16 matmul (``cpu_isa`` level
    avx512_bf16 or amx_bf16), else minutes."""
    from tailserve.executors.pytorch import cpu_isa
    from tailserve.executors.pytorch.cpu_backend import can_pack

    level = level or cpu_isa.detect().level
    name = str(dtype).removeprefix("torch.")
    speed = (
        "seconds in all"
        if cpu_isa.LEVELS.index(level) >= cpu_isa.LEVELS.index("avx512_bf16")
        or dtype == torch.float32
        or can_pack(dtype, torch.device("cpu"))
        else f"no native bf16 matmul on this CPU, {level}: a minute or more each"
    )
    return f"  {name} GEMM rate: {GEMM_REPS + 1} matmuls of {GEMM_N}^3 ({speed})"


def measure_gemm_flops(
    n: int = GEMM_N,
    dtype: torch.dtype = torch.bfloat16,
    reps: int = GEMM_REPS,
    say: Callable[[str], None] | None = None,
) -> float:
    """FLOP/s of an ``n`` x ``n`` x ``n`` matmul in ``dtype``. Without a native bf16 matmul (no
    AVX512-BF16 or AMX) one 2,048^3 bf16 matmul can take a minute or more, so when the untimed
    first call is slow, ``say`` is told how long the ``reps`` timed ones will take. Where the
    engine's linear layers run their own kernel for ``dtype`` (bf16 at avx2 and above: tailserve's
    AVX2 or dpbf16 kernel, oneDNN), that kernel is timed: it is the engine's peak."""
    from tailserve.fidelity.torch_calibrate import engine_linear

    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    matmul = engine_linear(b) or (lambda x: torch.matmul(x, b))
    t = time.perf_counter()
    matmul(a)  # first call picks the kernel
    first = time.perf_counter() - t
    if say is not None and first > SLOW_MATMUL_S:
        say(f"  the first {n}^3 matmul took {first:.0f} s; {reps} more to time, about {reps * first:.0f} s")
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        matmul(a)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


_QKV = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias")


@dataclass(frozen=True, slots=True)
class ModelCounts:
    num_params: int  # everything in the checkpoint
    num_linear_params: int  # projections of every layer (weights and biases): run for every token
    num_lm_head_params: int  # run only for rows that sample
    num_embed_params: int  # a lookup: one row read per token
    num_norm_params: int
    itemsize: int  # bytes per weight
    kv_bytes_per_token: int  # K and V of every layer
    # The weights a token's matmuls run, of every layer: a MoE layer's experts at the share
    # num_experts_per_tok / num_experts (the router in full); dense models: num_linear_params.
    num_linear_params_per_token: float
    # Of those, the last layer's after attention (o_proj, the MLP): tailserve's packed CPU
    # weights run them on the sampled rows alone (``LlamaModel._rows_needed``).
    num_last_layer_rest_params_per_token: float

    @staticmethod
    def from_config(config: ModelConfig, itemsize: int) -> ModelCounts:
        groups = {"linear": 0, "lm_head": 0, "embed": 0, "norm": 0}
        per_token = {"linear": 0.0, "last_rest": 0.0}
        share = config.num_experts_per_tok / config.num_experts if config.num_experts else 1.0
        last = f"model.layers.{config.num_hidden_layers - 1}."
        for name, shape in expected_tensor_shapes(config).items():
            n = 1
            for d in shape:
                n *= d
            run = n * share if ".experts." in name else n
            if name.startswith(last) and "norm" not in name and not name.endswith(_QKV):
                per_token["last_rest"] += run
            if name == "lm_head.weight":
                groups["lm_head"] += n
            elif name == "model.embed_tokens.weight":
                groups["embed"] += n
            elif "norm" in name:
                groups["norm"] += n
            else:
                groups["linear"] += n
                per_token["linear"] += run
        if config.tie_word_embeddings:
            groups["lm_head"] = groups["embed"]  # the same matrix, multiplied as the head
        kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * itemsize
        return ModelCounts(
            config.num_params,
            groups["linear"],
            groups["lm_head"],
            groups["embed"],
            groups["norm"],
            itemsize,
            kv,
            per_token["linear"],
            per_token["last_rest"],
        )

    def decode_weight_bytes(self) -> int:
        """Weights one decode step reads whatever the batch (embedding rows are negligible)."""
        return (self.num_linear_params + self.num_lm_head_params + self.num_norm_params) * self.itemsize

    def prefill_flops(
        self, num_tokens: int, num_sampled_rows: int, last_layer_rows_only: bool = False
    ) -> float:
        """Matmul FLOPs of a forward pass over ``num_tokens`` (2 x params x tokens, the head only
        for the rows that sample, a MoE layer's experts at the share a token is routed to;
        attention's own FLOPs left out, as in the usual estimate).
        ``last_layer_rows_only``: the last layer after attention runs on the sampled rows alone
        (tailserve's packed CPU weights; at W's 8 x 256-token prefill of the tiny model 40.9
        GFLOP instead of 51.6)."""
        rows_skipped = num_tokens - num_sampled_rows if last_layer_rows_only else 0
        return 2.0 * (
            self.num_linear_params_per_token * num_tokens
            - self.num_last_layer_rest_params_per_token * rows_skipped
            + self.num_lm_head_params * num_sampled_rows
        )


def roofline(
    counts: ModelCounts,
    bandwidth: float,
    gemm_flops: float,
    decode: dict[str, Any] | None,
    prefills: dict[str, dict[str, Any]],
    last_layer_rows_only: bool = False,
) -> dict[str, Any]:
    """Fractions of the limits that measured steps reached.

    ``decode``: ``{"batch_size", "mean_context_len", "step_s", ...}`` for decode-only steps;
    each of ``prefills``: ``{"num_tokens", "num_sampled_rows", "time_s", ...}``;
    ``last_layer_rows_only``: the engine runs the last layer after attention on the sampled rows
    alone (``ModelCounts.prefill_flops``).
    """
    out: dict[str, Any] = {
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "gemm_gflop_s": gemm_flops / 1e9,
        "counts": asdict(counts),
        "last_layer_rows_only": last_layer_rows_only,
    }
    if decode is not None:
        weight_bytes = counts.decode_weight_bytes()
        kv_bytes = decode["batch_size"] * decode["mean_context_len"] * counts.kv_bytes_per_token
        weights_limit = weight_bytes / bandwidth
        with_kv_limit = (weight_bytes + kv_bytes) / bandwidth
        out["decode"] = {
            **decode,
            "weight_bytes": weight_bytes,
            "kv_bytes": kv_bytes,
            "weights_limit_s": weights_limit,
            "weights_and_kv_limit_s": with_kv_limit,
            "fraction_of_weights_limit": weights_limit / decode["step_s"],
            "fraction_of_weights_and_kv_limit": with_kv_limit / decode["step_s"],
        }
    for name, prefill in prefills.items():
        flops = counts.prefill_flops(prefill["num_tokens"], prefill["num_sampled_rows"], last_layer_rows_only)
        limit = flops / gemm_flops
        out[name] = {
            **prefill,
            "flops": flops,
            "flop_limit_s": limit,
            "fraction_of_flop_limit": limit / prefill["time_s"],
        }
    return out
