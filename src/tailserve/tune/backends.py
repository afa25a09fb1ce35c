"""Where a sweep's runs execute: in this process, on a local process pool, or on Ray.

Every backend runs ``tune.sweep.execute`` on specs (``SweepSpec``: a ``RunSpec`` or a cluster
layout's) and hands back ``RunOutcome``s as they finish; the simulator is deterministic, so all
three give identical results for the same specs.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tailserve.tune.sweep import RunOutcome, SweepSpec


def _execute() -> Callable[[SweepSpec], RunOutcome]:
    # Imported when used: sweep.py imports this module. A module-level function pickles for the
    # process pool and Ray alike.
    from tailserve.tune.sweep import execute

    return execute


class Backend(Protocol):
    def submit(self, spec: SweepSpec) -> None: ...
    def wait(self) -> list[RunOutcome]:
        """Block until at least one submitted run finished; return every finished one."""
        ...

    def close(self) -> None: ...


class SerialBackend:
    """Runs in this process, one at a time (``--workers 1``)."""

    workers = 1

    def __init__(self) -> None:
        self._queue: deque[SweepSpec] = deque()

    def submit(self, spec: SweepSpec) -> None:
        self._queue.append(spec)

    def wait(self) -> list[RunOutcome]:
        return [_execute()(self._queue.popleft())]

    def close(self) -> None:
        self._queue.clear()


class ProcessBackend:
    """A local process pool. Workers are spawned, not forked: the parent runs a progress thread,
    and forking a process with threads can deadlock on a lock the thread held."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"--workers must be >= 1, got {workers}")
        self.workers = workers
        self._pool = cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        self._futures: set[cf.Future[RunOutcome]] = set()

    def submit(self, spec: SweepSpec) -> None:
        self._futures.add(self._pool.submit(_execute(), spec))

    def wait(self) -> list[RunOutcome]:
        done, self._futures = cf.wait(self._futures, return_when=cf.FIRST_COMPLETED)
        return [f.result() for f in done]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class RayBackend:
    """Ray tasks, one CPU each. ``address`` ``auto`` attaches to the Ray instance this machine
    runs (``ray start``, or ``RAY_ADDRESS``) and starts a local one if there is none; otherwise it
    names a cluster (``ray://host:10001`` or ``host:6379``). An already initialised Ray (a test's
    ``ray.init(num_cpus=2)``) is used as it is."""

    def __init__(self, address: str) -> None:
        try:
            import ray
        except ImportError:
            raise ValueError("--ray needs the ray package: pip install 'tailserve[ray]'") from None
        self._ray = ray
        self._started = False
        if not ray.is_initialized():
            ray.init(address=None if address == "auto" else address, log_to_driver=False)
            self._started = True
        self.workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self._execute = ray.remote(num_cpus=1)(_execute())
        self._refs: list[Any] = []

    def submit(self, spec: SweepSpec) -> None:
        self._refs.append(self._execute.remote(spec))

    def wait(self) -> list[RunOutcome]:
        done, self._refs = self._ray.wait(self._refs, num_returns=1)
        return list(self._ray.get(done))

    def close(self) -> None:
        for ref in self._refs:
            self._ray.cancel(ref)
        self._refs = []
        if self._started:
            self._ray.shutdown()


def make_backend(workers: int | None = None, ray_address: str | None = None) -> Backend:
    """``--ray`` wins; otherwise a pool of ``workers`` processes (default: the CPU count), or this
    process alone with one worker."""
    if ray_address:
        return RayBackend(ray_address)
    n = workers if workers is not None else (os.cpu_count() or 1)
    return SerialBackend() if n == 1 else ProcessBackend(n)
