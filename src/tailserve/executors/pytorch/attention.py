"""Paged attention in plain PyTorch: KV tensors addressed by the block tables the scheduler's
``KVCacheManager`` hands out, and ``scaled_dot_product_attention`` over gathered context.

One forward pass runs a whole ``SchedulerOutput``. Its tokens are flattened: every decode (one
new token attending to its whole cached context) first, then each prefill chunk (several new
tokens attending causally to themselves and to everything cached before them — earlier chunks
and prefix-cache hits alike). Token ``p`` of a request lives in slot
``table[p // block_size] * block_size + p % block_size``; new tokens' K/V are written to their
slots before attention reads, so a chunk sees itself through the same path as its context.

The device's operations come from a ``Backend`` (``backend.py``): storing K/V, decode attention
(a fused kernel on CPU; one batched SDPA call over context gathered to [batch, max_context]
elsewhere, padding pointing at a zeroed spare block and masked out) and, where it has one, a
kernel for every prefill chunk at once. Otherwise each prefill chunk gets its own SDPA call, with
``is_causal`` when nothing is cached before it.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import torch
import torch.nn.functional as F

from tailserve.executors.pytorch import resident
from tailserve.executors.pytorch.backend import TorchBackend, backend_for


class PagedKVCache:
    """K and V for every layer: [num_blocks + 1, block_size, num_kv_heads, head_dim] each. The
    extra last block is never handed out; it stays zero and backs the padding of gathers."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
        # ``empty``: nothing reads a slot before a request's K/V is stored there (decodes read
        # ``lengths`` slots, masked and padded ones point at the spare block), so zeroing the
        # whole cache only cost start-up time (2 GiB by default on CPU, seconds on a loaded
        # machine, a page fault per 4 KiB). On CPU the engine backs the pages in one call instead
        # (``populate``). The spare block (the null slot) must read as zeros: it alone is cleared.
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for t in (*self.k, *self.v):
            t[num_blocks].zero_()
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.null_slot = num_blocks * block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def populate(self) -> bool:
        """Back every page of a CPU cache now (``resident.populate``; the values do not change),
        so that serving's first writes to each block pay no page faults. The engine does this
        when it is built, as vLLM's ``torch.zeros`` cache is backed at start-up; False where the
        pages stay backed on first use (not Linux, a kernel before 5.14, a CUDA cache)."""
        return all([resident.populate(t) for t in (*self.k, *self.v)])

    def slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as [slots, num_kv_heads, head_dim] views."""
        h, d = self.num_kv_heads, self.head_dim
        return self.k[layer].view(-1, h, d), self.v[layer].view(-1, h, d)

    def copy_blocks(
        self, src: PagedKVCache | CpuSwapSpace, src_blocks: list[int], dst_blocks: list[int]
    ) -> None:
        """Copy whole blocks from another store (swap in), layer by layer."""
        s = torch.tensor(src_blocks, dtype=torch.long, device=src.k[0].device)
        d = torch.tensor(dst_blocks, dtype=torch.long, device=self.k[0].device)
        for layer in range(len(self.k)):
            self.k[layer].index_copy_(0, d, src.k[layer].index_select(0, s).to(self.k[layer].device))
            self.v[layer].index_copy_(0, d, src.v[layer].index_select(0, s).to(self.v[layer].device))


class CpuSwapSpace:
    """Host memory for swapped-out blocks (vLLM V0 ``--swap-space``), same block layout."""

    def __init__(self, num_layers: int, num_blocks: int, like: PagedKVCache) -> None:
        shape = (max(num_blocks, 1), like.block_size, like.num_kv_heads, like.head_dim)
        dtype = like.k[0].dtype
        pin = like.k[0].is_cuda
        self.k = [torch.empty(shape, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]

    def copy_blocks(self, src: PagedKVCache, src_blocks: list[int], dst_blocks: list[int]) -> None:
        s = torch.tensor(src_blocks, dtype=torch.long, device=src.k[0].device)
        d = torch.tensor(dst_blocks, dtype=torch.long)
        for layer in range(len(self.k)):
            self.k[layer].index_copy_(0, d, src.k[layer].index_select(0, s).cpu())
            self.v[layer].index_copy_(0, d, src.v[layer].index_select(0, s).cpu())


@dataclass(slots=True)
class PrefillChunk:
    start: int  # index of its first token in the flattened batch
    num_new_tokens: int
    num_context_tokens: int  # tokens cached before this chunk
    context_slots: torch.Tensor | None  # [num_context_tokens] slots of the cached context
    mask: torch.Tensor | None  # [new, context + new] bool; None: causal with no context
    slots: torch.Tensor | None = None  # [context + new] every slot the chunk attends over


@dataclass(slots=True)
class PrefillKernelInputs:
    """The prefill chunks as the CPU prefill kernel reads them; built once per iteration, on
    first use."""

    slots: torch.Tensor  # [num_chunks, longest context + new] long, padded with the null slot
    starts: torch.Tensor  # [num_chunks] long: each chunk's first row among the prefill tokens
    news: torch.Tensor  # [num_chunks] long: its new tokens
    contexts: torch.Tensor  # [num_chunks] long: its tokens cached before it


@dataclass(slots=True)
class AttentionMetadata:
    """Where each new token's K/V goes and what each query attends to, for one iteration."""

    slot_mapping: torch.Tensor  # [num_tokens] long
    num_decodes: int  # the first ``num_decodes`` tokens are single-token decodes
    decode_slots: torch.Tensor | None  # [num_decodes, max_context] long, padded with the null slot
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_context] bool, True = attend
    decode_lengths: torch.Tensor | None  # [num_decodes] long, context + 1 per decode
    prefills: list[PrefillChunk]
    null_slot: int = -1
    prefill_kernel: PrefillKernelInputs | None = None  # see ``prefill_kernel_inputs``


def prefill_kernel_inputs(meta: AttentionMetadata) -> PrefillKernelInputs:
    if meta.prefill_kernel is None:
        chunks = meta.prefills
        width = max(c.num_context_tokens + c.num_new_tokens for c in chunks)
        slots = torch.full((len(chunks), width), meta.null_slot, dtype=torch.long)
        for i, c in enumerate(chunks):
            slots[i, : c.slots.numel()] = c.slots
        news = torch.tensor([c.num_new_tokens for c in chunks])
        starts = torch.cumsum(news, 0) - news
        contexts = torch.tensor([c.num_context_tokens for c in chunks])
        meta.prefill_kernel = PrefillKernelInputs(slots, starts, news, contexts)
    return meta.prefill_kernel


def build_metadata(
    block_tables: list[list[int]],
    num_new_tokens: list[int],
    num_context_tokens: list[int],
    num_decodes: int,
    block_size: int,
    null_slot: int,
    device: torch.device,
    kernels: Any | None = None,
) -> AttentionMetadata:
    """Requests in flattened order (decodes first); each table covers its context + new tokens.
    ``kernels``: the CPU kernels (``cpu_kernels.load()``), whose ``decode_slots`` builds the
    decode slots and mask in one pass; None (or a build without it): PyTorch's ops."""
    offsets = torch.arange(block_size)
    slot_mapping: list[torch.Tensor] = []
    prefills: list[PrefillChunk] = []
    for i in range(num_decodes, len(block_tables)):
        table, n, c = block_tables[i], num_new_tokens[i], num_context_tokens[i]
        total = c + n
        blocks = torch.tensor(table[: -(-total // block_size)], dtype=torch.long)
        slots = (blocks[:, None] * block_size + offsets).flatten()
        slot_mapping_part = slots[c:total]
        if c == 0:
            prefills.append(PrefillChunk(0, n, 0, None, None, slots[:total]))
        else:
            q_pos = torch.arange(c, total, device=device)[:, None]
            k_pos = torch.arange(total, device=device)[None, :]
            prefills.append(PrefillChunk(0, n, c, slots[:c].to(device), k_pos <= q_pos, slots[:total]))
        slot_mapping.append(slot_mapping_part)
    decode_slots = decode_mask = length_t = None
    decode_mapping = torch.empty(0, dtype=torch.long)
    if num_decodes:
        # Host lists go to tensors through ``array`` (torch.frombuffer): ``torch.tensor`` of a
        # decode batch's 64 x 21 table entries took ~180 us, boxing each int, the array ~50
        # (2-core EPYC, another job running).
        contexts = num_context_tokens[:num_decodes]
        width = max(contexts) + 1
        num_table = -(-width // block_size)
        table = array("q")
        mapping_list = array("q")
        for t, c in zip(block_tables, contexts):
            row = t[:num_table]
            table.extend(row)
            if len(row) < num_table:
                table.extend(repeat(0, num_table - len(row)))
            mapping_list.append(t[c // block_size] * block_size + c % block_size)
        bt = torch.frombuffer(table, dtype=torch.long).view(num_decodes, num_table)
        context_t = torch.frombuffer(array("q", contexts), dtype=torch.long)
        length_t = context_t + 1
        if kernels is not None and hasattr(kernels, "decode_slots"):
            slots, valid = kernels.decode_slots(bt, context_t, block_size, width, null_slot)
        else:
            slots = (bt[:, :, None] * block_size + offsets).view(num_decodes, -1)[:, :width]
            valid = torch.arange(width)[None, :] < length_t[:, None]
            slots = torch.where(valid, slots, null_slot)
        decode_slots = slots.to(device)
        decode_mask = valid[:, None, None, :].to(device)
        decode_mapping = torch.frombuffer(mapping_list, dtype=torch.long)
    # Prefill chunks follow the decodes in the flattened batch.
    start = num_decodes
    for chunk in prefills:
        chunk.start = start
        start += chunk.num_new_tokens
    mapping = torch.cat([decode_mapping, *slot_mapping]) if slot_mapping else decode_mapping
    return AttentionMetadata(
        mapping.to(device), num_decodes, decode_slots, decode_mask, length_t, prefills, null_slot
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    meta: AttentionMetadata,
    backend: TorchBackend | None = None,
) -> torch.Tensor:
    """``q``: [tokens, heads, dim]; ``k``/``v``: [tokens, kv_heads, dim] for the new tokens;
    ``k_slots``/``v_slots``: the layer's cache as [slots, kv_heads, dim]. Returns [tokens, heads, dim].
    ``backend``: the device's operations (default: ``backend_for(q.device)``)."""
    backend = backend_for(q.device) if backend is None else backend
    backend.store_kv(k_slots, v_slots, k, v, meta.slot_mapping)
    nd = meta.num_decodes
    if not meta.prefills:
        return backend.decode_attention(q, k_slots, v_slots, meta)  # decode-only: no joint output
    fused = backend.prefill_attention(q[nd:], k_slots, v_slots, meta)
    if fused is not None and not nd:
        return fused  # a prefill-only iteration: no joint output to copy into
    out = torch.empty_like(q)
    if nd:
        out[:nd] = backend.decode_attention(q[:nd], k_slots, v_slots, meta)
    if fused is not None:
        out[nd:] = fused
        return out
    for chunk in meta.prefills:
        s, n = chunk.start, chunk.num_new_tokens
        query = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]
        if chunk.context_slots is None:
            keys = k[s : s + n]
            values = v[s : s + n]
        else:
            keys = torch.cat((k_slots.index_select(0, chunk.context_slots), k[s : s + n]))
            values = torch.cat((v_slots.index_select(0, chunk.context_slots), v[s : s + n]))
        keys = keys.transpose(0, 1).unsqueeze(0)
        values = values.transpose(0, 1).unsqueeze(0)
        if chunk.mask is None:
            res = F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=True)
        else:
            res = F.scaled_dot_product_attention(query, keys, values, attn_mask=chunk.mask, enable_gqa=True)
        out[s : s + n] = res.squeeze(0).transpose(0, 1)
    return out


def _decode_attention(
    q: torch.Tensor,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    meta: AttentionMetadata,
    backend: TorchBackend | None = None,
) -> torch.Tensor:
    """One query token per request over its context, through ``backend`` (default: the
    device's; on CPU the fused kernel reads K/V straight from their slots, without it the
    context is gathered first)."""
    backend = backend_for(q.device) if backend is None else backend
    return backend.decode_attention(q, k_slots, v_slots, meta)
