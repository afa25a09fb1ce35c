"""Sliding-window layers' share of an iteration: what attention reads when a layer sees only the
last ``window`` tokens (gpt-oss: 128 on every other layer; Gemma 2/3; Mistral-7B-v0.1: 4,096).

A query at position ``p`` attends to ``min(p + 1, window)`` keys: the ones from ``p - window + 1``
on, as the engines' kernels mask them and vLLM's SlidingWindowManager keeps only their blocks
(vllm/v1/core/single_type_kv_cache_manager.py). These aggregates replace ``BatchShape``'s
prefill pairs and KV reads for the sliding layers; full-attention layers keep the whole context.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


def _capped_sum(first: int, last: int, cap: int) -> int:
    """sum of min(x, cap) for x = first .. last (first >= 1)."""
    if last < first:
        return 0
    if last <= cap:
        return (first + last) * (last - first + 1) // 2
    if first >= cap:
        return (last - first + 1) * cap
    return (first + cap - 1) * (cap - first) // 2 + (last - cap + 1) * cap


@dataclass(frozen=True, slots=True)
class WindowShape:
    """The window-bounded aggregates of one iteration (compare ``BatchShape``)."""

    prefill_pairs: int = 0  # (query, key) pairs of prefill chunks within the window
    prefill_kv_tokens: int = 0  # KV tokens a sliding layer reads for the prefill chunks
    decode_kv_tokens: int = 0  # ... for the decodes (context + 1 each, at most the window)

    @staticmethod
    def of(prefill: Iterable[tuple[int, int]], decode_contexts: Iterable[int], window: int) -> WindowShape:
        """From (chunk tokens, context before it) per prefill and context per decode."""
        pairs = kv = 0
        for q, c in prefill:
            pairs += _capped_sum(c + 1, c + q, window)
            kv += min(c + q, q + window - 1)
        return WindowShape(pairs, kv, sum(min(c + 1, window) for c in decode_contexts))
