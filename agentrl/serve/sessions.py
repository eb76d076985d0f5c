"""What the endpoint records per session: token ids, loss mask and logprobs, in segments.

A session is every request carrying the same session id (the `X-Agentrl-Session` header, else the
request's `user` field). A request either continues one of the session's segments or starts a new
one:

- it continues a segment when its messages begin with exactly the messages recorded in it and its
  tool schemas are the segment's. Any kept segment may be continued, not only the latest: an agent
  that talks to the model in two conversations under one session (a planner and an executor, a
  sub-agent that summarises) alternates between them, and each goes on extending its own tokens.
  Where several match, the longest record wins (then the latest). "Exactly" is checked after
  normalisation (protocol.chat_messages): each of the client's own earlier messages as it sent it,
  and each assistant reply either as the endpoint returned it (OpenAI form: the text outside the
  calls, calls with JSON-string arguments) or as recorded (ChatRenderer.assistant_message). The
  messages after that prefix are appended as the chat template's suffix (ChatRenderer.suffix_ids on
  the recorded messages, as the builtin loop does), mask 0, and the sampled turn after them, mask 1
  — token-in/token-out across requests;
- anything else starts a new segment, rendered afresh from the request's messages: the client
  edited, dropped or reordered history, changed its tools, or branched from an earlier point.
  Each such request after the first counts as a history rewrite.

Each segment is a Trajectory, whose `append` keeps ids, mask and logprobs aligned, so within a
segment the mask-1 tokens are exactly the sampled ones. A session's trajectory (to_trajectory) is
the segment its last turn extended (kept last in `segments`): concatenating segments would train
later tokens on a context they were not sampled in (a flat causal sequence lets them attend to the
earlier segment), so the other segments are left out and their sampled tokens counted in
`dropped_generated_tokens`. A session keeps the records of its last `max_segments` segments only (a
client that starts a new conversation on every request under one `user` would otherwise grow it
without bound); older ones are forgotten, their counts kept.

This module does not sample, parse calls or speak HTTP: service.py plans a turn here, samples it,
and commits it here.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from itertools import islice
from dataclasses import dataclass, field
from typing import Any, Literal

from agentrl.rollout.chat import ChatRenderer
from agentrl.types import Completion, Finish, Trajectory

Message = dict[str, Any]


@dataclass
class Segment:
    """One run of requests whose tokens extend each other."""

    record: Trajectory  # token_ids, loss_mask, logprobs, messages (the recorded forms)
    tools: list[dict[str, Any]] | None  # the schemas it was rendered with
    echoes: list[set[str]] = field(default_factory=list)  # per recorded message: forms a client may send back
    turns: int = 0
    finish: Finish = "stop"  # of its last sampled turn
    last_exact: bool = True  # whether the last recorded reply renders back to its sample


@dataclass
class Session:
    id: str
    segments: list[Segment] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one request of a session at a time
    in_flight: int = 0  # requests holding or waiting for the lock (a woken waiter has not taken it yet)
    turns: int = 0
    template_fallbacks: int = 0
    parse_errors: int = 0
    # Agent episodes: the malformed call blocks of turns cut off by their budget, which (unlike a
    # finished turn's) are not counted in `parse_errors` when sampled; see agent.answered_twice.
    uncounted_errors: list[str] = field(default_factory=list)
    refused: Literal["max_turns", "length"] | None = None  # a limit refused a request after the last sampled turn
    max_segments: int = 8  # segments whose records are kept; older ones are forgotten
    forgotten_segments: int = 0
    forgotten_generated_tokens: int = 0
    seed: int | None = None  # an agent episode's: its turns sample with seeds derived from it

    def metrics(self) -> dict[str, float]:
        last = self.segments[-1] if self.segments else None
        segments = len(self.segments) + self.forgotten_segments
        dropped = sum(s.record.num_generated for s in self.segments[:-1]) + self.forgotten_generated_tokens
        return {"turns": float(last.turns if last else 0), "session_turns": float(self.turns),
                "segments": float(segments), "history_rewrites": float(max(segments - 1, 0)),
                "dropped_generated_tokens": float(dropped),
                "template_fallbacks": float(self.template_fallbacks), "parse_errors": float(self.parse_errors)}

    def start_segment(self, segment: Segment) -> None:
        self.segments.append(segment)
        while len(self.segments) > self.max_segments:
            forgotten = self.segments.pop(0)
            self.forgotten_segments += 1
            self.forgotten_generated_tokens += forgotten.record.num_generated

    def make_latest(self, segment: Segment) -> None:
        """`segment` was just extended: it becomes the session's trajectory, and the last forgotten."""
        # by identity: two segments may hold equal records (a branch that sampled the same reply)
        self.segments = [s for s in self.segments if s is not segment] + [segment]


@dataclass
class TurnPlan:
    """What one request samples after, before anything is recorded."""

    history: list[Message]  # the conversation the turn answers (recorded forms)
    prompt_ids: list[int]  # what the engine continues
    added_ids: list[int]  # appended with mask 0 before the sample
    new_messages: list[Message]
    tools: list[dict[str, Any]] | None
    segment: Segment | None  # the segment continued; None starts a new one
    fell_back: bool  # the suffix came from chat.py's fallback


def message_key(message: Message) -> str:
    """The parts of a message that decide its rendering, as one comparable string; arguments by
    value (`_by_value`), since a client that echoes a call may write its numbers its own way."""
    calls = [[c["function"]["name"], _by_value(c["function"]["arguments"])] for c in message.get("tool_calls") or []]
    return json.dumps([message["role"], message.get("content") or "", calls], sort_keys=True, ensure_ascii=False)


def _by_value(value: Any) -> Any:
    """Integral floats as ints, through dicts and lists: JavaScript's JSON.stringify writes the 1.0
    it parsed as 1 (and 1e5 as 100000), so a client in JavaScript or Go that echoes a call with
    `scale: 1.0` sends `scale: 1`, and comparing the text forked the session there, dropping every
    earlier turn from training. A continuation renders the recorded call, never the client's."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _by_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_by_value(v) for v in value]
    return value


def plan_turn(session: Session, renderer: ChatRenderer, messages: list[Message],
              tools: list[dict[str, Any]] | None) -> TurnPlan:
    """Continue the session's segment that `messages` extend (the longest, then the latest), else
    plan a new segment. `renderer` must render `tools`; the turn's reply is then interpreted with it."""
    continued = [(len(s.echoes), i, s) for i, s in enumerate(session.segments) if _continues(s, messages, tools)]
    if continued:
        segment = max(continued, key=lambda c: c[:2])[2]
        # equal schemas, but in the order first rendered, so the prefix renders as it did then
        renderer.schemas = segment.tools
        recorded = segment.record.messages
        new = messages[len(recorded):]
        added, fell_back = renderer.suffix_ids(segment.record.token_ids, recorded, new)
        return TurnPlan(recorded + new, segment.record.token_ids + added, added, new, segment.tools, segment,
                        fell_back)
    ids = renderer.prompt_ids(messages)
    return TurnPlan(list(messages), ids, ids, list(messages), tools, None, False)


def _continues(segment: Segment, messages: list[Message], tools: list[dict[str, Any]] | None) -> bool:
    return (segment.tools == tools and len(messages) >= len(segment.echoes)
            and all(message_key(m) in echo for m, echo in zip(messages, segment.echoes)))


def commit_turn(session: Session, plan: TurnPlan, completion: Completion, recorded: Message, reply: Message,
                exact: bool) -> Segment:
    """Record a sampled turn: the plan's added ids (mask 0), the sample (mask 1, its logprobs), the
    new messages and the recorded reply; `reply` is the reply as the client received it."""
    segment = plan.segment
    if segment is None:
        segment = Segment(Trajectory(task_id=session.id, group_id=session.id,
                                     weight_version=completion.weight_version), plan.tools)
        session.start_segment(segment)
    else:
        if plan.fell_back and segment.last_exact:  # counted once per turn, as the builtin loop does
            session.template_fallbacks += 1
        session.make_latest(segment)  # planned and committed under the session's lock: still kept
    record = segment.record
    record.append(plan.added_ids, trainable=False)
    record.append(completion.token_ids, trainable=True, logprobs=completion.logprobs)
    record.messages.extend(plan.new_messages + [recorded])
    segment.echoes.extend({message_key(m)} for m in plan.new_messages)
    segment.echoes.append({message_key(recorded), message_key(reply)})
    record.weight_version = min(record.weight_version, completion.weight_version)
    segment.turns += 1
    segment.finish = completion.finish
    segment.last_exact = exact
    session.turns += 1
    session.template_fallbacks += not exact
    session.refused = None  # a refusal the client recovered from did not end the episode
    return segment


def to_trajectory(session: Session, task_id: str, group_id: str) -> Trajectory:
    """The session as one trajectory: its last segment (see the module docstring), its metrics."""
    if not session.segments:
        return Trajectory(task_id=task_id, group_id=group_id, metrics=session.metrics())
    last = session.segments[-1].record
    return Trajectory(task_id=task_id, group_id=group_id, token_ids=list(last.token_ids),
                      loss_mask=list(last.loss_mask), logprobs=list(last.logprobs),
                      messages=[dict(m) for m in last.messages], finish=session.segments[-1].finish,
                      weight_version=last.weight_version, metrics=session.metrics())


def session_json(session: Session) -> dict[str, Any]:
    """Every segment a session keeps, for `GET /agentrl/sessions/{id}`."""
    segments = [{"token_ids": s.record.token_ids, "loss_mask": s.record.loss_mask, "logprobs": s.record.logprobs,
                 "messages": s.record.messages, "turns": s.turns, "finish": s.finish,
                 "weight_version": s.record.weight_version} for s in session.segments]
    return {"id": session.id, "segments": segments, "forgotten_segments": session.forgotten_segments,
            "metrics": session.metrics(), "refused": session.refused}


class SessionStore:
    """Sessions by id; beyond `max_sessions` the least recently used ones without a request in
    flight are forgotten (a request's turn is never lost to the store filling up meanwhile)."""

    def __init__(self, max_sessions: int = 10_000, max_segments: int = 8):
        self.max_sessions, self.max_segments = max_sessions, max_segments
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def get_or_create(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            session = self._sessions[session_id] = Session(session_id, max_segments=self.max_segments)
            excess = len(self._sessions) - self.max_sessions
            if excess > 0:  # the oldest first; sessions in flight stay (the store may exceed its size meanwhile)
                idle = (key for key, s in self._sessions.items() if s is not session and not s.in_flight)
                for key in list(islice(idle, excess)):
                    del self._sessions[key]
        self._sessions.move_to_end(session_id)
        return session

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def open(self, session_id: str) -> Session:
        """A new session under `session_id`: agent episodes open theirs before the agent runs and
        pop it when it ends, so the store holds only running episodes and evicts none of them (an
        episode whose session is idle while its tools run would otherwise lose its turns)."""
        session = self._sessions[session_id] = Session(session_id, max_segments=self.max_segments)
        return session

    async def pop(self, session_id: str) -> Session | None:
        """Remove a session at once (a request arriving from now on starts a new one with its id)
        and return it when the requests already holding it are recorded."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return None
        async with session.lock:  # FIFO: taken after every request that got this session before
            return session
