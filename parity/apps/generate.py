"""`parity generate`: sample completions with the rollout engine.

Prompts come as text (`--prompt`, encoded with the checkpoint's tokenizer.json or UTF-8 bytes;
with `--chat` as a user turn: in the checkpoint's chat template, with `--chat-kwarg NAME=VALUE`
for its variables such as enable_thinking=false, or parity's turn format),
as token ids (`--prompt-ids`) or from a file (one prompt per line, or JSONL with `prompt` /
`prompt_ids`: a line that starts with `{` is JSON, so text that does goes in as {"prompt": ...}).
`--json` prints token ids, float32 log-probs and the policy version of each token.
"""

from __future__ import annotations

import json
import sys

from .. import hardware
from ..config.task import as_bool
from ..dtypes import dtype_from_name
from ..engine import Engine, SamplingParams
from ..envs import chat
from ..errors import ParityError
from ..model import Model, ModelConfig, load_model
from ..model.chat_template import CALLER_VARIABLES
from ..model.tokenizer import ByteTokenizer, load_tokenizer
from ..ops.common import gemm_linear
from .sft import RECIPES, get_base_policy, names_recipe

MAX_PROMPTS_FILE = 64 * 2**20
"""The largest --prompts-file read, in characters."""


def _text_prompt(args, tokenizer, text: str) -> list[int]:
    """A text prompt: with --chat a user turn, in the checkpoint's chat template or (parity's own
    tokenizers, whose turn markers are special tokens) in the tasks' format; else raw text."""
    if args.chat:
        own = getattr(tokenizer, "token_id", lambda _: None)(chat.USER) is not None
        if not args.model:
            raise ParityError("--chat needs a checkpoint with a chat template (--model DIR, or base): "
                              "a random-init preset has none")
        if not getattr(tokenizer, "chat_template", None) and not own:
            raise ParityError("--chat: this checkpoint has no chat template (tokenizer_config.json "
                              "or chat_template.jinja) and no <|user|> turn token")
        return chat.prompt_ids(tokenizer, text)
    return tokenizer.encode_prompt(text)


def _read_prompts(args, tokenizer) -> list[list[int]]:
    prompts: list[list[int]] = []
    for text in args.prompt or []:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # bytes the shell passed that are not UTF-8
            raise ParityError(f"--prompt: not UTF-8 text: {text!r}") from None
        prompts.append(_text_prompt(args, tokenizer, text))
    for ids in args.prompt_ids or []:
        try:  # (an empty item, `1,,2`, was read as 1,2)
            prompts.append([int(x) for x in ids.split(",")])
        except ValueError:
            raise ParityError(f"--prompt-ids: expected comma-separated integers, got {ids!r}") from None
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8-sig") as f:  # (a BOM made line 1 text)
                text = f.read(MAX_PROMPTS_FILE + 1)
            if len(text) > MAX_PROMPTS_FILE:  # (/dev/zero was read until memory ran out)
                raise ParityError(f"{args.prompts_file}: larger than {MAX_PROMPTS_FILE // 2**20} MiB")
            lines = text.splitlines()
        except OSError as exc:
            raise ParityError(f"{args.prompts_file}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ParityError(f"{args.prompts_file}: not UTF-8 text (byte {exc.start})") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ParityError(f"{args.prompts_file}:{n}: invalid JSON ({exc.msg})") from None
                ids = item.get("prompt_ids") if isinstance(item, dict) else None
                if not isinstance(item, dict):
                    raise ParityError(f"{args.prompts_file}:{n}: expected a JSON object")
                unknown = sorted(set(item) - {"prompt", "prompt_ids"})
                if unknown:  # (were ignored: a line's own max_tokens or temperature silently not used)
                    raise ParityError(f"{args.prompts_file}:{n}: unknown field {unknown[0]!r} (a line holds "
                                      "'prompt' or 'prompt_ids'; sampling options are the command's)")
                if "prompt_ids" in item and "prompt" in item:  # (the prompt was dropped without a word)
                    raise ParityError(f"{args.prompts_file}:{n}: both 'prompt' and 'prompt_ids': give one")
                if "prompt_ids" in item:
                    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in ids):
                        raise ParityError(f"{args.prompts_file}:{n}: prompt_ids must be a list of integers")
                    prompts.append(ids)
                elif "prompt" in item:
                    if not isinstance(item["prompt"], str):
                        raise ParityError(f"{args.prompts_file}:{n}: prompt must be a string, got "
                                          f"{json.dumps(item['prompt'])[:40]}")
                    prompts.append(_text_prompt(args, tokenizer, item["prompt"]))
                else:
                    raise ParityError(f"{args.prompts_file}:{n}: expected a 'prompt' or 'prompt_ids' field")
            else:
                prompts.append(_text_prompt(args, tokenizer, line))
    if not prompts:
        raise ParityError("no prompts: give --prompt, --prompt-ids or --prompts-file")
    return prompts


def _chat_kwarg(text: str) -> tuple[str, object]:
    """'--chat-kwarg enable_thinking=false' -> ('enable_thinking', False): a TOML value (bare words
    are strings)."""
    import tomllib

    key, sep, raw = text.partition("=")
    if not sep or not key.strip().isidentifier() or key.strip() in CALLER_VARIABLES:
        raise ParityError(f"--chat-kwarg {text!r}: expected NAME=VALUE, NAME a template variable "
                          "(not messages or add_generation_prompt)")
    try:
        return key.strip(), as_bool(tomllib.loads(f"v = {raw}")["v"])
    except tomllib.TOMLDecodeError:
        return key.strip(), as_bool(raw)  # ('False' is false: a string is true to the template)


def main(args) -> int:
    """`parity generate`."""
    if args.chat and not (args.prompt or args.prompts_file):  # (it was ignored without a word)
        raise ParityError("--chat wraps text prompts (--prompt, --prompts-file); --prompt-ids go in as given")
    dtype = dtype_from_name(args.dtype, "--dtype")
    warning = hardware.bf16_warning(args.dtype, "--dtype", linear=gemm_linear)
    if warning:
        print(f"parity: warning: {warning}", file=sys.stderr, flush=True)
    if names_recipe(args.model):  # a cached base policy of `parity sft` by name, as `parity eval` takes it
        args.model = str(get_base_policy(RECIPES[args.model]))
    if args.model:
        model = load_model(args.model, kernels=args.kernels, dtype=dtype, device=args.device,
                           context=args.context)
    else:
        model = Model(ModelConfig.preset(args.preset).with_context(args.context), kernels=args.kernels,
                      dtype=dtype, seed=args.seed, device=args.device)
    tokenizer = load_tokenizer(args.model, model.config.vocab_size)
    if getattr(args, "chat_kwarg", None):
        if not args.chat:
            raise ParityError("--chat-kwarg needs --chat")
        if not getattr(tokenizer, "chat_template", None):  # (parity's own bases: their turn tokens)
            which = args.model or "this model"
            raise ParityError(f"--chat-kwarg needs a checkpoint with a chat template; {which} has none "
                              "(--chat wraps prompts in its turn tokens)")
        tokenizer.chat_template_kwargs = dict(_chat_kwarg(text) for text in args.chat_kwarg)
    prompts = _read_prompts(args, tokenizer)
    unk = getattr(tokenizer, "unk_token_id", None)
    unspelled = [i for i, ids in enumerate(prompts) if unk is not None and unk in ids]
    if unspelled and (args.prompt or args.prompts_file):  # (as a dataset's prompts are said to)
        print(f"parity: warning: prompt {unspelled[0]}{' and others' if len(unspelled) > 1 else ''} holds "
              f"characters this tokenizer cannot spell; the model sees them as {tokenizer.decode([unk])}",
              file=sys.stderr, flush=True)
    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, top_k=args.top_k,
                             top_p=args.top_p, seed=(args.seed + i) % (1 << 63), stop_strings=args.stop or [])
              for i in range(len(prompts))]
    engine = Engine(model, max_num_seqs=args.max_num_seqs, tokenizer=tokenizer,
                    kv_cache_memory=args.kv_cache_memory)
    if not args.model:  # (its noise read as the library's output; said once the input is known good)
        print(f"parity: model: random {args.preset!r} weights (seed {args.seed}; no --model), so the text is "
              f"noise: --model base samples the cached base policy", file=sys.stderr, flush=True)
    elif isinstance(tokenizer, ByteTokenizer) and (args.prompt or args.prompts_file):
        print(f"parity: {args.model} has no tokenizer.json: text is read and written as UTF-8 bytes",
              file=sys.stderr, flush=True)
    print(f"parity: {engine.describe_cache()}", file=sys.stderr, flush=True)
    outs = engine.generate(prompts, params)
    if args.json:
        print(json.dumps([{"prompt_token_ids": o.prompt_token_ids, "token_ids": o.token_ids,
                           "logprobs": o.logprobs, "sampled_logprobs": o.sampled_logprobs,
                           "policy_versions": o.policy_versions, "finish_reason": o.finish_reason,
                           "cache_full": o.cache_full, "text": o.text, "error": o.error} for o in outs],
                         indent=1))
    else:
        for i, o in enumerate(outs):
            if o.error:
                print(f"[{i}] error: {o.error}")
            else:
                print(f"[{i}] ({o.finish_reason}, {len(o.token_ids)} tokens) {o.text!r}")
    return 0 if all(o.error is None for o in outs) else 1
