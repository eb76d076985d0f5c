"""One chat completion: a validated request → token ids → the engine → an OpenAI chat.completion.

The request's messages are rendered with the recipe's chat template and the request's own tool
schemas; the sampled turn is parsed with the recipe's parser into `content` (the text outside the
call blocks that parsed: a malformed block stays in it, so a client sees it and can answer it as the
builtin loop does) and `tool_calls` (OpenAI form, arguments as a JSON string). Beside a malformed
block, `content` is the whole turn as sampled where the template renders it verbatim (the Hermes
one does), so that the reply sent back renders as the turn the model sampled. With a session id the
turn is planned and recorded in sessions.py; without one it is served and forgotten.

`logprobs` carries each sampled token's text and its own bytes: in a byte-level BPE vocabulary a
token holding part of a UTF-8 character decodes to U+FFFD (as OpenAI's do), and its bytes are that
part, so the bytes of consecutive tokens join into the reply's UTF-8; so do a SentencePiece
vocabulary's, each token keeping its word's space; other vocabularies give the bytes of each
token's text (TokenBytes).

Sampling: the client's `temperature`, `top_p` and `max_tokens` apply, the recipe's values are the
defaults. With `fixed_sampling` (agent episodes for training) the recipe's temperature and top-p
always apply and `max_tokens` can only lower the recipe's per-turn budget, because the trainer
recomputes logprobs under the recipe's temperature. A turn never runs past `max_context_tokens`.

This module does not speak HTTP (app.py does) or run tools (the client does).
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Iterator

import jinja2

from agentrl.rollout.chat import (ChatRenderer, PromptTooLong, SpecialTextError, TemplateError, schema_special_text,
                                 stop_token_ids)
from agentrl.rollout.engine import Engine
from agentrl.serve.protocol import SESSION_HEADER, ChatRequest, RequestError, chat_messages
from agentrl.serve.sessions import Session, SessionStore, commit_turn, plan_turn
from agentrl.tools.parsers import ParsedTurn
from agentrl.types import Completion, SamplingParams, derive_seed


# The error code of a request refused at a limit, by the finish it gives an agent episode.
REFUSAL_CODES = {"max_turns": "session_turn_limit", "length": "context_length_exceeded"}


@dataclass
class ServeSettings:
    model_name: str = "policy"  # what /v1/models lists and responses name
    max_context_tokens: int = 2048
    max_new_tokens: int = 256  # a turn's budget when the request names none
    temperature: float = 1.0
    top_p: float = 1.0
    fixed_sampling: bool = False  # the recipe's sampling wins over the request's
    max_turns: int | None = None  # sampled turns per session; None: no limit
    max_sessions: int = 10_000
    max_segments: int = 8  # segments a session keeps the records of (sessions.py)
    open_sessions_only: bool = False  # a session id must have been opened (agent episodes); else any id starts one
    system_prompt: str | None = None  # the recipe's (agent episodes), rendered as written; not a client's


@contextmanager
def rendering_errors(session: Session | None, max_context_tokens: int) -> Iterator[None]:
    """A template that rejects the client's messages is the client's problem (400); one that cannot
    continue a conversation token by token is the recipe's (500). A conversation that is too long by
    its characters alone is refused as one too long by its tokens is (`_sampling`)."""
    try:
        yield
    except PromptTooLong as e:
        if session is not None:
            session.refused = "length"
        raise RequestError(f"the conversation is more than {max_context_tokens - 1} tokens ({e.chars} characters "
                           f"rendered), which leaves no room for a reply within max_context_tokens="
                           f"{max_context_tokens}", code=REFUSAL_CODES["length"]) from None
    except jinja2.TemplateError as e:
        raise RequestError(f"the chat template cannot render these messages: {e}") from None
    except SpecialTextError as e:  # in the client's messages
        raise RequestError(str(e)) from None
    except TemplateError as e:
        raise RequestError(str(e), 500, "template_error") from None


@dataclass
class SampledTurn:
    recorded: dict[str, Any]  # ChatRenderer.assistant_message: what renders back to the sample
    reply: dict[str, Any]  # what the client receives (calls with mapping arguments here)
    exact: bool  # `recorded` renders back to exactly the sample
    parse_errors: int  # malformed call blocks, left in the reply's text


class ChatService:
    """Answers chat completion requests from one engine, recording sessions."""

    def __init__(self, engine: Engine, tokenizer: Any, parser: Callable[[str], ParsedTurn], settings: ServeSettings):
        self.engine = engine
        self.tokenizer = tokenizer
        self.parser = parser
        self.settings = settings
        self.sessions = SessionStore(settings.max_sessions, settings.max_segments)
        self.stop_ids = stop_token_ids(tokenizer)

    def renderer(self, tools: list[dict[str, Any]] | None) -> ChatRenderer:
        renderer = ChatRenderer(self.tokenizer, [])
        renderer.schemas = tools  # the request's schemas, exactly as sent, are what the template shows
        # Agent episodes: the recipe's system prompt renders as the builtin loop renders it. Any
        # other system message is the client's text, kept as text.
        renderer.system_prompt = self.settings.system_prompt
        renderer.max_tokens = self.settings.max_context_tokens - 1  # a prompt that leaves room for one token
        problem = schema_special_text(tools, renderer.special_texts)
        if problem:
            raise RequestError(f"tools: {problem}")
        return renderer

    async def complete(self, request: ChatRequest, session_id: str | None) -> dict[str, Any]:
        messages, tools = chat_messages(request.messages), request.tools or None
        renderer = self.renderer(tools)
        if session_id is None and self.settings.open_sessions_only:
            # An agent's second client without the episode's header (a planner, a summariser):
            # answered, its turns would shape the episode without being in its trajectory.
            raise RequestError(f"no session: during an episode every request carries the {SESSION_HEADER} header "
                               "(ctx.openai_client() sends it; other clients take ctx.headers)",
                               code="session_required")
        if session_id is None:
            with rendering_errors(None, self.settings.max_context_tokens):
                ids = renderer.prompt_ids(messages)
            completion = await self._generate(ids, self._sampling(request, len(ids), None))
            turn = self._interpret(renderer, messages, completion)
            return self._response(request, turn.reply, completion, len(ids), renderer)
        if self.settings.open_sessions_only:
            session = self.sessions.get(session_id)
            if session is None:
                raise RequestError(f"session '{session_id}' is not open: its episode has ended (or never began)",
                                   code="session_closed")
        else:
            session = self.sessions.get_or_create(session_id)
        session.in_flight += 1
        try:
            return await self._complete_in(session, session_id, request, renderer, messages, tools)
        finally:
            session.in_flight -= 1

    async def _complete_in(self, session: Session, session_id: str, request: ChatRequest, renderer: ChatRenderer,
                           messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        async with session.lock:
            if self.settings.max_turns is not None and session.turns >= self.settings.max_turns:
                session.refused = "max_turns"
                raise RequestError(f"session '{session_id}' has used its {self.settings.max_turns} turns "
                                   f"(rollout.max_turns)", code=REFUSAL_CODES["max_turns"])
            with rendering_errors(session, self.settings.max_context_tokens):
                plan = plan_turn(session, renderer, messages, tools)
            completion = await self._generate(plan.prompt_ids, self._sampling(request, len(plan.prompt_ids), session))
            turn = self._interpret(renderer, plan.history, completion)
            commit_turn(session, plan, completion, turn.recorded, turn.reply, turn.exact)
            session.parse_errors += turn.parse_errors
            if completion.finish != "stop" and self.settings.open_sessions_only:  # agent episodes (agent.py)
                session.uncounted_errors += self.parser(turn.reply["content"]).errors
        return self._response(request, turn.reply, completion, len(plan.prompt_ids), renderer)

    def _sampling(self, request: ChatRequest, prompt_len: int, session: Session | None) -> SamplingParams:
        s = self.settings
        room = s.max_context_tokens - prompt_len
        if room <= 0:
            if session is not None:
                session.refused = "length"
            raise RequestError(f"the conversation is {prompt_len} tokens, which leaves no room for a reply within "
                               f"max_context_tokens={s.max_context_tokens}", code=REFUSAL_CODES["length"])
        asked = request.max_new_tokens
        if s.fixed_sampling:
            budget, temperature, top_p = min(asked or s.max_new_tokens, s.max_new_tokens), s.temperature, s.top_p
        else:
            budget = asked or s.max_new_tokens
            temperature = s.temperature if request.temperature is None else request.temperature
            top_p = s.top_p if request.top_p is None else request.top_p
        if session is not None and session.seed is not None:
            seed = derive_seed(session.seed, session.turns)
        else:  # a group's episodes must not share one stream: under fixed sampling the request's is not taken
            seed = None if s.fixed_sampling or request.seed is None else request.seed % 2**64
        return SamplingParams(min(budget, room), temperature, top_p, self.stop_ids, seed)

    async def _generate(self, ids: list[int], sampling: SamplingParams) -> Completion:
        try:
            completion = await self.engine.generate(ids, sampling)
        except Exception as e:  # the message reaches the client; the server log keeps the traceback
            raise RequestError(f"generation failed: {type(e).__name__}: {e}", status=500, code="engine_error") from e
        # Before the turn is recorded: JSON has no NaN or infinity (the answer would be a 500, or
        # an invalid stream chunk, for a turn the session already held), nor would training want it.
        bad = next((i for i, lp in enumerate(completion.logprobs) if not math.isfinite(lp)), None)
        if bad is not None:
            raise RequestError(f"generation failed: the engine gave sampled token {bad} the logprob "
                               f"{completion.logprobs[bad]} (a diverged model?)", status=500, code="engine_error")
        return completion

    def _interpret(self, renderer: ChatRenderer, history: list[dict[str, Any]], completion: Completion) -> SampledTurn:
        """A sampled turn as recorded and as replied; one cut off by its budget carries no calls."""
        stopped = completion.finish == "stop"
        text = renderer.decode(completion.token_ids[:-1] if stopped else completion.token_ids)
        if not stopped:  # recorded as the episode loop records it: marked, so no grader takes it for an answer
            return SampledTurn({"role": "assistant", "content": text, "truncated": True},
                               {"role": "assistant", "content": text}, True, 0)
        parsed = self.parser(text)
        recorded, exact = renderer.assistant_message(history, text, parsed, completion.token_ids)
        if not parsed.calls:
            return SampledTurn(recorded, {"role": "assistant", "content": text}, exact, len(parsed.errors))
        calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                  "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]
        # Beside a malformed block the valid calls stay in the text too, when the template renders
        # that text verbatim (hermes_chatml.jinja then skips `tool_calls`): a client sending the
        # reply back without a session, or rewriting history, would otherwise render the turn
        # without its valid calls, and the model would see results for calls it never made.
        content = text if parsed.errors and recorded["content"] == text else parsed.content or None
        reply = {"role": "assistant", "content": content, "tool_calls": calls}
        return SampledTurn(recorded, reply, exact, len(parsed.errors))

    def _response(self, request: ChatRequest, reply: dict[str, Any], completion: Completion, prompt_len: int,
                  renderer: ChatRenderer) -> dict[str, Any]:
        calls = reply.get("tool_calls")
        message: dict[str, Any] = {"role": "assistant", "content": reply["content"]}
        if calls:
            message["tool_calls"] = [{**c, "function": {"name": c["function"]["name"], "arguments": json.dumps(
                c["function"]["arguments"], ensure_ascii=False)}} for c in calls]
        finish = "length" if completion.finish == "length" else "tool_calls" if calls else "stop"
        n = len(completion.token_ids)
        choice = {"index": 0, "message": message, "finish_reason": finish,
                  "logprobs": self._logprobs(renderer, completion) if request.logprobs else None}
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.settings.model_name, "choices": [choice],
                "usage": {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}}

    def _logprobs(self, renderer: ChatRenderer, completion: Completion) -> dict[str, Any]:
        tokens = [self._token_bytes.text(i, renderer.decode([i])) for i in completion.token_ids]
        return {"content": [{"token": t, "logprob": lp, "bytes": list(self._token_bytes(i, t)), "top_logprobs": []}
                            for i, t, lp in zip(completion.token_ids, tokens, completion.logprobs)]}

    @cached_property
    def _token_bytes(self) -> TokenBytes:
        return TokenBytes(self.tokenizer)  # reads the whole vocabulary once, at the first `logprobs` request


class TokenBytes:
    """A token's own text and bytes. In a byte-level BPE vocabulary: its spelling read back with
    GPT-2's alphabet. In a SentencePiece one (`▁` for a space, `<0xC3>` for a byte the vocabulary
    spells no other way: Llama 2's, Mistral's, Gemma's): its piece, a word's leading space kept
    (decoded alone, every word lost it, so the tokens no longer spelled the reply; the reply's very
    first space, which its decoding drops, stays on its token) and a fallback byte as itself, its
    text U+FFFD past ASCII. For an added token (`<|im_end|>`), and in other vocabularies, the
    token decoded alone and its UTF-8."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.added = set(getattr(tokenizer, "added_tokens_decoder", {}))
        alphabet = byte_level_alphabet()
        spelled = "".join(piece for piece, i in tokenizer.get_vocab().items() if i not in self.added)
        self.alphabet = alphabet if spelled and set(spelled) <= alphabet.keys() else None
        self.sentencepiece = self.alphabet is None and "▁" in spelled

    def _piece(self, token_id: int) -> str | None:
        """The SentencePiece piece of `token_id`, or None where its decoded text is what counts."""
        if not self.sentencepiece or token_id in self.added:
            return None
        return self.tokenizer.convert_ids_to_tokens(token_id) or None  # None past the vocabulary

    def text(self, token_id: int, decoded: str) -> str:
        piece = self._piece(token_id)
        if piece is None:
            return decoded
        byte = _FALLBACK_BYTE.fullmatch(piece)
        if byte:
            value = int(byte.group(1), 16)
            return chr(value) if value < 0x80 else "\ufffd"
        return piece.replace("▁", " ")

    def __call__(self, token_id: int, text: str) -> bytes:
        if self.alphabet is not None and token_id not in self.added:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)  # None past the vocabulary
            return bytes(self.alphabet[c] for c in piece) if piece else text.encode()
        byte = _FALLBACK_BYTE.fullmatch(self._piece(token_id) or "")
        return bytes([int(byte.group(1), 16)]) if byte else text.encode()


_FALLBACK_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's map from the characters byte-level BPE vocabularies are spelled in to the bytes
    they stand for: printable bytes stand for themselves, the other 68 (space, control bytes, ...)
    for chr(256), chr(257), ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}
