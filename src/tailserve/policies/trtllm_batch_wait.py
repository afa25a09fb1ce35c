"""TensorRT-LLM 1.2's batch waiting: contexts held back to let a bigger prefill batch gather
(``batch_wait_timeout_iters``, ``batch_wait_max_tokens_ratio``; ``TorchLlmArgs``, "prototype").

Read in ``tensorrt_llm/_torch/pyexecutor/py_executor.py`` of the 1.2 line (``PyExecutor._schedule``
and ``_waiting_requests``, beside ``_balance_adp_requests``). After the capacity and micro-batch
schedulers built the step, and only without attention DP, when the step has both contexts and
generation requests ("if no generation requests, no need to wait, to avoid dead waiting"):

- the step's tokens are counted as every scheduled context's *whole* token list
  (``len(get_tokens(0))``: its prompt, outputs folded in after a pause, not the chunk it runs)
  plus ``1 + drafts`` per generation request;
- the contexts run (and the counter resets) once the counter has reached
  ``batch_wait_timeout_iters`` or the tokens reach ``batch_wait_max_tokens_ratio x
  max_num_tokens``; otherwise they are held this step (they stay active, unscheduled, as the
  attention-DP hold leaves them) and the counter counts up.

Both tests are ``>=``: with ``batch_wait_timeout_iters`` 0 the first always passes and with
``batch_wait_max_tokens_ratio`` 0 the second does, so the feature holds anything only with
both above 0 (``lint`` says so). Later TensorRT-LLM (NVIDIA/TensorRT-LLM#12501, 2026-03) counts a
first chunk's tokens less its reusable prefix, and #12658 the chunks; 1.2 does neither.
``batch_wait_timeout_ms`` (how long the request fetch waits for ``max_batch_size`` requests) is
the engine's (``Engine._fetched``, ``TrtllmPolicy.fetch_wait``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tailserve.policies.trtllm_microbatch import MicroBatch


@dataclass(slots=True)
class BatchWait:
    timeout_iters: int
    max_tokens: float  # batch_wait_max_tokens_ratio x max_num_tokens
    count: int = 0  # batch_wait_iters_count: steps held since the contexts last ran

    def holds(self, batch: MicroBatch, num_drafts: int) -> bool:
        """``_waiting_requests`` for a step with contexts and generation requests: True holds
        the contexts back this step."""
        tokens = sum([request.num_tokens for request, _ in batch.contexts])
        tokens += (1 + num_drafts) * len(batch.generations)
        if self.count >= self.timeout_iters or tokens >= self.max_tokens:
            self.count = 0
            return False
        self.count += 1
        return True
