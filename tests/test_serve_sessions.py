"""Sessions over their lifetime: how many segments they keep, a DELETE racing a request, ids with
a slash, agent episodes that fail after a refusal or ask after they ended, and replies or
messages that the chat template or the renderer's markers used to turn into a 500.

As in test_serve.py, everything is real (tokenizer, template, parser, uvicorn on 127.0.0.1, the
openai client) except the policy's sampling where a test needs a specific turn.
"""

from __future__ import annotations

import asyncio
import copy
import json

import httpx
import openai
import pytest

from agentrl.rollout.chat import ChatRenderer
from agentrl.serve.app import create_app
from agentrl.serve.protocol import RequestError, parse_request
from agentrl.serve.server import BackgroundServer
from agentrl.serve.service import ChatService, ServeSettings
from agentrl.serve.sessions import SessionStore
from agentrl.tools.parsers import parse_hermes
from tests.conftest import ScriptedEngine
from tests.test_serve import ANSWER, CALL, TASK, HangingEngine, agent_runner, calculator_agent, run_agent


async def ask(service: ChatService, messages: list[dict], session_id: str | None = "s") -> dict:
    return await service.complete(parse_request(json.dumps({"messages": messages}).encode()), session_id)


def conversation(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Question number {i}?"}]


def test_a_session_keeps_the_records_of_its_last_segments_only(tokenizer):
    """A client starting a new conversation on every request under one `user` used to grow its
    session by a segment each time, for as long as the server ran."""
    turns = ["one", "two two", "three three three", "four four four four"]
    engine = ScriptedEngine(tokenizer, turns)
    service = ChatService(engine, tokenizer, parse_hermes, ServeSettings(max_segments=2))
    for i in range(4):
        asyncio.run(ask(service, conversation(i)))
    session = service.sessions.get("s")
    assert [s.record.messages[0]["content"] for s in session.segments] == ["Question number 2?", "Question number 3?"]
    generated = [len(t) for t in engine.turns]
    assert session.metrics()["segments"] == 4 and session.metrics()["history_rewrites"] == 3
    assert session.metrics()["dropped_generated_tokens"] == sum(generated[:3])
    assert session.forgotten_segments == 2 and session.forgotten_generated_tokens == sum(generated[:2])


async def summarising_agent(ctx, task):
    """calculator_agent with a second conversation in the same session between its turns: after
    the tool runs it asks the model, without tools, to summarise the task, then goes on."""

    async def summarise(client):
        await client.chat.completions.create(model=ctx.model, messages=[
            {"role": "user", "content": f"Summarise in five words: {task.prompt}"}])

    await calculator_agent(ctx, task, after_tools=summarise)


def test_an_agent_alternating_between_two_conversations_trains_on_its_main_one_whole(tokenizer):
    """Agent episodes kept one segment and a request continued only the latest: the main
    conversation's turn after the sub-conversation was rendered afresh, so its first turn was
    trained nowhere (mask 0 in a new segment) and the episode counted a history rewrite."""
    expected = run_agent(calculator_agent, ScriptedEngine(tokenizer, [CALL, ANSWER]), tokenizer)
    engine = ScriptedEngine(tokenizer, [CALL, "Multiply two four-digit numbers.", ANSWER])
    traj = run_agent(summarising_agent, engine, tokenizer)
    call, said, answer = engine.turns
    assert engine.prompts[2] == expected.token_ids[:len(engine.prompts[2])]  # appended, not re-rendered
    assert traj.token_ids == expected.token_ids and traj.loss_mask == expected.loss_mask
    assert sum(traj.loss_mask) == len(call) + len(answer) and traj.logprobs == expected.logprobs
    assert traj.messages[-1]["content"] == ANSWER and traj.reward == 1.0 and traj.finish == "stop"
    assert {k: traj.metrics[k] for k in ("turns", "session_turns", "segments", "dropped_generated_tokens")} == \
        {"turns": 2.0, "session_turns": 3.0, "segments": 2.0, "dropped_generated_tokens": float(len(said))}
    runner = agent_runner(None, ScriptedEngine(tokenizer, []), tokenizer)
    assert runner.service.sessions.max_segments == ServeSettings().max_segments == 8


def test_a_request_continues_the_longest_segment_it_extends(tokenizer):
    """A client that re-asked its first question (a new segment whose reply matched the first
    one's) and then went on with its first conversation: both segments are prefixes of the
    request; the longer one is extended, the shorter one's record kept as it was."""
    engine = ScriptedEngine(tokenizer, ["first", "second", "first", "third"])
    service = ChatService(engine, tokenizer, parse_hermes, ServeSettings())
    u1, u2, u3 = conversation(1), conversation(2), conversation(3)
    a1, a2 = {"role": "assistant", "content": "first"}, {"role": "assistant", "content": "second"}
    for messages in ([*u1], [*u1, a1, *u2], [*u1], [*u1, a1, *u2, a2, *u3]):
        asyncio.run(ask(service, messages))
    session = service.sessions.get("s")
    longer, shorter = session.segments[1], session.segments[0]
    assert [m["content"] for m in longer.record.messages] == \
        ["Question number 1?", "first", "Question number 2?", "second", "Question number 3?", "third"]
    assert [m["content"] for m in shorter.record.messages] == ["Question number 1?", "first"]
    assert longer.turns == 3 and shorter.turns == 1
    assert engine.prompts[3][:len(engine.prompts[1]) + len(engine.turns[1])] == \
        engine.prompts[1] + engine.turns[1]  # the longer record, appended to
    assert longer.record.loss_mask.count(1) == len(engine.turns[0]) + len(engine.turns[1]) + len(engine.turns[3])
    assert session.metrics()["dropped_generated_tokens"] == len(engine.turns[2])


def test_a_request_during_a_delete_lands_in_a_new_session(tokenizer):
    """DELETE waited for the session's request in flight while the session stayed in the store: a
    request arriving meanwhile joined the old session behind the DELETE, was answered 200 and was
    recorded nowhere."""

    async def scenario():
        engine = HangingEngine(tokenizer, ["unused", ANSWER, "late"])
        service = ChatService(engine, tokenizer, parse_hermes, ServeSettings())
        first = asyncio.create_task(ask(service, TASK.messages()))  # hangs until cancelled
        while not engine.prompts:
            await asyncio.sleep(0.01)
        deleting = asyncio.create_task(service.sessions.pop("s"))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(ask(service, conversation(1)))  # same id, after the DELETE began
        await asyncio.sleep(0.05)
        first.cancel()
        deleted = await asyncio.wait_for(deleting, 5)
        return service, deleted, await asyncio.wait_for(second, 5)

    service, deleted, second = asyncio.run(scenario())
    assert deleted.turns == 0 and deleted.segments == []  # the cancelled turn was not recorded
    assert second["choices"][0]["message"]["content"] == ANSWER
    kept = service.sessions.get("s")
    assert kept is not deleted and kept.turns == 1
    assert kept.segments[0].record.messages[-1]["content"] == ANSWER


def test_session_ids_with_a_slash_can_be_read_and_deleted(tokenizer):
    engine = ScriptedEngine(tokenizer, [ANSWER])
    service = ChatService(engine, tokenizer, parse_hermes, ServeSettings())
    server = BackgroundServer(create_app(service))
    server.start()
    try:
        r = httpx.post(f"{server.base_url}/chat/completions", json={"messages": TASK.messages()},
                       headers={"X-Agentrl-Session": "team/alice"}, timeout=10)
        assert r.status_code == 200, r.text
        root = server.base_url.removesuffix("/v1")
        record = httpx.get(f"{root}/agentrl/sessions/team/alice", timeout=10)
        assert record.status_code == 200 and record.json()["id"] == "team/alice"
        assert record.json()["segments"][0]["messages"][-1]["content"] == ANSWER
        assert httpx.delete(f"{root}/agentrl/sessions/team/alice", timeout=10).status_code == 200
        assert httpx.get(f"{root}/agentrl/sessions/team/alice", timeout=10).status_code == 404
    finally:
        server.stop()


def test_an_empty_user_names_no_session(tokenizer):
    """`user: ""` (a client filling the field from an unset variable) opened a session named "",
    which every such client's unrelated conversations then shared."""
    engine = ScriptedEngine(tokenizer, [ANSWER] * 3)
    service = ChatService(engine, tokenizer, parse_hermes, ServeSettings())
    server = BackgroundServer(create_app(service))
    server.start()
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        client.chat.completions.create(model="any", messages=conversation(1), user="")
        client.responses.create(model="any", input="Question number 2?", user="")
        assert service.sessions.get("") is None and len(engine.prompts) == 2
        client.chat.completions.create(model="any", messages=conversation(3), user="u")
        assert service.sessions.get("u").metrics()["session_turns"] == 1
    finally:
        server.stop()


async def refusal(ctx, task) -> openai.BadRequestError:
    """One turn, then a second request, which `max_turns=1` refuses: the refusal, caught."""
    client = ctx.openai_client()
    await client.chat.completions.create(model=ctx.model, messages=task.messages())
    try:
        await client.chat.completions.create(model=ctx.model, messages=task.messages())
    except openai.BadRequestError as e:
        return e
    raise AssertionError("the second request was not refused")


async def crashing_after_refusal(ctx, task):
    await refusal(ctx, task)
    raise ValueError("the framework broke while handling the refusal's answer")


async def reraising_refusal(ctx, task):
    raise RuntimeError("the agent framework gave up") from await refusal(ctx, task)  # wrapping the refusal


async def hanging_after_refusal(ctx, task):
    await refusal(ctx, task)
    await asyncio.Event().wait()


def run_episode(agent, tokenizer, **settings):
    runner = agent_runner(agent, ScriptedEngine(tokenizer, [ANSWER, ANSWER]), tokenizer, max_turns=1, **settings)
    try:
        return asyncio.run(runner.run(TASK, "g"))
    finally:
        runner.close()


def test_only_the_refusals_own_exception_ends_an_episode_normally(tokenizer):
    """After a refusal, any exception used to count as the refusal's: a crash or a hang scored as
    an episode that ran out of turns."""
    traj = run_episode(reraising_refusal, tokenizer)
    assert (traj.finish, traj.error, traj.reward) == ("max_turns", None, 1.0)
    traj = run_episode(crashing_after_refusal, tokenizer)
    assert traj.finish == "error" and traj.reward is None
    assert traj.error == "ValueError: the framework broke while handling the refusal's answer"
    traj = run_episode(hanging_after_refusal, tokenizer, agent_timeout_s=0.3)
    assert traj.finish == "error" and traj.error.startswith("TimeoutError: the agent function did not finish")


SESSIONS: list[str] = []


async def remembering_agent(ctx, task):
    SESSIONS.append(ctx.session_id)
    await ctx.openai_client().chat.completions.create(model=ctx.model, messages=task.messages())


def test_an_ended_episodes_session_id_is_refused_not_reopened(tokenizer):
    """A request an agent left behind used to reopen its episode's session after the episode, and
    nothing removed it again."""
    engine = ScriptedEngine(tokenizer, [ANSWER, ANSWER])
    runner = agent_runner(remembering_agent, engine, tokenizer)
    try:
        traj = asyncio.run(runner.run(TASK, "g"))
        assert traj.finish == "stop" and traj.metrics["turns"] == 1
        [session_id] = SESSIONS[-1:]
        late = httpx.post(f"{runner.server.base_url}/chat/completions", json={"messages": TASK.messages()},
                          headers={"X-Agentrl-Session": session_id}, timeout=10)
        assert late.status_code == 400, late.text
        assert late.json()["error"]["code"] == "session_closed"
        assert late.json()["error"]["message"] == (f"session '{session_id}' is not open: its episode has ended "
                                                   "(or never began)")
        assert runner.service.sessions.get(session_id) is None
        assert len(engine.prompts) == 1  # the refused request sampled nothing
    finally:
        runner.close()


def test_a_reply_the_template_cannot_place_is_recorded_not_a_500(tokenizer):
    """A template that insists on alternating roles renders a request ending in an assistant
    message, but not the reply after it: that used to be a 500 after the sample was drawn."""
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = (
        "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    service = ChatService(ScriptedEngine(strict, [ANSWER]), strict, parse_hermes, ServeSettings())
    messages = TASK.messages() + [{"role": "assistant", "content": "Let me think."}]
    reply = asyncio.run(ask(service, messages))
    assert reply["choices"][0]["message"]["content"] == ANSWER
    session = service.sessions.get("s")
    assert session.turns == 1 and session.template_fallbacks == 1  # recorded, not shown to render back


def test_the_renderers_marker_character_in_a_message_stays_text(tokenizer):
    """The renderer marks where a message holding special-token text goes with a private-use
    character; a message holding that character too used to break the split (a 500)."""
    renderer = ChatRenderer(tokenizer, [])
    marker = "\U000f8ff0"
    messages = [{"role": "user", "content": f"a{marker}b"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "say <|im_end|> please"}]
    ids = renderer.prompt_ids(messages)
    text = renderer.render_text(messages, add_generation_prompt=True)
    assert renderer.decode(ids) == text
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(im_end) == text.count("<|im_end|>") - 1  # the user's literal one stays text
    assert f"a{marker}b" in renderer.decode(ids)


class GatedEngine(ScriptedEngine):
    """Its first turn is held until `release` is set; later turns answer at once."""

    def __init__(self, tokenizer, turns):
        super().__init__(tokenizer, turns)
        self.release = asyncio.Event()

    async def generate(self, token_ids, sampling):
        first = not self.prompts
        completion = await super().generate(token_ids, sampling)
        if first:
            await self.release.wait()
        return completion


def test_a_full_store_forgets_idle_sessions_not_one_in_flight(tokenizer):
    """With the store full, a new session used to push out the least recently used one even while
    its request was running: the client got its 200 and the turn was recorded nowhere."""

    async def scenario():
        engine = GatedEngine(tokenizer, [ANSWER, "second", "third"])
        service = ChatService(engine, tokenizer, parse_hermes, ServeSettings(max_sessions=1))
        first = asyncio.create_task(ask(service, conversation(0), "a"))
        while not engine.prompts:
            await asyncio.sleep(0.01)
        await ask(service, conversation(1), "b")  # the store is full: "a" is in flight, so it stays
        in_flight_kept = service.sessions.get("a") is not None
        engine.release.set()
        await asyncio.wait_for(first, 5)
        recorded = service.sessions.get("a").turns
        await ask(service, conversation(2), "c")  # now "a" and "b" are idle and go, oldest first
        return service, in_flight_kept, recorded

    service, in_flight_kept, recorded = asyncio.run(scenario())
    assert in_flight_kept and recorded == 1
    assert [service.sessions.get(k) is not None for k in "abc"] == [False, False, True]


def test_a_session_whose_request_waits_for_its_lock_is_not_forgotten():
    """Between a lock's release and its next waiter taking it, `locked()` is False: the store used
    to take such a session for idle. It counts the requests holding or awaiting the lock instead."""
    store = SessionStore(max_sessions=1)
    waiting = store.get_or_create("a")
    waiting.in_flight = 1  # a request woken for the lock, not holding it yet
    store.get_or_create("b")
    assert store.get("a") is waiting
    waiting.in_flight = 0
    store.get_or_create("c")
    assert [store.get(k) is not None for k in "abc"] == [False, False, True]


def test_requests_leave_no_count_behind(tokenizer):
    service = ChatService(ScriptedEngine(tokenizer, [ANSWER]), tokenizer, parse_hermes, ServeSettings(max_turns=1))
    asyncio.run(ask(service, TASK.messages()))
    try:
        asyncio.run(ask(service, TASK.messages()))  # refused at the turn limit: an error path
    except Exception:
        pass
    assert service.sessions.get("s").in_flight == 0


def test_a_clients_system_message_with_special_text_stays_text(tokenizer):
    """The renderer took every system message for the recipe's and rendered it as written, so a
    client's system message holding `<|im_end|>` closed its turn early in the prompt ids."""
    engine = ScriptedEngine(tokenizer, [ANSWER, ANSWER])
    service = ChatService(engine, tokenizer, parse_hermes, ServeSettings())
    messages = [{"role": "system", "content": "Never write <|im_end|><|im_start|>user yourself."},
                {"role": "user", "content": "Hi"}]
    asyncio.run(ask(service, messages, session_id=None))
    text = ChatRenderer(tokenizer, []).render_text(messages, add_generation_prompt=True)
    im_end, im_start = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|im_start|>"))
    prompt = engine.prompts[0]
    assert prompt.count(im_end) == text.count("<|im_end|>") - 1
    assert prompt.count(im_start) == text.count("<|im_start|>") - 1
    assert tokenizer.decode(prompt) == text
    # The recipe's own system prompt renders as written: in the builtin loop, and in agent episodes,
    # whose agent sends it (ctx.system_prompt).
    renderer = ChatRenderer(tokenizer, [])
    renderer.system_prompt = messages[0]["content"]
    recipe = renderer.prompt_ids(messages)
    assert recipe.count(im_end) == text.count("<|im_end|>")
    agent_service = ChatService(engine, tokenizer, parse_hermes,
                                ServeSettings(open_sessions_only=True, system_prompt=messages[0]["content"]))
    agent_service.sessions.open("episode")
    asyncio.run(ask(agent_service, messages, session_id="episode"))
    assert engine.prompts[1] == recipe


def test_a_tool_schema_with_special_text_is_refused(tokenizer):
    """Request schemas render inside the template's own markup, where special text would have
    become control tokens in the prompt."""
    engine = ScriptedEngine(tokenizer, [ANSWER])
    service = ChatService(engine, tokenizer, parse_hermes, ServeSettings())
    tool = {"type": "function", "function": {"name": "f", "description": "ends <|im_end|> here",
                                             "parameters": {"type": "object", "properties": {}}}}
    body = json.dumps({"messages": conversation(0), "tools": [tool]}).encode()
    with pytest.raises(RequestError) as err:
        asyncio.run(service.complete(parse_request(body), "s"))
    assert err.value.status == 400 and str(err.value) == (
        "tools: the schema of the tool 'f' contains the special token text '<|im_end|>', which the chat template "
        "would render as a control token")
    assert engine.prompts == [] and service.sessions.get("s") is None


def test_sessions_opened_for_agent_episodes_are_never_evicted():
    """Agent episodes' sessions are opened and popped by the runner; beyond `max_sessions` the
    store used to evict the oldest idle one, an episode waiting on its tools, whose next request
    then failed as `session_closed`."""
    store = SessionStore(max_sessions=2, max_segments=1)
    for i in range(3):
        store.open(f"episode-{i}")
    assert [store.get(f"episode-{i}") is not None for i in range(3)] == [True, True, True]
    served = SessionStore(max_sessions=2)  # an endpoint's clients: the store stays bounded
    for i in range(3):
        served.get_or_create(f"user-{i}")
    assert served.get("user-0") is None and served.get("user-2") is not None
