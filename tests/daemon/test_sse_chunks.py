"""SSE chunks written from a template (responses.py ``chunk_json``) are the bytes pydantic
would have written for the same chunk, on awkward texts and every finish/stop shape."""

from __future__ import annotations

import itertools

import pytest

from pagefleet.daemon.job import Choice, Job
from pagefleet.daemon.responses import ChatShape, CompletionShape
from pagefleet.engine.outputs import CompletionDelta, TokenLogprob
from pagefleet.engine.sampling_params import SamplingParams

TEXTS = [
    "",
    " hello",
    'quote " and backslash \\ and slash /',
    "new\nline\ttab\r\x00\x01\x1f\x7f",
    "caf\u00e9 \u4e2d\u6587 \U0001f600 \u2028\u2029",
    "\ufffd",
    "</script><!--",
]
FINISH = [(None, None), ("length", None), ("stop", None), ("stop", "END\n"), ("stop", 2)]
MODELS = ["tiny", 'we"ird/\u00e9']


def _job(**kw: object) -> Job:
    return Job("cmpl-0123abcd", [[1, 2, 3]], SamplingParams(max_tokens=4), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [CompletionShape(), ChatShape()], ids=["completion", "chat"])
def test_template_chunks_equal_pydantic_chunks(shape: CompletionShape | ChatShape) -> None:
    for text, (reason, stop), model, index in itertools.product(TEXTS, FINISH, MODELS, (0, 3)):
        delta = CompletionDelta(0, [5], text, None, reason, stop)
        job, fast_ch, slow_ch = _job(), Choice(index), Choice(index)
        # Twice on the same choice: a chat stream's first chunk says the role, later ones not.
        for _ in range(2):
            fast = shape.chunk_json(job, 1700000000, model, fast_ch, delta)
            slow = shape.chunk(job, 1700000000, model, slow_ch, delta)
            assert fast == slow.model_dump_json(exclude_none=True).encode(), (text, reason, stop)
            assert fast_ch.sent_role == slow_ch.sent_role


def test_chat_role_only_on_the_first_chunk() -> None:
    shape, job, ch = ChatShape(), _job(), Choice(0)
    first = shape.chunk_json(job, 1, "m", ch, CompletionDelta(0, [5], "a", None, None, None))
    second = shape.chunk_json(job, 1, "m", ch, CompletionDelta(0, [6], "b", None, None, None))
    assert b'"role":"assistant"' in first and b'"role"' not in second


@pytest.mark.parametrize("shape", [CompletionShape(), ChatShape()], ids=["completion", "chat"])
def test_chunks_with_logprobs_or_a_tool_call_take_the_model_path(
    shape: CompletionShape | ChatShape,
) -> None:
    lp = [TokenLogprob(5, " hi", -0.25, [(5, " hi", -0.25), (6, " ho", -1.5)])]
    job = _job()
    job.params.logprobs = 2
    cases = [(job, CompletionDelta(0, [5], " hi", lp, None, None), b'"logprobs"')]
    if isinstance(shape, ChatShape):
        # A forced tool call's name not complete yet: no content, no call in this chunk.
        tool = CompletionDelta(0, [5], '{"na', None, None, None)
        cases.append((_job(forced_tool_call=True), tool, b'"role"'))
    for job, delta, marker in cases:
        fast_ch, slow_ch = Choice(0), Choice(0)
        fast_ch.text = slow_ch.text = delta.new_text
        fast = shape.chunk_json(job, 7, "m", fast_ch, delta)
        slow = shape.chunk(job, 7, "m", slow_ch, delta).model_dump_json(exclude_none=True)
        assert fast == slow.encode() and marker in fast
        if job.forced_tool_call:
            assert b'"content"' not in fast
