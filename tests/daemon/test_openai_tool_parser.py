"""Auto tool choice (--tool-call-parser) through the official openai client on a real daemon.

The tiny model's weights are random, so its own text never holds a call: a guided_regex
(a request field any client may send) holds it to the text a tool-calling model would
write, and the parser reads that text as it would read the model's own.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import openai
import pytest
import pytest_asyncio
from click.testing import CliRunner

from pagefleet.daemon.cli import command
from pagefleet.daemon.config import DaemonConfig
from pagefleet.dev.process import free_port
from pagefleet.engine.loader import resolve_model

from .conftest import live_daemon

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny-tools"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]  # fmt: skip
MSGS = [{"role": "user", "content": "Weather in Paris?"}]
# What Qwen-style (hermes) models write: text, then each call in tags on its own lines.
ONE_CALL = r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)"\}\}\n</tool_call>'  # noqa: E501
TWO_CALLS = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo"\}\}\n</tool_call>\n'
    r'<tool_call>\n\{"name": "get_time", "arguments": \{\}\}\n</tool_call>'
)


def tools_checkpoint(dest: Path) -> Path:
    """A copy of the tiny checkpoint whose chat template shows the model its tools."""
    shutil.copytree(resolve_model("tiny"), dest)
    cfg_path = dest / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = (
        "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
        + cfg["chat_template"]
    )
    cfg_path.write_text(json.dumps(cfg))
    return dest


def config(model: Path, parser: str) -> DaemonConfig:
    return DaemonConfig(
        model=str(model), served_model_name=MODEL, port=free_port(), pod_name="pod-t",
        block_size=8, num_gpu_blocks=256, max_model_len=1024, max_num_seqs=8, max_queue=8,
        tool_call_parser=parser,
    )  # fmt: skip


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tools_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-tools")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def hermes(ckpt: Path):
    async with live_daemon(config(ckpt, "hermes")) as d:
        c = openai.AsyncOpenAI(base_url=d.base_url, api_key="none", max_retries=0)
        yield c
        await c.close()


async def ask(c: openai.AsyncOpenAI, regex: str, **kw):
    """The whole answer and the streamed one (the client's own accumulation) to the same
    greedy request, and every streamed chunk's delta."""
    kw = dict(model=MODEL, messages=MSGS, max_tokens=200, temperature=0,
              extra_body={"guided_regex": regex}, **kw)  # fmt: skip
    whole = await c.chat.completions.create(**kw)
    deltas = []
    async with c.chat.completions.stream(**kw) as stream:
        async for event in stream:
            if event.type == "chunk" and event.chunk.choices:
                deltas.append(event.chunk.choices[0])
        streamed = await stream.get_final_completion()
    return whole.choices[0], streamed.choices[0], deltas


def calls_of(choice) -> list[tuple[str, dict]]:
    return [(t.function.name, json.loads(t.function.arguments))
            for t in choice.message.tool_calls or []]  # fmt: skip


async def test_a_written_call_comes_back_as_tool_calls(hermes) -> None:
    whole, streamed, deltas = await ask(hermes, ONE_CALL, tools=TOOLS)
    assert whole.finish_reason == "tool_calls" == streamed.finish_reason
    assert whole.message.content == "Checking." == streamed.message.content
    (call,) = whole.message.tool_calls
    assert call.id and call.type == "function"
    assert calls_of(whole) == calls_of(streamed)
    assert calls_of(whole)[0][0] == "get_weather"
    assert calls_of(whole)[0][1]["city"] in ("Paris", "Oslo")
    # The stream: content first, never the tag's text; then the call with its id, type
    # and name; the last chunk says why it ended.
    content = [d.delta.content for d in deltas if d.delta.content]
    assert "".join(content) == "Checking."
    heads = [tc for d in deltas for tc in d.delta.tool_calls or [] if tc.function.name]
    assert [(h.index, h.type, h.function.name) for h in heads] == [(0, "function", "get_weather")]
    assert heads[0].id
    assert deltas[-1].finish_reason == "tool_calls"
    assert not any(d.delta.content == "" and not d.finish_reason for d in deltas[1:])


async def test_two_calls_and_a_round_trip_of_the_history(hermes) -> None:
    whole, streamed, _ = await ask(hermes, TWO_CALLS, tools=TOOLS, n=1)
    assert whole.message.content is None and streamed.message.content is None
    expected = [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert calls_of(whole) == expected == calls_of(streamed)
    assert len({t.id for t in whole.message.tool_calls}) == 2
    # The answer goes back as history with the tools' results, as a client's loop does.
    history = [
        *MSGS,
        whole.message.model_dump(exclude_none=True),
        *({"role": "tool", "tool_call_id": t.id, "content": "sunny"}
          for t in whole.message.tool_calls),
    ]  # fmt: skip
    again = await hermes.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=3
    )
    assert again.choices[0].finish_reason in ("stop", "length")


async def test_parallel_tool_calls_false_returns_the_first_call_only(hermes) -> None:
    whole, streamed, _ = await ask(hermes, TWO_CALLS, tools=TOOLS, parallel_tool_calls=False)
    assert calls_of(whole) == [("get_weather", {"city": "Oslo"})] == calls_of(streamed)
    assert whole.message.content is None and streamed.message.content is None
    assert whole.finish_reason == "tool_calls" == streamed.finish_reason


async def test_what_is_not_a_well_formed_call_stays_text(hermes) -> None:
    """Bad JSON, a tool the request did not offer, no tools, tool_choice none: the text
    as the model wrote it, whole and streamed alike, finish_reason stop."""
    bad_json = r'<tool_call>\{"name": "get_weather", "arguments": \{city\}\}</tool_call>'
    unknown = r'<tool_call>\{"name": "rm_rf", "arguments": \{\}\}</tool_call>'
    for regex, kw in (
        (bad_json, {"tools": TOOLS}),
        (unknown, {"tools": TOOLS}),
        (ONE_CALL, {}),
        (ONE_CALL, {"tools": TOOLS, "tool_choice": "none"}),
    ):
        whole, streamed, _ = await ask(hermes, regex, **kw)
        assert re.fullmatch(regex, whole.message.content), (regex, whole.message)
        assert streamed.message.content == whole.message.content
        assert not whole.message.tool_calls and not streamed.message.tool_calls
        assert whole.finish_reason == "stop" == streamed.finish_reason


async def test_llama3_json_reads_a_bare_json_call(ckpt: Path) -> None:
    async with live_daemon(config(ckpt, "llama3_json")) as d:
        c = openai.AsyncOpenAI(base_url=d.base_url, api_key="none", max_retries=0)
        regex = r'\{"name": "get_weather", "parameters": \{"city": "Oslo"\}\}'
        whole, streamed, _ = await ask(c, regex, tools=TOOLS)
        assert calls_of(whole) == [("get_weather", {"city": "Oslo"})] == calls_of(streamed)
        assert whole.message.content is None and whole.finish_reason == "tool_calls"
        text, streamed, _ = await ask(c, r"Sunny \{today\}", tools=TOOLS)
        assert text.message.content == "Sunny {today}" == streamed.message.content
        await c.close()


async def test_pythonic_reads_a_list_of_python_calls(ckpt: Path) -> None:
    """Llama 3.2/4's format: the whole output a list of calls with literal arguments."""
    async with live_daemon(config(ckpt, "pythonic")) as d:
        c = openai.AsyncOpenAI(base_url=d.base_url, api_key="none", max_retries=0)
        regex = r'\[get_weather\(city="Oslo", days=3, hourly=False\), get_time\(\)\]'
        whole, streamed, _ = await ask(c, regex, tools=TOOLS)
        expected = [("get_weather", {"city": "Oslo", "days": 3, "hourly": False}),
                    ("get_time", {})]  # fmt: skip
        assert calls_of(whole) == expected == calls_of(streamed)
        assert whole.message.content is None is streamed.message.content
        assert whole.finish_reason == "tool_calls" == streamed.finish_reason
        # Code, not literals: the text as written, never run.
        bad = r'\[get_time\(tz=__import__\("os"\)\)\]'
        text, streamed, _ = await ask(c, bad, tools=TOOLS)
        assert text.message.content == '[get_time(tz=__import__("os"))]'
        assert streamed.message.content == text.message.content and not text.message.tool_calls
        await c.close()


MISTRAL_MARK_ID = 1023  # the tiny vocabulary's last merge, made Mistral's special token


def mistral_checkpoint(dest: Path) -> Path:
    """The tools checkpoint with [TOOL_CALLS] a special token of the tokenizer, as in
    Mistral's: the id of the vocabulary's last merge (used by no other merge) renamed."""
    tools_checkpoint(dest)
    tok_path = dest / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    vocab = tok["model"]["vocab"]
    (old,) = [t for t, i in vocab.items() if i == MISTRAL_MARK_ID]
    merge = tok["model"]["merges"].pop()
    assert "".join(merge.split(" ") if isinstance(merge, str) else merge) == old
    del vocab[old]
    vocab["[TOOL_CALLS]"] = MISTRAL_MARK_ID
    tok["added_tokens"].append({
        "id": MISTRAL_MARK_ID, "content": "[TOOL_CALLS]", "single_word": False,
        "lstrip": False, "rstrip": False, "normalized": False, "special": True,
    })  # fmt: skip
    tok_path.write_text(json.dumps(tok))
    return dest


async def test_mistral_reads_calls_after_its_special_token(tmp_path: Path) -> None:
    """[TOOL_CALLS] is a special token: the model writes its id (logit_bias makes the
    tiny one), and the parser sees the marker although skip_special_tokens is on by
    default (it was skipped: the call came back as content). Both forms are read; a
    plain answer shows no special token (EOS) in its content."""
    ckpt = mistral_checkpoint(tmp_path / "tiny-mistral")
    async with live_daemon(config(ckpt, "mistral")) as d:
        c = openai.AsyncOpenAI(base_url=d.base_url, api_key="none", max_retries=0)
        bias = {"logit_bias": {str(MISTRAL_MARK_ID): 100}}
        array = r'\[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": \{"city": "Oslo"\}\}\]'
        whole, streamed, deltas = await ask(c, array, tools=TOOLS, **bias)
        assert calls_of(whole) == [("get_weather", {"city": "Oslo"})] == calls_of(streamed)
        assert whole.message.content is None is streamed.message.content
        assert whole.finish_reason == "tool_calls" == streamed.finish_reason
        assert not any(d.delta.content for d in deltas)
        v11 = (r'Sure\.\[TOOL_CALLS\]get_weather\[ARGS\]\{"city": "Paris"\}'
               r'\[TOOL_CALLS\]get_time\[ARGS\]\{\}')  # fmt: skip
        whole, streamed, _ = await ask(c, v11, tools=TOOLS, **bias)
        expected = [("get_weather", {"city": "Paris"}), ("get_time", {})]
        assert calls_of(whole) == expected == calls_of(streamed)
        assert whole.message.content == "Sure." == streamed.message.content
        # Tokenizer v13+ writes its own call id before [ARGS]: read past, and each call
        # gets a fresh 9-character id (it was read as part of the name: no call at all).
        v13 = (r'\[TOOL_CALLS\]get_weather\[CALL_ID\]a1B2c3D4e\[ARGS\]\{"city": "Oslo"\}'
               r'\[TOOL_CALLS\]get_time\[CALL_ID\]Zz9Yy8Xx7\[ARGS\]\{\}')  # fmt: skip
        whole, streamed, _ = await ask(c, v13, tools=TOOLS, **bias)
        expected = [("get_weather", {"city": "Oslo"}), ("get_time", {})]
        assert calls_of(whole) == expected == calls_of(streamed)
        assert whole.message.content is None is streamed.message.content
        ids = [t.id for a in (whole, streamed) for t in a.message.tool_calls]
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids), ids
        text, streamed, _ = await ask(c, r"Sunny \[today\]", tools=TOOLS)
        assert text.message.content == "Sunny [today]" == streamed.message.content
        assert text.finish_reason == "stop"
        await c.close()


# A tool whose arguments the tiny model can only write one way under the forced grammar.
STRICT = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"], "additionalProperties": False}}}]  # fmt: skip


async def test_forced_and_parsed_calls_accumulate_to_the_same_message(hermes) -> None:
    """A forced call streams its arguments piece by piece, a parsed one arrives whole in
    one delta: the official client's accumulation of either stream is the non-streamed
    message, and the same call (name, arguments, null content, finish_reason) both ways."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=MODEL, messages=MSGS, tools=STRICT, max_tokens=60, temperature=0)
    forced = (await hermes.chat.completions.create(tool_choice=named, **kw)).choices[0]
    pieces = []
    async with hermes.chat.completions.stream(tool_choice=named, **kw) as stream:
        async for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                pieces.append(event.arguments_delta)
        forced_streamed = (await stream.get_final_completion()).choices[0]
    assert len([p for p in pieces if p]) > 1, pieces  # piece by piece
    (call,) = forced.message.tool_calls
    # The text the grammar made the model write, written by it again as a parsed call.
    text = json.dumps({"name": "get_weather", "arguments": json.loads(call.function.arguments)})
    whole, parsed_streamed, deltas = await ask(
        hermes, re.escape(f"<tool_call>{text}</tool_call>").replace("\\ ", " "), tools=STRICT
    )
    arg_deltas = [tc for d in deltas for tc in d.delta.tool_calls or []]
    assert len(arg_deltas) == 1  # whole, in one delta
    # (ids differ per request; "index" is the client's own, kept from the deltas)
    skip = {"tool_calls": {0: {"id", "index"}}}
    # A named tool_choice's call ends with "stop" (OpenAI's, vLLM's); a parsed one with
    # "tool_calls".
    for a, b, finish in ((forced, forced_streamed, "stop"), (whole, parsed_streamed, "tool_calls")):
        assert a.finish_reason == finish == b.finish_reason
        dump_a = a.message.model_dump(exclude=skip, exclude_none=True)
        dump_b = b.message.model_dump(exclude=skip, exclude_none=True)
        assert dump_a == dump_b, (dump_a, dump_b)
        assert b.message.tool_calls[0].id and b.message.tool_calls[0].type == "function"
    assert forced.message.content is None is whole.message.content
    assert calls_of(forced) == calls_of(whole) == calls_of(parsed_streamed)


async def test_the_flag_names_its_formats_and_refuses_others() -> None:
    help_text = CliRunner().invoke(command, ["--help"], terminal_width=200).output
    assert "--tool-call-parser [none|hermes|llama3_json|pythonic|mistral]" in help_text
    bad = CliRunner().invoke(command, ["--tool-call-parser", "qwen9"])
    assert bad.exit_code != 0 and "qwen9" in bad.output
    assert DaemonConfig().tool_call_parser == "none"


# Mistral's chat templates check every tool call id of the history, as here (their words).
ID_CHECK = (
    "{% for m in messages %}"
    "{% for tc in m.tool_calls or [] %}{% if tc.id is not defined or tc.id|length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{% endif %}{% endfor %}"
    "{% if m.role == 'tool' and (m.tool_call_id is not defined or m.tool_call_id|length != 9) %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{% endif %}{% endfor %}"
)


async def test_tool_call_ids_suit_a_template_that_checks_them(tmp_path: Path) -> None:
    """A model whose template takes only 9-character alphanumeric ids (Mistral's): the
    ids this daemon gives its calls, forced and parsed, go back in the history without
    an error (they were "call-" and 32 hex digits: the next turn was a 400); an id from
    another provider that the template refuses is a 400 naming messages, in the
    template's words, streamed or not, never a 500."""
    ckpt = tools_checkpoint(tmp_path / "tiny-mistral-ids")
    cfg_path = ckpt / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = ID_CHECK + cfg["chat_template"]
    cfg_path.write_text(json.dumps(cfg))
    async with live_daemon(config(ckpt, "hermes")) as d:
        c = openai.AsyncOpenAI(base_url=d.base_url, api_key="none", max_retries=0)
        forced = await c.chat.completions.create(
            model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=60, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )  # fmt: skip
        parsed, streamed, deltas = await ask(c, TWO_CALLS, tools=TOOLS)
        streamed_ids = [tc.id for d in deltas for tc in d.delta.tool_calls or [] if tc.id]
        answers = [forced.choices[0], parsed, streamed]
        ids = [t.id for a in answers for t in a.message.tool_calls]
        assert streamed_ids == [t.id for t in streamed.message.tool_calls]
        assert len(ids) == 5 and len(set(ids)) == 5, ids
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids), ids
        for answer in answers:
            history = [
                *MSGS,
                answer.message.model_dump(exclude_none=True),
                *({"role": "tool", "tool_call_id": t.id, "content": "ok"}
                  for t in answer.message.tool_calls),
            ]  # fmt: skip
            again = await c.chat.completions.create(
                model=MODEL, messages=history, tools=TOOLS, max_tokens=2
            )
            assert again.choices[0].finish_reason in ("stop", "length")
        foreign = [
            *MSGS,
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_Vq3mX8kfNnB0pLr2sT7uYw1Z", "type": "function",
                "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_Vq3mX8kfNnB0pLr2sT7uYw1Z", "content": "9am"},
        ]  # fmt: skip
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(
                    model=MODEL, messages=foreign, tools=TOOLS, max_tokens=2, stream=stream
                )
            assert e.value.body["param"] == "messages", e.value.body
            assert "length 9" in e.value.body["message"], e.value.body
        await c.close()
