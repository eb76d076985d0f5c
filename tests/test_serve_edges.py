"""The endpoint's edges: malformed calls beside valid ones, tokens that hold part of a character,
options it cannot honour, and an episode cancelled while its tools start.

As in test_serve.py, everything is real (tokenizer, template, parser, tools, uvicorn on
127.0.0.1, the openai client) except the policy's sampling where a test needs a specific turn.
"""

from __future__ import annotations

import asyncio
import copy
import json

import openai
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from agentrl.env.rewards import gsm8k_reward
from agentrl.rollout.episode import EpisodeRunner, EpisodeSettings
from agentrl.serve.agent import AgentRunner
from agentrl.serve.app import create_app
from agentrl.serve.protocol import RequestError, parse_request
from agentrl.serve.server import BackgroundServer
from agentrl.serve.service import ChatService, ServeSettings, TokenBytes
from agentrl.tools.builtin.calculator import calculator
from agentrl.tools.parsers import parse_hermes
from tests.conftest import ScriptedEngine
from tests.test_serve import ANSWER, CALL, TASK, agent_runner, calculator_agent

BAD = '<tool_call>\n{"name": "calculator", "arguments": {"expression": 12*3}}\n</tool_call>'  # not JSON
BAD_ERROR = ("Error: the tool call is not valid JSON (Expecting ',' delimiter at position 53): "
             '{"name": "calculator", "arguments": {"expression": 12*3}}')


async def ask(service: ChatService, body: dict, session_id: str | None = "s") -> dict:
    return await service.complete(parse_request(json.dumps(body).encode()), session_id)


def test_a_malformed_call_beside_valid_ones_stays_in_the_replys_text(tokenizer):
    other = CALL.replace("1234 * 5678", "2 + 2")
    sampled = f"First {CALL} then {BAD} and {other} done."
    engine = ScriptedEngine(tokenizer, [sampled, f"{other} done.", BAD])
    service = ChatService(engine, tokenizer, parse_hermes, ServeSettings())
    body = {"messages": TASK.messages(), "tools": [calculator.schema]}
    message = asyncio.run(ask(service, body))["choices"][0]["message"]
    # The whole turn as sampled: the Hermes template renders such a text verbatim, calls included.
    assert message["content"] == sampled
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [
        {"expression": "1234 * 5678"}, {"expression": "2 + 2"}]
    assert service.sessions.get("s").parse_errors == 1
    # Without a malformed block only the text outside the calls is content; with nothing that
    # parsed, the malformed block is all the content there is.
    for expected in ("done.", BAD):
        message = asyncio.run(ask(service, body))["choices"][0]["message"]
        assert message["content"] == expected and len(message.get("tool_calls") or []) == int(expected == "done.")


def test_a_call_echoed_with_its_numbers_written_another_way_continues_the_session(tokenizer):
    """JavaScript's JSON.stringify writes the 1.0 it parsed as 1 and 1e5 as 100000, and so does a Go
    client: such a client sends the call back that way. Compared as text, the echo forked the
    session there, and every earlier turn dropped out of training."""
    call = CALL.replace('"1234 * 5678"}', '"1234 * 5678", "scale": 1.0, "limit": 1e5, "steps": [2.0, 0.5]}')
    engine = ScriptedEngine(tokenizer, [call, ANSWER, ANSWER])
    service = ChatService(engine, tokenizer, parse_hermes, ServeSettings())
    messages = TASK.messages()
    reply = asyncio.run(ask(service, {"messages": messages, "tools": [calculator.schema]}, "js"))
    message = {k: v for k, v in reply["choices"][0]["message"].items() if v is not None}
    function = message["tool_calls"][0]["function"]
    assert json.loads(function["arguments"]) == {"expression": "1234 * 5678", "scale": 1.0, "limit": 1e5,
                                                 "steps": [2.0, 0.5]}
    function["arguments"] = '{"expression":"1234 * 5678","scale":1,"limit":100000,"steps":[2,0.5]}'
    messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "7006652"}]
    asyncio.run(ask(service, {"messages": messages, "tools": [calculator.schema]}, "js"))
    metrics = service.sessions.get("js").metrics()
    assert (metrics["segments"], metrics["history_rewrites"], metrics["dropped_generated_tokens"]) == (1, 0, 0)
    sampled = engine.prompts[0] + engine.turns[0]
    assert engine.prompts[1][:len(sampled)] == sampled  # the recorded call, not the client's spelling
    # a number that differs is still another call
    function["arguments"] = '{"expression":"1234 * 5678","scale":1.5,"limit":100000,"steps":[2,0.5]}'
    asyncio.run(ask(service, {"messages": messages, "tools": [calculator.schema]}, "js"))
    assert service.sessions.get("js").metrics()["segments"] == 2


def test_a_reply_with_a_malformed_block_sent_back_renders_as_the_model_sampled_it(tokenizer):
    """A client without a session (or one rewriting history) sends the reply back, and the
    endpoint renders it again from the messages. The reply's content used to be the malformed
    block alone beside the valid call; the template, seeing a call block in the content, skipped
    `tool_calls`, so the model saw its call's result next to a turn that no longer held the call."""
    turn = f"{CALL}\n{BAD}"
    engine = ScriptedEngine(tokenizer, [turn, ANSWER])
    service = ChatService(engine, tokenizer, parse_hermes, ServeSettings())
    messages = TASK.messages()
    reply = asyncio.run(ask(service, {"messages": messages, "tools": [calculator.schema]}, None))
    message = {k: v for k, v in reply["choices"][0]["message"].items() if v is not None}
    call_id = message["tool_calls"][0]["id"]
    messages += [message, {"role": "tool", "tool_call_id": call_id, "content": "7006652"},
                 {"role": "tool", "name": "parse_error", "content": BAD_ERROR}]
    asyncio.run(ask(service, {"messages": messages, "tools": [calculator.schema]}, None))
    sampled = engine.prompts[0] + engine.turns[0]
    assert engine.prompts[1][:len(sampled)] == sampled  # the turn, both blocks, token for token


@pytest.mark.parametrize("first_turn", [CALL + "\n" + BAD, BAD], ids=["call-and-malformed", "malformed-only"])
def test_an_agent_tells_the_model_its_call_was_broken_as_the_builtin_loop_does(first_turn, tokenizer):
    builtin = EpisodeRunner(ScriptedEngine(tokenizer, [first_turn, ANSWER]), tokenizer, [calculator], parse_hermes,
                            EpisodeSettings(), reward_fn=gsm8k_reward)
    expected = asyncio.run(builtin.run(TASK, "g"))
    engine = ScriptedEngine(tokenizer, [first_turn, ANSWER])
    runner = agent_runner(calculator_agent, engine, tokenizer)
    try:
        traj = asyncio.run(runner.run(TASK, "g"))
    finally:
        runner.close()
    tool_messages = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert tool_messages == [m["content"] for m in expected.messages if m["role"] == "tool"]
    assert tool_messages[-1] == BAD_ERROR
    assert traj.token_ids == expected.token_ids and traj.loss_mask == expected.loss_mask
    assert (traj.finish, traj.error, traj.reward) == (expected.finish, None, expected.reward) == ("stop", None, 1.0)
    assert traj.metrics["parse_errors"] == expected.metrics["parse_errors"] == 1  # counted once, when sampled
    assert (traj.metrics["segments"], traj.metrics["history_rewrites"]) == (1, 0)


def test_logprobs_bytes_of_tokens_that_hold_part_of_a_character(tokenizer):
    euro = tokenizer.convert_tokens_to_ids(["â", "Ĥ", "¬"])  # E2 82 AC, spelled in GPT-2's byte alphabet
    engine = ScriptedEngine(tokenizer, [])
    before, after = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("Costs 5", " each.\nOK"))
    engine.turns = [before + euro + after + [2]]
    service = ChatService(engine, tokenizer, parse_hermes, ServeSettings())
    choice = asyncio.run(ask(service, {"messages": TASK.messages(), "logprobs": True}, None))["choices"][0]
    assert choice["message"]["content"] == "Costs 5€ each.\nOK"
    entries = choice["logprobs"]["content"]
    assert len(entries) == len(engine.turns[0]) and entries[-1]["token"] == "<|im_end|>"
    split = [e for e in entries if e["token"] == "\ufffd"]  # OpenAI's text for part of a character
    assert [e["bytes"] for e in split] == [[0xE2], [0x82], [0xAC]]
    assert b"".join(bytes(e["bytes"]) for e in entries) == "Costs 5€ each.\nOK<|im_end|>".encode()
    assert all(bytes(e["bytes"]) == e["token"].encode() for e in entries if e not in split)
    # a vocabulary not spelled in the byte alphabet (SentencePiece's ▁): the decoded text's bytes
    word_level = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"▁€": 0, "[UNK]": 1}, "[UNK]")))
    assert TokenBytes(word_level)(0, " €") == " €".encode() and TokenBytes(tokenizer)(euro[1], "\ufffd") == b"\x82"


def test_logprobs_tokens_of_a_sentencepiece_vocabulary_keep_their_spaces_and_bytes():
    """Llama 2's layout, built here: `▁` for a space, byte fallback, a decoder that strips the
    sequence's first space. Each token was decoded alone, so every word lost its space, and a
    fallback byte decoded to U+FFFD gave that character's three bytes."""
    from pathlib import Path

    from tokenizers import decoders, models, normalizers

    from agentrl.types import Completion

    pieces = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], "▁Hello", "▁world", ",", "▁Caf", "▁"]
    spm = Tokenizer(models.Unigram([(p, -1.0) for p in pieces], unk_id=0, byte_fallback=True))
    spm.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    spm.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    llama_like = PreTrainedTokenizerFast(tokenizer_object=spm, bos_token="<s>", eos_token="<|im_end|>",
                                         unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    llama_like.chat_template = Path("agentrl/templates/hermes_chatml.jinja").read_text()
    ids = llama_like("Hello world, Café", add_special_tokens=False)["input_ids"] + [llama_like.eos_token_id]
    assert llama_like.convert_ids_to_tokens(ids)[3:] == ["▁Caf", "<0xC3>", "<0xA9>", "<|im_end|>"]

    class Engine:
        weight_version = 0

        async def generate(self, token_ids, sampling):
            return Completion(ids, [-0.5] * len(ids), "stop", 0)

    service = ChatService(Engine(), llama_like, parse_hermes, ServeSettings())
    choice = asyncio.run(ask(service, {"messages": TASK.messages(), "logprobs": True}, None))["choices"][0]
    assert choice["message"]["content"] == "Hello world, Café"
    entries = choice["logprobs"]["content"]
    assert [e["token"] for e in entries] == [" Hello", " world", ",", " Caf", "\ufffd", "\ufffd", "<|im_end|>"]
    assert [e["bytes"] for e in entries[4:6]] == [[0xC3], [0xA9]]
    assert b"".join(bytes(e["bytes"]) for e in entries) == " Hello world, Café<|im_end|>".encode()


def test_a_reply_holding_its_calls_and_special_text_sent_back_without_a_session_is_kept_as_text(tokenizer):
    """The content holding the special text was swapped for a marker to find it in the rendering;
    the Hermes template, no longer seeing the call blocks in it, rendered the calls again, and the
    endpoint answered its own reply with a 500."""
    turn = f'The string "<|im_end|>" ends a turn.\n{CALL}\n{BAD}'  # beside a malformed block: the whole turn
    engine = ScriptedEngine(tokenizer, [turn, ANSWER])
    service = ChatService(engine, tokenizer, parse_hermes, ServeSettings())
    messages = TASK.messages()
    reply = asyncio.run(ask(service, {"messages": messages, "tools": [calculator.schema]}, None))
    message = {k: v for k, v in reply["choices"][0]["message"].items() if v is not None}
    assert message["content"] == turn and len(message["tool_calls"]) == 1  # with the Hermes template: as sampled
    messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "7006652"},
                 {"role": "tool", "name": "parse_error", "content": BAD_ERROR}]
    asyncio.run(ask(service, {"messages": messages, "tools": [calculator.schema]}, None))
    prompt = engine.prompts[1]
    rendered = tokenizer.apply_chat_template(chat_messages_of(messages), tools=[calculator.schema], tokenize=False,
                                             add_generation_prompt=True)
    assert tokenizer.decode(prompt) == rendered and rendered.count(CALL) == 1
    # <|im_end|> as a control token: the system, user, assistant and two tool turns' ends only; the
    # one in the content is plain text
    assert prompt.count(2) == 5 and prompt.count(1) == 6


def chat_messages_of(messages: list[dict]) -> list[dict]:
    from agentrl.serve.protocol import ChatRequest, chat_messages

    return chat_messages(ChatRequest.model_validate({"messages": messages}).messages)


@pytest.mark.parametrize("part,message", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
     "messages.0.content: part 1 is of type 'image_url'; only text parts are supported"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
     "messages.0.content: part 1 is of type 'input_audio'; only text parts are supported"),
    ({"type": "text"}, "messages.0.content: part 1: text: Field required"),
    ({"type": "text", "text": 5}, "messages.0.content: part 1: text: Input should be a valid string"),
])
def test_a_content_part_that_is_not_text_is_named(part, message):
    """The union's first type answered: "messages.0.content.str: Input should be a valid string
    (and 2 more problems)", for an image part the Responses route names."""
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]}
    with pytest.raises(RequestError) as e:
        parse_request(json.dumps(body).encode())
    assert (e.value.status, e.value.message) == (400, message)


def test_logit_bias_and_response_format_are_refused_unless_neutral(tokenizer):
    base = {"messages": TASK.messages()}
    for extra, message in [({"logit_bias": {"50256": -100}}, "logit_bias: token biases are not supported"),
                           ({"response_format": {"type": "json_object"}},
                            'response_format: only {"type": "text"} is supported; structured output is not')]:
        with pytest.raises(RequestError) as refused:
            parse_request(json.dumps({**base, **extra}).encode())
        assert (refused.value.status, refused.value.body()) == (400, {"error": {
            "message": message, "type": "invalid_request_error", "param": None, "code": "invalid_request_error"}})
    service = ChatService(ScriptedEngine(tokenizer, [ANSWER] * 5), tokenizer, parse_hermes, ServeSettings())
    neutral = [{"logit_bias": None}, {"logit_bias": {}}, {"logit_bias": {"50256": 0}}, {"response_format": None},
               {"response_format": {"type": "text"}}]
    for extra in neutral:
        assert asyncio.run(ask(service, {**base, **extra}, None))["choices"][0]["message"]["content"] == ANSWER
    # through HTTP and the openai client, as an agent framework would meet it
    server = BackgroundServer(create_app(service))
    server.start()
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="response_format: only"):
            client.chat.completions.create(model="any", messages=TASK.messages(),
                                           response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    finally:
        server.stop()


@pytest.mark.parametrize("extra,message", [
    ({"functions": [{"name": "f", "parameters": {}}], "function_call": "auto"},
     "functions/function_call: the legacy function-calling fields are not supported; send tools"),
    ({"parallel_tool_calls": False},
     "parallel_tool_calls: false is not supported; the model may call several tools in one turn"),
    ({"modalities": ["text", "audio"]}, 'modalities: only ["text"] is supported'),
    ({"reasoning_effort": "low"}, "reasoning_effort: reasoning effort is not supported"),  # as the Responses route
    ({"messages": [{"role": "user", "content": "2+2?"},
                   {"role": "assistant", "content": "", "function_call": {"name": "f", "arguments": "{}"}}]},
     "messages.1: the legacy function_call form is not supported; send the call in tool_calls"),
], ids=["functions", "parallel_tool_calls_false", "audio", "reasoning_effort", "legacy_call_in_history"])
def test_options_that_change_the_answer_are_refused_not_dropped(tokenizer, extra, message):
    """These used to be accepted and ignored: the model never saw legacy `functions` and answered
    in text, a legacy call vanished from the history, `parallel_tool_calls: false` could still get
    several calls."""
    with pytest.raises(RequestError) as refused:
        parse_request(json.dumps({"messages": TASK.messages(), **extra}).encode())
    assert (refused.value.status, str(refused.value)) == (400, message)
    service = ChatService(ScriptedEngine(tokenizer, [ANSWER] * 3), tokenizer, parse_hermes, ServeSettings())
    for neutral in ({"parallel_tool_calls": True}, {"modalities": ["text"]}, {"reasoning_effort": None}):
        assert asyncio.run(ask(service, {"messages": TASK.messages(), **neutral}, None))["choices"][0]["message"][
            "content"] == ANSWER


def test_a_requests_seed_reaches_the_engine_except_under_the_recipes_sampling(tokenizer):
    """`seed` was accepted and dropped, so the same seeded request sampled other tokens each time.
    OpenAI's seed is an int64: a negative one is taken modulo 2**64, the engine's range."""
    engine = ScriptedEngine(tokenizer, [ANSWER] * 4)
    service = ChatService(engine, tokenizer, parse_hermes, ServeSettings())
    for seed in (7, -1, None):
        body = {"messages": TASK.messages(), **({} if seed is None else {"seed": seed})}
        asyncio.run(ask(service, body, None))
    assert engine.seeds == [7, 2**64 - 1, None]
    # agent episodes for training: a group's episodes sending one seed would all sample alike
    training = ChatService(engine, tokenizer, parse_hermes, ServeSettings(fixed_sampling=True))
    asyncio.run(ask(training, {"messages": TASK.messages(), "seed": 7}, None))
    assert engine.seeds[-1] is None


@pytest.mark.parametrize("depth", [65, 5000])
def test_call_arguments_nested_deeper_than_a_template_renders_are_a_400(tokenizer, depth):
    """5000 levels made json.loads raise RecursionError: a 500, which the openai client retries."""
    deep = "[" * depth + "]" * depth
    messages = [*TASK.messages(), {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": f'{{"expression": {deep}}}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "4"}]
    engine = ScriptedEngine(tokenizer, [ANSWER])
    service = ChatService(engine, tokenizer, parse_hermes, ServeSettings())
    with pytest.raises(RequestError) as refused:
        asyncio.run(ask(service, {"messages": messages}, None))
    assert (refused.value.status, str(refused.value)) == (
        400, "messages.1.tool_calls: arguments are nested more than 64 levels deep")
    assert engine.prompts == []


def test_a_request_without_the_session_header_is_refused_during_agent_episodes(tokenizer):
    """An agent's second client without the header (a planner, a summariser) was answered, and its
    turns shaped the episode without being in its trajectory."""
    engine = ScriptedEngine(tokenizer, [ANSWER])
    service = ChatService(engine, tokenizer, parse_hermes, ServeSettings(open_sessions_only=True))
    with pytest.raises(RequestError) as refused:
        asyncio.run(ask(service, {"messages": TASK.messages()}, None))
    assert (refused.value.status, refused.value.code, str(refused.value)) == (
        400, "session_required", "no session: during an episode every request carries the X-Agentrl-Session "
                                 "header (ctx.openai_client() sends it; other clients take ctx.headers)")
    assert engine.prompts == []


class LedgerTool:
    """A tool that records its lifecycle; with `hang`, its create never ends unless cancelled."""

    def __init__(self, name: str, log: list[str], hang: asyncio.Event | None = None):
        self.schema = {"type": "function", "function": {"name": name, "description": name, "parameters": {
            "type": "object", "properties": {}}}}
        self.name, self.log, self.hang = name, log, hang

    async def create(self, instance_id, **kwargs):
        self.log.append(f"create {self.name}")
        if self.hang is not None:
            self.hang.set()
            await asyncio.sleep(60)

    async def execute(self, instance_id, arguments):
        return "ok"

    async def reward(self, instance_id):
        return None

    async def release(self, instance_id):
        self.log.append(f"release {self.name}")


def test_an_episode_cancelled_while_its_tools_start_releases_them(tokenizer):
    log: list[str] = []

    async def cancel_while_starting():
        hanging = asyncio.Event()
        tools = [LedgerTool("ledger", log), LedgerTool("stuck", log, hanging)]
        runner = AgentRunner(calculator_agent, ScriptedEngine(tokenizer, [ANSWER]), tokenizer, tools, parse_hermes,
                             EpisodeSettings())
        try:
            episode = asyncio.ensure_future(runner.run(TASK, "g"))
            await asyncio.wait_for(hanging.wait(), 10)
            episode.cancel()
            with pytest.raises(asyncio.CancelledError):
                await episode
        finally:
            runner.close()

    asyncio.run(cancel_while_starting())
    assert log[:2] == ["create ledger", "create stuck"] and "release ledger" in log


async def answers_a_cut_reply_agent(ctx, task):
    """Answers the malformed block of a reply cut off by its budget, then asks again."""
    client = ctx.openai_client()
    messages = task.messages(ctx.system_prompt)
    response = await client.chat.completions.create(model=ctx.model, messages=messages, tools=ctx.tools,
                                                    max_tokens=40)
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "length"
    messages.append(message.model_dump(exclude_none=True))
    messages += await ctx.run_tools(message.tool_calls, message.content.strip())  # trimmed, as agents may
    await client.chat.completions.create(model=ctx.model, messages=messages, tools=ctx.tools)


def test_an_agent_answering_a_cut_off_reply_counts_its_malformed_block_once(tokenizer):
    """The endpoint counts a reply's malformed blocks only when the turn stopped; `run_tools` took
    every block it answered for one the endpoint had counted, so a cut-off reply's block counted
    -1 + 1 = 0 times."""
    cut = f"{BAD} and then some more words that run on past the budget of this turn, and on and on"
    engine = ScriptedEngine(tokenizer, [cut, ANSWER])
    assert len(engine.turns[0]) > 41  # longer than the 40-token budget: cut off, no stop token
    runner = agent_runner(answers_a_cut_reply_agent, engine, tokenizer)
    try:
        traj = asyncio.run(runner.run(TASK, "g"))
    finally:
        runner.close()
    assert traj.error is None and traj.metrics["parse_errors"] == 1
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == [BAD_ERROR]
    # A finished turn's block, counted when sampled and answered too, counts once:
    # test_an_agent_tells_the_model_its_call_was_broken_as_the_builtin_loop_does.


def test_a_tool_message_is_named_after_the_call_it_answers_when_clients_reuse_call_ids():
    from agentrl.serve.protocol import chat_messages

    def turn(name: str) -> list[dict]:
        return [{"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": name, "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_0", "content": "r"}]

    request = parse_request(json.dumps({"messages": [{"role": "user", "content": "q"}, *turn("calculator"),
                                                     *turn("search")]}).encode())
    named = [m.get("name") for m in chat_messages(request.messages) if m["role"] == "tool"]
    assert named == ["calculator", "search"]  # the first was named after the later call


def test_run_tools_says_arguments_that_decode_to_a_string_are_not_an_object():
    from agentrl.env.tool_env import ToolEnv, ToolLimits
    from agentrl.serve.agent import AgentContext
    from agentrl.types import Task

    async def answers() -> list[dict]:
        env = ToolEnv([calculator], ToolLimits(), lambda text: (text, False))
        await env.start("e", Task(id="t", prompt="p", answer="a"))
        try:
            ctx = AgentContext("http://127.0.0.1:1/v1", "s", "m", [calculator], None, env, parse_hermes)
            return await ctx.run_tools([{"id": "c1", "function": {"name": "calculator", "arguments": '"rm -rf"'}},
                                        {"id": "c2", "function": {"name": "calculator", "arguments": "[1]"}}])
        finally:
            await env.finish()

    contents = [m["content"] for m in asyncio.run(answers())]
    assert contents == ["Error: the arguments of 'calculator' must be a JSON object"] * 2  # not "Error: rm -rf"


def test_a_non_finite_logprob_is_an_engine_error_and_nothing_is_recorded(tokenizer):
    """JSON has no -inf: the answer was a 500 for a turn the session already held (or, streamed,
    a chunk no client parses)."""
    from agentrl.types import Completion

    class Diverged(ScriptedEngine):
        async def generate(self, token_ids, sampling):
            done = await super().generate(token_ids, sampling)
            return Completion(done.token_ids, [float("-inf")] + done.logprobs[1:], done.finish, done.weight_version)

    service = ChatService(Diverged(tokenizer, [ANSWER]), tokenizer, parse_hermes, ServeSettings())
    with pytest.raises(RequestError) as refused:
        asyncio.run(ask(service, {"messages": TASK.messages(), "logprobs": True}))
    assert (refused.value.status, refused.value.code) == (500, "engine_error")
    assert str(refused.value) == "generation failed: the engine gave sampled token 0 the logprob -inf (a diverged model?)"
    assert service.sessions.get("s").turns == 0


def test_megabytes_of_conversation_are_refused_by_their_length_before_they_are_encoded(tokenizer, monkeypatch):
    """Encoding 8 MB of text took the event loop, shared by every session, for 3-12 s, only to refuse it
    by its token count. A token stands for at most max_token_chars characters, so a rendering longer
    than the context times that is refused as too long at once, as a first prompt and as a session's
    new messages; shorter ones are still counted in tokens."""
    from agentrl.rollout.chat import ChatRenderer, max_token_chars

    encoded: list[int] = []
    for name in ("encode", "encode_text"):
        original = getattr(ChatRenderer, name)
        monkeypatch.setattr(ChatRenderer, name,
                            lambda self, text, _f=original: encoded.append(len(text)) or _f(self, text))
    longest = max(len(tokenizer.convert_ids_to_tokens(i)) for i in range(len(tokenizer)))
    assert max_token_chars(tokenizer) == 2 * longest
    engine = ScriptedEngine(tokenizer, [CALL, ANSWER])
    service = ChatService(engine, tokenizer, parse_hermes, ServeSettings(max_context_tokens=300))
    huge = "word " * 400_000  # 2 MB, 400k tokens
    rendered = len(tokenizer.apply_chat_template([{"role": "user", "content": huge}], tokenize=False,
                                                 add_generation_prompt=True))
    for session_id in (None, "s"):
        with pytest.raises(RequestError) as refused:
            asyncio.run(ask(service, {"messages": [{"role": "user", "content": huge}]}, session_id))
        assert refused.value.code == "context_length_exceeded" and refused.value.status == 400
        assert refused.value.message == (f"the conversation is more than 299 tokens ({rendered} characters rendered), "
                                         "which leaves no room for a reply within max_context_tokens=300")
    assert service.sessions.get("s").refused == "length"
    assert encoded == [299 * max_token_chars(tokenizer)] * 2 and engine.prompts == []  # its head alone

    messages = TASK.messages()
    reply = asyncio.run(ask(service, {"messages": messages, "tools": [calculator.schema]}, "t"))["choices"][0]
    message = {k: v for k, v in reply["message"].items() if v is not None}
    messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": huge}]
    encoded.clear()
    with pytest.raises(RequestError, match=r"^the conversation is more than 299 tokens \(2000\d\d\d characters"):
        asyncio.run(ask(service, {"messages": messages, "tools": [calculator.schema]}, "t"))
    assert service.sessions.get("t").refused == "length" and max(encoded) < 299 * max_token_chars(tokenizer)
    # Under the bound, the tokens decide, as before: 300 tokens' worth of tool output is refused by its count.
    messages[-1]["content"] = "word " * 300
    with pytest.raises(RequestError, match=r"^the conversation is \d+ tokens, which leaves no room"):
        asyncio.run(ask(service, {"messages": messages, "tools": [calculator.schema]}, "u"))
    assert max(encoded) > 1000


def test_text_a_token_takes_in_beyond_its_own_characters_is_counted_not_refused(tokenizer):
    """An added token that strips the whitespace after it stands for any number of characters: the
    bound by the longest token would refuse a rendering of 3 tokens. Its head is encoded to check."""
    from transformers import AddedToken

    from agentrl.rollout.chat import ChatRenderer, PromptTooLong

    stripping = copy.deepcopy(tokenizer)
    stripping.add_special_tokens({"additional_special_tokens": [AddedToken("<|user|>", rstrip=True, special=True)]})
    renderer = ChatRenderer(stripping, [])
    text = "<|user|>" + " " * 100_000 + "hi"
    ids = renderer.encode_rendered(text, [], lambda marked: text, limit=10)
    assert ids == renderer.encode(text) and len(ids) <= 3
    with pytest.raises(PromptTooLong):
        renderer.encode_rendered(" hi" * 50_000, [], lambda marked: "", limit=10)


@pytest.mark.parametrize("arguments,rendered", [
    ('{"expression": ' + "9" * 5000 + "}", "9" * 5000),  # json.loads: a ValueError past Python's 4300-digit limit
    ('{"expression": "\\ud800"}', "\\ud800"),  # half a surrogate pair, which the tokenizer cannot take
    ('{"expression": NaN}', "NaN"),  # no JSON number: the session's record could not be answered any more
], ids=["huge-integer", "lone-surrogate", "nan"])
def test_call_arguments_python_reads_but_json_has_not_are_kept_as_sent_text(tokenizer, arguments, rendered):
    """Each was a 500 (the first two), or recorded a NaN that made the session's GET and DELETE
    fail after the DELETE had dropped it. Like any arguments that are not JSON, they are the
    string the client sent."""
    import httpx

    engine = ScriptedEngine(tokenizer, [ANSWER])  # room for 5000 digits, a token each
    service = ChatService(engine, tokenizer, parse_hermes, ServeSettings(max_context_tokens=8192))
    server = BackgroundServer(create_app(service))
    server.start()
    try:
        messages = [*TASK.messages(), {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c", "content": "4"}]
        reply = httpx.post(f"{server.base_url}/chat/completions", json={"messages": messages},
                           headers={"X-Agentrl-Session": "s"}, timeout=60)
        assert (reply.status_code, reply.json()["choices"][0]["message"]["content"]) == (200, ANSWER)
        prompt = tokenizer.decode(engine.prompts[0])
        assert rendered in prompt  # the string, as the template renders a string
        sessions = f"{server.base_url.removesuffix('/v1')}/agentrl/sessions/s"
        assert [httpx.get(sessions).status_code, httpx.delete(sessions).status_code,
                httpx.get(sessions).status_code] == [200, 200, 404]
    finally:
        server.stop()


@pytest.mark.parametrize("where,body", [
    ("messages.1.tool_calls.0.function.arguments.expression", {"messages": [
        {"role": "user", "content": "Go."},
        {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "calculator",
                                                                      "arguments": {"expression": float("nan")}}}]},
        {"role": "tool", "tool_call_id": "c", "content": "4"}]}),
    ("tools.0.function.parameters.default", {"messages": [{"role": "user", "content": "Go."}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"default": float("inf")}}}]}),
])
def test_a_nan_or_infinity_in_a_request_is_a_400_naming_where(served, where, body):
    import httpx

    server, engine = served(["unused"])
    reply = httpx.post(f"{server.base_url}/chat/completions", content=json.dumps(body),  # json.dumps writes NaN
                       headers={"content-type": "application/json", "X-Agentrl-Session": "s"}, timeout=60)
    value = body["messages"][1]["tool_calls"][0]["function"]["arguments"]["expression"] if "messages.1" in where \
        else body["tools"][0]["function"]["parameters"]["default"]
    assert (reply.status_code, reply.json()["error"]["message"]) == (400, f"{where}: {value} is not a JSON number")
    assert engine.prompts == []


def test_run_tools_answers_every_call_id_past_the_turns_limit_and_json_python_cannot_read():
    """Six calls with broken arguments, the limit four: the env's one "2 more" message was given
    the fifth call's id and the sixth got no answer. And arguments past one of Python's JSON limits
    (5000 digits) raised out of run_tools, failing the episode."""
    from agentrl.env.tool_env import ToolEnv, ToolLimits
    from agentrl.serve.agent import AgentContext
    from agentrl.types import Task

    calls = [{"id": f"c{i}", "function": {"name": "calculator", "arguments": f"[{i}]"}} for i in range(5)] + [
        {"id": "c5", "function": {"name": "calculator", "arguments": '{"expression": ' + "9" * 5000 + "}"}}]

    async def answers() -> tuple[list[dict], dict]:
        env = ToolEnv([calculator], ToolLimits(max_calls_per_turn=4), lambda text: (text, False))
        await env.start("e", Task(id="t", prompt="p", answer="a"))
        try:
            ctx = AgentContext("http://127.0.0.1:1/v1", "s", "m", [calculator], None, env, parse_hermes)
            return await ctx.run_tools(calls), env.metrics
        finally:
            await env.finish()

    messages, metrics = asyncio.run(answers())
    not_object = "Error: the arguments of 'calculator' must be a JSON object"
    assert [(m["tool_call_id"], m["content"]) for m in messages] == [(f"c{i}", not_object) for i in range(4)] + [
        ("c4", f"{not_object}; not read: at most 4 tool calls are answered per turn."),
        ("c5", "Error: the arguments of 'calculator' are not valid JSON (Exceeds the limit (4300 digits) for integer "
               "string conversion: value has 5000 digits); not read: at most 4 tool calls are answered per turn.")]
    assert metrics["parse_errors"] == 6


def test_an_endpoint_that_does_not_start_in_time_stops_and_gives_its_port_back():
    """It raised with its thread still starting and its socket still listening: it would serve
    later, unasked, on a port no one had closed."""
    import socket

    from fastapi import FastAPI

    server = BackgroundServer(FastAPI())
    with pytest.raises(RuntimeError, match=r"the endpoint on http://127\.0\.0\.1:\d+/v1 did not start"):
        server.start(timeout_s=0)
    assert not server._thread.is_alive()
    socket.create_server(("127.0.0.1", server.port)).close()  # free again: nothing listens there


def test_an_endpoint_listens_on_an_ipv6_address():
    """`agentrl serve --host ::1` failed with 'Address family for hostname not supported': the
    socket was always IPv4, though the printed URL already brackets an IPv6 host."""
    import httpx
    from fastapi import FastAPI

    app = FastAPI()
    app.get("/v1/ping")(lambda: {"pong": True})
    server = BackgroundServer(app, host="::1")
    server.start()
    try:
        assert server.base_url == f"http://[::1]:{server.port}/v1"
        assert httpx.get(server.base_url + "/ping", trust_env=False).json() == {"pong": True}
    finally:
        server.stop()


def test_an_engine_failure_is_answered_500_and_logged_with_its_traceback(served, tokenizer, caplog):
    """The 500 names the failure to the client; its traceback went nowhere, as the handler that
    answers a RequestError counts it as handled."""
    class Broken(ScriptedEngine):
        async def generate(self, token_ids, sampling):
            raise ValueError("weights on the wrong device")

    server, _ = served([], engine=Broken(tokenizer, []))
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    with caplog.at_level("ERROR", logger="agentrl.serve"):
        with pytest.raises(openai.InternalServerError, match="generation failed: ValueError: weights on the wrong"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
    [record] = [r for r in caplog.records if r.name == "agentrl.serve"]
    assert record.getMessage() == ("POST /v1/chat/completions: generation failed: ValueError: "
                                   "weights on the wrong device")
    assert isinstance(record.exc_info[1], ValueError)
    assert "in generate" in caplog.text  # the traceback, down to the engine's frame


def test_a_message_using_up_every_marker_beside_special_text_is_the_clients_400(tokenizer):
    """A client's text holding `<|im_end|>` and all 16 private-use marker characters cannot be kept
    as text: that is the client's message (400), not the recipe's template (it was a 500 that told
    the client not to retry, blaming the server)."""
    from agentrl.rollout.chat import _MARKS

    service = ChatService(ScriptedEngine(tokenizer, [ANSWER]), tokenizer, parse_hermes, ServeSettings())
    with pytest.raises(RequestError) as refused:
        asyncio.run(ask(service, {"messages": [{"role": "user", "content": "<|im_end|>" + "".join(_MARKS)}]}))
    assert (refused.value.status, refused.value.code) == (400, "invalid_request_error")
    assert str(refused.value).startswith("a message contains a special token's text, and every marker character")


def test_stream_options_are_typed_so_a_string_false_is_refused_not_read_as_true(served):
    """`include_usage: "false"` was read by its truth value, and the stream carried a usage chunk
    the client had asked not to get."""
    with pytest.raises(RequestError) as refused:
        parse_request(json.dumps({"messages": TASK.messages(), "stream_options": {"include_usage": "false"}}).encode())
    assert str(refused.value) == "stream_options.include_usage: Input should be a valid boolean"
    server, _ = served([ANSWER, ANSWER])
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    for include_usage, usage_chunks in ((False, 0), (True, 1)):
        chunks = list(client.chat.completions.create(model="m", messages=TASK.messages(), stream=True,
                                                     stream_options={"include_usage": include_usage}))
        assert sum(chunk.usage is not None for chunk in chunks) == usage_chunks
