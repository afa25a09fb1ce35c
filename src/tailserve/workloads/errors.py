"""The one error a workload input can raise beyond a plain ``ValueError``."""

from __future__ import annotations


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message starts with ``<path>:<line>:`` when a
    single line is at fault, so an editor or a terminal can jump straight to it."""
