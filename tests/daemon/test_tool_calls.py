"""read_call: the forced call read from every prefix of its text only ever grows."""

from __future__ import annotations

import json

from pagefleet.daemon.tool_calls import read_call

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
