"""Turn one iteration's logits into tokens: greedy, temperature, top-k, top-p, per-request seeds.

Rules as vLLM applies them: ``temperature`` below 1e-5 is greedy; ``min_tokens`` forbids EOS and
``stop_token_ids`` until that many tokens exist; a request with a ``seed`` draws from its own
generator, so its samples do not depend on what it was batched with; the rest share the
engine's seeded generator.
"""

from __future__ import annotations

import torch

from tailserve.core.request import Request
from tailserve.llm.sampling_params import GREEDY_EPSILON, SamplingParams

_DEFAULT_PARAMS = SamplingParams(temperature=0.0)


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...], seed: int, device: torch.device) -> None:
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """``logits``: float32 [rows, vocab], row i for ``requests[i]``."""
        params = [r.sampling_params or _DEFAULT_PARAMS for r in requests]
        for i, (request, p) in enumerate(zip(requests, params)):
            if request.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
                if banned:
                    logits[i, banned] = float("-inf")
        greedy = [p.temperature < GREEDY_EPSILON for p in params]
        tokens = logits.argmax(dim=-1).tolist() if any(greedy) else [0] * len(requests)
        for i, (request, p) in enumerate(zip(requests, params)):
            if not greedy[i]:
                tokens[i] = self._sample_row(logits[i], p, request.request_id)
        return tokens

    def _sample_row(self, row: torch.Tensor, p: SamplingParams, request_id: str) -> int:
        row = row / p.temperature
        if (p.top_k > 0 and p.top_k < row.shape[0]) or p.top_p < 1.0:
            values, indices = row.sort(descending=True)
            if p.top_k > 0:
                values[p.top_k :] = float("-inf")
            if p.top_p < 1.0:
                probs = values.softmax(-1)
                # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
                drop = probs.cumsum(-1) - probs >= p.top_p
                values[drop] = float("-inf")
            probs = values.softmax(-1)
            choice = torch.multinomial(probs, 1, generator=self._generator(p, request_id))
            return int(indices[choice])
        probs = row.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self._generator(p, request_id)))

    def _generator(self, p: SamplingParams, request_id: str) -> torch.Generator:
        if p.seed is None:
            return self.generator
        g = self._generators.get(request_id)
        if g is None:
            g = self._generators[request_id] = torch.Generator(device=self.device).manual_seed(p.seed)
        return g
