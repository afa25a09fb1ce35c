"""Static batching is the same thing in both executors: the real executor computes the padding
slots the simulator prices (every padded row through the layers and the LM head, as a padded
``generate`` does), and the padding changes no request's tokens."""

from __future__ import annotations

import random

import pytest
import torch

from tailserve.executors.simulated.executor import batch_shape
from tailserve.llm import LLM, SamplingParams
from torch_helpers import hf_greedy, micro_model

KV_GIB = 4096 * 512 / 2**30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return micro_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[1] + [rng.randrange(3, 512) for _ in range(n - 1)] for n in (9, 50, 23, 4)]


MAX_TOKENS = (3, 12, 7, 1)  # early finishers leave decode padding behind them


class _Counting:
    """Wraps the model: the tokens each forward pass and each LM-head call really computed."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.forward_tokens: list[int] = []
        self.logit_rows: list[int] = []

    def forward(self, ids, positions, meta, kv, out_rows=None):
        self.forward_tokens.append(int(ids.numel()))
        return self.inner.forward(ids, positions, meta, kv, out_rows)

    def logits(self, hidden):  # the executor's LM-head call
        self.logit_rows.append(int(hidden.shape[0]))
        return self.inner.logits(hidden)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _static_run(model_dir, prompts):
    llm = LLM(
        str(model_dir), policy="static", dtype="float32", check_integrity=True, kv_cache_memory_gib=KV_GIB
    )
    executor = llm.engine.stop_checker.inner
    counting = _Counting(executor.model)
    executor.model = counting
    shapes = []
    execute = executor.execute

    def recording(out):
        shapes.append(batch_shape(out))
        return execute(out)

    executor.execute = recording
    requests = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate(requests, params)
    return llm, outs, shapes, counting


@pytest.fixture(scope="module")
def static_run(model_dir, prompts):
    return _static_run(model_dir, prompts)


def test_real_executor_computes_the_padding_the_simulator_prices(static_run):
    _, outs, shapes, counting = static_run
    assert [len(o.outputs[0].token_ids) for o in outs] == list(MAX_TOKENS)
    # The prefill pads every prompt to 50 tokens (three padding slots, each with its LM-head
    # row, as the simulator counts them); decodes keep finished requests' slots.
    assert shapes[0].num_tokens == 4 * 50 and shapes[0].num_logits == 4 + 3
    assert all(s.num_tokens == 4 for s in shapes[1:]) and len(shapes) == max(MAX_TOKENS)
    # Iteration by iteration the forward pass ran exactly the tokens the cost model prices, and
    # the LM head ran over every row the cost model counts as sampling.
    assert counting.forward_tokens == [s.num_tokens for s in shapes]
    assert counting.logit_rows == [s.num_logits for s in shapes]


def test_padding_changes_no_tokens_and_leaves_the_spare_block_zero(model_dir, prompts, static_run):
    llm, outs, _, _ = static_run
    # Greedy: the first n tokens of a longer generation are the n-token generation.
    reference = hf_greedy(model_dir, prompts, max(MAX_TOKENS))
    for want, out, n in zip(reference, outs, MAX_TOKENS):
        assert list(out.outputs[0].token_ids) == want[:n]
    kv = llm.engine.stop_checker.inner.kv
    spare = kv.num_blocks
    assert all(not k[spare].any() and not v[spare].any() for k, v in zip(kv.k, kv.v))
    assert torch.count_nonzero(kv.k[0][:spare]) > 0  # the real requests' KV was written
