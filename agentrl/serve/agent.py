"""Agent functions as episodes: `rollout.agent` runs against the OpenAI-compatible endpoint, and
what the endpoint recorded for the episode's session becomes its Trajectory.

An agent function is `async def agent(ctx: AgentContext, task: Task) -> None`. It reaches the
policy only through the endpoint: `ctx.base_url` plus the session header `ctx.headers`, or
`ctx.openai_client()`, which sets both on an `openai.AsyncOpenAI`; any framework built on an
OpenAI client works. `ctx.tools` are the recipe's tool schemas (OpenAI form) and
`await ctx.run_tools(message.tool_calls, message.content)` runs the recipe's tools with the builtin
loop's checks, timeouts, truncation and metrics, answering with OpenAI tool messages, and answers
each malformed call block the endpoint left in the reply's text as the builtin loop does (no
answers: the model called nothing); an agent may run tools of its own instead. Its return value is
not used: the reward function sees the recorded messages, which end with the model's last reply.

AgentRunner has EpisodeRunner's interface (`await run(task, group_id) -> Trajectory`, `.engine`,
`.renderer`), so collect.py and the training driver use it unchanged. It starts the endpoint once,
on 127.0.0.1, on a daemon thread (server.py says why), and opens a fresh session for every
episode; a request naming another session id (one whose episode has ended, say) is refused.
The trajectory is the session's segment that its last turn extended (sessions.py says why: an
agent may hold several conversations with the model in one session), with `segments`,
`history_rewrites` and `dropped_generated_tokens` in its metrics; sampling is the recipe's and each
session has `rollout.max_turns` turns and `rollout.max_context_tokens` tokens. Finish: that of the
last sampled turn (`stop`, `length`); `max_turns` or `length` when the endpoint refused a request
at a limit (the agent's exception from that refusal ends the episode normally; `from_refusal`
tells it from others); `error` for any other exception (`SystemExit` too), for an agent still
running after `rollout.agent_timeout_s` (cancelled; what it recorded is kept), or when the agent
made no request with its session. An episode refused before its first turn (a prompt longer than
`rollout.max_context_tokens`) records what the builtin loop records for it: the task's prompt,
rendered, nothing trainable, finish `length`.

This module does not sample, interpret turns or record (service.py and sessions.py do).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
import uuid
from collections import Counter
from typing import Any, Awaitable, Callable

from agentrl.config import RecipeConfig
from agentrl.env.rewards import RewardFn
from agentrl.env.tool_env import ToolEnv, ToolLimits
from agentrl.errors import ConfigError
from agentrl.rollout.chat import ChatRenderer
from agentrl.rollout.engine import Engine
from agentrl.rollout.episode import EpisodeSettings, checked_total, threaded_outcome_reward
from agentrl.serve.app import create_app
from agentrl.serve.protocol import SESSION_HEADER
from agentrl.serve.server import BackgroundServer, serve_settings
from agentrl.serve.service import REFUSAL_CODES, ChatService
from agentrl.serve.sessions import Session, to_trajectory
from agentrl.tools.base import Tool
from agentrl.tools.loader import close_tools, resolve_reference
from agentrl.tools.parsers import ParsedTurn, json_limit, strict_json
from agentrl.tools.threads import CallTimeout, call_plugin, failure_text
from agentrl.types import Task, ToolCall, Trajectory

AgentFn = Callable[["AgentContext", Task], Awaitable[object]]


class AgentContext:
    """What an agent function gets besides its task: where the policy is and the episode's tools."""

    def __init__(self, base_url: str, session_id: str, model: str, tools: list[Tool], system_prompt: str | None,
                 env: ToolEnv, parser: Callable[[str], ParsedTurn]):
        self.base_url = base_url  # http://127.0.0.1:PORT/v1
        self.session_id = session_id
        self.model = model
        self.tools = [t.schema for t in tools]
        self.system_prompt = system_prompt  # rollout.system_prompt: task.messages(ctx.system_prompt)
        self._env = env
        self._parser = parser
        self.reparsed: list[str] = []  # the malformed blocks run_tools answered, as parse errors

    @property
    def headers(self) -> dict[str, str]:
        return {SESSION_HEADER: self.session_id}

    def openai_client(self, **kwargs: Any) -> Any:
        """An `openai.AsyncOpenAI` on the endpoint, sending this episode's session header."""
        import openai

        headers = {**kwargs.pop("default_headers", {}), **self.headers}
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=kwargs.pop("api_key", "agentrl"),
                                  default_headers=headers, **kwargs)

    async def run_tools(self, tool_calls: list[Any] | None, content: str | None = None) -> list[dict[str, Any]]:
        """Tool messages (`role: tool`, `tool_call_id`, `content`) answering OpenAI tool calls
        (objects of the openai client or dicts), in order, through the recipe's tools; then, given
        the reply's `content`, one `Error: ...` message (named `parse_error`, no call id) per
        malformed call block in it, as the builtin loop tells the model its call was broken."""
        calls, errors, call_ids, error_ids = [], [], [], []
        for call in tool_calls or []:
            call = call if isinstance(call, dict) else call.model_dump()
            fn, arguments = call["function"], call["function"].get("arguments") or "{}"
            problem = f"the arguments of '{fn['name']}' must be a JSON object"  # '"rm -rf"' decodes to a str
            try:
                arguments = strict_json(arguments) if isinstance(arguments, str) else arguments
            except json.JSONDecodeError as e:
                problem = f"the arguments of '{fn['name']}' are not valid JSON ({e.msg})"
            except (ValueError, RecursionError) as e:  # NaN, 5000 digits, a lone surrogate, 5000 levels deep
                problem = f"the arguments of '{fn['name']}' are not valid JSON ({json_limit(e)})"
            if isinstance(arguments, dict):
                calls.append(ToolCall(fn["name"], arguments))
                call_ids.append(call.get("id"))
            else:
                errors.append(problem)
                error_ids.append(call.get("id"))
        malformed = self._parser(content).errors if content else []
        # Every call gets its own answer: past the turn's limit the tools' env folds errors into one
        # "N more" message, which would answer one call id for several and leave the last unanswered.
        limit = self._env.limits.max_calls_per_turn
        answers = await self._env.run_turn(ParsedTurn(calls=calls, errors=errors[:limit] + malformed))
        self._env.metrics["parse_errors"] += len(errors[limit:])
        self.reparsed += malformed  # a finished turn's were counted when sampled: see `answered_twice`
        answered = len(call_ids) + len(errors[:limit])
        not_read = [{"content": f"Error: {problem}; not read: at most {limit} tool calls are answered per turn."}
                    for problem in errors[limit:]]
        return [{"role": "tool", "tool_call_id": call_id, "content": m["content"]}
                for call_id, m in zip(call_ids + error_ids, answers[:answered] + not_read)] + \
            [{"role": "tool", "name": "parse_error", "content": m["content"]} for m in answers[answered:]]


def answered_twice(reparsed: list[str], uncounted: list[str]) -> int:
    """How many of the malformed blocks an agent answered through `run_tools` the endpoint had
    already counted. It counts a turn's blocks when the turn is sampled to its end; the blocks of
    turns cut off by their budget (`uncounted`, each matched once, by its parse error, which names
    the block and not where the reply was cut or how the agent trimmed it) were counted nowhere."""
    return sum((Counter(reparsed) - Counter(uncounted)).values())


def load_agent(config: RecipeConfig) -> AgentFn:
    """The recipe's agent function, or a ConfigError naming `rollout.agent`."""
    ref = config.rollout.agent
    if config.rollout.interaction_config:
        raise ConfigError("rollout.agent cannot be combined with rollout.interaction_config: "
                          "the agent function writes every user turn")
    try:
        fn = resolve_reference(ref, group="agentrl.agents")
    except ValueError as e:
        raise ConfigError(f"rollout.agent: {e}") from None
    if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))):
        raise ConfigError(f"rollout.agent: '{ref}' is not an async function (async def agent(ctx, task))")
    return fn


class AgentRunner:
    """Runs an agent function per episode against the endpoint; shared by concurrent episodes."""

    def __init__(self, agent: AgentFn, engine: Engine, tokenizer: Any, tools: list[Tool],
                 parser: Callable[[str], ParsedTurn], settings: EpisodeSettings, reward_fn: RewardFn | None = None,
                 model_name: str = "policy"):
        self.agent = agent
        self.engine = engine
        self.renderer = ChatRenderer(tokenizer, tools)  # the training driver takes its tokenizer from here
        self.renderer.system_prompt = settings.system_prompt  # rendered as the endpoint renders it
        self.tools = tools
        self.settings = settings
        self.reward_fn = reward_fn
        self.service = ChatService(engine, tokenizer, parser, serve_settings(settings, model_name, for_training=True))
        self._server: BackgroundServer | None = None
        self._starting = threading.Lock()

    @property
    def server(self) -> BackgroundServer:
        """The endpoint, started on first use."""
        with self._starting:
            if self._server is None:
                server = BackgroundServer(create_app(self.service))
                server.start()
                self._server = server
        return self._server

    def close(self) -> None:
        """Stop the endpoint, then close what stands behind the tools; the engine is its builder's."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        close_tools(self.tools)

    async def run(self, task: Task, group_id: str, seed: int | None = None) -> Trajectory:
        """One episode; any unexpected failure ends it with finish='error', never raises. With a
        `seed`, the session's turn t samples with seed derive_seed(seed, t), as the builtin loop's do."""
        started = time.perf_counter()
        try:
            traj = await self._run(task, group_id, seed)
        except Exception as e:
            traj = Trajectory(task_id=task.id, group_id=group_id, weight_version=self.engine.weight_version,
                              finish="error", error=failure_text(e))
        if traj.finish == "error":
            traj.metrics["error"] = 1.0
        traj.metrics["episode_s"] = time.perf_counter() - started
        traj.metrics["generated_tokens"] = float(traj.num_generated)
        return traj

    async def _open(self, session_id: str, seed: int | None) -> None:
        self.service.sessions.open(session_id).seed = seed  # on the server's loop, where sessions live

    async def _run(self, task: Task, group_id: str, seed: int | None) -> Trajectory:
        s, server, session_id = self.settings, self.server, uuid.uuid4().hex
        env = ToolEnv(self.tools, s.tool_limits or ToolLimits(),
                      lambda text: self.renderer.truncate(text, s.max_tool_output_tokens))
        ctx = AgentContext(server.base_url, session_id, self.service.settings.model_name, self.tools,
                           s.system_prompt, env, self.service.parser)
        failure: Exception | None = None
        try:  # from here on, whatever happens (a cancellation while the tools start too), they are released
            await asyncio.wrap_future(server.submit(self._open(session_id, seed)))
            await env.start(session_id, task)
            # call_plugin: a sys.exit() in it fails this episode, not the run; so does a hang
            await call_plugin(self.agent(ctx, task), s.agent_timeout_s, f"the agent function "
                              f"'{getattr(self.agent, '__qualname__', self.agent)}'")
        except CallTimeout:
            failure = TimeoutError(f"the agent function did not finish within {s.agent_timeout_s:g} s "
                                   "(rollout.agent_timeout_s)")
        except Exception as e:  # a refusal at a limit ends the episode; anything else fails it (below)
            failure = e
        finally:
            try:
                tool_final = await env.finish()
            finally:  # cancelled while the tools finish: the session still closes
                session = await asyncio.wrap_future(server.submit(self.service.sessions.pop(session_id)))
        session = session or Session(session_id)
        traj = to_trajectory(session, task.id, group_id)
        traj.weight_version = traj.weight_version if session.segments else self.engine.weight_version
        traj.metrics = {**env.metrics, **traj.metrics,
                        "parse_errors": env.metrics["parse_errors"] + traj.metrics["parse_errors"]
                        - answered_twice(ctx.reparsed, session.uncounted_errors)}
        if failure is not None and not (session.refused and from_refusal(failure, REFUSAL_CODES[session.refused])):
            traj.finish, traj.error = "error", failure_text(failure)
            return traj
        if not session.segments and session.refused is None:
            traj.finish, traj.error = "error", f"the agent made no chat completion request with its session " \
                                               f"(header {SESSION_HEADER}: {session_id})"
            return traj
        if not session.segments:  # refused before any turn: what the builtin loop records for a prompt too long
            traj.messages = task.messages(s.system_prompt)
            traj.append(self.renderer.prompt_ids(traj.messages), trainable=False)
            if session.refused == "length":
                traj.finish, traj.error = "error", failure_text(ValueError(
                    f"the prompt is {len(traj.token_ids)} tokens, and rollout.max_context_tokens "
                    f"({s.max_context_tokens}) leaves no room to generate"))
                return traj
        traj.finish = session.refused or traj.finish
        outcome = await threaded_outcome_reward(self.reward_fn, task, traj.messages, s.reward_timeout_s)
        traj.reward = checked_total(outcome + (sum(env.step_rewards) if s.tool_step_rewards else 0.0)
                                    + (tool_final if s.tool_final_rewards else 0.0))
        traj.metrics.update({"outcome_reward": outcome, "tool_step_reward": sum(env.step_rewards),
                             "tool_final_reward": tool_final})
        return traj


def from_refusal(failure: BaseException, code: str) -> bool:
    """Whether an agent's exception is the endpoint's refusal with error `code`, or was raised from
    or while handling it: an openai `APIStatusError` carries the code, an httpx `HTTPStatusError`
    its response's body, and a framework's own error usually its text."""
    seen: set[int] = set()
    error: BaseException | None = failure
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if getattr(error, "code", None) == code or code in str(error):
            return True
        try:
            if code in error.response.text:  # type: ignore[attr-defined]
                return True
        except Exception:  # no response, or one whose body was not read
            pass
        error = error.__cause__ or error.__context__
    return False
