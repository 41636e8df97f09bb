"""The `parity` command: check and bench end to end (small settings), errors as one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from parity.apps import sft_child
from parity.cli import main


def run(*args):
    return subprocess.run([sys.executable, "-m", "parity.cli", *args], capture_output=True, text=True,
                          timeout=600)


def test_check_json_passes_and_shows_standard_gap():
    proc = run("check", "--json", "--rounds", "2", "--dtype", "float32",
               "--cases", "batch,decode,padding")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["passed"] is True
    aligned = [r for r in out["results"] if r["kernels"] == "aligned"]
    assert aligned and all(r["mismatches"] == 0 and r["comparisons"] > 0 for r in aligned)
    assert sum(r["mismatches"] for r in out["results"] if r["kernels"] == "standard") > 0


@pytest.mark.parametrize("failing", ["standard", "aligned"])
def test_a_case_that_cannot_run_is_recorded_and_the_others_still_report(failing, monkeypatch, capsys):
    """A decode graph that fails to capture (as a GPU's standard SDPA path might) stops that case
    on that backend only: its error is in the JSON, every other case and backend still reports,
    and the check fails only when the aligned backend could not run a case."""
    from parity import invariance
    from parity.errors import ParityError

    real = invariance.case_graphs

    def graphs(model, *args, **kwargs):
        pairs = real(model, *args, **kwargs)
        if model.kernels.name == failing:
            raise ParityError("check 'graphs': decode graph capture failed: stand-in")
        return pairs

    monkeypatch.setattr(invariance, "case_graphs", graphs)
    code = main(["check", "--json", "--preset", "tiny", "--rounds", "2", "--dtype", "float32",
                 "--cases", "batch,graphs"])
    out = json.loads(capsys.readouterr().out)
    assert code == (0 if failing == "standard" else 1) and out["passed"] is (failing == "standard")
    by = {(r["kernels"], r["case"]): r for r in out["results"]}
    assert by[(failing, "graphs")]["error"].endswith("capture failed: stand-in")
    assert by[(failing, "graphs")]["comparisons"] == 0  # it failed in its first round
    other = "aligned" if failing == "standard" else "standard"
    assert by[(other, "graphs")]["error"] == "" and by[(other, "graphs")]["comparisons"] > 0
    assert all(by[(k, "batch")]["comparisons"] > 0 and not by[(k, "batch")]["error"]
               for k in ("aligned", "standard"))
    assert main(["check", "--preset", "tiny", "--rounds", "1", "--dtype", "float32",
                 "--cases", "graphs"]) == code
    text = capsys.readouterr().out
    assert f"graphs ({failing}, float32) stopped: check 'graphs'" in text
    assert ("cases stopped by an error" in text) is (failing == "aligned")
    import parity  # the bitwise suite's run_checks: an error still raises (a test cannot pass on it)

    with pytest.raises(ParityError, match="capture failed: stand-in"):
        invariance.run_checks(parity.Model(parity.ModelConfig.preset("tiny"), kernels=failing), rounds=1,
                              cases=("graphs",))


def test_check_covers_moe(capsys):
    assert main(["check", "--preset", "tiny-moe", "--rounds", "1", "--dtype", "float32",
                 "--cases", "batch,decode,engine"]) == 0
    out = capsys.readouterr().out
    assert "preset tiny-moe" in out and "PASS" in out


def test_a_case_named_twice_is_checked_once(capsys):
    assert main(["check", "--json", "--rounds", "1", "--dtype", "float32", "--cases", "batch,batch"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [r["case"] for r in results if r["kernels"] == "aligned"] == ["batch"]


def test_check_on_a_saved_checkpoint(tmp_path, capsys):
    import parity

    parity.Model(parity.ModelConfig.preset("tiny"), seed=2).save_pretrained(tmp_path)
    assert main(["check", "--model", str(tmp_path), "--rounds", "1", "--dtype", "bfloat16",
                 "--cases", "batch,decode"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_bad_input_is_one_line_no_traceback(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 60, "num_attention_heads": 7}')
    for args in (["check", "--model", str(tmp_path)], ["check", "--preset", "huge"],
                 ["bench", "kernels", "--dtypes", "float16"]):
        proc = run(*args)
        assert proc.returncode == 2
        assert "Traceback" not in proc.stderr
        assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("parity: error:")
    proc = subprocess.run([sys.executable, "-m", "parity", "check", "--preset", "huge"], capture_output=True,
                          text=True, timeout=600)  # (`python -m parity`, as the command)
    assert proc.returncode == 2 and proc.stderr.startswith("parity: error: unknown model preset 'huge'"), proc


def test_version_names_parity_and_what_its_bits_follow(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    import parity
    assert done.value.code == 0
    expected = f"parity {parity.__version__} (torch {torch.__version__}, Python "
    assert capsys.readouterr().out.startswith(expected)


def test_more_bad_input_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    """Found by a hostile-input review: each of these used to give a traceback, an unnamed
    error, a hang, an out-of-memory kill, or a silent reinterpretation. All are refused in one line
    naming the input, before anything is trained or computed, and nothing is written or deleted."""
    (tmp_path / "not-utf8.toml").write_bytes(b"steps = 3\n\xff\n")
    (tmp_path / "prompts.txt").write_bytes(b"ok\n\xff\n")
    (tmp_path / "typed.jsonl").write_text('{"prompt": 5}\n')
    (tmp_path / "bools.jsonl").write_text('{"prompt_ids": [true]}\n')
    (tmp_path / "extra.jsonl").write_text('{"prompt": "hi", "max_tokens": 2}\n')
    (tmp_path / "both.jsonl").write_text('{"prompt": "hi", "prompt_ids": [1, 2]}\n')  # (the prompt dropped)
    (tmp_path / "escape.toml").write_text('[[runs]]\nname = "../escape"\n')
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "notes.txt").write_text("mine")
    toy = ["--set", 'model.preset="tiny"', "--set", f'run_dir="{tmp_path / "run"}"']
    nested = tmp_path / "not-utf8.toml" / "sub"  # a run directory under a file
    monkeypatch.setenv("PARITY_CACHE", str(tmp_path / "cache"))  # no base policy built: none may be
    monkeypatch.setattr(sft_child, "build", lambda *a, **k: pytest.fail("built the base policy first"))
    cases = [
        (["bench", "kernels", "--presets", ""], "got nothing"),
        (["check", "--cases", ","], "got nothing"),
        (["generate", "--prompt-ids", "1,,2"], "expected comma-separated integers, got '1,,2'"),  # (was 1,2)
        (["bench", "kernels", "--batches", "a"], "list of integers, got 'a'"),
        (["sft", "--recipe", "junk"], "invalid choice: 'junk'"),  # (argparse's: a usage block, then this)
        (["bench", "kernels", "--presets", "qwen3-0.6b", "--batches", "100000"], "GiB is available"),
        (["bench", "learner", "--presets", "qwen3-0.6b", "--batch", "100000"], "GiB is available"),
        (["eval", "-k", "-1"], "--k must be >= 0"),
        (["eval", "-k", "100000"], "--k must be at most 64"),
        (["sft", "--eval-problems", "1000"], "--eval-problems must be at most 200"),  # (ran 200)
        (["sft", "--out", ""], "--out is empty"),  # (fell back to the default: the cache)
        (["study", " "], "the config path is empty"),
        (["eval", "--model", ""], "--model is empty"),
        (["generate", "--seed", str(10**23), "--prompt", "x"], "--seed"),
        (["generate", "--prompts-file", str(tmp_path / "prompts.txt")], "prompts.txt: not UTF-8"),
        (["generate", "--prompts-file", str(tmp_path / "extra.jsonl")], "unknown field 'max_tokens'"),
        (["generate", "--prompts-file", str(tmp_path / "both.jsonl")], ":1: both 'prompt' and 'prompt_ids'"),
        (["generate", "--prompt-ids", "1,2", "--chat"], "--chat wraps text prompts"),
        (["bench", "learner", "--length", "1", "--presets", "tiny"], "--length must be at least 2"),
        (["bench", "memory", "--dtype", "junk"], "--dtype must be one of float32, bfloat16, got 'junk'"),
        (["bench", "memory", "--preset", "nope"], "unknown model preset 'nope': expected one of tiny,"),
        (["bench", "gemm"], "FLOP of interpreted work, hours or days; give small shapes"),  # (ran for days)
        (["bench", "learner-memory", "--device", "cuda"], "--device='cuda' but this torch build"),
        (["study", "--seeds", "a,b"], "--seeds: expected a comma-separated list of integers, got 'a,b'"),
        (["train", *toy, "--set", 'model.dtype="float64"'], "must be one of float32, bfloat16 or auto"),
        (["train", *toy, "--set", "task.heldout_size=-1"], "task.heldout_size must be >= 1, got -1"),
        (["train", "--set", "..=3"], "a key is dotted names"),  # (was "unknown config key " naming none)
        (["train", *toy, "--set", 'run_dir="/proc/self/x"'], "run_dir /proc/self/x cannot be used"),
        (["eval", "--set", "learner.lr=1"], "keys only (--n"),  # (offered task.learner.lr)
        (["eval", "--set", "model.checkpoint=x"], "eval takes the model from --model"),  # (won over it)
        (["compile", "--gemm-candidates", ""], "--gemm-candidates is empty"),  # (compiled the passes)
        (["train", str(tmp_path / "not-utf8.toml")], "not-utf8.toml: not UTF-8"),
        (["train", *toy, "--set", "steps=1000000000"], "steps must be in 1..10,000,000"),
        (["train", *toy, "--set", "eval_prompts=100000000"], "eval_prompts must be at most 100,000"),
        (["train", *toy, "--set", 'task.name="math"', "--set", 'model.checkpoint="base"', "--set",
          "eval_prompts=300"], "at most task.heldout_size"),
        (["train", *toy, "--set", "rollout.temperature=inf"], "temperature must be >= 0.01 and finite"),
        # a review of 2026-12-05: NaN log-probs, a hang that ignored SIGTERM, overflow errors
        # naming no field, a greedy pass thrown away, an error naming a file the user never made
        (["train", *toy, "--set", "rollout.temperature=1e-300"], "temperature must be >= 0.01"),
        (["generate", "--prompt", "hi", "--temperature", "1e-300"], "temperature must be 0 (greedy) or in"),
        (["eval", "--n", "2", "-k", "2", "--temperature", "-1"], "temperature must be 0 (greedy) or in"),
        (["train", *toy, "--set", "rollout.prompts_per_step=100000000"], "at most 65,536 episodes a step"),
        (["train", *toy, "--set", "rollout.workers=1000"], "rollout.workers must be at most 256"),
        (["train", *toy, "--set", "=5"], "no key before '='"),
        (["eval", "--set", "steps=5"], "eval takes task.* and model.* keys only"),
        (["train", "/dev/zero"], "/dev/zero: larger than 1 MiB"),
        (["check", "--model", str(tmp_path / "not-utf8.toml")], "not-utf8.toml: not a directory (a"),
        (["demo", "--set", f'run_dir="{tmp_path / "run"}"'], "--set run_dir: the demo sets it with"),
        (["generate", "--prompts-file", str(tmp_path / "typed.jsonl")], ":1: prompt must be a string"),
        (["generate", "--prompts-file", str(tmp_path / "bools.jsonl")], "must be a list of integers"),
        (["train", *toy, "--set", "rollout.heartbeat_timeout_s=nan"], "heartbeat_timeout_s must be >= 0"),
        (["train", *toy, "--set", "model.seed=99999999999999999999999"], "model.seed must be in 0..2**63-1"),
        (["generate", "--prompt", "hi", "--context", "4000"], "a context of 4,000 positions exceeds"),
        (["train", *toy, "--set", "model.context=1"], "model.context must be at least 2 positions"),
        (["train", "--set", 'model.preset="tiny"', "--set", f'run_dir="{nested}"'],
         "not-utf8.toml/sub cannot be used: Not a directory"),
        (["train", *toy, "--set", "learner.weight_decay=nan"], "weight_decay must be finite"),
        (["train", "--set", 'run_dir=""'], "run_dir must name a directory"),
        (["train", "--set", f'run_dir="{tmp_path / "not-utf8.toml"}"'], "is not a directory"),
        (["train", *toy, "--set", 'learner.dump_dir="/proc/nope"'], "learner.dump_dir /proc/nope"),
        (["train", *toy, "--set", 'rollout.backend="ray"', "--set", 'ray.address="127.0.0.1:1"'],
         "cannot reach the Ray head at 127.0.0.1:1"),
        (["train", "--resume", str(tmp_path), "--set", "model.preset=small"], "model.preset is fixed"),
        (["sft", "--out", str(tmp_path / "keep"), "--steps", "1"], "with other files in it"),
        (["sft", "--out", str(tmp_path / "not-utf8.toml"), "--steps", "1"], "is not a directory"),
        # a CLI audit of 2026-12-05 (seventh session): sizes of 1e11 that hung for minutes, a level
        # of 0 read as "not given", options for another task ignored, a run name leaving --out
        (["bench", "learner", "--batch", "99999999999"], "--batch must be at most 1,000,000"),
        (["bench", "sampler", "--reps", "99999999999"], "--reps must be at most 2,147,483,647"),
        (["eval", "--n", "2", "--level", "0"], "tool task level must be 1..3, got 0"),
        (["eval", "--task", "tool", "--math-task", "add"], "--math-task is for --task math"),
        (["train", *toy, "--set", 'task.math_task="mul"'], "task.math_task is for task.name = 'math'"),
        (["study", str(tmp_path / "escape.toml"), "--out", str(tmp_path / "study")], "'../escape' must be"),
        (["sft", "--out", "/proc/no/such", "--steps", "1"], "/proc/no/such cannot be written: No such file"),
        (["study", "--out", str(tmp_path / "not-utf8.toml"), "--report-only"], "is not a directory"),
        (["bench", "memory", "--lags", "20000000"], "--lags plus --after must be at most 10,000,000"),
        (["train", *toy, "--set", "task.prompt_len=600"], "task.prompt_len (600) leaves no room to generate"),
        # a new user's walk through the README (2026-12-07, second session)
        (["demo", "--set", 'task.name="math"'], "--set task.name: the demo is the tool-use task"),
        (["demo", "--model", str(tmp_path / "nope")], "nope: checkpoint directory not found"),  # (only)
        (["train", *toy, "--stepz", "3"], "--stepz (`parity train --help` lists the options)"),
        (["bench", "kernels", "--foo"], "--foo (`parity bench kernels --help` lists the options)"),
        (["train", *toy, "--set", "rollout.kv_cache_memory=2.0"], "2.0 reads as 2 bytes: a fraction"),
        (["train", "--resume", str(tmp_path / "no-run")], "no-run: no run there (a run directory holds"),
        # a new user's walk (2026-12-07, ninth session): run_dir was silently the resumed run's
        (["train", "--resume", str(tmp_path), "--set", 'run_dir="/x"'], "run_dir is fixed: a run continues"),
    ]
    for argv, message in cases:
        try:
            code = main(argv)
        except SystemExit as stop:  # argparse's own errors
            code = stop.code
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert code == 2, (argv, err)
        assert "training the base policy" not in captured.out  # (said so of a file, then refused)
        # (argparse's own errors too: they printed a usage block before their one line)
        assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err, (argv, err)
    assert (tmp_path / "keep" / "notes.txt").read_text() == "mine" and not (tmp_path / "run").exists()
    (tmp_path / "base").mkdir()  # a directory named like the cached base policy: was read as that
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "--model", "base", "--prompt", "x"]) == 2
    assert "names both a cached base policy and ./base" in capsys.readouterr().err
    from parity.apps.sft import names_recipe

    monkeypatch.setenv("PARITY_CACHE", ".")  # ./base is the cache itself then: no clash
    assert names_recipe("base")
    from parity.config import load_config

    assert load_config(None, ["eval_prompts=256"]).eval_prompts == 256  # target_tokens makes its own


def test_an_allocator_failure_is_said_as_out_of_memory_with_its_size():
    from parity.apps.args import out_of_memory as _out_of_memory

    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                       "allocate memory: you tried to allocate 4096000016384 bytes. Error code 12")
    assert _out_of_memory(cpu).startswith("out of memory (3,814.7 GiB asked for at once): the sizes given")
    cuda = RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79")
    assert _out_of_memory(cuda).startswith("out of memory (20.00 GiB asked for at once)")
    assert _out_of_memory(MemoryError()).startswith("out of memory: the sizes given")
    assert _out_of_memory(RuntimeError("shape mismatch")) is None and _out_of_memory(ValueError("x")) is None


@pytest.mark.parametrize("signal_name, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_training_interrupted_inside_any_command_is_one_line(monkeypatch, capsys, tmp_path, signal_name,
                                                               code):
    """The checkpoint a stopped run saved is named in one line with the signal's exit status,
    whichever command ran the training (demo here, with the way to finish it: a new demo starts over;
    train has its own line with a resume hint).
    A benchmark's run lived in a temporary directory that is gone by then: not named as saved."""
    import parity.apps.demo as demo
    from parity.errors import Interrupted

    saved = tmp_path / "checkpoint-3"
    saved.mkdir()
    hint = f"(finish it with: parity train --resume {tmp_path})"
    for path, said in ((saved, f"checkpoint saved to {saved} {hint}"),
                       (tmp_path / "gone" / "checkpoint-3", "nothing kept (the run was a benchmark's")):
        def stopped(args, path=path):
            raise Interrupted(path, signal_name)

        monkeypatch.setattr(demo, "main", stopped)
        assert main(["demo"]) == code
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"parity: interrupted ({signal_name}); {said}") and "\n" not in err


def test_bench_kernels_json_reports_ratios():
    proc = run("bench", "kernels", "--json", "--presets", "tiny", "--dtypes", "float32",
               "--batches", "8", "--reps", "1", "--decode-steps", "2", "--prefill-len", "16")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["rows"]
    assert {r["phase"] for r in rows} == {"prefill", "decode"}
    assert all(r["aligned_tok_s"] > 0 and r["ratio"] > 0 for r in rows)
    assert all(r["gemm_gflops"] > 0 and 0 < r["gemm_fraction"] == r["aligned_gflops"] / r["gemm_gflops"]
               for r in rows)


def test_bench_learner_json_reports_the_gemm_fraction():
    proc = run("bench", "learner", "--json", "--presets", "tiny", "--dtypes", "float32", "--batch", "2",
               "--length", "16", "--reps", "1")
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(proc.stdout)["rows"]
    assert row["aligned_tok_s"] > 0 and row["gemm_gflops"] > 0 and 0 < row["gemm_fraction"] < 1


def test_a_bench_stopped_by_sigterm_reports_the_rows_it_finished(monkeypatch, capsys):
    """A time limit's SIGTERM (as `timeout` sends it) mid-run: bench kernels, learner, rollout,
    attention and sampler and check print what they measured so far and say they were stopped,
    instead of dying with nothing; the benchmarks exit 130, so a script tells partial rows from a
    whole run (check: 1, not a pass)."""
    import os
    import signal

    from parity import hardware
    from parity.apps import bench_kernels

    def after(n, fn):  # fn, but SIGTERM to this process on its n-th call
        calls = []

        def wrapped(*args, **kwargs):
            calls.append(1)
            if len(calls) == n:
                os.kill(os.getpid(), signal.SIGTERM)
            return fn(*args, **kwargs)
        return wrapped

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(bench_kernels, "interleaved", after(3, bench_kernels.interleaved))
    assert main(["bench", "kernels", "--json", "--presets", "tiny", "--dtypes", "float32", "--batches", "1,8",
                 "--reps", "1", "--decode-steps", "2", "--prefill-len", "16"]) == 130
    out = json.loads(capsys.readouterr().out)
    assert [(r["phase"], r["batch"]) for r in out["rows"]] == [("prefill", 1), ("decode", 1)]
    assert out["stopped"] == ["interrupted: 2 rows done"]
    monkeypatch.setattr(hardware, "gemm_rate", after(2, hardware.gemm_rate))
    assert main(["bench", "learner", "--presets", "tiny", "--dtypes", "float32,bfloat16", "--batch", "2",
                 "--length", "16", "--reps", "1"]) == 130
    text = capsys.readouterr().out
    assert "interrupted: 1 rows done: the rows not listed were not measured" in text
    assert "tiny    float32" in text and "bfloat16" not in text.split("---")[-1]
    from parity.apps import bench_rollout  # the rounds both backends finished, paired

    for n, rounds in ((5, 1), (2, 0)):  # runs 1-2 warm up, 3-4 are round 1, 5 starts round 2
        monkeypatch.setattr(bench_rollout, "_run_engine", after(n, bench_rollout._run_engine))
        assert main(["bench", "rollout", "--json", "--preset", "tiny", "--dtypes", "float32,bfloat16",
                     "--num-seqs", "4", "--max-num-seqs", "4", "--mean-len", "4", "--max-len", "8",
                     "--reps", "3"]) == 130
        out = json.loads(capsys.readouterr().out)
        assert out["stopped"] == [f"interrupted: float32 after {rounds} of 3 timed rounds"]
        assert [r["system"] for r in out["rows"]] == ["parity-aligned", "parity-standard"][:2 * rounds]
        assert list(out["ratios"]) == ["float32/aligned_over_standard"][:rounds]
        monkeypatch.undo()
    import sys
    import types

    import parity.ops
    from parity.apps import bench_attention, bench_sampler  # the shapes / batches finished
    from parity.ops import standard

    # the Triton attention as the standard one: what is tested is the interrupt, and Triton's
    # interpreter cannot be turned on in a process that imported triton before
    fake = types.SimpleNamespace(paged_attention=lambda *args, **kw: standard.paged_attention(*args[:5]),
                                 _schedule=lambda *args: "walk", _attention_tiles=lambda d, dtype: (16,))
    monkeypatch.setitem(sys.modules, "parity.ops.triton_attention", fake)
    monkeypatch.setattr(parity.ops, "triton_attention", fake, raising=False)
    monkeypatch.setattr(bench_attention, "seconds_per_call", after(5, bench_attention.seconds_per_call))
    assert main(["bench", "attention", "--json", "--preset", "tiny", "--batches", "1,2", "--contexts", "16",
                 "--reps", "1"]) == 130
    out = json.loads(capsys.readouterr().out)
    assert [r["batch"] for r in out["rows"]] == [1] and out["stopped"] == ["interrupted: 1 of 2 shapes done"]
    monkeypatch.setattr(bench_sampler, "interleaved", after(1, bench_sampler.interleaved))
    assert main(["bench", "sampler", "--vocab", "1000", "--batches", "1,2", "--reps", "1"]) == 130
    text = capsys.readouterr().out  # (stopped before its first row: the table's header alone)
    assert "interrupted: 0 of 2 batches done: the batches not listed were not measured" in text
    from parity import invariance  # parity check: the comparisons made so far, and not a pass

    monkeypatch.setattr(invariance, "compare", after(3, invariance.compare))
    assert main(["check", "--json", "--preset", "tiny", "--rounds", "2", "--dtype", "float32",
                 "--cases", "batch,decode"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] is False and out["stopped"] == ["interrupted in round 2 of 2 (aligned kernels)"]
    assert [(r["kernels"], r["case"]) for r in out["results"]] == [("aligned", "batch"),
                                                                   ("aligned", "decode")]
    assert all(r["comparisons"] > 0 and r["mismatches"] == 0 for r in out["results"])
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is put back
    with pytest.raises(KeyboardInterrupt):  # without a `stopped` list the interrupt goes on up
        bench_kernels.bench_kernels(presets=["tiny"], dtypes=["float32"], batches=[1],
                                    progress=lambda m: (_ for _ in ()).throw(KeyboardInterrupt))


def test_flops_per_token_counts_the_parameters_and_attention():
    from parity.model import ModelConfig

    cfg = ModelConfig.preset("qwen3-0.6b")
    params = 596_049_920 - cfg.num_hidden_layers * (2 * cfg.hidden_size + 2 * cfg.head_dim) - cfg.hidden_size
    assert cfg.forward_flops_per_token(0) == 2 * params  # every matrix once (tied head), norms aside
    attention = cfg.num_hidden_layers * 4 * cfg.num_attention_heads * cfg.head_dim * 100
    assert cfg.forward_flops_per_token(100) == 2 * params + attention


def test_generate_json_records_logprobs_and_versions(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    # a byte-order mark (made line 1's JSON a text prompt); the largest seed for several prompts
    prompts.write_bytes('\ufeff{"prompt": "hi"}\n{"prompt_ids": [1, 2, 3]}\nplain text line\n'.encode())
    proc = run("generate", "--prompts-file", str(prompts), "--max-tokens", "5", "--json",
               "--seed", str(2**63 - 1))
    assert proc.returncode == 0, proc.stderr
    outs = json.loads(proc.stdout)
    assert len(outs) == 3 and outs[0]["prompt_token_ids"] == [104, 105]
    for o in outs:
        assert len(o["token_ids"]) == len(o["logprobs"]) == len(o["policy_versions"]) == 5
        assert o["policy_versions"] == [0] * 5 and o["error"] is None
    proc = run("generate", "--prompt-ids", "1,2,3", "--max-tokens", "50", "--json", "--context", "40")
    assert proc.returncode == 0, proc.stderr  # a served context of 40 positions ends it at 37 tokens
    assert [(len(o["token_ids"]), o["finish_reason"]) for o in json.loads(proc.stdout)] == [(37, "length")]


def test_generate_bad_prompt_is_one_line():
    proc = run("generate", "--prompt-ids", "1,x")
    assert proc.returncode == 2 and proc.stderr.startswith("parity: error: --prompt-ids")
    proc = run("generate", "--prompt-ids", "1,2", "--prompt-ids", "500", "--max-tokens", "2")
    assert proc.returncode == 1  # the bad request fails, the good one completes
    assert "error: prompt: token id 500" in proc.stdout and "(length, 2 tokens)" in proc.stdout


def test_bench_rollout_json():
    proc = run("bench", "rollout", "--json", "--preset", "tiny", "--num-seqs", "6", "--max-num-seqs", "4",
               "--reps", "1", "--dtypes", "float32", "--mean-len", "6", "--max-len", "12")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {r["system"] for r in out["rows"]} == {"parity-aligned", "parity-standard"}
    assert out["ratios"]["float32/aligned_over_standard"] > 0
    assert all(r["gemm_gflops"] > 0 and 0 < r["gemm_fraction"] == r["gflops"] / r["gemm_gflops"]
               for r in out["rows"])
    assert not any(r["shared_prompt_tokens"] for r in out["rows"])  # (16-64 random tokens each)


def test_bench_rollout_groups_time_prefix_caching():
    """Each prompt asked 4 times: the aligned engine without prefix caching is timed beside, and
    the engines with it took 3 of each group's 4 prompts' full blocks (64 of 70 tokens) from the cache."""
    proc = run("bench", "rollout", "--json", "--preset", "tiny", "--num-seqs", "8", "--max-num-seqs", "8",
               "--reps", "1", "--dtypes", "float32", "--mean-len", "4", "--max-len", "8",
               "--group-size", "4", "--prompt-len", "70")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    shared = {r["system"]: r["shared_prompt_tokens"] for r in out["rows"]}
    assert shared == {"parity-aligned": 2 * 3 * 64, "parity-standard": 2 * 3 * 64,
                      "parity-aligned-no-prefix": 0}
    assert out["ratios"]["float32/prefix_caching_speedup"] > 0
    proc = run("bench", "rollout", "--preset", "tiny", "--group-size", "0")
    assert proc.returncode != 0 and "--group-size must be at least 1" in proc.stderr


def test_bench_attention_json():
    """Both schedules timed beside the standard path, their bits compared (interpreter here)."""
    proc = run("bench", "attention", "--json", "--preset", "tiny", "--dtype", "float32", "--batches", "1",
               "--contexts", "70", "--reps", "1")
    assert proc.returncode == 0, proc.stderr
    [row] = json.loads(proc.stdout)["rows"]
    assert row["same_bits"] and row["auto"] in ("walk", "split") and min(row["ms"].values()) > 0
    assert set(row["ms"]) == {"walk", "split", "auto", "standard"}


def test_bench_sampler_json_and_bad_batches():
    proc = run("bench", "sampler", "--json", "--vocab", "500", "--batches", "1,3", "--reps", "1")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["rows"]
    assert [r["batch"] for r in rows] == [1, 3] and all(r["vocab"] == 500 for r in rows)
    assert all(set(r["ms"]) == {"generator", "counter"} and min(r["ms"].values()) > 0 for r in rows)
    bad = run("bench", "sampler", "--batches", "0")
    assert bad.returncode == 2 and bad.stderr.startswith("parity: error: --batches")


def test_bench_sampler_compares_the_calls_both_paths_made(monkeypatch):
    """The timing calls a faster path more times per sample than a slower one, so the fused and
    counter paths' token lists differ in length: compared whole, they read "not the same tokens"
    on a GPU where every draw agreed. Both compare over the calls both made; the control (another
    seed for one path) still differs."""
    from parity.apps import bench_sampler

    def uneven(fns, reps):  # the fused path timed at 3 calls, the others at 5
        for k, fn in fns.items():
            for _ in range(3 if k == "fused" else 5):
                fn()
        return dict.fromkeys(fns, 1e-3)

    monkeypatch.setattr(bench_sampler, "_paths", lambda device: ["generator", "counter", "fused"])
    monkeypatch.setattr(bench_sampler, "interleaved", uneven)
    row, = bench_sampler.bench_sampler(300, [4], torch.float32, 1, torch.device("cpu"))
    assert row.same_tokens is True
    made, real = [], bench_sampler.Sampler

    def sampler(model, seed, draws):  # (the control: the third, the fused path's, picks other tokens)
        made.append(real(model, seed=seed, draws=draws))
        if len(made) == 3:
            sample = made[-1].sample
            made[-1].sample = lambda seqs, logits: [(t + 1, lp, v) for t, lp, v in sample(seqs, logits)]
        return made[-1]

    monkeypatch.setattr(bench_sampler, "Sampler", sampler)
    row, = bench_sampler.bench_sampler(300, [4], torch.float32, 1, torch.device("cpu"))
    assert row.same_tokens is False


def test_train_runs_and_rejects_bad_config(tmp_path):
    sets = ["steps=2", "model.preset=\"tiny\"", f"run_dir=\"{tmp_path}\"", "rollout.prompts_per_step=2",
            "max_policy_lag=1"]
    proc = run("train", *[x for s in sets for x in ("--set", s)])
    assert proc.returncode == 0, proc.stderr
    assert "step    2/2" in proc.stdout and (tmp_path / "metrics.jsonl").exists()
    assert (tmp_path / "report.md").exists() and (tmp_path / "report.png").exists()  # the app's report
    assert (tmp_path / "config.toml").read_text().startswith("steps = 2")
    bad = run("train", "--set", "rollout.group_size=0")
    assert bad.returncode == 2 and bad.stderr.startswith("parity: error: rollout.group_size")
    assert "Traceback" not in bad.stderr


def test_bench_async_json():
    proc = run("bench", "async", "--json", "--preset", "tiny", "--steps", "3", "--lags", "2",
               "--prompts", "2", "--group", "2", "--max-tokens", "8", "--workers", "1,2", "--reps", "1")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [(r["max_policy_lag"], r["workers"]) for r in out["rows"]] == [(0, 1), (2, 1), (2, 2)]
    assert out["rows"][0]["observed_lag_max"] == 0 and all(r["observed_lag_max"] <= 2 for r in out["rows"])
    assert out["ratios"]["local_x1_lag2_over_sync"] > 0 and out["ratios"]["local_x2_lag2_over_sync"] > 0
    assert out["ratio_ranges"] == {k: [v, v] for k, v in out["ratios"].items()}  # (one repetition)
    assert out["device"] == "cpu"
    for bad, named in ((["--device", "tpu"], "--device must"), (["--lags", "2,2"], "--lags names a value")):
        refused = run("bench", "async", *bad)
        assert refused.returncode == 2 and refused.stderr.startswith(f"parity: error: {named}"), refused
    assert out["rows"][2]["bytes_moved"] == 2 * out["rows"][1]["bytes_moved"] > 0
    assert all(r["gemm_gflops"] > 0 and 0 < r["gemm_fraction"] == r["gflops"] / r["gemm_gflops"]
               for r in out["rows"])


def test_bench_async_takes_turns_and_reports_each_repetitions_own_ratio(monkeypatch):
    """Modes take turns, the order reversed every other repetition; the ratio is the medians' and
    the range is each repetition's async run over the sync run beside it."""
    from parity.apps import bench_async

    order, speeds = [], iter([100, 150, 300, 200, 100, 260])  # (rep 1: sync, lag 2; rep 2 reversed; ...)

    def measure(cfg):
        order.append(cfg.max_policy_lag)
        return (float(next(speeds)), 0.1, 0.2, float(cfg.max_policy_lag), 0.001, 0.01, 1e6, 1.0)

    monkeypatch.setattr(bench_async, "_measure", measure)
    monkeypatch.setattr(bench_async.hardware, "gemm_rate", lambda dtype, device: 10.0)
    rows, ratios, ranges = bench_async.bench_async("tiny", steps=3, lags=[2], reps=3)
    assert order == [0, 2, 2, 0, 0, 2]
    assert [r.steps_per_hour for r in rows] == [100, 260]  # medians of (100, 200, 100) and (150, 300, 260)
    assert ratios == {"local_x1_lag2_over_sync": 2.6}
    assert ranges == {"local_x1_lag2_over_sync": (1.5, 2.6)}  # 150/100, 300/200, 260/100


def test_bench_linear_json_checks_the_aligned_rows(capsys, monkeypatch):
    """Every weight shape at every row count, aligned beside standard, the aligned rows checked
    against the largest product's (exit 1 and "same_bits" false where they differ: the control
    puts the standard product in the aligned path's place, whose small row counts take another
    path: MKL's GEMV below 4 rows)."""
    from parity.ops import gemm

    argv = ["bench", "linear", "--json", "--preset", "small", "--dtype", "float32", "--rows", "1,5,20",
            "--reps", "1"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["shape"], r["rows"]) for r in out["rows"]][:3] == [("qkv", 1), ("qkv", 5), ("qkv", 20)]
    assert len(out["rows"]) == 15 and all(r["same_bits"] for r in out["rows"])
    assert all(r["aligned_us"] > 0 and r["standard_us"] > 0 for r in out["rows"]) and out["aligned_path"]
    monkeypatch.setattr(gemm, "linear", lambda x, w, b=None: torch.nn.functional.linear(x, w, b))
    assert main(argv) == 1
    assert not all(r["same_bits"] for r in json.loads(capsys.readouterr().out)["rows"])


def test_bench_memory_json():
    """Each lag's run in its own process: steps = lag + after, the copies kept stay below lag + 1."""
    proc = run("bench", "memory", "--json", "--preset", "tiny", "--lags", "1,6", "--after", "2")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    rows = out["rows"]
    assert [(r["lag"], r["steps"]) for r in rows] == [(1, 3), (6, 8)]
    assert all(r["learner_peak_gib"] > 0 and r["worker_peak_gib"] > 0 and r["version_mib"] > 0 for r in rows)
    assert all(1 <= r["versions_kept_max"] <= r["copies_if_kept_per_lag"] for r in rows)
    assert out["machine"]["cores"] >= 1 and "bf16" in out["machine"]


def test_bench_learner_memory_json(capsys):
    """Four settings, each in its own process: memory and speed beside the plain setting's."""
    proc = run("bench", "learner-memory", "--json", "--preset", "tiny", "--dtype", "float32",
               "--length", "48", "--head-chunk", "16")  # 47 positions: 3 chunks
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["rows"]
    assert [(r["setting"], r["head_chunk"], r["checkpointing"]) for r in rows] == [
        ("plain", 0, False), ("head chunks", 16, False), ("checkpointing", 0, True), ("both", 16, True)]
    assert all(r["tok_s"] > 0 and r["held_gib"] > 0 and r["step_gib"] >= 0 for r in rows)
    assert main(["bench", "learner-memory", "--preset", "tiny", "--length", "100000"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("parity: error: --length")


def test_kv_cache_memory_with_a_unit_reaches_the_engine_as_written(capsys):
    """`--kv-cache-memory 512KiB` (and a plain 65536) were parsed to a float before the engine read
    them: 524288.0, which the engine's decimal rule then refused (a regression of the same day)."""
    for size in ("512KiB", "65536", "0.25"):
        assert main(["generate", "--preset", "tiny", "--prompt-ids", "1,2,3", "--max-tokens", "2",
                     "--kv-cache-memory", size]) == 0, capsys.readouterr().err
    capsys.readouterr()
