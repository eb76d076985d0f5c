"""Task sources and model resolution."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from agentrl.data import arithmetic_tasks, conversation_file, dataset_tasks
from agentrl.errors import ConfigError
from agentrl.jsonl import jsonl_objects
from agentrl.models import load_model, load_tokenizer

GOOD_ROW = '{"question": "What is 2 + 1?", "answer": "#### 3"}\n'


def test_arithmetic_tasks_are_deterministic_and_correct():
    tasks = arithmetic_tasks(20, seed=3, min_digits=3, max_digits=4)
    assert [t.prompt for t in tasks] == [t.prompt for t in arithmetic_tasks(20, seed=3, min_digits=3, max_digits=4)]
    assert [t.prompt for t in tasks] != [t.prompt for t in arithmetic_tasks(20, seed=4)]
    for t in tasks:
        a, b, *rest = (int(x) for x in re.findall(r"\d+", t.prompt))
        assert 100 <= a <= 9999 and 100 <= b <= 9999
        truth = int(t.answer.removeprefix("#### "))
        assert truth in {a * b} | {a * b - c for c in rest} | {a * b + c for c in rest}


def test_the_longest_operands_the_recipe_allows_make_tasks_the_calculator_answers():
    """At 50 digits a x b + c passed the calculator's 1e100: generating the tasks raised a bare
    ValueError, and the model's calculator would have answered "out of range"."""
    from agentrl.config import MAX_DIGITS
    from agentrl.tools.builtin.calculator import calculator

    for task in arithmetic_tasks(200, seed=0, min_digits=MAX_DIGITS, max_digits=MAX_DIGITS):
        assert calculator(task.metadata["expression"]) == task.answer.removeprefix("#### ")


def test_jsonl_rows_with_field_mapping(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"q": f"question {i}", "a": f"#### {i}", "uid": f"u{i}"}) for i in range(5)))
    tasks = dataset_tasks("files", [str(path)], "train", "q", "a", "uid", limit=3)
    assert [(t.id, t.prompt, t.answer) for t in tasks] == [(f"u{i}", f"question {i}", f"#### {i}") for i in range(3)]
    with pytest.raises(ConfigError) as err:
        dataset_tasks("files", [str(path)], "train", "question", "a")
    assert str(err.value) == f"{path}:1: missing 'question' (the row has 'q', 'a', 'uid')"
    with pytest.raises(ConfigError, match="data.files: 'missing.jsonl' not found"):
        dataset_tasks("files", ["missing.jsonl"], "train", "q", "a")


@pytest.mark.parametrize("line,message", [
    ('{"answer": "#### 3"}', "3: missing 'question' (the row has 'answer')"),
    ('{"question": "q"}',
     "3: missing 'answer' (the row has 'question'; data.answer_key: null runs tasks without answers)"),
    ('{"question": "q", "answer": null}', "3: 'answer' is null (data.answer_key: null runs tasks without answers)"),
    ('{"question": "q", "answer": " "}', "3: 'answer' is empty (data.answer_key: null runs tasks without answers)"),
    ('{"question": 5, "answer": "#### 5"}', "3: 'question' must be text or a list of chat messages, not a number"),
    ('{"question": "q", "answer": ["#### 5"]}', "3: 'answer' must be text or a number, not a list"),
    ('{"question": ["a"], "answer": "#### 3"}', "3: 'question': message 1 is not a JSON object"),
    ('{"question": [{"role": "human", "content": "a"}], "answer": "1"}',
     "3: 'question': message 1: role 'human' is not one of system, user, assistant, tool"),
    ('{"question": "q", "answer": "1", "tool_kwargs": {"calculator": 1}}',
     "3: 'tool_kwargs' must map tool names to mappings of create() arguments"),
    ('{"question": "q", "answer": "1", "interaction_kwargs": "strict"}',
     "3: 'interaction_kwargs' must be a mapping (the interaction reads it as task.interaction_kwargs), not str"),
    # empty but wrong kinds: they loaded as no arguments
    ('{"question": "q", "answer": "1", "tool_kwargs": []}',
     "3: 'tool_kwargs' must map tool names to mappings of create() arguments"),
    ('{"question": "q", "answer": "1", "interaction_kwargs": ""}',
     "3: 'interaction_kwargs' must be a mapping (the interaction reads it as task.interaction_kwargs), not str"),
    ('{"question": "q", "answer": "#### 3",', "3: not valid JSON (Expecting property name enclosed in double quotes)"),
    ("[1, 2]", "3: expected a JSON object"),
    ('{"question": "q", "answer": NaN}', "3: not valid JSON (NaN is not JSON)"),  # it would have been 'nan'
    # both used to load: an empty prompt, and the last of a repeated key
    ('{"question": " \\n ", "answer": "#### 3"}', "3: 'question' is empty"),
    ('{"question": "What is 2+2?", "answer": "4", "question": "x"}', "3: key 'question' appears twice in one object"),
    ('{"question": [{"role": "user", "content": "a", "content": "b"}], "answer": "1"}',
     "3: key 'content' appears twice in one object"),

    (b'{"question": "caf\xe9", "answer": "1"}', "3: not UTF-8 text (byte 0xe9 at column 18)"),
])
def test_a_bad_task_row_names_its_file_and_line(tmp_path, line, message):
    path = tmp_path / "tasks.jsonl"
    bad = line if isinstance(line, bytes) else line.encode()
    path.write_bytes(GOOD_ROW.encode() + b"\n" + bad + b"\n" + GOOD_ROW.encode())  # line 2 is blank
    with pytest.raises(ConfigError) as err:  # rows past the ones used are checked too
        dataset_tasks("files", [str(path)], "train", "question", "answer", limit=1)
    assert str(err.value) == f"{path}:{message}"


def test_jsonl_rows_keep_numbers_kwargs_and_line_separators_inside_strings(tmp_path):
    path = tmp_path / "tasks.jsonl"
    rows = [{"question": "line one\u2028line two\u0085", "answer": 42, "tool_kwargs": {"calculator": {"x": 1}},
             "interaction_kwargs": {"persona": "impatient", "goal": ["book", "pay"]}},
            {"question": [{"role": "user", "content": "hi"}], "answer": "#### 1"}]
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode())
    tasks = dataset_tasks("files", [str(path)], "train", "question", "answer")
    assert [(t.prompt, t.answer, t.tool_kwargs) for t in tasks] == [
        ("line one\u2028line two\u0085", "42", {"calculator": {"x": 1}}),
        ([{"role": "user", "content": "hi"}], "#### 1", {})]
    assert [t.interaction_kwargs for t in tasks] == [{"persona": "impatient", "goal": ["book", "pay"]}, {}]
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n \n")
    assert dataset_tasks("files", [str(blank)], "train", "question", "answer") == []


def test_jsonl_from_a_run_skips_only_a_last_line_cut_short(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2, "reward_me')
    with pytest.raises(ConfigError, match=r"metrics.jsonl:2: not valid JSON"):
        list(jsonl_objects(path))  # a user's file: every line counts
    assert list(jsonl_objects(path, cut_short_end=True)) == [(1, {"step": 1})]
    assert capsys.readouterr().err == (f"agentrl: {path}:2: the last line is cut short (the run stopped while "
                                       "writing it); skipped\n")
    path.write_bytes(b'{"step": 1}\n{"step": 2, "caf\xc3')  # cut inside a UTF-8 character
    assert list(jsonl_objects(path, cut_short_end=True)) == [(1, {"step": 1})]
    path.write_bytes(b'{"step": 1, "re\n{"step": 2}')  # a broken line with lines after it is no crash's
    with pytest.raises(ConfigError, match=r"metrics.jsonl:1: not valid JSON"):
        list(jsonl_objects(path, cut_short_end=True))


@pytest.mark.parametrize("line,message", [
    ('{"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]}', "2: message 1 has no 'role'"),
    ('{"messages": [{"role": "bogus", "content": "q"}, {"role": "assistant", "content": "x"}]}',
     "2: message 1: role 'bogus' is not one of system, user, assistant, tool"),
    ('{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}',
     "2: message 1 (user): 'content' must be text, not a number"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}',
     "2: message 2 (assistant) has no 'content'"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}',
     "2: the conversation opens with role 'assistant'; it must open with a system or user message"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null, "tool_calls": '
     '[{"function": {"name": "calculator", "arguments": "{bad"}}]}]}',
     "2: message 2 (assistant): tool call 1 ('calculator'): the arguments are not a JSON object"),
    ('{"messages": []}', "2: expected a non-empty list of chat messages"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "2: the conversation has no assistant turn to learn from"),
])
def test_sft_conversations_are_checked_when_read(tmp_path, line, message):
    path = tmp_path / "sft.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1 + 1"}'}}]}]}
    path.write_text(json.dumps(good) + "\n")
    assert conversation_file(str(path)) == [(f"{path}:1", good["messages"])]
    path.write_text(json.dumps(good) + "\n" + line + "\n")
    with pytest.raises(ConfigError) as err:
        conversation_file(str(path))
    assert str(err.value) == f"{path}:{message}"


def test_cli_stops_on_bad_data_before_loading_the_model(tmp_path, agentrl_in_process):
    tasks, conversations = tmp_path / "tasks.jsonl", tmp_path / "sft.jsonl"
    tasks.write_text(GOOD_ROW * 2 + '{"answer": "#### 3"}\n')
    conversations.write_text("\n")
    for args, message in [
        (["rollout", "recipes/rollout_cpu.yaml", "data.source=files", f"data.files=[{tasks}]", "data.num_tasks=1"],
         f"{tasks}:3: missing 'question' (the row has 'answer')"),
        (["sft", "recipes/quickstart.yaml", f"sft.data={conversations}", f"sft.output={tmp_path / 'sft'}"],
         f"sft.data: no conversations: '{conversations}' has no rows")]:
        assert agentrl_in_process(*args, "model.path=/nonexistent", "sft.base_model=/nonexistent",
                                  f"output_dir={tmp_path / 'out'}") == (2, f"agentrl: error: {message}")


def test_a_directory_without_a_model_says_so(tmp_path, tiny_model_dir, tokenizer):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    with pytest.raises(ConfigError) as err:
        load_tokenizer(str(run))
    assert str(err.value) == f"model '{run}': the directory holds no model or tokenizer"
    shutil.copytree(tiny_model_dir, run / "final", dirs_exist_ok=True)
    with pytest.raises(ConfigError) as err:
        load_tokenizer(str(run))
    assert str(err.value) == (f"model '{run}': the directory holds no model or tokenizer (a run directory? "
                              f"its final/ holds one: {run / 'final'})")
    tokenizer.save_pretrained(tmp_path / "tokenizer_only")
    with pytest.raises(ConfigError) as err:
        load_model(str(tmp_path / "tokenizer_only"))
    assert str(err.value) == f"model '{tmp_path / 'tokenizer_only'}': the directory holds no model (no config.json)"


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
                           "not a builtin (smollm2-135m-instruct) nor a hub id in the local cache, and downloading "
                           "it from the hub failed (")


def test_template_that_ignores_tools_is_replaced(tmp_path, tokenizer, capsys):
    tokenizer.save_pretrained(tmp_path)
    plain = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    (tmp_path / "chat_template.jinja").write_text(plain)
    assert load_tokenizer(str(tmp_path)).chat_template == plain
    assert "<tools>" in load_tokenizer(str(tmp_path), needs_tools=True).chat_template
    assert "ignores tools; using 'hermes'" in capsys.readouterr().err


def test_the_recipes_system_prompt_opens_a_task_given_as_messages_unless_it_has_its_own():
    """It used to be dropped for such tasks, so their RL prompts differed from the SFT ones."""
    from agentrl.types import Task

    asked = [{"role": "user", "content": "2 + 2?"}]
    assert Task(id="a", prompt=asked).messages("Be brief.") == [{"role": "system", "content": "Be brief."}, *asked]
    own = [{"role": "system", "content": "Think."}, *asked]
    assert Task(id="b", prompt=own).messages("Be brief.") == own and Task(id="c", prompt=asked).messages() == asked


def test_one_digit_operands_generate_tasks():
    """1 × 1 left no room for the subtracted term: randint(1, 0) raised inside the generator."""
    tasks = arithmetic_tasks(40, seed=1, min_digits=1, max_digits=1)
    assert len(tasks) == 40 and all(task.answer.startswith("#### ") for task in tasks)


@pytest.mark.parametrize("row, problem", [
    ('{"question": "q", "answer": 1e400}', "not valid JSON (1e400 is too large for a number)"),
    # anywhere in the row: it read as inf, which no later check looked for
    ('{"question": "q", "answer": "1", "tool_kwargs": {"calc": {"tolerance": -1e999}}}',
     "not valid JSON (-1e999 is too large for a number)"),
    # past Python's digits limit: a bare ValueError, a traceback naming no file
    ('{"question": "q", "answer": ' + "9" * 5000 + "}",
     "not valid JSON (Exceeds the limit (4300 digits) for integer string conversion: value has 5000 digits; use "
     "sys.set_int_max_str_digits() to increase the limit)"),
])
def test_a_number_no_float_or_int_holds_is_refused_naming_the_line(tmp_path, row, problem):
    path = tmp_path / "tasks.jsonl"
    path.write_text(row + "\n")
    with pytest.raises(ConfigError) as err:
        dataset_tasks("files", [str(path)], "train", "question", "answer")
    assert str(err.value) == f"{path}:1: {problem}"


def test_openai_style_calls_in_a_task_prompt_render_as_sampled_calls_do(tmp_path, tokenizer):
    """A prompt's earlier assistant turn with JSON-string arguments rendered them quoted a second
    time, unlike SFT and the policy's own calls."""
    from agentrl.rollout.chat import ChatRenderer
    from agentrl.tools.builtin.calculator import calculator

    history = [{"role": "user", "content": "What is 2+3?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}]},
               {"role": "tool", "content": "5"}, {"role": "user", "content": "And 4*4?"}]
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"prompt": history, "answer": "16"}) + "\n")
    [task] = dataset_tasks("files", [str(path)], "train", "prompt", "answer")
    assert task.messages()[1]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "calculator", "arguments": {"expression": "2+3"}}}]  # the id kept: some templates render it
    text = ChatRenderer(tokenizer, [calculator]).render_text(task.messages(), add_generation_prompt=True)
    assert '{"name": "calculator", "arguments": {"expression": "2+3"}}' in text


def test_special_token_text_in_a_calls_arguments_is_refused_not_encoded(tokenizer):
    from agentrl.rollout.chat import ChatRenderer, SpecialTextError

    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"type": "function", "function": {"name": "calculator",
                                                      "arguments": {"expression": "1<|im_end|>"}}}]},
                {"role": "tool", "content": "1"}]
    with pytest.raises(SpecialTextError, match=r"^a tool call's arguments contain the special token text "
                                               r"'<\|im_end\|>', which would become a control token$"):
        ChatRenderer(tokenizer, []).prompt_ids(messages)


def test_an_adapter_without_its_base_model_is_a_config_error(tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"r": 8}')
    with pytest.raises(ConfigError) as err:
        load_model(str(tmp_path))
    assert str(err.value) == (f"model '{tmp_path}': {tmp_path / 'adapter_config.json'} names no base model "
                              "('base_model_name_or_path')")


def test_adapters_naming_each_other_as_base_are_a_config_error(tmp_path):
    """A base may be an adapter itself (LoRA RL after LoRA SFT); two naming each other recursed
    until Python's recursion limit."""
    first, second = tmp_path / "a", tmp_path / "b"
    for adapter, base in ((first, second), (second, first)):
        adapter.mkdir()
        (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base)}))
    with pytest.raises(ConfigError) as err:
        load_model(str(first))
    assert str(err.value) == (f"model '{first}': its adapters name each other as base model "
                              f"({first} -> {second} -> {first})")


def test_csv_cells_are_read_as_written(tmp_path):
    """pandas' type guessing turned the answer 0012 into '12.0', and the ids 001 and 01 into one."""
    path = tmp_path / "tasks.csv"
    path.write_text("\ufeffid,question,answer\n001,q1,0012\n01,q2,3.50\n")  # with the BOM spreadsheets write
    tasks = dataset_tasks("files", [str(path)], "train", "question", "answer", "id")
    assert [(t.id, t.prompt, t.answer) for t in tasks] == [("001", "q1", "0012"), ("01", "q2", "3.50")]
    path.write_text(",question,answer,answer\n0,q1,0012,x\n")  # pandas' to_csv: an unnamed index, a repeat
    assert [t.answer for t in dataset_tasks("files", [str(path)], "train", "question", "answer")] == ["0012"]


@pytest.mark.parametrize("suffix", ["csv", "parquet"])
def test_reading_a_local_task_file_sends_no_request(tmp_path, monkeypatch, suffix):
    """datasets counted each load of its csv, json and parquet builders with a HEAD request to
    s3.amazonaws.com: a training run reading its own task file went to the network (and, with no
    network, waited for the request to fail)."""
    import datasets.load
    import pyarrow as pa
    import pyarrow.parquet as pq

    requests: list[str] = []

    class Session:
        def head(self, url, **kwargs):
            requests.append(url)

    monkeypatch.setattr(datasets.load, "get_session", Session)
    path = tmp_path / f"tasks.{suffix}"
    if suffix == "csv":
        path.write_text("question,answer\nq1,1\n")
    else:
        pq.write_table(pa.table({"question": ["q1"], "answer": ["1"]}), path)
    assert [(t.prompt, t.answer) for t in dataset_tasks("files", [str(path)], "train", "question", "answer")] == [
        ("q1", "1")]
    assert requests == []


def test_a_bad_csv_row_names_the_reason(tmp_path):
    path = tmp_path / "tasks.csv"
    path.write_text("question,answer\nq1,1\nq2,2,3\n")
    with pytest.raises(ConfigError) as err:
        dataset_tasks("files", [str(path)], "train", "question", "answer")
    assert str(err.value) == f"{path} row 2: 3 cells under a header of 2 columns (question, answer)"
    path.write_text('question,answer\n"a cell\nof three\nlines",1\nq2,2,3\n')  # rows, not lines
    with pytest.raises(ConfigError) as err:
        dataset_tasks("files", [str(path)], "train", "question", "answer")
    assert str(err.value) == f"{path} row 2: 3 cells under a header of 2 columns (question, answer)"
    path.write_text('question,answer\nq,"' + "x" * 200_000 + '"\n')  # past the csv module's default field limit
    assert [len(t.answer) for t in dataset_tasks("files", [str(path)], "train", "question", "answer")] == [200_000]


def test_csv_rows_ending_in_a_comma_keep_their_columns_and_empty_tables_have_no_rows(tmp_path):
    """A row one cell longer than its header (an export's trailing comma) had its first cell taken
    for pandas' index: every other cell moved one column left, so the answer read as null or the
    prompt as the answer. A header alone or a parquet table of no rows gave datasets' own errors."""
    import pandas as pd

    path = tmp_path / "tasks.csv"
    path.write_text("question,answer\nq1,1,\nq2,2,\n")
    tasks = dataset_tasks("files", [str(path)], "train", "question", "answer")
    assert [(t.prompt, t.answer) for t in tasks] == [("q1", "1"), ("q2", "2")]
    path.write_text("question,answer\n")
    assert dataset_tasks("files", [str(path)], "train", "question", "answer") == []
    table = tmp_path / "tasks.parquet"
    pd.DataFrame({"question": [], "answer": []}).astype(str).to_parquet(table)
    assert dataset_tasks("files", [str(table)], "train", "question", "answer") == []


def test_a_task_file_given_as_a_dataset_name_or_nested_too_deeply_is_named(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(GOOD_ROW)
    with pytest.raises(ConfigError) as err:
        dataset_tasks(str(path), [], "train", "question", "answer")
    assert str(err.value) == f"data.source: '{path}' is a file; give it as data.source: files, data.files: [{path}]"
    path.write_text(GOOD_ROW + '{"question": "x", "answer": "1", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(ConfigError) as err:
        dataset_tasks("files", [str(path)], "train", "question", "answer")
    assert str(err.value) == f"{path}:2: not valid JSON (nested too deeply to read)"


def test_two_rows_sharing_an_id_are_refused(tmp_path):
    """A task's id names its group: two tasks under one id would be merged."""
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"id": "a", "q": "x", "answer": 1}\n{"id": "b", "q": "y", "answer": 2}\n'
                    '{"id": "a", "q": "z", "answer": 3}\n')
    with pytest.raises(ConfigError) as err:
        dataset_tasks("files", [str(path)], "train", "q", "answer", "id")
    assert str(err.value) == f"{path}:1 and {path}:3 share the id 'a' (column 'id')"
    assert len(dataset_tasks("files", [str(path)], "train", "q", "answer")) == 3  # row ids: row-0, row-1, row-2


def test_a_bad_row_of_a_csv_set_names_its_file(tmp_path):
    """Rows read through `datasets` were numbered across all files: 'data.files row 4' named none."""
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text("question,answer\nq1,1\nq2,2\n")
    b.write_text("question,answer\nq3,3\nq4,\n")
    with pytest.raises(ConfigError) as err:
        dataset_tasks("files", [str(a), str(b)], "train", "question", "answer")
    assert str(err.value) == f"{b} row 2: 'answer' is null (data.answer_key: null runs tasks without answers)"
    tasks = dataset_tasks("files", [str(a), str(b)], "train", "question", "answer", limit=3)
    assert [(t.id, t.prompt, t.answer) for t in tasks] == [("row-0", "q1", "1"), ("row-1", "q2", "2"),
                                                            ("row-2", "q3", "3")]


def test_a_parquet_files_filled_in_nulls_are_not_read_as_values(tmp_path):
    """A struct column has one set of keys for every row: a key a row never had reads back as
    null. Rows whose `tool_kwargs` named different tools were refused ('must map tool names to
    mappings'), and a message's absent `name` reached the template as a null."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": [{"role": "user", "content": "q1"}], "answer": "1",
             "tool_kwargs": {"calculator": {"precision": 2}}},
            {"question": [{"role": "system", "content": "s"}, {"role": "user", "content": "q2", "name": "bob"},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
             "answer": "2", "tool_kwargs": {"other": {"x": 1, "y": 2}}}]
    path = tmp_path / "tasks.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert pq.read_table(path).to_pylist()[0]["tool_kwargs"]["other"] is None  # what the file holds
    first, second = dataset_tasks("files", [str(path)], "train", "question", "answer")
    assert first.tool_kwargs == {"calculator": {"precision": 2}} and second.tool_kwargs == {"other": {"x": 1, "y": 2}}
    assert first.prompt == [{"role": "user", "content": "q1"}]
    assert second.prompt[1] == {"role": "user", "content": "q2", "name": "bob"}
    assert second.prompt[2]["content"] is None and second.prompt[2]["tool_calls"][0]["function"]["name"] == "f"


def test_tool_kwargs_for_a_tool_the_run_lacks_are_named_once_before_any_model_loads(tmp_path, tiny_model_dir, capsys):
    """A misspelt tool name in a row's tool_kwargs used to vanish: its tool's create() ran without
    the arguments, and the episode's reward dropped without a word."""
    from agentrl.recipe import load_recipe
    from agentrl.rollout.run import load_driver_parts

    rows = [{"id": "a", "question": "q", "answer": "1", "tool_kwargs": {"calculatr": {"x": 1}}},
            {"id": "b", "question": "q", "answer": "2", "tool_kwargs": {"calculatr": {"x": 2}, "calculator": {}}}]
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_recipe(None, [f"model.path={tiny_model_dir}", "data.source=files", f"data.files=[{data}]",
                                "data.id_key=id", "rollout.tool_configs=[tool_configs/calculator.yaml]",
                                "data.num_tasks=2"])
    tasks, _ = load_driver_parts(config)
    assert [t.tool_kwargs for t in tasks] == [r["tool_kwargs"] for r in rows]  # kept as they are
    assert capsys.readouterr().err == (f"agentrl: warning: {data}:1: tool_kwargs for 'calculatr', which no tool "
                                       "of rollout.tool_configs has (tools: calculator); its create() arguments "
                                       "go nowhere\n")


@pytest.mark.parametrize("num_tasks,eval_files", [(5, False), (3, False), (5, True)])
def test_a_task_file_with_fewer_rows_than_asked_for_is_named_and_its_rows_are_used(tmp_path, capsys, num_tasks,
                                                                                   eval_files):
    from agentrl.recipe import load_recipe
    from agentrl.rollout.run import load_tasks

    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n" for i in range(3)))
    config = load_recipe(None, ["data.source=files", f"data.files=[{data}]", f"data.num_tasks={num_tasks}"])
    tasks = load_tasks(config, "eval.files" if eval_files else "data.files")
    assert [t.prompt for t in tasks] == ["q0", "q1", "q2"]
    key, count_key = ("eval.files", "eval.num_tasks") if eval_files else ("data.files", "data.num_tasks")
    assert capsys.readouterr().err == ("" if num_tasks == 3 else (
        f"agentrl: warning: {count_key} is 5, but {key} ['{data}'] has 3 rows: the run uses those 3\n"))


def test_answers_gsm8k_reward_cannot_read_are_named_in_a_warning(tmp_path, capsys):
    """A task whose answer holds no number scores 0 whatever the model says; such rows loaded without a word."""
    from agentrl.recipe import load_recipe
    from agentrl.rollout.run import load_tasks

    data = tmp_path / "tasks.jsonl"
    rows = [{"question": "2+2?", "answer": "#### 4"}, {"question": "How many?", "answer": "four"},
            {"question": "And now?", "answer": "#### "}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = load_recipe(None, ["data.source=files", f"data.files=[{data}]", "data.num_tasks=3"])
    assert len(load_tasks(config)) == 3
    assert capsys.readouterr().err == (
        f"agentrl: warning: 2 of 3 tasks have an answer with no number (first: {data}:2: 'four'), so "
        "reward.function (gsm8k_reward) scores every episode of them 0\n")
    load_tasks(load_recipe(None, ["data.source=files", f"data.files=[{data}]", "data.num_tasks=3",
                                  "reward.function=my_rewards:score"]))
    assert capsys.readouterr().err == ""  # another reward function reads answers its own way
