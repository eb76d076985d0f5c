"""Task sources and model resolution."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from agentrl.data import arithmetic_tasks, dataset_tasks
from agentrl.errors import ConfigError
from agentrl.models import load_tokenizer


def test_arithmetic_tasks_are_deterministic_and_correct():
    tasks = arithmetic_tasks(20, seed=3, min_digits=3, max_digits=4)
    assert [t.prompt for t in tasks] == [t.prompt for t in arithmetic_tasks(20, seed=3, min_digits=3, max_digits=4)]
    assert [t.prompt for t in tasks] != [t.prompt for t in arithmetic_tasks(20, seed=4)]
    for t in tasks:
        a, b, *rest = (int(x) for x in re.findall(r"\d+", t.prompt))
        assert 100 <= a <= 9999 and 100 <= b <= 9999
        truth = int(t.answer.removeprefix("#### "))
        assert truth in {a * b} | {a * b - c for c in rest} | {a * b + c for c in rest}


def test_jsonl_rows_with_field_mapping(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"q": f"question {i}", "a": f"#### {i}", "uid": f"u{i}"}) for i in range(5)))
    tasks = dataset_tasks("files", [str(path)], "train", "q", "a", "uid", limit=3)
    assert [(t.id, t.prompt, t.answer) for t in tasks] == [(f"u{i}", f"question {i}", f"#### {i}") for i in range(3)]
    with pytest.raises(ConfigError, match=r"data: column 'question' not in \['q', 'a', 'uid'\]"):
        dataset_tasks("files", [str(path)], "train", "question", "a")
    with pytest.raises(ConfigError, match="data.files: 'missing.jsonl' not found"):
        dataset_tasks("files", ["missing.jsonl"], "train", "q", "a")


def test_builtin_model_has_a_tool_aware_template(smollm2_dir):
    tokenizer = load_tokenizer(str(smollm2_dir))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         tools=[{"type": "function", "function": {"name": "ping", "parameters": {
                                             "type": "object", "properties": {}}}}])
    assert '"name": "ping"' in text and "<tool_call>" in text
    assert (smollm2_dir / "model.safetensors").stat().st_size > 500_000_000


def test_unknown_model_fails_clearly():
    # huggingface_hub reads HF_HUB_OFFLINE when imported, so the check runs in a fresh process;
    # online, the same path reaches the hub and fails (or loads) there.
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "rollout", "recipes/rollout_cpu.yaml",
                           "model.path=nobody/no-such-model"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("agentrl: error: model 'nobody/no-such-model': not a local model directory, "
                           "not a builtin (smollm2-135m-instruct), and loading it as a hub id failed (")


def test_template_that_ignores_tools_is_replaced(tmp_path, tokenizer, capsys):
    tokenizer.save_pretrained(tmp_path)
    plain = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    (tmp_path / "chat_template.jinja").write_text(plain)
    assert load_tokenizer(str(tmp_path)).chat_template == plain
    assert "<tools>" in load_tokenizer(str(tmp_path), needs_tools=True).chat_template
    assert "ignores tools; using 'hermes'" in capsys.readouterr().err
