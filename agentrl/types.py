"""The nouns that carry data through agentrl: tasks, tool calls, completions and trajectories.

Plain dataclasses with no behaviour beyond keeping themselves consistent. A Trajectory is the one
record that leaves the rollout loop: one flat token sequence with an aligned loss mask and logprobs,
never re-tokenised after the fact.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Finish = Literal["stop", "length", "max_turns", "error"]


@dataclass
class Task:
    """One prompt the agent must solve."""

    id: str
    prompt: str | list[dict[str, Any]]  # a user question, or a full list of chat messages
    answer: str | None = None  # ground truth, handed to rewards, tools and interactions
    tool_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)  # tool name -> create() kwargs
    interaction_kwargs: dict[str, Any] = field(default_factory=dict)  # the interaction's per-task settings
    metadata: dict[str, Any] = field(default_factory=dict)

    def messages(self, system_prompt: str | None = None) -> list[dict[str, Any]]:
        if isinstance(self.prompt, list):  # the recipe's system prompt, unless the task brings its own
            own = [dict(m) for m in self.prompt]
            has_system = any(m.get("role") == "system" for m in own)
            return own if has_system or not system_prompt else [{"role": "system", "content": system_prompt}, *own]
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        return messages + [{"role": "user", "content": self.prompt}]


@dataclass
class ToolCall:
    """A function call parsed from the model's text."""

    name: str
    arguments: dict[str, Any]

    def as_message_field(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def derive_seed(seed: int, *keys: int | str) -> int:
    """A seed for one part of a run (an episode, a turn) from the run's seed and the part's place
    in it: the same on every machine and in every process (Python's hash of a string is not)."""
    digest = hashlib.blake2b(repr((seed, *keys)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: any torch.Generator takes it


@dataclass
class SamplingParams:
    """How the engine samples one completion. temperature 0 means greedy."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()  # generation ends after emitting any of these (kept)
    # The request's own random stream: its tokens then depend on its seed alone, not on which other
    # requests shared its batches (which follows the timing of tools). None: the engine's stream.
    seed: int | None = None

    def batch_key(self) -> tuple:
        """Requests with equal keys can share one batched forward pass."""
        return (self.temperature, self.top_p, self.stop_token_ids)


@dataclass
class Completion:
    """What an engine returns for one generate call: new ids exactly as sampled."""

    token_ids: list[int]
    logprobs: list[float]  # log p(token) under the temperature-scaled distribution
    finish: Literal["stop", "length"]
    weight_version: int


# Metric names the episode loop and the agent runner give a trajectory; a tool's metric of the same
# name would overwrite one (or make a successful episode report `error`), so a tool may not use them.
EPISODE_METRICS = frozenset({
    "error", "episode_s", "generated_tokens", "turns", "template_fallbacks", "outcome_reward",
    "tool_step_reward", "tool_final_reward", "interaction_score", "interaction_invalid_scores",
    "interaction_truncations", "session_turns", "segments", "history_rewrites", "dropped_generated_tokens"})


@dataclass
class Trajectory:
    """One sampled episode: prompt and every turn as one flat token sequence."""

    task_id: str
    group_id: str
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1 = sampled by the policy
    logprobs: list[float] = field(default_factory=list)  # 0.0 where loss_mask is 0
    messages: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None
    finish: Finish = "stop"
    weight_version: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # why the episode ended with finish="error"

    def append(self, ids: list[int], *, trainable: bool, logprobs: list[float] | None = None) -> None:
        """The only mutation of the token record; keeps ids, mask and logprobs aligned."""
        if trainable and (logprobs is None or len(logprobs) != len(ids)):
            raise ValueError("trainable tokens need one logprob each")
        self.token_ids.extend(ids)
        self.loss_mask.extend([1 if trainable else 0] * len(ids))
        self.logprobs.extend(logprobs if trainable else [0.0] * len(ids))

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
