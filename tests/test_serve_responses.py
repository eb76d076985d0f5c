"""The Responses API route: an agent written against `client.responses` records the episode a chat
agent records, streamed or not, and what the route cannot honour is refused by name.

As in test_serve.py, everything is real (tokenizer, template, parser, uvicorn on 127.0.0.1, the
openai client) except the policy's sampling, scripted where a test needs a specific turn.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from agentrl.tools.builtin.calculator import calculator
from tests.conftest import ScriptedEngine
from tests.test_serve import ANSWER, CALL, TASK, calculator_agent, run_agent


def responses_tools(chat_tools: list[dict]) -> list[dict]:
    return [{"type": "function", **tool["function"]} for tool in chat_tools]


async def next_response(client, stream: bool, **request):
    """The response to `request`; streamed, the one `response.completed` carries, after checking
    that the streamed text and arguments add up to it."""
    if not stream:
        return await client.responses.create(**request)
    text, arguments, final = "", "", None
    async for event in await client.responses.create(stream=True, **request):
        if event.type == "response.output_text.delta":
            text += event.delta
        elif event.type == "response.function_call_arguments.delta":
            arguments += event.delta
        elif event.type == "response.completed":
            final = event.response
    assert text == final.output_text
    assert arguments == "".join(item.arguments for item in final.output if item.type == "function_call")
    return final


async def responses_agent(ctx, task, stream=False):
    """calculator_agent over the Responses API, as the OpenAI Agents SDK drives it: the whole
    conversation as input items each time, the output items appended as received."""
    client = ctx.openai_client()
    items = [{"role": m["role"], "content": m["content"]} for m in task.messages(ctx.system_prompt)]
    for _ in range(8):
        response = await next_response(client, stream, model=ctx.model, input=items, tools=responses_tools(ctx.tools))
        assert response.status == "completed" and response.usage.output_tokens > 0
        items += [item.model_dump(exclude_none=True) for item in response.output]
        calls = [{"id": item.call_id, "function": {"name": item.name, "arguments": item.arguments}}
                 for item in response.output if item.type == "function_call"]
        answers = await ctx.run_tools(calls, response.output_text)
        if not answers:
            return
        items += [{"type": "function_call_output", "call_id": a["tool_call_id"], "output": a["content"]}
                  for a in answers]


async def streaming_responses_agent(ctx, task):
    await responses_agent(ctx, task, stream=True)


@pytest.mark.parametrize("agent", [responses_agent, streaming_responses_agent], ids=["plain", "streamed"])
@pytest.mark.parametrize("first_turn", [CALL, "I will use the calculator.\n" + CALL], ids=["call", "text-and-call"])
def test_a_responses_agent_records_the_episode_a_chat_agent_does(agent, first_turn, tokenizer):
    """POST /v1/responses was a 404, and the OpenAI Agents SDK speaks the Responses API by default."""
    chat, responses = (run_agent(each, ScriptedEngine(tokenizer, [first_turn, ANSWER]), tokenizer)
                       for each in (calculator_agent, agent))
    assert responses.error is None and responses.finish == "stop" and responses.reward == chat.reward == 1.0
    assert (responses.token_ids, responses.loss_mask, responses.logprobs) == \
        (chat.token_ids, chat.loss_mask, chat.logprobs)
    assert responses.metrics["segments"] == 1 and responses.metrics["turns"] == 2  # the items continued the turn


def test_a_response_carries_text_calls_usage_and_logprobs(served, tokenizer):
    server, engine = served(["Sure.\n" + CALL, "The answer is"])
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    tools = responses_tools([calculator.schema])
    response = client.responses.create(model="scripted", instructions="Use tools.", input=TASK.prompt, tools=tools,
                                       include=["message.output_text.logprobs"])
    message, call = response.output
    assert (response.status, response.object, response.store) == ("completed", "response", False)
    assert message.type == "message" and message.content[0].text == "Sure."
    assert (call.type, call.name, json.loads(call.arguments)) == \
        ("function_call", "calculator", {"expression": "1234 * 5678"})
    turn = engine.turns[0]
    assert [lp.logprob for lp in message.content[0].logprobs] == pytest.approx([-0.01 * (i + 1) for i in range(len(turn))])
    assert response.usage.output_tokens == len(turn)
    assert response.usage.input_tokens == len(engine.prompts[0])
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    # a turn cut off by max_output_tokens is incomplete, and says why
    cut = client.responses.create(model="scripted", input="Go on.", max_output_tokens=2)
    assert (cut.status, cut.incomplete_details.reason, cut.output_text) == ("incomplete", "max_output_tokens", "The answer")


def test_streamed_response_events_in_order(served):
    server, _ = served(["Sure.\n" + CALL])
    body = {"input": TASK.prompt, "tools": responses_tools([calculator.schema]), "stream": True}
    with httpx.stream("POST", f"{server.base_url}/responses", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[0::2]]
    events = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert names == [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert events[0]["response"]["output"] == [] and events[0]["response"]["status"] == "in_progress"
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == final["output"]
    assert events[4]["delta"] == "Sure." and events[9]["delta"] == '{"expression": "1234 * 5678"}'


@pytest.mark.parametrize("body, message", [
    ({"input": "x", "previous_response_id": "resp_1"},
     "previous_response_id/conversation: responses are not stored; send the whole conversation in input"),
    ({"input": []}, "input: at least one item is needed"),
    ({"input": [{"type": "reasoning", "summary": []}]},
     "input.0.type: items of type 'reasoning' are not supported (messages, function_call and "
     "function_call_output are)"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type: only text parts are supported, not 'input_image'"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input.0.call_id: Field required"),
    # a list or mapping as the type: `in` a dict raised TypeError, a 500
    ({"input": [{"type": ["message"], "role": "user", "content": "hi"}]},
     "input.0.type: items of type ['message'] are not supported (messages, function_call and function_call_output "
     "are)"),
    ({"input": [{"type": {}, "role": "user", "content": "hi"}]},
     "input.0.type: items of type {} are not supported (messages, function_call and function_call_output are)"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type: only function tools are supported, not "
                                                         "'web_search'"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools.0.name: Field required"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {}}}},
     'text.format: only {"type": "text"} is supported; structured output is not'),
    ({"input": "x", "tool_choice": "required"}, "tool_choice: only 'auto' is supported"),
    ({"input": "x", "truncation": "auto"}, "truncation: 'auto' is not supported; a conversation is never cut short"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning: reasoning effort is not supported"),
])
def test_what_the_route_cannot_honour_is_refused_by_name(served, body, message):
    server, engine = served(["unused"])
    r = httpx.post(f"{server.base_url}/responses", json=body)
    assert (r.status_code, r.json()["error"]["message"]) == (400, message)
    assert r.json()["error"]["type"] == "invalid_request_error" and engine.prompts == []


@pytest.mark.parametrize("stream", [False, True])
def test_a_nan_in_a_tools_schema_is_a_400_before_anything_is_sampled(served, stream):
    """The answer echoes the tools: JSONResponse refused the NaN after the turn was sampled and
    recorded (a 500, and the client's retry was counted as a history rewrite), and a stream sent
    it as a bare NaN, which no client's JSON reader takes."""
    server, engine = served(["unused"])
    body = {"input": "hi", "user": "r", "stream": stream,
            "tools": [{"type": "function", "name": "f", "parameters": {"default": float("nan")}}]}
    r = httpx.post(f"{server.base_url}/responses", content=json.dumps(body),  # json.dumps writes NaN
                   headers={"content-type": "application/json"})
    assert (r.status_code, r.json()["error"]["message"]) == (400, "tools.0.parameters.default: nan is not a JSON "
                                                                  "number")
    assert engine.prompts == []
    assert httpx.get(f"{server.base_url.removesuffix('/v1')}/agentrl/sessions/r").status_code == 404


def test_options_that_ask_for_nothing_here_are_accepted(served):
    server, _ = served([ANSWER])
    body = {"input": "x", "store": True, "include": ["reasoning.encrypted_content"], "metadata": {"run": "1"},
            "truncation": "disabled", "reasoning": {"effort": None}, "text": {"format": {"type": "text"}},
            "parallel_tool_calls": True, "tool_choice": "auto"}
    r = httpx.post(f"{server.base_url}/responses", json=body)
    assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == ANSWER
    assert r.json()["store"] is False and r.json()["metadata"] == {"run": "1"}


def test_an_empty_reply_is_an_empty_message_the_client_sends_back(served):
    """A turn that ends at once had no output item, so a client returning the items it received left
    the assistant turn out of its next request and the session could not continue it."""
    server, engine = served(["", "Hello."])
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    first = client.responses.create(model="scripted", input="Say nothing.")
    [item] = first.output
    assert (item.type, item.role, item.content[0].text, first.output_text) == ("message", "assistant", "", "")
    items = [{"role": "user", "content": "Say nothing."}, item.model_dump(exclude_none=True),
             {"role": "user", "content": "Now say hello."}]
    assert client.responses.create(model="scripted", input=items).output_text == "Hello."
    first_turn = engine.prompts[0] + engine.turns[0]
    assert engine.turns[0] == [2]  # <|im_end|> alone
    assert engine.prompts[1][:len(first_turn)] == first_turn  # the second request continued the first turn
