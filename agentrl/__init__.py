"""agentrl: reinforcement learning for LLM agents that use tools over many turns."""

__version__ = "0.1.0"
