"""``tailserve model init``: write a randomly initialised Hugging Face model directory.

torch and tokenizers are imported only when the command runs, so the rest of the CLI (the
simulator) starts without them.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(sub: Any) -> None:
    """Register ``model`` and its ``init`` subcommand on the top-level subparsers."""
    model = sub.add_parser("model", help="model directories for the real executor (init)")
    model_sub = model.add_subparsers(dest="model_command")
    p = model_sub.add_parser(
        "init",
        help="write a random Llama-family model and a trained BPE tokenizer in Hugging Face's format",
    )
    p.add_argument(
        "--out", required=True, metavar="DIR", help="directory to create (must be missing or empty)"
    )
    p.add_argument(
        "--preset",
        default="tiny",
        help="tiny (~21 M params) | small (~101 M) | tiny-moe (Mixtral, 8 experts, ~1.9 M) | "
        "tiny-qwen3-moe (Qwen3-MoE) (default: %(default)s)",
    )
    p.add_argument(
        "--architecture",
        default=None,
        help="llama | mistral | qwen2 | mixtral | qwen3_moe (default: the preset's; llama for tiny/small)",
    )
    p.add_argument("--dtype", default="bfloat16", help="float32 | bfloat16 | float16 (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="weight seed; the same seed gives the same bytes")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a config field, e.g. --set num_hidden_layers=2 --set tie_word_embeddings=true "
        "(VALUE is JSON; repeatable)",
    )
    p.set_defaults(run=cmd_model_init)
    model.set_defaults(run=_no_subcommand)


def _no_subcommand(args: argparse.Namespace) -> int:
    raise ValueError("tailserve model needs a subcommand: init (see tailserve model init --help)")


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["hidden_size=64", "rope_scaling={...}"]`` -> {field: value}; a value that is not JSON stays text."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE, e.g. hidden_size=64")
        try:
            overrides[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[key.strip()] = raw
    return overrides


def cmd_model_init(args: argparse.Namespace) -> int:
    from tailserve.executors.pytorch.init_model import init_model
    from tailserve.executors.pytorch.loader import load_config

    out = init_model(
        args.out,
        preset=args.preset,
        seed=args.seed,
        dtype=args.dtype,
        architecture=args.architecture,
        **parse_overrides(args.set),
    )
    config = load_config(out)
    print(
        f"wrote {out}: {config.architecture}, {config.num_params:,} parameters, {config.torch_dtype}, "
        f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}"
    )
    return 0
