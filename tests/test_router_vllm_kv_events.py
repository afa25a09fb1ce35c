"""The precise ``kv-aware`` router against vLLM's own KV events.

``tests/fixtures/kv_events/vllm_v1.json`` holds what vLLM V1's scheduler published step by step
(``scripts/record_vllm_kv_events.py``, vLLM's own encoder) while prompts sharing system prompts
were cached, hit and evicted, and after every step vLLM's prefix-cache hit for five probe
prompts. Fed those bytes, the router's view must give the same hits from the events alone,
although vLLM's block hashes are its own and not the router's keys.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tailserve.cluster.routing import RouteRequest, block_keys_from_tokens
from tailserve.router.kv_events import BackendBlocks
from tailserve.server.kv_events import BlockRemoved, BlockStored, decode_batch

FIXTURE = Path(__file__).parent / "fixtures" / "kv_events" / "vllm_v1.json"


def _fixture() -> dict:
    return json.loads(FIXTURE.read_text())


def _vllm_hit_blocks(hit_tokens: int, block_size: int) -> int:
    return hit_tokens // block_size


def test_router_reproduces_vllms_prefix_hits_from_its_events_step_by_step():
    fixture = _fixture()
    block_size = fixture["block_size"]
    probes = [RouteRequest.from_tokens(f"p{i}", p) for i, p in enumerate(fixture["probes"])]
    backend = BackendBlocks()
    seen_eviction = seen_hit = False
    for step in fixture["steps"]:
        for payload in step["payloads"]:
            for event in decode_batch(bytes.fromhex(payload)).events:
                seen_eviction |= isinstance(event, BlockRemoved)
                backend.apply(event)
        for probe, prompt, hit_tokens in zip(probes, fixture["probes"], step["probe_hit_tokens"]):
            ours = backend.overlap(probe)
            # vLLM recomputes a prompt's last token, so a fully cached prompt hits one block less
            cap = (len(prompt) - 1) // block_size
            assert min(ours, cap) == _vllm_hit_blocks(hit_tokens, block_size), (
                step["step"],
                probe.request_id,
            )
            seen_hit |= hit_tokens > 0
    assert seen_eviction and seen_hit
    assert backend.skipped_blocks == 0


def test_vllm_hashes_are_not_router_keys_but_its_tokens_are():
    """Why the router re-keys: vLLM's block hashes never equal the router's keys."""
    fixture = _fixture()
    first = decode_batch(bytes.fromhex(fixture["steps"][0]["payloads"][0])).events[0]
    assert isinstance(first, BlockStored) and first.parent_block_hash is None
    ours = block_keys_from_tokens(first.token_ids, fixture["block_size"])
    assert len(ours) == len(first.block_hashes) and not set(ours) & set(first.block_hashes)


def _stored(hashes, parent, tokens, block_size):
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def test_larger_engine_blocks_give_several_router_keys_and_copies_are_counted():
    tokens = list(range(100, 164))  # 64 tokens: two 32-token engine blocks, four router blocks
    backend = BackendBlocks()
    backend.apply(_stored([b"a" * 32], None, tokens[:32], 32))  # sha256 bytes hashes decode too
    backend.apply(_stored([b"b" * 32], b"a" * 32, tokens[32:], 32))
    backend.apply(_stored([b"b" * 32], b"a" * 32, tokens[32:], 32))  # a second copy
    request = RouteRequest.from_tokens("r", [*tokens, 1, 2, 3])
    assert backend.overlap(request) == 4
    backend.apply(BlockRemoved(block_hashes=[b"b" * 32], medium="GPU"))
    assert backend.overlap(request) == 4  # one copy left
    backend.apply(BlockRemoved(block_hashes=[b"b" * 32], medium="GPU"))
    assert backend.overlap(request) == 2


def test_a_block_whose_parent_was_never_seen_is_skipped_not_misplaced():
    tokens = list(range(200, 232))
    backend = BackendBlocks()
    backend.apply(_stored([7], 6, tokens[16:], 16))  # subscribed after block 6 was stored
    assert backend.skipped_blocks == 1
    assert backend.overlap(RouteRequest.from_tokens("r", tokens)) == 0


@pytest.mark.parametrize("block_size", [24, 8])
def test_engine_blocks_that_are_not_whole_router_blocks_cannot_be_matched(block_size):
    backend = BackendBlocks()
    backend.apply(_stored([1], None, list(range(block_size)), block_size))
    assert backend.overlap(RouteRequest.from_tokens("r", list(range(64)))) is None


def test_tailserve_events_of_other_blocks_cannot_be_matched():
    """Token-less events (tailserve serve's) name the engine's own keys: only 16-token ones match."""
    backend = BackendBlocks()
    backend.apply(_stored([1], None, [], 32))
    assert backend.overlap(RouteRequest.from_tokens("r", list(range(64)))) is None
