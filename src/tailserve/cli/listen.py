"""What a command that listens shares (``serve``, ``router``): the socket bound before anything
loads, so a port in use is one error line, and the API keys from the flag or the environment."""

from __future__ import annotations

import socket
from collections.abc import Mapping


def bind_socket(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    sock.set_inheritable(True)
    return sock


def api_keys_from_env(flag: list[str] | None, environ: Mapping[str, str]) -> list[str]:
    """``--api-key`` values, else ``TAILSERVE_API_KEY``, else ``VLLM_API_KEY`` (vLLM's variable);
    empty: no authentication."""
    keys = flag or [key for key in (environ.get("TAILSERVE_API_KEY") or environ.get("VLLM_API_KEY"),) if key]
    if any(not key.strip() for key in keys):
        raise ValueError("--api-key must not be empty")
    return keys
