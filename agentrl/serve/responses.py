"""OpenAI's Responses API (`POST /v1/responses`), served by translation onto chat completions.

The OpenAI Agents SDK and other recent clients speak the Responses API by default. A request here
becomes the chat request it stands for, which ChatService serves like any other (the same sessions,
recording and masks), and the chat answer becomes a `response` object:

- `instructions` becomes a system message before the input. `input` (a string stands for one user
  message) is a list of items: a message becomes a message (`input_text`/`output_text` parts
  joined); an assistant message item and the `function_call` items after it become one assistant
  message with `tool_calls` (each call's `call_id` its id); a `function_call_output` becomes a
  tool message answering its `call_id`;
- function tools (`name`, `description`, `parameters`, `strict`) are the chat tools
  `{"type": "function", "function": {...}}` with those keys, which is what the Agents SDK sends over
  chat completions, so one conversation renders the same tokens through either API;
- the answer: a `message` item with the reply's text (and its tokens' logprobs when `include` asks
  for `message.output_text.logprobs`), then one `function_call` item per call; status `incomplete`
  with reason `max_output_tokens` for a turn cut off by its budget; usage in input/output tokens.

A client that sends back the output items it received continues its session token for token, as a
chat client sending back its replies does. Only stateless use is served: nothing is stored (the
answer says `store: false`), so `previous_response_id`, `conversation` and stored prompts are
refused, as are options the chat path refuses (tool choices but `auto`, `parallel_tool_calls:
false`, structured output, top logprobs) and the ones it has no counterpart for (built-in tools,
non-text input, `truncation: auto`, background runs, reasoning effort). Unknown fields are ignored,
as on the chat path. With `stream: true` the answer is sent as the Responses API's events once the
turn is sampled (response_events), as app.stream_chunks does for chat.

This module does not sample or record; it only translates.
"""

from __future__ import annotations

import itertools
import json
import uuid
from typing import Any, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from agentrl.serve.protocol import ChatRequest, RequestError, describe, refuse_non_finite

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


TEXT_PARTS = ("input_text", "output_text", "text")


class TextPart(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


ITEMS: dict[str, type[_Strict]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                    "function_call_output": FunctionCallOutputItem}
Item = MessageItem | FunctionCallItem | FunctionCallOutputItem


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_output_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = Field(None, ge=0)
    include: list[str] | None = None  # only the logprobs one changes the answer; the others ask for nothing here
    stream: bool | None = None
    text: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    store: bool | None = None  # nothing is stored whatever it says; the answer says store: false
    metadata: dict[str, str] | None = None
    user: str | None = None
    _items: list[Item] = PrivateAttr(default_factory=list)  # `input`, validated item by item below

    @model_validator(mode="after")
    def _supported(self) -> "ResponsesRequest":
        raw = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        if not raw:
            raise ValueError("input: at least one item is needed")
        for i, item in enumerate(raw):
            kind = item.get("type", "message")
            if not isinstance(kind, str) or kind not in ITEMS:  # a list or mapping: unhashable
                raise ValueError(f"input.{i}.type: items of type {kind!r} are not supported (messages, "
                                 "function_call and function_call_output are)")
            for field in ("content", "output"):  # an image or file part: named, not a union's two errors
                parts = item.get(field)
                for j, part in enumerate(parts if isinstance(parts, list) else []):
                    part_type = part.get("type") if isinstance(part, dict) else None
                    if part_type not in TEXT_PARTS:
                        raise ValueError(f"input.{i}.{field}.{j}.type: only text parts are supported, "
                                         f"not {part_type!r}")
            try:
                self._items.append(ITEMS[kind].model_validate(item))
            except ValidationError as e:
                raise ValueError(describe(e, prefix=f"input.{i}.")) from None
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                raise ValueError(f"tools.{i}.type: only function tools are supported, not {tool.get('type')!r}")
            try:
                FunctionTool.model_validate(tool)
            except ValidationError as e:
                raise ValueError(describe(e, prefix=f"tools.{i}.")) from None
        text_format = (self.text or {}).get("format")
        refused = [
            (self.previous_response_id is not None or self.conversation is not None,
             "previous_response_id/conversation: responses are not stored; send the whole conversation in input"),
            (self.prompt is not None, "prompt: stored prompts are not supported; send instructions and input"),
            (self.background is True, "background: background responses are not supported"),
            (self.truncation == "auto", "truncation: 'auto' is not supported; a conversation is never cut short"),
            ((self.reasoning or {}).get("effort") is not None, "reasoning: reasoning effort is not supported"),
            (self.tool_choice not in (None, "auto"), "tool_choice: only 'auto' is supported"),
            (self.parallel_tool_calls is False,
             "parallel_tool_calls: false is not supported; the model may call several tools in one turn"),
            (text_format not in (None, {"type": "text"}),
             'text.format: only {"type": "text"} is supported; structured output is not'),
            (bool(self.top_logprobs), "top_logprobs: only the sampled token's logprob is available"),
        ]
        for problem, message in refused:
            if problem:
                raise ValueError(message)
        return self

    def chat_request(self) -> ChatRequest:
        """The chat request this one stands for (the module docstring gives the mapping)."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        for item in self._items:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": _text(item.content)})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":  # the same turn's text, or its earlier calls
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        tools = [{"type": "function", "function": {key: tool[key] for key in ("name", "description", "parameters",
                                                                               "strict") if key in tool}}
                 for tool in self.tools or []] or None
        try:
            return ChatRequest.model_validate(
                {"model": self.model, "messages": messages, "tools": tools, "temperature": self.temperature,
                 "top_p": self.top_p, "max_completion_tokens": self.max_output_tokens, "user": self.user,
                 "logprobs": LOGPROBS_INCLUDE in (self.include or [])})
        except ValidationError as e:  # named as the chat request's fields: say so
            raise RequestError(f"input, as chat messages: {describe(e)}") from None


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def parse_responses_request(body: bytes) -> ResponsesRequest:
    """A validated request, or a RequestError naming the first problem (`input.2.call_id: ...`)."""
    try:
        request = ResponsesRequest.model_validate_json(body)
    except ValidationError as e:
        raise RequestError(describe(e)) from None
    refuse_non_finite(request)
    return request


def response_object(request: ResponsesRequest, answer: dict[str, Any]) -> dict[str, Any]:
    """The chat completion `answer` to `request` as a Responses API `response`."""
    [choice] = answer["choices"]
    message, cut = choice["message"], choice["finish_reason"] == "length"
    status = "incomplete" if cut else "completed"
    output: list[dict[str, Any]] = []
    if message["content"] or not message.get("tool_calls"):  # an empty reply is still a message the client returns
        logprobs = (choice["logprobs"] or {}).get("content") or []
        output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
                       "content": [{"type": "output_text", "text": message["content"], "annotations": [],
                                    "logprobs": logprobs}]})
    for call in message.get("tool_calls") or []:
        output.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    usage = answer["usage"]
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": answer["created"],
            "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "model": answer["model"], "output": output, "parallel_tool_calls": True, "previous_response_id": None,
            "reasoning": None, "store": False, "temperature": request.temperature, "text": {"format": {"type": "text"}},
            "tool_choice": "auto", "tools": request.tools or [], "top_p": request.top_p, "truncation": "disabled",
            "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": usage["total_tokens"]},
            "user": request.user, "metadata": request.metadata or {}}


def response_events(response: dict[str, Any]) -> Iterator[str]:
    """A finished `response` as the server-sent events the Responses API streams: created and
    in progress, each output item added, its text or arguments (whole, one delta) and done, then
    `response.completed` (or `response.incomplete`) carrying the whole response."""
    sequence = itertools.count()

    def event(kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": next(sequence), **fields}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    started = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    for index, item in enumerate(response["output"]):
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            [part] = item["content"]
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "content": []})
            yield event("response.content_part.added", **where, content_index=0,
                        part={**part, "text": "", "logprobs": []})
            yield event("response.output_text.delta", **where, content_index=0, delta=part["text"],
                        logprobs=part["logprobs"])
            yield event("response.output_text.done", **where, content_index=0, text=part["text"],
                        logprobs=part["logprobs"])
            yield event("response.content_part.done", **where, content_index=0, part=part)
        else:
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "arguments": ""})
            yield event("response.function_call_arguments.delta", **where, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **where, name=item["name"],
                        arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index, item=item)
    yield event(f"response.{response['status']}", response=response)
