"""A model directory's tokenizer, behaving like ``transformers.AutoTokenizer`` on the same files.

``tokenizer.json`` is run by the ``tokenizers`` library (the engine under Hugging Face's fast
tokenizers); ``tokenizer_config.json`` supplies what transformers layers on top, reproduced here:

- BOS/EOS: the post-processor in ``tokenizer.json`` decides (Llama 2/3 and Mistral prepend BOS
  there, Qwen2 adds nothing). transformers 5.x drops ``add_bos_token`` / ``add_eos_token`` from
  ``tokenizer_config.json`` whenever a ``tokenizer.json`` exists, and so does this class.
- Chat templates render in a sandboxed jinja2 environment set up like transformers' (trim_blocks,
  lstrip_blocks, loop controls, ``tojson``, ``raise_exception``, ``strftime_now``), with the special
  tokens as variables. The rendered string already holds BOS where the template puts it, so it is
  encoded with ``add_special_tokens=False`` (as transformers and vLLM do).

``IncrementalDetokenizer`` turns a stream of token ids into text the way vLLM does: it re-decodes a
short window of recent tokens and emits only text that has stopped changing, so a multi-byte
character split across tokens is never emitted half-done.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tailserve.executors.pytorch.loader import ModelLoadError

# Used when a model directory has no chat template (transformers would refuse; a plain
# "role: content" transcript keeps chat endpoints usable).
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as written in a config: a string or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _compile_template(source: str) -> Any:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        # transformers' override: no HTML escaping, optional indent
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not parse: {e}") from None


class Tokenizer:
    """Encode, decode and chat-format text for one model directory."""

    def __init__(
        self,
        backend: Any,
        config: dict[str, Any],
        eos_token_ids: tuple[int, ...],
        chat_template: str | None,
    ) -> None:
        self._backend = backend  # tokenizers.Tokenizer
        self._special = {n: t for n in _SPECIAL_NAMES if (t := _token_text(config.get(n))) is not None}
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        bos = self._special.get("bos_token")
        self.bos_token_id: int | None = backend.token_to_id(bos) if bos else None
        self.eos_token_ids: tuple[int, ...] = eos_token_ids
        self.chat_template: str = chat_template or DEFAULT_CHAT_TEMPLATE
        self._template: Any = None  # compiled on first use
        # transformers ignores clean_up_tokenization_spaces for BPE models (it corrupts their output).
        is_bpe = type(backend.model).__name__ == "BPE"
        self._clean_up = bool(config.get("clean_up_tokenization_spaces")) and not is_bpe

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Read ``tokenizer.json`` (required), ``tokenizer_config.json``, ``special_tokens_map.json``,
        ``chat_template.jinja`` and the EOS ids of ``generation_config.json`` when present."""
        from tokenizers import Tokenizer as Backend

        root = Path(model_dir).expanduser()
        path = root / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(
                f"{path}: file not found (tailserve needs a fast tokenizer's tokenizer.json)"
            )
        try:
            backend = Backend.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception for malformed files
            raise ModelLoadError(f"{path}: not a tokenizers file ({e})") from None
        config: dict[str, Any] = {}
        # tokenizer_config.json wins over special_tokens_map.json, as in transformers.
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            if (root / name).is_file():
                config.update(_read_json(root / name))
        eos: list[int] = []
        eos_text = _token_text(config.get("eos_token"))
        if eos_text is not None and backend.token_to_id(eos_text) is not None:
            eos.append(backend.token_to_id(eos_text))
        if (root / "generation_config.json").is_file():
            value = _read_json(root / "generation_config.json").get("eos_token_id")
            eos += [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)]
        return cls(backend, config, tuple(dict.fromkeys(eos)), _chat_template(root, config))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS/EOS as tokenizer.json's post-processor does."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # A list goes as it is (the detokenizer's slices, two a token per request): no copy.
        text = self._backend.decode(
            ids if type(ids) is list else list(ids), skip_special_tokens=skip_special_tokens
        )
        return _clean_up_tokenization(text) if self._clean_up else text

    def decoder(self, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
        """``decode`` of a list with ``skip_special_tokens`` bound, for a caller that decodes
        often (the detokenizer: twice a token per request, 128 calls a decode step at batch
        64): straight into the Rust tokenizer where no clean-up applies, without this frame."""
        if self._clean_up:
            return functools.partial(self.decode, skip_special_tokens=skip_special_tokens)
        return functools.partial(self._backend.decode, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt string for ``messages`` (``[{"role": ..., "content": ...}, ...]``)."""
        import jinja2

        if self._template is None:
            self._template = _compile_template(self.chat_template)
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._special
            )
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template: {e}") from None

    def detokenizer(
        self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        """A detokenizer for one request's output; ``prompt_ids`` give it context (a leading space)."""
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


def _chat_template(root: Path, config: dict[str, Any]) -> str | None:
    # transformers 5.x saves the template beside the config and prefers that file.
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


def _clean_up_tokenization(text: str) -> str:
    # transformers' clean_up_tokenization, for WordPiece-style decoders
    for old, new in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                     (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):  # fmt: skip
        text = text.replace(old, new)
    return text


class IncrementalDetokenizer:
    """Text of one request's output tokens as they arrive (vLLM's prefix/read offsets).

    ``push`` decodes ``ids[prefix_offset:]`` and ``ids[prefix_offset:read_offset]``; the difference
    is new text unless it ends in U+FFFD (an incomplete UTF-8 sequence), in which case it waits for
    the next token. ``text`` is everything emitted; ``flush()`` emits what is still held back when
    the request ends (bytes that never completed a character).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._decode = tokenizer.decoder(skip_special_tokens)
        self._ids: list[int] = list(prompt_ids)
        # A few prompt tokens of context, so the first output token decodes as it would mid-text.
        self._prefix_offset = max(len(self._ids) - 5, 0)
        self._read_offset = len(self._ids)
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completed ("" while a character is incomplete)."""
        ids = self._ids
        ids.append(token_id)
        prefix = self._decode(ids[self._prefix_offset : self._read_offset])
        full = self._decode(ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += new
        return new

    def flush(self) -> str:
        """Emit whatever ``push`` held back (an incomplete character decodes as U+FFFD)."""
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tokenizer.decode(self._ids[self._prefix_offset :], self._skip)
        new = full[len(prefix) :] if len(full) > len(prefix) else ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += new
        return new
