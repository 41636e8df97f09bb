"""Any Hugging Face tokenizer and chat template: byte-level BPE through `tokenizers`, templates
rendered exactly as `transformers` renders them, EOS ids from the checkpoint's configs, and
environments that prompt a model in its own format (tool markers spelled out as text)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import parity
from parity.cli import main
from parity.envs.math import MathEnv
from parity.envs.tool import ToolEnv
from parity.errors import InputError
from parity.model.tokenizer import HFTokenizer, copy_tokenizer

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|eot_id|>",
           "<|start_header_id|>", "<|end_header_id|>"]

CHATML = ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
          "<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
          "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA = ("{{ bos_token }}{% for message in messages %}"
         "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
         "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
         "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
FANCY = ("{%- set ns = namespace(turns=0) -%}\n"
         "{%- for m in messages -%}\n"
         "  {%- if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif -%}\n"
         "  {%- if m.role == 'system' %}{% continue %}{% endif -%}\n"
         "  {%- set ns.turns = ns.turns + 1 -%}\n"
         "  [{{ ns.turns }}] {{ m.role }}: {{ m.content | tojson }}\n"
         "  {%- if m.role == 'assistant' %}{% generation %} (done){% endgeneration %}{% endif %}\n"
         "{% endfor -%}\n"
         "{%- if add_generation_prompt %}[{{ ns.turns + 1 }}] assistant:{% endif -%}")

CONVERSATIONS = [
    [{"role": "user", "content": "What is 48213*9127?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo ✓"}],
    [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "answer: 4"},
     {"role": "user", "content": "  and 3+3?  "}],
]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A byte-level BPE tokenizer trained here, saved by transformers with a chat template."""
    path = tmp_path_factory.mktemp("bpe")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [f"What is {a}*{b}? answer: {a * b} <python>print({a}+{b})</python> héllo ✓"
            for a in range(40) for b in range(7)]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                              eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHATML
    hf.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 2]}))
    return path


def hf_tokenizer(path, template):
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.chat_template = template
    return tok


def ids_of(result):
    return list(result["input_ids"] if isinstance(result, dict) or hasattr(result, "keys") else result)


def test_byte_level_bpe_encodes_and_decodes_like_transformers(bpe_dir):
    ours = HFTokenizer(bpe_dir / "tokenizer.json")
    theirs = transformers.AutoTokenizer.from_pretrained(bpe_dir)
    for text in ("What is 12*34? answer: 408", "héllo ✓ <python>print(1)</python>", "  spaces\tand\nlines"):
        ids = ours.encode(text)
        assert ids == theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == text
    assert ours.eos_token_ids == sorted({theirs.convert_tokens_to_ids("<|im_end|>"), 4, 2})
    assert ours.special_tokens["bos_token"] == "<|begin_of_text|>"


@pytest.mark.parametrize("template", [CHATML, LLAMA, FANCY], ids=["chatml", "llama3", "features"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_templates_render_as_transformers_renders_them(bpe_dir, template, generation_prompt):
    ours = HFTokenizer(bpe_dir / "tokenizer.json")
    ours.chat_template = template
    theirs = hf_tokenizer(bpe_dir, template)
    for conversation in CONVERSATIONS:
        text = ours.render_chat(conversation, add_generation_prompt=generation_prompt)
        assert text == theirs.apply_chat_template(conversation, tokenize=False,
                                                  add_generation_prompt=generation_prompt)
        ids = theirs.apply_chat_template(conversation, tokenize=True, add_generation_prompt=generation_prompt)
        assert ours.apply_chat_template(conversation, add_generation_prompt=generation_prompt) == ids_of(ids)


def test_the_chat_template_file_and_template_errors(bpe_dir, tmp_path):
    ours = HFTokenizer(bpe_dir / "tokenizer.json")
    assert ours.chat_template == CHATML  # from the directory transformers wrote
    ours.chat_template = FANCY
    with pytest.raises(InputError, match="no tools here"):
        ours.render_chat([{"role": "tool", "content": "x"}])
    ours.chat_template = "{% for m in messages %}{{ m.content }"
    with pytest.raises(InputError, match="syntax error") as err:
        ours.render_chat(CONVERSATIONS[0])
    assert "\n" not in str(err.value)


def test_a_hostile_chat_template_is_one_line_and_bounded(bpe_dir):
    """A checkpoint's template hung the host (nested loops of 10^5), asked for 4 GB ("a" * 10**9:
    a Rust abort), or printed a traceback (1/0, "a" + 1, a macro that recurses): each is now an
    InputError naming the template, at once; a real template still renders."""
    from parity.model.chat_template import MAX_RENDER_CHARS, render_chat

    hi = [{"role": "user", "content": "hi"}]
    for template, message in [
            ("{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}", "loop steps"),
            ("{{ 'a' * 1000000000 }}", "a product of 1,000,000,000 items"),
            ("{{ 10 ** 100000 }}", "a power of exponent"),
            ("{% for i in range(2000) %}{{ 'x' * 4000 }}{% endfor %}", f"passed {MAX_RENDER_CHARS:,} chara"),
            ("{{ 1 / 0 }}", "ZeroDivisionError"), ("{{ messages[0].content + 1 }}", "TypeError"),
            ("{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
            ("{{ ''.__class__.__mro__ }}", "unsafe"), ("{{ 'a'|center(10**12) }}", "center: a width of"),
            ("{{ '%1000000000000s'|format('a') }}", "a format width"),
            ("{{ '%1000000000000s' % 'a' }}", "a format width")]:
        with pytest.raises(InputError, match=message) as err:
            render_chat(template, hi)
        assert str(err.value).startswith("chat template: ") and "\n" not in str(err.value), template
    real = "{% for m in messages %}<{{ m.content }}>{% endfor %}{% for i in range(3) %}.{% endfor %}"
    assert render_chat(real, hi) == "<hi>..."
    widths = "{{ '%-4s|%.2f'|format('ab', 1.234) }}{{ 'x'|center(3) }}{{ '%d' % 3 }}"  # (ordinary ones work)
    assert render_chat(widths, hi) == "ab  |1.23 x 3"
    tok = HFTokenizer(bpe_dir / "tokenizer.json")
    with pytest.raises(InputError, match="text of 3,000,000 characters: more than"):
        tok.encode("x" * 3_000_000)  # (10 million took 3.9 GB in the tokenizer)
    assert tok.decode(tok.encode("x" * 1000)) == "x" * 1000


def test_environments_prompt_in_the_models_own_format(bpe_dir):
    tok = HFTokenizer(bpe_dir / "tokenizer.json")
    env = MathEnv(tok, "add", 1)
    problem = env.heldout(1)[0]
    ids = env.prompt_ids(problem)
    assert tok.decode(ids).endswith(f"<|im_start|>user\n{problem.prompt}<|im_end|>\n<|im_start|>assistant\n")


def test_a_dataset_prompts_its_messages_in_the_models_own_format(bpe_dir, tmp_path):
    """Your own dataset's `messages` (a system prompt, few-shot turns) and `prompt` rows render as
    transformers renders them with the checkpoint's chat template, token for token."""
    from parity.envs.dataset import DatasetEnv

    rows = [{"messages": conversation, "answer": 4} for conversation in CONVERSATIONS] + \
        [{"prompt": f"What is {a}*3?", "answer": a * 3} for a in range(8)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = DatasetEnv(HFTokenizer(bpe_dir / "tokenizer.json"), str(tmp_path / "d.jsonl"), heldout_size=2)
    theirs = hf_tokenizer(bpe_dir, CHATML)
    for row in env.heldout() + env.problems(0, 8):
        conversation = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        assert env.prompt_ids(row) == ids_of(theirs.apply_chat_template(conversation, tokenize=True,
                                                                           add_generation_prompt=True))


def test_the_tool_task_with_a_tokenizer_that_spells_its_markers_out(bpe_dir):
    tok = HFTokenizer(bpe_dir / "tokenizer.json")
    env = ToolEnv(tok, ("mul",), 1, sandbox=None)
    assert env.stop_token_ids == [] and env.stop_strings == ["</python>"]
    problem = env.heldout(1)[0]
    episode = env.start(problem)
    call = env.step(episode, tok.encode('<python>print("answer:", ' + problem.prompt[8:-1] + ")</python>"))
    assert not call.done and f"answer: {problem.answer}" in tok.decode(call.observation)
    end = env.step(episode, tok.encode(f"answer: {problem.answer}") + [tok.token_id("<|im_end|>")])
    assert end.done and end.reward == 1.0 and episode.tool_calls == 1


def test_generate_chat_with_a_checkpoint_that_brings_its_tokenizer(bpe_dir, tmp_path, capsys):
    cfg = parity.ModelConfig.preset("tiny", vocab_size=512, eos_token_id=2)
    parity.Model(cfg, seed=0).save_pretrained(tmp_path)
    for path in bpe_dir.iterdir():  # tokenizer.json, tokenizer_config.json, chat_template.jinja, ...
        (tmp_path / path.name).write_bytes(path.read_bytes())
    assert main(["generate", "--model", str(tmp_path), "--prompt", "What is 2*3?", "--chat", "--json",
                 "--max-tokens", "5"]) == 0
    out = json.loads(capsys.readouterr().out)[0]
    assert HFTokenizer(tmp_path / "tokenizer.json").decode(out["prompt_token_ids"]).endswith(
        "<|im_start|>user\nWhat is 2*3?<|im_end|>\n<|im_start|>assistant\n")
    assert len(out["logprobs"]) == len(out["token_ids"]) and all(lp <= 0 for lp in out["logprobs"])
    assert torch.tensor(out["logprobs"]).isfinite().all()


def test_generate_chat_in_paritys_own_turn_format(tmp_path, capsys):
    """A checkpoint with parity's character tokenizer (as `parity sft` writes) has no chat
    template: --chat gives the tasks' turn format, whose markers are single tokens; a checkpoint
    with neither a template nor the turn tokens is a one-line error."""
    from parity.model.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = parity.ModelConfig.preset("tiny", vocab_size=tok.get_vocab_size())
    parity.Model(cfg, seed=0).save_pretrained(tmp_path / "char")
    tok.save(str(tmp_path / "char" / "tokenizer.json"))
    assert main(["generate", "--model", str(tmp_path / "char"), "--prompt", "What is 2*3?", "--chat",
                 "--json", "--max-tokens", "3"]) == 0
    ids = json.loads(capsys.readouterr().out)[0]["prompt_token_ids"]
    char = HFTokenizer(tmp_path / "char" / "tokenizer.json")
    assert ids[0] == char.token_id("<|user|>") and ids[-1] == char.token_id("<|assistant|>")
    assert char.decode(ids) == "<|user|>What is 2*3?<|assistant|>"
    parity.Model(cfg, seed=0).save_pretrained(tmp_path / "bare")  # UTF-8 bytes, no turn tokens
    assert main(["generate", "--model", str(tmp_path / "bare"), "--prompt", "hi", "--chat"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no chat template" in err


def test_eval_and_train_accept_a_brought_checkpoint(bpe_dir, tmp_path, capsys):
    """A Qwen2 checkpoint written by transformers, with its own BPE tokenizer and chat template."""
    cfg = transformers.Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    ckpt = tmp_path / "qwen2"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(ckpt)
    for path in bpe_dir.iterdir():
        (ckpt / path.name).write_bytes(path.read_bytes())
    assert main(["eval", "--model", str(ckpt), "--task", "math", "--n", "2", "-k", "0", "--max-tokens", "4",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["eval/problems"] == 2.0
    sets = ['task.name="math"', f'model.checkpoint="{ckpt}"', "steps=1", "rollout.prompts_per_step=2",
            "rollout.group_size=2", "rollout.max_tokens=4", "eval_every=0", f'run_dir="{tmp_path / "run"}"']
    assert main(["train", *[x for s in sets for x in ("--set", s)]]) == 0
    saved = HFTokenizer(tmp_path / "run" / "checkpoint-1" / "tokenizer.json")  # its own chat template and
    brought = HFTokenizer(ckpt / "tokenizer.json")  # EOS ids, so an eval or resume from it prompts the same
    assert (saved.chat_template, saved.eos_token_ids) == (brought.chat_template, brought.eos_token_ids)
    assert saved.chat_template == CHATML  # (it was dropped: such a run was evaluated in parity's format)


def test_plain_text_encodes_as_encode_does_and_never_as_added_tokens(bpe_dir, tmp_path):
    """`encode_plain` (a tool's output) gives `encode`'s ids for ordinary text and never an added
    token's id, on byte-level BPE and on SentencePiece-style (Metaspace) tokenizers: cutting the
    text around each added token put a word-start marker on every piece there ('< /s>')."""
    import random

    sp = Tokenizer(models.BPE(unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    sp.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>", "<|im_end|>"])
    sp.train_from_iterator(["the tool printed </s> and <|im_end|> then stopped"] * 10, trainer)
    sp.save(str(tmp_path / "sp.json"))
    rng = random.Random(0)
    for tok, marker in ((HFTokenizer(bpe_dir / "tokenizer.json"), "<|im_end|>"),
                        (HFTokenizer(tmp_path / "sp.json"), "</s>")):
        for _ in range(100):
            text = "".join(rng.choice("abdeilnoprst <>/|_0123456789\n") for _ in range(rng.randint(1, 30)))
            if marker not in text:
                assert tok.encode_plain(text) == tok.encode(text), text
        text = f"the tool printed {marker} then stopped"
        assert tok.token_id(marker) in tok.encode(text)  # control: encode makes it the added token
        plain = tok.encode_plain(text)
        assert tok.token_id(marker) not in plain and tok.decode(plain) == text


THINKING = CHATML + ("{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
                     "<think>\n\n</think>\n\n{% endif %}")  # (Qwen3's switch, in a small template)


def test_chat_template_kwargs_reach_every_prompt_a_task_renders(bpe_dir, tmp_path, capsys):
    """`task.chat_template_kwargs` (enable_thinking = false for Qwen3) renders the tasks' prompts
    as transformers' apply_chat_template(..., enable_thinking=False) does; there was no way to
    pass it. `parity generate --chat --chat-kwarg enable_thinking=false` likewise. Without it the
    prompt has no empty think block (the control); misuse is a one-line error."""
    from parity.config import TrainConfig, with_overrides
    from parity.errors import ConfigError, ParityError
    from parity.rl.build import build_env

    ckpt = tmp_path / "ckpt"
    model = parity.Model(parity.ModelConfig.preset("tiny", vocab_size=512, eos_token_id=2), seed=0)
    model.save_pretrained(ckpt)
    theirs = hf_tokenizer(bpe_dir, THINKING)
    theirs.save_pretrained(ckpt)
    base = with_overrides(TrainConfig(), [f'model.checkpoint="{ckpt}"', 'task.name="math"'])
    cfg = with_overrides(base, ["task.chat_template_kwargs={enable_thinking = false}"])
    env, plain = build_env(cfg, 512), build_env(base, 512)
    problem = env.problems(0, 1)[0]
    conversation = [{"role": "user", "content": problem.prompt}]
    want = ids_of(theirs.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True,
                                             enable_thinking=False))
    assert env.prompt_ids(problem) == want
    assert plain.prompt_ids(problem) != want  # the control: thinking left on
    assert HFTokenizer(ckpt / "tokenizer.json").decode(want).endswith("<think>\n\n</think>\n\n")
    assert main(["generate", "--model", str(ckpt), "--prompt", "hi", "--chat", "--chat-kwarg",
                 "enable_thinking=false", "--json", "--max-tokens", "2"]) == 0
    ids = json.loads(capsys.readouterr().out)[0]["prompt_token_ids"]
    assert HFTokenizer(ckpt / "tokenizer.json").decode(ids).endswith("assistant\n<think>\n\n</think>\n\n")
    assert main(["generate", "--model", str(ckpt), "--prompt", "hi", "--chat-kwarg", "x=1"]) == 2
    assert "--chat-kwarg needs --chat" in capsys.readouterr().err
    assert main(["generate", "--model", str(ckpt), "--prompt", "hi", "--chat", "--chat-kwarg", "template=x",
                 "--chat-kwarg", "special_tokens=1", "--max-tokens", "1"]) == 0  # (were TypeErrors)
    capsys.readouterr()
    python_style = with_overrides(base, ["task.chat_template_kwargs.enable_thinking=False"])
    assert python_style.task.chat_template_kwargs == {"enable_thinking": False}  # (was the string 'False')
    assert build_env(python_style, 512).prompt_ids(problem) == want
    for bad, message in (("task.chat_template_kwargs={messages = 1}", "is set by the task itself"),
                         ("task.chat_template_kwargs={a = 1}", "for the text tasks")):
        with pytest.raises(ConfigError, match=message):
            with_overrides(TrainConfig(), [bad])
    (ckpt / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ParityError, match="chat_template_kwargs: the run's tokenizer has no chat template"):
        build_env(cfg, 512)


def test_a_processors_chat_template_json_is_read_and_copied(tmp_path, bpe_dir):
    """Image-text checkpoints (Gemma 3 4B-27B) may keep their template only in the processor's
    `chat_template.json`: it is read when tokenizer_config.json has none (a template there, or a
    `chat_template.jinja`, wins), and copied with the tokenizer, also as the `chat_template.jinja`
    transformers' tokenizer reads."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copyfile(bpe_dir / "tokenizer.json", ckpt / "tokenizer.json")
    config = json.loads((bpe_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    assert HFTokenizer(ckpt / "tokenizer.json").chat_template is None  # (the control)
    (ckpt / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}!"}))
    assert HFTokenizer(ckpt / "tokenizer.json").chat_template == "{{ messages[0]['content'] }}!"
    copy_tokenizer(ckpt / "tokenizer.json", tmp_path)
    assert HFTokenizer(tmp_path / "tokenizer.json").chat_template == "{{ messages[0]['content'] }}!"
    # (review) ... and as chat_template.jinja, which transformers' tokenizer reads (not the processor's file)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert theirs.chat_template == "{{ messages[0]['content'] }}!"
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "own"}))
    assert HFTokenizer(ckpt / "tokenizer.json").chat_template == "own"


def test_generate_names_unspellable_characters_and_a_missing_chat_template(tmp_path, capsys):
    """A new user's walk (2026-12-07, ninth session): `generate` with characters a character
    tokenizer cannot spell gave <|unk|> without a word (a dataset's prompts were warned of), and
    --chat-kwarg on a checkpoint with no chat template said it needed --chat, which was given."""
    from parity.model.tokenizer import build_char_tokenizer

    build_char_tokenizer().save(str(tmp_path / "tokenizer.json"))
    parity.Model(parity.ModelConfig.preset("tiny", eos_token_id=1), seed=0).save_pretrained(tmp_path)
    args = ["generate", "--model", str(tmp_path), "--max-tokens", "1"]
    assert main([*args, "--prompt", "1+2=", "--prompt", "h\u00e9llo \U0001F600"]) == 0
    err = capsys.readouterr().err
    assert "warning: prompt 1 holds characters this tokenizer cannot spell; the model sees them as <|unk|>" \
        in err
    assert main([*args, "--prompt", "1+2="]) == 0
    assert "cannot spell" not in capsys.readouterr().err  # (the control: every character spelled)
    assert main([*args, "--prompt", "hi", "--chat", "--chat-kwarg", "x=1"]) == 2
    assert capsys.readouterr().err.strip().endswith("has none (--chat wraps prompts in its turn tokens)")
