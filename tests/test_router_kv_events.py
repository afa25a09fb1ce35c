"""KV events: ``serve`` publishes its block pool's stores and evictions in vLLM's ZeroMQ format,
and ``tailserve router --policy kv-aware --kv-events ...`` learns each backend's cached blocks
from them (Dynamo's precise KV router)."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from router_helpers import running_router, sim_server
from server_helpers import wait_until
from tailserve.cluster.routing import RouteRequest, block_keys_from_tokens
from tailserve.kv.block_pool import HashedBlockPool
from tailserve.kv.prefix import block_hashes
from tailserve.router.kv_events import BackendBlocks
from tailserve.server.kv_events import (
    BlockRemoved,
    BlockStored,
    KvEventsConfig,
    ZmqKvEventPublisher,
    decode_batch,
)
from test_server import micro_model  # noqa: F401  (fixture)

ENGINE_ARGS = {"hardware": "A40", "sim_model": "Llama-3-8B", "max_model_len": 2048}


def test_router_token_keys_are_the_engine_block_keys():
    tokens = list(range(7, 90))
    assert block_keys_from_tokens(tokens, 16) == tuple(block_hashes(tokens, 16))
    assert RouteRequest.from_tokens("r", tokens).token_keys


def test_pool_events_go_out_in_vllm_wire_format():
    pool = HashedBlockPool(4, 2)
    pool.take_events()  # start recording
    keys = block_hashes([1, 2, 3, 4], 2)
    blocks = pool.allocate(2)
    pool.cache_full_blocks(blocks, keys)
    pool.free(blocks)
    pool.allocate(4)  # evicts both cached blocks
    events = pool.take_events()
    assert events == [("stored", keys, None, []), ("removed", keys[::-1])]  # freed tail first, LRU
    config = KvEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*", topic="kv")
    publisher = ZmqKvEventPublisher(config, block_size=2)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv")
    sub.connect(publisher.endpoint)
    try:
        time.sleep(0.3)  # a SUB that has not joined yet misses what is sent (ZeroMQ's slow joiner)
        publisher.publish(events)
        assert sub.poll(5000)
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and seq == (0).to_bytes(8, "big")
        # vLLM's layout: the batch an array [ts, events, dp rank], each event a map tagged with its type
        ts, raw_events, _dp_rank = msgspec.msgpack.decode(payload)
        assert ts > 0 and [e["type"] for e in raw_events] == ["BlockStored", "BlockRemoved"]
        assert raw_events[0]["block_hashes"] == keys and raw_events[0]["block_size"] == 2
        batch = decode_batch(payload)
        assert isinstance(batch.events[0], BlockStored) and isinstance(batch.events[1], BlockRemoved)
    finally:
        sub.close(linger=0)
        context.term()
        publisher.close()


def test_stored_events_carry_tokens_and_each_runs_parent():
    """Blocks another request already cached are not stored again: the newly cached blocks come
    in runs, each one BlockStored with its blocks' tokens and the key of the block before it
    (not the parent of the whole span), so a consumer that rehashes tokens (the router, Dynamo)
    rebuilds exactly the pool's keys."""
    bs = 16
    tokens = list(range(100, 100 + 5 * bs))
    keys = block_hashes(tokens, bs)
    pool = HashedBlockPool(8, bs)
    pool.take_events()  # start recording
    shared = pool.allocate(2)
    pool.cache_full_blocks(shared, keys, token_ids=tokens)  # a shared two-block prefix
    mine = pool.allocate(5)
    pool.cache_full_blocks(mine[:3], keys, token_ids=tokens)  # up to block 2
    pool.cache_full_blocks(mine[3:], keys, keys[2], start=3, token_ids=tokens)  # blocks 3 and 4
    events = pool.take_events()
    assert events == [
        ("stored", keys[:2], None, tokens[: 2 * bs]),
        ("stored", [keys[2]], keys[1], tokens[2 * bs : 3 * bs]),
        ("stored", keys[3:], keys[2], tokens[3 * bs :]),
    ]
    backend = BackendBlocks()
    for _, stored, parent, toks in events:
        backend.apply(BlockStored(stored, parent, toks, bs, None, "GPU", None))
    assert set(backend.keys) == set(keys) and backend.skipped_blocks == 0
    no_tokens = HashedBlockPool(4, bs)
    no_tokens.take_events()
    no_tokens.cache_full_blocks(no_tokens.allocate(2), keys[:2])
    assert no_tokens.take_events() == [("stored", keys[:2], None, [])]  # keyed without tokens


def test_kv_events_config_is_vllms_and_bad_values_are_clear():
    assert KvEventsConfig.parse('{"enable_kv_cache_events": true}').publishes
    assert not KvEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}').publishes
    for text, message in (
        ("[1]", "JSON object"),
        ('{"endpointt": "x"}', "unknown field"),
        ('{"replay_endpoint": "tcp://*:5558"}', "not supported"),
        ("{", "not JSON"),
    ):
        with pytest.raises(ValueError, match=message):
            KvEventsConfig.parse(text)


def _pool_keys(server: Any) -> set[int]:
    pool = server.engine.scheduler.kv_cache.pool
    return {k for b in range(pool.num_blocks) if (k := pool.block_key(b)) is not None}


def test_live_router_learns_each_backends_blocks_from_its_events(micro_model: Path) -> None:  # noqa: F811
    with ExitStack() as stack:
        servers = [
            stack.enter_context(sim_server(str(micro_model), kv_events=True, **ENGINE_ARGS)) for _ in range(2)
        ]
        router = stack.enter_context(
            running_router(
                [s.base_url for s in servers], "kv-aware", kv_endpoints=[s.kv_endpoint for s in servers]
            )
        )
        time.sleep(0.5)  # let the SUB sockets join
        prompt = list(range(100, 100 + 16 * 8 + 5))  # 8 full blocks
        first = httpx.post(
            f"{router.base_url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=30
        )
        assert first.status_code == 200
        chosen = [s.base_url for s in servers].index(first.headers["x-tailserve-backend"])
        index = router.kv_events
        wait_until(lambda: index.blocks[chosen] == _pool_keys(servers[chosen]) != set(), 10)
        assert index.blocks[1 - chosen] == _pool_keys(servers[1 - chosen]) == set()
        request = RouteRequest.from_tokens("again", prompt)
        assert index.overlap(request, chosen) == 8 and index.overlap(request, 1 - chosen) == 0
        text = RouteRequest("text", 10, (1, 2), 16)  # keyed from bytes: the events cannot tell
        assert index.overlap(text, chosen) is None
        again = httpx.post(
            f"{router.base_url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=30
        )
        assert again.headers["x-tailserve-backend"] == first.headers["x-tailserve-backend"]
        hits = httpx.get(f"{servers[chosen].base_url}/metrics").text
        assert "vllm:prefix_cache_hits_total" in hits


def test_router_kv_events_flags_are_checked(capsys):
    from tailserve.cli import main

    argv = ["router", "--backend", "http://127.0.0.1:1", "--kv-events", "tcp://127.0.0.1:5557"]
    assert main(argv) == 2
    assert "--kv-events is for --policy kv-aware" in capsys.readouterr().err
    assert main([*argv, "--policy", "kv-aware", "--backend", "http://127.0.0.1:2"]) == 2
    assert "1 endpoints for 2 backends" in capsys.readouterr().err
