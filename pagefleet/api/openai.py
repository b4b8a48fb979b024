"""OpenAI API bodies (completions, chat, models, errors) and vLLM's tokenize endpoints.

Shared by the daemon (which serves them) and the gateway (which parses them to route and
forwards them). Invariant: a request model that validated is well-formed for the fields it
declares (types and ranges); limits that depend on the model (max length) are the server's
to check. Fields these models do not declare are kept (``extra="allow"``) so a proxy can
forward them and a server can log and ignore them: routers such as sglang-router and
vllm-router add their own.

JSON is parsed in strict mode (``parse_body``): ``"n": "3"`` is a type error, not 3, but an
integer is accepted where a float is expected, as JSON has one number type.
"""

from __future__ import annotations

import json
import secrets
import string
import time
import uuid
from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

# -- errors -------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}`` as OpenAI returns it."""

    error: ErrorDetail


class RequestValidationError(ValueError):
    """A body that failed validation; ``param`` is the dotted path of the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


_Req = TypeVar("_Req", bound=BaseModel)


_UNION_FORMS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
}


# The tags pydantic puts in an error's location for the union member it tried ("prompt.str",
# "tool_choice.literal['none','auto','required']", "content.list[ContentPart]").
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "none"})
_UNION_TAG_PREFIXES = (
    "list[", "dict[", "tuple[", "set[", "literal[", "nullable[", "function-", "tagged-union[",
    "constrained-",
)  # fmt: skip


def _is_union_tag(item: str) -> bool:
    # Model names (ContentPart, NamedToolChoice) start upper-case; every field of the API is
    # snake_case. Exact tags only: "stream" and "strict" are fields, not the "str" tag.
    return item in _UNION_TAGS or item.startswith(_UNION_TAG_PREFIXES) or item[:1].isupper()


def _loc_to_param(loc: tuple[int | str, ...]) -> str | None:
    """The field path the caller sent, from a pydantic error location (union tags dropped)."""
    parts = [str(item) for item in loc if isinstance(item, int) or not _is_union_tag(item)]
    return ".".join(parts) or None


def parse_body(model: type[_Req], body: bytes | str) -> _Req:
    """Parse a JSON body into ``model`` strictly; raise RequestValidationError naming the field."""
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        if first["type"] == "json_invalid":
            raise RequestValidationError(
                f"request body is not valid JSON: {first['msg']}; send a JSON object"
            ) from None
        if first["type"] == "model_type" and not first["loc"]:
            raise RequestValidationError("request body must be a JSON object") from None
        param = _loc_to_param(tuple(first["loc"]))
        # A union (e.g. prompt) yields one error per member; say what the field accepts.
        msg = first["msg"].removeprefix("Value error, ")
        if len(errors) > 1 and param in _UNION_FORMS:
            msg = f"wrong type; expected {_UNION_FORMS[param]}"
        elif len(errors) > 1 and param and param.endswith(".content"):
            msg = "wrong type; expected a string or a list of content parts"
        where = f"'{param}'" if param else "body"
        raise RequestValidationError(f"{where}: {msg}", param=param) from None


# -- shared pieces ------------------------------------------------------------------------


class _Lenient(BaseModel):
    """Request models keep unknown fields instead of failing validation on them, so the
    server can sort them itself: ignorable ones (``IGNORED_FIELDS``) and ones at a value that
    asks for nothing (``ACCEPTED_DEFAULTS``) pass, any other is refused with a 400 that names
    it (``unsupported_fields``), never dropped silently."""

    model_config = ConfigDict(extra="allow")


# Fields a server accepts and ignores: they change nothing in the output. Clients send the
# OpenAI bookkeeping ones; routers in front of a worker add their own (sglang-router: rid,
# bootstrap_*; vllm-router: request_id; both: priority-style hints).
IGNORED_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",  # only means something with tools
        "no_stop_trim",
        "rid",
        "sglang_rid",
        "request_id",
        "priority",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "return_text_in_logprobs",
        "stream_reasoning",
        "session_id",  # the gateway's session policy reads it (docs/gateway.md)
    }
)

# Fields a server does not implement but accepts at the value that asks for nothing
# (vLLM's defaults): any other value is refused rather than silently ignored.
ACCEPTED_DEFAULTS: dict[str, object] = {
    "truncate_prompt_tokens": None,
    "return_tokens_as_token_ids": False,
    "functions": None,
    "function_call": None,
    "modalities": ["text"],
    # Added by the peer routers to every request they forward, at these values:
    # sglang-router 0.3.2 and vllm-router 0.1.17 (bench/routing.py).
    "return_hidden_states": False,
    "include_reasoning": True,
    "separate_reasoning": True,
}


def unsupported_fields(req: BaseModel) -> list[str]:
    """The undeclared fields of ``req`` that would change the output: neither ignorable
    (``IGNORED_FIELDS``) nor at a default that asks for nothing (``ACCEPTED_DEFAULTS``).
    A null asks for nothing: the OpenAI API reads it as the field not sent."""
    extra = req.model_extra or {}
    out = []
    for name, value in extra.items():
        if name in IGNORED_FIELDS or value is None:
            continue
        if name in ACCEPTED_DEFAULTS and value == ACCEPTED_DEFAULTS[name]:
            continue
        out.append(name)
    return sorted(out)


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False


Stop = str | list[str] | None
NonNegInt = Annotated[int, Field(ge=0)]


class JSONSchemaFormat(_Lenient):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object with a 'schema'")
        return self


class StructuredOutputs(_Lenient):
    """vLLM's ``structured_outputs`` (which replaced its guided_* fields): one of json (a
    schema, as an object or its text), regex, choice, grammar or json_object."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _known_options(self) -> StructuredOutputs:
        # Options this server lacks (structural_tag, whitespace_pattern, ...) would change
        # the output: refused by name rather than ignored.
        unknown = sorted(k for k, v in (self.model_extra or {}).items() if v is not None)
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not supported; use json, regex, choice, "
                             "grammar or json_object")  # fmt: skip
        return self

    def constraints(self) -> list[tuple[str, str]]:
        """``(kind, spec)`` of each constraint given (see ``_SamplingFields.guided``)."""
        found = []
        if self.json_ is not None:
            g = self.json_
            found.append(("json", g if isinstance(g, str) else json.dumps(g)))
        if self.regex is not None:
            found.append(("regex", self.regex))
        if self.choice is not None:
            found.append(("choice", json.dumps(self.choice)))
        if self.grammar is not None:
            found.append(("grammar", self.grammar))
        if self.json_object:
            found.append(("json_object", ""))
        return found


class ConstraintConflict(ValueError):
    """More than one output constraint; ``param`` is the field to name in the 400."""

    def __init__(self, message: str, param: str = "response_format") -> None:
        super().__init__(message)
        self.param = param


def _not_nullable(field: FieldInfo) -> bool:
    return type(None) not in get_args(field.annotation)


class _SamplingFields(_Lenient):
    """Fields common to completions and chat; ranges match SamplingParams' own checks."""

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI declares n, stream, logprobs, echo... "or null" with a default, and vLLM
        # accepts null for them: a field that cannot hold None takes its default. A field
        # that can (max_tokens: up to the context) keeps the None.
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        nulls = {
            k for k, v in data.items() if v is None and k in fields and _not_nullable(fields[k])
        }
        return {k: v for k, v in data.items() if k not in nulls} if nulls else data

    model: str | None = None
    n: int = Field(default=1, ge=1, le=128)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: Stop = None
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    # JSON object keys are strings: token id (as a string) -> bias, clamped to [-100, 100]
    # (logit_bias_ids) as vLLM does: a client banning a token with -1000 was a 400 here.
    logit_bias: dict[str, Annotated[float, Field(allow_inf_nan=False)]] | None = None
    bad_words: list[str] | None = None
    # Structured output: OpenAI's response_format, or one of vLLM's guided_* fields.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    # vLLM's extension: each prompt token's logprob (the first has none) and the top k,
    # returned as ``prompt_logprobs`` (not with stream, as vLLM).
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    # vLLM's: whether detokenizing puts a space around added tokens. Only a slow (Python)
    # tokenizer does; fast ones (tokenizer.json, all this server loads, and what vLLM's own
    # fast detokenizer runs) write added tokens where they are, so both values give the
    # same text here, as they do on vLLM with a fast tokenizer.
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    # P/D handshake (vLLM's shape); opaque to everything but the daemon's P/D code.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's beam search: best_of beams (n when unset), the n best returned, not streamed.
    use_beam_search: bool = False
    best_of: int | None = Field(default=None, ge=1, le=128)
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: Stop) -> Stop:
        stops = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(
        cls, v: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        # As vLLM: options of a stream on a request that is not one are a mistake to report.
        if v is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        # ASCII digits only: str.isdigit() is also true of "²" (int() fails on it) and of
        # other scripts' digits ("٣" would be read as token 3).
        bad = next((k for k in (v or {}) if not (k.isascii() and k.isdigit())), None)
        if bad is not None:
            raise ValueError(f"logit_bias keys must be token ids, got {bad!r}")
        return v

    def guided(self) -> tuple[str, str, str] | None:
        """``(kind, spec, field)`` of the output constraint asked for, if any: kind is
        json / json_object / regex / choice / grammar, spec its text (a JSON list for
        choice). Raises ValueError when more than one constraint is given."""
        found: list[tuple[str, str, str]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("json_object", "", "response_format"))
        elif rf is not None and rf.json_schema is not None and rf.type == "json_schema":
            found.append(("json", json.dumps(rf.json_schema.schema_), "response_format"))
        if self.guided_json is not None:
            g = self.guided_json
            found.append(("json", g if isinstance(g, str) else json.dumps(g), "guided_json"))
        if self.guided_regex is not None:
            found.append(("regex", self.guided_regex, "guided_regex"))
        if self.guided_choice is not None:
            found.append(("choice", json.dumps(self.guided_choice), "guided_choice"))
        if self.guided_grammar is not None:
            found.append(("grammar", self.guided_grammar, "guided_grammar"))
        if self.structured_outputs is not None:
            so = self.structured_outputs.constraints()
            if len(so) > 1:
                kinds = ", ".join(kind for kind, _ in so)
                raise ConstraintConflict(
                    f"give at most one output constraint in structured_outputs; got {kinds}",
                    "structured_outputs",
                )
            found += [(kind, spec, "structured_outputs") for kind, spec in so]
        if len(found) > 1:
            names = ", ".join(f[2] for f in found)
            raise ConstraintConflict(f"give at most one output constraint; got {names}")
        return found[0] if found else None

    def logit_bias_ids(self) -> dict[int, float]:
        """Token id -> bias, each bias clamped to OpenAI's range [-100, 100], as vLLM."""
        return {int(k): min(100.0, max(-100.0, v)) for k, v in (self.logit_bias or {}).items()}

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


# -- completions --------------------------------------------------------------------------

Prompt = str | list[str] | list[NonNegInt] | list[list[NonNegInt]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    # 0 with echo scores the prompt without generating (lm-eval's loglikelihood requests).
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    # vLLM's: BOS (and whatever else the tokenizer adds) around each text prompt; token-id
    # prompts are taken as they are.
    add_special_tokens: bool = True

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: Prompt) -> Prompt:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        if isinstance(v, list) and any(isinstance(p, list) and not p for p in v):
            raise ValueError("prompt token-id lists must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts this request stands for (OpenAI allows 1 or many)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs object: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class Logprob(BaseModel):
    """vLLM's logprob of one token in ``prompt_logprobs``; rank 1 is the most likely."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: one entry per prompt token, None for the first (it has no
# context), else token id -> its Logprob: the prompt token itself and the top k.
PromptLogprobs = list[dict[int, Logprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobs | None = None


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


class CompletionStreamResponse(BaseModel):
    """One SSE chunk; OpenAI reuses ``text_completion`` as the chunk object name."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# -- chat ---------------------------------------------------------------------------------


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class MessageFunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends JSON text; some clients the object


class MessageToolCall(_Lenient):
    """A call in an assistant message of the history (chat templates read it)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The message's text; non-text parts (images, audio) are refused by the server.
        Text parts are joined by a newline, as vLLM joins them for a template that reads
        the content as a string: joined by nothing, "Describe:" and "the cat" made a
        prompt a vLLM-served model never saw ("Describe:the cat")."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text or "" for p in self.content if p.type == "text")

    def text_parts(self) -> list[dict[str, str]]:
        """The message's text as OpenAI content parts, for a template that loops over
        them: a string is one part, no content none."""
        if self.content is None:
            return []
        if isinstance(self.content, str):
            return [{"type": "text", "text": self.content}]
        return [{"type": "text", "text": p.text or ""} for p in self.content if p.type == "text"]


# How a chat template reads a message's content (vLLM's --chat-template-content-format):
# "string", the text; "openai", the list of content parts (a template that loops over it).
ContentFormat = Literal["string", "openai"]


def template_messages(
    messages: list[ChatMessage], content_format: ContentFormat = "string"
) -> list[dict[str, Any]]:
    """What the chat template reads of each message: every field the caller sent, the
    content as text, or as a list of text parts for a template that loops over parts
    (``content_format``, Tokenizer.chat_content_format). Tool-calling templates read an
    assistant's ``tool_calls``, a tool result's ``tool_call_id`` and a message's ``name``:
    without them the model never sees which call it made nor which result answers it. The
    daemon and the gateway both render these (pagefleet/api/chat_prompt.py)."""
    out = []
    for m in messages:
        msg = m.model_dump(exclude_none=True)
        msg["content"] = m.text_parts() if content_format == "openai" else m.text()
        calls = msg.get("tool_calls")
        if isinstance(calls, list):
            msg["tool_calls"] = [_call_for_template(c) for c in calls]
        out.append(msg)
    return out


def cut_after_final(text: str, final: str) -> str | None:
    """``text`` (a rendered chat) up to the end of its last occurrence of the final
    message's text, so the model continues that message (``continue_final_message``);
    templates that strip a message are matched on the stripped text. None when the
    template did not write it at all."""
    for needle in (final, final.strip()):
        at = text.rfind(needle) if needle else -1
        if at >= 0:
            return text[: at + len(needle)]
    return None


def _call_for_template(call: Any) -> Any:
    """A tool call as chat templates read it: OpenAI sends ``arguments`` as JSON text;
    templates (Hugging Face's convention, which vLLM follows) expect the object, and would
    otherwise write it as a quoted string. Text that is not a JSON object stays as is."""
    fn = call.get("function") if isinstance(call, dict) else None
    args = fn.get("arguments") if isinstance(fn, dict) else None
    if not isinstance(args, str):
        return call
    try:
        parsed = json.loads(args)
    except ValueError:
        return call
    if not isinstance(parsed, dict):
        return call
    return {**call, "function": {**fn, "arguments": parsed}}


class ToolFunction(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: ToolFunction


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    # vLLM's: the prompt ends inside the final message, which the model continues.
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the template's ``documents`` variable (retrieval-augmented templates).
    documents: list[dict[str, Any]] | None = None
    # vLLM's: true adds the tokenizer's special tokens (BOS) around the rendered prompt on
    # top of what the template writes; false, vLLM's default, adds none: the template
    # writes the prompt's BOS or there is none (chat_prompt.add_special_tokens).
    add_special_tokens: bool = False
    # vLLM's: the reply starts with the final message's text when it has the reply's role
    # (with continue_final_message: the whole assistant message, not just its end).
    echo: bool = False
    # vLLM's per-request template: refused (_no_request_template).
    chat_template: str | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (auto tool choice)

    def forced_tool_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must match when ``tool_choice`` forces a call:
        ``{"name": ..., "arguments": {...}}`` of one of the tools (``required``) or of the
        named one. None when the model may answer in text. ValueError for a name that is
        not among ``tools``."""
        choice = self.tool_choice
        if not self.tools or choice is None or choice in ("none", "auto"):
            return None
        tools = self.tools
        if isinstance(choice, NamedToolChoice):
            tools = [t for t in self.tools if t.function.name == choice.function.name]
            if not tools:
                raise ValueError(f"tool_choice names {choice.function.name!r}, not in tools")
        options = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    "arguments": t.function.parameters or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in tools
        ]
        return options[0] if len(options) == 1 else {"anyOf": options}

    @field_validator("chat_template", "chat_template_kwargs")
    @classmethod
    def _no_request_template(cls, v: Any) -> Any:
        return refuse_request_template(v)

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return v

    def effective_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; OpenAI prefers it when both are given.
        return self.max_completion_tokens or self.max_tokens


_REQUEST_TEMPLATE = (
    "a chat template sent with the request is not accepted: a template is code, and this "
    "server (its gateway too) renders every request with the model's own template (vLLM "
    "refuses one too unless started with --trust-request-chat-template); drop "
    "'chat_template' and send template variables in chat_template_kwargs"
)


def refuse_request_template(value: Any) -> Any:
    """Validator of ``chat_template`` and ``chat_template_kwargs``: a request's own template,
    as a field or in chat_template_kwargs (where vLLM reads it too), is refused by name.
    Taken as a mere variable it was silently ignored; run, it would be the caller's code
    on the daemon's and the gateway's event loops (sandboxed, but a loop of 10**9
    iterations still stalls every stream)."""
    if isinstance(value, str) or (isinstance(value, dict) and value.get("chat_template")):
        raise ValueError(_REQUEST_TEMPLATE)
    return value


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


# How a daemon reads tool calls out of free text when ``tool_choice`` is "auto": the
# daemon's --tool-call-parser and the CRD's engine.toolCallParser take these names.
ToolCallParser = Literal["none", "hermes", "llama3_json", "pythonic", "mistral"]
TOOL_CALL_PARSERS: tuple[str, ...] = get_args(ToolCallParser)

_ID_ALPHABET = string.ascii_letters + string.digits


def new_tool_call_id() -> str:
    """A tool call's id: 9 random letters and digits. Clients send it back in the history,
    and chat templates differ in what they accept there: Mistral's raise on any id that is
    not 9 alphanumeric characters (the 37-character ``call-<hex>`` ids made every next
    turn a 400); Llama's, Qwen's and Hermes' ignore it. 62**9 ids: no clash in a chat."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


class ToolCall(BaseModel):
    id: str = Field(default_factory=new_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A piece of a streamed tool call: the first carries id, type and name; the others
    the next piece of the arguments' text (clients concatenate them by ``index``)."""

    index: int = 0
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


# The role a reply is reported with: the assistant's, or with add_generation_prompt false
# the final message's, which the reply continues (chat_prompt.reply_role, as vLLM).
ReplyRole = Literal["system", "developer", "user", "assistant", "tool"]


class ChatResponseMessage(BaseModel):
    role: ReplyRole = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's prompt_logprobs: on the response, not each choice (chat has one prompt).
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    role: ReplyRole | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# -- models -------------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pagefleet"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- vLLM's /tokenize and /detokenize -----------------------------------------------------


class TokenizeRequest(_Lenient):
    """Either ``prompt`` or ``messages`` (vLLM accepts both shapes)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # Not sent: as vLLM, true for a prompt; for messages, chat's rule (ChatCompletionRequest).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # With messages, as chat: the template shows the tools and documents and reads these
    # variables.
    tools: list[Tool] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None

    @field_validator("chat_template", "chat_template_kwargs")
    @classmethod
    def _no_request_template(cls, v: Any) -> Any:
        return refuse_request_template(v)

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[NonNegInt]


class DetokenizeResponse(BaseModel):
    prompt: str
