"""Speculative decoding in the simulator: the drafters vLLM V1 runs, which drafts are accepted,
and what drafting costs.

**Methods** (vLLM 0.32 ``vllm/config/speculative.py``, ``vllm/config/vllm.py``): what the
scheduler sees of each is the KV lookahead it reserves past the verified tokens
(``VllmConfig.num_lookahead_tokens``: the drafter writes KV there), whether a prefix-cache hit
drops its last block (``use_eagle``: the drafter needs the hidden states of the tokens before
the generation point recomputed) and whether async scheduling may run with it:

| method | lookahead slots | hit drops a block | async scheduling | drafter on the GPU |
|---|---|---|---|---|
| ``ngram`` | 0 | no | refused (vLLM: "only supported with EAGLE/MTP/...") | none (CPU n-gram lookup) |
| ``ngram_gpu`` | 0 | no | yes | none (a GPU n-gram kernel, ~0) |
| ``eagle``, ``eagle3`` | k | yes | yes | one decoder layer per draft token |
| ``mtp`` | k | yes | yes | one MTP module (~ one decoder layer) per draft token |

``mtp`` is a single MTP module reused for every draft (DeepSeek-V3's ``num_nextn_predict_layers
= 1``); vLLM's multi-module MTP, which also moves chunk boundaries (``num_prefill_lookahead``),
is not modelled. ``draft_model`` (a separate small model, one more input slot per request) is
refused: its cost is a second model's.

**Acceptance** is vLLM's own synthetic rejection sampler (``rejection_sample_method=
"synthetic"``, ``vllm/v1/sample/rejection_sampler.py``) under its field names, one of:

- ``synthetic_acceptance_rates``: per-position *unconditional* rates p_1 >= p_2 >= ... >= p_k,
  p_i the probability that the first i drafts are all accepted — what vLLM logs as the
  "per-position acceptance rate" (``vllm:spec_decode_num_accepted_tokens_per_pos`` /
  ``vllm:spec_decode_num_drafts``);
- ``synthetic_acceptance_length``: the mean acceptance length L in [1, k + 1] (``1 +
  num_accepted_tokens / num_drafts``, the bonus token included), turned into rates by vLLM's
  minimum-variance schedule ``[1] * floor(L - 1) + [frac(L - 1)] + [0, ...]``.

A verification accepts position i while ``u_i < p_i / p_{i-1}`` (vLLM's conditional rates) and
stops at the first rejection; it samples 1 + accepted tokens (the bonus or recovered token).
The uniforms are a hash of (seed, request id, the request's computed tokens before the step):
deterministic, independent of what else runs, and the same for a position verified again after a
preemption, as a real drafter's success depends on the text. With fewer drafts scheduled than k
(a budget cut), the first ones decide: ``min(draw, scheduled)``.

**Drafter cost** (per step, on top of the target's verification, which the cost model prices
like a small prefill: 1 + k tokens per decode, the LM head over each): EAGLE, EAGLE-3 and MTP
run one decoder layer of the target, first over every token of the step (the drafter keeps its
own KV of the prompt), then k - 1 times over one token per request that samples, each pass with
an LM head over those requests. Priced by the cost model of a one-layer copy of the target
(same GPU, TP, data parallelism and efficiencies, no per-step overhead: the host part is the
step's). Assumptions: the draft layer has the target's shapes (EAGLE-3's own smaller draft
vocabulary and MTP's extra ``2h x h`` projection are not priced); n-gram drafting costs no GPU
time.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from tailserve.executors.simulated.cost_model import BatchShape, CostModel
from tailserve.executors.simulated.model_spec import ModelSpec

# method -> (lookahead slots = k, hit drops a block, async allowed, drafter on the GPU)
METHODS: dict[str, tuple[bool, bool, bool, bool]] = {
    "ngram": (False, False, False, False),
    "ngram_gpu": (False, False, True, False),
    "eagle": (True, True, True, True),
    "eagle3": (True, True, True, True),
    "mtp": (True, True, True, True),
}


def acceptance_length_to_rates(length: float, k: int) -> tuple[float, ...]:
    """vLLM's ``SpeculativeConfig._acceptance_length_to_rates``: the minimum-variance schedule."""
    num_drafts = length - 1  # expected accepted drafts
    num_full = int(num_drafts)
    return tuple(([1.0] * num_full + [num_drafts - num_full] + [0.0] * (k - num_full - 1))[:k])


def resolve_acceptance_rates(
    k: int, rates: tuple[float, ...] | None, length: float | None
) -> tuple[float, ...]:
    """Per-position unconditional rates from exactly one of ``rates`` or ``length``, checked as
    vLLM checks them (``_resolve_synthetic_acceptance_rates``); one-line ValueErrors."""
    if (rates is None) == (length is None):
        raise ValueError(
            "speculative decoding needs exactly one of synthetic_acceptance_rates or "
            "synthetic_acceptance_length"
        )
    if rates is not None:
        if len(rates) != k:
            raise ValueError(
                f"synthetic_acceptance_rates must have num_speculative_tokens ({k}) entries, got {len(rates)}"
            )
        if not all(0.0 <= r <= 1.0 for r in rates):
            raise ValueError(f"synthetic_acceptance_rates entries must be in [0, 1], got {list(rates)}")
        if any(rates[i] > rates[i - 1] for i in range(1, k)):
            raise ValueError(f"synthetic_acceptance_rates must be non-increasing, got {list(rates)}")
        return tuple(float(r) for r in rates)
    assert length is not None
    if not 1.0 <= length <= k + 1:
        raise ValueError(
            f"synthetic_acceptance_length must be in [1, {k + 1}] (1 + {k} draft{'s' * (k != 1)}: the bonus "
            f"token and at most every draft), got {length}"
        )
    return acceptance_length_to_rates(length, k)


def conditional_rates(rates: tuple[float, ...]) -> tuple[float, ...]:
    """vLLM's ``unconditional_to_conditional_rates``: c_i = p_i / p_{i-1}."""
    return tuple(p / q if q > 0.0 else 0.0 for p, q in zip(rates, (1.0, *rates[:-1])))


@dataclass(frozen=True, slots=True)
class SpecDecoding:
    """A configuration's speculative decoding (``Policy.speculative_decoding``)."""

    method: str
    num_speculative_tokens: int
    acceptance_rates: tuple[float, ...]  # unconditional, per position (resolved)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if len(self.acceptance_rates) != self.num_speculative_tokens:
            raise ValueError("one acceptance rate per draft position")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots reserved past the verified tokens (``VllmConfig.num_lookahead_tokens``)."""
        return self.num_speculative_tokens if METHODS[self.method][0] else 0

    @property
    def drops_hit_block(self) -> bool:
        """A prefix-cache hit gives up its last block (``use_eagle_block_drop``)."""
        return METHODS[self.method][1]

    @property
    def allows_async(self) -> bool:
        return METHODS[self.method][2]

    @property
    def drafter_on_gpu(self) -> bool:
        return METHODS[self.method][3]

    @property
    def mean_acceptance_length(self) -> float:
        """1 + expected accepted drafts per verification of all k drafts."""
        return 1.0 + sum(self.acceptance_rates)


def accepted_drafts(spec: SpecDecoding, seed: int, request_id: str, position: int) -> int:
    """Drafts (out of k) a verification of ``request_id`` starting after ``position`` computed
    tokens accepts: one uniform per draft position from a hash of (seed, request, position),
    accepted while below vLLM's conditional rate."""
    k = spec.num_speculative_tokens
    digest = hashlib.blake2b(f"{seed}:{request_id}:{position}".encode(), digest_size=8 * k).digest()
    accepted = 0
    for i, rate in enumerate(conditional_rates(spec.acceptance_rates)):
        if int.from_bytes(digest[8 * i : 8 * i + 8], "little") / 2.0**64 >= rate:
            break
        accepted += 1
    return accepted


def draft_layer_model(model: ModelSpec) -> ModelSpec:
    """The drafter as priced and sized here: one decoder layer of the target, with the target's
    shapes (an MoE target's: one MoE layer)."""
    return replace(
        model,
        name=f"{model.name} (one layer)",
        num_layers=1,
        first_dense_layers=0,
        num_sliding_layers=0,
        sliding_window=0,
    )


def draft_layer_weight_bytes(model: ModelSpec, tp: int, dp: int = 1) -> float:
    """One draft layer's weights on one GPU, embedding and LM head excluded (an MTP / EAGLE
    drafter shares the target's: SGLang's ``set_embed_and_head``)."""
    one = draft_layer_model(model)
    embed = model.vocab_size * model.hidden_size * (1 if model.tie_word_embeddings else 2)
    # weight_bytes_per_shard adds the embedding and LM head at dtype_bytes over tp: take them off.
    return one.weight_bytes_per_shard(tp, dp) - embed * model.dtype_bytes / tp


class DrafterCost:
    """Seconds the drafter adds to a step (see the module docstring): k passes of a one-layer
    copy of the target, the first over every token of the step."""

    def __init__(self, cost_model: CostModel, spec: SpecDecoding) -> None:
        self.spec = spec
        self.layer: CostModel | None = None
        if spec.drafter_on_gpu:
            one = draft_layer_model(cost_model.model)
            efficiency = replace(cost_model.efficiency, overhead=0.0)
            cm = cost_model
            self.layer = CostModel(
                one, cm.hardware, cm.tp, efficiency, cm.expert_parallel, cm.dp, cm.all2all, cm.expert_load
            )

    def time(self, shape: BatchShape, num_drafting: int, drafting_kv_tokens: int) -> float:
        """``shape``: the step's target batch; ``num_drafting``: requests that sample (and draft)
        this step; ``drafting_kv_tokens``: their KV tokens after the step."""
        layer = self.layer
        if layer is None or shape.num_tokens == 0:
            return 0.0
        first = layer.iteration_time(
            BatchShape(
                shape.num_tokens,
                num_drafting,
                shape.prefill_pairs,
                shape.prefill_kv_tokens,
                shape.decode_kv_tokens,
                shape.num_prefills,
                shape.num_decodes,
            )
        )
        later = self.spec.num_speculative_tokens - 1
        if not num_drafting or not later:
            return first
        rest = 0.0
        for j in range(later):  # each pass adds one drafted token per request
            rest += layer.iteration_time(
                BatchShape(
                    num_drafting,
                    num_drafting,
                    0,
                    0,
                    drafting_kv_tokens + num_drafting * (j + 1),
                    0,
                    num_drafting,
                )
            )
        return first + rest
