"""The multi-turn episode loop, token-in/token-out.

The prompt is rendered once with the chat template. Each assistant turn is appended exactly as the
engine sampled it (mask 1, with logprobs). Tool and user turns are appended as the text the chat
template adds after the conversation so far: render all messages, strip the text the current ids
decode to, tokenise the rest (mask 0). Boundary tokens the template inserts after a sampled
`<|im_end|>` (the newline) therefore land in that suffix, never in the sampled part, and decoding a
finished trajectory reproduces the template's rendering of its messages.

This module does not batch (the engine does), schedule episodes (collect.py does) or train.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from agentrl.env.interaction import Interaction
from agentrl.env.rewards import RewardFn
from agentrl.env.tool_env import ToolEnv, ToolLimits
from agentrl.rollout.engine import Engine
from agentrl.tools.base import Tool
from agentrl.tools.parsers import ParsedTurn
from agentrl.types import SamplingParams, Task, Trajectory

_FALLBACK_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


@dataclass
class EpisodeSettings:
    max_turns: int = 4  # assistant turns
    max_context_tokens: int = 2048
    max_new_tokens_per_turn: int = 256
    max_tool_output_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    system_prompt: str | None = None
    tool_limits: ToolLimits | None = None
    tool_step_rewards: bool = False  # add the tools' per-call rewards to the trajectory reward
    tool_final_rewards: bool = False  # add each tool's reward(instance) at the end
    interaction_scores: bool = False  # add the interaction's scores


class ChatRenderer:
    """Chat-template rendering to token ids, and the suffix a list of new messages adds."""

    def __init__(self, tokenizer: Any, tools: list[Tool]):
        self.tokenizer = tokenizer
        self.schemas = [t.schema for t in tools] or None

    def render_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.schemas, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.render_text(messages, add_generation_prompt=True))

    def suffix_ids(self, current_ids: list[int], history: list[dict[str, Any]],
                   new: list[dict[str, Any]]) -> tuple[list[int], bool]:
        """Ids that continue `current_ids` with `new` messages and the next generation prompt.

        Returns (ids, used_fallback). The fallback, for templates that re-render history
        differently from what was sampled, diffs a fixed two-message base instead.
        """
        current = self.decode(current_ids)
        full = self.render_text(history + new, add_generation_prompt=True)
        if full.startswith(current):
            return self.encode(full[len(current):]), False
        base = self.render_text(_FALLBACK_BASE, add_generation_prompt=False)
        extended = self.render_text(_FALLBACK_BASE + new, add_generation_prompt=True)
        eos = self.tokenizer.eos_token or ""
        boundary = base[base.rfind(eos) + len(eos):] if eos and eos in base else ""
        return self.encode(boundary + extended[len(base):]), True

    def truncate(self, text: str, max_tokens: int) -> tuple[str, bool]:
        """Text cut to `max_tokens` tokens with a marker saying so; (text, was_cut)."""
        head = text[: max_tokens * 16]  # no token is longer than this, so tokenising stays cheap
        ids = self.encode(head)
        if len(ids) <= max_tokens and len(head) == len(text):
            return text, False
        kept = self.decode(ids[:max_tokens])
        return f"{kept}\n[output truncated to {max_tokens} tokens]", True


class EpisodeRunner:
    """Runs episodes for one configuration; shared by every concurrent episode of a run."""

    def __init__(self, engine: Engine, tokenizer: Any, tools: list[Tool], parser: Callable[[str], ParsedTurn],
                 settings: EpisodeSettings, interaction_factory: Callable[[], Interaction] | None = None,
                 reward_fn: RewardFn | None = None):
        self.engine = engine
        self.renderer = ChatRenderer(tokenizer, tools)
        self.tools = tools
        self.parser = parser
        self.settings = settings
        self.interaction_factory = interaction_factory
        self.reward_fn = reward_fn
        self.stop_ids = tuple({tokenizer.eos_token_id} | {tokenizer.convert_tokens_to_ids("<|im_end|>")} - {None})

    async def run(self, task: Task, group_id: str) -> Trajectory:
        """One episode; any unexpected failure ends it with finish='error', never raises."""
        traj = Trajectory(task_id=task.id, group_id=group_id, weight_version=self.engine.weight_version)
        started = time.perf_counter()
        try:
            await self._run(task, traj)
        except Exception as e:
            traj.finish = "error"
            traj.metrics["error"] = 1.0
            traj.error = f"{type(e).__name__}: {e}"
        traj.metrics["episode_s"] = time.perf_counter() - started
        traj.metrics["generated_tokens"] = float(traj.num_generated)
        return traj

    async def _run(self, task: Task, traj: Trajectory) -> None:
        s = self.settings
        env = ToolEnv(self.tools, s.tool_limits or ToolLimits(),
                      lambda text: self.renderer.truncate(text, s.max_tool_output_tokens))
        await env.start(uuid.uuid4().hex[:12], task)
        interaction = self.interaction_factory() if self.interaction_factory else None
        if interaction:
            await interaction.start(task)
        traj.messages = task.messages(s.system_prompt)
        traj.append(self.renderer.prompt_ids(traj.messages), trainable=False)
        scores: list[float] = []
        turns, fallbacks = 0, 0
        try:
            while True:
                if turns >= s.max_turns:
                    traj.finish = "max_turns"
                    break
                budget = min(s.max_new_tokens_per_turn, s.max_context_tokens - len(traj.token_ids))
                if budget <= 0:
                    traj.finish = "length"
                    break
                sampling = SamplingParams(budget, s.temperature, s.top_p, self.stop_ids)
                completion = await self.engine.generate(traj.token_ids, sampling)
                traj.weight_version = min(traj.weight_version, completion.weight_version)
                traj.append(completion.token_ids, trainable=True, logprobs=completion.logprobs)
                turns += 1
                content_ids = completion.token_ids[:-1] if completion.finish == "stop" else completion.token_ids
                text = self.renderer.decode(content_ids)
                parsed = self.parser(text)
                assistant: dict[str, Any] = {"role": "assistant", "content": text}
                if parsed.calls:
                    assistant["tool_calls"] = [c.as_message_field() for c in parsed.calls]
                traj.messages.append(assistant)
                if completion.finish == "length":
                    traj.finish = "length"
                    break
                if parsed.calls or parsed.errors:
                    new = await env.run_turn(parsed)
                elif interaction:
                    reply = await interaction.respond(traj.messages)
                    scores.append(reply.score)
                    if reply.done:
                        traj.finish = "stop"
                        break
                    new = [{"role": "user", "content": reply.text}]
                else:
                    traj.finish = "stop"
                    break
                suffix, fell_back = self.renderer.suffix_ids(traj.token_ids, traj.messages, new)
                fallbacks += fell_back
                if len(traj.token_ids) + len(suffix) >= s.max_context_tokens:
                    traj.finish = "length"
                    break
                traj.messages.extend(new)
                traj.append(suffix, trainable=False)
        finally:
            tool_final = await env.finish()
            if interaction:
                await interaction.finish()
        outcome = float(self.reward_fn(task, traj.messages)) if self.reward_fn else 0.0
        traj.reward = (outcome + (sum(env.step_rewards) if s.tool_step_rewards else 0.0)
                       + (tool_final if s.tool_final_rewards else 0.0)
                       + (sum(scores) if s.interaction_scores else 0.0))
        traj.metrics.update(env.metrics)
        traj.metrics.update({"turns": float(turns), "outcome_reward": outcome, "tool_step_reward": sum(env.step_rewards),
                             "tool_final_reward": tool_final, "interaction_score": sum(scores),
                             "template_fallbacks": float(fallbacks)})
