"""A real byte-level BPE tokenizer for the tiny presets, trained deterministically here.

No model hub is reachable from tests or CI, yet the engine, daemon and gateway must run a
real tokenizer (merges, special tokens, chat template) in the Hugging Face file format.
Training on a fixed embedded corpus with one thread makes the files byte-identical on every
machine, so a checkpoint directory's content depends only on its preset and version.
Only ``tokenizers`` is needed (no torch): the gateway builds its tokenizer here
(pagefleet/presets), the engine writes the same files into each tiny checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Bumping this changes every tiny checkpoint's cache directory name.
TOKENIZER_VERSION = 2

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# Two families of real tokenizers, mirrored so the presets behave like the real models:
# "llama": GPT-2 byte-level split, BOS prepended by the post-processor, EOS "</s>";
# "qwen": Qwen's digit-by-digit split regex + NFC, no BOS, EOS "<|im_end|>" (what
# transformers' Qwen2Tokenizer rebuilds from the vocab, so ids agree with it).
STYLES = ("llama", "qwen")
SPECIAL_TOKENS = {
    "llama": [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START, IM_END],
    "qwen": [ENDOFTEXT, IM_START, IM_END],
}
QWEN_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML. For "llama" the BOS comes from the post-processor (completions prompts get it),
# not the template, so chat prompts carry none: the chat path encodes with
# add_special_tokens=False unless the request asks, as vLLM's does.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TARGET_VOCAB_SIZE = 1024
MODEL_MAX_LENGTH = 4096

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A paged cache keeps every block of keys and
values in a fixed pool, so memory is allocated one block at a time as a sequence grows.
When the pool runs out, the scheduler preempts the newest request and recomputes it later.
Nothing that was accepted is ever dropped; it only waits a little longer in the queue.

Once upon a time there was a small model that lived in a cache on a quiet machine. Every
morning it read the prompts that arrived, wrote its answers one token at a time, and sent
them back to the people who asked. Some questions were short and some were very long, but
the model answered all of them in the order the scheduler decided.

Hello, world! How are you today? I am fine, thank you. What is the weather like in the
city? It is sunny and warm, with a light wind from the west. Tomorrow it may rain.
Please tell me a story about a dragon, a knight, and a castle on a hill near the sea.
Can you explain how attention works in a transformer? Each query compares itself with
every key, turns the scores into weights with a softmax, and mixes the values.

The gateway routes each request to the server that already holds the longest matching
prefix of the prompt. A shared system prompt is cached once and reused by many requests,
which saves time to first token. The operator watches the cluster and scales the prefill
and decode roles so that latency stays within the targets that the user wrote down.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 32 64 100 128 256 512
1000 1024 2048 4096 8192 3.14159 2.71828 1.41421 -7 +42 50% 99.9% $19.99 #1 @home
Dates: 2024-01-31, 2025-06-15, 2026-11-29. Times: 09:30, 12:00, 23:59.
Punctuation: . , ; : ! ? ' " ( ) [ ] { } < > / \\ | - _ = + * & ^ % $ # @ ~ `

def add(a, b):
    return a + b

for i in range(10):
    print(i * i)

class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0

{"role": "user", "content": "What is two plus two?"}
{"role": "assistant", "content": "Two plus two is four."}

She sells sea shells by the sea shore. Peter Piper picked a peck of pickled peppers.
All that glitters is not gold. A journey of a thousand miles begins with a single step.
The early bird catches the worm, but the second mouse gets the cheese. Knowledge is power.
Spring, summer, autumn and winter: the seasons turn, and the river keeps running to the sea.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. January, February, March,
April, May, June, July, August, September, October, November, December.
red orange yellow green blue indigo violet black white gray brown pink purple
one two three four five six seven eight nine ten eleven twelve hundred thousand million
apple banana cherry grape lemon mango orange peach pear plum strawberry watermelon bread
water coffee tea milk juice soup rice pasta cheese butter salt sugar pepper garlic onion

Questions and answers: Who wrote this? We did. Where is it running? On a server with two
cores and no accelerator. Why is it slow? Because every matrix multiply runs on the CPU.
When will it finish? Soon, after the last request has produced its final token.

Unicode: café naïve résumé über straße façade jalapeño. Ελληνικά, русский язык, 日本語のテキスト,
中文文本, 한국어 텍스트, עברית, العربية, हिन्दी. Emoji: 🙂 🚀 ✨ 🍕 ❤️ 👍.
"""


def corpus() -> list[str]:
    """The fixed training corpus, one paragraph per item (order is part of the contract)."""
    return [p for p in _CORPUS.split("\n\n") if p.strip()]


def _check_style(style: str) -> None:
    if style not in STYLES:
        raise ValueError(f"unknown tokenizer style {style!r}: choose one of {', '.join(STYLES)}")


def build_tokenizer(style: str = "llama"):  # -> tokenizers.Tokenizer
    """Train the tiny byte-level BPE tokenizer; same merges and ids on every call."""
    _check_style(style)
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    if style == "qwen":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(
                    Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False
                ),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS[style],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    if style == "llama":
        bos_id = tok.token_to_id(BOS_TOKEN)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
            special_tokens=[(BOS_TOKEN, bos_id)],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_config(style: str = "llama", tok: Any = None) -> dict:
    """tokenizer_config.json content matching ``build_tokenizer(style)``'s special tokens."""
    _check_style(style)
    tok = tok if tok is not None else build_tokenizer(style)
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS[style]
    }
    common = {
        "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }
    if style == "qwen":
        return {
            **common,
            "tokenizer_class": "Qwen2Tokenizer",
            "bos_token": None,
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
            "unk_token": None,
            "additional_special_tokens": [IM_START, IM_END],
            "errors": "replace",
            "split_special_tokens": False,
        }
    return {
        **common,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "additional_special_tokens": [IM_START, IM_END],
    }


def write_tokenizer_files(directory: Path, style: str = "llama") -> dict[str, int | None]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json.

    Returns the ids the model config refers to: ``bos``/``eos``/``pad`` token ids (bos may
    be None), ``eos_ids`` for generation_config.json, and ``vocab_size``.
    """
    directory = Path(directory)
    tok = build_tokenizer(style)
    tok.save(str(directory / "tokenizer.json"), pretty=False)
    cfg = tokenizer_config(style, tok)
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    special_map = {
        k: cfg[k]
        for k in ("bos_token", "eos_token", "pad_token", "additional_special_tokens")
        if cfg.get(k) is not None
    }
    (directory / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))
    return special_ids(style, tok, cfg)


def special_ids(style: str, tok: Any, cfg: dict) -> dict[str, Any]:
    """The ids a model config refers to, for ``tok``/``cfg`` of ``style``."""
    ids: dict[str, Any] = {
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "pad": tok.token_to_id(cfg["pad_token"]),
    }
    if style == "qwen":
        # Qwen's config.json names <|endoftext|> as BOS though the tokenizer adds none.
        ids["bos"] = tok.token_to_id(ENDOFTEXT)
        ids["eos"] = tok.token_to_id(IM_END)
        ids["eos_ids"] = [tok.token_to_id(IM_END), tok.token_to_id(ENDOFTEXT)]
    else:
        ids["bos"] = tok.token_to_id(BOS_TOKEN)
        ids["eos"] = tok.token_to_id(EOS_TOKEN)
        ids["eos_ids"] = [tok.token_to_id(EOS_TOKEN), tok.token_to_id(IM_END)]
    return ids


def load_tokenizer(style: str = "llama"):  # -> pagefleet.tokenizer.Tokenizer
    """The tiny tokenizer of ``style`` in memory: what ``Tokenizer.from_dir`` reads back
    from the files ``write_tokenizer_files`` writes (tests compare the two)."""
    from pagefleet.tokenizer import Tokenizer

    tok = build_tokenizer(style)
    cfg = tokenizer_config(style, tok)
    return Tokenizer(tok, cfg, special_ids(style, tok, cfg)["eos_ids"], cfg["chat_template"])


def load_llama():  # -> pagefleet.tokenizer.Tokenizer
    return load_tokenizer("llama")


def load_qwen():  # -> pagefleet.tokenizer.Tokenizer
    return load_tokenizer("qwen")
