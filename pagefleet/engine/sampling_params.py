"""Per-request sampling parameters.

Invariant: a SamplingParams that constructed without error is valid; every bad value raises
``ValueError`` naming the field, so the HTTP layer can turn it into a 400 as is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagefleet.engine.guided_spec import GuidedSpec

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): logits / 1e-38 overflow
# float32 to inf and softmax to NaN, and a Python float as small as 1e-50 is 0 in float32.
# The limit of sampling as the temperature goes to 0 is the argmax, so nothing is lost.
GREEDY_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's max length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token
    # vLLM's prompt_logprobs: each prompt token's logprob (the first has none) and the top
    # k at its position, from the raw logits. None (the default) costs nothing; a request
    # that sets it skips prefix-cache hits (cached positions have no logits).
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Penalties with vLLM's meaning: presence/frequency count output tokens only and are
    # subtracted; repetition divides positive (multiplies negative) logits of every token
    # seen in the prompt or the output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Token sequences that must not be generated (the engine tokenizes ``bad_words``).
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # Structured output: the generated text must match this (guided.py).
    guided: GuidedSpec | None = None
    # Beam search (beam.py): ``best_of`` beams (``n`` when unset), the ``n`` best returned.
    # Scores are sum(logprob) / generated_len ** length_penalty, as transformers' generate.
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never" (transformers' meanings)
    # False: the engine leaves ``new_text`` empty and its caller decodes the tokens (the
    # daemon's HTTP process does, off the engine's core). Stop strings need the text in the
    # engine, so they require True.
    detokenize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not self.detokenize and (self.stop or self.use_beam_search):
            raise ValueError(
                "detokenize=False cannot be combined with stop strings or beam search (the "
                "engine needs the text for them)"
            )
        # Written so NaN fails them too (every comparison with NaN is false): a NaN
        # temperature passed "< 0" and then broke the step of every request in its batch.
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer of at least 1, got {self.n!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} and "
                f"max_tokens={self.max_tokens}"
            )
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}"
            )
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty}")
        bad_bias = next((v for v in self.logit_bias.values() if not -100 <= v <= 100), None)
        if bad_bias is not None:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bad_bias}")
        if any(not w for w in self.bad_words_token_ids):
            raise ValueError("bad_words must not contain an empty word")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be >= n, got best_of={self.best_of} and n={self.n}")
        if self.use_beam_search:
            self._check_beam_search()
        elif self.best_of is not None and self.best_of != self.n:
            raise ValueError(
                "best_of is supported with use_beam_search only (it is the beam width); "
                "drop best_of or set use_beam_search"
            )

    def _check_beam_search(self) -> None:
        """Beam search is deterministic and scores raw logprobs: every control that would
        change the distribution or end a beam other than by EOS / length is refused."""
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f"early_stopping must be true, false or 'never', got {self.early_stopping!r}"
            )
        if self.temperature != 0.0:
            raise ValueError(
                "temperature must be 0 with use_beam_search (beam search is deterministic; "
                f"got {self.temperature}); drop temperature or set it to 0"
            )
        refused = {
            "top_p": self.top_p != 1.0,
            "top_k": self.top_k not in (-1, 0),
            "min_p": self.min_p != 0.0,
            "min_tokens": self.min_tokens != 0,
            "stop": bool(self.stop),
            "stop_token_ids": bool(self.stop_token_ids),
            "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "logit_bias": bool(self.logit_bias),
            "bad_words": bool(self.bad_words or self.bad_words_token_ids),
            "response_format": self.guided is not None,
        }
        name = next((k for k, bad in refused.items() if bad), None)
        if name is not None:
            raise ValueError(
                f"{name} is not supported with use_beam_search (beams end on EOS or length "
                "and score the model's own logprobs); drop one of the two"
            )

    @property
    def beam_width(self) -> int:
        """Live beams of a beam-search request (0 when not beam search)."""
        if not self.use_beam_search:
            return 0
        return self.best_of if self.best_of is not None else self.n

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or one too small to divide by safely."""
        return self.temperature < GREEDY_TEMPERATURE
