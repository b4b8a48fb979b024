"""Structured output: grammars compiled with xgrammar, one matcher per sequence, a token
bitmask per constrained row per step.

``GuidedSpec`` says what a request's output must match (a JSON schema, any JSON object, a
regex, one of a list of strings, or an EBNF grammar). ``GrammarBackend`` compiles specs
against the engine's tokenizer, caching compiled grammars by spec (compiling a schema
costs far more than a step), and hands each sequence its own ``GrammarMatcher``.

Invariants: a constrained sequence's output tokens were each accepted by its matcher, in
order (``accept`` is called for every appended token), so the output is a prefix of a
string of the grammar, and a whole one once the matcher terminates; the bitmask is applied
before any other logits processing, so no control can revive a token the grammar forbids.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import torch

from pagefleet.engine.guided_spec import GuidedKind, GuidedSpec

__all__ = ["GrammarBackend", "GrammarError", "GuidedKind", "GuidedSpec"]

_CACHE_SIZE = 64


class GrammarError(ValueError):
    """A spec xgrammar cannot compile (bad schema, regex or grammar)."""


def _vocab_type(tokens: list[str]) -> Any:
    import xgrammar as xgr

    # Byte-level BPE spells a leading space "Ġ"; SentencePiece spells it "▁" and has
    # <0xNN> byte-fallback tokens.
    if any(t.startswith("Ġ") for t in tokens if t):
        return xgr.VocabType.BYTE_LEVEL
    if any(t.startswith("▁") for t in tokens if t):
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


class GrammarBackend:
    """Compiles ``GuidedSpec``s for one tokenizer; one per engine (no module state)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        convert = getattr(tokenizer, "convert_ids_to_tokens", None)
        if convert is None:
            raise GrammarError("structured output needs a tokenizer that lists its tokens")
        n = len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.vocab_size
        tokens = [t or "" for t in convert(list(range(n)))]
        info = xgr.TokenizerInfo(
            tokens, _vocab_type(tokens), vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._compiled: OrderedDict[GuidedSpec, Any] = OrderedDict()
        self.compilations = 0  # cache misses (tests check the cache works)

    def compiled(self, spec: GuidedSpec) -> Any:
        """The compiled grammar of ``spec`` (cached, least recently used dropped first)."""
        hit = self._compiled.get(spec)
        if hit is not None:
            self._compiled.move_to_end(spec)
            return hit
        c = self._compiler
        try:
            if spec.kind == "json":
                # Compact JSON: a random-weight model would otherwise pad with whitespace.
                grammar = c.compile_json_schema(spec.spec, any_whitespace=False)
            elif spec.kind == "json_object":
                # OpenAI's json_object is an object, not any JSON value.
                grammar = c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif spec.kind == "regex":
                grammar = c.compile_regex(spec.spec)
            elif spec.kind == "choice":
                options = json.loads(spec.spec)
                # Literal characters, not JSON's \uXXXX escapes: xgrammar reads an
                # escaped surrogate pair (an emoji) as two code points.
                grammar = c.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)
                )
            else:
                grammar = c.compile_grammar(spec.spec)
        except (RuntimeError, ValueError) as exc:
            raise GrammarError(f"cannot compile the {spec.kind} constraint: {exc}") from None
        self.compilations += 1
        self._compiled[spec] = grammar
        if len(self._compiled) > _CACHE_SIZE:
            self._compiled.popitem(last=False)
        return grammar

    def matcher(self, spec: GuidedSpec) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compiled(spec))


def apply_grammar_bitmask(logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
    """Mask (in place, to -inf) every token that ``matchers[j]`` forbids in row ``rows[j]``."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[-1])
    for j, m in enumerate(matchers):
        m.fill_next_token_bitmask(bitmask, j)
    sub = logits[rows]
    xgr.apply_token_bitmask_inplace(sub, bitmask)
    logits[rows] = sub
