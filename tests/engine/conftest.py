"""Fixtures shared by the engine tests (model-free helpers; model fixtures live in the
test files that need them so pure-Python tests never load torch models)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagefleet.engine.outputs import RequestMetrics
from pagefleet.engine.request import Request, SeqIdCounter, Sequence
from pagefleet.engine.sampling_params import SamplingParams

SeqFactory = Callable[..., Sequence]


@pytest.fixture
def make_seq() -> SeqFactory:
    """Build a bare sequence (index 0 of a fresh request) over ``tokens``."""
    ids = SeqIdCounter()

    def make(tokens: list[int], n: int = 1, lora_id: str | None = None) -> Sequence:
        req = Request(
            request_id=f"r{ids()}",
            prompt_token_ids=list(tokens),
            params=SamplingParams(n=n, temperature=0.0),
            metrics=RequestMetrics(arrival_time=0.0),
            lora_id=lora_id,
            forked=n == 1,
        )
        seq = Sequence(
            seq_id=ids(),
            request=req,
            index=0,
            token_ids=list(tokens),
            num_prompt_tokens=len(tokens),
        )
        req.seqs.append(seq)
        return seq

    return make
