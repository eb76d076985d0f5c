"""The OpenAI chat-completions wire format the endpoint accepts, as strict pydantic models, and the
turn from a request's messages into the dicts a chat template renders.

Only what a token-exact policy server can honour is accepted: one choice, no stop strings, no
penalties or token biases, no tool choice but 'auto', no structured output, no top alternatives in
`logprobs`, no limit of one call per turn (`parallel_tool_calls: false`), no output but text, no
reasoning effort, none of the legacy `functions`/`function_call` fields. Such options are refused
with a message naming them rather than ignored, because ignoring them would hand a client
something other than what it asked for; their neutral values (null, zero, `logit_bias: {}`,
`response_format: {"type": "text"}`, `parallel_tool_calls: true`, `modalities: ["text"]`) are
accepted. `seed` gives the request a random stream of its own (the same seeded request samples
the same tokens), except where the recipe's sampling wins (agent episodes for training, whose
turns take seeds of the episode's). Fields this endpoint does not know are ignored: clients send
many optional ones (`metadata`, a message's `refusal`, ...).

This module does not sample, keep sessions or speak HTTP.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agentrl.rollout.chat import normalize_tool_calls
from agentrl.tools.parsers import MAX_ARGUMENT_DEPTH, nesting_depth

SESSION_HEADER = "X-Agentrl-Session"


class RequestError(Exception):
    """A request the endpoint refuses: an HTTP status, an OpenAI error code and one-line message."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.code = message, status, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.code, self.status)


def error_body(message: str, code: str, status: int) -> dict[str, Any]:
    """OpenAI's error shape, which its clients turn into the exception's message: `type` is the
    class OpenAI uses for the status (the request's fault, or the server's), `code` the reason."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionCallIn(_Strict):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class MessageIn(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    function_call: dict[str, Any] | None = None  # the legacy form of a call: refused, not dropped

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """An image, audio, file or refusal part named, not as the union's first type's error
        ("content.str: Input should be a valid string")."""
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"part {j} is of type {kind!r}; only text parts are supported")
            try:
                TextPart.model_validate(part)
            except ValidationError as e:
                raise ValueError(f"part {j}: {describe(e)}") from None
        return content

    @model_validator(mode="after")
    def _content_present(self) -> "MessageIn":
        if self.function_call is not None:
            raise ValueError("the legacy function_call form is not supported; send the call in tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs 'content'")
        return self


class ToolFunctionSpec(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(_Strict):
    type: Literal["function"]
    function: ToolFunctionSpec


class StreamOptions(_Strict):
    include_usage: bool | None = None  # a last chunk with the usage (a string "false" is refused, not true)


class ChatRequest(_Strict):
    model: str | None = None  # any name is accepted: the endpoint serves one model
    messages: list[MessageIn] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None  # kept as sent: the template renders exactly these
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None  # OpenAI's nullable fields: null means the default
    top_logprobs: int | None = Field(None, ge=0)
    n: int | None = Field(None, ge=1)
    stream: bool | None = None  # answered as events once the turn is sampled (app.stream_chunks)
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id → bias
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None
    functions: list[Any] | None = None  # the legacy function-calling API
    function_call: str | dict[str, Any] | None = None
    user: str | None = None
    reasoning_effort: str | None = None
    seed: int | None = None  # OpenAI's is an int64; any integer is taken, modulo 2**64

    @model_validator(mode="after")
    def _supported(self) -> "ChatRequest":
        for i, tool in enumerate(self.tools or []):
            try:
                ToolSpec.model_validate(tool)
            except ValidationError as e:
                raise ValueError(describe(e, prefix=f"tools.{i}.")) from None
        refused = [
            (self.n not in (None, 1), "n: one choice per request is supported"),
            (bool(self.stop), "stop: stop sequences are not supported; turns end at the end-of-turn token"),
            (bool(self.top_logprobs), "top_logprobs: only the sampled token's logprob is available"),
            (bool(self.frequency_penalty) or bool(self.presence_penalty),
             "frequency_penalty/presence_penalty: penalties are not supported"),
            (any((self.logit_bias or {}).values()), "logit_bias: token biases are not supported"),
            (self.response_format not in (None, {"type": "text"}),
             'response_format: only {"type": "text"} is supported; structured output is not'),
            (self.tool_choice not in (None, "auto"), "tool_choice: only 'auto' is supported"),
            (self.functions is not None or self.function_call is not None,
             "functions/function_call: the legacy function-calling fields are not supported; send tools"),
            (self.parallel_tool_calls is False,
             "parallel_tool_calls: false is not supported; the model may call several tools in one turn"),
            (self.modalities not in (None, ["text"]), 'modalities: only ["text"] is supported'),
            (self.reasoning_effort is not None, "reasoning_effort: reasoning effort is not supported"),
        ]
        for problem, message in refused:
            if problem:
                raise ValueError(message)
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def parse_request(body: bytes) -> ChatRequest:
    """A validated request, or a RequestError naming the first problem (`messages.0.role: ...`)."""
    try:
        request = ChatRequest.model_validate_json(body)
    except ValidationError as e:
        raise RequestError(describe(e)) from None
    refuse_non_finite(request)
    return request


def refuse_non_finite(request: BaseModel) -> None:
    """A RequestError naming the first NaN or infinity in `request` (in a tool's schema, a call's
    arguments): the JSON reader takes `NaN`, `Infinity` and `1e999`, which no JSON answer can hold,
    so a session recording them could no longer be read, and an answer echoing them failed after
    its turn was sampled and recorded."""
    stack: list[tuple[Any, str]] = [(request.model_dump(exclude_none=True), "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise RequestError(f"{where}: {value} is not a JSON number")
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        stack.extend((item, f"{where}.{key}" if where else str(key)) for key, item in reversed(list(items)))


def describe(e: ValidationError, prefix: str = "") -> str:
    first = e.errors()[0]
    where = prefix + ".".join(str(p) for p in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    more = f" (and {e.error_count() - 1} more problems)" if e.error_count() > 1 else ""
    return f"{where}: {message}{more}" if where else f"{message}{more}"


def chat_messages(messages: list[MessageIn]) -> list[dict[str, Any]]:
    """The request's messages as the dicts chat templates render: text parts joined, `developer`
    as `system`, tool calls with mapping arguments (normalize_tool_calls), and each tool message
    named after the call it answers (templates that show a tool's name need it; OpenAI sends only
    the call id: the name is that of the call with this id in the latest assistant message before
    it, since clients reuse ids such as `call_0` from turn to turn)."""
    call_names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.role == "assistant":
            call_names = {call.id: call.function.name for call in m.tool_calls or [] if call.id}
        content = "".join(p.text for p in m.content) if isinstance(m.content, list) else m.content
        role = "system" if m.role == "developer" else m.role
        message: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant" and m.tool_calls:
            too_deep = RequestError(f"messages.{i}.tool_calls: arguments are nested more than "
                                    f"{MAX_ARGUMENT_DEPTH} levels deep")  # deeper than templates render
            try:
                message = normalize_tool_calls({**message, "tool_calls": [c.model_dump() for c in m.tool_calls]})
            except RecursionError:  # json.loads of arguments nested beyond Python's recursion limit
                raise too_deep from None
            if any(nesting_depth(call["function"]["arguments"]) > MAX_ARGUMENT_DEPTH for call in message["tool_calls"]):
                raise too_deep
        if role == "tool":
            name = m.name or call_names.get(m.tool_call_id)
            message.update({k: v for k, v in (("tool_call_id", m.tool_call_id), ("name", name)) if v})
        out.append(message)
    return out
