"""Tokenize chat prompts piecewise, caching the pieces every turn repeats.

A chat prompt is the rendered conversation: a long system prompt and history that the
next turn repeats verbatim, between the template's special tokens (``<|im_start|>`` ...).
A fast tokenizer splits its input on special added tokens *before* normalizing and
pre-tokenizing, so each piece between two special tokens is tokenized on its own. Encoding
the pieces separately, repeated ones from a cache, therefore gives the very ids of
encoding the whole text, at the cost of only the new pieces: a few hundred microseconds
instead of milliseconds per 1000-token prompt. Short pieces are cached too (a chat's
earlier user and assistant turns, the role names): every call into the tokenizer costs
~0.1-0.2 ms however short its text, so on the bench's chat prompts caching them halved
the time (0.84 -> 0.38 ms per prompt, in-process, load ~8).

Invariant: ``encode`` returns exactly ``tokenizer.encode(text, add_special_tokens)``. Where
that cannot be assumed (special tokens that strip neighbouring spaces or are normalized)
the cache is off from the start; and the first ``verify_first`` calls, then one call in
``verify_every``, are checked against a whole encode: one mismatch turns the cache off for
good, with a warning.
"""

from __future__ import annotations

import logging
import re
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from pagefleet.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class SegmentCachedEncoder:
    def __init__(
        self,
        tokenizer: Tokenizer,
        max_entries: int = 4096,
        max_tokens: int = 1 << 20,
        min_chars: int = 1,
        verify_first: int = 16,
        verify_every: int = 256,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        # Pieces are bounded by their tokens too: unique long pieces (RAG documents, tool
        # outputs) would otherwise fill max_entries at megabytes each. Stored as 4-byte
        # arrays, this budget is ~4 MB of ids.
        self.max_tokens = max_tokens
        self.cached_tokens = 0
        self.min_chars = min_chars
        self.verify_first = verify_first
        self.verify_every = verify_every
        self.calls = 0
        self.hits = 0
        self._cache: OrderedDict[str, array[int]] = OrderedDict()
        raw = tokenizer._tok
        specials = {
            t.content: i
            for i, t in raw.get_added_tokens_decoder().items()
            if t.special and t.content
        }
        unsafe = [
            t.content
            for t in raw.get_added_tokens_decoder().values()
            if t.special and (t.lstrip or t.rstrip or t.normalized or t.single_word)
        ]
        self.enabled = bool(specials) and not unsafe
        self._specials = specials
        self._split = (
            re.compile(
                "(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")"
            )
            if specials
            else None
        )
        # What the post-processor wraps around a text (BOS, maybe EOS), from a probe.
        probe, bare = (
            raw.encode("a", add_special_tokens=True).ids,
            raw.encode("a", add_special_tokens=False).ids,
        )
        at = _find(probe, bare)
        if at < 0:
            self.enabled = False
            self._pre: list[int] = []
            self._post: list[int] = []
        else:
            self._pre, self._post = probe[:at], probe[at + len(bare) :]

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """``tokenizer.encode(text, add_special_tokens)``, with repeated pieces cached."""
        if not self.enabled or self._split is None:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        self.calls += 1
        ids: list[int] = list(self._pre) if add_special_tokens else []
        for piece in self._split.split(text):
            if not piece:
                continue
            special = self._specials.get(piece)
            if special is not None:
                ids.append(special)
            else:
                ids += self._piece(piece)
        if add_special_tokens:
            ids += self._post
        n = self.calls
        if n <= self.verify_first or n % self.verify_every == 0:
            whole = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
            if whole != ids:
                self.enabled = False
                self._cache.clear()
                self.cached_tokens = 0
                logger.warning(
                    "piecewise tokenization differs from a whole encode for this tokenizer; "
                    "the gateway now tokenizes whole prompts (slower, same routing)"
                )
                return whole
        return ids

    def _piece(self, piece: str) -> Sequence[int]:
        """The piece's ids. Invariant: at most ``max_entries`` pieces and ``max_tokens``
        ids are cached (least recently used out first; a piece over the budget alone is
        not cached)."""
        if len(piece) < self.min_chars:
            return self.tokenizer.encode(piece, add_special_tokens=False)
        got = self._cache.get(piece)
        if got is not None:
            self._cache.move_to_end(piece)
            self.hits += 1
            return got
        ids = self.tokenizer.encode(piece, add_special_tokens=False)
        if len(ids) > self.max_tokens:
            return ids
        self._cache[piece] = array("I", ids)
        self.cached_tokens += len(ids)
        while len(self._cache) > self.max_entries or self.cached_tokens > self.max_tokens:
            self.cached_tokens -= len(self._cache.popitem(last=False)[1])
        return ids


def _find(seq: list[int], sub: list[int]) -> int:
    for i in range(len(seq) - len(sub) + 1):
        if seq[i : i + len(sub)] == sub:
            return i
    return -1
