"""`agentrl plot`: PNGs from metrics.jsonl for one run and two overlaid, through the real CLI too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from PIL import Image

from agentrl.errors import ConfigError
from agentrl.plot import Run, read_run, run_plot

BLUE, ORANGE = (31, 119, 180), (255, 127, 14)  # matplotlib's C0 and C1


def write_run(path, steps: int, reward_start: float, with_kl: bool = True, with_sync: bool = True):
    path.mkdir(parents=True)
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step, "reward_mean": reward_start + 0.1 * step, "reward_std": 0.05, "accuracy": 0.1 * step,
               "tool_call_rate": min(1.0, 0.2 * step), "response_tokens": 40.0 + step, "mean_turns": 1.5,
               "time_rollout_s": 20.0, "time_logprobs_s": 2.0, "time_update_s": 15.0 + step}
        if with_kl:
            row |= {"kl_ref": 0.001 * step, "approx_kl": 0.0005}
        if with_sync:
            row["time_sync_s"] = 0.5
        rows.append(row)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def colours(png) -> set[tuple[int, int, int]]:
    return {rgb for _, rgb in Image.open(png).convert("RGB").getcolors(maxcolors=1 << 20)}


def test_one_run_writes_every_panel(tmp_path, capsys):
    run = write_run(tmp_path / "grpo", steps=6, reward_start=0.0)
    written = run_plot([run])
    names = ["reward.png", "accuracy.png", "tool_call_rate.png", "kl.png", "lengths.png", "time.png"]
    assert [p.name for p in written] == names and all(p.parent == run / "plots" for p in written)
    assert written[run / "plots" / "kl.png"] == [("grpo", "kl_ref"), ("grpo", "approx_kl")]
    assert written[run / "plots" / "time.png"] == [("grpo", k) for k in
                                                   ("time_rollout_s", "time_logprobs_s", "time_update_s", "time_sync_s")]
    for png in written:
        image = Image.open(png)
        assert image.format == "PNG" and image.size[0] >= 600 and image.size[1] == 400
        assert png.stat().st_size > 10_000 and len(colours(png)) > 50  # drawn, not a blank canvas
    assert BLUE in colours(run / "plots" / "reward.png")
    assert capsys.readouterr().out == f"wrote 6 plots to {run / 'plots'}: {', '.join(names)}\n"


def test_two_runs_overlay_and_missing_keys_are_skipped(tmp_path):
    first = write_run(tmp_path / "a" / "grpo", steps=5, reward_start=0.0)
    second = write_run(tmp_path / "b" / "grpo", steps=3, reward_start=0.3, with_kl=False, with_sync=False)
    written = run_plot([first, second], out=tmp_path / "cmp")
    assert written[tmp_path / "cmp" / "reward.png"] == [("a/grpo", "reward_mean"), ("b/grpo", "reward_mean")]
    assert written[tmp_path / "cmp" / "kl.png"] == [("a/grpo", "kl_ref"), ("a/grpo", "approx_kl")]
    assert ("b/grpo", "time_sync_s") not in written[tmp_path / "cmp" / "time.png"]
    assert ("b/grpo", "time_update_s") in written[tmp_path / "cmp" / "time.png"]
    reward = colours(tmp_path / "cmp" / "reward.png")
    assert BLUE in reward and ORANGE in reward  # both runs' lines are in the picture
    assert ORANGE not in colours(tmp_path / "cmp" / "kl.png")  # the second run has no KL
    assert Image.open(tmp_path / "cmp" / "time.png").size == (1200, 400)  # one stack per run


def test_cli_errors_name_the_run(tmp_path):
    good = write_run(tmp_path / "good", steps=2, reward_start=0.0)
    (tmp_path / "empty").mkdir()
    cases = [((str(good), str(tmp_path / "empty")), f"{tmp_path / 'empty'}: no metrics.jsonl (written by agentrl train)"),
             ((str(tmp_path / "nope"),), f"{tmp_path / 'nope'}: no such run directory")]
    for args, message in cases:
        done = subprocess.run([sys.executable, "-m", "agentrl.cli", "plot", *args], capture_output=True, text=True)
        assert (done.returncode, done.stderr) == (2, f"agentrl: error: {message}\n")
    assert not (good / "plots").exists()  # nothing is written when one run is bad
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "plot", str(good)], capture_output=True, text=True)
    assert done.returncode == 0 and (good / "plots" / "reward.png").is_file()


def test_plot_loads_neither_torch_nor_transformers(tmp_path):
    # It read its files through agentrl.data and tools.base, which import both: 2-3 s a plot.
    good = write_run(tmp_path / "good", steps=2, reward_start=0.0)
    probe = ("import sys; from agentrl.cli import main; rc = main(sys.argv[1:]); "
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules)); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", probe, "plot", str(good)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and (good / "plots" / "reward.png").is_file(), done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_last_line_cut_short_by_a_crash_is_skipped(tmp_path, capsys):
    run = write_run(tmp_path / "crashed", steps=3, reward_start=0.0)
    metrics = run / "metrics.jsonl"
    metrics.write_text(metrics.read_text()[:-40])  # step 3's line half written
    assert [row["step"] for row in read_run(run)] == [1, 2]
    assert capsys.readouterr().err == (f"agentrl: {metrics}:3: the last line is cut short (the run stopped while "
                                       "writing it); skipped\n")
    assert run / "plots" / "reward.png" in run_plot([run])


def test_a_run_whose_metrics_went_nan_still_plots(tmp_path):
    """RunLogger writes a diverged step's NaN loss or infinite grad_norm the way Python's json does
    (NaN, Infinity); plot used to refuse the whole run, exactly when it is wanted most."""
    run = write_run(tmp_path / "diverged", steps=3, reward_start=0.0)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1].replace('"reward_std": 0.05', '"reward_std": NaN, "grad_norm": Infinity')
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    rows = read_run(run)
    assert rows[1]["grad_norm"] == float("inf") and rows[1]["reward_std"] != rows[1]["reward_std"]
    assert run / "plots" / "reward.png" in run_plot([run])


def test_an_out_that_is_a_file_is_refused(tmp_path):
    run = write_run(tmp_path / "run", steps=2, reward_start=0.0)
    (tmp_path / "afile").write_text("")
    for out, message in [(tmp_path / "afile", f"'{tmp_path / 'afile'}' is a file, not a directory"),
                         (tmp_path / "afile" / "plots",
                          f"cannot make directory '{tmp_path / 'afile' / 'plots'}' (Not a directory: "
                          f"'{tmp_path / 'afile' / 'plots'}')")]:
        done = subprocess.run([sys.executable, "-m", "agentrl.cli", "plot", str(run), "--out", str(out)],
                              capture_output=True, text=True)
        assert (done.returncode, done.stderr) == (2, f"agentrl: error: --out: {message}\n")


def test_an_out_that_cannot_be_written_to_is_refused_before_drawing(tmp_path):
    """savefig failed with a traceback; /proc/self is a directory no one, root included, makes files in."""
    run = write_run(tmp_path / "run", steps=2, reward_start=0.0)
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "plot", str(run), "--out", "/proc/self"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("agentrl: error: --out: '/proc/self' is not writable ("), \
        done.stderr


def test_steps_and_values_plot_cannot_use_are_named_or_left_out(tmp_path):
    """A step that is no integer, and an integer past float's range, ended `plot` in a traceback."""
    run = write_run(tmp_path / "odd", steps=3, reward_start=0.0)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1].replace('"reward_std": 0.05', '"reward_std": 1' + "0" * 400)
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert [row["step"] for row in read_run(run)] == [1, 2, 3]
    assert Run("odd", read_run(run)).series("reward_std")[0] == [1, 3]  # step 2's value left out
    assert run / "plots" / "reward.png" in run_plot([run])
    lines[2] = lines[2].replace('"step": 3', '"step": [3]')
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"metrics.jsonl:3: 'step' is \[3\], not an integer$"):
        read_run(run)
    lines[2] = lines[2].replace('"step": [3]', '"step": 1' + "0" * 400)  # matplotlib: OverflowError
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"metrics.jsonl:3: 'step' is 1" + "0" * 39 + "…, too large for a step$"):
        read_run(run)
