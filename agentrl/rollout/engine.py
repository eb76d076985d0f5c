"""The engine protocol: token ids in, token ids + logprobs + finish reason out.

The transformers engine (hf_engine.py) implements it on CPU or GPU, the SGLang engine
(sglang_engine.py) in-process or over HTTP. The rollout loop only ever sees this protocol.
"""

from __future__ import annotations

from typing import Iterable, Protocol, runtime_checkable

import torch

from agentrl.types import Completion, SamplingParams


@runtime_checkable
class Engine(Protocol):
    weight_version: int

    async def generate(self, token_ids: list[int], sampling: SamplingParams) -> Completion:
        """Sample a continuation of `token_ids`; many calls may be in flight at once."""
        ...

    def score(self, token_ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
        """Logprobs of token_ids[start:] given their prefix (SGLang: input_token_logprobs); used to
        check that the engine's weights match the trainer's after a sync."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                       flush_cache: bool = True) -> None:
        """Load new weights in place; completions after it carry `version`."""
        ...

    def release_memory(self) -> None:
        """Free accelerator memory (weights and KV cache) while training runs; no-op where meaningless."""
        ...

    def resume_memory(self, tags: tuple[str, ...] | None = None) -> None:
        """Take back released memory: tags from {"weights", "kv_cache"}, None for all. The driver
        resumes "weights", updates them, then resumes "kv_cache", so both never peak together with
        the new weights in flight."""
        ...

    def close(self) -> None:
        """Stop what the engine started (server processes, threads) and delete the files it wrote;
        the engine takes no requests after it. Whoever built the engine closes it."""
        ...
