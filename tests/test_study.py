"""`parity study`: figure definitions on hand-made metrics, config validation, and the --quick
grid end to end (the CI smoke run)."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from parity.apps.study_grid import DEFAULT_GRID, load_study
from parity.cli import main
from parity.errors import ConfigError
from parity.metrics.sinks import read_metrics
from parity.metrics.summary import row_figures


def _metrics(n=20):
    rows = []
    for s in range(n):
        rows.append({"step": s, "is_weight/max": 2.0 if s == 7 else 1.0, "mismatch/k3": 0.01 * (s + 1),
                     "mismatch/kernel_max_abs": 0.0, "train/grad_norm": 0.1 * s, "reward/mean": s / n,
                     "lag/mean": 1.0, "lag/max": 3.0, "time/wall_s": 10.0 * (s + 1),
                     "throughput/steps_per_hour": 360.0})
    rows[0]["eval/pass@1"] = 0.2
    rows[10]["eval/pass@1"] = 0.5
    rows[-1]["eval/pass@1_final"] = 0.4
    return rows


def test_row_figures_follow_the_published_definitions():
    f = row_figures(_metrics())
    assert f["is_peak_over_median"] == 2.0  # peak 2 over median 1 of the per-step max weight
    # first and last 2 of 20 steps
    assert f["kl_first"] == pytest.approx(0.015) and f["kl_last"] == pytest.approx(0.195)
    assert f["kl_last_over_first"] == pytest.approx(13.0)
    assert f["grad_norm_max"] == pytest.approx(1.9)
    assert f["reward_first5"] == 0.0 and f["reward_last5"] == pytest.approx(0.95)  # 1 of 20 steps
    assert (f["pass1_start"], f["pass1_peak"], f["pass1_end"]) == (0.2, 0.5, 0.4)
    assert f["kernel_mismatch_max"] == 0.0 and f["lag_max"] == 3.0 and f["wall_s"] == 200.0


def test_report_tables_say_what_was_not_measured_and_give_wilson_intervals():
    """pass@1's 95% CI is Wilson's (the normal approximation printed ± 0.0% at 5/5 and ran past
    100%: 98.5% ± 1.7%); a run without the kernel/lag decomposition reads 'not measured' (was
    the headline 'exactly 0'); a demo without evaluations gets its table (was a TypeError after
    the whole run); throughput leaves out start-up and evaluations."""
    from parity.metrics.summary import demo_rows, run_rows, wilson

    lo, hi = wilson(197 / 200, 200)
    assert (round(lo, 3), round(hi, 3)) == (0.957, 0.995)
    lo, hi = wilson(1.0, 5)
    assert (round(lo, 3), hi) == (0.566, 1.0) and wilson(0.0, 5)[0] == 0.0
    rows = _metrics(12)
    rows[-1]["eval/problems_final"] = 5.0
    for r in rows:
        del r["mismatch/kernel_max_abs"]
        r.pop("eval/pass@1", None)
        r["throughput/steady_steps_per_hour"] = 900.0
    assert dict(run_rows(rows))["kernel mismatch max |Δ| (all steps)"].startswith("not measured")
    table = dict(demo_rows(rows))
    assert table["held-out pass@1 (greedy), before -> after"].startswith("not evaluated -> 40.0% (95% CI")
    speed = "learner steps/hour (after the first step, evaluations out); sampled tokens/s"
    assert table[speed].startswith("900;")
    recheck = "learner process vs rollout worker, old tokens re-scored: max |Δ| (steps)"
    assert table[recheck] == "-"  # (none re-scored: a synchronous or MoE run)
    rows[3]["mismatch/learner_recheck_max_abs"], rows[7]["mismatch/learner_recheck_max_abs"] = 0.0, 2e-3
    assert dict(demo_rows(rows))[recheck] == "0.002 (2)"
    from parity.metrics.summary import token_mean  # per-token figures weigh each step by its tokens

    short_long = [{"step": 0, "lag/mean": 0.0, "response/length_mean": 1.0},
                  {"step": 1, "lag/mean": 2.0, "response/length_mean": 3.0}]
    assert token_mean(short_long, "lag/mean") == 1.5  # (the plain mean over steps read 1.0)


def test_lag_figures_leave_out_the_warm_up_of_a_bound():
    """A fixed-64 row's lag is the step number during its first 64 steps: its KL's first 10% and
    its weight-lag mean were taken over those, so they measured the run's length, not lag 64."""
    rows = _metrics(100)
    for r in rows:
        r["lag/bound"] = 64.0
        r["mismatch/k3"] = 0.01 * min(r["step"], 64)  # KL grows with the lag, then stays
        r["mismatch/weight_lag_mean_abs"] = 0.001 * min(r["step"], 64)
        r["loss/frac_rejected"] = 0.0 if r["step"] < 64 else 0.25  # (a gate: what it rejects at the bound)
    f = row_figures(rows)
    assert f["kl_last_over_first"] == pytest.approx(1.0) and f["weight_lag_mean_abs"] == pytest.approx(0.064)
    assert f["rejected_frac"] == 0.25 and math.isnan(row_figures(_metrics())["rejected_frac"])
    for r in rows:
        r["lag/bound"] = 0.0  # the control: counted from step 0, the same run reads x3.6
    assert row_figures(rows)["kl_last_over_first"] > 3


def test_lag_zero_aligned_weights_give_exactly_one():
    rows = _metrics()
    for r in rows:
        r["is_weight/max"] = 1.0
    assert row_figures(rows)["is_peak_over_median"] == 1.0


def test_study_config_errors_are_one_line(tmp_path):
    bad = tmp_path / "s.toml"
    bad.write_text('seeds = []\n')
    with pytest.raises(ConfigError, match="seeds"):
        load_study(str(bad))
    bad.write_text('colour = "red"\n')
    with pytest.raises(ConfigError, match="unknown study key colour"):
        load_study(str(bad))
    bad.write_text('[[runs]]\nname = "x"\nkernels = "fast"\n')
    with pytest.raises(ConfigError, match="kernels"):
        load_study(str(bad), quick=True, out_dir=str(tmp_path / "o"))
    bad.write_text('[[runs]]\nname = "x"\nstaleness = "sometimes"\n')
    with pytest.raises(ConfigError, match="staleness"):
        load_study(str(bad))
    for text, message in (("runs = 5\n", "expected \\[\\[runs\\]\\] tables"),
                          ('[[runs]]\nkernels = "aligned"\n', "table 1 has no name"),
                          ('[[runs]]\nname = "x"\ncolour = 1\n', "x: unknown key colour")):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_study(str(bad))
    names = ["sync", "async-8", "fixed-64", "std-fixed-64", "std-fixed-64-tis", "fixed-64-tis",
             "std-fixed-64-gate", "fixed-64-fp32", "std-fixed-64-fp32"]
    assert [r.name for r in DEFAULT_GRID] == names


def test_an_interrupted_study_run_goes_on_from_its_checkpoint(tmp_path):
    """A run with no report.md, written with the same config, resumes from a sound checkpoint
    short of its end; another config's run (a --quick study's, say), a finished one or a corrupt
    checkpoint starts over (its checkpoints cleared, never mixed)."""
    from parity.apps.study import _restart
    from parity.config import load_config
    from parity.rl.controller import Controller

    def cfg(steps):
        return load_config(None, ['model.preset="tiny"', "rollout.prompts_per_step=2", "rollout.group_size=2",
                                  "rollout.max_tokens=4", "eval_every=0", "checkpoint_every=2",
                                  f"steps={steps}", f'run_dir="{tmp_path}"'])

    assert _restart(cfg(2)) == {"overwrite": True}  # nothing there yet
    Controller(cfg(4)).run()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    shutil.rmtree(tmp_path / "checkpoint-4")  # as if stopped after its checkpoint at step 2
    assert _restart(cfg(4)) == {"resume": True}
    assert _restart(cfg(3)) == {"overwrite": True}  # another config (steps): never continued
    (tmp_path / "report.md").write_text("finished")
    assert _restart(cfg(4)) == {"overwrite": True}  # a report: that run had finished
    (tmp_path / "report.md").unlink()
    (tmp_path / "checkpoint-2" / "manifest.json").write_text("{")
    assert _restart(cfg(4)) == {"overwrite": True}


def test_a_study_never_replaces_another_config_s_runs_without_overwrite(tmp_path, capsys, monkeypatch):
    """A study into a directory holding runs of other settings (a --quick study into a full one's
    runs/study, say) is refused before anything trains, naming the run; --overwrite trains it
    again. (It replaced the finished runs without a word: hours of a full study.)"""
    study = tmp_path / "s.toml"
    text = '''task = "target_tokens"
seeds = [0]
[train]
steps = STEPS
eval_every = 0
"model.checkpoint" = ""
"model.preset" = "tiny"
"rollout.prompts_per_step" = 1
"rollout.group_size" = 2
"rollout.max_tokens" = 2
[[runs]]
name = "a"
'''
    out = tmp_path / "out"
    study.write_text(text.replace("STEPS", "2"))
    assert main(["study", str(study), "--out", str(out)]) == 0
    finished = (out / "a-seed0" / "report.md").read_text()
    assert main(["study", str(study), "--out", str(out)]) == 0  # the control: the same study skips it
    monkeypatch.chdir(tmp_path)  # and the same study with --out spelled otherwise (was refused)
    assert main(["study", str(study), "--out", "out"]) == 0
    assert (out / "a-seed0" / "report.md").read_text() == finished
    study.write_text(text.replace("STEPS", "1"))
    capsys.readouterr()
    assert main(["study", str(study), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "a-seed0 holds a run of other settings" in err and "--overwrite" in err
    # (one line; a CPU without bf16 instructions may warn before it, as every bf16 command does there)
    assert len([line for line in err.splitlines() if not line.startswith("parity: warning:")]) == 1
    assert (out / "a-seed0" / "report.md").read_text() == finished  # untouched
    assert main(["study", str(study), "--out", str(out), "--overwrite"]) == 0
    assert len(read_metrics(out / "a-seed0")) == 1


def test_quick_study_runs_the_default_grid_end_to_end(tmp_path, capsys):
    """The CI smoke run: every row of the default grid, its report, the results page built from
    it, and --report-only on finished and missing runs."""
    out = tmp_path / "study"
    assert main(["study", "--quick", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert list(results["runs"]) == [r.name for r in DEFAULT_GRID]
    for name, r in results["runs"].items():
        fig = r["figures"]
        if r["run"]["kernels"] == "aligned":
            assert fig["kernel_mismatch_max"]["mean"] == 0.0, name
        if name == "sync":
            assert fig["is_peak_over_median"]["mean"] == 1.0
    report = (out / "report.md").read_text()
    assert "| sync | aligned | 0 | reinforce_zero |" in report and (out / "study.png").exists()
    assert "std-fixed-64-gate" in capsys.readouterr().out

    # the results page from this study: the published-comparison table with a verdict per figure,
    # the lag check and the mechanism tables, written where asked (not over docs/)
    page = tmp_path / "page"
    page.mkdir()
    script = Path(__file__).resolve().parents[1] / "docs" / "make_results.py"
    proc = subprocess.run([sys.executable, str(script), "--study", str(out), "--out", str(page)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = (page / "results.md").read_text()
    assert "| importance-weight peak/median | 1.5 / 442.54 |" in text
    assert results["code"] and f"Code: {results['code']}." in text  # which code produced the page
    assert "The premise holds exactly" in text  # aligned rows at 0 and sync's weights at 1 here
    assert "| fixed-64 | 64 |" in text and "exactly the bound?" in text
    assert "**kernel mismatch: mean |Δ log-prob| at the sampling version**" in text
    assert (page / "study.png").exists()
    assert "| standard + TIS | aligned + TIS |" in text and "**Truncation or kernels?**" in text
    assert "of responses once the lag bound held" in text  # (the gate's rejection rate)
    # a study from before the aligned + TIS row: its page is built without that column
    older = tmp_path / "older"
    older.mkdir()
    (older / "results.json").write_text(json.dumps(
        {**results, "runs": {k: v for k, v in results["runs"].items() if k != "fixed-64-tis"}}))
    proc = subprocess.run([sys.executable, str(script), "--study", str(older), "--out", str(page)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = (page / "results.md").read_text()
    assert "| standard + TIS | standard + sequence gate |" in text and "Truncation or kernels?" not in text

    # what the page says follows the numbers (a 2026-12-07 audit: "holds exactly" checked two of the
    # aligned rows, "accuracy fell" was said of NaN, "nanx sync", a crash on a figure not measured)
    spec = importlib.util.spec_from_file_location("make_results", script)
    pages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pages)
    said = " ".join(pages.reasons(results, None, None))
    assert "The premise holds exactly" in said and "async-8 reached" in said  # the controls
    edited = copy.deepcopy(results)
    edited["runs"]["fixed-64-tis"]["figures"]["kernel_mismatch_max"]["values"] = [0.02]
    assert "The premise does not hold" in " ".join(pages.reasons(edited, None, None))
    for run in edited["runs"].values():
        for key in ("pass1_start", "pass1_end"):
            run["figures"][key]["values"] = [None]
    del edited["runs"]["async-8"]
    said = " ".join(pages.reasons(edited, None, None))
    assert "not measured (no evaluations" in said and "there is no async-8 row" in said
    edited["runs"]["fixed-64"]["figures"]["kernel_mismatch_max"]["values"] = [float("nan")]
    assert pages.comparison(edited)[2].endswith("| - |")
    assert pages.worse([math.inf], [1.0]) == "yes (one seed)"  # (an infinite rise read "within spread")
    assert pages.worse([3.0, 4.0], [1.0, 1.5]) == "yes (two seeds)"

    # a report from finished runs only: drop one row's run, nothing is trained, the row is left out
    shutil.rmtree(out / "std-fixed-64-gate-seed0")
    assert main(["study", "--quick", "--out", str(out), "--report-only"]) == 0
    partial = json.loads((out / "results.json").read_text())
    assert "std-fixed-64-gate" not in partial["runs"] and not (out / "std-fixed-64-gate-seed0").exists()
    assert partial["runs"]["sync"]["figures"] == results["runs"]["sync"]["figures"]
    # the same directory asked for the math task: the tool runs there are not its runs (they were
    # reported under a math heading before)
    assert main(["study", "--quick", "--task", "math", "--out", str(out), "--report-only"]) == 2
    assert "no finished study runs" in capsys.readouterr().err
    shutil.rmtree(out)
    out.mkdir()
    assert main(["study", "--quick", "--out", str(out), "--report-only"]) == 2
    assert "no finished study runs" in capsys.readouterr().err
    missing = tmp_path / "missing"  # a report of nothing: the directory was made first
    assert main(["study", "--quick", "--out", str(missing), "--report-only"]) == 2
    assert "no finished study runs" in capsys.readouterr().err and not missing.exists()


def test_study_runs_at_the_base_policies_level_and_math_uses_base_math(tmp_path):
    from parity.apps.study import run_config

    for task, base in (("tool", "base"), ("math", "base-math")):
        study = load_study(None, task=task)
        cfg = run_config(study, study.runs[0], 0)
        assert cfg.task.level == 1 and cfg.model.checkpoint == base and cfg.task.name == task
        quick = load_study(None, task=task, quick=True, out_dir="/tmp/q")  # its smoke base: the task's
        expected = {"tool": "/tmp/q/quick-base", "math": "/tmp/q/quick-base-math"}[task]
        assert quick.train["model.checkpoint"] == expected
    # your own task: its task.* keys in the [train] table, on every cell of the grid
    path = tmp_path / "study.toml"
    path.write_text('task = "custom"\nseeds = [1]\n[train]\n"task.env" = "my_env.py:MyEnv"\n'
                    '"task.options.level" = 2\n')
    study = load_study(str(path))
    cfg = run_config(study, study.runs[2], 1)
    assert cfg.task.name == "custom" and cfg.task.env.endswith("/my_env.py:MyEnv")
    assert cfg.task.options == {"level": 2} and cfg.max_policy_lag == 64 and cfg.seed == 1
    # a row's own training keys (an objective's parameters) over the [train] table, that row alone
    study = load_study("configs/study_objectives.toml")
    cells = {run.name: run_config(study, run, 0) for run in study.runs}
    assert cells["fixed-64-dapo"].learner.loss_config.ppo_eps_high == 0.28
    assert cells["fixed-64-dapo"].learner.loss_config.aggregation == "token"
    assert cells["fixed-64-gspo"].learner.loss_config.aggregation == "response"
    study = load_study("configs/study_updates.toml")  # several updates per batch
    cells = {run.name: run_config(study, run, 0) for run in study.runs}
    assert [(c.learner.loss, c.learner.mini_batches) for c in cells.values()] == \
        [("reinforce_zero", 4), ("decoupled_ppo", 4), ("decoupled_ppo", 4), ("reinforce_zero", 4)]
    assert not any(c.learner.shuffle for c in cells.values())  # (as docs/results.md measured them)
    assert cells["fixed-64-decoupled-4up-cap5"].learner.loss_config.behav_cap == 5.0
    assert cells["fixed-64-4up-lr-quarter"].learner.lr == 1.25e-5


@pytest.mark.parametrize("text, message", [
    ("seeds = 5", "study.seeds must be a list of integers >= 0, got 5"),
    ("seeds = [1, 1]", "study.seeds must be non-empty and without repeats"),
    ("train = 5", "study train: expected a [train] table of config keys, got 5"),
    ("out_dir = 5", "study.out_dir must be a directory path, got 5"),
    ("[[runs]]\nname = [1]", "study runs: name must be a non-empty string, got [1]"),
    ('[[runs]]\nname = "a"\ntrain = {"learner.loss" = "tis"}',
     "study run 'a': train sets learner.loss, which comes from the row's loss"),
    ('[[runs]]\nname = "a"\ntrain = 3', "study run 'a': train must be a table of training keys, got 3"),
    # the study's [train] table: these were replaced by each row's own without a word (the runs
    # trained another loss or lag than the file said); a default dtype and steps stay allowed
    ('[train]\n"learner.loss" = "tis"', "study [train] sets learner.loss, which every row sets from the "
     "row's loss: set it there"),
    ("[train]\nmax_policy_lag = 4", "study [train] sets max_policy_lag, which every row sets from the row"),
    ('[train]\nrun_dir = "/tmp/x"', "study [train] sets run_dir, which every row sets from the row's name"),
    ('[train]\n"task.name" = "math"', "study [train] sets task.name, which every row sets from the study's"),
    ('[[runs]]\nname = "a"\ntrain = {"learner.loss_config.ppo_eps" = -1}',
     "study run a: LossConfig.ppo_eps must be > 0"),
])
def test_a_study_config_of_the_wrong_types_is_one_line(tmp_path, text, message):
    """Each was a traceback (a repeated seed counted a seed twice) before a review of 2026-12-05."""
    path = tmp_path / "study.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_study(str(path))


def test_a_studys_train_table_may_set_the_default_dtype_and_steps(tmp_path):
    path = tmp_path / "study.toml"
    path.write_text('[train]\n"model.dtype" = "float32"\nsteps = 7\n')
    study = load_study(str(path))
    assert study.train["model.dtype"] == "float32" and study.train["steps"] == 7


def test_a_run_written_before_a_config_field_was_added_is_still_this_studys(tmp_path):
    """A finished or interrupted run is recognised by its config.toml read as a config, not as text:
    one written by an earlier parity lacks the fields added since (compared as text, every run of
    an earlier study trained again, and an interrupted one started over, its checkpoints cleared)."""
    from parity.apps.study import _wrote, run_config
    from parity.config import to_toml

    study = load_study(None, out_dir=str(tmp_path))
    cfg = run_config(study, study.runs[0], 0)
    text = to_toml(cfg)
    old = "\n".join(line for line in text.splitlines()
                    if not line.startswith(("reward = ", "max_prompt_tokens = ", "[task.options]")))
    path = tmp_path / "config.toml"
    path.write_text(old)
    assert old != text and _wrote(path, cfg)
    path.write_text(old.replace("seed = 0", "seed = 1"))
    assert not _wrote(path, cfg)  # another run's

