"""Prompt tokenization off the event loop and off the engine thread, with a size check first.

The ``tokenizers`` library holds the GIL while it encodes (measured here: a 1 MB string blocks
every other Python thread for the whole ~1 s), so a worker *thread* would still stall every
stream. Short texts (up to ``inline_limit_chars``, a few milliseconds) are encoded in a thread;
longer ones go to a worker *process* that loads the tokenizer once, so the server's event loop
and engine thread keep running, and the memory a huge encoding takes (~0.9 GB for 10 MB of text)
is the worker's: a worker that encoded more than ``RECYCLE_AFTER_CHARS`` characters is replaced
at once (its memory goes back to the system), any other after ``MAX_TASKS_PER_WORKER`` tasks.

Before any of that, a prompt whose UTF-8 length is over ``max_model_len`` x the longest token's
UTF-8 length cannot fit in the context whatever it tokenizes to (each token covers at most that
many bytes; a normalizer that deletes characters is the one exception) and is refused at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import multiprocessing
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from tailserve.server.protocol import ApiError

INLINE_LIMIT_CHARS = 8192  # ~3 ms of encoding on this CPU: fine in a thread
MAX_TASKS_PER_WORKER = 16  # recycle the worker process now and then
RECYCLE_AFTER_CHARS = 2**20  # a text this long leaves ~100 MB in the worker: replace it at once

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
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


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
    """Async encoding for the HTTP handlers; ``close`` stops the worker process."""

    def __init__(
        self,
        tokenizer: Any,
        model_dir: str,
        max_model_len: int,
        *,
        inline_limit_chars: int = INLINE_LIMIT_CHARS,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.inline_limit_chars = inline_limit_chars
        self.max_prompt_bytes = max_model_len * longest_token_bytes(tokenizer)
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def check_prompt_size(self, text: str, param: str) -> None:
        """Refuse text that cannot fit in the context whatever it tokenizes to."""
        if len(text) * 4 <= self.max_prompt_bytes:
            return  # at most 4 bytes per character: certainly within the bound
        num_bytes = len(text.encode("utf-8", "surrogatepass"))
        if num_bytes > self.max_prompt_bytes:
            raise ApiError(
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
            call = self._in_worker(_worker_encode, text, add_special_tokens)
        try:
            return await self._checked(call, param)
        finally:
            self._recycle_after(len(text))

    async def tokenize_json(self, text: str, add_special_tokens: bool) -> bytes | None:
        """``/tokenize``'s body for a long text (from the worker); None: short, do it inline."""
        if len(text) <= self.inline_limit_chars:
            return None
        call = self._in_worker(_worker_tokenize_json, text, add_special_tokens, self.max_model_len)
        try:
            return await self._checked(call, "prompt")
        finally:
            self._recycle_after(len(text))

    async def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        size = sum(len(m.get("content") or "") for m in messages)
        try:
            if size <= self.inline_limit_chars:
                return await asyncio.to_thread(self._chat_inline, messages, add_generation_prompt)
            return await self._in_worker(_worker_chat, messages, add_generation_prompt)
        except BrokenProcessPool:
            self._pool = None
            raise
        except Exception as error:  # a template may refuse a conversation (roles, order)
            raise ApiError(f"messages: the chat template failed: {error}", param="messages") from None

    def _chat_inline(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def _checked(self, call: Any, param: str) -> Any:
        try:
            return await call
        except BrokenProcessPool:
            self._pool = None  # the worker died (killed for memory?): a new one next time
            raise
        except (UnicodeError, ValueError, TypeError) as error:
            raise ApiError(f"{param}: cannot be tokenized: {error}", param=param) from None

    def _in_worker(self, fn: Any, *args: Any) -> asyncio.Future[Any]:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=1,
                # spawn: forking a process that runs an engine thread (and torch) is unsafe
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_init,
                initargs=(self.model_dir,),
                max_tasks_per_child=MAX_TASKS_PER_WORKER,
            )
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _recycle_after(self, num_chars: int) -> None:
        if num_chars > RECYCLE_AFTER_CHARS and self._pool is not None:
            # Texts already queued on this worker still run; the next one spawns a fresh worker.
            pool, self._pool = self._pool, None
            pool.shutdown(wait=False, cancel_futures=False)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
