"""What a command that listens shares (``serve``, ``router``): the socket bound before anything
loads, so a port in use is one error line, and the API keys from the flag or the environment."""

from __future__ import annotations

import socket
from collections.abc import Mapping

LISTEN_BACKLOG = 2048  # uvicorn's default backlog


def bind_socket(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on connections accepted from such a socket
    # (uvicorn writes a response's head and body apart: with Nagle's algorithm a kept-alive client
    # waited 40 ms for each body). Linux also copies the listener's TCP_NODELAY to accepted ones.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
        # Listening from here on: a client that connects after "listening on" waits in the
        # kernel's queue while the app starts (the engine, the heap freeze) instead of being
        # refused; uvicorn accepts from the same socket once the app is up.
        sock.listen(LISTEN_BACKLOG)
    except OSError as error:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    sock.set_inheritable(True)
    return sock


def api_keys_from_env(flag: list[str] | None, environ: Mapping[str, str]) -> list[str]:
    """``--api-key`` values, else ``TAILSERVE_API_KEY``, else ``VLLM_API_KEY`` (vLLM's variable);
    empty: no authentication.

    Keys lose surrounding whitespace: a key from a file written by ``echo`` (a Kubernetes secret
    made ``--from-file``, say) ends in a newline that no ``Authorization`` header can carry, so
    every request was a 401. A key variable that is set but empty (or blank) leaves the server
    open, and one line on stderr says so."""
    import sys

    if flag:
        keys = [key.strip() for key in flag]
        if not all(keys):
            raise ValueError("--api-key must not be empty")
        return keys
    names = ("TAILSERVE_API_KEY", "VLLM_API_KEY")
    for name in names:
        key = environ.get(name, "").strip()
        if key:
            return [key]
    blank = [name for name in names if name in environ]
    if blank:
        print(
            f"tailserve: warning: {' and '.join(blank)} {'is' if len(blank) == 1 else 'are'} set but "
            "empty: no API key, every client is served",
            file=sys.stderr,
        )
    return []
