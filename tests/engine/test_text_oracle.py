"""The text a client gets for output token ids, against transformers' tokenizer.

The incremental detokenizer (streamed deltas, and the whole text, which is their join)
must give ``AutoTokenizer.decode(output ids)`` on byte-level vocabularies, whatever the
ids: random ones split characters across tokens and across the prompt/output boundary.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import transformers

from pagefleet.engine.detokenizer import IncrementalDetokenizer
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.tiny import ensure_tiny_checkpoint
from pagefleet.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def _stream(tok, prompt: list[int], ids: list[int], params: SamplingParams) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, params)
    deltas = []
    for t in ids:
        detok.add_token(t)
        deltas.append(detok.take_delta(finished=False))
    deltas.append(detok.take_delta(finished=True))
    assert "".join(deltas) == detok.text
    return deltas


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2"])
def test_random_ids_stream_to_transformers_decode(preset: str, model_root: Path) -> None:
    """Prompts that end inside a character (sent as ids) included: the context the first
    output token was decoded in held the character's first bytes, and the output lost or
    gained a U+FFFD against decode(ids) (6-8 in 300 random cases per preset)."""
    tok_dir = ensure_tiny_checkpoint(preset, model_root)
    ours = Tokenizer.from_dir(tok_dir)
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    rng = random.Random(0)
    for _ in range(300):
        prompt = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(0, 8))]
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 20))]
        for skip in (True, False):
            deltas = _stream(ours, prompt, ids, SamplingParams(skip_special_tokens=skip))
            assert "".join(deltas) == hf.decode(ids, skip_special_tokens=skip), (prompt, ids)


def test_prompt_ending_inside_a_character(model_root: Path) -> None:
    ours = Tokenizer.from_dir(ensure_tiny_checkpoint("tiny", model_root))
    ids = ours.encode("say 東京 now", add_special_tokens=False)
    # Cut where the decoded prefix ends in U+FFFD: inside 東's or 京's bytes.
    cut = next(i for i in range(1, len(ids)) if ours.decode(ids[:i]).endswith("\ufffd"))
    prompt, output = ids[:cut], ids[cut:]
    deltas = _stream(ours, prompt, output, SamplingParams())
    assert "".join(deltas) == ours.decode(output)
    assert "".join(deltas).endswith("京 now")


def test_decode_keeps_spaces_before_punctuation(tmp_path: Path, model_root: Path) -> None:
    """Llama 3's tokenizer_config says clean_up_tokenization_spaces: true. transformers
    ignores that for BPE vocabularies (the clean-up is WordPiece's); pagefleet applied it,
    so "x , y" came out "x, y", and streamed, "I 'm" lost its "m" for good."""
    src = ensure_tiny_checkpoint("tiny", model_root)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["clean_up_tokenization_spaces"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "Hello , world . I 'm fine ! Is it ? a , b"
    ids = ours.encode(text, add_special_tokens=False)
    assert hf.decode(ids) == text
    assert ours.decode(ids) == text
    assert "".join(_stream(ours, ours.encode("Q:"), ids, SamplingParams())) == text


def test_chat_template_with_a_generation_block(tmp_path: Path, model_root: Path) -> None:
    """transformers' {% generation %} tag (TRL's training templates mark the assistant's
    text with it): the template failed to compile here, refusing every chat request."""
    src = ensure_tiny_checkpoint("tiny", model_root)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' %}{% generation %}{% set x = 1 %}{{ m.content }}"
        "<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n"
        "{% endfor %}{% if x is defined %}leaked{% endif %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [
        {"role": "user", "content": "Hi 🎉"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Again"},
    ]
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "Hello<|im_end|>" in want and "leaked" not in want
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == want


def test_a_template_that_spells_out_bos_gets_one(tmp_path: Path, model_root: Path) -> None:
    """A template writing "<s>" literally (not through bos_token) was encoded with the
    tokenizer's own BOS on top: two BOS where transformers' chat ids have one."""
    src = ensure_tiny_checkpoint("tiny", model_root)  # its post-processor prepends <s>
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "<s>{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "Hi"}]
    text = ours.apply_chat_template(messages, add_generation_prompt=True)
    ids = ours.encode(text, add_special_tokens=not ours.template_adds_bos)
    want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert ids == list(want)
    assert ids.count(ours.bos_token_id) == 1
