"""The precise ``kv-aware`` router's view: each backend's cached blocks, learned from its KV
events (vLLM's ZeroMQ format, ``server/kv_events.py``), as Dynamo's and llm-d's KV indexers do.

One SUB socket per backend (``--kv-events ENDPOINT``, in ``--backend`` order; ``-`` for a
backend without events) on one thread; ``BlockStored`` adds its ``block_hashes`` to the
backend's set, ``BlockRemoved`` takes them out, ``AllBlocksCleared`` empties it. ``overlap``
answers the ``KvIndex`` question for a prompt keyed by its token ids (``RouteRequest.token_keys``:
the router's keys are the engine's, ``cluster/routing.block_keys_from_tokens``); for a text
prompt, or a backend without events, it says None and the router uses its own tree.
"""

from __future__ import annotations

import logging
import threading

from tailserve.cluster.routing import RouteRequest
from tailserve.server.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

logger = logging.getLogger("tailserve.router")


class KvEventIndex:
    def __init__(self, endpoints: list[str | None], topic: str = "") -> None:
        import zmq

        self._zmq = zmq
        self._context = zmq.Context()
        self._sockets: dict[object, int] = {}
        self._poller = zmq.Poller()
        self.blocks: list[set[int]] = [set() for _ in endpoints]
        self.block_size: list[int | None] = [None] * len(endpoints)
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
                self._apply(replica, batch.events)

    def _apply(self, replica: int, events: list) -> None:
        with self._lock:
            blocks = self.blocks[replica]
            self.num_batches[replica] += 1
            for event in events:
                if isinstance(event, BlockStored):
                    blocks.update(event.block_hashes)
                    self.block_size[replica] = event.block_size
                elif isinstance(event, BlockRemoved):
                    blocks.difference_update(event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    blocks.clear()

    def overlap(self, request: RouteRequest, replica: int) -> int | None:
        """Leading blocks of the prompt the backend holds; None when it cannot tell."""
        if replica >= len(self.blocks) or not self.subscribed[replica] or not request.token_keys:
            return None
        with self._lock:
            size = self.block_size[replica]
            if size is None:  # nothing stored yet: its cache is empty
                return 0
            if size != request.block_size:
                return None  # the engine's blocks are not the router's: keys cannot match
            blocks = self.blocks[replica]
            n = 0
            for key in request.block_keys:
                if key not in blocks:
                    break
                n += 1
            return n

    def close(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            self._thread.join(timeout=2)
        for sock in list(self._sockets):
            sock.close(linger=0)
        self._context.term()
