"""read_call: the forced call read from every prefix of its text only ever grows."""

from __future__ import annotations

import json
import random

from pagefleet.daemon.tool_calls import (
    CallStream,
    ParsedCall,
    keeps_special_tokens,
    parse_calls,
    read_call,
)

TEXTS = [
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
    '{ "name" : "f\\"x", "arguments" :{"s": "a}\\"{", "l": [1, {"k": []}]}\n}',
    '{"name": "get_time", "arguments": {}}',
]


def test_every_prefix_reads_a_prefix_of_the_final_arguments() -> None:
    for text in TEXTS:
        final = read_call(text)
        obj = json.loads(text)
        assert final.complete and final.name == obj["name"]
        assert json.loads(final.arguments) == obj["arguments"]
        seen_name = False
        for i in range(len(text) + 1):
            part = read_call(text[:i])
            assert final.arguments.startswith(part.arguments), (text, i)
            seen_name |= part.name is not None
            if part.name is not None:
                assert part.name == obj["name"]
            assert part.complete == (part.arguments == final.arguments and i >= len(text) - 2)
        assert seen_name


def test_text_of_another_shape_reads_no_call() -> None:
    assert read_call('{"arguments": {}, "name": "f"}').name is None
    assert read_call("hello").name is None
    assert read_call('{"name": "f", "arguments": 3}').arguments == ""


# -- auto tool choice: parse_calls / CallStream ------------------------------------------

TOOLS = frozenset({"get_weather", "get_time"})
W = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
T = '{"name": "get_time", "arguments": {}}'

HERMES_CASES: list[tuple[str, str, list[tuple[str, dict]]]] = [
    # (output, content, calls)
    (f"<tool_call>\n{W}\n</tool_call>", "", [("get_weather", {"city": "Paris", "days": 3})]),
    (
        f"Let me check.\n<tool_call>\n{W}\n</tool_call>\n<tool_call>{T}</tool_call>\n",
        "Let me check.",
        [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})],
    ),
    ("no call here, a < sign and <tool", "no call here, a < sign and <tool", []),
    # Malformed: bad JSON, an unknown tool, arguments that are no object: text as written.
    ('<tool_call>{"name": "get_weather", "arguments": {"city": Paris}}</tool_call>',
     '<tool_call>{"name": "get_weather", "arguments": {"city": Paris}}</tool_call>', []),
    ('a<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>b',
     'a<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>b', []),
    ('<tool_call>{"name": ["get_time"], "arguments": {}}</tool_call>',
     '<tool_call>{"name": ["get_time"], "arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>', []),
    # The good call stays a call next to a bad one; an unclosed last call that parses too.
    (f"<tool_call>{{bad</tool_call><tool_call>{T}", "<tool_call>{bad</tool_call>",
     [("get_time", {})]),
    (f"<tool_call>{W[:-3]}", f"<tool_call>{W[:-3]}", []),  # cut short: text
    ("", "", []),
]  # fmt: skip

LLAMA_CASES: list[tuple[str, str, list[tuple[str, dict]]]] = [
    ('{"name": "get_time", "parameters": {}}', "", [("get_time", {})]),
    (f'<|python_tag|>{W}; {{"name": "get_time", "parameters": {{}}}}',
     "", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    ('  {"name": "get_time", "parameters": {"tz": "UTC"}}\n', "", [("get_time", {"tz": "UTC"})]),
    ("The answer is {x}.", "The answer is {x}.", []),
    ('{"name": "get_time", "parameters": {}} and more',
     '{"name": "get_time", "parameters": {}} and more', []),
    ('{"name": "nope", "parameters": {}}', '{"name": "nope", "parameters": {}}', []),
    ('{"name": "get_time", "parameters": {', '{"name": "get_time", "parameters": {', []),
]  # fmt: skip

PYTHONIC_CASES: list[tuple[str, str, list[tuple[str, dict]]]] = [
    ('[get_weather(city="Paris", days=3), get_time()]', "",
     [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    (" [get_time(tz='UTC', dst=False, off=-1.5, l=[None, True, {'k': (), 'j': []}])]\n",
     " [get_time(tz='UTC', dst=False, off=-1.5, l=[None, True, {'k': (), 'j': []}])]\n", []),
    ("[get_time(tz='UTC', dst=False, off=-1.5, l=[None, True, {'k': [], 'j': {}}])]\n", "",
     [("get_time", {"tz": "UTC", "dst": False, "off": -1.5,
                    "l": [None, True, {"k": [], "j": {}}]})]),
    ("The answer is [1].", "The answer is [1].", []),
    # Malformed, or more than literals: the text as written, never evaluated.
    ('[get_weather("Paris")]', '[get_weather("Paris")]', []),  # positional
    ("[get_time(a=1, a=2)]", "[get_time(a=1, a=2)]", []),  # a repeated key
    ("[get_time(**{'a': 1})]", "[get_time(**{'a': 1})]", []),
    ("[rm_rf()]", "[rm_rf()]", []),  # not a tool of the request
    ("[get_time(x=1+1)]", "[get_time(x=1+1)]", []),
    ("[get_time(x={1, 2})]", "[get_time(x={1, 2})]", []),  # a set: no JSON for it
    ("[get_time(x=b'a')]", "[get_time(x=b'a')]", []),
    ("[get_time(x=1e999)]", "[get_time(x=1e999)]", []),  # inf: no JSON for it
    ("[get_time(x=open('/etc/passwd'))]", "[get_time(x=open('/etc/passwd'))]", []),
    ("[os.system('ls')]", "[os.system('ls')]", []),
    ("[get_time()] and more", "[get_time()] and more", []),
    ("[get_time(", "[get_time(", []),  # cut short
    ("[]", "[]", []),
]  # fmt: skip

MISTRAL_CASES: list[tuple[str, str, list[tuple[str, dict]]]] = [
    (f"[TOOL_CALLS][{W}, {T}]", "",
     [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    (f"Let me check.\n[TOOL_CALLS] [{W}]\n", "Let me check.",
     [("get_weather", {"city": "Paris", "days": 3})]),
    (f"[TOOL_CALLS]{T}", "", [("get_time", {})]),  # one object, no array
    # tokenizer v11+: name[ARGS]{...}, each call after its own marker
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{}',
     "", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    # tokenizer v13+: the model's call id between the name and its arguments; and the
    # name right before the arguments (a tokenizer whose text drops [ARGS])
    ('Sure.[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris", "days": 3}'
     "[TOOL_CALLS]get_time[CALL_ID]Zz9Yy8Xx7[ARGS]{}", "Sure.",
     [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    ("[TOOL_CALLS]get_time{}", "", [("get_time", {})]),
    ("[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e", "[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e", []),
    ("no call here, a [TOOL or [1]", "no call here, a [TOOL or [1]", []),
    # Malformed: the text from the marker on, as written.
    ('ok [TOOL_CALLS][{"name": "rm_rf", "arguments": {}}]',
     'ok [TOOL_CALLS][{"name": "rm_rf", "arguments": {}}]', []),
    (f"[TOOL_CALLS][{W}, 3]", f"[TOOL_CALLS][{W}, 3]", []),
    ("[TOOL_CALLS]get_time[ARGS][1]", "[TOOL_CALLS]get_time[ARGS][1]", []),
    ("[TOOL_CALLS]get_time[ARGS]{} and more", "[TOOL_CALLS]get_time[ARGS]{} and more", []),
    (f"[TOOL_CALLS][{W}", f"[TOOL_CALLS][{W}", []),  # cut short
    ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
]  # fmt: skip

CASES = (
    ("hermes", HERMES_CASES),
    ("llama3_json", LLAMA_CASES),
    ("pythonic", PYTHONIC_CASES),
    ("mistral", MISTRAL_CASES),
)
# Text only a call's own text holds: no content piece of a well-formed call shows it.
CALL_TEXT = {"hermes": "tool_call", "llama3_json": "{", "pythonic": "(", "mistral": "TOOL"}


def _calls(parsed_calls: list[ParsedCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed_calls]


def _splits(text: str) -> list[list[str]]:
    """The text whole, a character at a time, and in seeded random pieces."""
    rng = random.Random(len(text))
    out = [[text], list(text) or [""]]
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


def test_whole_outputs_split_into_content_and_calls() -> None:
    for parser, cases in CASES:
        for text, content, calls in cases:
            got = parse_calls(parser, text, TOOLS)
            assert (got.content, _calls(got.calls)) == (content, calls), (parser, text)


def test_any_split_streams_to_the_whole_answer_and_never_shows_a_tag() -> None:
    """Fed in any pieces, a stream's content and calls concatenate to the whole parse; no
    content piece of a well-formed call's output ever holds tag or call text."""
    for parser, cases in CASES:
        for text, content, calls in cases:
            for pieces in _splits(text):
                stream = CallStream(parser, TOOLS)
                got = [stream.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
                assert "".join(g.content for g in got) == content, (parser, pieces)
                assert _calls([c for g in got for c in g.calls]) == calls, (parser, pieces)
                assert stream.num_calls == len(calls)
                if calls and "{" not in content:  # (a malformed call's text is content)
                    marks = (CALL_TEXT[parser], "{")
                    assert not any(m in g.content for g in got for m in marks), (parser, pieces)


def test_content_streams_before_the_call_closes() -> None:
    """Text before a call goes out as it comes (not held to the end); the call waits for
    its closing tag; a possible tag start is held only until it proves to be text."""
    s = CallStream("hermes", TOOLS)
    assert s.feed("Let me check", final=False).content == "Let me check"
    assert s.feed(" now <tool", final=False).content == " now"
    opened = s.feed("_call>" + W, final=False)
    assert (opened.content, opened.calls) == ("", [])
    closed = s.feed("</tool_call>", final=False)
    assert _calls(closed.calls) == [("get_weather", {"city": "Paris", "days": 3})]
    s = CallStream("hermes", TOOLS)
    assert s.feed("a <tool", final=False).content == "a"
    assert s.feed("s>", final=False).content == " <tools>"
    s = CallStream("llama3_json", TOOLS)
    assert s.feed("Sunny", final=False).content == "Sunny"
    assert s.feed(' {"name": "get_time"', final=False).content == ' {"name": "get_time"'
    s = CallStream("pythonic", TOOLS)
    assert s.feed("Sunny", final=False).content == "Sunny"
    assert s.feed(" [get_time()]", final=False).content == " [get_time()]"
    s = CallStream("pythonic", TOOLS)
    assert s.feed("\n[get_time()", final=False).content == ""  # maybe a call: held
    assert _calls(s.feed("]", final=True).calls) == [("get_time", {})]
    s = CallStream("mistral", TOOLS)
    assert s.feed("Let me check", final=False).content == "Let me check"
    assert s.feed(" now [TOOL", final=False).content == " now"
    assert s.feed("_CALLS][" + T, final=False).content == ""
    assert _calls(s.feed("]", final=True).calls) == [("get_time", {})]
    s = CallStream("mistral", TOOLS)
    assert s.feed("a [TOOL", final=False).content == "a"
    assert s.feed("S]", final=False).content == " [TOOLS]"


def test_max_calls_drops_the_calls_past_it_whole_or_streamed() -> None:
    text = f"Sure.<tool_call>{W}</tool_call>\n<tool_call>{T}</tool_call>"
    whole = parse_calls("hermes", text, TOOLS, max_calls=1)
    assert (whole.content, [c.name for c in whole.calls]) == ("Sure.", ["get_weather"])
    stream = CallStream("hermes", TOOLS, max_calls=1)
    pieces = [
        stream.feed(text[i : i + 7], final=i + 7 >= len(text)) for i in range(0, len(text), 7)
    ]
    assert "".join(p.content for p in pieces) == "Sure."
    assert [c.name for p in pieces for c in p.calls] == ["get_weather"]
    assert stream.num_calls == 1
    joined = ";".join([W, T])
    assert [c.name for c in parse_calls("llama3_json", joined, TOOLS, max_calls=1).calls] == [
        "get_weather"
    ]
    for parser, text in (
        ("pythonic", "[get_weather(city='Paris'), get_time()]"),
        ("mistral", f"[TOOL_CALLS][{W}, {T}]"),
    ):
        one = parse_calls(parser, text, TOOLS, max_calls=1)
        assert (one.content, [c.name for c in one.calls]) == ("", ["get_weather"]), parser


def test_pythonic_arguments_are_read_never_run(tmp_path) -> None:
    """The pythonic parser reads literals; code in an argument is the model's text and
    never runs (ast.literal_eval of the argument nodes, no eval)."""
    marker = tmp_path / "ran"
    for text in (
        f"[get_time(x=__import__('pathlib').Path({str(marker)!r}).touch())]",
        f"[get_time(x=[open({str(marker)!r}, 'w')])]",
        f"[get_time(**{{'x': open({str(marker)!r}, 'w')}})]",
    ):
        assert parse_calls("pythonic", text, TOOLS).content == text
    assert not marker.exists()


def test_only_mistral_keeps_special_tokens() -> None:
    """[TOOL_CALLS] is a special token in Mistral's tokenizers: the daemon must decode
    with skip_special_tokens false for that parser, and only for it."""
    assert [p for p in ("hermes", "llama3_json", "pythonic", "mistral")
            if keeps_special_tokens(p)] == ["mistral"]  # fmt: skip


def test_deeply_nested_text_is_content_not_an_error() -> None:
    """json raises RecursionError (not ValueError) past ~1000 levels: a model that writes
    that many brackets in a call gets its text back, not a 500."""
    for parser, text in (
        ("hermes", "<tool_call>" + "[" * 5000 + "</tool_call>"),
        ("llama3_json", '{"name": "get_time", "parameters": ' + "[" * 5000),
        ("pythonic", "[get_time(x=" + "[" * 5000 + "]" * 5000 + ")]"),
        ("pythonic", "[get_time(x=" + "9" * 5000 + ")]"),  # past int's digit limit
        ("mistral", "[TOOL_CALLS]" + "[" * 5000),
        ("mistral", "[TOOL_CALLS]get_time[ARGS]" + '{"a":' * 5000),
    ):
        assert parse_calls(parser, text, TOOLS).content == text
