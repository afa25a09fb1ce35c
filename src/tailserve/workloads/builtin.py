"""Named synthetic workloads.

Each draws from its own ``numpy`` generator seeded by the caller, so the same seed gives the
same requests. Arrival times and each length distribution come from separate child streams of
that seed: changing the arrival process (or the rate) leaves the token lengths unchanged, so two
runs that differ only in arrival pattern compare like with like.
"""

from __future__ import annotations

import math

import numpy as np

from tailserve.core.request import Request
from tailserve.core.source import ListSource, RequestSource
from tailserve.workloads.arrivals import ArrivalSpec, ClosedLoopSource, poisson_arrivals
from tailserve.workloads.lengths import LengthDist, LogNormal, Uniform

HOL_NUM_SHORT = 10
HOL_SHORT_PROMPT_LEN = 512  # tokens
HOL_LONG_PROMPT_LEN = 8192  # tokens
HOL_OUTPUT_LEN = 256  # tokens

CHAT_LONG_FRACTION = 0.1  # share of requests that are long documents
CHAT_SHORT_PROMPT = LogNormal(mean=300, sigma=0.8, max_value=2048)
CHAT_SHORT_OUTPUT = LogNormal(mean=250, sigma=0.8, max_value=1024)
CHAT_LONG_PROMPT = Uniform(4096, 8000)
CHAT_LONG_OUTPUT = LogNormal(mean=200, sigma=0.8, max_value=1024)


def _streams(seed: int, count: int) -> list[np.random.Generator]:
    return [np.random.default_rng(child) for child in np.random.SeedSequence(seed).spawn(count)]


def hol(long_arrival_time: float) -> list[Request]:
    """Head-of-line blocking: ten short requests at t = 0, one long prompt later.

    Ten requests (``short-0``..``short-9``) with 512-token prompts and 256 output tokens arrive
    at t = 0; one (``long-0``) with an 8,192-token prompt and 256 output tokens arrives at
    ``long_arrival_time`` seconds, which the caller picks so the ten are all decoding by then.
    A scheduler that prefills the long prompt in one step stalls all ten decodes behind it.
    """
    if not (long_arrival_time >= 0 and math.isfinite(long_arrival_time)):
        raise ValueError(f"long_arrival_time must be a finite number >= 0, got {long_arrival_time}")
    requests = [
        Request(f"short-{i}", HOL_SHORT_PROMPT_LEN, HOL_OUTPUT_LEN, 0.0) for i in range(HOL_NUM_SHORT)
    ]
    requests.append(Request("long-0", HOL_LONG_PROMPT_LEN, HOL_OUTPUT_LEN, long_arrival_time))
    return requests


def chat(num_requests: int = 200, rate: float = 4.0, seed: int = 0) -> list[Request]:
    """Poisson-arriving chat traffic with a minority of long documents.

    About 90% are short chat turns (prompt log-normal, mean 300 tokens, capped at 2,048; output
    mean 250, capped at 1,024) and about 10% long documents (prompt uniform 4,096-8,000 tokens,
    output mean 200). Ids are ``chat-<i>`` in arrival order.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    arrival_rng, kind_rng, prompt_rng, output_rng = _streams(seed, 4)
    arrivals = poisson_arrivals(num_requests, rate, arrival_rng)
    is_long = kind_rng.random(num_requests) < CHAT_LONG_FRACTION
    # Draw both kinds for every request and pick per request: each request's lengths then
    # depend only on its index, not on how many long ones came before it.
    prompt_lens = np.where(
        is_long,
        CHAT_LONG_PROMPT.sample(num_requests, prompt_rng),
        CHAT_SHORT_PROMPT.sample(num_requests, prompt_rng),
    )
    output_lens = np.where(
        is_long,
        CHAT_LONG_OUTPUT.sample(num_requests, output_rng),
        CHAT_SHORT_OUTPUT.sample(num_requests, output_rng),
    )
    return [
        Request(f"chat-{i}", int(prompt_lens[i]), int(output_lens[i]), float(arrivals[i]))
        for i in range(num_requests)
    ]


def synthetic(
    num_requests: int,
    rate: float,
    input_len: LengthDist,
    output_len: LengthDist,
    arrival: ArrivalSpec,
    seed: int,
) -> RequestSource:
    """Requests with lengths from ``input_len`` / ``output_len`` arriving per ``arrival``.

    Open-loop processes give a ``ListSource`` at ``rate`` requests/s; a closed loop gives a
    ``ClosedLoopSource`` with ``arrival.concurrency`` in flight, and ``rate`` is not used.
    Ids are ``req-<i>``.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    arrival_rng, prompt_rng, output_rng = _streams(seed, 3)
    prompt_lens = input_len.sample(num_requests, prompt_rng)
    output_lens = output_len.sample(num_requests, output_rng)
    if arrival.is_closed_loop:
        arrivals = np.zeros(num_requests)  # overwritten by the source as requests are released
    else:
        arrivals = arrival.times(num_requests, rate, arrival_rng)
    requests = [
        Request(f"req-{i}", int(prompt_lens[i]), int(output_lens[i]), float(arrivals[i]))
        for i in range(num_requests)
    ]
    if arrival.is_closed_loop:
        assert arrival.concurrency is not None  # guaranteed by ArrivalSpec validation
        return ClosedLoopSource(requests, arrival.concurrency)
    return ListSource(requests)
