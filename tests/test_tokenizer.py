"""Tokenizer matches transformers' AutoTokenizer on the same files; the incremental detokenizer matches decode."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from tailserve.executors.pytorch.init_model import init_model
from tailserve.executors.pytorch.loader import ModelLoadError
from tailserve.executors.pytorch.tokenizer import Tokenizer
from torch_helpers import edit_json

TEXTS = [
    "Hello world",
    "The scheduler admitted 12 requests at 09:45; p99 TTFT rose to 850 ms.",
    "Zoë ordered a café crème — for €4.50!",
    "안녕하세요. 연속 배칭을 켰는데 왜 p99가 튈까요?",
    "こんにちは 你好 Привет 🙂🚀",
    "  leading spaces,\ttabs\n\nand newlines  ",
    "<s> literal special tokens </s> and <|im_end|> inside text",
    "",
]
CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is p99 TTFT?"},
        {"role": "assistant", "content": "The 99th percentile of time to first token."},
        {"role": "user", "content": "Und auf Deutsch? ✓"},
    ],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(
        tmp_path_factory.mktemp("tok") / "m",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=512,
    )


@pytest.fixture
def copy_dir(model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model_dir, tmp_path / "copy"))


def _edit_tokenizer_config(model_dir: Path, **changes: object) -> None:
    edit_json(model_dir / "tokenizer_config.json", **changes)


def _hf(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_same_ids_text_and_chat_as_transformers(model_dir: Path) -> None:
    ours, hf = Tokenizer.from_dir(model_dir), _hf(model_dir)
    assert ours.vocab_size == len(hf) == 512
    assert (ours.bos_token_id, ours.eos_token_ids) == (1, (2, 4))
    assert hf.bos_token_id == 1 and hf.eos_token_id == 2
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert ids[0] == 1  # BOS, as this config asks
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
        assert (
            ours.decode(ids)
            == hf.decode(ids, skip_special_tokens=True)
            == text.replace("<s>", "").replace("</s>", "").replace("<|im_end|>", "")
        )
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    for messages in CHATS:
        for add_generation_prompt in (True, False):
            ours_text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            hf_text = hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert ours_text == hf_text
    assert (
        ours.apply_chat_template(CHATS[0])
        == "<s><|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    # The chat markers are single special tokens.
    assert ours.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)[0] == 3


def test_trained_merges_look_like_english(tmp_path: Path) -> None:
    big = init_model(
        tmp_path / "big",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=8192,
    )
    tok = Tokenizer.from_dir(big)
    # Common words are single tokens (with their leading space), so English needs few tokens per word.
    for word in (" the", " request", " scheduler", " because", " quickly"):
        assert len(tok.encode(word, add_special_tokens=False)) == 1, word
    text = "The gentle engineer finally measured the latency of every request in the queue."
    assert len(tok.encode(text, add_special_tokens=False)) <= len(text.split()) + 2


def test_tokenizer_json_decides_bos_and_eos_like_transformers(copy_dir: Path) -> None:
    # transformers 5.x drops add_bos_token / add_eos_token when tokenizer.json exists.
    _edit_tokenizer_config(copy_dir, add_bos_token=False, add_eos_token=True)
    ours, hf = Tokenizer.from_dir(copy_dir), _hf(copy_dir)
    for text in TEXTS[:4]:
        assert ours.encode(text) == hf(text)["input_ids"]
        assert ours.encode(text)[0] == 1 and ours.encode(text)[-1] != 2
    # With no post-processor in tokenizer.json nothing is added (a Qwen2-style tokenizer).
    path = copy_dir / "tokenizer.json"
    data = json.loads(path.read_text())
    data["post_processor"] = None
    path.write_text(json.dumps(data))
    ours, hf = Tokenizer.from_dir(copy_dir), _hf(copy_dir)
    for text in TEXTS[:4]:
        assert ours.encode(text) == hf(text)["input_ids"] == ours.encode(text, add_special_tokens=False)


def test_default_template_when_the_config_has_none(copy_dir: Path) -> None:
    _edit_tokenizer_config(copy_dir, chat_template=None)
    tok = Tokenizer.from_dir(copy_dir)
    assert tok.apply_chat_template(CHATS[0]) == "<s>user: Hi there\nassistant: "
    assert tok.apply_chat_template(CHATS[0], add_generation_prompt=False) == "<s>user: Hi there\n"


def test_chat_template_jinja_file_wins_and_template_errors_are_value_errors(copy_dir: Path) -> None:
    (copy_dir / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "[{{ m['role'] }}] {{ m['content'] | tojson }}{% endfor %}"
    )
    tok = Tokenizer.from_dir(copy_dir)
    assert tok.apply_chat_template([{"role": "user", "content": "é<b>"}]) == '[user] "é<b>"'
    with pytest.raises(ValueError, match="chat template: no tools"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    (copy_dir / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="chat template does not parse"):
        Tokenizer.from_dir(copy_dir).apply_chat_template(CHATS[0])


def test_template_is_sandboxed(copy_dir: Path) -> None:
    (copy_dir / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    tok = Tokenizer.from_dir(copy_dir)
    with pytest.raises(ValueError, match=r"chat template: .*unsafe"):
        tok.apply_chat_template(CHATS[0])


def test_missing_or_broken_tokenizer_json(copy_dir: Path) -> None:
    (copy_dir / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: not a tokenizers file"):
        Tokenizer.from_dir(copy_dir)
    (copy_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: file not found") as err:
        Tokenizer.from_dir(copy_dir)
    assert str(copy_dir) in str(err.value)


def test_incremental_detokenizer_equals_full_decode(model_dir: Path) -> None:
    tok = Tokenizer.from_dir(model_dir)
    rng = random.Random(0)
    multibyte = [tok.encode(t, add_special_tokens=False) for t in TEXTS[2:5]]
    held_back = 0
    for _ in range(300):
        if rng.random() < 0.5:
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        else:  # real multi-byte text, cut anywhere, with random tokens mixed in
            source = rng.choice(multibyte)
            start = rng.randrange(len(source))
            ids = [*source[start : start + rng.randint(1, 25)], rng.randrange(tok.vocab_size)]
        detok = tok.detokenizer()
        pieces = [detok.push(i) for i in ids]
        held_back += pieces.count("")
        pieces.append(detok.flush())
        assert "".join(pieces) == detok.text == tok.decode(ids), ids
    assert held_back > 50  # incomplete characters really were held back, not emitted half-done


def test_detokenizer_never_emits_half_a_character(model_dir: Path) -> None:
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode("안녕하세요 세계", add_special_tokens=False)
    assert len(ids) > len("안녕하세요 세계")  # a 512-token vocabulary splits Hangul into byte tokens
    detok = tok.detokenizer()
    for i in ids:
        piece = detok.push(i)
        assert "\ufffd" not in piece
    assert detok.text == "안녕하세요 세계"
    assert detok.flush() == ""


def test_detokenizer_with_prompt_context_and_special_tokens(model_dir: Path) -> None:
    tok = Tokenizer.from_dir(model_dir)
    prompt = tok.encode("The queue grew")
    output = [*tok.encode(" and then shrank.", add_special_tokens=False), 2]
    detok = tok.detokenizer(prompt_ids=prompt)
    text = "".join(detok.push(i) for i in output) + detok.flush()
    assert text == " and then shrank."
    detok = tok.detokenizer(skip_special_tokens=False)
    assert "".join(detok.push(i) for i in output) == " and then shrank.</s>"
