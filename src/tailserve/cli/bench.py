"""``tailserve bench``: load an OpenAI-compatible server (tailserve, vLLM, SGLang, TGI, llama.cpp).

    tailserve bench --base-url URL (--dataset random | --dataset sharegpt PATH | --dataset trace PATH)
                    [--request-rate R] [--burstiness K] [--max-concurrency C] [--num-prompts N]
                    [--goodput ttft:MS tpot:MS] [--json OUT] [--predict ...]

Flags, metric definitions and the result JSON follow ``vllm bench serve``; ``--predict`` runs the
same workload through the simulator first and prints predicted beside measured. The model name
and, when it is a local directory, the tokenizer come from the server's ``/v1/models`` unless
given.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
from datetime import datetime
from typing import Any

from tailserve.bench.predict_spec import PredictSpec
from tailserve.cli.base import default_of
from tailserve.cli.bench_setup import (
    check_args,
    failure_reason,
    fit_to_context,
    load_requests,
    server_context,
    server_model,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark any OpenAI-compatible server with vllm bench serve's workloads, metrics and JSON",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL (default: %(default)s)")
    p.add_argument(
        "--endpoint",
        default="/v1/completions",
        choices=("/v1/completions", "/v1/chat/completions"),
        help="(default: %(default)s)",
    )
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="model directory with tokenizer.json (default: the served model's root, if it is a local directory)",
    )
    g = p.add_argument_group("dataset")
    g.add_argument(
        "--dataset",
        nargs="+",
        default=["random"],
        metavar="KIND [PATH]",
        help="random | sharegpt PATH | prefix_repetition | trace PATH (Azure CSV, Mooncake JSONL, "
        "tailserve JSONL)",
    )
    g.add_argument("--num-prompts", type=int, default=100, help="requests to send (default: %(default)s)")
    g.add_argument("--random-input-len", "--input-len", type=int, default=1024, help="(default: %(default)s)")
    g.add_argument(
        "--random-output-len", "--output-len", type=int, default=128, help="(default: %(default)s)"
    )
    g.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths in L*(1-r)..L*(1+r)")
    g.add_argument(
        "--random-prefix-len", type=int, default=0, help="tokens of one random prefix every prompt shares"
    )
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="override the replies' lengths")
    # vLLM's prefix_repetition flags and defaults: shared prefixes, as prefix-aware routing needs.
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256, help="(default: %(default)s)")
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256, help="(default: %(default)s)")
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10, help="(default: %(default)s)")
    g.add_argument("--prefix-repetition-output-len", type=int, default=128, help="(default: %(default)s)")
    g.add_argument("--rate-scale", type=float, default=1.0, help="trace: replay this many times faster")
    g.add_argument("--trace-block-size", type=int, default=512, help="trace: tokens per prefix hash id")
    g.add_argument(
        "--fit-context",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="trace: cut prompts that would not fit the server's context (its /v1/models max_model_len), "
        "so they are measured rather than refused (default: on)",
    )
    g.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    g = p.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s (default: inf, all at once; a trace keeps its own timestamps unless set)",
    )
    g.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 bursty, >1 smooth"
    )
    g.add_argument(
        "--max-concurrency", type=int, default=None, help="client-side limit on requests in flight"
    )
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="send ignore_eos (default: on for random and trace, off for sharegpt, as vLLM)",
    )
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g = p.add_argument_group("results")
    g.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs for goodput, e.g. ttft:200 tpot:50")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", help="(default: %(default)s)")
    g.add_argument("--metric-percentiles", default="99", help="comma list (default: %(default)s)")
    g.add_argument("--json", metavar="OUT", help="write the result JSON (vllm bench serve's field names)")
    g.add_argument("--save-detailed", action="store_true", help="keep per-request lists in the JSON")
    g.add_argument(
        "--record-trace",
        metavar="FILE.jsonl",
        default=None,
        help="write every request (send time, prompt and output tokens, the prompt's token ids, TTFT and "
        "each inter-token gap as measured) as a trace simulate --trace replays",
    )
    g.add_argument("--label", default=None, help="label stored in the JSON")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("prediction (--predict)")
    g.add_argument(
        "--predict",
        action="store_true",
        help="simulate the same workload first; print side by side. Against `tailserve serve --executor "
        "sim` the server's own deployment is simulated, with the --predict-* flags you set on top",
    )
    # Each --predict-* flag defaults to None, "not given": against a stand-in server only the
    # flags given replace its deployment's values, whatever they are (a given value equal to the
    # default still wins); elsewhere PredictSpec's defaults fill the rest.
    g.add_argument("--predict-model", default=None, help=_predict_help("simulated model", "model"))
    g.add_argument("--predict-hardware", default=None, help=_predict_help("simulated GPU", "hardware"))
    g.add_argument("--predict-tp", type=int, default=None, help=_predict_help("tensor-parallel size", "tp"))
    g.add_argument("--predict-policy", default=None, help=_predict_help("NAME[:flag=value...]", "policy"))
    g.add_argument(
        "--predict-calibration",
        default=None,
        help=_predict_help("as tailserve simulate --calibration", "calibration"),
    )
    p.set_defaults(run=run_bench)


def _predict_help(what: str, field: str) -> str:
    return (
        f"{what} (default: the server's own against tailserve serve --executor sim, else "
        f"{default_of(PredictSpec, field)})"
    )


def predict_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--predict-*`` flags given, by ``PredictSpec`` field name."""
    names = (f.name for f in dataclasses.fields(PredictSpec))
    return {name: value for name in names if (value := getattr(args, f"predict_{name}")) is not None}


def run_bench(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tailserve.bench.client import BenchConfig, run_benchmark, send_times
    from tailserve.bench.report import print_comparison, print_result
    from tailserve.bench.result import (
        DETAILED_FIELDS,
        chunk_notes,
        compute_result,
        parse_goodput,
        parse_percentiles,
    )
    from tailserve.bench.tokenizer import find_tokenizer, load_tokenizer

    check_args(args)
    goodput = parse_goodput(args.goodput)
    percentiles = parse_percentiles(args.metric_percentiles)
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    base_url = args.base_url.rstrip("/")
    model, root = (args.model, None) if args.model and args.tokenizer else server_model(base_url)
    model = args.model or model
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else find_tokenizer([root, model])
    if tokenizer is None:
        raise ValueError(
            f"no tokenizer for {model!r}: the server's model root {root!r} is not a local directory; "
            "pass --tokenizer DIR (a directory with tokenizer.json)"
        )
    requests = load_requests(args, tokenizer)
    if not requests:
        raise ValueError(f"--dataset {' '.join(args.dataset)}: no requests to send")
    kind = args.dataset[0]
    if kind == "trace" and args.fit_context:
        context = server_context(base_url)
        fitted = fit_to_context(requests, context, args.trace_block_size) if context else requests
        num_cut = sum(a is not b for a, b in zip(requests, fitted))
        requests = fitted
        if num_cut:
            print(
                f"note: {num_cut} of {len(requests)} trace requests cut to fit the server's "
                f"{context:,}-token context (prompt + max_tokens); --no-fit-context sends them as recorded",
                file=sys.stderr,
            )
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else kind in ("random", "trace")
    times = send_times(requests, args.request_rate, args.burstiness, args.seed)
    extra = {
        k: v
        for k, v in (("temperature", args.temperature), ("top_p", args.top_p), ("top_k", args.top_k))
        if v is not None
    }
    chat = args.endpoint == "/v1/chat/completions"
    config = BenchConfig(f"{base_url}{args.endpoint}", model, chat, ignore_eos, extra, args.max_concurrency)

    predicted = None
    if args.predict:
        from tailserve.bench.predict import predicted_notes, server_deployment, simulate, spec_for_server

        spec, warnings = spec_for_server(predict_overrides(args), server_deployment(base_url))
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr)
        sim_results, sim_duration, run = simulate(requests, times, spec, args.max_concurrency)
        predicted = compute_result(
            sim_results, sim_duration, percentiles=percentiles, metrics=metrics, goodput=goodput
        )
        for note in predicted_notes(run):
            print(f"note: {note}", file=sys.stderr)

    with Progress(
        TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), disable=args.no_progress
    ) as progress:
        task = progress.add_task("requests", total=len(requests))
        results, duration = asyncio.run(
            run_benchmark(requests, times, config, tokenizer, on_done=lambda _: progress.advance(task))
        )
    errors = [r.error for r in results if not r.success]
    if results and len(errors) == len(results):
        # Nothing to measure: one line saying why, and a failing exit status for scripts.
        reasons = dict.fromkeys(failure_reason(e) for e in errors)
        raise ValueError(
            f"all {len(results)} requests failed: {next(iter(reasons))}"
            + (f" (and {len(reasons) - 1} other errors)" if len(reasons) > 1 else "")
        )
    result = compute_result(results, duration, percentiles=percentiles, metrics=metrics, goodput=goodput)
    if args.record_trace:
        from tailserve.bench.record import record_trace

        record_trace(args.record_trace, requests, results)
    for error in dict.fromkeys(errors[:10]):
        print(f"failed request: {error}", file=sys.stderr)
    print_result(
        result,
        metrics=metrics,
        percentiles=percentiles,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
    )
    chunks = result["mean_tokens_per_chunk"]
    for note in chunk_notes(chunks, predicted["mean_tokens_per_chunk"] if predicted is not None else None):
        print(f"note: {note}", file=sys.stderr)
    if predicted is not None:
        print_comparison(
            predicted,
            result,
            metrics=metrics,
            percentiles=percentiles,
            title=f"predicted ({spec.label}) vs measured",
        )
    if args.json:
        backend = "openai-chat" if chat else "openai"
        payload: dict[str, Any] = {
            "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
            "endpoint_type": backend,
            "backend": backend,
            "label": args.label,
            "model_id": model,
            "tokenizer_id": tokenizer.path,
            "num_prompts": len(requests),
            "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
            **result,
        }
        if predicted is not None:
            payload["predicted"] = {
                k: v for k, v in predicted.items() if k not in (*DETAILED_FIELDS, "latencies", "queue_times")
            }
            payload["predicted"]["deployment"] = spec.label
        if not args.save_detailed:
            for key in DETAILED_FIELDS:
                payload.pop(key, None)
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
            f.write("\n")
    return 0
