"""The OpenAI-compatible endpoint and agent functions: token-exact sessions across HTTP turns.

Everything is real except the policy's sampling where a test needs a specific tool call
(ScriptedEngine): the tokenizer and template, the parser, the tools, uvicorn on 127.0.0.1, the
openai client. One test runs `agentrl serve` as a subprocess on the tiny random model.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import select
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from agentrl.config import RecipeConfig
from agentrl.env.rewards import gsm8k_reward
from agentrl.errors import ConfigError
from agentrl.rollout.chat import normalize_tool_calls
from agentrl.rollout.collect import run_episodes
from agentrl.rollout.episode import EpisodeRunner, EpisodeSettings
from agentrl.rollout.hf_engine import HFEngine
from agentrl.rollout.run import build_runner
from agentrl.serve.agent import AgentRunner, load_agent
from agentrl.serve.protocol import RequestError, parse_request
from agentrl.serve.service import ChatService, ServeSettings
from agentrl.tools.builtin.calculator import calculator
from agentrl.tools.parsers import parse_hermes
from agentrl.types import Completion, Task, Trajectory, derive_seed
from tests.conftest import ScriptedEngine, make_tiny_llama

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}\n</tool_call>'
ANSWER = "1234 * 5678 = 7006652. The answer is 7006652."
TASK = Task(id="t1", prompt="What is 1234 * 5678?", answer="#### 7006652")


async def calculator_agent(ctx, task, after_tools=None):
    """A plain OpenAI-client tool loop, as a user would write it (the README's): it also answers
    the malformed call blocks left in a reply, and stops when nothing was called. `after_tools`,
    given, is awaited with the client after each turn's tools ran."""
    client = ctx.openai_client()
    messages = task.messages(ctx.system_prompt)
    for _ in range(8):
        response = await client.chat.completions.create(model=ctx.model, messages=messages, tools=ctx.tools)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        answers = await ctx.run_tools(message.tool_calls, message.content)
        if not answers:
            return
        messages += answers
        if after_tools is not None:
            await after_tools(client)


async def streaming_agent(ctx, task):
    """calculator_agent with `stream=True`, putting each reply together from its chunks as
    streaming frameworks do; it checks the usage chunk it asked for."""
    client = ctx.openai_client()
    messages = task.messages(ctx.system_prompt)
    for _ in range(8):
        stream = await client.chat.completions.create(model=ctx.model, messages=messages, tools=ctx.tools,
                                                      stream=True, stream_options={"include_usage": True})
        content, calls, usage, finish = "", {}, None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                content += choice.delta.content or ""
                finish = choice.finish_reason or finish
                for call in choice.delta.tool_calls or []:
                    slot = calls.setdefault(call.index, {"id": "", "type": "function",
                                                         "function": {"name": "", "arguments": ""}})
                    slot["id"] += call.id or ""
                    slot["function"]["name"] += call.function.name or ""
                    slot["function"]["arguments"] += call.function.arguments or ""
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens > usage.prompt_tokens
        assert finish == ("tool_calls" if calls else "stop")
        message = {"role": "assistant", "content": content or None}
        messages.append(message | ({"tool_calls": [calls[i] for i in sorted(calls)]} if calls else {}))
        answers = await ctx.run_tools([calls[i] for i in sorted(calls)], content)
        if not answers:
            return
        messages += answers


def test_a_streaming_agent_records_the_episode_the_plain_one_does(tokenizer):
    """Streaming was refused, and frameworks that stream by default (LangGraph's message stream,
    the Agents SDK's run_streamed) failed every episode."""
    plain, streamed = (run_agent(agent, ScriptedEngine(tokenizer, [CALL, ANSWER]), tokenizer)
                       for agent in (calculator_agent, streaming_agent))
    assert streamed.finish == "stop" and streamed.error is None and streamed.reward == plain.reward == 1.0
    assert (streamed.token_ids, streamed.loss_mask) == (plain.token_ids, plain.loss_mask)
    def without_ids(traj):  # call ids are drawn per reply
        return [{k: v for k, v in m.items() if k != "tool_call_id"} for m in traj.messages]

    assert without_ids(streamed) == without_ids(plain)
    assert streamed.metrics["tool_calls"] == 1 and streamed.metrics["segments"] == 1


def test_streamed_events_carry_the_answer_and_end_with_done(served):
    server, _ = served([CALL])
    body = {"messages": TASK.messages(), "tools": [calculator.schema], "stream": True, "logprobs": True}
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": None},
        {"tool_calls": [{"index": 0, "id": chunks[1]["choices"][0]["delta"]["tool_calls"][0]["id"], "type": "function",
                         "function": {"name": "calculator", "arguments": '{"expression": "1234 * 5678"}'}}]},
        {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "tool_calls"]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert len(chunks[0]["choices"][0]["logprobs"]["content"]) > 0 and "usage" not in chunks[0]


async def rewriting_agent(ctx, task):
    """Replaces the model's tool-call turn with its own wording before asking again."""
    client = ctx.openai_client()
    first = await client.chat.completions.create(model=ctx.model, messages=task.messages(), tools=ctx.tools)
    call = first.choices[0].message.tool_calls[0]
    messages = task.messages() + [
        {"role": "assistant", "content": "Let me compute.", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "7006652"}]
    await client.chat.completions.create(model=ctx.model, messages=messages, tools=ctx.tools)


async def single_request_agent(ctx, task):
    await ctx.openai_client().chat.completions.create(model=ctx.model, messages=task.messages())


def ids_of(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tools=[calculator.schema], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def agent_runner(agent, engine, tokenizer, **settings) -> AgentRunner:
    return AgentRunner(agent, engine, tokenizer, [calculator], parse_hermes, EpisodeSettings(**settings),
                       reward_fn=gsm8k_reward)


def run_agent(agent, engine, tokenizer, **settings) -> Trajectory:
    """One episode of TASK by `agent` on `engine`, its runner closed after."""
    runner = agent_runner(agent, engine, tokenizer, **settings)
    try:
        return asyncio.run(runner.run(TASK, "g"))
    finally:
        runner.close()


@pytest.mark.parametrize("first_turn", [CALL, "I will use the calculator.\n" + CALL], ids=["call", "text-and-call"])
def test_agent_episode_has_the_builtin_loops_ids_and_mask(first_turn, tmp_path, tiny_model_dir, tokenizer):
    base = {"model": {"path": str(tiny_model_dir)}, "output_dir": str(tmp_path),
            "rollout": {"tool_configs": ["tool_configs/calculator.yaml"]}}
    builtin_engine = ScriptedEngine(tokenizer, [first_turn, ANSWER])
    builtin, _ = build_runner(RecipeConfig.model_validate(base), engine=builtin_engine)
    [expected] = run_episodes(builtin, [TASK], 1, 1)

    engine = ScriptedEngine(tokenizer, [first_turn, ANSWER])
    base["rollout"]["agent"] = "tests.test_serve:calculator_agent"
    runner, _ = build_runner(RecipeConfig.model_validate(base), engine=engine)
    assert isinstance(runner, AgentRunner)
    try:
        [traj] = run_episodes(runner, [TASK], 1, 1)  # collect.py, unchanged
    finally:
        runner.close()

    assert traj.error is None and traj.finish == "stop"
    assert traj.token_ids == expected.token_ids and len(traj.token_ids) > 100
    assert traj.loss_mask == expected.loss_mask and sum(traj.loss_mask) == sum(len(t) for t in engine.turns)
    assert traj.logprobs == expected.logprobs
    assert engine.prompts == builtin_engine.prompts  # the engine saw the same growing sequence
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
    assert traj.messages[1] == expected.messages[1]  # recorded as ChatRenderer.assistant_message does
    assert traj.messages[2]["content"] == "7006652" and traj.messages[2]["name"] == "calculator"
    assert traj.reward == expected.reward == 1.0
    assert {k: traj.metrics[k] for k in ("turns", "segments", "history_rewrites", "tool_calls", "tool_errors")} == \
        {"turns": 2.0, "segments": 1.0, "history_rewrites": 0.0, "tool_calls": 1.0, "tool_errors": 0.0}


def test_rewritten_history_starts_a_new_segment(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL, ANSWER])
    runner = agent_runner(rewriting_agent, engine, tokenizer)
    try:
        traj = asyncio.run(runner.run(TASK, "g"))
    finally:
        runner.close()
    turn1, turn2 = engine.turns
    rewritten = TASK.messages() + [
        normalize_tool_calls({"role": "assistant", "content": "Let me compute.", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1234 * 5678"}}}]}),
        {"role": "tool", "content": "7006652"}]
    fresh = ids_of(tokenizer, rewritten)
    assert engine.prompts[1] == fresh  # rendered afresh, not appended to the first turn
    assert traj.token_ids == fresh + turn2
    assert traj.loss_mask == [0] * len(fresh) + [1] * len(turn2)
    assert traj.metrics["segments"] == 2 and traj.metrics["history_rewrites"] == 1
    assert traj.metrics["dropped_generated_tokens"] == len(turn1) and traj.metrics["turns"] == 1
    assert traj.finish == "stop" and traj.reward == 1.0


def test_tool_calls_in_openai_format_and_session_record(served, tokenizer):
    server, engine = served([CALL, ANSWER])
    body = {"model": "any", "messages": TASK.messages(), "tools": [calculator.schema], "logprobs": True}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, headers={"X-Agentrl-Session": "s1"})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    [call] = choice["message"]["tool_calls"]
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
    assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function",
         "function": {"name": "calculator", "arguments": '{"expression": "1234 * 5678"}'}}]}
    assert choice["finish_reason"] == "tool_calls"
    prompt, turn1 = ids_of(tokenizer, TASK.messages()), engine.turns[0]
    assert r.json()["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(turn1),
                                 "total_tokens": len(prompt) + len(turn1)}
    content = choice["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == CALL + "<|im_end|>"
    assert [t["logprob"] for t in content] == [-0.01 * (i + 1) for i in range(len(turn1))]

    record = httpx.get(f"{server.base_url.removesuffix('/v1')}/agentrl/sessions/s1").json()
    [segment] = record["segments"]
    assert segment["token_ids"] == prompt + turn1
    assert segment["loss_mask"] == [0] * len(prompt) + [1] * len(turn1)
    # `user` names the session when there is no header; a request with neither is not recorded
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    answer = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], user="u2")
    assert answer.choices[0].message.content == ANSWER and answer.choices[0].finish_reason == "stop"
    sessions = f"{server.base_url.removesuffix('/v1')}/agentrl/sessions"
    assert httpx.get(f"{sessions}/u2").json()["metrics"]["session_turns"] == 1
    assert httpx.get(f"{sessions}/none").status_code == 404


def test_bad_requests_get_json_errors_and_the_server_keeps_serving(served, tokenizer):
    class BrokenEngine(ScriptedEngine):
        """Fails once with an exception, then once with a result of the wrong type, then works."""

        async def generate(self, token_ids, sampling):
            self.prompts.append(token_ids)
            if len(self.prompts) == 1:
                raise RuntimeError("device lost")
            if len(self.prompts) == 2:
                return None
            return Completion(self.turns[0], [-0.5] * len(self.turns[0]), "stop", 0)

    server, _ = served(None, max_body_bytes=2000, engine=BrokenEngine(tokenizer, [ANSWER]))
    url = f"{server.base_url}/chat/completions"
    ok = {"messages": [{"role": "user", "content": "hi"}]}
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 3000}]}).encode()
    cases = [
        (b"{not json", 400, "Invalid JSON: key must be a string at line 1 column 2"),
        (b"{}", 400, "messages: Field required"),
        (json.dumps({"messages": "hi"}).encode(), 400, "messages: Input should be a valid array"),
        (json.dumps({**ok, "temperature": "hot"}).encode(), 400, "temperature: Input should be a valid number"),
        (json.dumps({"messages": [{"role": "user"}]}).encode(), 400, "messages.0: a user message needs 'content'"),
        (json.dumps({**ok, "n": 2}).encode(), 400, "n: one choice per request is supported"),
        (json.dumps({**ok, "tools": [{"type": "function"}]}).encode(), 400, "tools.0.function: Field required"),
        (big, 413, f"request body of {len(big)} bytes is over the limit of 2000"),
        (iter([big[:1500], big[1500:]]), 413, "request body is over the limit of 2000 bytes"),  # chunked, no length
        (json.dumps(ok).encode(), 500, "generation failed: RuntimeError: device lost"),
        (json.dumps(ok).encode(), 500, "internal error (AttributeError); see the server log"),
    ]
    for body, status, message in cases:
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
        assert (r.status_code, r.json()["error"]["message"]) == (status, message)
        assert r.json()["error"]["type"] == ("server_error" if status >= 500 else "invalid_request_error")
        assert "Traceback" not in r.text
        assert r.headers.get("x-should-retry") == ("false" if status >= 500 else None)  # the openai client obeys it
    assert httpx.get(f"{server.base_url}/nothing").json()["error"]["message"] == "Not Found"
    r = httpx.post(url, json=ok)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ANSWER
    assert httpx.get(f"{server.base_url}/models").json()["data"][0]["id"] == "scripted"


class HangingEngine(ScriptedEngine):
    """Its first turn never ends unless cancelled (which it records); later turns answer at once."""

    def __init__(self, tokenizer, turns):
        super().__init__(tokenizer, turns)
        self.cancelled = threading.Event()

    async def generate(self, token_ids, sampling):
        if not self.prompts:
            self.prompts.append(token_ids)
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        return await super().generate(token_ids, sampling)


def test_a_client_that_hangs_up_cancels_its_generation(served, tokenizer):
    server, engine = served(None, engine=HangingEngine(tokenizer, ["unused", ANSWER]))
    url, session = f"{server.base_url}/chat/completions", {"X-Agentrl-Session": "s1"}
    body = {"messages": TASK.messages()}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(url, json=body, headers=session, timeout=0.5)
    assert engine.cancelled.wait(5), "the generation went on after the client left"
    r = httpx.post(url, json=body, headers=session, timeout=10)  # the session is free again
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ANSWER
    record = httpx.get(f"{server.base_url.removesuffix('/v1')}/agentrl/sessions/s1").json()
    assert record["metrics"]["session_turns"] == 1  # the abandoned turn was not recorded


def test_null_for_openais_nullable_fields_means_the_default(served, tokenizer):
    server, _ = served([ANSWER])
    body = {"messages": TASK.messages(), "n": None, "stream": None, "logprobs": None}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == ANSWER and r.json()["choices"][0]["logprobs"] is None
    with pytest.raises(RequestError, match="^n: one choice per request is supported$"):
        parse_request(json.dumps({**body, "n": 2}).encode())


def test_messages_the_template_rejects_get_a_400(tokenizer):
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = "{{ raise_exception('roles must alternate user/assistant') }}"
    service = ChatService(ScriptedEngine(tokenizer, [ANSWER]), strict, parse_hermes, ServeSettings())
    request = parse_request(json.dumps({"messages": TASK.messages()}).encode())
    with pytest.raises(RequestError) as refused:
        asyncio.run(service.complete(request, "s"))
    assert (refused.value.status, refused.value.message) == (
        400, "the chat template cannot render these messages: roles must alternate user/assistant")


def test_turn_limit_ends_the_episode_as_max_turns(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL, CALL, CALL])
    runner = agent_runner(calculator_agent, engine, tokenizer, max_turns=2)
    try:
        traj = asyncio.run(runner.run(TASK, "g"))
    finally:
        runner.close()
    assert traj.finish == "max_turns" and traj.error is None
    assert len(engine.prompts) == 2  # the refused third request sampled nothing and was not retried
    assert traj.metrics["turns"] == 2 and traj.metrics["tool_calls"] == 2 and traj.reward == 0.0
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "tool", "assistant"]


async def failing_agent(ctx, task):
    await ctx.openai_client().chat.completions.create(model=ctx.model, messages=task.messages())
    raise ValueError("the framework gave up")


async def headerless_agent(ctx, task):
    client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key="unused", max_retries=0)  # forgets the session header
    await client.chat.completions.create(model=ctx.model, messages=task.messages())


async def silent_agent(ctx, task):
    """Returns without asking the policy anything."""


async def exiting_agent(ctx, task):
    """Wraps a command-line program that calls sys.exit on bad input."""
    await ctx.openai_client().chat.completions.create(model=ctx.model, messages=task.messages())
    raise SystemExit(3)


def test_agent_failures_end_the_episode_as_errors(tokenizer):
    for agent, error, asked in [
            (failing_agent, "ValueError: the framework gave up", 1),
            (exiting_agent, "SystemExit: 3", 1),
            # refused before the engine: answered, its turn would have shaped the episode unrecorded
            (headerless_agent, "BadRequestError: Error code: 400 - no session: during an episode every request "
                               "carries the X-Agentrl-Session header", 0),
            (silent_agent, "the agent made no chat completion request with its session", 0)]:
        engine = ScriptedEngine(tokenizer, [ANSWER])
        runner = agent_runner(agent, engine, tokenizer)
        try:
            traj = asyncio.run(runner.run(TASK, "g"))
        finally:
            runner.close()
        assert traj.finish == "error" and traj.error.startswith(error) and traj.reward is None
        assert traj.metrics["error"] == 1.0 and len(engine.prompts) == asked


async def hanging_agent(ctx, task):
    """Its framework awaits something that never comes (a remote judge without a timeout), and a
    retry loop in it swallows the first cancellation."""
    await ctx.openai_client().chat.completions.create(model=ctx.model, messages=task.messages())
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        await asyncio.Event().wait()


def test_an_agent_that_never_finishes_fails_its_episode_within_the_timeout(tokenizer):
    """A hung agent function used to hold its episode, and the whole step, forever. Now it fails
    at rollout.agent_timeout_s (plus the abandoned call's grace), naming the setting, and keeps
    the turn it had recorded."""
    from agentrl.rollout.run import episode_settings

    assert episode_settings(RecipeConfig.model_validate(
        {"rollout": {"agent_timeout_s": 0.25}})).agent_timeout_s == 0.25
    engine = ScriptedEngine(tokenizer, [ANSWER])
    runner = agent_runner(hanging_agent, engine, tokenizer, agent_timeout_s=0.3)
    started = time.monotonic()
    try:
        traj = asyncio.run(runner.run(TASK, "g"))
    finally:
        runner.close()
    took = time.monotonic() - started
    assert traj.finish == "error" and traj.reward is None and took < 5, took
    assert traj.error == "TimeoutError: the agent function did not finish within 0.3 s (rollout.agent_timeout_s)"
    assert [m["role"] for m in traj.messages] == ["user", "assistant"] and traj.messages[1]["content"] == ANSWER
    assert traj.metrics["turns"] == 1 and sum(traj.loss_mask) == len(engine.turns[0])


def test_an_agent_episode_samples_with_the_seeds_the_builtin_loop_uses(tokenizer):
    """With an episode seed, turn t of an agent's session samples with the seed the builtin loop's
    turn t gets, so an agent's episodes repeat as the builtin loop's do; without one, no seed."""
    builtin_engine = ScriptedEngine(tokenizer, [CALL, ANSWER])
    builtin = EpisodeRunner(builtin_engine, tokenizer, [calculator], parse_hermes, EpisodeSettings(),
                            reward_fn=gsm8k_reward)
    assert asyncio.run(builtin.run(TASK, "g", seed=5)).reward == 1.0
    engines = [ScriptedEngine(tokenizer, [CALL, ANSWER]) for _ in range(2)]
    for engine, seed in zip(engines, (5, None)):
        runner = agent_runner(calculator_agent, engine, tokenizer)
        try:
            assert asyncio.run(runner.run(TASK, "g", seed=seed)).reward == 1.0
        finally:
            runner.close()
    assert engines[0].seeds == builtin_engine.seeds == [derive_seed(5, 0), derive_seed(5, 1)]
    assert engines[1].seeds == [None, None]


def test_a_prompt_over_the_context_limit_fails_like_the_builtin_loop(tokenizer):
    """An episode with no room to generate fails, naming the sizes, so the run counts it against
    trainer.max_failed_fraction; it used to end as 'length' with nothing sampled, and a recipe whose
    every prompt was too long trained on nothing without a word."""
    settings = {"max_context_tokens": 60}  # the task's prompt with the calculator schema is longer
    builtin = EpisodeRunner(ScriptedEngine(tokenizer, [ANSWER]), tokenizer, [calculator], parse_hermes,
                            EpisodeSettings(**settings), reward_fn=gsm8k_reward)
    expected = asyncio.run(builtin.run(TASK, "g"))
    engine = ScriptedEngine(tokenizer, [ANSWER])
    runner = agent_runner(calculator_agent, engine, tokenizer, **settings)
    try:
        traj = asyncio.run(runner.run(TASK, "g"))
    finally:
        runner.close()
    prompt = ids_of(tokenizer, TASK.messages())
    assert (traj.finish, traj.error, traj.reward) == (expected.finish, expected.error, expected.reward) == \
        ("error", f"ValueError: the prompt is {len(prompt)} tokens, and rollout.max_context_tokens (60) leaves no "
                  "room to generate", None)
    assert traj.token_ids == expected.token_ids == prompt and len(traj.token_ids) > 60
    assert traj.loss_mask == expected.loss_mask == [0] * len(traj.token_ids)
    assert traj.messages == expected.messages == TASK.messages()
    assert engine.prompts == [] and traj.metrics["error"] == expected.metrics["error"] == 1.0


async def shortening_agent(ctx, task):
    """Sends a history over the context limit, catches the refusal, retries with the task alone."""
    client = ctx.openai_client()
    try:
        await client.chat.completions.create(model=ctx.model, tools=ctx.tools, messages=task.messages() + [
            {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "more context " * 100}])
    except openai.BadRequestError:
        await client.chat.completions.create(model=ctx.model, messages=task.messages(), tools=ctx.tools)


def test_a_refusal_the_agent_recovers_from_does_not_end_the_episode(tokenizer):
    engine = ScriptedEngine(tokenizer, [ANSWER])
    runner = agent_runner(shortening_agent, engine, tokenizer, max_context_tokens=300)
    try:
        traj = asyncio.run(runner.run(TASK, "g"))
    finally:
        runner.close()
    assert (traj.finish, traj.error, traj.reward) == ("stop", None, 1.0)
    assert engine.prompts == [ids_of(tokenizer, TASK.messages())]  # the refused request sampled nothing
    assert [m["role"] for m in traj.messages] == ["user", "assistant"] and traj.metrics["turns"] == 1.0


async def hot_sampling_agent(ctx, task):
    await ctx.openai_client().chat.completions.create(model=ctx.model, messages=task.messages(), temperature=1.9,
                                                      top_p=0.5, max_tokens=1000)


class RecordingEngine(ScriptedEngine):
    def __init__(self, tokenizer, turns):
        super().__init__(tokenizer, turns)
        self.sampling = []

    async def generate(self, token_ids, sampling):
        self.sampling.append(sampling)
        return await super().generate(token_ids, sampling)


def test_agent_episodes_sample_with_the_recipes_settings(tokenizer, served):
    engine = RecordingEngine(tokenizer, [ANSWER])
    runner = agent_runner(hot_sampling_agent, engine, tokenizer, temperature=0.7, top_p=0.9, max_new_tokens_per_turn=32)
    try:
        asyncio.run(runner.run(TASK, "g"))
    finally:
        runner.close()
    [sampling] = engine.sampling
    assert (sampling.temperature, sampling.top_p, sampling.max_new_tokens) == (0.7, 0.9, 32)
    # `agentrl serve` takes the client's settings
    server, engine = served(None, engine=RecordingEngine(tokenizer, [ANSWER]))
    body = {"messages": TASK.messages(), "temperature": 1.9, "top_p": 0.5, "max_tokens": 7}
    assert httpx.post(f"{server.base_url}/chat/completions", json=body).status_code == 200
    [sampling] = engine.sampling
    assert (sampling.temperature, sampling.top_p, sampling.max_new_tokens) == (1.9, 0.5, 7)


def test_concurrent_sessions_share_one_engine_batch(tokenizer):
    engine = HFEngine(make_tiny_llama(), pad_token_id=2, batch_wait_s=0.5)
    runner = agent_runner(single_request_agent, engine, tokenizer, max_new_tokens_per_turn=4)
    tasks = [Task(id=f"t{i}", prompt=f"Say {i}.") for i in range(4)]
    try:
        trajectories = run_episodes(runner, tasks, 1, 8)
    finally:
        runner.close()
    assert engine.stats["requests"] == 4 and engine.stats["batches"] == 1
    for task, traj in zip(tasks, trajectories):
        prompt = ids_of_plain(tokenizer, task.messages())
        assert traj.error is None and traj.token_ids[: len(prompt)] == prompt
        assert traj.loss_mask == [0] * len(prompt) + [1] * (len(traj.token_ids) - len(prompt))
        assert 1 <= sum(traj.loss_mask) <= 4 and all(lp < 0 for lp in traj.logprobs[len(prompt):])


def ids_of_plain(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_agent_configuration_errors(tmp_path):
    def config(**rollout):
        return RecipeConfig.model_validate({"output_dir": str(tmp_path), "rollout": rollout})

    with pytest.raises(ConfigError, match=r"^rollout.agent: module 'tests.test_serve' has no attribute 'nope'$"):
        load_agent(config(agent="tests.test_serve:nope"))
    with pytest.raises(ConfigError, match=r"'tests.test_serve:ids_of' is not an async function"):
        load_agent(config(agent="tests.test_serve:ids_of"))
    with pytest.raises(ConfigError, match="cannot be combined with rollout.interaction_config"):
        load_agent(config(agent="tests.test_serve:calculator_agent",
                          interaction_config="tool_configs/gsm8k_interaction.yaml"))


@pytest.mark.parametrize("stop_signal", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_agentrl_serve_subprocess_answers_the_openai_client(tiny_model_dir, stop_signal):
    """Stopped by Ctrl-C, a supervisor's SIGTERM or a closed terminal's SIGHUP, the server closes its
    engine and says so. On SIGTERM uvicorn raised the signal again once it had shut down, and the
    default handler ended the process there: the engine (a launched SGLang server) was never closed."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "serve", "recipes/rollout_cpu.yaml", f"model.path={tiny_model_dir}",
         "rollout.max_new_tokens_per_turn=6", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline() if ready else ""
        match = re.search(r"on (http://127\.0\.0\.1:\d+/v1) ", line)
        assert match, f"no address printed: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
        client = openai.OpenAI(base_url=match.group(1), api_key="unused", max_retries=0)
        response = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                                  logprobs=True, user="s1")
        n = response.usage.completion_tokens
        assert 1 <= n <= 6 and len(response.choices[0].logprobs.content) == n
        assert response.choices[0].finish_reason in ("length", "stop")
        assert client.models.list().data[0].id == str(tiny_model_dir)
        record = httpx.get(match.group(1).removesuffix("/v1") + "/agentrl/sessions/s1").json()
        assert sum(record["segments"][0]["loss_mask"]) == n
    finally:
        proc.send_signal(getattr(signal, stop_signal))
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr[-2000:]
    assert "agentrl serve: stopped" in stderr and "Traceback" not in stderr
    assert time.monotonic() - started < 60


def test_an_agents_turn_cut_off_by_the_token_limit_is_no_answer(tokenizer):
    """As in the builtin loop: a turn that ran out of tokens is recorded as `truncated`, and the
    reward function does not take the number it stopped at for the answer (it scored 1.0)."""
    traj = run_agent(calculator_agent, ScriptedEngine(tokenizer, [ANSWER], stop=False), tokenizer)
    assert traj.error is None and traj.messages[-1] == {"role": "assistant", "content": ANSWER, "truncated": True}
    assert traj.reward == 0.0 and traj.loss_mask.count(1) == len(tokenizer(ANSWER, add_special_tokens=False)["input_ids"])
