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

import ast
import json
import math
import re
from dataclasses import dataclass, field

from pagefleet.api.openai import TOOL_CALL_PARSERS

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


# -- auto tool choice: calls the model wrote in its own format (--tool-call-parser) -------
#
# With ``tool_choice`` "auto" nothing constrains the output: the model answers in text or
# writes calls in the format its chat template taught it. A parser reads such calls out
# of the text, whole (``parse_calls``) or as it grows (``CallStream``). One implementation
# serves both: the whole text is the stream fed at once, so a streamed answer concatenates
# to exactly the non-streamed one (content and calls alike).
#
# A call is held back until it is closed (hermes: ``</tool_call>``; llama3_json,
# pythonic and mistral: the end of the output) and checked: well-formed, a ``name`` among
# the request's tools, an object of arguments. One that fails is the model's text and
# goes out as content as is; a streamed piece is never taken back, so nothing of a call
# is sent before that check.
#
# The formats (vLLM's parser names):
#   hermes       text, then any number of <tool_call>{"name", "arguments"}</tool_call>
#   llama3_json  the whole output is {"name", "parameters"}, or several joined by ";"
#   pythonic     the whole output is [f(a=1, b="x"), g()] (Llama 3.2/4): Python literal
#                arguments, read with ast (parsed, never evaluated)
#   mistral      text, then [TOOL_CALLS] and the rest of the output: a JSON array of
#                {"name", "arguments"} (older Mistral), or name[ARGS]{...} per call, each
#                after its own [TOOL_CALLS] (tokenizer v11+), with the model's own call id
#                as name[CALL_ID]id[ARGS]{...} (v13+). [TOOL_CALLS] is a special
#                token: the daemon decodes with skip_special_tokens false for this parser
#                (``keeps_special_tokens``), else the marker never reaches the text.


_HERMES_OPEN = "<tool_call>"
_HERMES_CLOSE = "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"  # Llama 3.1 may open its calls with it
_CALL_SEP = re.compile(r"\s*;?\s*")  # between llama3_json calls
_MISTRAL_MARK = "[TOOL_CALLS]"
_MISTRAL_ARGS = "[ARGS]"
_MISTRAL_CALL_ID = "[CALL_ID]"
_WS = re.compile(r"\s*")


def keeps_special_tokens(parser: str) -> bool:
    """Whether ``parser`` needs special tokens in the text: Mistral's [TOOL_CALLS] is one,
    and skip_special_tokens (the default) would drop it before the parser sees it."""
    return parser == "mistral"


@dataclass(slots=True, frozen=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments object as JSON text


@dataclass(slots=True)
class Parsed:
    """What one ``feed`` found: content to send and calls completed since the last one."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


def _checked_call(body: str, tool_names: frozenset[str]) -> ParsedCall | None:
    """The call ``body`` states, or None when it is not a well-formed call of a tool."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: past ~1000 nested levels
        return None
    return _checked_obj(obj, tool_names)


def _checked_obj(obj: object, tool_names: frozenset[str]) -> ParsedCall | None:
    """The call a decoded JSON value states, or None when it is not a call of a tool.
    Hermes writes ``arguments``, Llama 3 ``parameters``: either is read."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or name not in tool_names:  # (a list is unhashable)
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(name, json.dumps(args, ensure_ascii=False))


def _held_tag_prefix(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class _Content:
    """Content pieces, with trailing whitespace held until more text follows: a model
    puts newlines around and between its calls, and an answer that only calls has null
    content, not "\\n". Invariant: the pieces given out concatenate to the whole content,
    less its trailing whitespace when there were calls."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held = ""

    def add(self, text: str) -> str:
        text = self._held + text
        visible = text.rstrip()
        if not visible:
            self._held = text
            return ""
        self._held = text[len(visible) :]
        return visible

    def end(self, had_calls: bool) -> str:
        held, self._held = self._held, ""
        return "" if had_calls else held


class CallStream:
    """Reads one choice's calls out of its text as the text grows (see above).

    ``feed(piece, final)`` takes the next piece of text (``final``: the output ended) and
    returns the content and calls it completes. Invariant: for any split of a text into
    pieces, the results concatenate to ``parse_calls(text)``.
    """

    __slots__ = (
        "_buf",
        "_content",
        "_format",
        "_in_call",
        "_is_text",
        "_max_calls",
        "_pos",
        "_tools",
        "num_calls",
    )

    def __init__(
        self, parser: str, tool_names: frozenset[str], max_calls: int | None = None
    ) -> None:
        """``max_calls``: calls beyond it are dropped, text and all (the request's
        ``parallel_tool_calls: false`` asks for one)."""
        if parser not in TOOL_CALL_PARSERS or parser == "none":
            raise ValueError(f"unknown tool call parser {parser!r}; one of {TOOL_CALL_PARSERS}")
        self._format = parser
        self._tools = tool_names
        self._buf = ""
        self._pos = 0  # text before it is dealt with
        self._in_call = False  # hermes, mistral: _pos is at an opening tag (marker)
        self._is_text = False  # llama3_json, pythonic: the output is text, not calls
        self._content = _Content()
        self._max_calls = max_calls
        self.num_calls = 0

    def feed(self, piece: str, final: bool) -> Parsed:
        self._buf += piece
        out = Parsed()
        if self._format == "hermes":
            self._hermes(out, final)
        elif self._format == "mistral":
            self._mistral(out, final)
        else:
            self._whole_output(out, final)
        if self._max_calls is not None:
            del out.calls[max(0, self._max_calls - self.num_calls) :]
        self.num_calls += len(out.calls)
        if final:
            out.content += self._content.end(self.num_calls > 0)
        return out

    def _text(self, out: Parsed, end: int) -> None:
        out.content += self._content.add(self._buf[self._pos : end])
        self._pos = end

    def _hermes(self, out: Parsed, final: bool) -> None:
        buf = self._buf
        while True:
            if not self._in_call:
                at = buf.find(_HERMES_OPEN, self._pos)
                if at < 0:
                    # Keep back what may be the start of a tag: "<tool" is no content yet.
                    self._text(
                        out, len(buf) if final else len(buf) - _held_tag_prefix(buf, _HERMES_OPEN)
                    )
                    return
                self._text(out, at)
                self._in_call = True
            body_at = self._pos + len(_HERMES_OPEN)
            close = buf.find(_HERMES_CLOSE, body_at)
            if close < 0 and not final:
                return  # the call is still being written
            end = len(buf) if close < 0 else close + len(_HERMES_CLOSE)
            call = _checked_call(buf[body_at : close if close >= 0 else len(buf)], self._tools)
            self._in_call = False
            if call is None:
                self._text(out, end)  # not a call after all: the model's text, as written
            else:
                out.calls.append(call)
                self._pos = end
            if close < 0:
                return

    def _whole_output(self, out: Parsed, final: bool) -> None:
        """llama3_json and pythonic: the whole output is the calls, or it is text. Its
        first non-blank characters decide: text streams from there on, a possible call
        is held until the output ends."""
        if self._is_text:
            self._text(out, len(self._buf))
            return
        start = len(self._buf) - len(self._buf[self._pos :].lstrip())
        if start == len(self._buf) and not final:
            return  # only whitespace so far: nothing decides yet
        rest = self._buf[start:]
        if self._format == "pythonic":
            may_call = rest.startswith("[")
        else:
            may_call = rest.startswith("{") or rest.startswith(_PYTHON_TAG)
            may_call |= _PYTHON_TAG.startswith(rest)
        if not may_call:
            self._is_text = True  # text: it streams as content from here on
            self._text(out, len(self._buf))
            return
        if not final:
            return  # maybe a call: held until the output ends
        if self._format == "pythonic":
            calls = _pythonic_calls(rest, self._tools)
        else:
            calls = _json_calls(rest.removeprefix(_PYTHON_TAG), self._tools)
        if calls is None:
            self._text(out, len(self._buf))
        else:
            out.calls += calls
            self._pos = len(self._buf)

    def _mistral(self, out: Parsed, final: bool) -> None:
        """Text streams until [TOOL_CALLS]; from it to the end of the output is held and
        read as the calls, or goes out as text when it is not (whole)."""
        buf = self._buf
        if not self._in_call:
            at = buf.find(_MISTRAL_MARK, self._pos)
            if at < 0:
                held = 0 if final else _held_tag_prefix(buf, _MISTRAL_MARK)
                self._text(out, len(buf) - held)
                return
            self._text(out, at)
            self._in_call = True
        if not final:
            return
        calls = _mistral_calls(buf[self._pos + len(_MISTRAL_MARK) :], self._tools)
        if calls is None:
            self._text(out, len(buf))
        else:
            out.calls += calls
            self._pos = len(buf)


def _json_calls(text: str, tool_names: frozenset[str]) -> list[ParsedCall] | None:
    """The calls of a llama3_json output (``{...}`` or ``{...}; {...}``); None unless
    every part is a call of a tool."""
    calls = []
    dec = json.JSONDecoder()
    pos = 0
    text = text.strip()
    while pos < len(text):
        try:
            _, end = dec.raw_decode(text, pos)
        except (ValueError, RecursionError):
            return None
        call = _checked_call(text[pos:end], tool_names)
        if call is None:
            return None
        calls.append(call)
        pos = end
        pos = _CALL_SEP.match(text, pos).end()  # type: ignore[union-attr]  # always matches
    return calls or None


def _mistral_calls(text: str, tool_names: frozenset[str]) -> list[ParsedCall] | None:
    """The calls after a first [TOOL_CALLS]: ``[{...}, ...]`` (or one ``{...}``), or
    ``name[ARGS]{...}``, each later call after its own [TOOL_CALLS]; only whitespace
    after the last. None unless all of it is calls of tools."""
    dec = json.JSONDecoder()
    calls: list[ParsedCall] = []
    pos = 0
    while True:
        pos = _WS.match(text, pos).end()  # type: ignore[union-attr]  # always matches
        named = not text.startswith(("[", "{"), pos)
        name = ""
        if named:  # name[ARGS]{...}, name[CALL_ID]id[ARGS]{...}
            head = _mistral_call_head(text, pos)
            if head is None:
                return None
            name, pos = head
        try:
            value, pos = dec.raw_decode(text, pos)
        except (ValueError, RecursionError):
            return None
        if named:
            value = {"name": name, "arguments": value}
        for obj in value if isinstance(value, list) else [value]:
            call = _checked_obj(obj, tool_names)
            if call is None:
                return None
            calls.append(call)
        pos = _WS.match(text, pos).end()  # type: ignore[union-attr]
        if pos == len(text):
            return calls or None
        if not text.startswith(_MISTRAL_MARK, pos):
            return None
        pos += len(_MISTRAL_MARK)


def _first(text: str, marks: tuple[str, ...], pos: int) -> int:
    """Where the first of ``marks`` occurs in ``text`` from ``pos``; -1 when none does."""
    found = [i for i in (text.find(m, pos) for m in marks) if i >= 0]
    return min(found, default=-1)


def _mistral_call_head(text: str, pos: int) -> tuple[str, int] | None:
    """A named call's name and where its arguments start: ``name[ARGS]`` (v11+),
    ``name[CALL_ID]id[ARGS]`` (v13+), or ``name`` right before the arguments' ``{``
    (vLLM reads that form too). The model's own id is dropped: as vLLM's parser, every
    call gets a fresh 9-character id (ToolCall), the form Mistral's templates check; the
    name ran up to [ARGS] before, id and all, and named no tool (the calls were text)."""
    end = _first(text, (_MISTRAL_CALL_ID, _MISTRAL_ARGS, "{"), pos)
    if end < 0:
        return None
    name = text[pos:end].strip()
    if text.startswith(_MISTRAL_CALL_ID, end):
        end = _first(text, (_MISTRAL_ARGS, "{"), end + len(_MISTRAL_CALL_ID))
        if end < 0:
            return None
    if text.startswith(_MISTRAL_ARGS, end):
        end += len(_MISTRAL_ARGS)
    return name, _WS.match(text, end).end()  # type: ignore[union-attr]  # always matches


def _is_json_value(v: object) -> bool:
    """Whether ``v`` is a string, number, bool, None, or a list or str-keyed dict of them:
    what a pythonic call's arguments may hold (no tuples, sets, bytes, complex, inf)."""
    if v is None or isinstance(v, (str, bool, int)):
        return True
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, list):
        return all(_is_json_value(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _is_json_value(x) for k, x in v.items())
    return False


def _pythonic_call(node: ast.expr, tool_names: frozenset[str]) -> ParsedCall | None:
    """``name(key=literal, ...)`` as a call; None for anything else (positional or
    ``**`` arguments, a repeated key, a value that is no plain literal)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
        return None
    if node.func.id not in tool_names:
        return None
    args: dict[str, object] = {}
    for kw in node.keywords:
        if kw.arg is None or kw.arg in args:
            return None
        # literal_eval of the node: constants and containers of them, never code run.
        value = ast.literal_eval(kw.value)
        if not _is_json_value(value):
            return None
        args[kw.arg] = value
    return ParsedCall(node.func.id, json.dumps(args, ensure_ascii=False))


def _pythonic_calls(text: str, tool_names: frozenset[str]) -> list[ParsedCall] | None:
    """The calls of a pythonic output (``[f(a=1), g()]``); None unless it is one list
    literal of calls of tools."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
        if not isinstance(tree.body, ast.List):
            return None
        calls = []
        for node in tree.body.elts:
            call = _pythonic_call(node, tool_names)
            if call is None:
                return None
            calls.append(call)
    # SyntaxError: not Python; ValueError: a null byte, a non-literal value or an int
    # past str's digit limit; RecursionError/MemoryError: nesting past what ast takes.
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None
    return calls or None


def parse_calls(
    parser: str, text: str, tool_names: frozenset[str], max_calls: int | None = None
) -> Parsed:
    """The content and calls of a whole output (the stream of it fed at once)."""
    return CallStream(parser, tool_names, max_calls).feed(text, final=True)
