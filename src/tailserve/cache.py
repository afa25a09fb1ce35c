"""Where tailserve keeps what it makes for itself: ``$TAILSERVE_CACHE``, else
``~/.cache/tailserve`` (models/, kernels/, tune/). Nothing is written to the current directory
unless the user names a path there."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    base = os.environ.get("TAILSERVE_CACHE")
    return Path(base).expanduser() if base else Path.home() / ".cache" / "tailserve"
