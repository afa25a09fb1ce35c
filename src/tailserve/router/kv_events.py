"""The precise ``kv-aware`` router's view: each backend's cached blocks, learned from its KV
events (vLLM's ZeroMQ format, ``server/kv_events.py``), as Dynamo's and llm-d's KV indexers do.

One SUB socket per backend (``--kv-events ENDPOINT``, in ``--backend`` order; ``-`` for a
backend without events) on one thread, each backend's events applied to its ``BackendBlocks``.
``overlap`` answers the ``KvIndex`` question for a prompt keyed by its token ids
(``RouteRequest.token_keys``); for a text prompt, or a backend without events, it says None and
the router uses its own tree.

Events are told apart by ``BlockStored.token_ids``:

- **With tokens** (vLLM, and ``tailserve serve``): each stored block's tokens and the engine hash
  of the block before it. vLLM's hashes are its own (sha256 or builtin hash, seeded per
  deployment), so the router re-keys the tokens with its own chain
  (``cluster/routing.extend_block_keys``), continuing from the key it gave the parent block, as
  Dynamo's indexer rehashes tokens; an engine block of ``k x 16`` tokens gives ``k`` router keys
  (for tailserve's 16-token blocks the re-keyed keys equal its hashes). ``BlockRemoved`` names
  engine hashes: the router maps them back. vLLM reports every cached copy of a block, so a hash
  is forgotten when its last copy is removed. A block whose parent the router never saw (it
  subscribed after the parent was stored) cannot be placed in a chain and is skipped: ZeroMQ
  PUB/SUB has no history without a replay socket.
- **Without tokens** (a tailserve engine keyed from Mooncake hash ids, or an older tailserve):
  the block hashes are the router's keys (same chain, same 16-token blocks), used as they are.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from tailserve.cluster.routing import DEFAULT_ROUTER_BLOCK_SIZE, RouteRequest, extend_block_keys
from tailserve.server.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, decode_batch

logger = logging.getLogger("tailserve.router")


@dataclass(slots=True)
class _EngineBlock:
    keys: tuple[int, ...]  # the router keys of this engine block's tokens
    copies: int = 1


class BackendBlocks:
    """One backend's cached prefix blocks, in the router's keys."""

    def __init__(self, router_block_size: int = DEFAULT_ROUTER_BLOCK_SIZE) -> None:
        self.router_block_size = router_block_size
        self.keys: dict[int, int] = {}  # router key -> engine blocks holding it
        self._engine: dict[BlockHash, _EngineBlock] = {}
        self.block_size: int | None = None  # the engine's, from its first BlockStored
        # whether its blocks can be put in the router's keys: tokens in whole 16-token blocks,
        # or (no tokens) hashes of the router's own 16-token blocks
        self.matchable = True
        self.skipped_blocks = 0  # stored blocks whose parent was never seen

    def apply(self, event: object) -> None:
        if isinstance(event, BlockStored):
            size = self.block_size = event.block_size
            rbs = self.router_block_size
            self.matchable = size % rbs == 0 if event.token_ids else size == rbs
            if self.matchable:
                self._store(event)
            elif event.token_ids:
                self.skipped_blocks += len(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            for engine_hash in event.block_hashes:
                block = self._engine.get(engine_hash)
                if block is None:
                    continue
                block.copies -= 1
                if block.copies == 0:
                    del self._engine[engine_hash]
                    for key in block.keys:
                        left = self.keys[key] - 1
                        if left:
                            self.keys[key] = left
                        else:
                            del self.keys[key]
        elif isinstance(event, AllBlocksCleared):
            self.keys.clear()
            self._engine.clear()

    def _store(self, event: BlockStored) -> None:
        size = event.block_size
        if not event.token_ids:  # tailserve's events: the hashes are the router's keys
            for engine_hash in event.block_hashes:
                self._add(engine_hash, (engine_hash,) if isinstance(engine_hash, int) else ())
            return
        if len(event.token_ids) != size * len(event.block_hashes):
            self.skipped_blocks += len(event.block_hashes)
            return
        parent = event.parent_block_hash
        if parent is None:
            key = None
        else:
            block = self._engine.get(parent)
            if block is None or not block.keys:
                self.skipped_blocks += len(event.block_hashes)
                return
            key = block.keys[-1]
        for i, engine_hash in enumerate(event.block_hashes):
            keys = extend_block_keys(key, event.token_ids[i * size : (i + 1) * size], self.router_block_size)
            self._add(engine_hash, keys)
            key = keys[-1]

    def _add(self, engine_hash: BlockHash, keys: tuple[int, ...]) -> None:
        block = self._engine.get(engine_hash)
        if block is not None:
            block.copies += 1
            return
        self._engine[engine_hash] = _EngineBlock(keys)
        for key in keys:
            self.keys[key] = self.keys.get(key, 0) + 1

    def overlap(self, request: RouteRequest) -> int | None:
        """Leading blocks of the prompt this backend holds; None when its keys cannot match."""
        if self.block_size is None:  # nothing stored yet: its cache is empty
            return 0
        if request.block_size != self.router_block_size or not self.matchable:
            return None  # the engine's blocks are not the router's: keys cannot match
        n = 0
        for key in request.block_keys:
            if key not in self.keys:
                break
            n += 1
        return n


class KvEventIndex:
    def __init__(self, endpoints: list[str | None], topic: str = "") -> None:
        import zmq

        self._zmq = zmq
        self._context = zmq.Context()
        self._sockets: dict[object, int] = {}
        self._poller = zmq.Poller()
        self.backends = [BackendBlocks() for _ in endpoints]
        self.num_batches = [0] * len(endpoints)
        self.subscribed = [e is not None for e in endpoints]
        self._lock = threading.Lock()
        for i, endpoint in enumerate(endpoints):
            if endpoint is None:
                continue
            sock = self._context.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt_string(zmq.SUBSCRIBE, topic)
            try:
                sock.connect(endpoint)
            except zmq.ZMQError as error:
                self.close()
                raise ValueError(f"--kv-events {endpoint!r}: {error}") from None
            self._sockets[sock] = i
            self._poller.register(sock, zmq.POLLIN)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tailserve-kv-events", daemon=True)
        self._thread.start()

    @property
    def blocks(self) -> list[set[int]]:
        """Each backend's cached router keys (a snapshot)."""
        with self._lock:
            return [set(b.keys) for b in self.backends]

    def _run(self) -> None:
        while not self._stop.is_set():
            for sock, _ in self._poller.poll(100):
                replica = self._sockets[sock]
                try:
                    _topic, _seq, payload = sock.recv_multipart(self._zmq.NOBLOCK)
                    batch = decode_batch(payload)
                except (ValueError, self._zmq.ZMQError) as error:  # a malformed message: skip it
                    logger.warning("KV events from backend %d: bad message (%s)", replica, error)
                    continue
                self.apply(replica, batch.events)

    def apply(self, replica: int, events: list) -> None:
        with self._lock:
            self.num_batches[replica] += 1
            backend = self.backends[replica]
            for event in events:
                backend.apply(event)

    def overlap(self, request: RouteRequest, replica: int) -> int | None:
        """Leading blocks of the prompt the backend holds; None when it cannot tell."""
        if replica >= len(self.backends) or not self.subscribed[replica] or not request.token_keys:
            return None
        with self._lock:
            return self.backends[replica].overlap(request)

    def close(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            self._thread.join(timeout=2)
        for sock in list(self._sockets):
            sock.close(linger=0)
        self._context.term()
