"""An OpenAI-compatible chat endpoint backed by the recipe's engine, recording token-exact
sessions, and agent functions that run against it as episodes.

Modules: protocol (the request format and its validation), sessions (token records per session
and their segments), service (one completion: render, sample, parse, record), app (the FastAPI
routes), server (`agentrl serve`, and the loopback server on a thread), agent (AgentContext,
AgentRunner). Nothing here is imported by the builtin episode loop.
"""
