"""Chat-template rendering for token-in/token-out episodes: prompts, recorded assistant turns, and
the tokens a list of new (tool or user) messages adds after what was sampled.

The invariant it maintains: rendering the recorded messages reproduces the token text sampled so
far, so the next suffix is the plain difference of two renderings. Two kinds of template need
care:
- templates that render an assistant message's `content` and then its `tool_calls` again (Qwen2.5's
  shape): the recorded message holds the text outside the call blocks as `content` and the calls
  as `tool_calls`, whichever of the candidate forms renders back to the sampled text;
- templates that re-render history differently from what was sampled (a call written in another
  JSON spacing, reasoning dropped from earlier turns): no recorded form reproduces the sample, so
  the suffix is taken from a fixed two-message base conversation instead (`used_fallback`). The ids
  are still exactly what was sampled plus the template's rendering of the new messages; only a
  re-rendering of the whole conversation differs from them, in the assistant turns.

This module does not sample, run tools or train.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import weakref
from typing import Any, Callable

import jinja2

from agentrl.tools.base import Tool
from agentrl.tools.parsers import ParsedTurn, strict_json

# Private-use characters, one of which marks where a literal content goes in a second rendering:
# the first that the rendering does not already hold (a client may send any character).
_MARKS = [chr(c) for c in range(0xF8FF0, 0xF9000)]
_FALLBACK_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


_plain_text: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_plain_text_lock = threading.Lock()


def plain_text_tokenizer(tokenizer: Any) -> Any:
    """A copy of `tokenizer` for `split_special_tokens=True` calls only, made once per tokenizer.

    transformers applies that argument by setting a flag on the Rust tokenizer behind the call,
    shared by every thread that uses the same tokenizer: with an endpoint's requests (or an
    agent's tools) encoding on other threads, a prompt could be encoded with its control tokens
    spelt out as text, or a tool's output with its special text turned into control tokens. The
    copy only ever has the flag on; the tokenizer itself only ever has it off."""
    with _plain_text_lock:
        plain = _plain_text.get(tokenizer)
        if plain is None:
            plain = _plain_text[tokenizer] = copy.deepcopy(tokenizer)
        return plain


_token_chars: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token stands for: the longest token string in the vocabulary (a
    byte-level token's string has a character per byte, so never fewer than its text has), times 2
    for normalisers that compose several characters into one. Computed once per tokenizer."""
    chars = _token_chars.get(tokenizer)
    if chars is None:
        tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        chars = _token_chars[tokenizer] = 2 * max(len(t) for t in tokens if isinstance(t, str))
    return chars


class PromptTooLong(ValueError):
    """A rendering that is more than `limit` tokens, known from its length alone: encoding megabytes
    of text takes seconds, and an endpoint encodes on the event loop every session shares."""

    def __init__(self, chars: int, limit: int):
        super().__init__(f"{chars} characters, more than {limit} tokens")
        self.chars, self.limit = chars, limit


class TemplateError(RuntimeError):
    """The chat template cannot continue this conversation token by token."""


class SpecialTextError(TemplateError):
    """A message holds a special token's text where it cannot be kept as text."""


class ChatRenderer:
    """Chat-template rendering to token ids, and the suffix a list of new messages adds."""

    def __init__(self, tokenizer: Any, tools: list[Tool]):
        self.tokenizer = tokenizer
        self.schemas = [t.schema for t in tools] or None
        added = getattr(tokenizer, "added_tokens_decoder", {}).values()
        # sorted: an error names the same token in every process (a set's order follows the hash seed)
        self.special_texts = sorted({t for t in tokenizer.all_special_tokens if t} | {t.content for t in added
                                                                                     if t.special})
        turn_end = template_turn_end(tokenizer)  # probed once: the stop ids and the fallback's turn end
        self.stop_ids = _stop_ids(tokenizer, turn_end)
        self.turn_end_id = tokenizer.eos_token_id if turn_end is None else turn_end
        # The recipe's system prompt is the one message rendered as written; any other system
        # message (a task file's, a client's) is data, kept as text like every other message's.
        self.system_prompt: str | None = None
        # Set by the endpoint: a prompt longer than this many tokens is refused before it is encoded
        # when its length in characters already shows it (PromptTooLong).
        self.max_tokens: int | None = None
        problem = schema_special_text(self.schemas, self.special_texts)
        if problem:
            raise SpecialTextError(problem)

    def render_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.schemas, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_text(self, text: str) -> list[int]:
        """Ids of a message's own text, special token text included, as plain text."""
        return plain_text_tokenizer(self.tokenizer)(text, add_special_tokens=False,
                                                    split_special_tokens=True)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def encode_rendered(self, text: str, messages: list[dict[str, Any]],
                        remake: Callable[[list[dict[str, Any]]], str], limit: int | None = None) -> list[int]:
        """Ids of `text`, a rendering that holds `messages`, in which the messages' own text can
        never become control tokens: a tool's output or a task's prompt that contains the string
        `<|im_end|>` would otherwise end its turn and open a turn the policy never wrote. Such a
        content is encoded as plain text (what OpenAI's API does with user text); everything else,
        as the whole rendering, so ids stay those of `encode(text)` whenever no content holds a
        special token's text. Only the recipe's system prompt (`system_prompt`) is rendered as
        written; a system message from a task file or a client is data like the rest.

        Where each such content sits is found by rendering again (`remake` makes `text` from other
        messages) with a marker in its place, never by searching for the content, which could match
        the template's own tokens first (a prompt that is just `<|im_start|>`).

        With a `limit`, a text too long to be `limit` tokens or fewer, by its length in characters,
        raises PromptTooLong having encoded only its first `limit` tokens' worth of characters."""
        if limit is not None:
            self._check_length(text, limit)
        for m in messages:
            # Arguments render inside the template's own call markup, where no marker can stand in
            # for them: special text there would be encoded as control tokens, so it is refused.
            calls = json.dumps(m["tool_calls"], ensure_ascii=False) if m.get("tool_calls") else ""
            found = next((s for s in self.special_texts if s in calls), None)
            if found:
                raise SpecialTextError(f"a tool call's arguments contain the special token text {found!r}, which "
                                       "would become a control token")
        special = {id(m) for m in messages if isinstance(m.get("content"), str)
                   and not (m.get("role") == "system" and m["content"] == self.system_prompt)
                   and any(t in m["content"] for t in self.special_texts)}
        if not special:
            return self.encode(text)
        mark = next((m for m in _MARKS if m not in text), None)
        if mark is None:
            raise SpecialTextError("a message contains a special token's text, and every marker character that "
                                   "would keep it as text occurs in the conversation")
        # The whole content in one marker's place first; where the template reads the content and
        # renders a marker otherwise (the Hermes template shows a turn's calls unless its content
        # holds their blocks), only the special text in it.
        for whole in (True, False):
            ids = self._encode_marked(text, messages, special, remake, mark, whole)
            if ids is not None:
                return ids
        raise TemplateError("a message contains a special token's text and the chat template does not render "
                            "it verbatim, so it cannot be kept as text")

    def _encode_marked(self, text: str, messages: list[dict[str, Any]], special: set[int],
                       remake: Callable[[list[dict[str, Any]]], str], mark: str, whole: bool) -> list[int] | None:
        """Ids of `text` with the literals encoded as plain text, or None where the rendering with
        markers in their places does not give `text` back with the literals put in again."""
        marked, literals = [], []
        longest_first = sorted(self.special_texts, key=len, reverse=True)
        special_text = re.compile("(" + "|".join(re.escape(t) for t in longest_first) + ")")
        for message in messages:
            if id(message) in special:
                # [text, special text, text, ...]; or the whole content as the one literal
                parts = [message["content"]] if whole else special_text.split(message["content"])
                content = ""
                for i, part in enumerate(parts):
                    if whole or i % 2:
                        literals.append(part)
                        content += f"{mark}{len(literals) - 1}{mark}"
                    else:
                        content += part
                message = {**message, "content": content}
            marked.append(message)
        pieces = remake(marked).split(mark)  # text, index, text, index, ..., text
        indices = pieces[1::2]
        if indices != [str(i) for i in range(len(literals))] or \
                "".join(p if i % 2 == 0 else literals[i // 2] for i, p in enumerate(pieces)) != text:
            return None
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            ids += self.encode_text(literals[i // 2]) if i % 2 else self.encode(piece)
        return ids

    def _check_length(self, text: str, limit: int) -> None:
        """PromptTooLong for a text longer than `limit` tokens of the longest token's characters
        whose first such characters alone are over twice `limit` tokens. The second test is for
        tokenizers where a token takes in more than its own characters (an added token that strips
        the whitespace after it): text within its bound by the first is encoded whole instead."""
        chars = max(limit, 0) * max_token_chars(self.tokenizer)
        if len(text) > chars and len(self.encode(text[:max(chars, 1)])) > 2 * limit:
            raise PromptTooLong(len(text), limit)

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode_rendered(self.render_text(messages, add_generation_prompt=True), messages,
                                    lambda marked: self.render_text(marked, add_generation_prompt=True),
                                    self.max_tokens)

    def assistant_message(self, history: list[dict[str, Any]], text: str, parsed: ParsedTurn,
                          turn_ids: list[int]) -> tuple[dict[str, Any], bool]:
        """The message recording a sampled turn, and whether it renders back to exactly the sample.

        `turn_ids` are the turn's sampled ids, its end-of-turn token included; the check is local
        to this turn (after `history` as the template renders it), so a divergence in an earlier
        turn is not counted again. Candidates, first match wins: the sampled text with structured `tool_calls` beside it (the
        project's Hermes template renders such content verbatim); the text outside the call blocks
        with `tool_calls` (templates that render calls themselves); the text alone.
        """
        calls = [c.as_message_field() for c in parsed.calls]
        candidates = [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]
        if calls:
            candidates += [{"role": "assistant", "content": parsed.content, "tool_calls": calls},
                           {"role": "assistant", "content": text}]
        sampled = self.render_text(history, add_generation_prompt=True) + self.decode(turn_ids)
        for candidate in candidates:
            try:
                rendered = self.render_text(history + [candidate], add_generation_prompt=False)
            except jinja2.TemplateError:  # a template that refuses the reply here (roles must alternate)
                continue
            if rendered.startswith(sampled):
                return candidate, True
        return candidates[0], False

    def suffix_ids(self, current_ids: list[int], history: list[dict[str, Any]],
                   new: list[dict[str, Any]]) -> tuple[list[int], bool]:
        """Ids that continue `current_ids` with `new` messages and the next generation prompt.

        Returns (ids, used_fallback). The fallback, for templates that re-render history
        differently from what was sampled, diffs a fixed two-message base instead.
        """
        current = self.decode(current_ids)
        full = self.render_text(history + new, add_generation_prompt=True)
        limit = None if self.max_tokens is None else self.max_tokens - len(current_ids)
        if full.startswith(current):
            return self.encode_rendered(full[len(current):], new, lambda marked: self.render_text(
                history + marked, add_generation_prompt=True)[len(current):], limit), False
        base = self.render_text(_FALLBACK_BASE, add_generation_prompt=False)
        extended = self.render_text(_FALLBACK_BASE + new, add_generation_prompt=True)
        # What the template puts after a turn's end token (a newline, for ChatML) is not sampled:
        # it is the start of the suffix. The end token is the one the turn stopped on, which need
        # not be the tokenizer's eos (Qwen's base models: eos <|endoftext|>, turns end <|im_end|>).
        stopped_on = current_ids[-1:] if current_ids and current_ids[-1] in self.tokenizer.all_special_ids else []
        ended = self.decode(stopped_on)
        if extended.startswith(base):
            end = ended if ended and ended in base else (self.tokenizer.eos_token or "")
            boundary = base[base.rfind(end) + len(end):] if end and end in base else ""
            start = len(base)
        else:
            # The base's assistant turn renders otherwise as the last message than once messages
            # follow it (reasoning templates give the last one a think block, empty or not): the
            # suffix starts after that turn's end token as `extended` renders it.
            boundary, start = "", self._after_base_reply(extended, ended)
        return self.encode_rendered(boundary + extended[start:], new, lambda marked: boundary + self.render_text(
            _FALLBACK_BASE + marked, add_generation_prompt=True)[start:], limit), True

    def _after_base_reply(self, extended: str, ended: str) -> int:
        """Where, in a rendering of the fallback base followed by messages, the text after the base
        assistant turn's end token starts; TemplateError where that turn cannot be found."""
        head = self.render_text(_FALLBACK_BASE[:1], add_generation_prompt=False)
        reply = extended.find(_FALLBACK_BASE[1]["content"], len(head)) if extended.startswith(head) else -1
        for end in dict.fromkeys(e for e in (ended, self.tokenizer.eos_token) if e):
            at = extended.find(end, reply) if reply >= 0 else -1
            if at >= 0:
                return at + len(end)
        raise TemplateError("the chat template renders a finished assistant turn, once messages follow it, without "
                            "the end-of-turn token it stopped on, so no suffix for the new messages can be derived")

    def assistant_turn_ids(self, history: list[dict[str, Any]], message: dict[str, Any]) -> tuple[list[int], bool]:
        """Ids a policy would sample for a given assistant message (content, tool calls, end-of-turn
        token), as the template renders it after `history`; (ids, used_fallback).

        OpenAI-style messages (`content: null`, `tool_calls` with JSON-string arguments) render like
        any other. The fallback, for templates whose rendering of `history` is not a prefix, is the
        content followed by each call in the Hermes format the parser reads, then the template's
        end-of-turn token (eos where the template shows none).
        """
        message = normalize_tool_calls(message)
        prompt = self.render_text(history, add_generation_prompt=True)
        full = self.render_text(history + [message], add_generation_prompt=False)
        if full.startswith(prompt):
            # The turn ends with the first token that stops sampling (the template's end of turn,
            # which need not be eos: Qwen's base models), where sampling would have stopped; what a
            # template adds after it (Phi-3's eos after the last message) is not the policy's. The
            # message's own text is kept as text (encode_rendered), so a literal `<|im_end|>` in it
            # cannot end the turn early.
            ids = self.encode_rendered(full[len(prompt):], [message], lambda marked: self.render_text(
                history + marked, add_generation_prompt=False)[len(prompt):])
            ends = [i for i, token in enumerate(ids) if token in self.stop_ids]
            if ends:
                return ids[: ends[0] + 1], False
        content = message.get("content") or ""
        calls = ["<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                              ensure_ascii=False) + "\n</tool_call>"
                 for c in message.get("tool_calls") or []]
        # As on the template's path: a special token's text stays text in the content, and is refused
        # in a call, where it would be encoded as the control token (a `<|im_end|>` there ended
        # the trained turn early).
        found = next((t for t in self.special_texts if any(t in call for call in calls)), None)
        if found:
            raise SpecialTextError(f"a tool call's arguments contain the special token text {found!r}, which "
                                   "would become a control token")
        if any(t in content for t in self.special_texts):
            rest = "".join("\n" + call for call in calls)
            return self.encode_text(content) + (self.encode(rest) if rest else []) + [self.turn_end_id], True
        return self.encode("\n".join(p for p in [content, *calls] if p)) + [self.turn_end_id], True

    def truncate(self, text: str, max_tokens: int, what: str = "output") -> tuple[str, bool]:
        """Text cut to `max_tokens` tokens with a marker saying so (`what` was cut: a tool's output,
        a simulated user's reply); (text, was_cut)."""
        # Only a head of the text is tokenised, so a huge tool output costs little: 16 characters a
        # token, more while the head holds no more than max_tokens tokens (runs like '#' * 80 are
        # one token) and the text goes on.
        # Counted as the text will be encoded (encode_rendered): a special token's text, kept as
        # text, is several tokens, not the one control token a plain encode() would count.
        size = max_tokens * 16
        while True:
            head = text[:size]
            ids = self.encode_text(head)
            if len(ids) > max_tokens or len(head) == len(text):
                break
            size *= 2
        if len(ids) <= max_tokens:
            return text, False
        cut = max_tokens
        kept = self.decode(ids[:cut])
        # A byte-level token may hold part of a character (an emoji, a CJK character): cut there,
        # it decodes to U+FFFD, which the text did not have. Up to 3 tokens back keeps it whole.
        while kept.endswith("\ufffd") and cut > max(0, max_tokens - 3) and not head.startswith(kept):
            cut -= 1
            kept = self.decode(ids[:cut])
        return f"{kept}\n[{what} truncated to {max_tokens} tokens]", True


def schema_special_text(schemas: list[dict[str, Any]] | None, special_texts: list[str]) -> str | None:
    """What is wrong with tool schemas that spell a special token's text, or None. Schemas render
    inside the template's own markup, where that text would become a control token: a description
    fetched from an MCP or tool server could end the system turn and open one of its own."""
    for schema in schemas or []:
        text = json.dumps(schema, ensure_ascii=False)
        found = next((t for t in special_texts if t in text), None)
        if found:
            name = (schema.get("function") or {}).get("name") if isinstance(schema, dict) else None
            return (f"the schema of the tool {name!r} contains the special token text {found!r}, which the chat "
                    "template would render as a control token")
    return None


def normalize_tool_calls(message: dict[str, Any]) -> dict[str, Any]:
    """A copy of an assistant message whose tool calls are `{type, function: {name, arguments}}`
    with `arguments` a mapping: OpenAI sends them as a JSON string, which templates would quote
    again. Arguments that are not strict JSON (strict_json: no NaN, no lone surrogate) are kept as
    the string; nesting beyond the recursion limit raises RecursionError."""
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)
    normalized = []
    for call in calls:
        fn = dict(call.get("function", call))
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = strict_json(fn["arguments"])
            except ValueError:  # NaN would reach a session's record, which JSON cannot hold
                pass
        kept = {"id": call["id"]} if isinstance(call, dict) and "id" in call else {}  # templates may render ids
        normalized.append({**kept, "type": "function",
                           "function": {"name": fn.get("name"), "arguments": fn.get("arguments", {})}})
    return {**message, "tool_calls": normalized}


def stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids that end an assistant turn: the special token the chat template closes an assistant
    turn with (ChatML's <|im_end|>, Llama 3's <|eot_id|>, Gemma's <end_of_turn>), the tokenizer's
    end of sequence, and <|im_end|> where the vocabulary has it."""
    return _stop_ids(tokenizer, template_turn_end(tokenizer))


def _stop_ids(tokenizer: Any, turn_end: int | None) -> tuple[int, ...]:
    ids = {tokenizer.eos_token_id, turn_end}
    if "<|im_end|>" in tokenizer.get_vocab():  # not convert_tokens_to_ids: that maps a missing token to <unk>
        ids.add(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return tuple(sorted(i for i in ids if i is not None))


def template_turn_end(tokenizer: Any) -> int | None:
    """The special token the chat template puts right after an assistant message's text; None when
    it puts none there, has no template, or refuses the probe (one that demands a system turn)."""
    turn = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    try:
        text = tokenizer.apply_chat_template(turn, tokenize=False) if getattr(tokenizer, "chat_template", None) else ""
    except Exception:
        return None
    after = tokenizer(text[text.rfind("y") + 1:], add_special_tokens=False)["input_ids"][:1] if text else []
    return after[0] if after and after[0] in tokenizer.all_special_ids else None
