"""Where a sweep's runs execute: in this process, on a local process pool, or on Ray.

Every backend runs ``tune.sweep.execute`` on specs (``SweepSpec``: a ``RunSpec`` or a cluster
layout's) and hands back ``RunOutcome``s as they finish; the simulator is deterministic, so all
three give identical results for the same specs, and ``Sweep`` puts them back in spec order.

A worker (a pool process or a Ray worker process) starts once and runs many specs. A spec is a
few hundred bytes (deployment, workload spec with its seed, policy flags): the worker builds the
cost model and the requests from it and keeps both for the next spec with the same deployment and
workload (``sweep._cost_model``, ``sweep._workload``), so a workload crosses no process boundary.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import socket
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tailserve.tune.sweep import RunOutcome, SweepSpec

CONNECT_TIMEOUT_S = 5.0  # a Ray address that does not answer in this long is an error, not a hang


def _execute() -> Callable[[SweepSpec], RunOutcome]:
    # Imported when used: sweep.py imports this module. A module-level function pickles for the
    # process pool and Ray alike.
    from tailserve.tune.sweep import execute

    return execute


def _warm_worker() -> None:
    """A pool worker's initializer: the simulator's imports once, at start, so the first spec's
    time is that spec's (the pool's workers are spawned: a fresh interpreter each)."""
    import tailserve.tune.sweep  # noqa: F401


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask, lowered by a cgroup v2 CPU quota (a
    container given 2 CPUs of a 64-core host). ``os.cpu_count()`` counts the host's."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


class Backend(Protocol):
    workers: int

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
        self._pool = cf.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=_warm_worker
        )
        self._futures: set[cf.Future[RunOutcome]] = set()

    def submit(self, spec: SweepSpec) -> None:
        self._futures.add(self._pool.submit(_execute(), spec))

    def wait(self) -> list[RunOutcome]:
        done, self._futures = cf.wait(self._futures, return_when=cf.FIRST_COMPLETED)
        return [f.result() for f in done]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class RayBackend:
    """Ray tasks of ``sweep.execute``, one CPU each; Ray keeps its worker processes between tasks,
    so each one's memos of cost models and workloads serve the specs it runs after the first.

    ``address``: ``local`` starts a Ray instance of ``workers`` CPUs (default: the usable CPUs)
    for this sweep alone and stops it after; ``auto`` attaches to the Ray this machine runs (``ray
    start``, ``RAY_ADDRESS``) and starts a local one if there is none; anything else names a
    cluster (``ray://host:10001`` or ``host:6379``), checked to answer before Ray is asked. An
    already initialised Ray (a test's ``ray.init(num_cpus=2)``) is used as it is."""

    def __init__(self, address: str, workers: int | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise ValueError("--ray-address needs the ray package: pip install 'tailserve[ray]'") from None
        self._ray = ray
        self._started = False
        if not ray.is_initialized():
            if address == "local":
                init: dict[str, Any] = dict(address="local", num_cpus=workers or usable_cpus())
            else:
                if address != "auto":
                    check_reachable(address)
                init = dict(address=None if address == "auto" else address)
            try:
                ray.init(**init, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
            except (ConnectionError, RuntimeError, TimeoutError, ValueError) as error:
                first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                raise ValueError(f"--ray-address {address}: Ray did not start or connect: {first}") from None
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


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """A TCP connection to a Ray address's host and port, or a ValueError naming it: without this
    ``ray.init`` retries an unreachable head for a minute and ends in a traceback."""
    host_port = address.removeprefix("ray://")
    host, sep, port_text = host_port.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(
            f"--ray-address {address!r}: expected local, auto, HOST:PORT (the head's GCS, e.g. "
            "head:6379) or ray://HOST:PORT (Ray Client, e.g. ray://head:10001)"
        )
    try:
        with socket.create_connection((host.strip("[]"), int(port_text)), timeout=timeout_s):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        if isinstance(error, TimeoutError):
            reason = f"no answer in {timeout_s:g} s"
        raise ValueError(f"--ray-address {address}: cannot reach {host}:{port_text} ({reason})") from None


def make_backend(workers: int | None = None, ray_address: str | None = None) -> Backend:
    """Ray when given an address; otherwise a pool of ``workers`` processes (default: the usable
    CPUs), or this process alone with one worker."""
    if ray_address:
        return RayBackend(ray_address, workers)
    n = workers if workers is not None else usable_cpus()
    return SerialBackend() if n == 1 else ProcessBackend(n)
