"""The model's tokenizer without transformers or torch (the gateway imports this).

GGUF files carry their tokenizer in metadata; ``pagefleet.gguf_tokenizer`` rebuilds it
into this same class.

Wraps a ``tokenizers.Tokenizer`` loaded from a Hugging Face checkpoint directory plus its
``tokenizer_config.json``. Special tokens such as BOS come from tokenizer.json's
post-processor, which is what ``transformers``' fast tokenizers apply too, so ids agree
with ``AutoTokenizer.from_pretrained(dir)``. Chat templates render with jinja2 in a sandbox
with the same globals transformers provides (``raise_exception``, ``bos_token``, ...).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

from tokenizers import Tokenizer as _HFTokenizer

logger = logging.getLogger(__name__)


class ChatTemplateError(ValueError):
    """The chat template rejected the messages (raised via ``raise_exception``)."""


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get("content")
    return str(value)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]


def _clean_up_tokenization(text: str) -> str:
    # Same substitutions transformers applies when clean_up_tokenization_spaces is true.
    for a, b in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(a, b)
    return text


def _cleans_up_spaces(tokenizer: _HFTokenizer, config: dict) -> bool:
    """Whether decoding applies ``_clean_up_tokenization``: as transformers (5.x) decides,
    never for a BPE vocabulary unless the config insists. The clean-up was made for
    WordPiece; on BPE text it deletes real spaces (Llama 3's config asks for it, and
    "x , y" came out "x, y"), and on a window of a few tokens it can drop a character the
    incremental detokenizer then never sends."""
    if not config.get("clean_up_tokenization_spaces", False):
        return False
    is_bpe = type(tokenizer.model).__name__ == "BPE"
    return not is_bpe or bool(
        config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
    )


def _generation_tag() -> type:
    """The ``{% generation %}...{% endgeneration %}`` block transformers' templates may use
    (it marks the assistant's tokens for training masks; TRL's training templates have it).
    Rendering a prompt, the block is its body, in its own scope as in transformers; without
    the tag such a template failed to compile and every chat request was refused."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser: Any) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    return GenerationTag


def _template_env():  # -> jinja2 ImmutableSandboxedEnvironment
    """The environment chat templates render in: transformers' whitespace rules, its
    extensions and globals, in jinja2's sandbox."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kw)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    # trim_blocks/lstrip_blocks: the whitespace rules transformers renders with.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _generation_tag()]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _unwrapped(node: Any) -> Any:
    """The value under filters and slices: ``message.content | list`` and
    ``message.content[1:]`` still iterate the content."""
    from jinja2 import nodes

    while True:
        filtered = isinstance(node, nodes.Filter) and node.node is not None
        sliced = isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
        if not (filtered or sliced):
            return node
        node = node.node


def _is_content(node: Any) -> bool:
    """``x.content`` or ``x['content']``."""
    from jinja2 import nodes

    node = _unwrapped(node)
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return False


def detect_content_format(template: str | None) -> str:
    """How ``template`` reads a message's content: "openai" when it loops over it (as a
    list of parts, ``{% for part in message.content %}``, directly or through a variable
    set from it), else "string". vLLM's "auto" content format decides the same way; a
    template that only loops over parts was given a string, and rendered it character by
    character (``part.text`` of a character is empty: the model saw no message at all)."""
    if not template:
        return "string"
    from jinja2 import TemplateSyntaxError, nodes

    try:
        tree = _template_env().parse(template)
    except TemplateSyntaxError:
        return "string"  # rendering reports it, with the request that hit it
    content_vars = {
        a.target.name
        for a in tree.find_all(nodes.Assign)
        if isinstance(a.target, nodes.Name) and _is_content(a.node)
    }
    for loop in tree.find_all(nodes.For):
        it = _unwrapped(loop.iter)
        if _is_content(it) or (isinstance(it, nodes.Name) and it.name in content_vars):
            return "openai"
    return "string"


class Tokenizer:
    """A checkpoint's tokenizer: encode/decode, special tokens and the chat template."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        config: dict,
        eos_token_ids: list[int],
        chat_template: str | None = None,
    ) -> None:
        self._tok = tokenizer
        self.config = config
        self.bos_token: str | None = _token_content(config.get("bos_token"))
        self.eos_token: str | None = _token_content(config.get("eos_token"))
        self.pad_token: str | None = _token_content(config.get("pad_token"))
        self.bos_token_id: int | None = (
            tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        )
        self.eos_token_ids: list[int] = eos_token_ids
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.model_max_length: int | None = config.get("model_max_length")
        self.chat_template: str | None = chat_template
        self._clean_up_spaces = _cleans_up_spaces(tokenizer, config)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json + tokenizer_config.json (+ generation_config.json for eos), or
        the tokenizer in the metadata of a GGUF file (``path`` or the one inside it)."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            # Imported here: gguf_tokenizer builds on this module.
            from pagefleet.gguf_tokenizer import find_gguf_file, tokenizer_from_gguf

            gguf_file = find_gguf_file(path)
            if gguf_file is not None:
                return tokenizer_from_gguf(gguf_file)
            raise FileNotFoundError(
                f"{tok_file} not found: pagefleet needs a fast tokenizer (tokenizer.json). "
                "Convert a slow tokenizer once with transformers "
                "(AutoTokenizer.from_pretrained(dir).save_pretrained(dir))."
            )
        tok = _HFTokenizer.from_file(str(tok_file))
        config = _read_json(path / "tokenizer_config.json")
        chat_template = config.get("chat_template")
        jinja_file = path / "chat_template.jinja"
        if chat_template is None and jinja_file.is_file():
            chat_template = jinja_file.read_text(encoding="utf-8")
        if isinstance(chat_template, list):
            # A list of named templates: use the default one.
            named = {t.get("name"): t.get("template") for t in chat_template}
            chat_template = named.get("default") or next(iter(named.values()), None)
        eos_ids = _as_id_list(_read_json(path / "generation_config.json").get("eos_token_id"))
        if not eos_ids:
            eos_ids = _as_id_list(_read_json(path / "config.json").get("eos_token_id"))
        if not eos_ids:
            eos = _token_content(config.get("eos_token"))
            eos_id = tok.token_to_id(eos) if eos else None
            eos_ids = [eos_id] if eos_id is not None else []
        return cls(tok, config, eos_ids, chat_template)

    def __len__(self) -> int:
        return self.vocab_size

    @cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest vocabulary entry: a text of ``c`` characters has at
        least ``c / max_token_chars`` tokens (a cheap lower bound, no encoding needed)."""
        return max((len(s) for s in self._tok.get_vocab(with_added_tokens=True)), default=1) or 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; BOS (if the checkpoint adds one) only when asked."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; incomplete UTF-8 sequences come out as U+FFFD."""
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up_spaces:
            text = _clean_up_tokenization(text)
        return text

    def token_text(self, token_id: int) -> str:
        """One token's part of a text, as logprobs show it: ``decode([id])`` with special
        tokens, plus the leading spaces a SentencePiece decoder strips from a text's first
        word ("\u2581the" alone decodes to "the" but reads " the" in a text; vLLM restores
        them too). Without them the tokens' texts did not join to the output's text."""
        text = self.decode([token_id], skip_special_tokens=False)
        piece = self._tok.id_to_token(int(token_id)) or ""
        marks = len(piece) - len(piece.lstrip("\u2581"))
        missing = marks - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Token strings of ``ids``; an id beyond the tokenizer (model vocabularies are often
        padded past it) gives ``""``, just as ``decode`` skips it."""
        return [self._tok.id_to_token(int(i)) or "" for i in ids]

    def convert_tokens_to_ids(self, tokens: list[str]) -> list[int | None]:
        return [self._tok.token_to_id(t) for t in tokens]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @cached_property
    def all_special_ids(self) -> set[int]:
        """Ids of every added special token (BOS, EOS, chat markers, ...)."""
        return {i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special}

    @cached_property
    def template_adds_bos(self) -> bool:
        """True when the chat template writes BOS itself: through ``bos_token`` or spelled
        out (a template with a literal "<s>" got a second BOS from the encoder, which
        neither transformers nor vLLM add)."""
        template = self.chat_template or ""
        return "bos_token" in template or bool(self.bos_token and self.bos_token in template)

    @cached_property
    def chat_content_format(self) -> str:
        """Either "string" or "openai": what the chat template reads as message content
        (``detect_content_format``; vLLM's --chat-template-content-format auto)."""
        return detect_content_format(self.chat_template)

    @cached_property
    def _template(self):  # -> jinja2.Template
        assert self.chat_template is not None
        return _template_env().from_string(self.chat_template)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the checkpoint's chat template into a prompt string.

        Whether encoding the result should add special tokens depends on the template:
        ``template_adds_bos`` says whether it emits BOS itself (then pass
        ``add_special_tokens=False`` to avoid a double BOS).
        """
        if not self.chat_template:
            raise ValueError(
                "this tokenizer has no chat_template (tokenizer_config.json or "
                "chat_template.jinja); use /v1/completions or add a template to the checkpoint"
            )
        special = {
            k: _token_content(v)
            for k, v in self.config.items()
            if k.endswith("_token") and isinstance(v, str | dict)
        }
        # Caller's variables (tools, documents, a date, ...) override the config's tokens.
        context = {**special, **kwargs}
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **context
        )
