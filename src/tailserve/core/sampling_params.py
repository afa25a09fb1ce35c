"""How one request samples and when it stops (vLLM's ``SamplingParams``, the fields we serve)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GREEDY_EPSILON = 1e-5  # temperatures below this are greedy, as in vLLM
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # vLLM takes seeds within int64 (torch.long)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0  # keep tokens with probability >= min_p x the top token's; 0: disabled
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings, not included in the text
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    min_tokens: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}.")
        for name in ("max_tokens", "top_k", "seed", "min_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer, got {value!r}.")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be within int64 [{SEED_MIN}, {SEED_MAX}], got {self.seed}.")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)}."
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty.")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
