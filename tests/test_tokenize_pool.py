"""The tokenizer worker pool (issue 30, item 1): no permanent hang, every request answered, no
orphan process.

On Python 3.11 the pool was a ``ProcessPoolExecutor(max_workers=1, max_tasks_per_child=16)``: a
burst of more than 16 long texts left it with no worker and the rest queued forever (CPython
gh-115634), and its spawned worker and resource tracker outlived a killed server. Each test here
is bounded by a timeout and loopback only; processes are found through ``/proc`` (Linux).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_helpers import MICRO, running_server
from tailserve.executors.pytorch.init_model import init_model
from tailserve.executors.pytorch.tokenizer import Tokenizer
from tailserve.server import tokenize_pool
from tailserve.server.protocol import ApiError
from tailserve.server.tokenize_pool import PromptTokenizer

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds processes in /proc")

LONG = "the quick brown fox jumps over the lazy dog " * 200  # 8,800 chars: past the inline limit


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "micro", preset="tiny", dtype="float32", **MICRO)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(str(model_dir))


@pytest.fixture
def make(tokenizer: Tokenizer, model_dir: Path) -> Iterator[Any]:
    """``make(**options)``: a PromptTokenizer, closed (and its workers checked gone) after the test."""
    made: list[PromptTokenizer] = []
    # The suite's other tests may have left multiprocessing children (its resource tracker lives
    # as long as pytest): only processes that appear during this test are this pool's.
    _OTHERS.clear()
    _OTHERS.update(_workers_of(os.getpid()))

    def factory(**options: Any) -> PromptTokenizer:
        made.append(PromptTokenizer(tokenizer, str(model_dir), 100_000, **options))
        return made[-1]

    yield factory
    for prompts in made:
        prompts.close()
    assert all(_gone(pid, 5) for pid in _workers_of(os.getpid()))


def _run(coro: Any, timeout: float) -> Any:
    """Run ``coro`` on a fresh event loop; a hang fails the test after ``timeout`` seconds."""

    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process; None once it is gone or a zombie with every thread done."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        if fields[0] == "Z" and len(os.listdir(f"/proc/{pid}/task")) <= 1:
            return None  # (a killed process's first thread is a zombie before the others end)
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) and stat[1] == pid:
            found.append(int(entry.name))
    return sorted(found)


def _is_worker(pid: int) -> bool:
    """A tokenizer worker: ours, or (before) a ``multiprocessing`` spawned one or its tracker."""
    return any(mark in _cmdline(pid) for mark in ("tokenize_pool", "spawn_main", "resource_tracker"))


_OTHERS: set[int] = set()  # worker-like children of pytest that were there before the test


def _workers_of(pid: int) -> list[int]:
    """Tokenizer worker processes whose parent is ``pid``, as an outsider (an OOM killer) sees them."""
    return [child for child in _children(pid) if _is_worker(child) and child not in _OTHERS]


def _worker() -> int:
    """This test's one tokenizer worker."""
    workers = [pid for pid in _workers_of(os.getpid()) if "resource_tracker" not in _cmdline(pid)]
    assert len(workers) == 1, [(pid, _cmdline(pid)) for pid in workers]
    return workers[0]


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _stat(pid) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


async def _warm(prompts: PromptTokenizer) -> int:
    """Start the worker with one long text; its pid."""
    await prompts.encode(LONG)
    return _worker()


# ---- no permanent hang ---------------------------------------------------------------------------
def test_a_burst_of_long_prompts_is_all_answered(make: Any, tokenizer: Tokenizer) -> None:
    """64 long texts at once: the old pool answered 16 and left 48 queued forever."""
    prompts = make()
    texts = [f"{i} {LONG}" for i in range(64)]

    async def burst() -> list[list[int]]:
        return await asyncio.gather(*(prompts.encode(text) for text in texts))

    assert _run(burst(), 60) == [tokenizer.encode(text) for text in texts]


def test_recycled_workers_never_strand_a_queued_text(make: Any, tokenizer: Tokenizer) -> None:
    """Workers replaced every 10 texts under 16 closed-loop clients (the issue's load): 160 long
    texts all answered, in order, by 16 successive workers."""
    prompts = make(max_tasks_per_worker=10)
    answers: dict[int, list[int]] = {}

    async def client(k: int) -> None:
        for j in range(10):
            answers[k * 10 + j] = await prompts.encode(f"{k} {j} {LONG}")

    async def clients() -> None:
        await asyncio.gather(*(client(k) for k in range(16)))

    _run(clients(), 120)
    assert len(answers) == 160
    assert answers[37] == tokenizer.encode(f"3 7 {LONG}")
    assert prompts.pool.started >= 16


def test_a_text_that_leaves_memory_behind_gets_a_fresh_worker(make: Any) -> None:
    """1.2 Mi chars leave ~130 MB in the worker: replaced right after; thousands of short texts
    leave nothing worth a restart (measured), so the worker is not replaced after a count."""
    prompts = make()

    async def scenario() -> tuple[int, int, int]:
        first = await _warm(prompts)
        await asyncio.gather(*(prompts.encode(f"{i} {LONG}") for i in range(100)))
        same = _worker()
        await prompts.encode("hello world, " * (1_200_000 // 13))
        await prompts.encode(LONG)
        return first, same, _worker()

    first, same, after = _run(scenario(), 90)
    assert first == same != after


def test_every_worker_function_matches_the_inline_result(make: Any, tokenizer: Tokenizer) -> None:
    prompts = make()
    messages = [{"role": "user", "content": LONG}]

    async def scenario() -> tuple[Any, ...]:
        ids = await prompts.encode(LONG, add_special_tokens=False)
        body = await prompts.tokenize_json(LONG, True)
        pid = _worker()
        chat = await prompts.encode_chat(messages, True)  # loads the chat wrapper (and torch) once
        return ids, body, chat, pid, _worker()

    ids, body, chat, pid, pid_after_chat = _run(scenario(), 120)
    assert ids == tokenizer.encode(LONG, add_special_tokens=False)
    expected = tokenizer.encode(LONG)
    assert json.loads(body) == {"tokens": expected, "count": len(expected), "max_model_len": 100_000}
    assert chat == prompts._chat_inline(messages, True)
    assert pid_after_chat == pid  # torch's import is not counted as a huge text's memory


# ---- a dead or hung worker: detected, its request answered, replaced ----------------------------
def test_a_worker_killed_mid_request_answers_it_with_a_503(make: Any, tokenizer: Tokenizer) -> None:
    prompts = make()
    huge = "the quick brown fox jumps over the lazy dog, " * (3 * 2**20 // 45)  # ~4 s to encode

    async def scenario() -> tuple[ApiError, list[int], int, int]:
        pid = await _warm(prompts)
        call = asyncio.ensure_future(prompts.encode(huge))
        queued = asyncio.ensure_future(prompts.encode(LONG))  # waits behind it
        await asyncio.sleep(0.5)
        os.kill(pid, signal.SIGKILL)  # as the OOM killer would
        with pytest.raises(ApiError) as failed:
            await call
        return failed.value, await queued, pid, _worker()

    error, queued_ids, dead, replacement = _run(scenario(), 60)
    assert error.status == 503 and error.message.startswith("prompt: could not be tokenized: ")
    assert "died" in error.message or "did not take the text" in error.message
    assert queued_ids == tokenizer.encode(LONG)  # the next text went to a fresh worker
    assert replacement != dead and _gone(dead, 5)


def test_a_hung_worker_is_killed_and_its_request_answered(make: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(tokenize_pool, "MIN_CHARS_PER_S", 10**9)  # the timeout is task_timeout_s
    prompts = make(task_timeout_s=1.0)
    big = "the quick brown fox jumps over the lazy dog, " * (2**20 // 45)  # more than a socket holds

    async def scenario() -> tuple[list[ApiError], list[int], int, float]:
        errors = []
        for text in (LONG, big):  # one fits the socket's buffer, one blocks the send
            pid = await _warm(prompts)
            os.kill(pid, signal.SIGSTOP)
            started = time.monotonic()
            with pytest.raises(ApiError) as failed:
                await prompts.encode(text)
            took = time.monotonic() - started
            errors.append(failed.value)
            assert _gone(pid, 5)  # SIGKILL ends a stopped process too
        return errors, await prompts.encode(LONG), pid, took

    errors, ids, stopped, took = _run(scenario(), 60)
    assert [e.status for e in errors] == [503, 503]
    assert "did not answer within 1.0 s" in errors[0].message
    assert "did not take the text within 1.0 s" in errors[1].message
    assert ids and _worker() != stopped and took < 10


def test_a_worker_that_died_while_idle_is_replaced_unseen(make: Any, tokenizer: Tokenizer) -> None:
    prompts = make()

    async def scenario() -> tuple[int, list[int]]:
        pid = await _warm(prompts)
        os.kill(pid, signal.SIGKILL)
        assert _gone(pid, 5)
        return pid, await prompts.encode(LONG)

    _, ids = _run(scenario(), 30)
    assert ids == tokenizer.encode(LONG)


def test_a_worker_that_cannot_start_answers_503_and_the_next_text_retries(
    make: Any, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    prompts = make()
    prompts.pool.model_dir = str(tmp_path)  # no tokenizer.json there

    async def scenario() -> tuple[ApiError, list[int]]:
        with pytest.raises(ApiError) as failed:
            await prompts.encode(LONG)
        prompts.pool.model_dir = prompts.model_dir
        return failed.value, await prompts.encode(LONG)

    error, ids = _run(scenario(), 60)
    assert error.status == 503 and "could not start" in error.message
    assert ids == tokenizer.encode(LONG)


# ---- shutdown: nothing left behind ---------------------------------------------------------------
def test_close_answers_every_request_and_leaves_no_process(make: Any) -> None:
    prompts = make()

    async def scenario() -> tuple[list[Any], float, int]:
        pid = await _warm(prompts)
        os.kill(pid, signal.SIGSTOP)  # even a hung worker does not hold shutdown up
        calls = [asyncio.ensure_future(prompts.encode(f"{i} {LONG}")) for i in range(3)]
        await asyncio.sleep(0.2)
        started = time.monotonic()
        prompts.close()
        took = time.monotonic() - started
        results = await asyncio.gather(*calls, prompts.encode(LONG), return_exceptions=True)
        return results, took, pid

    results, took, pid = _run(scenario(), 30)
    assert took < 6
    assert all(isinstance(r, ApiError) and r.status == 503 for r in results), results
    assert all("shutting down" in r.message for r in results)
    assert _gone(pid, 1) and _workers_of(os.getpid()) == []


_SERVER_STAND_IN = """
import asyncio, sys, time
from tailserve.executors.pytorch.tokenizer import Tokenizer
from tailserve.server.tokenize_pool import PromptTokenizer

async def main():
    prompts = PromptTokenizer(Tokenizer.from_dir(sys.argv[1]), sys.argv[1], 100_000)
    await prompts.encode("the quick brown fox " * 500)
    print("started", flush=True)
    if sys.argv[2] == "busy":
        asyncio.ensure_future(prompts.encode("the quick brown fox, " * 300_000))
        await asyncio.sleep(0.5)
        print("busy", flush=True)
    await asyncio.sleep(120)

if __name__ == "__main__":
    asyncio.run(main())
"""


@pytest.mark.parametrize("state", ["idle", "busy"])
def test_a_worker_exits_when_its_server_is_killed(model_dir: Path, state: str) -> None:
    """SIGKILL the server: its worker (and, before, a resource tracker) must not live on."""
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER_STAND_IN, str(model_dir), state], stdout=subprocess.PIPE, text=True
    )
    descendants: list[int] = []
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "started"
        if state == "busy":
            assert server.stdout.readline().strip() == "busy"  # encoding ~6 MB: several seconds
        descendants = _workers_of(server.pid)
        assert descendants, _children(server.pid)
        server.kill()
        server.wait(10)
        # Busy, only the kernel's parent-death signal can stop it this soon (it holds the GIL).
        assert all(_gone(pid, 3) for pid in descendants), [(p, _cmdline(p)) for p in descendants]
    finally:
        server.kill()
        server.wait(10)
        for pid in descendants:  # started by our stand-in: ours to clean up if the test failed
            if _stat(pid) is not None and _is_worker(pid):
                os.kill(pid, signal.SIGKILL)


# ---- through the server --------------------------------------------------------------------------
def _long_prompt_clients(base_url: str, clients: int, each: int) -> list[int | str]:
    """``clients`` threads, each sending ``each`` long prompts in turn; every status (or error)."""
    statuses: list[int | str] = []

    def client(k: int) -> None:
        with httpx.Client(base_url=base_url, timeout=30) as http:
            for j in range(each):
                body = {"prompt": f"{k} {j} {LONG}", "max_tokens": 1}
                try:
                    statuses.append(http.post("/v1/completions", json=body).status_code)
                except httpx.HTTPError as error:
                    statuses.append(type(error).__name__)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return statuses


def test_long_prompts_from_64_clients_are_all_served(model_dir: Path) -> None:
    """The issue's load at 64 clients: prompts over 8,192 chars (it saw 192 served, then none)."""
    with running_server(model_dir, "sim") as running:
        assert _long_prompt_clients(running.base_url, 64, 3) == [200] * 192


def test_serve_stops_on_sigterm_and_leaves_no_worker(model_dir: Path) -> None:
    cmd = [sys.executable, "-m", "tailserve.cli", "serve", "--model", str(model_dir), "--executor", "sim"]
    cmd += ["--port", "0", "--log-level", "warning"]
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    workers: list[int] = []
    try:
        assert proc.stderr is not None
        url = next(
            (line.split("listening on ")[1].split()[0] for line in proc.stderr if "listening on " in line),
            None,
        )
        assert url is not None, "the server printed no address"
        assert _long_prompt_clients(url, 32, 1) == [200] * 32  # a burst: the old pool hung on it
        workers = _workers_of(proc.pid)
        assert workers
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert all(_gone(pid, 5) for pid in workers), [(pid, _cmdline(pid)) for pid in workers]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in workers:
            if _stat(pid) is not None and _is_worker(pid):
                os.kill(pid, signal.SIGKILL)
