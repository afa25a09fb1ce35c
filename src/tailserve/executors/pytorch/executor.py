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

Padding (``SchedulerOutput.padding``, static batching) is computed like a request, as Hugging
Face's padded ``generate`` computes it: a pad slot's tokens run through every layer, attend over
its context (read from the spare zero block, so no real request's KV is touched) and get LM-head
logits, which nobody samples. Its K/V go to the spare block, which is zeroed again after the
step. So the real executor does the work the simulator prices for the same ``SchedulerOutput``.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass

import torch

from tailserve.core.executor import StepResult
from tailserve.core.request import Request
from tailserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tailserve.executors.pytorch.attention import CpuSwapSpace, PagedKVCache, build_metadata
from tailserve.executors.pytorch.model import LlamaModel
from tailserve.executors.pytorch.sampler import Sampler
from tailserve.executors.pytorch.thread_policy import step_shape
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
        if self.threads is None:
            return self._execute(out, t0)
        self.threads.begin_step()  # the thread count, and pinning (threads.py)
        shape = None
        try:
            result = self._execute(out, t0)
            # The step's time at its shape: how the thread count's upward probe is judged (a
            # fixed count records nothing: no shape to build).
            if self.threads.adaptive:
                shape = step_shape(
                    [s.num_new_tokens for s in out.scheduled] + [p.num_new_tokens for p in out.padding],
                    [s.num_context_tokens for s in out.scheduled]
                    + [p.num_context_tokens for p in out.padding],
                )
            return result
        finally:
            self.threads.end_step(shape)

    def _execute(self, out: SchedulerOutput, t0: float) -> StepResult:
        self._copy_swapped(out)
        # Decodes (one new token, real or padding) first: the layout build_metadata expects.
        decodes: list[_Row] = []
        longer: list[_Row] = []
        for s in out.scheduled:
            (decodes if s.num_new_tokens == 1 else longer).append(_Row.of(s))
        for p in out.padding:
            (decodes if p.num_new_tokens == 1 else longer).append(
                self._pad_row(p.num_new_tokens, p.num_context_tokens)
            )
        rows = decodes + longer if longer else decodes
        if not rows:
            return StepResult(time.perf_counter() - t0, {})
        num_decodes = len(decodes)
        input_ids = array("q", [t for r in rows for t in r.token_ids])
        positions = array("q", [p for r in rows for p in r.positions])
        # Rows that sample, then padding's last rows (logits computed, never sampled).
        sample_rows, sampling, pad_rows = _logit_rows(rows)
        logit_rows = sample_rows + pad_rows
        # Inference mode from here: the metadata's tensor ops skip autograd's bookkeeping too.
        with torch.inference_mode():
            meta = build_metadata(
                [r.block_ids for r in rows],
                [r.num_new_tokens for r in rows],
                [r.num_context_tokens for r in rows],
                num_decodes,
                self.kv.block_size,
                self.kv.null_slot,
                self.device,
                getattr(self.model.backend, "kernels", None),  # the CPU's: decode_slots
            )
            # Through ``array``: torch.tensor boxes each int (~6-10 us for 64 of them).
            ids = torch.frombuffer(input_ids, dtype=torch.long).to(self.device)
            pos = torch.frombuffer(positions, dtype=torch.long).to(self.device)
            # Every row in order (a decode step): no index, so the model keeps its rows instead
            # of copying them (two row gathers at the last layer, the same values).
            index = None
            if len(logit_rows) != len(input_ids) or logit_rows != list(range(len(input_ids))):
                index = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
            hidden = self.model.forward(ids, pos, meta, self.kv, out_rows=index)
            token_ids: dict[str, int] = {}
            if sample_rows or pad_rows:
                logits = self.model.logits(hidden)  # model dtype: the sampler widens what it must
                if sampling:
                    tokens = self.sampler.sample(logits[: len(sample_rows)], sampling)  # waits for the device
                    token_ids = {r.request_id: t for r, t in zip(sampling, tokens)}
            if out.padding:
                self._clear_spare_block()
        return StepResult(time.perf_counter() - t0, token_ids)

    def _pad_row(self, num_new_tokens: int, num_context_tokens: int) -> _Row:
        """A padding slot as a row over the spare block: every table entry is that block, so its
        context gather reads zeros and its K/V writes land there. Positions past the RoPE table
        (a padded row can outgrow the longest real request) are clamped: nobody reads them."""
        bs = self.kv.block_size
        total = num_context_tokens + num_new_tokens
        last = self.model.rope.max_positions - 1
        positions = [min(p, last) for p in range(num_context_tokens, total)]
        return _Row(
            [self.kv.num_blocks] * -(-total // bs), num_new_tokens, num_context_tokens,
            [PAD_TOKEN_ID] * num_new_tokens, positions, None,
        )  # fmt: skip

    def _clear_spare_block(self) -> None:
        """The spare block backs masked gathers and must read as zeros; padding wrote into it."""
        for k, v in zip(self.kv.k, self.kv.v):
            k[self.kv.num_blocks].zero_()
            v[self.kv.num_blocks].zero_()

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
                last = torch.tensor([new - 1], device=self.device)
                self.model.compute_logits(self.model.forward(ids, pos, meta, self.kv, out_rows=last))

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)


PAD_TOKEN_ID = 0  # what a padding slot feeds the model; its output is discarded


@dataclass(slots=True)
class _Row:
    """One sequence of the flattened batch: a scheduled request or a padding slot."""

    block_ids: list[int]
    num_new_tokens: int
    num_context_tokens: int
    token_ids: list[int]
    positions: list[int]
    request: Request | None  # None: padding

    @staticmethod
    def of(s: ScheduledRequest) -> _Row:
        c, n, r = s.num_context_tokens, s.num_new_tokens, s.request
        if n == 1:  # a decode (64 a step at batch 64): no range to build
            return _Row(s.block_ids, 1, c, [token_at(r, c)], [c], r)
        return _Row(s.block_ids, n, c, _tokens(r, c, c + n), list(range(c, c + n)), r)


def _logit_rows(rows: list[_Row]) -> tuple[list[int], list[Request], list[int]]:
    """Flattened-batch rows whose request samples this iteration (the last token of a grant that
    completes the request's known tokens; a partial prefill chunk samples nothing), those
    requests, and the last row of each padding slot (a padded batch computes its logits too)."""
    sample_rows: list[int] = []
    requests: list[Request] = []
    pad_rows: list[int] = []
    end = 0
    for r in rows:
        end += r.num_new_tokens
        if r.request is None:
            pad_rows.append(end - 1)
        elif r.num_context_tokens + r.num_new_tokens == r.request.num_tokens:
            sample_rows.append(end - 1)
            requests.append(r.request)
    return sample_rows, requests, pad_rows


def _tokens(request: Request, first: int, last: int) -> list[int]:
    """Token ids of positions [first, last): prompt, then outputs (a recompute re-reads both)."""
    prompt = request.prompt_token_ids or []
    if last <= request.prompt_len:
        return prompt[first:last]
    return (prompt + request.output_token_ids)[first:last]
