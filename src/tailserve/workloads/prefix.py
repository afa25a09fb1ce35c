"""Workloads whose prompts share prefixes, for prefix caching: shared system prompts, multi-turn chat.

Unlike the other synthetic workloads these carry token ids (``prompt_token_ids``, and for
multi-turn chat the replies as ``planned_output_token_ids``), because prefix caching keys blocks
by content. Ids are random in [TOKEN_ID_LOW, TOKEN_ID_HIGH), so two prompts share a block only
where the workload made them share it. Every random component draws from its own child stream of
the caller's seed: the same seed gives the same requests, token for token.

Who shares what in a multi-turn session (each turn's prompt starts with the previous turn's
prompt and reply, so the cache can reuse both)::

    turn 0 prompt: | system | user 0 |
    turn 0 reply:                    | reply 0 |
    turn 1 prompt: | system | user 0 | reply 0 | user 1 |
    turn 1 reply:                                       | reply 1 |
    turn 2 prompt: | system | user 0 | reply 0 | user 1 | reply 1 | user 2 |
"""

from __future__ import annotations

import math

import numpy as np

from tailserve.core.request import Request
from tailserve.workloads.arrivals import poisson_arrivals
from tailserve.workloads.lengths import LengthDist, LogNormal

TOKEN_ID_LOW = 1000  # inclusive; clear of the special tokens at the bottom of real vocabularies
TOKEN_ID_HIGH = 32000  # exclusive; inside every vocabulary the models here use

SP_SUFFIX_LEN = LogNormal(mean=256, sigma=0.6, max_value=2048)
SP_OUTPUT_LEN = LogNormal(mean=200, sigma=0.6, max_value=1024)

MT_FIRST_PROMPT_LEN = LogNormal(mean=512, sigma=0.8, max_value=2048)  # may paste a document
MT_USER_TURN_LEN = LogNormal(mean=128, sigma=0.8, max_value=1024)
MT_REPLY_LEN = LogNormal(mean=256, sigma=0.6, max_value=1024)
THINK_TIME_SIGMA = 0.6  # of the log-normal think time's underlying normal


def _streams(seed: int, count: int) -> list[np.random.Generator]:
    return [np.random.default_rng(child) for child in np.random.SeedSequence(seed).spawn(count)]


def _token_ids(rng: np.random.Generator, n: int) -> list[int]:
    # Plain ints: the prefix-cache keys hash them, and ``.tolist()`` is far faster than int().
    return rng.integers(TOKEN_ID_LOW, TOKEN_ID_HIGH, size=n).tolist()


def _check_seconds(name: str, value: float) -> None:
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number >= 0 seconds, got {value}")


def shared_prefix(
    num_requests: int = 200,
    rate: float = 4.0,
    num_prefixes: int = 4,
    prefix_len: int = 1024,
    shared_fraction: float = 0.8,
    suffix_len: LengthDist = SP_SUFFIX_LEN,
    output_len: LengthDist = SP_OUTPUT_LEN,
    seed: int = 0,
) -> list[Request]:
    """Poisson-arriving requests, most of which start with one of a few system prompts.

    There are ``num_prefixes`` system prompts of ``prefix_len`` tokens. Each request, with
    probability ``shared_fraction``, starts with one of them (chosen uniformly); the others start
    with ``prefix_len`` tokens of their own, shared with nobody. Either way its own random suffix
    of ``suffix_len`` tokens follows, so prompt lengths (and the load) do not depend on
    ``shared_fraction``: sweeping it changes only what a prefix cache can reuse. Ids are
    ``sp-<i>`` in arrival order.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
    if prefix_len < 1:
        raise ValueError(f"prefix_len must be >= 1 token, got {prefix_len}")
    if not 0.0 <= shared_fraction <= 1.0:
        raise ValueError(f"shared_fraction must be in [0, 1], got {shared_fraction}")
    arrival_rng, kind_rng, choice_rng, suffix_rng, output_rng, prefix_rng, token_rng = _streams(seed, 7)
    arrivals = poisson_arrivals(num_requests, rate, arrival_rng)
    # Every per-request draw is made for all requests, so a request's kind, prefix choice and
    # lengths depend only on its index, not on the kinds drawn before it.
    is_shared = kind_rng.random(num_requests) < shared_fraction
    choices = choice_rng.integers(0, num_prefixes, size=num_requests)
    suffix_lens = suffix_len.sample(num_requests, suffix_rng)
    output_lens = output_len.sample(num_requests, output_rng)
    prefixes = [_token_ids(prefix_rng, prefix_len) for _ in range(num_prefixes)]
    requests = []
    for i in range(num_requests):
        head = prefixes[int(choices[i])] if is_shared[i] else _token_ids(token_rng, prefix_len)
        ids = [*head, *_token_ids(token_rng, int(suffix_lens[i]))]
        requests.append(
            Request(f"sp-{i}", len(ids), int(output_lens[i]), float(arrivals[i]), prompt_token_ids=ids)
        )
    return requests


def multi_turn(
    num_sessions: int = 40,
    turns: tuple[int, int] = (2, 6),
    rate: float = 1.0,
    think_time: float = 5.0,
    first_prompt_len: LengthDist = MT_FIRST_PROMPT_LEN,
    user_turn_len: LengthDist = MT_USER_TURN_LEN,
    reply_len: LengthDist = MT_REPLY_LEN,
    system_prompt_len: int = 256,
    max_context: int = 8192,
    reply_token_time: float = 0.02,
    seed: int = 0,
) -> list[Request]:
    """Multi-turn chat sessions: every turn resends the whole conversation so far.

    Sessions start as a Poisson process of ``rate`` sessions/s; each has a number of turns drawn
    uniformly from ``turns`` (inclusive). All sessions share one system prompt of
    ``system_prompt_len`` tokens. Turn k's prompt is the system prompt, every earlier user message
    and reply, then the new user message (``first_prompt_len`` tokens for turn 0,
    ``user_turn_len`` after); it generates exactly its reply (``reply_len`` tokens, given as
    ``planned_output_token_ids`` with ``max_tokens`` = its length).

    Arrivals are fixed in advance (the simulator gives a workload no feedback): turn k+1 arrives
    ``reply_len_k * reply_token_time + think`` seconds after turn k, i.e. after the time the
    client assumes the reply takes to stream (``reply_token_time`` seconds per token, 0.02 =
    50 tokens/s) plus a think time drawn per turn, log-normal with mean ``think_time`` seconds.
    A server slower than that assumption gets the next turn before the previous one finished,
    as when replaying a trace, and its cache then holds only what was computed by then.

    A session ends before the first turn whose prompt plus reply would exceed ``max_context``
    tokens (so one whose first turn is too long has no requests). Ids are
    ``mt-<session>-<turn>`` (both from 0); the list is sorted by arrival time.
    """
    if num_sessions < 0:
        raise ValueError(f"num_sessions must be >= 0, got {num_sessions}")
    min_turns, max_turns = turns
    if min_turns < 1 or max_turns < min_turns:
        raise ValueError(f"turns must be (low, high) with 1 <= low <= high, got {turns}")
    _check_seconds("think_time", think_time)
    _check_seconds("reply_token_time", reply_token_time)
    if system_prompt_len < 0:
        raise ValueError(f"system_prompt_len must be >= 0 tokens, got {system_prompt_len}")
    if max_context < system_prompt_len + 2:
        raise ValueError(
            f"max_context must leave room for one user token and one reply token after the "
            f"{system_prompt_len}-token system prompt, got {max_context}"
        )
    arrival_seq, system_seq, sessions_seq = np.random.SeedSequence(seed).spawn(3)
    starts = poisson_arrivals(num_sessions, rate, np.random.default_rng(arrival_seq))
    system = _token_ids(np.random.default_rng(system_seq), system_prompt_len)
    requests: list[Request] = []
    # One stream per session: a session's content depends only on its index and the seed.
    for s, session_seq in enumerate(sessions_seq.spawn(num_sessions)):
        rng = np.random.default_rng(session_seq)
        num_turns = int(rng.integers(min_turns, max_turns, endpoint=True))
        user_lens = [*first_prompt_len.sample(1, rng), *user_turn_len.sample(num_turns - 1, rng)]
        reply_lens = reply_len.sample(num_turns, rng)
        thinks = _think_times(num_turns - 1, think_time, rng)
        history = system
        arrival = float(starts[s])
        for k in range(num_turns):
            prompt = [*history, *_token_ids(rng, int(user_lens[k]))]
            if len(prompt) + int(reply_lens[k]) > max_context:
                break
            reply = _token_ids(rng, int(reply_lens[k]))
            requests.append(
                Request(
                    f"mt-{s}-{k}",
                    len(prompt),
                    len(reply),
                    arrival,
                    prompt_token_ids=prompt,
                    planned_output_token_ids=reply,
                )
            )
            history = [*prompt, *reply]
            if k + 1 < num_turns:
                arrival += len(reply) * reply_token_time + float(thinks[k])
    requests.sort(key=lambda r: r.arrival_time)  # stable: ties keep session, then turn order
    return requests


def _think_times(n: int, mean: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` log-normal think times (seconds) with the given mean. Drawn with mean 1 and scaled,
    so the same draws are made whatever the mean (0 included) and the tokens after them stay."""
    unit = rng.lognormal(-(THINK_TIME_SIGMA**2) / 2, THINK_TIME_SIGMA, size=n)
    return mean * unit
