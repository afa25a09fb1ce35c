"""``TorchExecutor``: run one ``SchedulerOutput`` as a single forward pass and sample.

The scheduler decides which blocks each request holds; this executor reads nothing but the
``SchedulerOutput``: each scheduled request's block table (``ScheduledRequest.block_ids``, asked
for by ``needs_block_ids``), into which it stores K/V (``PagedKVCache``) and from which it reads
them back, and the step's swaps as ``(src, dst)`` block pairs, copied before the forward pass
(swap-outs, then swap-ins, the order ``SchedulerOutput`` prescribes). A prefix
hit needs nothing here: the request's table already points at blocks computed earlier, and its
``num_computed_tokens`` says where its new tokens start. A recompute preemption needs nothing
either: the request comes back with ``num_computed_tokens == 0`` and its prompt plus outputs
are prefilled again.
"""

from __future__ import annotations

import time

import torch

from tailserve.core.executor import StepResult
from tailserve.core.request import Request
from tailserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tailserve.executors.pytorch.attention import CpuSwapSpace, PagedKVCache, build_metadata
from tailserve.executors.pytorch.model import LlamaModel
from tailserve.executors.pytorch.sampler import Sampler
from tailserve.executors.pytorch.threads import ThreadController


def token_at(request: Request, position: int) -> int:
    if position < request.prompt_len:
        return request.prompt_token_ids[position]  # type: ignore[index]
    return request.output_token_ids[position - request.prompt_len]


class TorchExecutor:
    needs_block_ids = True

    def __init__(
        self,
        model: LlamaModel,
        kv: PagedKVCache,
        sampler: Sampler,
        swap_space: CpuSwapSpace | None = None,
        threads: ThreadController | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.sampler = sampler
        self.swap_space = swap_space
        self.device = model.device
        # CPU intra-op threads, revisited between steps (None: torch's setting, e.g. on CUDA).
        self.threads = threads

    def execute(self, out: SchedulerOutput) -> StepResult:
        t0 = time.perf_counter()
        if self.threads is not None:
            self.threads.tick()
        self._copy_swapped(out)
        items = [s for s in out.scheduled if s.num_new_tokens == 1]
        num_decodes = len(items)
        items += [s for s in out.scheduled if s.num_new_tokens > 1]
        if not items:
            return StepResult(time.perf_counter() - t0, {})
        input_ids: list[int] = []
        positions: list[int] = []
        for s in items:
            request, c, n = s.request, s.num_context_tokens, s.num_new_tokens
            if n == 1:
                input_ids.append(token_at(request, c))
            else:
                input_ids.extend(_tokens(request, c, c + n))
            positions.extend(range(c, c + n))
        meta = build_metadata(
            [s.block_ids for s in items],
            [s.num_new_tokens for s in items],
            [s.num_context_tokens for s in items],
            num_decodes,
            self.kv.block_size,
            self.kv.null_slot,
            self.device,
        )
        rows, sampling = self._sampling_rows(items)
        with torch.inference_mode():
            ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
            pos = torch.tensor(positions, dtype=torch.long, device=self.device)
            hidden = self.model.forward(ids, pos, meta, self.kv)
            token_ids: dict[str, int] = {}
            if rows:
                logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
                tokens = self.sampler.sample(logits, sampling)  # .tolist() waits for the device
                token_ids = {r.request_id: t for r, t in zip(sampling, tokens)}
        return StepResult(time.perf_counter() - t0, token_ids)

    @staticmethod
    def _sampling_rows(items: list[ScheduledRequest]) -> tuple[list[int], list[Request]]:
        """Rows of the flattened batch whose request samples this iteration: the last token of
        a grant that completes the request's known tokens (a partial prefill chunk samples nothing)."""
        rows: list[int] = []
        requests: list[Request] = []
        start = 0
        for s in items:
            start += s.num_new_tokens
            request = s.request
            if s.num_context_tokens + s.num_new_tokens == request.num_tokens:
                rows.append(start - 1)
                requests.append(request)
        return rows, requests

    def _copy_swapped(self, out: SchedulerOutput) -> None:
        if not out.blocks_to_swap_out and not out.blocks_to_swap_in:
            return
        if self.swap_space is None:
            raise RuntimeError("the scheduler swapped KV blocks but the executor has no CPU swap space")
        if out.blocks_to_swap_out:
            gpu, cpu = zip(*out.blocks_to_swap_out)
            self.swap_space.copy_blocks(self.kv, list(gpu), list(cpu))
        if out.blocks_to_swap_in:
            cpu, gpu = zip(*out.blocks_to_swap_in)
            self.kv.copy_blocks(self.swap_space, list(cpu), list(gpu))

    def warm_up(self, num_tokens: int = 16) -> None:
        """One prefill and one decode through block 0, so the first real request does not pay
        for kernel selection and allocator growth. Harmless: every position a request reads is
        written first."""
        n = min(
            num_tokens,
            self.kv.block_size * max(1, num_tokens // self.kv.block_size),
            self.model.rope.max_positions - 1,
        )
        table = [0] * (-(-(n + 1) // self.kv.block_size))
        with torch.inference_mode():
            for new, ctx, decodes in ((n, 0, 0), (1, n, 1)):
                meta = build_metadata(
                    [table], [new], [ctx], decodes, self.kv.block_size, self.kv.null_slot, self.device
                )
                ids = torch.ones(new, dtype=torch.long, device=self.device)
                pos = torch.arange(ctx, ctx + new, device=self.device)
                self.model.compute_logits(self.model.forward(ids, pos, meta, self.kv)[-1:])

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)


def _tokens(request: Request, first: int, last: int) -> list[int]:
    """Token ids of positions [first, last): prompt, then outputs (a recompute re-reads both)."""
    prompt = request.prompt_token_ids or []
    if last <= request.prompt_len:
        return prompt[first:last]
    return (prompt + request.output_token_ids)[first:last]
