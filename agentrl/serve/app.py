"""The HTTP face of ChatService: a FastAPI app with OpenAI's chat-completions and Responses routes.

Routes: `POST /v1/chat/completions`, `POST /v1/responses` (OpenAI's Responses API, translated onto
chat completions by responses.py), `GET /v1/models`, and `GET` / `DELETE /agentrl/sessions/{id}`
for a session's recorded segments. The session of a request is the `X-Agentrl-Session` header,
else the body's `user` field; a request with neither is served and not recorded.

Every answer is JSON, or with `stream: true` the same answer as server-sent events: the turn is
sampled whole first (its tokens are recorded as one turn either way), then sent as OpenAI's chunks
(stream_chunks), so frameworks that stream by default (LangGraph's message streaming, the Agents
SDK's run_streamed over chat completions) work unchanged. The body is read by this module (not by
FastAPI's parameter binding) so that its size is capped while it streams in (413 past
`max_body_bytes`) and so that a malformed body gets OpenAI's error shape with one line naming the
field (400), which OpenAI clients surface as the exception message. An unexpected failure answers
500 with the exception's type only, an engine's or template's failure a 500 naming it; either way
the traceback goes to the server's log (logger `agentrl.serve` for the latter), never to the
client. A client that hangs up before its answer has its request's work cancelled (and its
session's turn left unrecorded) rather than finished for nobody.

This module does not sample or record; service.py does.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Coroutine, Iterator, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from agentrl.serve.protocol import SESSION_HEADER, RequestError, error_body, parse_request
from agentrl.serve.responses import parse_responses_request, response_events, response_object
from agentrl.serve.service import ChatService
from agentrl.serve.sessions import session_json

MAX_BODY_BYTES = 8 * 1024 * 1024
CLIENT_GONE = 499  # the status nginx logs for a client that closed the connection before the answer
log = logging.getLogger("agentrl.serve")
T = TypeVar("T")


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"request body of {declared} bytes is over the limit of {limit}", 413, "body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:  # a body without (or lying about) its length is cut off here
            raise RequestError(f"request body is over the limit of {limit} bytes", 413, "body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def until_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """The result of `work`, or None after cancelling it when the client hangs up first: nobody
    would read the answer, and a session's turn is then not recorded."""
    task = asyncio.ensure_future(work)
    hangup = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, hangup}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler itself is cancelled
        hangup.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def wait_for_disconnect(request: Request) -> None:
    # After the body, the server's next ASGI message for this request is its disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def stream_chunks(answer: dict[str, Any], include_usage: bool) -> Iterator[str]:
    """A `chat.completion` as the `chat.completion.chunk` events OpenAI streams: the role with the
    text (and its logprobs), one chunk per tool call (`index`, `id`, name and whole arguments), the
    finish reason, the usage when asked for, then `[DONE]`."""
    [choice] = answer["choices"]
    message = choice["message"]
    head = {key: answer[key] for key in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    empty_usage = {"usage": None} if include_usage else {}

    def event(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> str:
        chunk = head | {"choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        return f"data: {json.dumps(chunk | empty_usage, ensure_ascii=False)}\n\n"

    yield event({"role": "assistant", "content": message["content"]}, logprobs=choice["logprobs"])
    for i, call in enumerate(message.get("tool_calls") or []):
        yield event({"tool_calls": [{"index": i, **call}]})
    yield event({}, choice["finish_reason"])
    if include_usage:
        yield f"data: {json.dumps(head | {'choices': [], 'usage': answer['usage']})}\n\n"
    yield "data: [DONE]\n\n"


# The openai client retries a 500 twice unless told not to. This endpoint's 500s are a template
# that cannot render the turn, an engine that failed after its own retries, or a bug: asking again
# would fail again, after sampling again.
NO_RETRY = {"x-should-retry": "false"}


def create_app(service: ChatService, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="agentrl", docs_url=None, redoc_url=None, openapi_url=None)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        chat = parse_request(await read_body(request, max_body_bytes))
        session_id = request.headers.get(SESSION_HEADER) or chat.user or None  # "": no session
        answer = await until_disconnected(request, service.complete(chat, session_id))
        if answer is None:
            return Response(status_code=CLIENT_GONE)
        if chat.stream:
            usage = bool(chat.stream_options and chat.stream_options.include_usage)
            return StreamingResponse(stream_chunks(answer, usage), media_type="text/event-stream")
        return JSONResponse(answer)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        asked = parse_responses_request(await read_body(request, max_body_bytes))
        chat = asked.chat_request()
        answer = await until_disconnected(request, service.complete(chat, request.headers.get(SESSION_HEADER)
                                                                    or chat.user or None))
        if answer is None:
            return Response(status_code=CLIENT_GONE)
        response = response_object(asked, answer)
        if asked.stream:
            return StreamingResponse(response_events(response), media_type="text/event-stream")
        return JSONResponse(response)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": service.settings.model_name, "object": "model", "created": 0, "owned_by": "agentrl"}]})

    @app.get("/agentrl/sessions/{session_id:path}")
    async def get_session(session_id: str) -> JSONResponse:
        session = service.sessions.get(session_id)
        if session is None:
            raise RequestError(f"no session '{session_id}'", 404, "not_found")
        return JSONResponse(session_json(session))

    @app.delete("/agentrl/sessions/{session_id:path}")
    async def delete_session(session_id: str) -> JSONResponse:
        session = await service.sessions.pop(session_id)
        if session is None:
            raise RequestError(f"no session '{session_id}'", 404, "not_found")
        return JSONResponse(session_json(session))

    @app.exception_handler(RequestError)
    async def refused(request: Request, e: RequestError) -> JSONResponse:
        if e.status >= 500:  # the server's fault: answered here, so nothing else would log its traceback
            log.error("%s %s: %s", request.method, request.url.path, e, exc_info=e.__cause__ or e)
        return JSONResponse(e.body(), status_code=e.status, headers=NO_RETRY if e.status >= 500 else None)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        code = "not_found" if e.status_code == 404 else "http_error"
        return JSONResponse(error_body(str(e.detail), code, e.status_code), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def crashed(_: Request, e: Exception) -> JSONResponse:
        # Starlette re-raises after answering, so the server logs the traceback
        message = f"internal error ({type(e).__name__}); see the server log"
        return JSONResponse(error_body(message, "internal_error", 500), status_code=500, headers=NO_RETRY)

    return app
