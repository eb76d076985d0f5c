"""The multi-turn episode loop, token-in/token-out.

The prompt is rendered once with the chat template. Each assistant turn is appended exactly as the
engine sampled it (mask 1, with logprobs) and recorded as the message that renders back to it. Tool
and user turns are appended as the text the chat template adds after the conversation so far:
render all messages, strip the text the current ids decode to, tokenise the rest (mask 0). Boundary
tokens the template inserts after a sampled `<|im_end|>` (the newline) therefore land in that
suffix, never in the sampled part, and decoding a finished trajectory reproduces the template's
rendering of its messages. Templates that cannot reproduce a sampled turn take chat.py's fallback,
counted in the `template_fallbacks` metric.

This module does not batch (the engine does), schedule episodes (collect.py does) or train.
"""

from __future__ import annotations

import asyncio
import copy
import math
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Coroutine, TypeVar

from agentrl.env.interaction import Interaction, InteractionError, Turn
from agentrl.env.rewards import RewardFn
from agentrl.env.tool_env import ToolEnv, ToolLimits
from agentrl.finite import finite_number
from agentrl.rollout.chat import ChatRenderer
from agentrl.rollout.engine import Engine
from agentrl.tools.base import REWARD_LIMIT, Tool
from agentrl.tools.loader import close_tools
from agentrl.tools.parsers import ParsedTurn
from agentrl.tools.threads import (NOT_A_PLUGINS_OWN, CallTimeout, call_plugin, failure_text, on_worker_thread,
                                   warn_if_blocking)
from agentrl.types import SamplingParams, Task, Trajectory, derive_seed
from agentrl.yaml_files import one_line

T = TypeVar("T")


@dataclass
class EpisodeSettings:
    max_turns: int = 4  # assistant turns
    max_context_tokens: int = 2048
    max_new_tokens_per_turn: int = 256
    max_tool_output_tokens: int = 256
    max_interaction_tokens: int = 1024  # an interaction's reply beyond this is cut, with a marker
    temperature: float = 1.0
    top_p: float = 1.0
    system_prompt: str | None = None
    tool_limits: ToolLimits | None = None
    tool_step_rewards: bool = False  # add the tools' per-call rewards to the trajectory reward
    tool_final_rewards: bool = False  # add each tool's reward(instance) at the end
    interaction_scores: bool = False  # add the interaction's scores
    interaction_timeout_s: float = 60.0  # per call into the interaction; past it the episode fails
    agent_timeout_s: float = 1800.0  # per episode of an agent function (rollout.agent); past it the episode fails
    reward_timeout_s: float = 60.0  # per call of the reward function; past it the episode fails


class EpisodeRunner:
    """Runs episodes for one configuration; shared by every concurrent episode of a run."""

    def __init__(self, engine: Engine, tokenizer: Any, tools: list[Tool], parser: Callable[[str], ParsedTurn],
                 settings: EpisodeSettings, interaction_factory: Callable[[], Interaction] | None = None,
                 reward_fn: RewardFn | None = None):
        self.engine = engine
        self.renderer = ChatRenderer(tokenizer, tools)
        self.renderer.system_prompt = settings.system_prompt  # rendered as written; a task's own is text
        self.tools = tools
        self.parser = parser
        self.settings = settings
        self.interaction_factory = interaction_factory
        self.reward_fn = reward_fn
        self.stop_ids = self.renderer.stop_ids

    def close(self) -> None:
        """Close what stands behind the tools (MCP server processes, tool-server clients). The
        engine is not the runner's: whoever built it closes it (run.close_runner)."""
        close_tools(self.tools)

    async def run(self, task: Task, group_id: str, seed: int | None = None) -> Trajectory:
        """One episode; any unexpected failure ends it with finish='error', never raises. With a
        `seed`, turn t samples with seed derive_seed(seed, t), so the episode's tokens do not depend on
        the other episodes' timing (which turns shared a batch with which)."""
        traj = Trajectory(task_id=task.id, group_id=group_id, weight_version=self.engine.weight_version)
        started = time.perf_counter()
        try:
            await self._run(task, traj, seed)
        except Exception as e:
            traj.finish = "error"
            traj.metrics["error"] = 1.0
            traj.error = failure_text(e)
        traj.metrics["episode_s"] = time.perf_counter() - started
        traj.metrics["generated_tokens"] = float(traj.num_generated)
        return traj

    async def _run(self, task: Task, traj: Trajectory, seed: int | None) -> None:
        s = self.settings
        env = ToolEnv(self.tools, s.tool_limits or ToolLimits(),
                      lambda text: self.renderer.truncate(text, s.max_tool_output_tokens))
        interaction, scores, turns, fallbacks = None, [], 0, 0  # scores: the interaction's, one per reply
        cuts = [0]  # interaction replies cut to max_interaction_tokens
        try:  # from here on, whatever fails, the tools' and the interaction's instances are released
            await env.start(uuid.uuid4().hex[:12], task)
            interaction = self._new_interaction() if self.interaction_factory else None
            if interaction:  # a copy, as tools get: what start changes must not reach the group's other episodes
                await self._interaction_call(interaction.start(copy.deepcopy(task)))
            traj.messages = task.messages(s.system_prompt)
            traj.append(self.renderer.prompt_ids(traj.messages), trainable=False)
            if len(traj.token_ids) >= s.max_context_tokens:  # a failure the run counts, not an empty episode
                raise ValueError(f"the prompt is {len(traj.token_ids)} tokens, and rollout.max_context_tokens "
                                 f"({s.max_context_tokens}) leaves no room to generate")
            while turns < s.max_turns:
                budget = min(s.max_new_tokens_per_turn, s.max_context_tokens - len(traj.token_ids))
                if budget <= 0:
                    traj.finish = "length"
                    break
                sampling = SamplingParams(budget, s.temperature, s.top_p, self.stop_ids,
                                          None if seed is None else derive_seed(seed, turns))
                completion = await self.engine.generate(traj.token_ids, sampling)
                # As the endpoint refuses them: a diverged model's NaN would weight the update (the
                # importance weights) and be written to the trajectory file as a bare NaN.
                bad = next((i for i, lp in enumerate(completion.logprobs) if not math.isfinite(lp)), None)
                if bad is not None:
                    raise ValueError(f"the engine gave sampled token {bad} of turn {turns + 1} the logprob "
                                     f"{completion.logprobs[bad]} (a diverged model?)")
                traj.weight_version = min(traj.weight_version, completion.weight_version)
                traj.append(completion.token_ids, trainable=True, logprobs=completion.logprobs)
                turns += 1
                content_ids = completion.token_ids[:-1] if completion.finish == "stop" else completion.token_ids
                text = self.renderer.decode(content_ids)
                parsed = self.parser(text)
                if completion.finish == "length":  # a cut-off turn ends the episode; nothing renders after it
                    # Marked, so a grader does not take the number it stopped at for an answer.
                    traj.messages.append({"role": "assistant", "content": text, "truncated": True})
                    traj.finish = "length"
                    break
                assistant, exact = self.renderer.assistant_message(traj.messages, text, parsed, completion.token_ids)
                fallbacks += not exact  # this turn's own rendering differs from its sample
                traj.messages.append(assistant)
                new = await self._answer(env, interaction, parsed, traj.messages, scores, cuts)
                if new is None:
                    traj.finish = "stop"
                    break
                suffix, fell_back = self.renderer.suffix_ids(traj.token_ids, traj.messages, new)
                fallbacks += fell_back and exact  # history re-renders differently; counted once per turn
                if len(traj.token_ids) + len(suffix) >= s.max_context_tokens:
                    # After the last allowed turn nothing more would be generated: the turns ran out.
                    traj.finish = "max_turns" if turns >= s.max_turns else "length"
                    break
                traj.messages.extend(new)
                traj.append(suffix, trainable=False)
            else:  # the loop ran out of turns (every other way out of it breaks)
                traj.finish = "max_turns"
        finally:
            try:
                tool_final = await env.finish()
            finally:  # the interaction is finished even when a second cancellation lands in the tools' release
                # Kept for a failed episode too: the turns and tool calls it made did happen.
                traj.metrics.update(env.metrics, turns=float(turns), template_fallbacks=float(fallbacks))
                if self.interaction_factory:
                    traj.metrics["interaction_invalid_scores"] = float(scores.count(None))
                    traj.metrics["interaction_truncations"] = float(cuts[0])
                failing = sys.exc_info()[1] is not None  # then the episode's own failure is the one reported
                if interaction:
                    try:
                        await self._interaction_call(interaction.finish())
                    except Exception:
                        if not failing:
                            raise
        await self._reward(task, traj, env.step_rewards, tool_final, [x for x in scores if x is not None])

    def _new_interaction(self) -> Interaction:
        """This episode's instance; a constructor that fails (raises, calls sys.exit(), raises a
        BaseException of its own) fails the episode."""
        started = time.perf_counter()
        try:
            return self.interaction_factory()
        except NOT_A_PLUGINS_OWN:
            raise
        except BaseException as e:  # SystemExit, or a BaseException of its own: fails this episode
            raise InteractionError(f"the interaction's constructor raised {failure_text(e)}") from e
        finally:  # it runs on the event loop, once per episode
            warn_if_blocking("the interaction's constructor", time.perf_counter() - started,
                             "build what is slow (a judge's model or client) once, outside the constructor, and "
                             "let each instance use it; do per-episode set-up in `async def start`")

    async def _interaction_call(self, coro: Coroutine[Any, Any, T]) -> T:
        """One call into the interaction through `call_plugin`: a `sys.exit()` in it, or a judge that
        never answers (a hung HTTP call), fails this episode, not the run; what it raises is named
        as the interaction's, apart from a reward function's or a tool's failure."""
        method = getattr(coro, "__qualname__", "call").rsplit(".", 1)[-1]
        try:
            return await call_plugin(coro, self.settings.interaction_timeout_s, f"the interaction's {method}")
        except CallTimeout:
            raise TimeoutError(f"the interaction's {method} did not answer within "
                               f"{self.settings.interaction_timeout_s:g} s (rollout.interaction_timeout_s)") from None
        except Exception as e:
            raise InteractionError(f"the interaction's {method} raised {failure_text(e)}") from e

    async def _answer(self, env: ToolEnv, interaction: Interaction | None, parsed: ParsedTurn,
                      messages: list[dict[str, Any]], scores: list[float | None],
                      cuts: list[int]) -> list[dict[str, Any]] | None:
        """The messages answering an assistant turn: its tools' (for calls, malformed ones too), else
        the interaction's reply, whose score goes to `scores` (None when it is not a finite number:
        a NaN would poison every advantage of the group). None when the episode ends here. A reply
        longer than max_interaction_tokens is cut, as tool output is, and counted in `cuts`: a
        megabyte of it held the event loop for seconds and then ended the episode at the context limit."""
        if parsed.calls or parsed.errors:
            return await env.run_turn(parsed)
        if interaction is None:
            return None
        # A copy, as tools get: a judge that appends its own prompt or edits a turn must not change
        # what the episode recorded (and will train on).
        reply = await self._interaction_call(interaction.respond(copy.deepcopy(messages)))
        if not isinstance(reply, Turn):
            raise InteractionError(f"the interaction's respond returned {one_line(repr(reply))}, not a "
                                   "Turn(text, done, score) (agentrl.env.interaction.Turn; verl's (done, text, "
                                   "score, metadata) tuple is not one)")
        if not isinstance(reply.done, bool):  # "false" would end the episode
            raise InteractionError(f"the interaction's respond returned done={reply.done!r}, not True or False")
        if reply.score is not None:  # None: this reply is not scored
            scores.append(finite_number(reply.score, REWARD_LIMIT))
        if reply.done:
            return None
        if not isinstance(reply.text, str):  # None would be shown to the model as an empty user turn
            raise InteractionError(f"the interaction's respond returned text {reply.text!r}, not a string")
        text, cut = self.renderer.truncate(reply.text, self.settings.max_interaction_tokens, "reply")
        cuts[0] += cut
        return [{"role": "user", "content": text}]

    async def _reward(self, task: Task, traj: Trajectory, step_rewards: list[float], tool_final: float,
                      scores: list[float]) -> None:
        """The episode's reward: the outcome, plus the tool and interaction rewards the settings add."""
        s = self.settings
        outcome = await threaded_outcome_reward(self.reward_fn, task, traj.messages, s.reward_timeout_s)
        traj.reward = checked_total(outcome + (sum(step_rewards) if s.tool_step_rewards else 0.0)
                                    + (tool_final if s.tool_final_rewards else 0.0)
                                    + (sum(scores) if s.interaction_scores else 0.0))
        traj.metrics.update({"outcome_reward": outcome, "tool_step_reward": sum(step_rewards),
                             "tool_final_reward": tool_final})
        if self.interaction_factory:
            traj.metrics["interaction_score"] = sum(scores)


async def threaded_outcome_reward(reward_fn: RewardFn | None, task: Task, messages: list[dict[str, Any]],
                                  timeout_s: float) -> float:
    """outcome_reward on a copy of the task and messages, on a worker thread, for at most `timeout_s`.

    Not on the event loop: a grader that calls a judge over HTTP, or runs `asyncio.run` itself,
    would hold every other episode and generation while it runs (or fail, as `asyncio.run` does
    inside a running loop), and one that hangs would hang the run. What it raises outside
    `Exception` there (a SystemExit from a grader wrapping an argparse- or click-style program, a
    KeyboardInterrupt or a BaseException of its own) fails this episode only."""
    if reward_fn is None:
        return 0.0
    work = asyncio.to_thread(on_worker_thread, outcome_reward, reward_fn=reward_fn, task=copy.deepcopy(task),
                             messages=copy.deepcopy(messages))
    try:
        return await call_plugin(work, timeout_s, "the reward function")
    except CallTimeout:
        raise TimeoutError(f"the reward function did not answer within {timeout_s:g} s (reward.timeout_s)") from None


def outcome_reward(reward_fn: RewardFn | None, task: Task, messages: list[dict[str, Any]]) -> float:
    """The reward function's value; one that is not a finite number fails the episode, which
    keeps it out of training (a NaN would poison every advantage of its group)."""
    if reward_fn is None:
        return 0.0
    value = reward_fn(task, messages)
    try:
        number = float(value) if not isinstance(value, (str, bytes)) else math.nan
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int past a float's range
        number = math.nan
    if not math.isfinite(number):
        raise ValueError(f"the reward function returned {value!r}, not a finite number")
    if abs(number) > REWARD_LIMIT:
        raise ValueError(f"the reward function returned {value!r}, beyond ±{REWARD_LIMIT:g} (the largest reward "
                         "training takes)")
    return number


def checked_total(reward: float) -> float:
    """An episode's summed reward, or a ValueError (which fails the episode) beyond REWARD_LIMIT."""
    if not abs(reward) <= REWARD_LIMIT:
        raise ValueError(f"the episode's rewards sum to {reward!r}, beyond ±{REWARD_LIMIT:g} (the largest reward "
                         "training takes)")
    return reward
