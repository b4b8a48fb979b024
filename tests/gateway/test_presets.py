"""The gateway's torch-free tokenizers (pagefleet.presets) equal the daemon's, preset by preset.

If they differed, the gateway's block keys would never match the daemons' and cache-aware
routing would route blind; so each preset's tokenizer is compared, on plain text and on
rendered chat, with the one the engine reads from the preset's checkpoint directory.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagefleet.engine.tiny import PRESETS, ensure_tiny_checkpoint
from pagefleet.presets import TOKENIZER_PRESETS, load_tokenizer
from pagefleet.tokenizer import Tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Numbers 12345 and ünïcödé, tabs\tand\nnewlines  ",
    "<|im_start|>user\nliteral markers<|im_end|>",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me a story about a cat."},
]


def test_every_engine_preset_has_a_torch_free_tokenizer() -> None:
    assert set(PRESETS) <= set(TOKENIZER_PRESETS)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_tokenizer_equals_the_checkpoints(preset: str) -> None:
    ours = load_tokenizer(preset)
    engine = Tokenizer.from_dir(ensure_tiny_checkpoint(preset))
    assert ours.vocab_size == engine.vocab_size
    assert ours.eos_token_ids == engine.eos_token_ids
    assert ours.template_adds_bos == engine.template_adds_bos
    for text in TEXTS:
        assert ours.encode(text) == engine.encode(text)
        assert ours.encode(text, add_special_tokens=False) == engine.encode(
            text, add_special_tokens=False
        )
    rendered = ours.apply_chat_template(CHAT, add_generation_prompt=True)
    assert rendered == engine.apply_chat_template(CHAT, add_generation_prompt=True)
    assert ours.encode(rendered) == engine.encode(rendered)


def test_directory_and_unknown_name(tmp_path) -> None:
    path = ensure_tiny_checkpoint("tiny")
    assert load_tokenizer(str(path)).encode("hello") == load_tokenizer("tiny").encode("hello")
    with pytest.raises(FileNotFoundError, match="neither a checkpoint directory nor a preset"):
        load_tokenizer(str(tmp_path / "missing"))


def test_gateway_builds_its_tokenizer_without_torch() -> None:
    code = (
        "import sys\n"
        "from pagefleet.gateway.cli import GatewayConfig, build_gateway\n"
        "gw = build_gateway(GatewayConfig(model='tiny-qwen2', endpoints=['127.0.0.1:1']))\n"
        "assert gw.tokenizer.tokenizer.encode('hi there'), 'no ids'\n"
        "loaded = sorted(m for m in sys.modules\n"
        "                if m == 'torch' or m.startswith('pagefleet.engine'))\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
