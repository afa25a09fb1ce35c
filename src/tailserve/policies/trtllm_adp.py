"""TensorRT-LLM 1.2's attention-DP rules: where a new request goes, and when contexts are held.

Both run in every attention-DP rank on numbers all-gathered from all of them, so every rank
takes the same decision; here they run once for the group (``cluster/adp_stage.py``).

Placement (``executor_request_queue.py`` of the 1.2 line, ``_fetch_new_requests_attention_dp``,
``_schedule_attention_dp_requests``, ``_balance_requests_across_ranks``): each iteration, before
scheduling, the ranks all-gather their active request counts and the summed original prompt
lengths of their active requests. One shared FCFS waiting queue gives up to
``ranks x max_num_active_requests - total active`` requests (``max_num_active_requests`` =
``max_batch_size`` without pipeline stages). A target ``expected = max(ceil((active + new) /
ranks), max(active per rank))`` caps each rank; the new requests, longest prompt first, go one
by one to the rank with the fewest active prompt tokens (then fewest requests, then lowest
rank) among those still under the target. A request stays on its rank until it finishes.
(``attention_dp_rank`` pinning from ``scheduling_params`` is not modelled: tailserve's requests
carry none.)

Balancing (``attention_dp_config.enable_balance``; ``py_executor.py`` of the 1.2 line,
``PyExecutor._balance_adp_requests``, called from ``_schedule`` after the capacity and
micro-batch schedulers): the ranks all-gather their scheduled context and generation counts.
- Every rank has a scheduled context and fewer than ``max_batch_size`` generations: the
  waiting counter resets; if every rank also has a generation, the contexts are held while the
  batching counter is below ``batching_wait_iters`` (it counts up), then run (it resets). With a
  rank without generations they run at once.
- Otherwise the contexts are held and the waiting counter counts up; they run (and it resets)
  once it reaches ``timeout_iters``, or at once when some rank has no generation.
A held context stays in its rank's active list, unscheduled; generations run as usual. A rank
with no active request runs a dummy generation request (``_pad_attention_dp_dummy_request``)
when the group has any, so it counts one generation and no context.
``AttentionDpConfig`` (``llmapi/llm_args.py`` of the 1.2 line): ``enable_balance`` false,
``timeout_iters`` 50, ``batching_wait_iters`` 10.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

DEFAULT_TIMEOUT_ITERS = 50  # AttentionDpConfig.timeout_iters
DEFAULT_BATCHING_WAIT_ITERS = 10  # AttentionDpConfig.batching_wait_iters


@dataclass(frozen=True, slots=True)
class RankLoad:
    """One rank's active requests as the placement all-gather reports them."""

    num_active: int  # requests fetched onto the rank and not finished
    num_active_tokens: int  # their original prompt lengths, summed (py_orig_prompt_len)


def num_to_fetch(loads: list[RankLoad], max_num_active: int) -> int:
    """How many requests the shared waiting queue gives this iteration (FCFS)."""
    return max(0, len(loads) * max_num_active - sum(load.num_active for load in loads))


def place_requests(prompt_lens: list[int], loads: list[RankLoad]) -> list[int]:
    """The rank of each new request (same order as ``prompt_lens``), by TensorRT-LLM's heap rule."""
    if not prompt_lens:
        return []
    ranks = len(loads)
    total = sum(load.num_active for load in loads)
    expected = max(-(-(total + len(prompt_lens)) // ranks), max(load.num_active for load in loads))
    heap = [(load.num_active_tokens, load.num_active, rank) for rank, load in enumerate(loads)]
    heap = [entry for entry in heap if entry[1] < expected]
    heapq.heapify(heap)
    placed = [0] * len(prompt_lens)
    # Longest prompt first; sorted() is stable, so equal lengths keep their queue order.
    for i in sorted(range(len(prompt_lens)), key=lambda i: -prompt_lens[i]):
        tokens, count, rank = heapq.heappop(heap)
        placed[i] = rank
        if count + 1 < expected:
            heapq.heappush(heap, (tokens + prompt_lens[i], count + 1, rank))
    return placed


@dataclass(frozen=True, slots=True)
class StepCounts:
    """One rank's scheduled batch as the balancing all-gather reports it."""

    num_context: int
    num_generation: int


@dataclass(slots=True)
class AdpBalance:
    """``_balance_adp_requests``'s two counters and rule (module docstring)."""

    timeout_iters: int = DEFAULT_TIMEOUT_ITERS
    batching_wait_iters: int = DEFAULT_BATCHING_WAIT_ITERS
    max_batch_size: int = 2048
    waiting_iters: int = field(default=0)  # adp_ctx_waiting_iters_count
    batching_iters: int = field(default=0)  # adp_ctx_batching_wait_iters_count

    def hold_contexts(self, counts: list[StepCounts]) -> bool:
        """True when this iteration's scheduled contexts wait (every rank's alike)."""
        free_slots = all(c.num_generation < self.max_batch_size for c in counts)
        all_context = all(c.num_context > 0 for c in counts)
        all_generation = all(c.num_generation > 0 for c in counts)
        if free_slots and all_context:
            self.waiting_iters = 0
            if not all_generation:
                return False
            if self.batching_iters < self.batching_wait_iters:
                self.batching_iters += 1
                return True
            self.batching_iters = 0
            return False
        self.waiting_iters += 1
        if self.waiting_iters >= self.timeout_iters or not all_generation:
            self.waiting_iters = 0
            return False
        return True
