"""Measured GPU operator profiles (Vidur's published format): read, check, compare to the model.

Two kinds of file, as Vidur publishes them (``data/profiling/``):

- ``compute/<gpu>/<org>/<model>/mlp.csv``: per decoder layer, on one TP shard, the median time
  (ms) of each operator over the number of tokens in the batch. The linear layers are
  ``attn_pre_proj`` (QKV), ``attn_post_proj`` (attention output), ``mlp_up_proj`` (gate + up)
  and ``mlp_down_proj``; the model's shape is in the ``n_head, n_kv_head, n_embd,
  n_expanded_embd, vocab_size, use_gated_mlp`` columns of every row.
- ``network/<topology>/all_reduce.csv``: NCCL all-reduce median time (ms) over the message size
  (bytes: Vidur's profiler records ``size * 2`` for its fp16 tensor) and the number of GPUs.

A malformed file is rejected with ``path:line: what is wrong``, never a traceback.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tailserve.executors.simulated.models import ModelSpec

LINEAR_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size")
MLP_COLUMNS = (
    *(f"time_stats.{op}.median" for op in LINEAR_OPS),
    *SHAPE_COLUMNS,
    "use_gated_mlp",
    "num_tokens",
    "num_tensor_parallel_workers",
)
ALL_REDUCE_COLUMNS = ("time_stats.all_reduce.median", "num_workers", "size", "devices_per_node")

# Vidur's folder names for the GPUs in our catalog, and the all-reduce topology of each.
VIDUR_GPUS = {"a100": "A100-80GB", "h100": "H100-SXM", "a40": "A40"}
VIDUR_TOPOLOGIES = {"a100_dgx": "A100-80GB", "h100_dgx": "H100-SXM"}


class ProfileError(ValueError):
    """A profile file that cannot be used; the message starts with ``path:line:``."""


@dataclass(frozen=True, slots=True)
class LinearSample:
    """The four linear layers of one decoder layer at one token count and TP degree."""

    num_tokens: int
    tp: int
    seconds: float  # median over the profile's duplicate rows, summed over the four ops


@dataclass(frozen=True, slots=True)
class LinearProfile:
    path: str
    model: ModelSpec  # one layer's shape from the file (num_layers = 1)
    samples: tuple[LinearSample, ...]


@dataclass(frozen=True, slots=True)
class AllReduceSample:
    num_gpus: int
    num_bytes: int
    seconds: float


def _number(path: Path, line: int, row: dict[str, str], column: str, kind: type = float) -> float:
    raw = row.get(column)
    if raw is None or raw == "":
        raise ProfileError(f"{path}:{line}: column {column!r} is empty")
    try:
        value = float(raw)
    except ValueError:
        raise ProfileError(f"{path}:{line}: column {column!r} is not a number: {raw!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ProfileError(f"{path}:{line}: column {column!r} must be a finite number >= 0, got {raw!r}")
    if kind is int:
        if value != int(value):
            raise ProfileError(f"{path}:{line}: column {column!r} must be a whole number, got {raw!r}")
        return int(value)
    return value


def _rows(path: Path, required: tuple[str, ...]) -> list[tuple[int, dict[str, str]]]:
    if not path.is_file():
        raise ProfileError(f"{path}: no such profile file")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        missing = [c for c in required if c not in header]
        if missing:
            raise ProfileError(f"{path}:1: header lacks column(s) {', '.join(missing)}")
        out = []
        for row in reader:
            line = reader.line_num
            if None in row or any(v is None for v in row.values()):
                raise ProfileError(
                    f"{path}:{line}: {len(header)} columns expected, the row has a different count"
                )
            out.append((line, row))
    if not out:
        raise ProfileError(f"{path}:2: no data rows")
    return out


def load_linear_profile(path: str | Path) -> LinearProfile:
    """An ``mlp.csv``: linear-layer time per (tokens, TP), and the layer's shape."""
    p = Path(path)
    rows = _rows(p, MLP_COLUMNS)
    shape: dict[str, int] | None = None
    times: dict[tuple[int, int], list[float]] = defaultdict(list)
    for line, row in rows:
        this = {c: _number(p, line, row, c, int) for c in SHAPE_COLUMNS}
        if shape is None:
            shape = this
        elif this != shape:
            raise ProfileError(f"{p}:{line}: model shape {this} differs from the first row's {shape}")
        n = _number(p, line, row, "num_tokens", int)
        tp = _number(p, line, row, "num_tensor_parallel_workers", int)
        if n < 1 or tp < 1:
            raise ProfileError(f"{p}:{line}: num_tokens and num_tensor_parallel_workers must be >= 1")
        ms = sum(_number(p, line, row, f"time_stats.{op}.median") for op in LINEAR_OPS)
        if ms <= 0:
            raise ProfileError(f"{p}:{line}: the linear layers' times sum to 0 ms")
        times[(n, tp)].append(ms * 1e-3)
    assert shape is not None
    gated = rows[0][1]["use_gated_mlp"].strip().lower() in ("true", "1")
    try:
        model = ModelSpec(
            name=p.parent.name,
            hidden_size=shape["n_embd"],
            num_layers=1,
            num_heads=shape["n_head"],
            num_kv_heads=shape["n_kv_head"],
            intermediate_size=shape["n_expanded_embd"],
            vocab_size=shape["vocab_size"],
            max_position_embeddings=1,
            gated_mlp=gated,
        )
    except ValueError as e:
        raise ProfileError(f"{p}:2: {e}") from None
    samples = tuple(LinearSample(n, tp, float(np.median(ts))) for (n, tp), ts in sorted(times.items()))
    return LinearProfile(str(p), model, samples)


def load_all_reduce(path: str | Path, single_node: bool = True) -> list[AllReduceSample]:
    """An ``all_reduce.csv``; ``single_node`` keeps rows whose GPUs all sit in one node (the
    tensor-parallel case), medians over duplicate rows."""
    p = Path(path)
    times: dict[tuple[int, int], list[float]] = defaultdict(list)
    for line, row in _rows(p, ALL_REDUCE_COLUMNS):
        n = _number(p, line, row, "num_workers", int)
        per_node = _number(p, line, row, "devices_per_node", int)
        size = _number(p, line, row, "size", int)
        ms = _number(p, line, row, "time_stats.all_reduce.median")
        if n < 1 or size < 1 or ms <= 0:
            raise ProfileError(f"{p}:{line}: num_workers, size and the time must be > 0")
        if single_node and per_node != n:
            continue
        times[(n, size)].append(ms * 1e-3)
    return [AllReduceSample(n, s, float(np.median(ts))) for (n, s), ts in sorted(times.items())]


def find_linear_profiles(root: str | Path, gpu: str) -> list[Path]:
    """Every ``mlp.csv`` of one GPU folder (``a100``, ``h100``, ``a40``) under a Vidur root."""
    base = Path(root) / "compute" / gpu
    if not base.is_dir():
        raise ProfileError(
            f"{base}: no such profile folder (expected <root>/compute/<gpu>/<org>/<model>/mlp.csv)"
        )
    return sorted(base.glob("*/*/mlp.csv"))
