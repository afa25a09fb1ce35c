"""The sampler never produces NaN and always keeps one token, whatever the parameters (defence in
depth behind the server's validation), and ``SamplingParams`` refuses what vLLM refuses."""

from __future__ import annotations

import math

import pytest
import torch

from tailserve.core.request import Request
from tailserve.executors.pytorch.sampler import Sampler
from tailserve.llm import SamplingParams

VOCAB = 64


def _request(params: SamplingParams, num_outputs: int = 0) -> Request:
    request = Request("r", 4, 8, 0.0, prompt_token_ids=[1, 2, 3, 4], sampling_params=params)
    request.num_output_tokens = num_outputs
    return request


def _sample(params: SamplingParams, logits: torch.Tensor, eos: tuple[int, ...] = (2,)) -> int:
    sampler = Sampler(eos, seed=0, device=torch.device("cpu"))
    return sampler.sample(logits.clone().unsqueeze(0), [_request(params)])[0]


def _unsafe(params: dict) -> SamplingParams:
    """Parameters the validation refuses, built anyway to test the sampler on its own."""
    p = SamplingParams()
    for name, value in params.items():
        object.__setattr__(p, name, value)
    return p


@pytest.mark.parametrize(
    "params",
    [
        {"top_p": 1e-50},  # 0 in float32: would mask every token
        {"top_p": 1e-50, "top_k": 3},
        {"min_p": 1.0},
        {"temperature": 1e-4},
        {"temperature": 1e300},
        {"temperature": math.inf},  # refused by validation; the sampler still copes
        {"top_p": 0.0},
    ],
    ids=str,
)
def test_sampler_keeps_a_token_and_never_nan(params: dict) -> None:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)) * 5
    token = _sample(_unsafe(params), logits)
    assert 0 <= token < VOCAB
    if params.get("top_p") is not None and params["top_p"] < 1e-30 and "top_k" not in params:
        assert token == int(logits.argmax())  # only the most likely token survives


def test_sampler_survives_non_finite_logits_and_out_of_vocab_bans() -> None:
    logits = torch.full((VOCAB,), float("nan"))
    logits[7] = 1.0
    assert _sample(SamplingParams(temperature=1.0, seed=3), logits) == 7
    assert _sample(SamplingParams(temperature=0.0), logits) == 7  # greedy: NaN counts as -inf
    # every logit NaN: cleaned to -inf, so greedy takes token 0 (torch.argmax's first maximum)
    assert _sample(SamplingParams(temperature=0.0), torch.full((VOCAB,), float("nan"))) == 0
    every_token_banned = torch.full((VOCAB,), float("-inf"))
    assert 0 <= _sample(SamplingParams(temperature=0.7), every_token_banned) < VOCAB
    # min_tokens with a stop id beyond the vocabulary: ignored, not an IndexError
    params = _unsafe({"min_tokens": 2, "stop_token_ids": (1_000_000, 5)})
    logits = torch.zeros(VOCAB)
    logits[5] = 100.0
    assert (
        _sample(_unsafe({**{"temperature": 0.0}, "min_tokens": 2, "stop_token_ids": (1_000_000, 5)}), logits)
        != 5
    )
    assert 0 <= _sample(params, logits) < VOCAB


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), 0, -1])
def test_seeds_across_int64_are_deterministic(seed: int) -> None:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.0, seed=seed)
    assert _sample(params, logits) == _sample(params, logits)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": math.nan}, "temperature must be a finite number"),
        ({"top_p": math.inf}, "top_p must be a finite number"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0."),
        ({"top_k": -2}, "top_k must be 0 (disable), or at least 1, got -2."),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5."),
        ({"seed": 2**64}, "seed must be within int64"),
        ({"seed": -(2**63) - 1}, "seed must be within int64"),
        ({"max_tokens": 2, "min_tokens": 3}, "min_tokens must be less than or equal to max_tokens=2, got 3."),
        ({"stop_token_ids": [True]}, "stop_token_ids must be non-negative integers"),
        ({"top_k": 1.5}, "top_k must be an integer"),
    ],
)
def test_sampling_params_refuse_with_vllm_messages(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        SamplingParams(**kwargs)
    assert message in str(error.value)


def test_bf16_logits_sample_as_their_float32_copy() -> None:
    """The executor hands the sampler the LM head's bf16 logits: greedy, banned and seeded rows
    give the tokens the float32 copy gives."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, VOCAB, generator=g) * 3).to(torch.bfloat16)
    logits[2, 11] = float("nan")
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=4),
        SamplingParams(temperature=0.0),
        _unsafe({"temperature": 0.0, "min_tokens": 3, "stop_token_ids": (int(logits[3].float().argmax()),)}),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=9),
        SamplingParams(temperature=0.5, min_p=0.1, seed=1),
    ]
    requests = [_request(p) for p in params]
    got = Sampler((2,), seed=0, device=torch.device("cpu")).sample(logits.clone(), requests)
    want = Sampler((2,), seed=0, device=torch.device("cpu")).sample(logits.float(), requests)
    assert got == want
