"""Turn one iteration's logits into tokens: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Rules as vLLM applies them: ``temperature`` below 1e-5 is greedy; ``min_tokens`` forbids EOS and
``stop_token_ids`` until that many tokens exist; a request with a ``seed`` draws from its own
generator, so its samples do not depend on what it was batched with; the rest share the
engine's seeded generator.

Whatever the parameters, a row keeps at least its most likely token and never samples from NaN:
the server validates parameters first, but a float32 top_p of 1e-50 is 0 and would mask every
token, and one bad request must not take the engine (and every other request) down with it.
"""

from __future__ import annotations

import torch

from tailserve.core.request import Request
from tailserve.core.sampling_params import GREEDY_EPSILON, SamplingParams
from tailserve.executors.pytorch import cpu_kernels

_DEFAULT_PARAMS = SamplingParams(temperature=0.0)
_SEED_MASK = 2**64 - 1  # torch seeds are uint64; vLLM's int64 seeds map onto them one to one


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...], seed: int, device: torch.device) -> None:
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed & _SEED_MASK)
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """``logits``: [rows, vocab], row i for ``requests[i]``: float32, or the model's bf16/fp16
        as the LM head gives them (greedy rows take their argmax there, the same token as from
        the exact float32 widening; a row that samples is widened first)."""
        params = [r.sampling_params or _DEFAULT_PARAMS for r in requests]
        vocab = logits.shape[-1]
        for i, (request, p) in enumerate(zip(requests, params)):
            if request.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
                banned = [t for t in banned if 0 <= t < vocab]  # ids the model cannot produce anyway
                if banned and len(banned) < vocab:
                    logits[i, banned] = float("-inf")
        # A non-finite logit (a model fault) must not become a NaN probability. The greedy
        # tokens come with the NaN check from one pass; with a NaN they are taken again.
        greedy = [p.temperature < GREEDY_EPSILON for p in params]
        argmax, has_nan = cpu_kernels.argmax_rows_nan(logits)
        if has_nan:
            logits = logits.nan_to_num(nan=float("-inf"))
            if any(greedy):
                argmax = cpu_kernels.argmax_rows(logits)
        tokens = argmax.tolist() if any(greedy) else [0] * len(requests)
        for i, (request, p) in enumerate(zip(requests, params)):
            if not greedy[i]:
                tokens[i] = self._sample_row(logits[i].float(), p, request.request_id)
        return tokens

    def _sample_row(self, row: torch.Tensor, p: SamplingParams, request_id: str) -> int:
        best = int(row.argmax())
        row = row / p.temperature
        if (p.top_k > 0 and p.top_k < row.shape[0]) or p.top_p < 1.0 or p.min_p > 0.0:
            values, indices = row.sort(descending=True)
            if p.top_k > 0:
                values[p.top_k :] = float("-inf")
            probs = values.softmax(-1)
            if p.top_p < 1.0:
                # Keep the smallest prefix whose mass reaches top_p; the first token always stays
                # (a top_p that rounds to 0 in float32 would otherwise drop every token).
                drop = probs.cumsum(-1) - probs >= p.top_p
                drop[0] = False
                values[drop] = float("-inf")
            if p.min_p > 0.0:
                drop = probs < p.min_p * probs[0]
                drop[0] = False
                values[drop] = float("-inf")
            probs = values.softmax(-1)
            if not _usable(probs):
                return best
            choice = torch.multinomial(probs, 1, generator=self._generator(p, request_id))
            return int(indices[choice])
        probs = row.softmax(-1)
        if not _usable(probs):
            return best
        return int(torch.multinomial(probs, 1, generator=self._generator(p, request_id)))

    def _generator(self, p: SamplingParams, request_id: str) -> torch.Generator:
        if p.seed is None:
            return self.generator
        g = self._generators.get(request_id)
        if g is None:
            g = self._generators[request_id] = torch.Generator(device=self.device).manual_seed(
                p.seed & _SEED_MASK
            )
        return g


def _usable(probs: torch.Tensor) -> bool:
    """A distribution ``multinomial`` can draw from: finite and with some mass."""
    return bool(torch.isfinite(probs).all()) and float(probs.sum()) > 0.0
