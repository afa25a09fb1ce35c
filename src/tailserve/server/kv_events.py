"""KV events in vLLM's format (``vllm/distributed/kv_events.py``), published over ZeroMQ.

With ``serve --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq"}'`` the
engine's hashed block pool (vLLM's prefix caching) reports the blocks it caches and evicts, and
after each engine step the server publishes them as one ``KVEventBatch`` on a PUB socket:
three frames, ``topic``, an 8-byte big-endian sequence number, and the msgpack batch — what
vLLM sends and what Dynamo's and llm-d's KV indexers (and ``tailserve router``) subscribe to.

``BlockStored`` carries each block's tokens and the key of the block before it, as vLLM's does,
so a consumer that rehashes tokens itself (Dynamo's and llm-d's indexers, the tailserve router)
can chain them; the block hashes are tailserve's own keys. What differs from vLLM: a key is
stored when its first block caches it and removed when its last one is evicted (vLLM reports
every copy), so one event covers a run of consecutive newly cached blocks; no replay socket (``replay_endpoint``
is refused); the send happens on the engine thread, non-blocking (a subscriber too slow for
``hwm`` queued batches loses the newest, counted in ``num_dropped``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, fields
from itertools import count
from typing import Any, Literal

import msgspec

MEDIUM_GPU = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float  # seconds since the epoch
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of vLLM's tagged events."""


# vLLM sends a block hash as a 64-bit int by default, as its sha256 bytes with
# VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0; both decode (the router only compares them).
BlockHash = int | bytes


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def decode_batch(payload: bytes) -> KVEventBatch:
    return msgspec.msgpack.decode(payload, type=KVEventBatch)


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """vLLM's ``--kv-events-config`` fields (``vllm/config/kv_events.py``) and defaults."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None  # None: "zmq" when enabled, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in (None, "null", "zmq"):
            raise ValueError(f"--kv-events-config: publisher must be 'null' or 'zmq', got {self.publisher!r}")
        if self.replay_endpoint is not None:
            raise ValueError("--kv-events-config: replay_endpoint is not supported (no replay socket)")
        if self.hwm < 1:
            raise ValueError(f"--kv-events-config: hwm must be >= 1, got {self.hwm}")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    @staticmethod
    def parse(text: str) -> KvEventsConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--kv-events-config is not JSON: {error}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(KvEventsConfig)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field(s) {unknown}; known: {sorted(known)}")
        return KvEventsConfig(**raw)


class ZmqKvEventPublisher:
    """A PUB socket: binds a wildcard or ipc/inproc endpoint (vLLM's ``tcp://*:5557``), connects
    to any other."""

    def __init__(self, config: KvEventsConfig, block_size: int) -> None:
        import zmq

        self._zmq = zmq
        self.block_size = block_size
        self._topic = config.topic.encode()
        self._seq = count()
        self._encoder = msgspec.msgpack.Encoder()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, config.hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        endpoint = config.endpoint
        if "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._socket.bind(endpoint)
            self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._socket.connect(endpoint)
            self.endpoint = endpoint
        self.num_published = 0
        self.num_dropped = 0

    def publish(self, raw_events: list[tuple]) -> None:
        """Send the pool's events (``HashedBlockPool.take_events``) as one batch; none: nothing."""
        if not raw_events:
            return
        events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        for event in raw_events:
            if event[0] == "stored":
                events.append(
                    BlockStored(event[1], event[2], event[3], self.block_size, None, MEDIUM_GPU, None)
                )
            else:
                events.append(BlockRemoved(event[1], MEDIUM_GPU))
        payload = self._encoder.encode(KVEventBatch(time.time(), events))
        frames = (self._topic, next(self._seq).to_bytes(8, "big"), payload)
        try:
            self._socket.send_multipart(frames, flags=self._zmq.NOBLOCK)
            self.num_published += 1
        except self._zmq.Again:
            self.num_dropped += 1

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()
