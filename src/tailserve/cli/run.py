"""``tailserve run``: offline generation with the real executor, like a script calling
``LLM(model).generate(prompts, params)``, with a summary of how the batch was served."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from tailserve.cli.base import default_of
from tailserve.cli.policy_flags import add_policy_flags
from tailserve.core.sampling_params import SamplingParams
from tailserve.llm.engine_args import DTYPE_HELP, DTYPES, EngineArgs


class PromptFileError(ValueError):
    """A prompts file line that is not a prompt; the message names file and line."""


def load_prompts(path: str | Path) -> list[str | list[int]]:
    """JSON lines with ``prompt`` (text) or ``prompt_token_ids`` (a list of ints) for ``.jsonl``
    files; otherwise one text prompt per non-empty line."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PromptFileError(f"{p}: not UTF-8 text (byte {e.start})") from None
    prompts: list[str | list[int]] = []
    jsonl = p.suffix in (".jsonl", ".json")
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if not jsonl:
            prompts.append(line)
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{p}:{lineno}: not JSON ({e.msg})") from None
        except RecursionError:
            raise PromptFileError(f"{p}:{lineno}: not JSON (nested too deeply)") from None
        except ValueError as e:  # an integer of more than sys.get_int_max_str_digits() digits
            raise PromptFileError(f"{p}:{lineno}: not JSON ({e})") from None
        if isinstance(row, dict):
            _check_prompt_keys(p, lineno, row)
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            prompts.append(row["prompt"])
        elif isinstance(row, dict) and isinstance(row.get("prompt_token_ids"), list):
            ids = row["prompt_token_ids"]
            if not all(isinstance(t, int) and t >= 0 for t in ids):
                raise PromptFileError(f"{p}:{lineno}: prompt_token_ids must be non-negative integers")
            prompts.append(ids)
        else:
            raise PromptFileError(
                f"{p}:{lineno}: expected an object with 'prompt' (text) or 'prompt_token_ids'"
            )
    if not prompts:
        raise PromptFileError(f"{p}: no prompts")
    return prompts


def _check_prompt_keys(path: Path, lineno: int, row: dict[str, Any]) -> None:
    """A key run does not read is refused, not dropped: a per-line ``max_tokens`` or sampling
    field would otherwise be silently replaced by the command line's for every prompt."""
    unknown = sorted(set(row) - {"prompt", "prompt_token_ids"})
    if unknown:
        raise PromptFileError(
            f"{path}:{lineno}: unknown key(s) {', '.join(map(repr, unknown))}; a line has 'prompt' "
            "(text) or 'prompt_token_ids' (--max-tokens, --temperature, ... set every prompt's)"
        )
    if "prompt" in row and "prompt_token_ids" in row:
        raise PromptFileError(f"{path}:{lineno}: both 'prompt' and 'prompt_token_ids': give one")


def _arg(name: str) -> Any:
    return default_of(EngineArgs, name)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="generate for a file of prompts with the real executor (policy flags by their engine names)",
    )
    p.add_argument(
        "--model", default=None, help="Hugging Face model directory (default: the cached tiny model)"
    )
    p.add_argument(
        "--prompts",
        required=True,
        help="text file (one prompt per line) or JSONL with prompt / prompt_token_ids",
    )
    p.add_argument("--dtype", default=_arg("dtype"), choices=DTYPES, help=DTYPE_HELP)
    p.add_argument("--device", default=_arg("device"), help="cpu or cuda (default: %(default)s)")
    p.add_argument(
        "--max-tokens", type=int, default=64, help="output tokens per prompt (default: %(default)s)"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=_arg("seed"), help="engine seed (default: %(default)s)")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--kv-cache-memory-gib", type=float, default=None, help="KV cache size (default: 2 GiB on CPU)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for the torch executor (default: the cores other processes leave free, revisited)",
    )
    p.add_argument("--json", metavar="OUT", help="write every output and the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    p.set_defaults(run=run_run)
    add_policy_flags(p, default_policy=_arg("policy"))


def run_run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from tailserve.llm import LLM

    prompts = load_prompts(args.prompts)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        ignore_eos=args.ignore_eos,
    )
    console = Console()
    llm = LLM(
        args.model,
        policy=args.policy,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        max_model_len=args.max_model_len,
        kv_cache_memory_gib=args.kv_cache_memory_gib,
        threads=args.threads,
        **args.policy_flags,
    )
    console.print(f"[dim]{llm.engine.description}[/dim]")
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=console.is_terminal)
    wall = time.perf_counter() - t0
    summary = summarize_outputs(outs, wall, llm.engine.stats())
    if not args.quiet:
        table = Table(show_header=True, header_style="bold")
        for col in ("#", "prompt", "output", "tokens", "finish"):
            table.add_column(col)
        tok = llm.get_tokenizer()
        for i, (prompt, out) in enumerate(zip(prompts, outs)):
            shown = prompt if isinstance(prompt, str) else tok.decode(prompt)
            table.add_row(
                str(i), _clip(shown), _clip(out.text), str(len(out.token_ids)), out.finish_reason or ""
            )
        console.print(table)
    console.print(
        f"{summary['num_requests']} requests, {summary['num_prompt_tokens']} prompt + "
        f"{summary['num_output_tokens']} output tokens in {wall:.2f} s: "
        f"{summary['output_throughput']:.0f} output tok/s; TTFT p50 {summary['ttft_p50_ms']:.0f} ms, "
        f"p99 {summary['ttft_p99_ms']:.0f} ms; {summary['num_preemptions']} preemptions; "
        f"prefix cache hit rate {summary['prefix_cache_hit_rate']:.1%}"
    )
    if args.json:
        payload = {
            "summary": summary,
            "engine": llm.engine.description,
            "outputs": [
                {"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason} for o in outs
            ],
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0


def summarize_outputs(outs: list, wall: float, stats: Any) -> dict[str, Any]:
    from tailserve.metrics.summary import stats as distribution

    ttft = distribution([o.first_token_time - o.arrival_time for o in outs if o.first_token_time is not None])
    num_out = sum(len(o.token_ids) for o in outs)
    return {
        "num_requests": len(outs),
        "num_prompt_tokens": sum(o.prompt_len for o in outs),
        "num_output_tokens": num_out,
        "wall_s": wall,
        "output_throughput": num_out / wall if wall > 0 else 0.0,
        "ttft_p50_ms": (ttft["p50"] or 0.0) * 1e3,
        "ttft_p99_ms": (ttft["p99"] or 0.0) * 1e3,
        "num_preemptions": stats.num_preemptions,
        "prefix_cache_hit_rate": stats.prefix_cache_hits / stats.prefix_cache_queries
        if stats.prefix_cache_queries
        else 0.0,
    }


def _clip(text: str, width: int = 60) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 1] + "…"
