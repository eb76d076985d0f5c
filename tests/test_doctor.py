"""`agentrl doctor`: passes on SmolLM2 with the project's template and on tokenizers whose eos is not
what ends a turn (Qwen2.5 base, Gemma, GPT-2); names what breaks in bad templates."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.doctor import Doctor, sample_call
from agentrl.models import load_tokenizer
from agentrl.tools.base import FunctionTool
from agentrl.tools.builtin.calculator import calculator
from agentrl.types import ToolCall

FIXTURES = Path(__file__).parent / "fixtures"


def doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentrl.cli", "doctor", "--model", "smollm2-135m-instruct", *args],
                          capture_output=True, text=True, timeout=120)


def test_smollm2_with_the_project_template_passes_every_check():
    done = doctor("--tools", "tool_configs/gsm8k.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines == [
        "PASS tools: calculator, check_answer appear in the prompt with their descriptions",
        "PASS prefix: the prompt holds the system and user messages; appending assistant, tool, user, assistant "
        "turns kept every earlier rendering as a prefix",
        'PASS tool-call: calculator({"expression": "12 * 34"}) rendered and parsed back unchanged',
        lines[3],  # token counts depend on the prompt; checked below
        "PASS stop: stop tokens '<|im_end|>'=2 are single tokens; the assistant turn ends with '<|im_end|>'",
        "5/5 checks passed",
    ]
    assert lines[3].startswith("PASS loss-mask: 41 trained tokens are exactly the 2 assistant turns plus '<|im_end|>'")


def test_a_template_that_drops_earlier_tool_calls_fails_prefix():
    done = doctor("--chat-template", str(FIXTURES / "drops_old_tool_calls.jinja"))
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert lines[0] == "PASS tools: calculator appears in the prompt with its description"
    assert lines[1].startswith("FAIL prefix: appending a tool turn changed earlier text at char ")
    assert lines[1].endswith(": expected '<tool_call>\\n{\"name\": \"calculator\", \"argum', "
                             "got '<|im_end|>\\n<|im_start|>tool\\n<tool_respons'")
    assert [line.split(":")[0] for line in lines[2:5]] == ["PASS tool-call", "PASS loss-mask", "PASS stop"]
    assert lines[5] == "4/5 checks passed; failed: prefix"


def test_the_char_position_is_where_the_renderings_part():
    tokenizer = load_tokenizer("smollm2-135m-instruct", str(FIXTURES / "drops_old_tool_calls.jinja"))
    check = next(c for c in Doctor(tokenizer, [calculator], "hermes").run() if c.name == "prefix")
    at = int(check.detail.split("at char ")[1].split(":")[0])
    call_turn = tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are a careful assistant."}, {"role": "user", "content": "What is 12 * 34?"}],
        tools=[calculator.schema], tokenize=False, add_generation_prompt=True)
    assert at == len(call_turn) + 1  # the call starts right after the generation prompt; '<' is common to both


def test_a_template_without_tools_fails_tools_and_tool_call():
    tokenizer = load_tokenizer("smollm2-135m-instruct", str(FIXTURES / "chatml_no_tools.jinja"))
    checks = {c.name: c for c in Doctor(tokenizer, [calculator], "hermes").run()}
    assert checks["tools"].line() == ("FAIL tools: the rendered prompt does not mention tool 'calculator' "
                                      "(does the template use `tools`?)")
    assert checks["tool-call"].line() == ('FAIL tool-call: the template renders calculator({"expression": "12 * 34"}) '
                                          "as '<|im_end|>\\n', which parses to []")
    assert checks["prefix"].ok and checks["loss-mask"].ok and checks["stop"].ok


def test_bad_input_exits_2_with_one_line(tmp_path, capsys):
    from agentrl.cli import main

    missing = tmp_path / "missing.jinja"
    assert main(["doctor", "--model", "smollm2-135m-instruct", "--chat-template", str(missing)]) == 2
    assert capsys.readouterr().err == (f"agentrl: error: --chat-template: '{missing}' is neither a builtin "
                                       "(hermes) nor a file\n")
    assert main(["doctor", "--model", "smollm2-135m-instruct", "--parser", "xml"]) == 2
    assert capsys.readouterr().err == "agentrl: error: --parser: unknown parser 'xml' (known: hermes)\n"
    assert main(["doctor", "--model", "smollm2-135m-instruct", "--tools", str(tmp_path / "none.yaml")]) == 2
    assert capsys.readouterr().err.startswith(f"agentrl: error: {tmp_path / 'none.yaml'}")


def with_turn_end(tokenizer, eos: str, turn_end: str):
    """The project's tokenizer with another eos, and a template that ends assistant turns with `turn_end`."""
    variant = copy.deepcopy(tokenizer)
    variant.eos_token = eos
    closing = "{%- endif -%}\n<|im_end|>\n{% else -%}"  # the end of the template's assistant branch
    assert variant.chat_template.count(closing) == 1
    variant.chat_template = variant.chat_template.replace(closing, closing.replace("<|im_end|>", turn_end))
    return variant


@pytest.mark.parametrize("eos, turn_end", [
    ("<|endoftext|>", "<|im_end|>"),  # Qwen2.5 / Llama 3 base: eos is not what ends a turn
    ("<|im_end|>", "<|endoftext|>"),  # Gemma: turns end with a token that is neither eos nor <|im_end|>
    ("<|endoftext|>", "<|endoftext|>"),  # GPT-2 family: eos is also the unk token, id 0
], ids=["qwen-base", "gemma", "gpt2"])
def test_turns_that_end_with_the_templates_token_rather_than_eos_pass(tokenizer, eos, turn_end):
    """SFT and the rollout loop end a turn with the template's end-of-turn token and stop on every
    such token; the doctor used to demand eos there, and took an eos whose id is unk's for missing."""
    variant = with_turn_end(tokenizer, eos, turn_end)
    assert variant.unk_token_id == 0 and variant.convert_tokens_to_ids("<|endoftext|>") == 0
    checks = {c.name: c for c in Doctor(variant, [calculator], "hermes").run()}
    assert [c.line().split(":")[0] for c in checks.values()] == [
        "PASS tools", "PASS prefix", "PASS tool-call", "PASS loss-mask", "PASS stop"]
    assert checks["loss-mask"].line().startswith(
        f"PASS loss-mask: 41 trained tokens are exactly the 2 assistant turns plus {turn_end!r}; ")
    assert checks["stop"].line() == ("PASS stop: stop tokens '<|endoftext|>'=0, '<|im_end|>'=2 are single tokens; "
                                     f"the assistant turn ends with {turn_end!r}")


def test_an_eos_missing_from_the_vocabulary_still_fails_stop(tokenizer):
    """A missing eos maps to unk's id; the vocabulary, not that id, says it is missing."""
    variant = copy.deepcopy(tokenizer)
    variant.eos_token = "<|missing|>"
    check = next(c for c in Doctor(variant, [calculator], "hermes").run() if c.name == "stop")
    assert check.line() == "FAIL stop: the eos token '<|missing|>' is not in the vocabulary"


def nullable_calculator(*types: list[str]) -> FunctionTool:
    properties = {f"p{i}": {"type": kind, "description": "A value."} for i, kind in enumerate(types)}
    return FunctionTool(calculator.fn, schema={"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": properties, "required": list(properties)}}})


def test_a_list_of_types_samples_its_first_non_null_type():
    tool = nullable_calculator(["string", "null"], ["null", "integer"], ["null", "boolean", "string"], ["null"])
    assert sample_call(tool) == ToolCall("calculator", {"p0": "12 * 34", "p1": 3, "p2": True, "p3": "x"})


def test_a_nullable_parameter_passes_every_check(tmp_path, capsys):
    """OpenAI strict-mode and MCP schemas write an optional parameter's type as ["string", "null"]."""
    from agentrl.cli import main

    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class: agentrl.tools.builtin.calculator:calculator\n    schema:\n"
                     "      type: function\n      function:\n        name: calculator\n"
                     "        description: Evaluate an arithmetic expression.\n        parameters:\n"
                     "          type: object\n          properties:\n"
                     "            expression: {type: [string, 'null'], description: The expression.}\n"
                     "          required: [expression]\n")
    assert main(["doctor", "--model", "smollm2-135m-instruct", "--tools", str(tools)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == 'PASS tool-call: calculator({"expression": "12 * 34"}) rendered and parsed back unchanged'
    assert lines[5] == "5/5 checks passed"


def test_a_template_that_renders_calls_after_the_content_passes(tokenizer):
    """Qwen2.5's shape renders `content` and then every `tool_calls` entry; the rollout loop records a
    call turn as the text outside its call blocks plus the calls, and the doctor checks that record.
    It used to check the sampled text with the calls beside it, which that template renders twice."""
    variant = load_tokenizer("smollm2-135m-instruct", str(FIXTURES / "qwen25_style.jinja"))
    doctor = Doctor(variant, [calculator], "hermes")
    assert doctor.conversation[2] == {"role": "assistant", "content": "",
                                      "tool_calls": [doctor.call.as_message_field()]}
    checks = {c.name: c for c in doctor.run()}
    assert [c.line().split(":")[0] for c in checks.values()] == [
        "PASS tools", "PASS prefix", "PASS tool-call", "PASS loss-mask", "PASS stop"]
    # the project's template keeps the sampled text as content, as the rollout loop records it there
    assert Doctor(tokenizer, [calculator], "hermes").conversation[2]["content"].startswith("<tool_call>\n")


def test_a_template_that_drops_tool_results_fails_prefix(tokenizer):
    """Appending a tool turn that renders as nothing keeps every earlier rendering as a prefix, but
    the model would never see the result."""
    variant = copy.deepcopy(tokenizer)
    tool_branch = "<|im_start|>tool\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    assert variant.chat_template.count(tool_branch) == 1
    variant.chat_template = variant.chat_template.replace(tool_branch, "")
    check = next(c for c in Doctor(variant, [calculator], "hermes").run() if c.name == "prefix")
    assert check.line() == "FAIL prefix: appending a tool turn added '', which does not contain its content '408'"


@pytest.mark.parametrize("original, replacement, role, content", [
    # a fixed system prompt in place of the recipe's: 5/5 used to pass, and rollout.system_prompt vanished
    ("{{ system if system is not none else 'You are a helpful assistant.' }}", "You are a helpful assistant.",
     "system", "You are a careful assistant."),
    # the first user message skipped along with the system message
    ("{%- if not (loop.first and message['role'] == 'system') -%}", "{%- if loop.index > 2 -%}",
     "user", "What is 12 * 34?"),
], ids=["fixed-system-prompt", "drops-first-user-message"])
def test_a_template_that_drops_an_opening_message_fails_prefix_naming_it(tokenizer, tmp_path, capsys,
                                                                         original, replacement, role, content):
    from agentrl.cli import main

    assert tokenizer.chat_template.count(original) == 1
    template = tmp_path / "template.jinja"
    template.write_text(tokenizer.chat_template.replace(original, replacement))
    assert main(["doctor", "--model", "smollm2-135m-instruct", "--chat-template", str(template)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == (f"FAIL prefix: the rendered prompt does not contain the {role} message's content "
                        f"{content!r}: the template drops or replaces it")
    assert lines[-1] == "4/5 checks passed; failed: prefix"
