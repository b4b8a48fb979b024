"""Detokenization in the daemon's HTTP process, for an engine running in its own process.

As vLLM v1 does in its front end: the engine process samples tokens, this process turns
them into text, so the model's core spends no time decoding. Only requests without stop
strings (and not beam search) are decoded here: a stop string must end a sequence at the
exact token that completes it, which only the engine can do without generating past it.

Invariant: for each sequence the text given out here equals what the engine's own
``IncrementalDetokenizer`` would have produced: the same detokenizer class, the same prompt
context, the same tokens. The engine decodes the token that ended a sequence with finish
reason "stop" (EOS, a stop token id, a grammar's end: no stop strings here) only with
``include_stop_str_in_output``, and so does this.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pagefleet.engine.detokenizer import Decoder, IncrementalDetokenizer
from pagefleet.engine.outputs import RequestOutput
from pagefleet.engine.sampling_params import SamplingParams


def decodable_here(prompt: Any, params: SamplingParams) -> bool:
    """Whether a request's text can be made in the HTTP process (see the module doc)."""
    return (
        isinstance(prompt, list) and params.detokenize and not params.stop
        and not params.use_beam_search
    )  # fmt: skip


def engine_params(params: SamplingParams) -> SamplingParams:
    """The params the engine gets for a request decoded here: no text in the engine."""
    return dataclasses.replace(params, detokenize=False)


class RequestText:
    """The detokenizers of one request's sequences (created at each one's first delta)."""

    __slots__ = ("_detoks", "_params", "_prompt", "_tok")

    def __init__(self, tokenizer: Decoder, prompt: list[int], params: SamplingParams) -> None:
        self._tok = tokenizer
        self._prompt = prompt
        self._params = params
        self._detoks: dict[int, IncrementalDetokenizer] = {}

    def fill(self, out: RequestOutput) -> None:
        """Set ``new_text`` of each delta of ``out`` (the engine left them empty)."""
        for delta in out.deltas:
            detok = self._detoks.get(delta.index)
            if detok is None:
                detok = IncrementalDetokenizer(self._tok, self._prompt, self._params)
                self._detoks[delta.index] = detok
            ids = delta.new_token_ids
            keep_stop = self._params.include_stop_str_in_output
            if delta.finish_reason == "stop" and ids and not keep_stop:
                ids = ids[:-1]  # the stopping token's text is left out
            for tok in ids:
                detok.add_token(tok, check_stop=False)
            delta.new_text = detok.take_delta(delta.finish_reason is not None)
