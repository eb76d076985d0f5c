"""`agentrl view`: real episodes → run-dir files → the real CLI → the page checked in headless Chromium."""

from __future__ import annotations

import asyncio
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from agentrl.errors import ConfigError
from agentrl.rollout.episode import EpisodeRunner, EpisodeSettings
from agentrl.tools.base import tool
from agentrl.tools.builtin.calculator import calculator
from agentrl.tools.parsers import parse_hermes
from agentrl.types import Task
from agentrl.view import load_trajectories, run_model, run_view, token_pieces
from tests.conftest import ScriptedEngine

HOSTILE = "<script>document.title='pwned'</script><marquee>not markup</marquee>"


@tool
def lookup(key: str) -> str:
    """Look a key up in an untrusted store.

    Args:
        key: The key.
    """
    return HOSTILE


def call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def episode(tokenizer, task: Task, turns: list[str], stop: bool = True, **settings):
    runner = EpisodeRunner(ScriptedEngine(tokenizer, turns, stop=stop), tokenizer, [calculator, lookup], parse_hermes,
                           EpisodeSettings(**settings),
                           reward_fn=lambda t, messages: float(t.answer in messages[-1]["content"]))
    return asyncio.run(runner.run(task, group_id=task.id))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tokenizer):
    """Two training steps and one eval file, laid out as a run directory."""
    t1 = Task(id="t1", prompt="What is 1234 * 5678?", answer="7006652")
    t2 = Task(id="t2", prompt="What is 25 * 4?", answer="100")
    step1 = [episode(tokenizer, t1, [call("calculator", {"expression": "1234 * 5678"}), "The answer is 7006652."]),
             episode(tokenizer, t1, [call("lookup", {"key": "x"}), "unused"], max_turns=1)]
    step2 = [episode(tokenizer, t2, [call("calculator", {"expression": "25 * 4"}), "The answer is 100."]),
             episode(tokenizer, t2, ["Let me think about 25 times"], stop=False)]
    assert [t.finish for t in step1 + step2] == ["stop", "max_turns", "stop", "length"]
    assert [t.reward for t in step1 + step2] == [1.0, 0.0, 1.0, 0.0]
    path = tmp_path_factory.mktemp("run")
    (path / "trajectories").mkdir()
    for step, trajectories in ((1, step1), (2, step2)):
        lines = [json.dumps({**t.to_json(), "step": step}) for t in trajectories]
        (path / "trajectories" / f"step_{step}.jsonl").write_text("\n".join(lines) + "\n")
    (path / "eval_final.jsonl").write_text(json.dumps(step2[0].to_json()) + "\n")  # no step: shown as step 0
    (path / "config.yaml").write_text("name: run\nmodel:\n  path: smollm2-135m-instruct\n  dtype: float32\n")
    return path


def agentrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentrl.cli", *args], capture_output=True, text=True, timeout=120)


def test_token_pieces_concatenate_to_the_decoded_text(tokenizer):
    ids = tokenizer("naïve café → 42 <tool_call>", add_special_tokens=False)["input_ids"] + [2]
    pieces = token_pieces(tokenizer, ids, {})
    assert len(pieces) == len(ids)
    assert "".join(pieces) == "naïve café → 42 <tool_call><|im_end|>"
    assert "\ufffd" not in "".join(pieces)


def offline(chromium: str, directory: Path) -> str:
    """A launcher that starts Chromium in a network namespace of its own, where no interface is up,
    or Chromium itself where user namespaces are not allowed. Chromium checks whether IPv6 reaches
    anywhere with a UDP socket connected to a public resolver's address, which no flag turns off;
    the pages it is shown are files, so it needs no network at all. ChromeDriver speaks to it over a
    pipe (--remote-debugging-pipe): the namespace's loopback is not the test's."""
    unshare = shutil.which("unshare")
    if not unshare or subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode != 0:
        return chromium
    launcher = directory / "chromium-offline"
    launcher.write_text(f'#!/bin/sh\nexec {shlex.quote(unshare)} -rn {shlex.quote(chromium)} "$@"\n')
    launcher.chmod(0o755)
    return str(launcher)


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the dev extra: pip install -e .[dev]")
    from selenium.webdriver.chrome.service import Service

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("headless Chromium is missing: apt-get install -y chromium chromium-driver")

    options = webdriver.ChromeOptions()
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--remote-debugging-pipe", "--window-size=1400,1000"):
        options.add_argument(flag)
    with tempfile.TemporaryDirectory() as profile:
        options.binary_location = offline(chromium, Path(profile))
        options.add_argument(f"--user-data-dir={profile}")
        # explicit driver path: selenium then never runs its driver manager (no network)
        chrome = webdriver.Chrome(service=Service(driver), options=options)
        yield chrome
        chrome.quit()


def visible_cards(browser) -> list[tuple[str, str, str]]:
    return [tuple(card) for card in browser.execute_script(
        "return Array.from(document.querySelectorAll('.traj:not([hidden])'),"
        " c => [c.dataset.step, c.dataset.finish, c.dataset.reward]);")]


def test_page_shows_turns_tokens_and_filters(run_dir, browser, tmp_path):
    done = agentrl("view", str(run_dir))
    assert done.returncode == 0, done.stderr[-2000:]
    page = run_dir / "view.html"
    assert done.stdout.strip() == f"wrote {page} (5 trajectories, steps 0, 1, 2)"
    html = page.read_text()
    assert "&lt;script&gt;document.title=" in html and "http://" not in html and "https://" not in html
    browser.get(page.as_uri())

    # the hostile tool result is text: it did not run, no element came of it, and it reads as written
    assert browser.title == f"agentrl · {run_dir.name}"
    assert browser.execute_script("return document.scripts.length") == 1
    assert browser.execute_script("return document.querySelectorAll('marquee').length") == 0
    tool_texts = browser.execute_script("return Array.from(document.querySelectorAll('.role-tool pre'), e => e.textContent)")
    assert HOSTILE in tool_texts and "7006652" in tool_texts and "100" in tool_texts
    roles = browser.execute_script("return Array.from(document.querySelectorAll('.traj')[2].querySelectorAll('.msg .role'),"
                                   " e => e.textContent)")
    assert roles == ["user", "assistant", "tool · lookup"]
    calls = browser.execute_script("return Array.from(document.querySelectorAll('.call b'), e => e.textContent)")
    assert calls == ["calculator", "calculator", "lookup", "calculator"]  # steps 0, 1, 1, 2 in page order

    # trained and masked tokens look different once the token streams are shown
    browser.find_element("id", "f-tokens").click()
    style = "return [getComputedStyle(arguments[0]).backgroundColor, getComputedStyle(arguments[0]).color]"
    trained = browser.find_element("css selector", ".traj .tokens .t")
    masked = browser.find_element("css selector", ".traj .tokens .m")
    assert trained.is_displayed() and masked.is_displayed()
    assert browser.execute_script(style, trained) == ["rgb(200, 236, 192)", "rgb(11, 61, 11)"]
    assert browser.execute_script(style, masked) == ["rgba(0, 0, 0, 0)", "rgb(138, 138, 138)"]
    assert trained.get_attribute("title").startswith("#") and " logprob -0.0" in trained.get_attribute("title")
    browser.execute_script("document.querySelectorAll('.group')[1].scrollIntoView()")
    browser.save_screenshot(str(tmp_path / "view.png"))
    assert (tmp_path / "view.png").stat().st_size > 20_000

    all_cards = [("0", "stop", "1.0"), ("1", "stop", "1.0"), ("1", "max_turns", "0.0"), ("2", "stop", "1.0"),
                 ("2", "length", "0.0")]
    assert visible_cards(browser) == all_cards
    rmin = browser.find_element("id", "f-rmin")
    rmin.send_keys("0.5")
    assert visible_cards(browser) == [c for c in all_cards if c[2] == "1.0"]
    rmin.clear()
    browser.execute_script("arguments[0].dispatchEvent(new Event('input'))", rmin)
    browser.find_element("css selector", ".f-step[value='1']").click()
    assert visible_cards(browser) == [c for c in all_cards if c[0] != "1"]
    assert browser.execute_script("return document.querySelectorAll('.group:not([hidden])').length") == 2
    browser.find_element("css selector", ".f-finish[value='stop']").click()
    assert visible_cards(browser) == [("2", "length", "0.0")]
    assert browser.find_element("id", "shown").text == "1 of 5 trajectories"


def test_steps_option_model_option_and_bad_input(run_dir, tmp_path):
    out = tmp_path / "two.html"
    done = agentrl("view", str(run_dir), "--steps", "1", "--out", str(out), "--model", "smollm2-135m-instruct")
    assert done.returncode == 0, done.stderr[-2000:]
    html = out.read_text()
    assert html.count('<article class="traj"') == 2 and 'data-step="2"' not in html
    # the tool's output is escaped text wherever it appears (its turn, its tokens), never markup
    assert html.count("&lt;script&gt;document.title=&#39;pwned&#39;&lt;/script&gt;&lt;marquee&gt;") == 1
    assert "<script>document" not in html and "<marquee" not in html
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "rollout.jsonl").write_text((run_dir / "eval_final.jsonl").read_text())
    cases = [
        ((str(tmp_path / "missing"),), f"agentrl: error: {tmp_path / 'missing'}: no such run directory"),
        ((str(run_dir), "--steps", "9"),
         f"agentrl: error: --steps 9: no trajectories for these steps in {run_dir} (steps present: 0, 1, 2)"),
        ((str(run_dir), "--steps", "1,x"), "agentrl: error: --steps: '1,x' is not a comma-separated list of step numbers"),
        ((str(tmp_path),), f"agentrl: error: {tmp_path}: no trajectory files "
                           "(trajectories/step_N.jsonl, rollout.jsonl, eval_*.jsonl)"),
        ((str(bare),), f"agentrl: error: {bare}: no config.yaml to take model.path from; pass --model"),
    ]
    for args, message in cases:
        done = agentrl("view", *args)
        assert (done.returncode, done.stderr.strip()) == (2, message)


def test_a_view_refused_loads_neither_torch_nor_transformers(run_dir):
    # A mistake in the command is named at once; only the page's tokenizer needs transformers.
    probe = ("import sys; from agentrl.cli import main; rc = main(sys.argv[1:]); "
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules)); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", probe, "view", str(run_dir), "--steps", "9"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "--steps 9: no trajectories" in done.stderr, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_a_crashed_run_shows_what_was_written(run_dir, tmp_path):
    crashed = tmp_path / "crashed"
    shutil.copytree(run_dir, crashed)
    step2 = crashed / "trajectories" / "step_2.jsonl"
    first, second = step2.read_bytes().splitlines(keepends=True)
    step2.write_bytes(first + second[:len(second) // 2])  # the second line half written
    done = agentrl("view", str(crashed))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == f"wrote {crashed / 'view.html'} (4 trajectories, steps 0, 1, 2)\n"
    assert done.stderr.endswith(f"agentrl: {step2}:2: the last line is cut short (the run stopped while writing it); "
                                "skipped\n")
    step2.write_text("not a trajectory file\n")  # --steps 1 reads no other step's file
    done = agentrl("view", str(crashed), "--steps", "1")
    assert (done.returncode, done.stdout) == (0, f"wrote {crashed / 'view.html'} (2 trajectories, steps 1)\n")


def test_an_out_that_is_a_directory_or_under_a_file_is_refused(run_dir, tmp_path):
    (tmp_path / "afile").write_text("")
    for out, message in [
            (tmp_path, f"--out: '{tmp_path}' is a directory; give a file name, e.g. {tmp_path / 'view.html'}"),
            (tmp_path / "afile" / "v.html", f"--out: cannot write '{tmp_path / 'afile' / 'v.html'}' "
                                            f"(File exists: '{tmp_path / 'afile'}')")]:
        done = agentrl("view", str(run_dir), "--out", str(out), "--model", "smollm2-135m-instruct")
        assert (done.returncode, done.stderr) == (2, f"agentrl: error: {message}\n")


def test_a_relative_model_path_is_found_from_another_directory(tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "runs" / "r" / "final").mkdir(parents=True)
    run = project / "runs" / "r"
    (run / "config.yaml").write_text("output_dir: runs/r\nmodel:\n  path: runs/r/final\n")
    monkeypatch.chdir(tmp_path)  # not where the run started
    assert run_model(run, None) == str(run / "final")
    assert run_model(run, "other") == "other"
    (run / "config.yaml").write_text("output_dir: runs/r\nmodel:\n  path: smollm2-135m-instruct\n")
    assert run_model(run, None) == "smollm2-135m-instruct"  # no directory: a builtin or hub id, as written
    (run / "config.yaml").write_text("output_dir: runs/r\nmodel:\n  path: runs/r/sft\n")
    assert run_model(run, None) == "runs/r/sft"  # in neither place: as written, for the error to name
    (run / "rollout.jsonl").write_text(json.dumps(GOOD) + "\n")
    done = agentrl("view", str(run))
    assert done.returncode == 2 and done.stderr.startswith("agentrl: error: model 'runs/r/sft': not a local model ")
    assert done.stderr.endswith(f"; it is model.path of {run / 'config.yaml'}: pass --model\n")


GOOD = {"task_id": "t", "group_id": "g", "token_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "logprobs": [0, -0.1, -0.2],
        "messages": [{"role": "user", "content": "hi"}], "reward": 1.0, "finish": "stop"}


@pytest.mark.parametrize("change, problem", [
    ({"step": "abc"}, 'step is "abc", not an integer'),
    ({"token_ids": None}, "token_ids is null, not a list of token ids (integers from 0)"),
    ({"loss_mask": [0, 1.5, 1]}, "loss_mask is [0, 1.5, 1], not a list of integers, one per token"),
    ({"messages": ["hello"]}, 'messages is ["hello"], not a list of objects (tool_calls a list of objects)'),
    ({"reward": "high"}, 'reward is "high", not a finite number'),
    ({"logprobs": ["a"]}, 'logprobs is ["a"], not a list of numbers'),
    # these used to reach the page and fail there, or drop tokens from it without a word
    ({"token_ids": [-1, 2, 3]}, "token_ids is [-1, 2, 3], not a list of token ids (integers from 0)"),
    ({"loss_mask": [0, 1]}, "loss_mask is [0, 1], not a list of integers, one per token"),
    ({"reward": 10**400}, f"reward is {str(10**400)[:40]}, not a finite number"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": "calc"}]}]},
     'messages is [{"role": "assistant", "tool_calls": [{", not a list of objects (tool_calls a list of objects)'),
    ({"messages": [{"role": "assistant", "tool_calls": 5}]},
     'messages is [{"role": "assistant", "tool_calls": 5}], not a list of objects (tool_calls a list of objects)'),
    ({"metrics": ["turns", 2]}, 'metrics is ["turns", 2], not an object'),
])
def test_a_record_the_page_cannot_show_is_named_not_a_traceback(tmp_path, change, problem):
    """Each of these used to end `agentrl view` in a Python traceback."""
    (tmp_path / "rollout.jsonl").write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD | change) + "\n")
    with pytest.raises(ConfigError) as refused:
        load_trajectories(tmp_path)
    assert str(refused.value) == f"{tmp_path / 'rollout.jsonl'}:2: not a trajectory ({problem})"
    (tmp_path / "rollout.jsonl").write_text(json.dumps(GOOD | {"logprobs": [0, float("-inf"), 0]}) + "\n")
    assert load_trajectories(tmp_path)[0]["logprobs"][1] == float("-inf")  # agentrl's own output: read


def test_a_run_with_nothing_but_a_cut_short_line_is_refused(tmp_path):
    """It used to write an empty page and exit 0."""
    (tmp_path / "rollout.jsonl").write_text(json.dumps(GOOD)[:30])
    with pytest.raises(ConfigError, match=f"^{tmp_path}: no complete trajectory to show$"):
        load_trajectories(tmp_path)


def test_half_a_surrogate_pair_in_a_trajectory_is_shown_as_its_escape(tmp_path):
    """jsonl_line keeps such text as its \\ud83d escape, which reads back as the lone surrogate:
    writing the page then failed with a UnicodeEncodeError, after emptying the view.html before it."""
    from agentrl.rollout.collect import jsonl_line
    from agentrl.types import Trajectory

    traj = Trajectory(task_id="t", group_id="g", messages=[{"role": "tool", "content": "half \ud83d pair"}])
    traj.append([1, 2], trainable=False)
    (tmp_path / "rollout.jsonl").write_text(jsonl_line(traj))
    (tmp_path / "view.html").write_text("an earlier page")
    out = run_view(tmp_path, model="smollm2-135m-instruct")
    page = out.read_text(encoding="utf-8")
    assert "half \\ud83d pair" in page and "an earlier page" not in page
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout.jsonl", "view.html"]  # no staging file left
