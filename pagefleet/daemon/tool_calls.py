"""Reading a forced tool call out of the model's constrained text, whole or as it grows.

With ``tool_choice`` forcing a call, the grammar holds the output to
``{"name": <one of the tools>, "arguments": {...}}`` (``forced_tool_schema``), name first.
OpenAI streams such a call as one chunk carrying the call's id, type and name (arguments
``""``), then chunks that each carry the next piece of the arguments' JSON text. The
arguments are the model's own text of the ``arguments`` value, whitespace included, in the
stream and in the whole response alike, so the pieces concatenate to exactly the
non-streamed ``arguments``.

Invariant: for any prefix ``p`` of a text ``t``, ``read_call(p).arguments`` is a prefix of
``read_call(t).arguments``, so the pieces sent never need to be taken back.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

# Up to and including the name's closing quote; then up to the arguments' value.
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGS = re.compile(r'\s*,\s*"arguments"\s*:\s*')


@dataclass(slots=True, frozen=True)
class CallSoFar:
    name: str | None  # once its string has closed
    arguments: str  # the arguments' JSON text so far
    complete: bool  # the arguments' value has closed


def _value_end(s: str) -> int | None:
    """Index just past the JSON object or array that ``s`` starts with; None while open."""
    depth = 0
    in_str = escaped = False
    for i, c in enumerate(s):
        if in_str:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def read_call(text: str) -> CallSoFar:
    """What ``text`` (a prefix of a forced call's output) already says of the call."""
    m = _NAME.match(text)
    if m is None:
        return CallSoFar(None, "", False)
    name = json.loads(m.group(1))
    a = _ARGS.match(text, m.end())
    if a is None or a.end() == len(text):
        return CallSoFar(name, "", False)
    rest = text[a.end() :]
    if rest[0] not in "{[":  # not the schema's shape: no arguments to stream
        return CallSoFar(name, "", False)
    end = _value_end(rest)
    return CallSoFar(name, rest if end is None else rest[:end], end is not None)
