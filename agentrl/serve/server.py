"""Running the endpoint: `agentrl serve` in the foreground, or on a daemon thread on loopback for
agent episodes (BackgroundServer).

Why a thread rather than a task on the caller's event loop: HFEngine binds its batching task and
the futures of waiting requests to the loop that calls `generate`, and `run_episodes` runs each
collection (each training step) on a fresh loop that it closes afterwards, cancelling what is left
on it. A server task there would die with every step and leave its engine state behind on a closed
loop. The thread owns one loop for the server's whole life: uvicorn serves on it and every engine
call is made from it, so the requests of all concurrent episodes meet in one batching queue. The
agents run on the caller's loop and reach the server over loopback HTTP, as any client would.

This module does not build responses (service.py) or run agents (agent.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import socket
import sys
import threading
import time
from typing import Any, Coroutine, TypeVar

import uvicorn
from fastapi import FastAPI

from agentrl.config import RecipeConfig
from agentrl.errors import ConfigError
from agentrl.rollout.episode import EpisodeSettings
from agentrl.serve.service import ServeSettings

T = TypeVar("T")


def serve_settings(settings: EpisodeSettings, model_name: str, for_training: bool) -> ServeSettings:
    """The endpoint's limits from the recipe's episode settings. For training (agent episodes) the
    recipe's sampling is fixed, `max_turns` caps each session and only sessions the runner opened
    are served; `agentrl serve` only takes defaults."""
    return ServeSettings(model_name=model_name, max_context_tokens=settings.max_context_tokens,
                         max_new_tokens=settings.max_new_tokens_per_turn, temperature=settings.temperature,
                         top_p=settings.top_p, fixed_sampling=for_training,
                         max_turns=settings.max_turns if for_training else None,
                         open_sessions_only=for_training,
                         system_prompt=settings.system_prompt if for_training else None)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket; an IPv6 address (`::1`, `::`) gets an IPv6 socket, which
    `create_server` does not choose by itself."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"


class BackgroundServer:
    """uvicorn serving an app on 127.0.0.1 (a free port) from a daemon thread and its own loop."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1"):
        self.app, self.host = app, host
        self.port: int | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return url(self.host, self.port or 0)

    def start(self, timeout_s: float = 30.0) -> None:
        sock = bind(self.host, 0)
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off"))

        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            await self._server.serve(sockets=[sock])

        self._thread = threading.Thread(target=asyncio.run, args=(main(),), name="agentrl-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop(timeout_s=5.0)  # a server that starts late must not serve, nor keep the port
                if not self._thread.is_alive():  # else its loop may hold the socket still: left to it
                    sock.close()
                raise RuntimeError(f"the endpoint on {self.base_url} did not start")
            time.sleep(0.01)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run a coroutine on the server's loop (where its sessions live)."""
        assert self.loop is not None, "start() first"
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout_s)


def run_serve(config: RecipeConfig, host: str, port: int) -> None:
    """`agentrl serve`: the recipe's model behind an OpenAI-compatible endpoint until interrupted."""
    from agentrl.rollout.run import close_quietly, episode_settings, load_policy
    from agentrl.serve.app import create_app
    from agentrl.serve.service import ChatService
    from agentrl.tools.parsers import get_parser

    sock = bind(host, port)  # a taken port fails before the model loads
    try:
        tokenizer, engine = load_policy(config, needs_tools=True)  # clients send tools: the template must show them
    except BaseException:
        sock.close()
        raise
    settings = serve_settings(episode_settings(config), config.model.path, for_training=False)
    service = ChatService(engine, tokenizer, get_parser(config.rollout.parser), settings)
    bound_host, bound_port = sock.getsockname()[:2]
    print(f"agentrl serve: {config.model.path} on {url(bound_host, bound_port)} "
          f"(sessions: header X-Agentrl-Session or the 'user' field)", flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="info"))
    # uvicorn shuts down gracefully on SIGINT and SIGTERM only; a closed terminal's SIGHUP gets the
    # same shutdown (raised as an exception on the loop, it cancelled uvicorn mid-step).
    hangup = signal.signal(signal.SIGHUP, server.handle_exit)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn shut down gracefully, then re-raised the Ctrl-C or SIGTERM it caught
        pass
    finally:
        signal.signal(signal.SIGHUP, hangup)
        close_quietly("the engine", engine.close)
    print("agentrl serve: stopped", file=sys.stderr)
