"""`parity sft` (demonstrations, tokenizer, checkpoint), `parity eval` and `parity demo` end to
end on a briefly trained base policy."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parity.apps.sft import (
    RECIPES,
    SFTConfig,
    encode_demo,
    read_record,
    resolve_base,
    tool_demonstration,
    train_sft,
)
from parity.cli import main
from parity.config import BASE_CHECKPOINTS, ModelSection, TrainConfig
from parity.envs.math import MathTask, column_sums, score, worked_answer
from parity.envs.tool import ToolEnv, make_tool_problem
from parity.errors import ConfigError
from parity.model import load_model
from parity.model.tokenizer import HFTokenizer, build_char_tokenizer


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    out = tmp_path_factory.mktemp("base") / "ckpt"
    train_sft(out, SFTConfig(steps=3, batch_size=4), eval_problems=0)
    return out


def test_sft_writes_a_loadable_checkpoint_with_its_tokenizer(base):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "sft.json"):
        assert (base / name).exists()
    model = load_model(base)
    tok = HFTokenizer(base / "tokenizer.json")
    assert model.config.vocab_size >= tok.vocab_size and model.config.eos_token_id == tok.token_id("<|eos|>")
    for special in ("<|user|>", "<|assistant|>", "<python>", "</python>", "<result>", "</result>"):
        assert len(tok.encode(special)) == 1
    record = json.loads((base / "sft.json").read_text())
    assert record["config"]["steps"] == 3


def test_demonstrations_replay_exactly_through_the_real_environment(tmp_path):
    """Every tool demonstration, fed turn by turn to the environment (real sandbox), gets the
    observations the demonstration contains and reward 1: the base policy learns the format the
    environment really produces."""
    path = tmp_path / "tokenizer.json"
    build_char_tokenizer().save(str(path))
    tok = HFTokenizer(path)
    env = ToolEnv(tok, level=1)
    rnd = random.Random(0)
    cfg = SFTConfig(retry_fraction=0.5, tool_use={"mul": 1.0, "sum": 1.0})
    for i in range(4):
        problem = make_tool_problem(("mul", "sum")[i % 2], 1, rnd)
        segments = tool_demonstration(problem, rnd, cfg)
        episode = env.start(problem)
        k = 0
        while k < len(segments):
            text, mask = segments[k]
            assert mask == 1
            turn = env.step(episode, tok.encode(text))
            if turn.done:
                break
            assert tok.decode(turn.observation) == segments[k + 1][0]
            k += 2
        assert turn.done and turn.reward == 1.0 and k == len(segments) - 1


def test_demo_loss_mask_covers_only_model_turns(tmp_path):
    path = tmp_path / "tokenizer.json"
    build_char_tokenizer().save(str(path))
    tok = HFTokenizer(path)
    turns = [("<python>print(1*2)</python>", 1), ("<result>2\n</result>", 0), ("answer: 2<|eos|>", 1)]
    ids, mask = encode_demo(tok, "<|user|>What is 1*2?<|assistant|>", turns)
    assert len(ids) == len(mask) and mask[0] == 0
    assert sum(mask) == len(tok.encode(turns[0][0])) + len(tok.encode(turns[2][0]))
    assert [t for t, m in zip(ids, mask) if m == 0][-len(tok.encode(turns[1][0])):] == tok.encode(turns[1][0])


def test_bad_sft_config_is_a_one_line_error():
    with pytest.raises(ConfigError, match="tool_use.mul"):
        SFTConfig(tool_use={"mul": 1.5})
    with pytest.raises(ConfigError, match="steps"):
        SFTConfig(steps=0)


def test_math_problems_for_sft_never_come_from_the_heldout_set():
    t = MathTask("add", 1, seed=0)
    held = {p.prompt for p in t.heldout()}
    assert held.isdisjoint(t.problems(i, 1)[0].prompt for i in range(300))


def test_cli_eval_reports_pass_at_1_and_mean_at_k(base, capsys):
    args = ["eval", "--model", str(base), "--task", "tool", "--n", "3", "-k", "2", "--max-tokens", "8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "pass@1 (greedy)" in out and "mean@2" in out and "sandbox:" in out
    assert main(["eval", "--model", str(base), "--task", "math", "--n", "3", "-k", "0", "--json",
                 "--max-tokens", "8"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["eval/problems"] == 3.0


def test_cli_eval_rejects_a_checkpoint_without_tokenizer(tmp_path, capsys):
    from parity.model import Model, ModelConfig

    Model(ModelConfig.preset("tiny")).save_pretrained(tmp_path)
    assert main(["eval", "--model", str(tmp_path), "--task", "tool", "--n", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tokenizer.json" in err[0]


def test_cli_demo_runs_end_to_end(base, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    code = main(["demo", "--model", str(base), "--steps", "2", "--eval-prompts", "3", "--run-dir", str(run),
                 "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=2",
                 "--set", "rollout.max_tokens=8"])
    assert code == 0
    out = capsys.readouterr().out
    assert "held-out pass@1 (greedy), before -> after" in out
    assert "rollout-learner KL at the sampling version (max)" in out
    for name in ("metrics.jsonl", "report.md", "report.png"):
        assert (run / name).exists()
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert "eval/pass@1" in metrics[0] and "eval/pass@1_final" in metrics[-1]
    assert all(m["mismatch/kernel_max_abs"] == 0.0 for m in metrics if "mismatch/kernel_max_abs" in m)

    # a later demo replaces its own earlier run; another command's run only with --overwrite
    other = tmp_path / "trained"
    (other / "checkpoint-5").mkdir(parents=True)
    small = ["--model", str(base), "--steps", "1", "--eval-prompts", "2", "--set",
             "rollout.prompts_per_step=2", "--set", "rollout.group_size=2", "--set", "rollout.max_tokens=8"]
    assert main(["demo", "--run-dir", str(other), *small]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("parity: error:")]
    assert len(err) == 1 and "holds checkpoint-5 of another command's run" in err[0] and "--run-dir" in err[0]
    assert (other / "checkpoint-5").is_dir()
    several = ["--set", "learner.loss=\"decoupled_ppo\"", "--set", "learner.mini_batches=2"]
    for run_dir, extra in ((run, []), (other, ["--overwrite", *several])):
        assert main(["demo", "--run-dir", str(run_dir), *small, *extra]) == 0, capsys.readouterr().err
        assert [p.name for p in sorted(run_dir.glob("checkpoint-*"))] == ["checkpoint-1"]
    assert "async decoupled_ppo, 2 updates per batch" in capsys.readouterr().out  # (the demo names it)
    # also in the default run dir (runs/demo): a `parity train` run there was deleted unasked
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "demo" / "checkpoint-5").mkdir(parents=True)
    assert main(["demo", *small]) == 2 and (tmp_path / "runs" / "demo" / "checkpoint-5").is_dir()
    assert "--overwrite" in capsys.readouterr().err
    # a recipe's name, as every other command's --model takes it (was refused as unresolved)
    import parity.apps.sft as sft

    monkeypatch.setattr(sft, "base_dir", lambda c=None: base)
    assert main(["demo", *small[2:], "--model", "base", "--run-dir", str(tmp_path / "named")]) == 0, \
        capsys.readouterr().err
    assert str(base) in (tmp_path / "named" / "config.toml").read_text()


@given(st.integers(0, 10**6), st.integers(0, 10**6))
@settings(max_examples=200, deadline=None)
def test_column_sums_read_back_to_the_sum(a, b):
    """The column format is a correct worked solution: each step is digit + digit (+ carry) = its
    sum, and the answer is the last step's sum followed by the earlier steps' last digits."""
    steps = [s for s in column_sums(a, b).split(" ") if s]
    carry, digits = 0, []
    for i, step in enumerate(steps):
        lhs, total = step.split("=")
        parts = [int(x) for x in lhs.split("+")]
        assert parts[0] == (a // 10**i) % 10 and parts[1] == (b // 10**i) % 10
        assert parts[2:] == ([1] if carry else []) and int(total) == sum(parts)
        carry = int(total) // 10
        digits.append(total if i == len(steps) - 1 else total[-1])
    assert int("".join(reversed(digits))) == a + b


def test_columns_demonstrations_score_1_and_direct_ones_too():
    t = MathTask("add", 1, seed=0)
    for p in t.problems(0, 20):
        assert score(p, worked_answer(p, "columns")) == 1.0 == score(p, worked_answer(p, "direct"))
    with pytest.raises(ConfigError, match="add task"):
        worked_answer(MathTask("mul", 1).problems(0, 1)[0], "columns")
    with pytest.raises(ConfigError, match="math_columns needs math_task 'add'"):
        SFTConfig(math_columns=0.5, math_task="sub")
    with pytest.raises(ConfigError, match="math_columns"):
        SFTConfig(math_columns=1.5)


def test_named_base_recipes_and_their_cache_keys():
    assert set(RECIPES) == set(BASE_CHECKPOINTS)
    assert RECIPES["base-math"].math_columns > 0 and RECIPES["base-math"].tool_fraction == 0.0
    # the default recipe's key is pinned: a change rebuilds every user's cached base policy, so
    # it must be deliberate (recipe 4) ...
    assert SFTConfig().key() == RECIPES["base"].key() == "dafc31c53adb"
    # ... while any other value is its own recipe
    assert len({r.key() for r in RECIPES.values()}) == len(RECIPES)
    cfg = resolve_base(TrainConfig(model=ModelSection(checkpoint="/some/dir")))
    assert cfg.model.checkpoint == "/some/dir"  # a directory is left alone


def test_base_math_learns_column_addition(tmp_path):
    """A few steps of the base-math recipe on column-sum demonstrations already lower the loss
    well below a uniform guess over the vocabulary (the recipe trains, end to end)."""
    import dataclasses
    import math

    record = train_sft(tmp_path / "m", dataclasses.replace(RECIPES["base-math"], steps=30, batch_size=8),
                       eval_problems=0)
    vocab = len(json.loads((tmp_path / "m" / "tokenizer.json").read_text())["model"]["vocab"])
    assert record["final_loss"] < 0.5 * math.log(vocab)


def test_an_interrupted_or_damaged_base_build_leaves_nothing_half_built(tmp_path, capsys, monkeypatch):
    """A build stopped by Ctrl-C or SIGTERM (now raised as an exception by the CLI) left its
    `OUT.tmpPID` directory behind for good; a killed one's is removed by the next build; a
    damaged sft.json was a traceback."""
    out = tmp_path / "base"
    import socket

    for name, builder in (("base.tmp999999999", socket.gethostname()), ("base.tmp1", "another-host"),
                          ("base.tmp2", None)):
        (tmp_path / name).mkdir()  # a build killed outright here (no such process); another
        if builder:                # machine's on a shared cache; a directory of the user's
            (tmp_path / name / ".builder").write_text(f"{builder} 999999999\n")

    def stop(step, loss, elapsed):
        if step == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_sft(out, SFTConfig(steps=5, batch_size=2), progress=stop, eval_problems=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.partial", "base.tmp1", "base.tmp2"]
    import shutil

    shutil.rmtree(tmp_path / "base.partial")  # (kept steps: see test_a_stopped_base_build_resumes...)
    for name in ("base.tmp1", "base.tmp2"):
        (tmp_path / name / ".builder").unlink(missing_ok=True)
        (tmp_path / name).rmdir()
    import parity.rl.evaluate

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(parity.rl.evaluate, "evaluate", stopped)
    with pytest.raises(KeyboardInterrupt):  # stopped in its evaluation: the trained policy is kept
        train_sft(out, SFTConfig(steps=2, batch_size=2), eval_problems=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"] and "heldout" not in read_record(out)
    assert not (out / ".builder").exists()
    capsys.readouterr()  # (its warning, where an earlier test set up the CLI's logging)
    for damaged in ("[1]", '{"heldout": {}}', "{bad", '{"heldout": {"tool": [0.5]}}'):
        (out / "sft.json").write_text(damaged)
        assert main(["sft", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"parity: error: {out / 'sft.json'}")
        assert err.endswith("rebuild it with --force\n")


def test_a_base_in_out_built_with_other_settings_is_not_handed_back(tmp_path, capsys):
    """`parity sft --out DIR` said "already built" and showed whatever DIR held (a 30-step tool
    base for `--recipe base-math`); a build of other settings there is now refused in one line."""
    from parity.cli import main

    out = tmp_path / "b"
    assert main(["sft", "--out", str(out), "--steps", "2", "--eval-problems", "0"]) == 0
    capsys.readouterr()
    assert main(["sft", "--out", str(out), "--steps", "2"]) == 0  # the same settings: shown
    assert "already built" in capsys.readouterr().out
    for argv, named in ((["--recipe", "base-math", "--steps", "2"], "tool_fraction = 0.8"),
                        ([], "steps = 2, not the"), (["--steps", "2", "--seed", "5"], "seed = 0")):
        assert main(["sft", "--out", str(out), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"parity: error: {out} holds a base policy built with {named}"), err
        assert err.endswith("--force rebuilds it there, or choose another --out\n") and err.count("\n") == 1
    import json

    record = json.loads((out / "sft.json").read_text())
    del record["config"]["lr"]  # (a field added since the build: its default, the one asked)
    (out / "sft.json").write_text(json.dumps(record))
    assert main(["sft", "--out", str(out), "--steps", "2"]) == 0
    (out / "sft.json").write_text(json.dumps({**record, "recipe": record["recipe"] - 1}))
    assert main(["sft", "--out", str(out), "--steps", "2"]) == 2
    assert "holds a base policy of recipe version" in capsys.readouterr().err


def test_a_stopped_base_build_resumes_to_the_same_bits(tmp_path):
    """Ctrl-C in `parity sft` threw every step away. The steps trained are kept in OUT.partial
    (a signal during a step is held until it ends) and the next build of the same recipe resumes
    there: its weights equal an uninterrupted build's bit for bit; a build of another recipe
    starts over (the control: it does not give the kept build's weights)."""
    import os
    import signal

    import torch
    from safetensors.torch import load_file

    cfg = SFTConfig(steps=6, batch_size=2)
    train_sft(tmp_path / "whole", cfg, eval_problems=0)

    def stop_at(n, how):
        def progress(step, loss, elapsed):
            if step == n:
                how()
        return progress

    out = tmp_path / "base"
    with pytest.raises(KeyboardInterrupt):  # a SIGINT in step 2's progress: held to the step's end
        train_sft(out, cfg, progress=stop_at(1, lambda: os.kill(os.getpid(), signal.SIGINT)), eval_problems=0)
    assert (tmp_path / "base.partial" / "state.pt").exists() and not out.exists()
    assert torch.load(tmp_path / "base.partial" / "state.pt", weights_only=True)["step"] == 2

    def interrupt():
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):  # resumed at 2, stopped again at 4
        train_sft(out, cfg, progress=stop_at(3, interrupt), eval_problems=0)
    assert torch.load(tmp_path / "base.partial" / "state.pt", weights_only=True)["step"] == 4
    record = train_sft(out, cfg, eval_problems=0)
    assert not (tmp_path / "base.partial").exists()
    whole, resumed = load_file(tmp_path / "whole" / "model.safetensors"), load_file(out / "model.safetensors")
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert record["final_loss"] == json.loads((tmp_path / "whole" / "sft.json").read_text())["final_loss"]
    # the control: kept steps whose demonstrations' random state is lost resume to other bits
    import random

    with pytest.raises(KeyboardInterrupt):
        train_sft(tmp_path / "lost", cfg, progress=stop_at(1, interrupt), eval_problems=0)
    state = torch.load(tmp_path / "lost.partial" / "state.pt", weights_only=True)
    torch.save({**state, "rnd": random.Random(cfg.seed).getstate()}, tmp_path / "lost.partial" / "state.pt")
    train_sft(tmp_path / "lost", cfg, eval_problems=0)
    lost = load_file(tmp_path / "lost" / "model.safetensors")
    assert not all(torch.equal(whole[k], lost[k]) for k in whole)
    # steps kept by another recipe's build are not resumed: the build starts over
    with pytest.raises(KeyboardInterrupt):
        train_sft(tmp_path / "other", cfg, progress=stop_at(1, interrupt), eval_problems=0)
    doubled = SFTConfig(steps=6, batch_size=2, lr=cfg.lr * 2)
    train_sft(tmp_path / "other", doubled, eval_problems=0)
    train_sft(tmp_path / "fresh", doubled, eval_problems=0)
    other, fresh = (load_file(tmp_path / name / "model.safetensors") for name in ("other", "fresh"))
    assert all(torch.equal(other[k], fresh[k]) for k in fresh) and not (tmp_path / "other.partial").exists()


def test_a_run_resumes_after_its_starting_checkpoint_went(base, tmp_path):
    """The task's tokenizer comes from the run's own checkpoint once the directory the run started
    from is gone (the resume was refused for want of its tokenizer.json, the copy beside the
    weights unused, and model.checkpoint cannot be changed on a resume)."""
    import shutil

    from parity.config import load_config
    from parity.rl import Learner, checkpoint
    from parity.rl.controller import Controller

    start = tmp_path / "mybase"
    shutil.copytree(base, start)
    cfg = load_config(None, ['task.name="math"', "task.heldout_size=4", "eval_prompts=4", "steps=2",
                             f'model.checkpoint="{start}"', f'run_dir="{tmp_path / "run"}"'])
    model = load_model(start)
    checkpoint.save(tmp_path / "run", 1, model, Learner(model, cfg.learner), start / "tokenizer.json")
    shutil.rmtree(start)
    run = Controller(cfg, resume=True)  # (refused here: no tokenizer.json in mybase)
    assert run.cfg.task.tokenizer == str(tmp_path / "run" / "checkpoint-1" / "tokenizer.json")
    assert run.cfg.model.checkpoint == str(start)  # (the run's record of where it started stays)
    assert run.env.describe() and run.start_step == 1


def test_a_cached_base_does_not_hang_on_the_asking_processs_threads(tmp_path, monkeypatch, capfd):
    """The base policy is built in a fresh process (`sft_child`), so a process on one thread (this
    pytest-xdist worker's share, OMP_NUM_THREADS included) or one that called set_num_threads gets
    the bits of a `parity sft` started in a clean shell (the control is the next test). A build
    inside another command shows its progress on stderr: `parity eval --json`'s stdout stays one
    JSON object."""
    import hashlib

    import torch

    from parity.apps import sft, sft_child
    from parity.errors import ParityError

    digest = lambda out: hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    cfg = SFTConfig(steps=2, batch_size=4)
    # (the cache moved by hand, not by PARITY_CACHE: the child would build the native kernels again)
    monkeypatch.setattr(sft, "base_dir", lambda c=None: tmp_path / "cache" / (c or RECIPES["base"]).key())
    monkeypatch.setattr(sft, "BASE_EVAL_PROBLEMS", 2)  # (a 2-step base answers at its length limit)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        built = digest(sft.get_base_policy(cfg))
    finally:
        torch.set_num_threads(threads)
    monkeypatch.delenv("OMP_NUM_THREADS")
    sft_child.build(tmp_path / "fresh", cfg, eval_problems=0)
    assert built == digest(tmp_path / "fresh")
    (tmp_path / "file").write_text("x")  # the child's one-line error, raised here
    with pytest.raises(ParityError, match="file exists and is not a directory"):
        sft_child.build(tmp_path / "file", cfg, eval_problems=0)
    monkeypatch.setitem(RECIPES, "base", SFTConfig(steps=1, batch_size=2))  # not built yet
    capfd.readouterr()
    assert main(["eval", "--n", "2", "-k", "0", "--json"]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out)["eval/problems"] == 2 and "sft    1/1" in err


def test_control_a_build_in_this_process_on_one_thread_is_another_base(tmp_path):
    """The control of the test above: the same build in this process, on one thread, gives other
    weights than the fresh process's (PyTorch's CPU backward follows the thread count on an Intel
    Xeon; on an AVX2-only AMD EPYC these builds agree on one thread and two, and there is nothing
    for the fresh process to fix: skipped, saying so)."""
    import hashlib

    import torch

    from parity.apps import sft_child

    digest = lambda out: hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    cfg = SFTConfig(steps=2, batch_size=4)
    sft_child.build(tmp_path / "fresh", cfg, eval_problems=0)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            train_sft(tmp_path / f"threads{n}", cfg, eval_problems=0)
    finally:
        torch.set_num_threads(threads)
    one, two = digest(tmp_path / "threads1"), digest(tmp_path / "threads2")
    if one == two == digest(tmp_path / "fresh"):
        pytest.skip("on this CPU the build's bits do not follow the thread count")
    assert one != digest(tmp_path / "fresh")


def test_a_base_build_runs_no_model_code_where_the_sandbox_cannot_isolate_it(tmp_path, monkeypatch, caplog):
    """The base build's held-out evaluation of the tool task runs the model's code: where the
    sandbox cannot isolate it, that evaluation is left out with a warning naming why (it ran in
    the degraded sandbox: as root without capabilities where Python is not open to other uids),
    and the build, the math evaluation included, goes on."""
    from parity.envs import sandbox as sandbox_mod

    monkeypatch.setattr(sandbox_mod, "_PROBE", sandbox_mod._Probe("plain", "unshare failed: forced by test"))
    monkeypatch.delenv("PARITY_ALLOW_DEGRADED_SANDBOX", raising=False)  # (the suite's own switch)
    record = train_sft(tmp_path / "base", SFTConfig(steps=2, batch_size=2), eval_problems=2)
    assert [name.split("-")[0] for name in record["heldout"]] == ["math"]
    assert "the tool task's held-out evaluation is left out: sandbox isolation is unavailable (unshare " \
           "failed: forced by test)" in caplog.text
    monkeypatch.setattr(sandbox_mod, "_PROBE", None)  # this machine's own answer
    if sandbox_mod.Sandbox(require_isolation=False).isolated:
        record = train_sft(tmp_path / "again", SFTConfig(steps=2, batch_size=2), eval_problems=2)
        assert sorted(name.split("-")[0] for name in record["heldout"]) == ["math", "tool"]


def test_the_demo_is_refused_before_its_base_build_where_the_sandbox_cannot_isolate(tmp_path, monkeypatch,
                                                                                   capsys):
    """The demo's tool calls need the sandbox: where it cannot isolate, the demo was refused only
    after building the base policy (minutes); now at once, naming the demo's own way to allow it."""
    import parity.apps.demo as demo_module
    from parity.envs import sandbox as sandbox_mod

    monkeypatch.setattr(sandbox_mod, "_PROBE", sandbox_mod._Probe("plain", "unshare failed: forced by test"))
    monkeypatch.delenv("PARITY_ALLOW_DEGRADED_SANDBOX", raising=False)

    def no_build(*args, **kwargs):
        raise AssertionError("the base policy was built before the refusal")

    monkeypatch.setattr(demo_module, "get_base_policy", no_build)
    assert main(["demo", "--steps", "1", "--run-dir", str(tmp_path / "demo")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("parity: error: sandbox isolation is unavailable (unshare failed: forced by test)")
    assert err.rstrip().endswith('(make demo ARGS="--set task.require_isolation=false")')
    with pytest.raises(AssertionError, match="built before the refusal"):  # (allowed: it goes on)
        main(["demo", "--steps", "1", "--run-dir", str(tmp_path / "demo"), "--set",
              "task.require_isolation=false"])
