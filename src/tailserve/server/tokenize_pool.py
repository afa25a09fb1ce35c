"""Prompt tokenization off the event loop and off the engine thread, with a size check first.

The ``tokenizers`` library holds the GIL while it encodes (measured here: a 1 MB string blocks
every other Python thread for the whole ~1 s), so a worker *thread* would still stall every
stream. Short texts (up to ``inline_limit_chars``, a few milliseconds) are encoded in a thread;
longer ones go to a worker *process* that loads the tokenizer once, so the server's event loop
and engine thread keep running, and the memory a huge encoding takes (~0.9 GB for 10 MB of text)
is the worker's: a worker whose memory grew more than ``RECYCLE_AFTER_GROWTH_BYTES`` over what it
held once loaded is replaced right after that text (its memory goes back to the system). Smaller
texts leave little and it does not add up (measured: 2,000 texts of 9k characters +3 MB, 300 of
100k +12 MB, 2,000 more afterwards +0), so a worker is not replaced after a number of texts.

The worker pool is ours (``WorkerPool``), not ``concurrent.futures.ProcessPoolExecutor``: on
Python 3.11 (and later versions until CPython's GH-140900) that executor with
``max_tasks_per_child`` can retire its last worker and spawn no replacement (gh-115634: its
idle-worker semaphore counts finished tasks, not idle workers), leaving every later text queued
forever and interpreter exit waiting on its manager thread. Here one supervisor thread owns each worker process and is the only one that starts,
talks to, retires or replaces it, so there is no race between them:

- a worker that dies (killed for memory, a crash) is seen at once (end of file on its socket): the
  request it held is answered with a 503, the queued ones go to a fresh worker;
- a worker that does not answer within ``task_timeout_s`` (+1 s per ``MIN_CHARS_PER_S`` chars) is
  killed, its request answered with a 503, and replaced;
- ``close`` answers every queued request, kills the workers and reaps them: nothing is left;
- a worker whose server dies exits too: ``PR_SET_PDEATHSIG`` (Linux; SIGKILL when the supervisor
  thread that started it ends, with the server or on ``close``), end of file on its socket, and a
  thread that polls its parent's pid. Workers are plain ``subprocess`` children (no
  ``multiprocessing`` resource tracker, no re-import of the server's ``__main__``), and ignore
  SIGINT: a Ctrl-C stops the server, and the server stops them.

Before any of that, a prompt whose UTF-8 length is over ``max_model_len`` x the longest token's
UTF-8 length cannot fit in the context whatever it tokenizes to (each token covers at most that
many bytes; a normalizer that deletes characters is the one exception) and is refused at once.

This module is also what a worker process imports, so it imports nothing of the server at the top
(``ApiError`` is imported where it is raised): a worker starts and loads the tiny model's
tokenizer in ~0.1 s and holds ~33 MB.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import pickle
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

logger = logging.getLogger("tailserve.server")

INLINE_LIMIT_CHARS = 8192  # ~3 ms of encoding on this CPU: fine in a thread
RECYCLE_AFTER_GROWTH_BYTES = 64 * 2**20  # 1 Mi chars leave ~110 MB in a worker, 100k chars ~3 MB
TASK_TIMEOUT_S = 30.0  # a worker that holds one text longer (plus the time below) is hung
MIN_CHARS_PER_S = 100_000  # each text also gets 1 s per this many chars (~7x slower than here)
START_TIMEOUT_S = 60.0  # a new worker must have loaded its tokenizer by then
WORKERS = 1

_worker_state: dict[str, Any] = {}  # in the worker process only


def _worker_init(model_dir: str) -> None:
    from tokenizers import Tokenizer as Backend

    _worker_state["model_dir"] = model_dir
    _worker_state["backend"] = Backend.from_file(str(Path(model_dir) / "tokenizer.json"))


def _worker_encode(text: str, add_special_tokens: bool) -> list[int]:
    return _worker_state["backend"].encode(text, add_special_tokens=add_special_tokens).ids


def _worker_tokenize_json(text: str, add_special_tokens: bool, max_model_len: int) -> bytes:
    """``/tokenize``'s whole response body, serialized here rather than on the event loop."""
    ids = _worker_encode(text, add_special_tokens)
    body = {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}
    return json.dumps(body, separators=(",", ":")).encode()


def _worker_chat(messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
    tokenizer = _worker_state.get("tokenizer")
    if tokenizer is None:  # the chat template needs the full wrapper (imports torch): load once
        from tailserve.executors.pytorch.tokenizer import Tokenizer

        tokenizer = _worker_state["tokenizer"] = Tokenizer.from_dir(_worker_state["model_dir"])
        _worker_state["baseline"] = _rss_bytes()  # torch's import is not a huge text's leftovers
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


_WORKER_FUNCTIONS = {
    "encode": _worker_encode,
    "tokenize_json": _worker_tokenize_json,
    "chat": _worker_chat,
}


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux: the peak, in KiB (bytes on macOS)
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def _exit_with_parent(parent_pid: int) -> None:
    """Make this worker die with the server, however the server ends."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG: the kernel kills us with it
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(0)

    def watch() -> None:  # elsewhere, or if prctl failed: an orphan's parent pid changes
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="tokenizer-parent-watch", daemon=True).start()


def _worker_main(config: dict[str, Any]) -> None:
    """A worker process: load the tokenizer, say ``ready``, then answer ``(function, args)``
    messages with ``(status, value, bytes grown)`` until the server closes the socket."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's; the server stops us
    _exit_with_parent(config["parent_pid"])
    conn = Connection(config["fd"])
    try:
        _worker_init(config["model_dir"])
    except Exception as error:
        conn.send(("failed", f"{type(error).__name__}: {error}"))
        return
    _worker_state["baseline"] = _rss_bytes()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            name, args = conn.recv()
        except (EOFError, OSError):
            return  # the server closed its end, or is gone
        try:
            reply = ("ok", _WORKER_FUNCTIONS[name](*args))
        except Exception as error:
            reply = ("error", _portable(error))
        try:
            conn.send((*reply, _rss_bytes() - _worker_state["baseline"]))
        except OSError:
            return


def _portable(error: Exception) -> Exception:
    """``error`` if the server can unpickle it, else a ValueError that says the same (an
    exception whose ``__init__`` does not take its own ``args`` back cannot be rebuilt there)."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return ValueError(f"{type(error).__name__}: {error}")
    return error


_BOOTSTRAP = (
    "import json, sys; config = json.loads(sys.argv[1]); sys.path[:] = config['path']; "
    "from tailserve.server.tokenize_pool import _worker_main; _worker_main(config)"
)


class WorkerFailed(Exception):
    """A worker could not answer a request: it died, hung, failed to start, or the pool closed."""

    def __init__(self, message: str, *, shutting_down: bool = False) -> None:
        super().__init__(message)
        self.shutting_down = shutting_down


class _Worker:
    """One worker process and the server's end of its socket; used by one supervisor thread."""

    def __init__(self, model_dir: str) -> None:
        self.sock, child_end = socket.socketpair()
        with child_end:
            config = {
                "fd": child_end.fileno(),
                "parent_pid": os.getpid(),
                "model_dir": model_dir,
                "path": sys.path,
            }
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", _BOOTSTRAP, json.dumps(config)],
                    pass_fds=(child_end.fileno(),),
                    stdin=subprocess.DEVNULL,
                )
            except BaseException:
                self.sock.close()
                raise
        self.pid = self.proc.pid
        self.conn = Connection(os.dup(self.sock.fileno()))
        self.ready = False
        self.tasks = 0

    def call(self, name: str, args: tuple[Any, ...], timeout: float) -> tuple[str, Any, int]:
        if not self.ready:
            status, detail = self._receive(START_TIMEOUT_S, "start")
            if status != "ready":
                raise WorkerFailed(f"the tokenizer worker could not start: {detail}")
            self.ready = True
        # A worker that stopped reading must not hold this thread in a send of a long text either.
        self._send_timeout(timeout)
        try:
            self.conn.send((name, args))
        except OSError:
            raise WorkerFailed(self._gone(timeout, "take the text")) from None
        return self._receive(timeout, "answer")

    def _receive(self, timeout: float, what: str) -> Any:
        try:
            if self.conn.poll(timeout):
                return self.conn.recv()
        except (EOFError, OSError):
            raise WorkerFailed(self._gone(timeout, what)) from None
        raise WorkerFailed(f"the tokenizer worker did not {what} within {timeout:.1f} s (killed)")

    def _gone(self, timeout: float, what: str) -> str:
        if self.proc.poll() is None:
            try:
                self.proc.wait(1.0)
            except subprocess.TimeoutExpired:
                return f"the tokenizer worker did not {what} within {timeout:.1f} s (killed)"
        code = self.proc.returncode
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return f"the tokenizer worker died ({how})"

    def _send_timeout(self, seconds: float) -> None:
        whole = int(seconds)
        try:
            timeval = struct.pack("@ll", whole, int((seconds - whole) * 1e6))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        except (OSError, struct.error):
            pass

    def alive(self) -> bool:
        """Running, and (once ready) silent while idle: end of file there means it is exiting."""
        if self.proc.poll() is not None:
            return False
        try:
            return not (self.ready and self.conn.poll(0))
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    def discard(self) -> None:
        """Kill, reap, close: nothing of this worker is left."""
        self.kill()
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:  # uninterruptible for now: subprocess reaps it later
            logger.warning("tokenizer worker %d did not exit within 5 s of SIGKILL", self.pid)
        self.conn.close()
        self.sock.close()


@dataclass
class _Task:
    name: str
    args: tuple[Any, ...]
    timeout: float
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)


class WorkerPool:
    """Worker processes, each owned by a supervisor thread; ``submit`` returns a future that is
    always answered: the result, the function's exception, or ``WorkerFailed``.

    Threads and workers start on the first ``submit``. A worker whose memory grew more than
    ``recycle_growth_bytes`` (or that ran ``max_tasks_per_worker`` tasks, if given) is replaced
    right after its answer, by a worker started at once; a dead one before its next task."""

    def __init__(
        self,
        model_dir: str,
        *,
        workers: int = WORKERS,
        recycle_growth_bytes: int = RECYCLE_AFTER_GROWTH_BYTES,
        max_tasks_per_worker: int | None = None,
    ) -> None:
        self.model_dir = model_dir
        self.num_workers = workers
        self.recycle_growth_bytes = recycle_growth_bytes
        self.max_tasks_per_worker = max_tasks_per_worker
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._workers: set[_Worker] = set()
        self._closed = False
        self.started = 0  # workers started, for tests and logs

    def submit(self, name: str, args: tuple[Any, ...], timeout: float) -> concurrent.futures.Future[Any]:
        task = _Task(name, args, timeout)
        with self._lock:
            if self._closed:
                raise WorkerFailed("the server is shutting down", shutting_down=True)
            if not self._threads:
                for i in range(self.num_workers):
                    thread = threading.Thread(target=self._supervise, name=f"tokenizer-{i}", daemon=True)
                    thread.start()
                    self._threads.append(thread)
            self._tasks.put(task)
        return task.future

    def worker_pids(self) -> list[int]:
        with self._lock:
            return sorted(worker.pid for worker in self._workers)

    def close(self, timeout: float = 5.0) -> None:
        """Answer every queued request, kill and reap every worker; returns within ``timeout``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads, workers = list(self._threads), list(self._workers)
        while True:
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                break
            if task is not None:
                self._fail(task, WorkerFailed("the server is shutting down", shutting_down=True))
        for _ in threads:
            self._tasks.put(None)
        for worker in workers:
            worker.kill()  # its supervisor answers the request it held and reaps it
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _supervise(self) -> None:
        worker: _Worker | None = None
        try:
            while (task := self._tasks.get()) is not None:
                if task.future.set_running_or_notify_cancel():  # else its client went away
                    worker = self._run(task, worker)
        finally:
            if worker is not None:
                self._retire(worker)

    def _run(self, task: _Task, worker: _Worker | None) -> _Worker | None:
        """Answer ``task`` on ``worker`` (started or replaced as needed); returns the worker for
        the next task."""
        try:
            if worker is not None and not worker.alive():
                logger.warning("tokenizer worker %d died while idle: replaced", worker.pid)
                self._retire(worker)
                worker = None
            if worker is None:
                worker = self._start()
            status, value, grown = worker.call(task.name, task.args, task.timeout)
        except Exception as error:  # WorkerFailed, or a bug here: never leave the future waiting
            if worker is not None:
                self._retire(worker)
            if self._closed:
                failure = WorkerFailed("the server is shutting down", shutting_down=True)
            elif isinstance(error, WorkerFailed):
                logger.warning("tokenizer: %s; a new worker takes the next text", error)
                failure = error
            else:
                logger.exception("tokenizer worker supervisor failed")
                failure = WorkerFailed(f"the tokenizer worker pool failed ({type(error).__name__})")
            self._fail(task, failure)
            return None
        worker.tasks += 1
        if status == "ok":
            task.future.set_result(value)
        else:
            task.future.set_exception(value)
        limit = self.max_tasks_per_worker
        if grown > self.recycle_growth_bytes or (limit is not None and worker.tasks >= limit):
            self._retire(worker)
            with contextlib.suppress(WorkerFailed):
                return self._start()  # it loads while this thread waits for the next text
            return None
        return worker

    def _start(self) -> _Worker:
        if self._closed:
            raise WorkerFailed("the server is shutting down", shutting_down=True)
        try:
            worker = _Worker(self.model_dir)
        except OSError as error:
            raise WorkerFailed(f"the tokenizer worker could not start: {error}") from None
        with self._lock:
            if not self._closed:  # else close() has already killed the workers it knew
                self._workers.add(worker)
                self.started += 1
                return worker
        worker.discard()
        raise WorkerFailed("the server is shutting down", shutting_down=True)

    def _retire(self, worker: _Worker) -> None:
        with self._lock:
            self._workers.discard(worker)
        worker.discard()

    @staticmethod
    def _fail(task: _Task, failure: WorkerFailed) -> None:
        if task.future.running() or task.future.set_running_or_notify_cancel():
            task.future.set_exception(failure)


def longest_token_bytes(tokenizer: Any) -> int:
    """UTF-8 length of the longest vocabulary entry: an upper bound on the bytes one token covers
    (byte-level BPE writes one byte as one char of up to 2 UTF-8 bytes; ``<0x0A>`` is 6)."""
    backend = getattr(tokenizer, "_backend", None)
    if backend is not None:
        vocab = backend.get_vocab(with_added_tokens=True)
        return max(len(token.encode("utf-8", "surrogatepass")) for token in vocab)
    return max(
        len(tokenizer.decode([i]).encode("utf-8", "surrogatepass")) for i in range(tokenizer.vocab_size)
    )


class PromptTokenizer:
    """Async encoding for the HTTP handlers; ``close`` stops the worker processes.

    Every call returns or raises: a 400 ``ApiError`` for text that cannot be tokenized, a 503 one
    when the worker died or hung on it (a fresh worker takes the next text) or the server is
    shutting down."""

    def __init__(
        self,
        tokenizer: Any,
        model_dir: str,
        max_model_len: int,
        *,
        inline_limit_chars: int = INLINE_LIMIT_CHARS,
        task_timeout_s: float = TASK_TIMEOUT_S,
        workers: int = WORKERS,
        recycle_growth_bytes: int = RECYCLE_AFTER_GROWTH_BYTES,
        max_tasks_per_worker: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.inline_limit_chars = inline_limit_chars
        self.task_timeout_s = task_timeout_s
        self.max_prompt_bytes = max_model_len * longest_token_bytes(tokenizer)
        self.pool = WorkerPool(
            model_dir,
            workers=workers,
            recycle_growth_bytes=recycle_growth_bytes,
            max_tasks_per_worker=max_tasks_per_worker,
        )

    def check_prompt_size(self, text: str, param: str) -> None:
        """Refuse text that cannot fit in the context whatever it tokenizes to."""
        if len(text) * 4 <= self.max_prompt_bytes:
            return  # at most 4 bytes per character: certainly within the bound
        num_bytes = len(text.encode("utf-8", "surrogatepass"))
        if num_bytes > self.max_prompt_bytes:
            raise _api_error(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"prompt is {num_bytes} bytes, more than {self.max_model_len} tokens of this "
                f"tokenizer can hold ({self.max_prompt_bytes} bytes). Please reduce the length of "
                "the prompt.",
                param=param,
            )

    async def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        if len(text) <= self.inline_limit_chars:
            call = asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        else:
            call = self._in_worker(len(text), "encode", text, add_special_tokens)
        return await self._checked(call, param)

    async def tokenize_json(self, text: str, add_special_tokens: bool) -> bytes | None:
        """``/tokenize``'s body for a long text (from the worker); None: short, do it inline."""
        if len(text) <= self.inline_limit_chars:
            return None
        call = self._in_worker(len(text), "tokenize_json", text, add_special_tokens, self.max_model_len)
        return await self._checked(call, "prompt")

    async def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        from tailserve.server.protocol import ApiError

        size = sum(len(m.get("content") or "") for m in messages)
        try:
            if size <= self.inline_limit_chars:
                return await asyncio.to_thread(self._chat_inline, messages, add_generation_prompt)
            return await self._in_worker(size, "chat", messages, add_generation_prompt)
        except WorkerFailed as failure:
            raise _unavailable(failure, "messages") from None
        except ApiError:
            raise
        except Exception as error:  # a template may refuse a conversation (roles, order)
            raise _api_error(f"messages: the chat template failed: {error}", param="messages") from None

    def _chat_inline(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def _checked(self, call: Any, param: str) -> Any:
        try:
            return await call
        except WorkerFailed as failure:
            raise _unavailable(failure, param) from None
        except (UnicodeError, ValueError, TypeError) as error:
            raise _api_error(f"{param}: cannot be tokenized: {error}", param=param) from None

    def _in_worker(self, num_chars: int, name: str, *args: Any) -> asyncio.Future[Any]:
        timeout = self.task_timeout_s + num_chars / MIN_CHARS_PER_S
        try:
            future = self.pool.submit(name, args, timeout)
        except WorkerFailed as failure:
            future = concurrent.futures.Future()
            future.set_exception(failure)
        return asyncio.wrap_future(future)

    def close(self) -> None:
        self.pool.close()


def _api_error(message: str, *, status: int = 400, param: str | None = None) -> Exception:
    from tailserve.server.protocol import ApiError  # here: a worker process imports this module

    return ApiError(message, status=status, param=param)


def _unavailable(failure: WorkerFailed, param: str) -> Exception:
    if failure.shutting_down:
        return _api_error("the server is shutting down", status=503)
    return _api_error(f"{param}: could not be tokenized: {failure}; retry the request", status=503)
