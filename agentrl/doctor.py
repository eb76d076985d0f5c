"""`agentrl doctor --model M`: is this chat template fit for token-exact multi-turn tool training?

Five checks, on CPU with the tokenizer only (no weights), on a small conversation with a tool call,
a tool result, a second user turn and a final answer, rendered exactly as the rollout loop and SFT
render it (`ChatRenderer`, `conversation_sample`), the call turn recorded as the rollout loop records it:

- tools: every tool's name and description appear in the rendered prompt;
- prefix: the prompt holds the system and first user messages' content, each appended turn leaves
  the earlier rendering unchanged (the generation prompt aside), and a tool or user turn adds text
  holding its content (a template that writes its own fixed system prompt would drop the recipe's);
- tool-call: a structured tool call, rendered and read back with the recipe's parser, is the same call;
- loss-mask: the trained tokens decode to exactly each assistant turn's content and end-of-turn token,
  which is also how the template renders that turn;
- stop: the end-of-turn tokens are single tokens and the rendered assistant turn ends with one.

The end of a turn is the chat template's end-of-turn token, which need not be eos (Qwen2.5 and Llama 3
base models, Gemma), and the stop tokens are the ones the rollout loop stops on; both come from
`agentrl.rollout.chat`, so the doctor judges a template by what training and rollouts will really do.

It reports one PASS/FAIL line per check and never changes the template; fixing one is up to the user.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from agentrl.errors import ConfigError
from agentrl.rollout.chat import ChatRenderer, SpecialTextError
from agentrl.tools.base import Tool
from agentrl.tools.parsers import ParsedTurn, get_parser
from agentrl.types import ToolCall

# How a model writes a call in each parser's format (what the rollout loop would have sampled).
CALL_TEXT: dict[str, Callable[[ToolCall], str]] = {
    "hermes": lambda call: f"<tool_call>\n{json.dumps({'name': call.name, 'arguments': call.arguments})}\n</tool_call>",
}
_SAMPLE_VALUES = {"string": "12 * 34", "integer": 3, "number": 2.5, "boolean": True, "array": [], "object": {}}


@dataclass
class Check:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} {self.name}: {self.detail}"


def sample_call(tool: Tool) -> ToolCall:
    """A call of `tool` with a plausible value for each declared parameter."""
    fn = tool.schema["function"]
    properties = fn.get("parameters", {}).get("properties", {})
    return ToolCall(fn["name"], {key: _sample_value(spec.get("type")) for key, spec in properties.items()})


def _sample_value(kind: Any) -> Any:
    """A value of JSON-Schema type `kind`; of its first non-null type where it is a list such as
    `["string", "null"]` (OpenAI strict mode and MCP servers write optional parameters that way)."""
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return _SAMPLE_VALUES.get(kind, "x") if isinstance(kind, str) else "x"


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


class Doctor:
    """The checks over one tokenizer (with its chat template), tool list and parser."""

    def __init__(self, tokenizer: Any, tools: list[Tool], parser: str):
        if parser not in CALL_TEXT:
            raise ConfigError(f"--parser: unknown parser '{parser}' (known: {', '.join(CALL_TEXT)})")
        self.tokenizer, self.tools = tokenizer, tools
        self.parse: Callable[[str], ParsedTurn] = get_parser(parser)
        try:
            self.renderer = ChatRenderer(tokenizer, tools)
        except SpecialTextError as e:  # a schema the template would render with control tokens in it
            raise ConfigError(str(e)) from None
        self.call = sample_call(tools[0])
        opening = [{"role": "system", "content": "You are a careful assistant."},
                   {"role": "user", "content": "What is 12 * 34?"}]
        call_text = CALL_TEXT[parser](self.call)
        self.conversation = opening + [
            self.recorded_call_turn(opening, call_text),
            {"role": "tool", "name": self.call.name, "content": "408"},
            {"role": "user", "content": "Thanks. Say it in words."},
            {"role": "assistant", "content": "Four hundred and eight."},
        ]
        # What the model sampled in each assistant turn, which is what training must see.
        self.sampled = {2: call_text, 5: self.conversation[5]["content"]}

    def recorded_call_turn(self, history: list[dict[str, Any]], text: str) -> dict[str, Any]:
        """The call turn as the rollout loop records it after sampling `text`: the form that renders
        back to the sample (Qwen2.5's shape keeps only the text outside the call blocks as content)."""
        fallback = {"role": "assistant", "content": text, "tool_calls": [self.call.as_message_field()]}
        end = self.renderer.turn_end_id
        try:
            message, _ = self.renderer.assistant_message(history, text, self.parse(text),
                                                         self.renderer.encode(text) + ([end] if end is not None else []))
        except Exception:  # the checks report what is wrong with such a template
            return fallback
        return message

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        return self.renderer.render_text(messages, add_generation_prompt=generation_prompt)

    def run(self) -> list[Check]:
        checks = []
        for name, method in (("tools", self.check_tools), ("prefix", self.check_prefix),
                             ("tool-call", self.check_tool_call), ("loss-mask", self.check_loss_mask),
                             ("stop", self.check_stop)):
            try:
                ok, detail = method()
            except Exception as e:  # a template that raises is a failed check, not a crash
                ok, detail = False, f"rendering failed: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
            checks.append(Check(name, ok, detail))
        return checks

    def check_tools(self) -> tuple[bool, str]:
        prompt = self.render(self.conversation[:2], generation_prompt=True)
        for tool in self.tools:
            fn = tool.schema["function"]
            if fn["name"] not in prompt:
                return False, f"the rendered prompt does not mention tool '{fn['name']}' (does the template use `tools`?)"
            description = fn.get("description") or ""
            if description not in prompt and json.dumps(description)[1:-1] not in prompt:
                return False, f"the description of tool '{fn['name']}' is not in the rendered prompt"
        names = ", ".join(t.schema["function"]["name"] for t in self.tools)
        return True, (f"{names} appear in the prompt with their descriptions" if len(self.tools) > 1
                      else f"{names} appears in the prompt with its description")

    def check_prefix(self) -> tuple[bool, str]:
        prompt = self.render(self.conversation[:2], generation_prompt=True)
        for message in self.conversation[:2]:  # the opening messages, which no appended turn checks
            if message["content"] not in prompt:
                return False, (f"the rendered prompt does not contain the {message['role']} message's content "
                               f"{message['content']!r}: the template drops or replaces it")
        roles = []
        for k in range(2, len(self.conversation)):
            role = self.conversation[k]["role"]
            before = self.render(self.conversation[:k], generation_prompt=role == "assistant")
            after = self.render(self.conversation[: k + 1])
            if not after.startswith(before):
                at = _first_difference(before, after)
                line = before.rfind("\n", 0, at) + 1  # show the differing line from its start
                start = line if at - line <= 30 else at
                return False, (f"appending {_article(role)} {role} turn changed earlier text at char {at}: "
                               f"expected {before[start:at + 40]!r}, got {after[start:at + 40]!r}")
            content = self.conversation[k]["content"]
            if role != "assistant" and content not in after[len(before):]:  # the model would never see it
                return False, (f"appending {_article(role)} {role} turn added {after[len(before):]!r}, "
                               f"which does not contain its content {content!r}")
            roles.append(role)
        return True, (f"the prompt holds the system and user messages; appending {', '.join(roles)} turns "
                      "kept every earlier rendering as a prefix")

    def check_tool_call(self) -> tuple[bool, str]:
        prompt = self.render(self.conversation[:2], generation_prompt=True)
        structured = {"role": "assistant", "content": "", "tool_calls": [self.call.as_message_field()]}
        full = self.render(self.conversation[:2] + [structured])
        if not full.startswith(prompt):
            return False, "the rendered assistant turn does not continue the generation prompt"
        turn = full[len(prompt):]
        parsed = self.parse(turn)
        if parsed.calls != [self.call] or parsed.errors:
            return False, (f"the template renders {self.call.name}({json.dumps(self.call.arguments)}) as {turn!r}, "
                           f"which parses to {[(c.name, c.arguments) for c in parsed.calls]}"
                           f"{' with errors: ' + '; '.join(parsed.errors) if parsed.errors else ''}")
        return True, f"{self.call.name}({json.dumps(self.call.arguments)}) rendered and parsed back unchanged"

    def check_loss_mask(self) -> tuple[bool, str]:
        from agentrl.trainer.sft import conversation_sample

        if self.renderer.turn_end_id is None:
            return False, "the template ends assistant turns with no special token and the tokenizer has no eos token"
        end = self.renderer.decode([self.renderer.turn_end_id])  # what SFT and the rollout loop end a turn with
        sample = conversation_sample(self.renderer, self.conversation)
        runs: list[list[int]] = []
        for position, (token, trained) in enumerate(zip(sample.token_ids, sample.loss_mask)):
            if trained:
                if position == 0 or not sample.loss_mask[position - 1]:
                    runs.append([])
                runs[-1].append(token)
        turns = [k for k, m in enumerate(self.conversation) if m["role"] == "assistant"]
        if len(runs) != len(turns):
            return False, f"{len(runs)} runs of trained tokens for {len(turns)} assistant turns"
        for number, (run, k) in enumerate(zip(runs, turns), start=1):
            got, want = self.renderer.decode(run), self.sampled[k] + end
            if got != want:
                return False, f"assistant turn {number}: trained tokens decode to {got!r}, expected {want!r}"
            shown = self.render(self.conversation[: k + 1])[len(self.render(self.conversation[:k], True)):]
            if not shown.startswith(want):
                return False, (f"assistant turn {number}: the template renders it as {shown!r}, "
                               f"but the trained tokens are {want!r}")
        masked = len(sample.loss_mask) - sum(sample.loss_mask)
        return True, (f"{sum(sample.loss_mask)} trained tokens are exactly the {len(turns)} assistant turns "
                      f"plus {end!r}; {masked} tokens masked")

    def check_stop(self) -> tuple[bool, str]:
        eos = self.tokenizer.eos_token
        if eos is None or eos not in self.tokenizer.get_vocab():  # its id may be unk's: GPT-2's <|endoftext|>
            return False, f"the eos token {eos!r} is not in the vocabulary"
        stops = {self.renderer.decode([i]): i for i in self.renderer.stop_ids}  # what the rollout loop stops on
        for token in stops:
            if len(ids := self.renderer.encode(token)) != 1:
                return False, f"{token!r} is not a single token (it encodes to {ids})"
        last = self.conversation[-1]
        turn = self.render(self.conversation)[len(self.render(self.conversation[:-1], True)):]
        end = turn[turn.find(last["content"]) + len(last["content"]):] if last["content"] in turn else turn
        if not any(end.startswith(t) for t in stops):
            return False, (f"the rendered assistant turn {turn!r} does not end its content with a stop token "
                           f"({', '.join(map(repr, stops))})")
        found = next(t for t in stops if end.startswith(t))
        ids = ", ".join(f"{t!r}={i}" for t, i in stops.items())
        return True, f"stop tokens {ids} are single tokens; the assistant turn ends with {found!r}"


def run_doctor(model: str, tools: str | None = None, chat_template: str | None = None, parser: str = "hermes") -> int:
    """`agentrl doctor`: prints one line per check; 0 when all pass, 1 otherwise."""
    from agentrl.models import load_tokenizer
    from agentrl.tools.loader import build_tools, load_tools

    if parser not in CALL_TEXT:  # before anything loads
        raise ConfigError(f"--parser: unknown parser '{parser}' (known: {', '.join(CALL_TEXT)})")
    tool_list = load_tools(tools) if tools else build_tools({"class": "agentrl.tools.builtin.calculator:calculator"})
    if not tool_list:
        raise ConfigError(f"{tools}: no tools to check the template with")
    try:
        tokenizer = load_tokenizer(model, chat_template, needs_tools=True)
    except ConfigError as e:  # it names the recipe key (also in what to set); here the flag stands for it
        raise ConfigError(re.sub(r"\bmodel\.chat_template\b", "--chat-template", str(e))) from None
    doctor = Doctor(tokenizer, tool_list, parser)
    checks = doctor.run()
    for check in checks:
        print(check.line())
    failed = [c.name for c in checks if not c.ok]
    print(f"{len(checks) - len(failed)}/{len(checks)} checks passed" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
