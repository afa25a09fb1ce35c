"""CUDA-graph padding: a generation-only step runs at the next captured batch size.

TensorRT-LLM 1.2's PyTorch backend (``_torch/pyexecutor/cuda_graph_runner.py``, and
``model_engine.py`` which asks it): a step with no context request may replay a captured CUDA
graph; with ``cuda_graph_config.enable_padding`` the batch is padded up to the smallest captured
batch size that holds it (``CUDAGraphRunner._get_padded_batch``: dummy generation requests from
``kv_cache_manager.add_dummy_requests``, each of ``1 + max_draft_len`` tokens), and a batch
larger than the largest captured size runs eagerly, unpadded. The graph's GEMMs then run over the
padded batch; the dummy requests' own attention (a context of a token or two) is left out here.
With attention DP the ranks agree on one padded size, the largest rank's (the lockstep group:
``cluster/dp_group.py``).

What it prices: ``pad`` adds the dummies to a step's ``BatchShape`` (new tokens, logits and, for
one-token steps, decodes: the counts the GEMMs, the LM head and the MLA decode path read; no KV
tokens). A step with a context request (``is_generation_only``) is not padded.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

from tailserve.core.scheduler_output import SchedulerOutput
from tailserve.executors.simulated.cost_model import BatchShape


@dataclass(frozen=True, slots=True)
class CudaGraphPadding:
    batch_sizes: tuple[int, ...]  # captured batch sizes, ascending
    tokens_per_request: int = 1  # a generation request's tokens per step: 1 + draft tokens

    def __post_init__(self) -> None:
        if not self.batch_sizes or list(self.batch_sizes) != sorted(set(self.batch_sizes)):
            raise ValueError(f"captured batch sizes must be ascending and distinct, got {self.batch_sizes}")
        if self.batch_sizes[0] < 1 or self.tokens_per_request < 1:
            raise ValueError("captured batch sizes and tokens per request must be >= 1")

    def padded_batch(self, num_requests: int) -> int:
        """The batch a generation-only step of ``num_requests`` runs at: the smallest captured
        size that holds it, or itself past the largest (eager, no graph)."""
        i = bisect.bisect_left(self.batch_sizes, num_requests)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else num_requests

    def pad(self, shape: BatchShape, num_requests: int, to: int | None = None) -> BatchShape:
        """``shape`` (a generation-only step of ``num_requests``) with the dummy requests up to
        ``to`` (default ``padded_batch(num_requests)``)."""
        size = self.padded_batch(num_requests) if to is None else to
        pad = size - num_requests
        if pad <= 0:
            return shape
        tokens = pad * self.tokens_per_request
        return replace(
            shape,
            num_tokens=shape.num_tokens + tokens,
            num_logits=shape.num_logits + tokens,
            num_decodes=shape.num_decodes + (pad if self.tokens_per_request == 1 else 0),
        )


def is_generation_only(out: SchedulerOutput) -> bool:
    """No context request in the step (``ScheduledRequests.can_run_cuda_graph``): every
    scheduled request computes one token plus its drafts after its prompt (a context chunk
    starts inside the prompt, or, recomputing a paused request's outputs, is longer)."""
    return bool(out.scheduled) and all(
        s.num_context_tokens >= s.request.prompt_len and s.num_new_tokens == 1 + s.num_spec_tokens
        for s in out.scheduled
    )
