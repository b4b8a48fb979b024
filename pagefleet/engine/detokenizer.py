"""Incremental detokenization with stop strings.

Each generated token is decoded together with a few tokens before it (the window starts
with the prompt's last tokens, so a leading space or merge is decoded in context) and only
the text past the window's previous end is appended. If the window's text ends in U+FFFD
the token ended mid-way through a multi-byte character: nothing is appended until the
character completes, so a partial character is never emitted.

Stop strings are searched in the text appended since the last check plus the
``max_len - 1`` characters before it (a stop string may span tokens). Text that could still
become the start of a stop string is held back from the caller until it cannot.

Invariant: the concatenation of every ``take_delta`` is ``text``, the output's text cut at
the first stop string (kept only with ``include_stop_str_in_output``).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

from pagefleet.engine.sampling_params import SamplingParams

_CONTEXT_TOKENS = 6  # prompt tokens decoded with the first output token


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def _context(tokenizer: Decoder, prompt_token_ids: Seq[int], skip: bool) -> list[int]:
    """The prompt's last tokens, less any that end it inside a character (a prompt sent as
    token ids can). Left in, the character's bytes were shared between the context and the
    output: the first output token's text was measured against a U+FFFD that it turned
    into part of a character, and the output lost or gained a character there; without
    them the output decodes as ``decode(output ids)`` does."""
    ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
    while ids and tokenizer.decode(ids, skip).endswith("\ufffd"):
        ids.pop()
    return ids


class IncrementalDetokenizer:
    __slots__ = (
        "_added",
        "_emitted",
        "_ids",
        "_include_stop",
        "_max_stop",
        "_prefix",
        "_read",
        "_skip",
        "_stops",
        "_tok",
        "text",
    )

    def __init__(
        self, tokenizer: Decoder, prompt_token_ids: Seq[int], params: SamplingParams
    ) -> None:
        self._tok = tokenizer
        self._skip = params.skip_special_tokens
        self._stops = [s for s in params.stop if s]
        self._include_stop = params.include_stop_str_in_output
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._ids = _context(tokenizer, prompt_token_ids, self._skip)
        self._prefix = 0  # window start
        self._read = len(self._ids)  # tokens before this are already in `text`
        self.text = ""
        self._emitted = 0
        self._added = 0  # characters the last token appended

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one generated token; return the stop string it completed, if any
        (stop strings are only looked for when ``check_stop``, e.g. after min_tokens)."""
        self._ids.append(token_id)
        if not self._advance(final=False) or not check_stop:
            return None
        return self._check_stop()

    def _advance(self, final: bool) -> bool:
        before = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        full = self._tok.decode(self._ids[self._prefix :], self._skip)
        if len(full) <= len(before) or (full.endswith("\ufffd") and not final):
            return False  # nothing new yet, or a character still incomplete
        self._added = len(full) - len(before)
        self.text += full[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        return True

    def _check_stop(self) -> str | None:
        if not self._stops:
            return None
        # Only a match that takes in this token's text: per stop string, starting at most
        # len(s) - 1 characters before it. One window for all (the longest string's) found
        # a short string wholly inside text checked before -- or never checked, during
        # min_tokens, and already streamed -- and cut the text back under what was sent.
        new_from = len(self.text) - self._added
        best: tuple[int, str] | None = None
        for s in self._stops:
            idx = self.text.find(s, max(0, new_from - len(s) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.text = self.text[: idx + len(s)] if self._include_stop else self.text[:idx]
        return s

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out. Unless ``finished``, holds back a suffix that is a
        proper prefix of some stop string (it may still turn into one)."""
        if finished:
            if self._read < len(self._ids):  # flush an unfinished character as U+FFFD
                self._advance(final=True)
            end = len(self.text)
        else:
            end = len(self.text) - self._held_back()
        end = max(end, self._emitted)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def _held_back(self) -> int:
        if not self._stops:
            return 0
        text = self.text
        for k in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
