"""pagefleet.tokenizer.Tokenizer against transformers.AutoTokenizer on the same directory."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from pagefleet.engine.tiny import ensure_tiny_checkpoint
from pagefleet.presets import tiny_tokenizer
from pagefleet.tokenizer import ChatTemplateError, Tokenizer

TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "café naïve façade — “quotes” …",
    "日本語のテキストと中文文本, 한국어 텍스트",
    "emoji 🙂🚀 and a family 👨‍👩‍👧 and flags 🇫🇷",
    "numbers 3.14159 and 1,000,000 and 2026-11-29",
    "<s> special </s> inside <|im_start|>user\nhi<|im_end|> text",
    "def f(x):\n    return {'a': [x, x ** 2]}  # code",
    "unseen words: zyzzyva quixotic xylophone",
    "a" * 300,
]
MESSAGES = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2? 🙂"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 日本?"},
    ],
]


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


# Llama style (BOS, GPT-2 split) and Qwen style (no BOS, digit split, NFC); transformers
# loads the Qwen ones through its own Qwen2Tokenizer, so this checks we match that too.
@pytest.fixture(scope="module", params=["tiny", "tiny-qwen2", "tiny-qwen3"])
def tok_dir(request: pytest.FixtureRequest, model_root: Path) -> Path:
    return ensure_tiny_checkpoint(request.param, model_root)


@pytest.fixture(scope="module")
def ours(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def hf(tok_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(tok_dir)


def test_vocab_and_special_tokens(ours: Tokenizer, hf) -> None:
    assert 1000 <= ours.vocab_size <= 2000
    assert ours.vocab_size == len(hf)
    assert ours.bos_token_id == hf.bos_token_id
    if ours.bos_token_id is None:  # Qwen style
        assert ours.eos_token_ids == [
            ours.token_to_id("<|im_end|>"),
            ours.token_to_id("<|endoftext|>"),
        ]
    else:
        assert ours.bos_token_id == ours.token_to_id("<s>")
        assert ours.eos_token_ids == [ours.token_to_id("</s>"), ours.token_to_id("<|im_end|>")]
    assert hf.eos_token_id == ours.eos_token_ids[0]
    assert set(hf.all_special_ids) <= ours.all_special_ids
    assert ours.model_max_length == hf.model_max_length == tiny_tokenizer.MODEL_MAX_LENGTH


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_autotokenizer(ours: Tokenizer, hf, text: str) -> None:
    for add in (True, False):
        ids = ours.encode(text, add_special_tokens=add)
        assert ids == hf.encode(text, add_special_tokens=add)
    ids = ours.encode(text)
    n_bos = 0 if ours.bos_token_id is None else 1
    assert ids[:n_bos] == ([ours.bos_token_id] if n_bos else [])
    assert ours.encode(text, add_special_tokens=False) == ids[n_bos:]
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
            ids, skip_special_tokens=skip
        )
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    # Byte-level: everything round-trips (up to NFC for Qwen), special-token text included.
    assert ours.decode(ids[n_bos:], skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_special_tokens_are_single_ids(ours: Tokenizer) -> None:
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == ours.token_to_id("<|im_start|>")
    assert ids[-1] == ours.token_to_id("<|im_end|>")
    assert ours.decode(ids) == "user\nhi"


def test_partial_utf8_decodes_to_replacement(ours: Tokenizer) -> None:
    ids = ours.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # one emoji spans several byte-level tokens
    assert "\ufffd" in ours.decode(ids[:1])
    assert ours.decode(ids) == "🙂"


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60))
def test_any_unicode_round_trips_like_autotokenizer(ours: Tokenizer, hf, text: str) -> None:
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == hf.encode(text, add_special_tokens=False)
    expected = text if ours.bos_token_id is not None else unicodedata.normalize("NFC", text)
    assert ours.decode(ids, skip_special_tokens=False) == expected
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_autotokenizer(
    ours: Tokenizer, hf, messages: list[dict], add_generation_prompt: bool
) -> None:
    mine = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert mine == theirs
    assert mine.startswith("<|im_start|>")
    assert mine.endswith("<|im_start|>assistant\n") == add_generation_prompt
    assert not ours.template_adds_bos
    # At most one BOS when encoded with special tokens: the template does not add its own.
    if ours.bos_token_id is not None:
        assert ours.encode(mine).count(ours.bos_token_id) == 1


def test_chat_template_raise_exception(ours: Tokenizer, hf) -> None:
    bad = [{"role": "wizard", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="Unknown role: wizard"):
        ours.apply_chat_template(bad)
    with pytest.raises(Exception, match="Unknown role: wizard"):
        hf.apply_chat_template(bad, tokenize=False)


def test_chat_template_is_sandboxed(tok_dir: Path, tmp_path: Path) -> None:
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages.__class__.__mro__ }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        Tokenizer.from_dir(tmp_path).apply_chat_template(MESSAGES[0])


def test_chat_template_from_jinja_file(tok_dir: Path, tmp_path: Path, ours: Tokenizer) -> None:
    # Newer checkpoints keep the template in chat_template.jinja instead of the config.
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    template = cfg.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").write_text(template)
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    other = Tokenizer.from_dir(tmp_path)
    assert other.apply_chat_template(MESSAGES[1]) == ours.apply_chat_template(MESSAGES[1])
    # Without generation_config.json/config.json the EOS id is tokenizer_config's eos_token.
    assert other.eos_token_ids == [ours.eos_token_ids[0]]


def test_no_chat_template(tok_dir: Path, tmp_path: Path) -> None:
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="no chat_template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template(MESSAGES[0])


@pytest.mark.parametrize("style", tiny_tokenizer.STYLES)
def test_training_is_deterministic(style: str) -> None:
    a = tiny_tokenizer.build_tokenizer(style).to_str()
    b = tiny_tokenizer.build_tokenizer(style).to_str()
    assert hashlib.sha256(a.encode()).hexdigest() == hashlib.sha256(b.encode()).hexdigest()


def test_qwen_style_splits_digits(model_root: Path) -> None:
    qwen = Tokenizer.from_dir(ensure_tiny_checkpoint("tiny-qwen2", model_root))
    llama = Tokenizer.from_dir(ensure_tiny_checkpoint("tiny", model_root))
    assert len(qwen.encode("2048", add_special_tokens=False)) == 4
    assert len(llama.encode("2048", add_special_tokens=False)) < 4
    assert qwen.encode("hi") == qwen.encode("hi", add_special_tokens=False)


def test_tokenizer_needs_neither_torch_nor_transformers(tok_dir: Path) -> None:
    """The gateway tokenizes with this module and must stay free of the engine's weight."""
    code = (
        "import sys\n"
        "from pagefleet.tokenizer import Tokenizer\n"
        "t = Tokenizer.from_dir(sys.argv[1])\n"
        "ids = t.encode(t.apply_chat_template([{'role': 'user', 'content': 'hi'}]))\n"
        "assert '<|im_start|>user' in t.decode(ids, skip_special_tokens=False)\n"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tok_dir)], check=True, timeout=60)


def test_reads_what_transformers_saves(ours: Tokenizer, hf, tmp_path: Path) -> None:
    """A directory written by transformers' save_pretrained (its own file layout, e.g. the
    template in chat_template.jinja) reads back to the same ids and prompts."""
    hf.save_pretrained(tmp_path)
    saved = Tokenizer.from_dir(tmp_path)
    for text in TEXTS:
        assert saved.encode(text) == ours.encode(text)
    for messages in MESSAGES:
        assert saved.apply_chat_template(messages) == ours.apply_chat_template(messages)
    assert saved.bos_token_id == ours.bos_token_id


def test_ids_beyond_the_vocab(ours: Tokenizer) -> None:
    # A model vocab padded past the tokenizer can emit such ids; they decode to nothing.
    ok = ours.encode("hi", add_special_tokens=False)
    beyond = ours.vocab_size + 10
    assert ours.decode([*ok, beyond]) == ours.decode(ok)
    assert ours.convert_ids_to_tokens([beyond]) == [""]
