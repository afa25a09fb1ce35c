"""Pause Python's cyclic garbage collector around allocation-heavy, cycle-free work.

A simulation appends millions of floats to per-request lists and creates no reference cycles;
left on, the cyclic collector keeps rescanning those lists as they grow (10-20% of a trace
replay's time here). Reference counting still frees everything as usual.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
