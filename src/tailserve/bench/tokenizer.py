"""The benchmark's own view of the served model's tokenizer (a Hugging Face ``tokenizer.json``).

The client needs one to build prompts of exact token lengths, to measure ShareGPT lengths and
to count output tokens when a server sends no ``usage``. It reads the file with the
``tokenizers`` library only, so the load generator stays light (no torch, no transformers).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer


@dataclass(frozen=True, slots=True)
class BenchTokenizer:
    path: str
    tokenizer: Tokenizer
    special_ids: frozenset[int]

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens (BOS), as vLLM's benchmark counts them."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def normal_ids(self) -> list[int]:
        """Every id that is not a special token: what random prompts are drawn from."""
        return [i for i in range(self.vocab_size) if i not in self.special_ids]


def load_tokenizer(path: str | Path) -> BenchTokenizer:
    """Load ``tokenizer.json`` from a model directory (or the file itself)."""
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise ValueError(
            f"no tokenizer at {path}: expected a model directory with tokenizer.json (pass --tokenizer DIR)"
        )
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as error:  # the library raises a bare Exception for unreadable files
        raise ValueError(f"{file}: not a Hugging Face tokenizer.json ({error})") from None
    special = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
    return BenchTokenizer(str(p), tokenizer, special)


def find_tokenizer(candidates: list[str | None]) -> BenchTokenizer | None:
    """The first candidate that is a local model directory with a tokenizer, if any."""
    for candidate in candidates:
        if candidate and (Path(candidate) / "tokenizer.json").is_file():
            return load_tokenizer(candidate)
    return None
