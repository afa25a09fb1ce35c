"""SGLang's speculative decoding as its scheduler sees it (``--speculative-algorithm`` EAGLE /
EAGLE3 / NEXTN, a chain of drafts: ``--speculative-eagle-topk 1``), read from SGLang 0.5.23.

What changes for the scheduler, and nothing else does (the ``PrefillAdder``'s budgets, the
retraction order and ``new_token_ratio`` are the plain ones):

- **Start-up flags** (``arg_groups/speculative_hook.py``): NEXTN is EAGLE under another name
  (:109); ``max_running_requests`` defaults to 48 (:1086-1093); without
  ``speculative_num_steps`` the three sizes are chosen per architecture (:1159-1174,
  ``_auto_choose_speculative_params`` :1430-1461: (3, 1, 4) for DeepSeek-V3 and most models,
  (5, 4, 8) for Llama and Grok, whose top-k 4 tree tailserve does not model); with top-k 1
  ``speculative_num_draft_tokens`` is forced to ``speculative_num_steps + 1`` (:1255-1266).
- **Decode KV** (``mem_cache/allocation_sizing.py:28-70``, ``speculative/eagle_utils.py:857-870``,
  ``allocation_sizing.py:73-93``): before each decode a request's slots grow to ``committed +
  2 x max(steps x topk, draft_tokens)`` (page-aligned; ``committed`` = the KV of its verified
  tokens), the "2x" a double buffer for the overlap scheduler's lag; slots it already holds
  are kept, so a request holds up to 2 x (steps + 1) slots past its verified tokens and a
  decode takes only what the last verification committed. ``check_decode_mem`` asks for the
  same amount (``schedule_batch.py:3421-3430``), so retraction uses it too.
- **A decode step** verifies ``speculative_num_draft_tokens`` tokens per request (the last
  sampled token and ``steps`` drafts) and commits 1 + the accepted drafts
  (``batch_result_processor.py:831``): outputs advance by 1 + accepted.
- Mixed chunks run the running requests as plain one-token decodes (``speculative_hook.py:1104``):
  not modelled here, refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from tailserve.executors.simulated.spec_decode import SpecDecoding, resolve_acceptance_rates

# --speculative-algorithm -> spec_decode.py's drafter (its cost: one decoder layer per draft step).
ALGORITHMS = {"EAGLE": "eagle", "EAGLE3": "eagle3", "NEXTN": "mtp"}
NOT_MODELLED = ("STANDALONE", "NGRAM", "DFLASH", "DSPARK", "UNO")
AUTO_NUM_STEPS, AUTO_TOPK = 3, 1  # _auto_choose_speculative_params' (3, 1, 4)
MAX_RUNNING_REQUESTS = 48  # speculative_hook.py:1086-1093, when the flag is not given
SOURCE = "sglang/srt/arg_groups/speculative_hook.py"


@dataclass(frozen=True, slots=True)
class SglangSpec:
    """A resolved SGLang speculative decoding: the shared acceptance model and drafter
    (``spec.num_speculative_tokens`` = ``speculative_num_steps``) plus SGLang's decode sizes."""

    spec: SpecDecoding
    num_steps: int
    num_draft_tokens: int  # tokens one verification computes: steps + 1

    @property
    def decode_reserve(self) -> int:
        """Slots past the verified tokens a decode makes a request hold
        (``get_alloc_reserve_per_decode``: 2 x max(steps x topk, draft_tokens), topk 1)."""
        return 2 * max(self.num_steps, self.num_draft_tokens)


def check_speculative(
    algorithm: str | None,
    num_steps: int | None,
    topk: int | None,
    num_draft_tokens: int | None,
    rates: tuple[float, ...] | None,
    length: float | None,
    mixed_chunk: bool,
) -> None:
    """One-line ValueErrors for flags SGLang refuses or tailserve does not model."""
    if algorithm is None:
        for name, value in (
            ("speculative_num_steps", num_steps),
            ("speculative_eagle_topk", topk),
            ("speculative_num_draft_tokens", num_draft_tokens),
            ("synthetic_acceptance_rates", rates),
            ("synthetic_acceptance_length", length),
        ):
            if value is not None:
                raise ValueError(f"{name} needs speculative_algorithm (one of {', '.join(ALGORITHMS)})")
        return
    if algorithm not in ALGORITHMS:
        known = ", ".join(ALGORITHMS)
        if algorithm in NOT_MODELLED:
            raise ValueError(f"speculative_algorithm {algorithm} is not modelled; known: {known}")
        raise ValueError(f"speculative_algorithm must be one of {known}, got {algorithm!r}")
    if topk is not None and topk != 1:
        raise ValueError(
            f"speculative_eagle_topk must be 1 (a chain of drafts), got {topk}: tree drafting is not modelled"
        )
    if num_steps is None and num_draft_tokens is not None:
        # speculative_hook.py:1160 asserts both unset when the step count is.
        raise ValueError("speculative_num_draft_tokens needs speculative_num_steps (SGLang asserts it)")
    if num_steps is not None and num_steps < 1:
        raise ValueError(f"speculative_num_steps must be >= 1, got {num_steps}")
    if num_draft_tokens is not None and num_draft_tokens < 1:
        raise ValueError(f"speculative_num_draft_tokens must be >= 1, got {num_draft_tokens}")
    if mixed_chunk:
        raise ValueError(
            "enable_mixed_chunk with speculative decoding is not modelled (SGLang runs the running "
            "requests of a mixed step as plain one-token decodes)"
        )
    resolve_acceptance_rates(num_steps or AUTO_NUM_STEPS, rates, length)


def resolve_speculative(
    algorithm: str | None,
    num_steps: int | None,
    rates: tuple[float, ...] | None,
    length: float | None,
) -> SglangSpec | None:
    """The speculative decoding the flags run (None without); ``check_speculative`` passed."""
    if algorithm is None:
        return None
    steps = num_steps or AUTO_NUM_STEPS
    spec = SpecDecoding(ALGORITHMS[algorithm], steps, resolve_acceptance_rates(steps, rates, length))
    return SglangSpec(spec, steps, steps + 1)


def draft_tokens_note(num_steps: int | None, num_draft_tokens: int | None) -> str | None:
    """SGLang's warning when it overrides the draft-token count (top-k 1), else None."""
    steps = num_steps or AUTO_NUM_STEPS
    if num_draft_tokens is None or num_draft_tokens == steps + 1:
        return None
    return (
        f"sglang: speculative_num_draft_tokens {num_draft_tokens} is adjusted to speculative_num_steps + 1 = "
        f"{steps + 1} when speculative_eagle_topk == 1 ({SOURCE}:1255-1266@v0.5.23)"
    )
