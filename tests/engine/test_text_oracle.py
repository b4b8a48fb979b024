"""The text a client gets for output token ids, against transformers' tokenizer.

The incremental detokenizer (streamed deltas, and the whole text, which is their join)
must give ``AutoTokenizer.decode(output ids)`` on byte-level vocabularies, whatever the
ids: random ones split characters across tokens and across the prompt/output boundary.
"""

from __future__ import annotations

import json
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
