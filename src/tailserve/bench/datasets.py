"""What the benchmark sends: prompts with their lengths, from four sources.

- ``random``: ``vllm bench serve``'s random dataset. Lengths are drawn uniformly from
  [floor(L(1-r)), ceil(L(1+r))] (outputs at least 1) with ``numpy.random.default_rng(seed)``;
  each prompt is an optional shared random prefix plus a run of consecutive token ids from a
  random offset over the tokenizer's non-special ids. Prompts are sent as token ids, so the
  server sees exactly ``prompt_len`` tokens (vLLM decodes and re-encodes them instead and then
  re-aligns lengths through ``/tokenize``).
- ``sharegpt``: the first human turn is the prompt, the first reply's token count the output
  length; entries shorter than 4 tokens, prompts over 1,024 and totals over 2,048 tokens are
  dropped (vLLM's filter), the rest shuffled with the seed and oversampled if too few.
- ``prefix_repetition``: ``vllm bench serve``'s shared-prefix dataset: a few random prefixes,
  each followed by random suffixes, shuffled (``prefix_repetition_requests``).
- ``trace``: a trace file read by ``tailserve.workloads.traces`` (Azure CSV, Mooncake JSONL,
  tailserve JSONL). Its timestamps become the send schedule; its prefix block hashes become
  shared token blocks (``block_size`` ids per hash, the same ids for the same hash), so a prefix
  cache sees the sharing the trace recorded.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tailserve.bench.tokenizer import BenchTokenizer
from tailserve.workloads.traces import load_trace

# vLLM's validity filter for ShareGPT (benchmarks/datasets, is_valid_sequence defaults).
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: str | list[int]  # text or token ids
    prompt_len: int  # tokens
    output_len: int  # tokens asked for (max_tokens)
    arrival_time: float | None = None  # seconds from the start; trace replay only
    prefix_block_hashes: tuple[int, ...] | None = None  # trace replay: shared prompt blocks


def random_requests(
    num_prompts: int,
    tokenizer: BenchTokenizer,
    *,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[BenchRequest]:
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if input_len < 1 or output_len < 1:
        raise ValueError(
            f"--random-input-len and --random-output-len must be >= 1, got {input_len}, {output_len}"
        )
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if prefix_len < 0:
        raise ValueError(f"--random-prefix-len must be >= 0, got {prefix_len}")
    rng = np.random.default_rng(seed)
    allowed = np.asarray(tokenizer.normal_ids(), dtype=np.int64)
    if allowed.size == 0:
        raise ValueError(f"tokenizer {tokenizer.path} has no non-special tokens to draw prompts from")
    input_lens = rng.integers(
        math.floor(input_len * (1 - range_ratio)),
        math.ceil(input_len * (1 + range_ratio)) + 1,
        size=num_prompts,
    )
    output_lens = rng.integers(
        max(math.floor(output_len * (1 - range_ratio)), 1),
        math.ceil(output_len * (1 + range_ratio)) + 1,
        size=num_prompts,
    )
    offsets = rng.integers(0, allowed.size, size=num_prompts)
    prefix = allowed[rng.integers(0, allowed.size, size=prefix_len)].tolist()
    out = []
    for i in range(num_prompts):
        n = max(int(input_lens[i]), 1)
        body = allowed[(offsets[i] + i + np.arange(n)) % allowed.size].tolist()
        out.append(BenchRequest(prefix + body, prefix_len + n, int(output_lens[i])))
    return out


def prefix_repetition_requests(
    num_prompts: int,
    tokenizer: BenchTokenizer,
    *,
    prefix_len: int = 256,
    suffix_len: int = 256,
    num_prefixes: int = 10,
    output_len: int = 128,
    seed: int = 0,
) -> list[BenchRequest]:
    """``vllm bench serve``'s ``prefix_repetition`` dataset: ``num_prefixes`` random prefixes,
    ``num_prompts // num_prefixes`` prompts on each (a random suffix after it), shuffled — the
    shared-prefix workload prefix-aware routing is measured on. Defaults are vLLM's."""
    if num_prefixes < 1 or num_prompts < num_prefixes:
        raise ValueError(
            f"--num-prompts ({num_prompts}) must be >= --prefix-repetition-num-prefixes ({num_prefixes}) >= 1"
        )
    if prefix_len < 0 or suffix_len < 0 or prefix_len + suffix_len < 1 or output_len < 1:
        raise ValueError(
            "--prefix-repetition-prefix-len and --prefix-repetition-suffix-len must be >= 0 with a "
            f"non-empty prompt, --prefix-repetition-output-len >= 1; got {prefix_len}, {suffix_len}, {output_len}"
        )
    rng = np.random.default_rng(seed)
    allowed = np.asarray(tokenizer.normal_ids(), dtype=np.int64)
    if allowed.size == 0:
        raise ValueError(f"tokenizer {tokenizer.path} has no non-special tokens to draw prompts from")
    out = []
    for _ in range(num_prefixes):
        prefix = allowed[rng.integers(0, allowed.size, size=prefix_len)].tolist()
        for _ in range(num_prompts // num_prefixes):
            suffix = allowed[rng.integers(0, allowed.size, size=suffix_len)].tolist()
            out.append(BenchRequest(prefix + suffix, prefix_len + suffix_len, output_len))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def sharegpt_requests(
    path: str | Path,
    num_prompts: int,
    tokenizer: BenchTokenizer,
    *,
    output_len: int | None = None,
    seed: int = 0,
) -> list[BenchRequest]:
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such ShareGPT file") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}} entries")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, dict) for t in turns[:2]):
            pairs.append((str(turns[0].get("value", "")), str(turns[1].get("value", ""))))
    random.Random(seed).shuffle(pairs)
    out: list[BenchRequest] = []
    for prompt, completion in pairs:
        if len(out) == num_prompts:
            break
        prompt_len = len(tokenizer.encode(prompt))
        reply_len = output_len if output_len is not None else len(tokenizer.encode(completion))
        if prompt_len < SHAREGPT_MIN_LEN or reply_len < SHAREGPT_MIN_LEN:
            continue
        if prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + reply_len > SHAREGPT_MAX_TOTAL_LEN:
            continue
        out.append(BenchRequest(prompt, prompt_len, reply_len))
    if not out:
        raise ValueError(f"{path}: no usable conversation (a prompt and a reply of 4..1024 tokens each)")
    if len(out) < num_prompts:  # vLLM oversamples to reach --num-prompts
        rng = random.Random(seed + 1)
        out += [rng.choice(out) for _ in range(num_prompts - len(out))]
    return out


def trace_requests(
    path: str | Path,
    tokenizer: BenchTokenizer,
    *,
    num_prompts: int | None = None,
    rate_scale: float = 1.0,
    block_size: int = 512,
    seed: int = 0,
) -> list[BenchRequest]:
    if block_size < 1:
        raise ValueError(f"--trace-block-size must be >= 1, got {block_size}")
    requests = load_trace(path, rate_scale=rate_scale, max_requests=num_prompts)
    if not requests:
        raise ValueError(f"{path}: the trace holds no request")
    allowed = np.asarray(tokenizer.normal_ids(), dtype=np.int64)
    rng = np.random.default_rng(seed)
    start = requests[0].arrival_time
    blocks: dict[int, list[int]] = {}
    out = []
    for r in requests:
        prompt: list[int] = []
        for h in r.prefix_block_hashes or ():
            if h not in blocks:
                block_rng = np.random.default_rng([seed, h & 0xFFFFFFFF, h >> 32 & 0xFFFFFFFF])
                blocks[h] = allowed[block_rng.integers(0, allowed.size, size=block_size)].tolist()
            prompt += blocks[h]
        del prompt[r.prompt_len :]
        fill = r.prompt_len - len(prompt)  # the part of the prompt no recorded block covers
        prompt += allowed[rng.integers(0, allowed.size, size=fill)].tolist()
        hashes = tuple(r.prefix_block_hashes) if r.prefix_block_hashes else None
        out.append(BenchRequest(prompt, r.prompt_len, r.max_tokens, r.arrival_time - start, hashes))
    return out
