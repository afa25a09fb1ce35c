"""``build_metadata``'s decode part (built from host arrays since r45, its slots and mask by the
CPU kernels' ``decode_slots`` where they load) equals the tensor-op construction it replaced, on mixed batches: tables longer and shorter than the widest context,
contexts at block boundaries, decodes with and without prefill chunks after them."""

import random

import pytest
import torch

from tailserve.executors.pytorch import cpu_kernels
from tailserve.executors.pytorch.attention import build_metadata

CPU = torch.device("cpu")


def reference_decode(tables, contexts, block_size, null_slot):
    """The r44 construction: padded tables through ``torch.tensor``, slots, mask, mapping."""
    offsets = torch.arange(block_size)
    lengths = [c + 1 for c in contexts]
    width = max(lengths)
    num_table = -(-width // block_size)
    padded = [t[:num_table] + [0] * (num_table - len(t[:num_table])) for t in tables]
    bt = torch.tensor(padded, dtype=torch.long)
    slots = (bt[:, :, None] * block_size + offsets).view(len(tables), -1)[:, :width]
    length_t = torch.tensor(lengths)
    valid = torch.arange(width)[None, :] < length_t[:, None]
    mapping = slots.gather(1, (length_t - 1)[:, None]).squeeze(1)
    return torch.where(valid, slots, null_slot), valid[:, None, None, :], length_t, mapping


def _kernels(which):
    if which == "torch":
        return None
    module = cpu_kernels.load()
    if module is None:
        pytest.skip("CPU kernels could not be built here")
    return module


@pytest.mark.parametrize("which", ["torch", "kernel"])
def test_decode_metadata_matches_the_tensor_construction(which):
    kernels = _kernels(which)
    rng = random.Random(0)
    bs, num_blocks = 16, 500
    null = num_blocks * bs
    for trial in range(40):
        nd = rng.randint(1, 70)
        contexts = [rng.choice([0, 15, 16, 17, rng.randint(1, 400)]) for _ in range(nd)]
        tables = []
        for c in contexts:
            need = -(-(c + 1) // bs)
            tables.append(rng.sample(range(num_blocks), need + rng.randint(0, 3)))
        prefills = [(rng.randint(2, 40), rng.choice([0, 16, 33])) for _ in range(trial % 3)]
        ptables = [rng.sample(range(num_blocks), -(-(n + c) // bs)) for n, c in prefills]
        meta = build_metadata(
            tables + ptables,
            [1] * nd + [n for n, _ in prefills],
            contexts + [c for _, c in prefills],
            nd,
            bs,
            null,
            CPU,
            kernels,
        )
        slots, mask, lengths, mapping = reference_decode(tables, contexts, bs, null)
        assert torch.equal(meta.decode_slots, slots)
        assert torch.equal(meta.decode_mask, mask)
        assert torch.equal(meta.decode_lengths, lengths)
        assert meta.decode_slots.dtype == meta.decode_lengths.dtype == meta.slot_mapping.dtype == torch.long
        assert torch.equal(meta.slot_mapping[:nd], mapping)
        expected_tail = []
        for (n, c), t in zip(prefills, ptables):
            expected_tail += [t[p // bs] * bs + p % bs for p in range(c, c + n)]
        assert meta.slot_mapping[nd:].tolist() == expected_tail
        assert [p.start for p in meta.prefills] == [
            nd + sum(n for n, _ in prefills[:i]) for i in range(len(prefills))
        ]
