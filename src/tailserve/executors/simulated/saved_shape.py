"""A ``BatchShape`` read back from a saved file (calibration points, recorded iterations).

Files written before ``BatchShape`` counted its prefill chunks and decodes hold only the five
aggregates. The counts are inferred where the aggregates fix them:

- no prefill KV: every token is a decode's (``num_decodes = num_tokens``);
- one prefill chunk explains the prefill aggregates exactly (its q tokens after c context
  tokens give ``prefill_kv_tokens = q + c`` and ``prefill_pairs = q * c + q * (q + 1) / 2``,
  so q is an integer root of ``q**2 - (2 * kv + 1) * q + 2 * pairs``): one prefill, and the
  other ``num_tokens - q`` tokens are decodes. Without decodes this is exact: k >= 2 chunks of
  the same total tokens and KV have fewer pairs than one chunk. With decodes it is the only
  reading in which every decode samples and reads at least its own token, which is what
  chunked prefill schedules (at most one partial chunk a step); several chunks beside decodes
  whose aggregates mimic one chunk are not told apart;
- no decode KV, several chunks: every logit is a prefill's (each finishing chunk samples once;
  calibration's prefill points all finish).

Anything else (a mixed point no single chunk explains) is an error naming the point.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tailserve.executors.simulated.cost_model import BatchShape

AGGREGATES = ("num_tokens", "num_logits", "prefill_pairs", "prefill_kv_tokens", "decode_kv_tokens")


def single_chunk_tokens(prefill_pairs: int, prefill_kv_tokens: int) -> int | None:
    """The q of the one chunk with these aggregates, or None when no chunk has them."""
    b = 2 * prefill_kv_tokens + 1
    disc = b * b - 8 * prefill_pairs
    if disc < 0:
        return None
    root = math.isqrt(disc)
    if root * root != disc or (b - root) % 2:
        return None
    q = (b - root) // 2  # the smaller root: q <= kv (the larger one exceeds kv)
    return q if 1 <= q <= prefill_kv_tokens else None


def infer_counts(
    num_tokens: int, num_logits: int, pairs: int, prefill_kv: int, decode_kv: int
) -> tuple[int, int]:
    """(num_prefills, num_decodes) of a shape saved without them; ValueError when ambiguous."""
    if prefill_kv == 0:
        return 0, num_tokens
    q = single_chunk_tokens(pairs, prefill_kv)
    if decode_kv == 0:
        if q == num_tokens:
            return 1, 0
        if num_logits >= 2:
            return num_logits, 0
    elif q is not None and 0 < num_tokens - q <= min(num_logits, decode_kv):
        return 1, num_tokens - q
    raise ValueError(
        f"a batch shape saved without num_prefills / num_decodes ({num_tokens} tokens, {num_logits} logits, "
        f"{pairs} prefill pairs, prefill KV {prefill_kv}, decode KV {decode_kv}) does not fix how many "
        "prefill chunks and decodes it held; record it again with this tailserve"
    )


def shape_from_saved(saved: Mapping[str, Any]) -> BatchShape:
    """The shape a file saved (``asdict(shape)``), its counts inferred when the file predates them."""
    missing = [k for k in AGGREGATES if k not in saved]
    if missing:
        raise ValueError(f"a saved batch shape lacks {', '.join(missing)}: {dict(saved)!r}")
    values = [int(saved[k]) for k in AGGREGATES]
    if "num_prefills" in saved and "num_decodes" in saved:
        return BatchShape(*values, int(saved["num_prefills"]), int(saved["num_decodes"]))
    if "num_prefills" in saved or "num_decodes" in saved:
        raise ValueError(f"a saved batch shape has only one of num_prefills / num_decodes: {dict(saved)!r}")
    return BatchShape(*values, *infer_counts(*values))
