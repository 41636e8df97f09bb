"""Your own tasks: a JSONL dataset with a reward function (`task.name = "dataset"`) and an
environment named by import path (`task.name = "custom"`), checked where they enter the run and
trained end to end in rollout worker processes that load them by name."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parity.config import TaskSection, config_from_dict, load_config
from parity.config.loading import to_toml
from parity.envs.base import Episode
from parity.envs.custom import TaskContext, build_custom_env
from parity.envs.dataset import DatasetEnv, exact
from parity.errors import ConfigError, ParityError
from parity.model.tokenizer import HFTokenizer, build_char_tokenizer

VOCAB = 64

TOY_ENV = '''
import random
from parity.envs.base import Env, Turn

class Toy(Env):
    """Reward: the share of response tokens equal to `target` (a custom twin of target_tokens)."""
    def __init__(self, ctx, target=7, mode="ok"):
        self.vocab, self.seed, self.n = ctx.vocab_size, ctx.seed, ctx.heldout_size
        self.target, self.mode = target, mode
    def problems(self, batch_index, n):
        rnd = random.Random() if self.mode == "random" else random.Random(f"{self.seed}/{batch_index}")
        out = [[rnd.randrange(self.vocab) for _ in range(6)] for _ in range(n)]
        return out[:-1] if self.mode == "short" else out
    def heldout(self, n=None):
        rnd = random.Random("heldout")
        count = self.n if n is None else min(n, self.n)
        return [[rnd.randrange(self.vocab) for _ in range(6)] for _ in range(count)]
    def prompt_ids(self, problem):
        return [self.vocab] if self.mode == "oov" else problem
    def step(self, episode, turn_ids):
        if self.mode == "raise":
            raise KeyError("boom")
        if self.mode == "oserror":
            raise OSError("flaky tool")
        if self.mode == "observation":
            return Turn([1, 2], False, 0.0)
        reward = sum(t == self.target for t in turn_ids) / max(1, len(turn_ids))
        episode.reward, episode.passed = reward, reward >= 0.5
        episode.info["metrics"] = {"length": len(turn_ids)}  # its own figure, averaged per batch
        if self.mode == "passed_none":
            episode.passed = None
        if self.mode == "calls_str":
            episode.tool_calls = "2"
        return Turn(None, "no" if self.mode == "done_str" else True,
                    float("nan") if self.mode == "nan" else reward)
'''


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    build_char_tokenizer().save(str(path))
    return HFTokenizer(path)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def additions(n, start=10):
    return [{"prompt": f"{a}+{a % 7}=", "answer": a + a % 7} for a in range(start, start + n)]


def test_dataset_split_is_fixed_disjoint_and_batches_walk_every_problem_once_per_epoch(tmp_path, tokenizer):
    rows = additions(50) + [additions(1)[0]]  # a repeated prompt: both copies on one side of the split
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    env, again, other = (DatasetEnv(tokenizer, data, seed=s, heldout_size=10) for s in (0, 0, 1))
    held = {p["prompt"] for p in env.heldout()}
    assert [p["prompt"] for p in other.heldout()] == [p["prompt"] for p in env.heldout()]  # every seed
    train = [p["prompt"] for p in env._train]
    assert len(held) == 10 and not held & set(train) and len(train) + len(env.heldout()) + env.left_out == 51
    assert env.problems(3, 5) == again.problems(3, 5)  # batch 3 follows from (seed, index) alone
    assert env.problems(3, 5) != other.problems(3, 5)
    per_epoch = len(train) // 5  # the whole batches of the first epoch: no row twice, a repeated one twice
    epoch = [p["prompt"] for b in range(per_epoch) for p in env.problems(b, 5)]
    assert len(epoch) == per_epoch * 5 and Counter(epoch) <= Counter(train)
    assert env.problems(1_000_000, 5)  # far epochs are as cheap as the first
    first = env.problems(0, 1)[0]
    assert env.prompt_ids(first) == tokenizer.encode(f"<|user|>{first['prompt']}<|assistant|>")


def test_prompts_the_tokenizer_cannot_spell_are_counted_at_load(tmp_path, tokenizer, caplog):
    """A row "２+２＝😀" trained on <|unk|> tokens without a word (the character tokenizer of the
    small models); the load now says how many prompts hold such characters."""
    import logging

    rows = additions(30) + [{"prompt": "２+２＝😀", "answer": 4}, {"prompt": "héllo 1+1=", "answer": 2}]
    with caplog.at_level(logging.WARNING, logger="parity"):
        DatasetEnv(tokenizer, write_jsonl(tmp_path / "u.jsonl", rows), heldout_size=5)
    assert "2 prompt(s) hold characters this tokenizer cannot spell" in caplog.text
    assert tokenizer.unk_token_id == tokenizer.token_id("<|unk|>") is not None
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="parity"):  # (the control: plain rows say nothing)
        DatasetEnv(tokenizer, write_jsonl(tmp_path / "p.jsonl", additions(30)), heldout_size=5)
    assert "cannot spell" not in caplog.text


def test_a_prompt_no_model_can_take_is_named_at_load_not_at_its_batch(tmp_path, tokenizer):
    """A prompt the tokenizer cannot take (3 million characters: gigabytes inside the tokenizer) or
    whose ids lie outside the model's vocabulary, or that leaves no room to generate in the model's
    context, stopped the run at the batch that drew it, and
    again at each --resume (the order is fixed); every prompt is now tokenized once at load, and a
    bad one is a ConfigError naming its file and line."""
    rows = additions(30) + [{"prompt": "1+1=" + "x" * 3_000_000, "answer": 2}]
    with pytest.raises(ConfigError, match=r"big.jsonl:31: text of [\d,]+ characters: more than"):
        DatasetEnv(tokenizer, write_jsonl(tmp_path / "big.jsonl", rows), heldout_size=5)
    data = write_jsonl(tmp_path / "ok.jsonl", additions(30))
    with pytest.raises(ConfigError, match=r"ok.jsonl:1: the prompt's token \d+ is outside the model's vocab"):
        DatasetEnv(tokenizer, data, heldout_size=5, vocab_size=10)
    assert DatasetEnv(tokenizer, data, heldout_size=5, vocab_size=tokenizer.vocab_size).heldout()
    long = write_jsonl(tmp_path / "long.jsonl", additions(30) + [{"prompt": "1+1=" + "x" * 600, "answer": 2}])
    with pytest.raises(ConfigError, match=r"long.jsonl:31: the prompt's 6\d\d tokens leave no room to "
                                          r"generate in the model's context of 512 \(task.max_prompt_tokens"):
        DatasetEnv(tokenizer, long, heldout_size=5, context=512)
    assert DatasetEnv(tokenizer, long, heldout_size=5, context=512, max_prompt_tokens=500).too_long == 1


def test_dataset_heldout_file_keeps_its_prompts_out_of_training(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "train.jsonl", additions(30))
    held = write_jsonl(tmp_path / "held.jsonl", additions(5, start=20) + additions(3, start=500))
    env = DatasetEnv(tokenizer, data, heldout_data=held)
    assert len(env.heldout()) == 8 and env.left_out == 5 and len(env._train) == 25
    assert "5 left out" in env.describe()


@pytest.mark.parametrize("response, answer, score", [
    ("so the answer: 1,234", 1234, 1), ("answer: 12.0", "12", 1), ("answer: 13", 12, 0),
    ("answer: 12345678901", 12345678905, 0), ("answer: 1000000001", 1000000000, 0),  # exact, not isclose
    ("answer: 1e3", 1000, 1), ("answer: .5", 0.5, 1), ("answer: 0.1", 0.1, 1), ("answer: -7.", -7, 1),
    ("answer: 12 or 13", 13, 0), ("answer: 12 (not 13)", 12, 1),  # the first number on the line
    ("answer: 12\nchecking: 99", 12, 1), ("answer: 2x=5", 5, 0), ("I think\n42\n", 42, 1),
    ("answer: 12", "1,2", 0), ("answer: 1,2", "1,2", 1),  # '1,2' is not a number: compared as text
    ("I think\nParis.", "paris", 1), ("answer: Paris!", "Paris", 1), ('answer: "Paris"', "Paris", 1),
    ("answer:  New   York ", "new york", 1), ("answer: Boston", "new york", 0), ("", 3, 0),
    ("answer:", "x", 0), ("İİ answer: 123", 123, 1),  # İ lowers to two characters: found in the text itself
])
def test_exact_reward_compares_numbers_exactly_and_text_as_text(response, answer, score):
    assert exact(response, {"answer": answer}) == score
    if response.startswith("İ"):
        from parity.envs.math import extract_answer

        assert extract_answer(response) == "123"  # the math and tool tasks' verifier too


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(-10**30, 10**30), st.integers(-10**30, 10**30).filter(lambda d: d != 0),
       st.sampled_from(["{}", "{:,}", "{}.0", " {} ", "{} apples", "= {}", "{}e0"]),
       st.text(alphabet="abc xyz:\n", max_size=12), st.booleans())
def test_exact_takes_an_integer_in_any_of_its_spellings_and_no_other(n, delta, spelling, prefix, as_text):
    """Any integer, written plainly, with thousands commas, as a decimal or in a sentence after
    `answer:`, is that integer and no other (as a JSON number or a numeric string answer)."""
    answer = str(n) if as_text else n
    said = spelling.format(n)
    assert exact(f"{prefix}\nanswer: {said}", {"answer": answer}) == 1.0
    assert exact(f"{prefix}\nanswer: {spelling.format(n + delta)}", {"answer": answer}) == 0.0


def test_a_row_added_to_the_file_moves_at_most_one_prompt_of_the_heldout_set(tmp_path, tokenizer):
    rows = additions(400)
    before = DatasetEnv(tokenizer, write_jsonl(tmp_path / "a.jsonl", rows), heldout_size=40)
    after = DatasetEnv(tokenizer, write_jsonl(tmp_path / "b.jsonl", rows + additions(1, start=900)),
                       heldout_size=40)
    moved = {p["prompt"] for p in before.heldout()} ^ {p["prompt"] for p in after.heldout()}
    assert len(moved) <= 2  # (a shuffle seeded by the row count kept 12 of 100)


def test_prompts_over_max_prompt_tokens_are_left_out(tmp_path, tokenizer):
    rows = additions(30) + [{"prompt": "9" * 50 + "+1=", "answer": 1}]
    env = DatasetEnv(tokenizer, write_jsonl(tmp_path / "d.jsonl", rows), heldout_size=5, max_prompt_tokens=20)
    assert env.too_long == 1 and "1 over task.max_prompt_tokens left out" in env.describe()
    assert len(env._train) + len(env.heldout()) == 30
    held = write_jsonl(tmp_path / "h.jsonl", rows[-1:])  # every held-out prompt too long: said at start-up
    with pytest.raises(ConfigError, match="h.jsonl: no prompt fits task.max_prompt_tokens = 20: nothing to"):
        DatasetEnv(tokenizer, str(tmp_path / "d.jsonl"), heldout_data=held, max_prompt_tokens=20)


def test_rewards_in_a_list_are_summed_with_their_weights_and_logged_by_part(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "d.jsonl", additions(20))
    (tmp_path / "parts.py").write_text("def formatted(response, problem):\n"
                                       "    return response.startswith('answer:')\n")
    env = DatasetEnv(tokenizer, data, reward=["exact", f"{tmp_path}/parts.py:formatted", "exact"],
                     reward_weights=[1.0, 0.25, 0.5], heldout_size=5)
    problem = env.problems(0, 1)[0]
    episode = env.start(problem)
    assert env.step(episode, tokenizer.encode(f"answer: {problem['answer']}")).reward == 1.75
    assert episode.passed and episode.info["metrics"] == {"reward/exact": 1.0, "reward/formatted": 1.0,
                                                         "reward/exact_2": 1.0}
    from parity.engine import RequestOutput
    from parity.metrics.diagnostics import rollout_stats
    from parity.metrics.summary import env_metrics
    from parity.rl.rollout_worker import EpisodeResult

    other = env.start(problem)
    env.step(other, tokenizer.encode("no idea"))
    stopped = RequestOutput(0, [1], [2], [0.0], [0.0], [0], [1], "stop")
    results = [EpisodeResult(stopped, e) for e in (episode, other)]
    assert rollout_stats(results)["rollout/reward/formatted"] == 0.5
    wrong = env.start(problem)  # formatted, wrong: a reward of 0.25, and not solved
    assert env.step(wrong, tokenizer.encode("answer: 99999")).reward == 0.25 and not wrong.passed
    bonus = DatasetEnv(tokenizer, data, reward=["exact", f"{tmp_path}/parts.py:formatted"], heldout_size=5)
    wrong = bonus.start(problem)  # weights 1 and 1: 1.0 from the format alone, still not solved
    assert bonus.step(wrong, tokenizer.encode("answer: 99999")).reward == 1.0 and not wrong.passed
    huge = DatasetEnv(tokenizer, data, reward=["exact", f"{tmp_path}/parts.py:formatted"],
                      reward_weights=[1e39, 1.0], heldout_size=5)  # each part finite, the sum not (float32)
    with pytest.raises(ParityError, match=r"task.reward_weights \[1e\+39, 1.0\] make a reward of 1e\+39"):
        huge.step(huge.start(problem), tokenizer.encode(f"answer: {problem['answer']}"))
    assert huge.step(huge.start(problem), tokenizer.encode("no idea")).reward == 0.0  # (0 x 1e39: finite)
    assert TaskSection(name="dataset", data=data, reward=["exact"]).reward == "exact"
    assert env_metrics([episode, other], "eval/")["eval/reward/exact"] == 0.5
    assert "1 x" not in env.describe() and "0.25 x" in env.describe()
    for kwargs, message in [({"reward": []}, "task.reward must not be an empty list"),
                            ({"reward": ["exact"], "reward_weights": [1, 2]},
                             "one weight per task.reward entry"),
                            ({"reward": "exact", "reward_weights": [float("inf")]}, "must be finite")]:
        with pytest.raises(ConfigError, match=message):
            TaskSection(name="dataset", data=data, **kwargs)


def test_a_reward_function_scores_and_its_failures_are_one_line(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "d.jsonl", additions(20))
    (tmp_path / "rewards.py").write_text(textwrap.dedent('''
        import math
        def half(response, problem):
            return 0.5 if str(problem["answer"]) in response else 0
        def nan(response, problem):
            return math.nan
        def boom(response, problem):
            return int(response)
        def text(response, problem):
            return "1"
        value = 3
        def one_argument(response):
            return 1.0
        def leave(response, problem):
            raise SystemExit(0)
        def cancelled(response, problem):
            import asyncio
            raise asyncio.CancelledError("the judge's task")
    '''))
    episode = lambda env: env.start(env.problems(0, 1)[0])  # noqa: E731
    env = DatasetEnv(tokenizer, data, reward=f"{tmp_path}/rewards.py:half", heldout_size=5)
    problem = env.problems(0, 1)[0]
    e = env.start(problem)
    turn = env.step(e, tokenizer.encode(f"answer: {problem['answer']}<|eos|>"))
    assert turn.done and turn.reward == 0.5 and e.reward == 0.5 and not e.passed  # 1 or more solves
    # (a SystemExit ended a worker without a word; a CancelledError was a traceback per restart)
    for name, message in [("nan", "returned nan"), ("boom", "raised ValueError: invalid literal"),
                          ("text", "returned '1'"), ("leave", "raised SystemExit: 0"),
                          ("cancelled", "raised CancelledError: the judge's task")]:
        env = DatasetEnv(tokenizer, data, reward=f"{tmp_path}/rewards.py:{name}", heldout_size=5)
        with pytest.raises(ParityError, match=f"task.reward .*rewards.py:{name}.*{message}") as err:
            env.step(episode(env), tokenizer.encode("answer: 3"))
        assert "\n" not in str(err.value)
    (tmp_path / "more.py").write_text(textwrap.dedent('''
        import numpy, torch
        def np_bool(response, problem):
            return numpy.bool_(True)
        def tensor(response, problem):
            return torch.tensor(0.25)
        def huge(response, problem):
            return 10 ** 400
        def missing(response, problem):
            open("/nonexistent/judge.txt")
    '''))
    for name, value in (("np_bool", 1.0), ("tensor", 0.25)):
        env = DatasetEnv(tokenizer, data, reward=f"{tmp_path}/more.py:{name}", heldout_size=5)
        assert env.step(episode(env), tokenizer.encode("x")).reward == value
    env = DatasetEnv(tokenizer, data, reward=f"{tmp_path}/more.py:huge", heldout_size=5)
    with pytest.raises(ParityError, match="returned 1000000.*a reward is a finite number"):
        env.step(episode(env), tokenizer.encode("x"))
    env = DatasetEnv(tokenizer, data, reward=f"{tmp_path}/more.py:missing", heldout_size=5)
    with pytest.raises(OSError, match="task.reward .*more.py:missing raised FileNotFoundError"):
        env.step(episode(env), tokenizer.encode("x"))  # an OSError stays one: a transient fault
    with pytest.raises(ConfigError, match="is a int, not a function"):
        DatasetEnv(tokenizer, data, reward=f"{tmp_path}/rewards.py:value")
    with pytest.raises(ConfigError, match=r"one_argument'.*it is called as name\(response, problem\)"):
        DatasetEnv(tokenizer, data, reward=f"{tmp_path}/rewards.py:one_argument")
    with pytest.raises(ConfigError, match="has no 'missing'"):
        DatasetEnv(tokenizer, data, reward=f"{tmp_path}/rewards.py:missing")


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "1+1=", "answer": 2}', "{not json"], r"d.jsonl:2: not JSON"),
    (['["a list"]'], r"d.jsonl:1: expected a JSON object, got list"),
    (['{"answer": 2}'], "needs exactly one of 'prompt'"),
    (['{"prompt": "1+1=", "messages": [], "answer": 2}'], "needs exactly one of 'prompt'"),
    (['{"prompt": "  ", "answer": 2}'], "'prompt' must be a non-empty string"),
    (['{"prompt": "1+1="}'], r"d.jsonl:1: needs an 'answer'"),
    (['{"prompt": "1+1=", "answer": true}'], "needs an 'answer'"),
    (['{"messages": [{"role": "user"}], "answer": 2}'], "a message's 'content' must be a string"),
    (['{"messages": [{"content": "hi"}], "answer": 2}'], "'messages' must be a non-empty list"),
    (['{"prompt": "\\ud800x", "answer": 2}'], r"d.jsonl:1: 'prompt' holds a lone surrogate"),
    (['{"prompt": "1+1=", "answer": ""}'], "'answer' must be a non-empty string"),
    (['{"prompt": "1+1=", "answer": NaN}'], "needs an 'answer' \\(a string or a finite number\\)"),
    (["[" * 100_000], r"d.jsonl:1: not readable JSON \(RecursionError"),
    (["", "  "], "no problems"),
    ([json.dumps({"messages": [{"role": "user", "content": f"1+{i}="}], "answer": i + 1}) for i in range(5)],
     "needs a checkpoint with a chat"),
    (['{"prompt": "1+1=", "answer": 2}'] * 3, "leaves none of task.data's 1 distinct prompts"),
])
def test_bad_dataset_files_are_one_line_naming_the_line(tmp_path, tokenizer, lines, message):
    data = write_jsonl(tmp_path / "d.jsonl", lines)
    with pytest.raises(ConfigError, match=message) as err:
        DatasetEnv(tokenizer, data, heldout_size=3)
    assert "\n" not in str(err.value)


def test_a_data_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path, tokenizer):
    """A FIFO named as task.data (or heldout_data): its open waited for a writer for good; a device
    too is refused before it is read. A regular file beside them loads (the check is not blanket)."""
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero"):
        with pytest.raises(ConfigError, match="not a regular file"):
            DatasetEnv(tokenizer, str(path), heldout_size=1)
    good = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"prompt": f"{i}+1=", "answer": i + 1})
                                              for i in range(4)])
    assert DatasetEnv(tokenizer, good, heldout_size=1)


def test_a_tilde_in_a_configs_paths_is_the_home_directory(tmp_path, monkeypatch):
    """run_dir, model.checkpoint and a study's out_dir (from TOML, --set or --out, where no shell
    expands it) beginning with ~: each made a directory named ~ in the working directory (and
    `rm -rf ~` to clean it up deletes your home) or was "not found". A relative path stays relative."""
    from parity.apps.study_grid import load_study
    from parity.cli import build_parser

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home = tmp_path / "home"
    cfg = load_config(None, ['run_dir="~/runs/a"', 'model.checkpoint="~/ckpt"'])
    assert cfg.run_dir == str(home / "runs" / "a") and cfg.model.checkpoint == str(home / "ckpt")
    assert load_config(None, ['run_dir="runs/a"']).run_dir == "runs/a"
    study = load_study(None, quick=True, out_dir="~/study")
    assert study.out_dir == str(home / "study")
    assert study.train["model.checkpoint"] == str(home / "study" / "quick-base")
    assert build_parser().parse_args(["sft", "--out", "~/base"]).out == str(home / "base")
    from parity.errors import CheckpointError
    from parity.model import load_model
    with pytest.raises(CheckpointError, match=f"^{home / 'ckpt'}: checkpoint directory not found"):
        load_model("~/ckpt")  # (eval/generate/check --model "~/ckpt")
    with pytest.raises(CheckpointError, match="a checkpoint is a directory path, got NoneType"):
        load_model(None)  # (pathlib's TypeError)


def test_task_config_fields_belong_to_their_task_and_paths_are_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    task = TaskSection(name="dataset", data="d.jsonl", reward="r.py:score")
    assert task.data == str(tmp_path / "d.jsonl") and task.reward == f"{tmp_path}/r.py:score"
    assert TaskSection(name="custom", env="mypkg.tasks:Env").env == "mypkg.tasks:Env"  # a module as it is
    for kwargs, message in [({"name": "tool", "env": "a:b"}, "task.env is for task.name = 'custom'"),
                            ({"name": "math", "data": "x"}, "task.data is for task.name = 'dataset'"),
                            ({"name": "tool", "reward": "a:b"}, "task.reward is for"),
                            ({"name": "tool", "options": {"a": 1}}, "task.options is for"),
                            ({"name": "dataset"}, "needs task.data"),
                            ({"name": "custom"}, "needs task.env"),
                            ({"name": "custom", "env": "no_colon"}, "task.env must be 'module:name'"),
                            ({"name": "custom", "env": "a:1x"}, "task.env must be 'module:name'"),
                            ({"name": "custom", "env": "a:b", "options": {"x": None}},
                             "task.options.x must be a string, number"),
                            ({"name": "dataset", "data": "d", "reward": ":f"}, "task.reward must be"),
                            ({"name": "custom", "env": "a:b", "options": {"x": [float("nan")]}},
                             r"task.options.x\[0\] must be finite"),
                            ({"name": "custom", "env": "a:b", "options": {"x": 2**64}},
                             "must fit in 64 bits")]:
        with pytest.raises(ConfigError, match=message):
            TaskSection(**kwargs)
    cfg = config_from_dict({"task": {"name": "custom", "env": "e.py:Toy",
                                     "options": {"mode": "ok", "odd key": [1, {"x": "a\"\n\x7f\x00"}]}}})
    import tomllib

    assert config_from_dict(tomllib.loads(to_toml(cfg))) == cfg  # config.toml reads back, options too


def toy_file(tmp_path):
    path = tmp_path / "toy_env.py"
    path.write_text(TOY_ENV)
    return path


@pytest.mark.parametrize("mode, message", [
    ("short", r"problems\(0, 2\) returned 1 problems, expected a list of 2"),
    ("oov", r"prompt_ids holds token id 64, outside the vocabulary \(0..63\)"),
    ("random", r"gave other prompts when called again"),
    ("raise", r"step\(Episode, list\) raised KeyError: 'boom'"),
    ("nan", r"step returned reward nan"),
    ("observation", r"done = False, but the environment's multi_turn is False"),
    # (a traceback in `parity eval`; in training a worker crash, restarted 3 times)
    ("passed_none", r"episode.passed = None; it must be True or False"),
    ("calls_str", r"episode.tool_calls = '2'; it must be an integer >= 0"),
    ("done_str", r"step returned done = 'no'; done is True or False"),
])
def test_a_custom_env_is_checked_where_it_enters_the_run(tmp_path, mode, message):
    spec = f"{toy_file(tmp_path)}:Toy"
    ctx = TaskContext(None, VOCAB, 0, 4)
    assert build_custom_env(spec, {}, ctx).problems(0, 2)  # the control: mode "ok" passes
    with pytest.raises(ParityError, match=message) as err:
        env = build_custom_env(spec, {"mode": mode}, ctx)
        env.step(Episode([1]), [7, 7, 3])
    assert "\n" not in str(err.value)
    assert mode != "raise" or isinstance(err.value.__cause__, KeyError)  # PARITY_DEBUG=1 shows its traceback
    env = build_custom_env(spec, {"mode": "oserror"}, ctx)  # a transient fault passes as it is
    with pytest.raises(OSError, match="flaky tool"):
        env.step(Episode([1]), [7])


MORE_ENVS = '''
import numpy
from helper import PROMPT  # a module beside the env file imports as a script's neighbours do
from parity.envs.base import Env, Turn

class Base(Env):
    def __init__(self, ctx):
        pass
    def problems(self, batch_index, n):
        return [PROMPT] * n
    def heldout(self, n=None):
        return [PROMPT]
    def prompt_ids(self, problem):
        return numpy.array(problem)  # NumPy integers are token ids too
    def step(self, episode, turn_ids):
        return Turn(None, True, 0.0)

class NoPassed(Base):  # never sets episode.passed: a reward of 1 or more counts as solved
    def step(self, episode, turn_ids):
        return Turn(None, True, numpy.float32(turn_ids[0] == 7))

class Observes(Base):
    multi_turn = True
    def step(self, episode, turn_ids):
        episode.turns += 1
        return Turn(numpy.array([5, 6]), False, 0.0) if episode.turns == 1 else Turn(None, True, 0.0)

class StringStops(Base):
    stop_strings = "</x>"

class FloatIds(Base):
    def prompt_ids(self, problem):
        return [1.0, 2.0]

class BadMetrics(Base):
    def step(self, episode, turn_ids):
        episode.info["metrics"] = {"confidence": "high"}
        return Turn(None, True, 0.0)

class FinalMetric(Base):
    def step(self, episode, turn_ids):
        episode.info["metrics"] = {"accuracy_final": 1.0}
        return Turn(None, True, 0.0)

class NoHeldout(Base):
    def heldout(self, n=None):
        return []

class BadInit(Base):
    def __init__(self, ctx, level=1):
        {}["level"]
'''


def test_custom_envs_of_unusual_but_valid_shapes_and_their_mistakes(tmp_path):
    (tmp_path / "helper.py").write_text("PROMPT = [1, 2, 3]\n")
    (tmp_path / "more_envs.py").write_text(MORE_ENVS)
    ctx = TaskContext(None, VOCAB, 0, 4)
    build = lambda name, **options: build_custom_env(f"{tmp_path}/more_envs.py:{name}", options, ctx)  # noqa: E731
    env = build("NoPassed")
    assert env.prompt_ids(env.problems(0, 1)[0]) == [1, 2, 3] and env.describe().startswith("task: NoPassed")
    solved, failed = env.start([1]), env.start([1])
    assert env.step(solved, [7]).reward == 1.0 and solved.passed and not env.step(failed, [3]).reward
    assert not failed.passed
    env = build("Observes")
    episode = env.start([1])
    assert env.step(episode, [9]).observation == [5, 6] and env.step(episode, [9]).done
    with pytest.raises(ParityError, match=r"stop_strings must be a list of non-empty strings, got '</x>'"):
        assert build("StringStops").stop_strings
    with pytest.raises(ParityError, match=r"prompt_ids holds 1.0 \(float\); token ids are integers"):
        build("FloatIds")
    with pytest.raises(ParityError, match=r"info\['metrics'\] must map names to finite numbers, got"):
        build("BadMetrics").step(Episode([1]), [3])
    with pytest.raises(ParityError, match="name 'accuracy_final': names ending in _final are the run's last"):
        build("FinalMetric").step(Episode([1]), [3])
    with pytest.raises(ConfigError, match=r"heldout\(1\) returned no problem: nothing to evaluate on"):
        build("NoHeldout")
    with pytest.raises(ConfigError, match=r"BadInit' raised KeyError: 'level'") as err:
        build("BadInit", level=2)
    assert "called as" not in str(err.value)  # its own TypeError or KeyError is not a signature hint


def test_custom_env_loading_errors_are_one_line(tmp_path):
    ctx = TaskContext(None, VOCAB, 0, 4)
    path = toy_file(tmp_path)
    (tmp_path / "broken.py").write_text("import nothing_here_at_all\n")
    (tmp_path / "leaves.py").write_text("import sys\ndef env(ctx):\n    sys.exit(0)\n")
    for spec, options, message in [
            (f"{tmp_path}/leaves.py:env", {}, "leaves.py:env' raised SystemExit: 0"),  # (ended a run, rc 0)
            (f"{tmp_path}/none.py:Toy", {}, "no such file"),
            (f"{path}:Nope", {}, "has no 'Nope'"),
            (f"{tmp_path}/broken.py:Toy", {}, "importing .*broken.py raised ModuleNotFoundError"),
            ("parity_no_such_module:Env", {}, "no module named 'parity_no_such_module'"),
            (f"{path}:random", {}, "module, not a class or function"),
            (f"{path}:Toy", {"colour": "red"}, "unexpected keyword argument 'colour'.*task.options"),
            ("parity.envs.base:Turn", {}, "Turn without problems, heldout, prompt_ids"),
    ]:
        with pytest.raises(ConfigError, match=message) as err:
            build_custom_env(spec, options, ctx)
        assert "\n" not in str(err.value)


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "parity.cli", *args], capture_output=True, text=True,
                          timeout=600, cwd=cwd)


def test_a_custom_env_trains_in_rollout_workers_and_evaluates_from_the_runs_config(tmp_path):
    """End to end: the env file is loaded by name in the learner and in a worker process (async,
    lag 1), the run's config.toml names it for `parity eval --config`; a failing env stops the
    run in one line with the checkpoint of its last whole step."""
    toy_file(tmp_path)
    sets = ["steps=2", "model.preset=\"tiny\"", "run_dir=\"run\"", "rollout.prompts_per_step=2",
            "max_policy_lag=1", "task.name=\"custom\"", "task.env=\"toy_env.py:Toy\"", "task.heldout_size=8",
            "eval_prompts=4", "eval_every=1", "task.options.target=3"]
    proc = run("train", *[x for s in sets for x in ("--set", s)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert all(0 <= r["reward/mean"] <= 1 and r["rollout/length"] >= 1 for r in records)
    assert "eval/length" in records[0]
    kept = list((tmp_path / "run" / "task-files").iterdir())  # what it ran, named by its content
    assert len(kept) == 1 and kept[0].name.startswith("toy_env-") and kept[0].read_text() == TOY_ENV
    config = load_config(tmp_path / "run" / "config.toml")
    assert config.task.env == f"{tmp_path}/toy_env.py:Toy" and config.task.options == {"target": 3}
    proc = run("eval", "--config", str(tmp_path / "run" / "config.toml"), "-k", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    assert f"evaluating {tmp_path}/run/checkpoint-2" in proc.stderr  # the run's newest checkpoint
    result = json.loads(proc.stdout)
    assert result["eval/problems"] == 8 and math.isfinite(result["eval/pass@1"])  # its whole held-out set

    bad = run("train", *[x for s in sets + ["task.options.mode=\"raise\"", "eval_every=0",
                                            "run_dir=\"bad\""] for x in ("--set", s)], cwd=tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "step(Episode, list) raised KeyError: 'boom'" in bad.stderr.strip().splitlines()[-1]


def test_a_resume_knows_when_your_tasks_files_changed(tmp_path):
    """The checkpoint records the files' contents beside the config (a data file edited between a
    run and its resume changes the held-out set and the batches: the resume warns, and batches
    sampled ahead are sampled again)."""
    from parity.rl.checkpoint import _changed, sampling_fields

    data = write_jsonl(tmp_path / "d.jsonl", additions(10))
    (tmp_path / "r.py").write_text("def score(response, problem):\n    return 0.0\n")
    cfg = config_from_dict({"model": {"checkpoint": str(tmp_path)},
                            "task": {"name": "dataset", "data": data, "reward": f"{tmp_path}/r.py:score"}})
    saved = sampling_fields(cfg)
    assert saved["task"]["data_sha256"] and saved["task"]["reward_sha256"]
    assert _changed(saved, sampling_fields(cfg)) == []
    write_jsonl(tmp_path / "d.jsonl", additions(11))
    (tmp_path / "r.py").write_text("def score(response, problem):\n    return 1.0\n")
    assert _changed(saved, sampling_fields(cfg)) == ["task.data_sha256", "task.reward_sha256"]
    # a checkpoint of a version before these fields: nothing changed while they hold their defaults
    old = sampling_fields(config_from_dict({}))
    for key in ("data", "heldout_data", "reward", "env", "options", "max_prompt_tokens"):
        del old["task"][key]
    assert _changed(old, sampling_fields(config_from_dict({}))) == []
    assert _changed(old, sampling_fields(config_from_dict({"task": {"name": "custom", "env": "m:E"}}))) == \
        ["task.env", "task.name"]
    # the run's seed draws the prompts and sampling seeds (a resume with another one trained on the
    # batches the old seed sampled ahead, silently: a run of neither seed)
    seed0, seed1 = (sampling_fields(config_from_dict({"seed": s})) for s in (0, 1))
    assert _changed(seed0, seed1) == ["run.seed"] and _changed(seed0, seed0) == []


def test_a_reward_function_judges_an_engine_steps_responses_on_several_threads(tmp_path, tokenizer, tiny):
    """A reward that waits (a judge over the network, a sandbox) is called on a pool, as a multi-turn
    env's steps are; the exact reward, which only computes, is not."""
    from parity.engine import Engine, SamplingParams
    from parity.rl.rollout_worker import run_episodes

    (tmp_path / "slow.py").write_text(textwrap.dedent('''
        import threading, time
        THREADS = set()
        def judge(response, problem):
            THREADS.add(threading.get_ident())
            time.sleep(0.05)
            return 0.0
    '''))
    data = write_jsonl(tmp_path / "d.jsonl", additions(30))
    env = DatasetEnv(tokenizer, data, reward=f"{tmp_path}/slow.py:judge", heldout_size=5)
    assert env.threaded and not DatasetEnv(tokenizer, data, heldout_size=5).threaded
    problems = env.problems(0, 8)
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)] * 8  # all finish in one step
    run_episodes(Engine(tiny, max_num_seqs=8), env, problems, params)
    assert len(env.rewards[0][2].__globals__["THREADS"]) > 1


def test_eval_config_of_a_hand_written_file_does_not_take_the_default_run_dirs_checkpoints(tmp_path,
                                                                                          monkeypatch):
    from parity.apps.evaluate import _newest

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "default" / "checkpoint-5").mkdir(parents=True)  # someone else's run
    (tmp_path / "runs" / "default" / "checkpoint-5" / "manifest.json").write_text('{"files": {}}')  # (intact)
    (tmp_path / "mine.toml").write_text('[task]\nname = "math"\n[model]\ncheckpoint = "base-math"\n')
    run = load_config(tmp_path / "mine.toml")
    assert _newest(run, tmp_path / "mine.toml", names_run_dir=False) == "base-math"
    assert _newest(run, tmp_path / "mine.toml", names_run_dir=True).endswith("runs/default/checkpoint-5")


def test_a_reward_that_takes_the_sandbox_runs_the_models_code_there(tmp_path, tokenizer):
    """examples/code_rewards.py: the model's code runs on the cases' arguments in the sandbox and
    the results are judged here; two ways past an in-sandbox assert (an always-equal object, a
    printed result and an early clean exit) earn nothing, and output too deeply nested to parse
    is the model's failure, not the run's."""
    from pathlib import Path

    spec = f"{Path(__file__).parents[1]}/examples/code_rewards.py:passes_tests"
    rows = [{"prompt": f"Write f(x) returning x+{i}.", "entry": "f", "cases": [[[1], 1 + i], [[5], 5 + i]]}
            for i in range(6)]
    env = DatasetEnv(tokenizer, write_jsonl(tmp_path / "code.jsonl", rows), reward=spec, heldout_size=2)
    problem = env.heldout()[0]  # (its own sandbox: none was given)
    plus = problem["cases"][0][1] - 1

    def score(code: str) -> float:
        episode = env.start(problem)
        return env.step(episode, tokenizer.encode(f"```python\n{code}\n```")).reward

    assert score(f"def f(x):\n    return x + {plus}") == 1.0
    assert score(f"def f(x):\n    return x + {plus} if x == 1 else 0") == 0.5
    always_equal = "class A:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return A()"
    assert score(always_equal) == 0.0
    assert score("import os\nprint('[%d, %d]' % (1, 5))\nos._exit(0)") == 0.0
    assert score("import os\nprint('[' * 20000 + ']' * 20000)\nos._exit(0)") == 0.0  # (stopped the run:
    # the host's json.loads raised RecursionError)
    assert score("print(1)") == 0.0  # no f
    episode = env.start(problem)
    assert env.step(episode, tokenizer.encode(f"def f(x): return x + {plus}")).reward == 0.0  # no code block



def test_the_calculator_example_runs_its_tool_in_the_sandbox_and_scores_the_answer(tokenizer):
    """examples/calculator_env.py as examples/calculator.toml builds it: problems from (seed, batch)
    alone, the held-out set kept out of them, a tool call answered with what the sandbox printed,
    the final `answer: N` scored, a bad `digits` refused in one line."""
    from pathlib import Path

    from parity.config.loading import read_toml

    root = Path(__file__).parents[1]
    options = read_toml(root / "examples" / "calculator.toml")["task"]["options"]
    spec = f"{root}/examples/calculator_env.py:CalculatorEnv"
    env = build_custom_env(spec, options, TaskContext(tokenizer, 512, 0, 20))
    assert env.name == "calculator-sums-5x2-3"
    held = {p["prompt"] for p in env.heldout()}
    batch = env.problems(3, 16)
    assert batch == env.problems(3, 16) and not held & {p["prompt"] for p in batch}
    sizes = {len(t) for p in batch for t in p["prompt"][len("What is "):-1].split("+")}
    assert sizes == {2, 3}  # five terms of 2 or 3 digits each
    problem = env.heldout()[0]
    episode = env.start(problem)
    expr = problem["prompt"][len("What is "):-1]
    turn = env.step(episode, tokenizer.encode(f'<python>print("answer:", {expr})</python>'))
    shown = tokenizer.decode(turn.observation)
    assert not turn.done and shown == f"<result>answer: {problem['answer']}\n</result>"
    assert env.step(episode, tokenizer.encode(f"answer: {problem['answer']}")).reward == 1.0
    wrong = env.start(problem)
    assert env.step(wrong, tokenizer.encode(f"answer: {problem['answer'] + 1}")).reward == 0.0
    # (a review: 5,000 digits raised inside int() and stopped the run; the last number was read)
    assert env.step(env.start(problem), tokenizer.encode("answer: " + "9" * 5000)).reward == 0.0
    said = f"answer: {problem['answer']} (the sum of 5 terms)"
    assert env.step(env.start(problem), tokenizer.encode(said)).reward == 1.0
    with pytest.raises(ConfigError, match=r"digits must be 1..18 or \[fewest, most\], got \[3, 2\]"):
        build_custom_env(spec, {**options, "digits": [3, 2]}, TaskContext(tokenizer, 512, 0, 4))
    with pytest.raises(ConfigError, match="terms must be 1..50, got 0"):  # (all "What is ?": a hang)
        build_custom_env(spec, {**options, "terms": 0}, TaskContext(tokenizer, 512, 0, 4))
    with pytest.raises(ParityError, match="almost every problem is held out"):  # (9 problems, 200 drawn)
        build_custom_env(spec, {**options, "terms": 1, "digits": 1}, TaskContext(tokenizer, 512, 0, 200))


def test_the_additions_example_holds_out_sums_the_base_never_trained_on(tokenizer):
    """examples/additions.toml from `base-math` held out 100 rows of additions.jsonl, 71 of them
    among that base's fine-tuning examples (its accuracy there was partly recall). Its held-out file
    now lists sums of the math task's held-out set, which `parity sft` leaves out of every base's
    training; the training rows with those prompts are left out of the example's training."""
    from pathlib import Path

    from parity.apps.sft import RECIPES
    from parity.config.loading import read_toml
    from parity.envs.math import MathTask

    root = Path(__file__).parents[1]
    task = read_toml(root / "examples" / "additions.toml")["task"]
    recipe = RECIPES["base-math"]
    never_trained = {p.prompt for p in MathTask(recipe.math_task, recipe.math_level).heldout()}
    env = DatasetEnv(tokenizer, str(root / task["data"]), heldout_data=str(root / task["heldout_data"]))
    held = [row["prompt"] for row in env.heldout()]
    assert len(held) == 100 and set(held) <= never_trained
    assert not set(held) & {row["prompt"] for row in env.problems(0, 600)}
    rows = [json.loads(line)["prompt"] for line in open(root / task["data"])]
    assert len(set(rows) & never_trained) < len(rows) // 20  # the control: the data itself is mostly seen


def test_a_held_out_set_larger_than_what_training_left_out_is_refused(tmp_path):
    """The tool and math tasks hold out the first task.heldout_size problems of a fixed stream, so
    a larger set than a checkpoint's training left out scored problems it trained on: a base
    policy's fine-tuning leaves out 200; a run its own heldout_size, after what its start left out.
    The controls: the same size or smaller, another task, a base that never trained the task."""
    from parity.apps.heldout import check_unseen

    base = tmp_path / "base-math"
    base.mkdir()
    (base / "sft.json").write_text(json.dumps({"config": {"tool_fraction": 0.0, "math_task": "add",
                                                          "math_level": 1, "tool_use": {"mul": 1.0},
                                                          "tool_level": 1}}))
    run = tmp_path / "run"
    (run / "checkpoint-5").mkdir(parents=True)
    (run / "config.toml").write_text(f'[task]\nname = "math"\nheldout_size = 100\n\n'
                                     f'[model]\ncheckpoint = "{base}"\n')

    def check(where, **task):
        check_unseen(config_from_dict({"model": {"checkpoint": str(where)}, "eval_prompts": 1,
                                       "task": {"name": "math", **task}}))
    with pytest.raises(ConfigError, match=r"task.heldout_size 300 exceeds the 200 held-out problems the base "
                                          r"policy's fine-tuning .* problems 200..299 were training"):
        check(base, heldout_size=300)
    with pytest.raises(ConfigError, match=r"exceeds the 100 held-out problems the run in .* \(use at most 1"):
        check(run / "checkpoint-5", heldout_size=150)
    check(base, heldout_size=200)  # the controls
    check(run / "checkpoint-5", heldout_size=100)
    check(base, heldout_size=300, math_task="mul")
    check_unseen(config_from_dict({"model": {"checkpoint": str(base)}, "eval_prompts": 1,
                                   "task": {"name": "tool", "heldout_size": 300, "kinds": ["mul"]}}))


def test_a_datasets_held_out_set_that_holds_training_prompts_is_refused(tmp_path, tokenizer):
    """A dataset task holds out the task.heldout_size prompts a fixed hash ranks first, so `parity eval
    --config RUN/config.toml --set task.heldout_size=10` on a run that held out 4 scored 6 prompts it
    trained on, without a word (a README review). Refused now, as are two more ways in: the data's
    hash-ranked set where the run held out a file of its own, and a stricter task.max_prompt_tokens
    (shorter training prompts move up). The controls: each leak measured on the environment itself;
    the run's own settings, a smaller set, a looser filter, a held-out file."""
    from parity.apps.heldout import check_unseen

    rows = additions(40, start=85)  # prompts of 5 characters (85..99) and of 6 (100..124)
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    held = write_jsonl(tmp_path / "h.jsonl", additions(5, start=500))

    def run(name, **task):
        (tmp_path / name / "checkpoint-3").mkdir(parents=True)
        cfg = config_from_dict({"eval_prompts": 1, "model": {"checkpoint": str(tmp_path / "start")},
                                "task": {"name": "dataset", "data": data, **task}})
        (tmp_path / name / "config.toml").write_text(to_toml(cfg))  # (as a run writes it)
        return tmp_path / name / "checkpoint-3"

    def check(where, **task):
        check_unseen(config_from_dict({"model": {"checkpoint": str(where)}, "eval_prompts": 1,
                                       "task": {"name": "dataset", "data": data, **task}}))

    def trained(**task):
        return {r["prompt"] for r in DatasetEnv(tokenizer, data, **task).problems(0, 100)}

    def heldout(**task):
        return {r["prompt"] for r in DatasetEnv(tokenizer, data, **task).heldout()}

    plain, with_file = run("plain", heldout_size=4), run("file", heldout_data=held)
    short = len(DatasetEnv(tokenizer, data, heldout_size=4).prompt_ids(rows[0]))  # (85+1=: 7 with markers)
    assert len(heldout(heldout_size=10) & trained(heldout_size=4)) == 6  # the leak
    with pytest.raises(ConfigError, match=r"task.heldout_size 10 exceeds the 4 held-out problems the run"):
        check(plain, heldout_size=10)
    assert heldout(heldout_size=4) & trained(heldout_data=held)  # evaluated on the data, trained on it
    with pytest.raises(ConfigError, match=r"held out task.heldout_data .*h.jsonl and trained on every other"):
        check(with_file, heldout_size=4)
    leaked = heldout(heldout_size=4, max_prompt_tokens=short) & trained(heldout_size=4)
    assert leaked and all(len(p) == 5 for p in leaked)  # the short prompts moved up
    with pytest.raises(ConfigError, match=r"task.max_prompt_tokens 7 leaves out prompts the run in .* kept "
                                          r"\(its task.max_prompt_tokens: 0\).* \(use 0\)"):
        check(plain, heldout_size=4, max_prompt_tokens=short)
    strict = run("strict", heldout_size=4, max_prompt_tokens=short)
    assert not heldout(heldout_size=4) & trained(heldout_size=4, max_prompt_tokens=short)  # looser: safe
    check(strict, heldout_size=4)  # the controls
    check(strict, heldout_size=4, max_prompt_tokens=short + 1)
    check(plain, heldout_size=4)
    check(plain, heldout_size=3)
    check(with_file, heldout_data=held, heldout_size=5)
    task = {"name": "dataset", "data": data, "heldout_size": 4}  # the default 32 eval_prompts: held to the
    start = {"checkpoint": str(tmp_path / "start")}  # held-out size only where the run evaluates (it
    config_from_dict({"eval_every": 0, "model": start, "task": task})  # refused a run that never does)
    with pytest.raises(ConfigError, match=r"eval_prompts \(32\) must be at most task.heldout_size \(4\)"):
        config_from_dict({"eval_every": 1, "model": start, "task": task})


def test_the_digits_reward_example_reads_the_answer_as_exact_does():
    """examples/rewards.py:digits read `-?\\d+`: `3.5`, `1,234` and `1e3` scored 0 where `exact`
    gives 1, and a longer number was compared from its first digit (a review, 2026-12-07). It
    takes `exact`'s verdict now, and its partial credit aligns both numbers on their last digit."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "examples" / "rewards.py"
    spec = importlib.util.spec_from_file_location("example_rewards", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for said, answer in (("3.5", 3.5), ("1,234", 1234), ("1e3", 1000), ("-7", -7), ("132", "132")):
        assert module.digits(f"answer: {said}", {"answer": answer}) == 1.0 == exact(f"answer: {said}",
                                                                                   {"answer": answer})
    assert module.digits("answer: 124", {"answer": 123}) == pytest.approx(0.6)  # two of three digits
    assert module.digits("answer: 23", {"answer": 123}) == pytest.approx(0.6)
    assert module.digits("answer: 99123", {"answer": 123}) == pytest.approx(0.9 * 3 / 5)  # (was 0)
    assert module.digits("answer: 3.4", {"answer": 3.5}) == 0.0 == module.digits("no answer", {"answer": 3})
    assert module.digits("answer: " + "9" * 5000, {"answer": 5}) == 0.0
