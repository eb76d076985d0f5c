"""`agentrl doctor`: passes on SmolLM2 with the project's template; names what breaks in bad templates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agentrl.doctor import Doctor
from agentrl.models import load_tokenizer
from agentrl.tools.builtin.calculator import calculator

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
        "PASS prefix: appending assistant, tool, user, assistant turns kept every earlier rendering as a prefix",
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
    assert capsys.readouterr().err == (f"agentrl: error: model.chat_template: '{missing}' is neither a builtin "
                                       "(hermes) nor a file\n")
    assert main(["doctor", "--model", "smollm2-135m-instruct", "--parser", "xml"]) == 2
    assert capsys.readouterr().err == "agentrl: error: --parser: unknown parser 'xml' (known: hermes)\n"
    assert main(["doctor", "--model", "smollm2-135m-instruct", "--tools", str(tmp_path / "none.yaml")]) == 2
    assert capsys.readouterr().err.startswith(f"agentrl: error: {tmp_path / 'none.yaml'}")
