"""Rollout: the engine protocol and engines, the episode loop, and concurrent collection."""
