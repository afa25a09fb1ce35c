"""What ``tailserve bench`` reads before it sends: the server's model and context length from
``/v1/models``, the dataset's requests (a trace's cut to fit the server's context), argument
checks, and the one-line reason a failed request is reported with."""

from __future__ import annotations

import argparse
import json
from typing import Any


def server_model(base_url: str) -> tuple[str, str | None]:
    import httpx

    url = f"{base_url}/v1/models"
    try:
        response = httpx.get(url, timeout=30.0)
        response.raise_for_status()
        card = response.json()["data"][0]
    except httpx.HTTPError as error:
        raise ValueError(f"cannot read {url}: {error}") from None
    except (KeyError, IndexError, TypeError, ValueError):
        raise ValueError(f"{url} lists no model; pass --model") from None
    return str(card["id"]), card.get("root")


def server_context(base_url: str) -> int | None:
    """``max_model_len`` of the server's first model card (vLLM's and ours carry it), or None."""
    import httpx

    try:
        card = httpx.get(f"{base_url}/v1/models", timeout=30.0).json()["data"][0]
        return int(card["max_model_len"])
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError):
        return None


def fit_to_context(requests: list[Any], context: int, block_size: int) -> list[Any]:
    """The requests with recorded prompts cut so prompt + max_tokens fits ``context`` (a trace
    recorded on a long-context deployment replayed against a small server); the others are the
    same objects. Outputs longer than the whole context keep a quarter of it, the prompt the rest."""
    import dataclasses

    fitted = []
    for r in requests:
        if r.prompt_len + r.output_len <= context:
            fitted.append(r)
            continue
        output_len = max(1, context // 4) if r.output_len >= context else r.output_len
        keep = max(1, context - output_len)
        hashes = r.prefix_block_hashes[: -(-keep // block_size)] if r.prefix_block_hashes else None
        prompt = r.prompt[:keep] if isinstance(r.prompt, list) else r.prompt
        fitted.append(
            dataclasses.replace(
                r, prompt=prompt, prompt_len=keep, output_len=output_len, prefix_block_hashes=hashes
            )
        )
    return fitted


def load_requests(args: argparse.Namespace, tokenizer: Any) -> list[Any]:
    from tailserve.bench import datasets

    kind, *rest = args.dataset
    if kind == "random" and not rest:
        return datasets.random_requests(
            args.num_prompts,
            tokenizer,
            input_len=args.random_input_len,
            output_len=args.random_output_len,
            range_ratio=args.random_range_ratio,
            prefix_len=args.random_prefix_len,
            seed=args.seed,
        )
    if kind == "sharegpt" and len(rest) == 1:
        return datasets.sharegpt_requests(
            rest[0], args.num_prompts, tokenizer, output_len=args.sharegpt_output_len, seed=args.seed
        )
    if kind == "prefix_repetition" and not rest:
        return datasets.prefix_repetition_requests(
            args.num_prompts,
            tokenizer,
            prefix_len=args.prefix_repetition_prefix_len,
            suffix_len=args.prefix_repetition_suffix_len,
            num_prefixes=args.prefix_repetition_num_prefixes,
            output_len=args.prefix_repetition_output_len,
            seed=args.seed,
        )
    if kind == "trace" and len(rest) == 1:
        return datasets.trace_requests(
            rest[0],
            tokenizer,
            num_prompts=args.num_prompts,
            rate_scale=args.rate_scale,
            block_size=args.trace_block_size,
            seed=args.seed,
        )
    raise ValueError(
        f"--dataset {' '.join(args.dataset)!r}: expected random, sharegpt PATH or trace PATH, or prefix_repetition"
    )


def failure_reason(error: str) -> str:
    """``HTTP 400 Bad Request: {"error": {"message": ...}}`` -> ``HTTP 400: <message>``."""
    head, sep, body = error.partition(": ")
    if sep and head.startswith("HTTP "):
        try:
            message = json.loads(body)["error"]["message"]
            return f"{head.split()[0]} {head.split()[1]}: {message}"
        except (ValueError, KeyError, TypeError, IndexError):
            pass
    return error


def check_args(args: argparse.Namespace) -> None:
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf for all at once), got {args.request_rate}")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
