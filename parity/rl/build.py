"""Build a run's model and environment from its `TrainConfig` — once per process.

The learner's process loads the model from its checkpoint (or a seeded preset); a rollout
worker builds the same architecture empty (`model_skeleton`) and receives the learner's weights,
so nothing is loaded from disk twice. `"base"` (the cached base policy of `parity sft`) must
have been resolved to a directory by the application before a config reaches this module.
"""

from __future__ import annotations

from pathlib import Path

from ..config import BASE_CHECKPOINTS, TrainConfig
from ..dtypes import dtype_from_name
from ..errors import ConfigError, ParityError
from ..model import Model, ModelConfig, load_model


def checkpoint_dir(cfg: TrainConfig) -> str | None:
    """The run's checkpoint directory (None: a random-init preset)."""
    path = cfg.model.checkpoint
    if path in BASE_CHECKPOINTS:
        raise ConfigError(f"model.checkpoint = {path!r} must be resolved to the base policy's directory "
                          "first (the parity commands do it; in Python: parity.apps.sft.resolve_base)")
    return path


def build_model(cfg: TrainConfig) -> Model:
    """The model the run starts from: its checkpoint, or the seeded preset."""
    dtype = dtype_from_name(cfg.model.dtype, "model.dtype")
    path = checkpoint_dir(cfg)
    if path:
        return load_model(path, kernels=cfg.model.kernels, dtype=dtype, device=cfg.model.device,
                          context=cfg.model.context)
    config = ModelConfig.preset(cfg.model.preset).with_context(cfg.model.context)
    return Model(config, kernels=cfg.model.kernels, dtype=dtype, seed=cfg.model.seed, device=cfg.model.device)


def model_skeleton(cfg: TrainConfig, config: ModelConfig) -> Model:
    """The run's architecture with uninitialised weights, for a worker that receives weights."""
    return Model(config, kernels=cfg.model.kernels, dtype=dtype_from_name(cfg.model.dtype), seed=None,
                 device=cfg.model.device)


def tokenizer_path(cfg: TrainConfig) -> Path | None:
    """The run's tokenizer.json: task.tokenizer, or the checkpoint's when it has one."""
    if cfg.task.tokenizer:
        return Path(cfg.task.tokenizer)
    path = checkpoint_dir(cfg)
    return Path(path) / "tokenizer.json" if path and (Path(path) / "tokenizer.json").exists() else None


def build_env(cfg: TrainConfig, vocab_size: int, sandbox=None, context: int | None = None):
    """The run's environment (text tasks read the checkpoint's tokenizer.json); with the model's
    `context`, a dataset's prompt that leaves no room to generate is refused at load."""
    t = cfg.task
    if t.name == "target_tokens":
        from ..envs import TargetTokensTask

        return TargetTokensTask(vocab_size, t.targets, t.prompt_len, cfg.seed)
    from ..model.tokenizer import HFTokenizer

    path = tokenizer_path(cfg)
    if path is not None and not path.is_file():
        raise ParityError(f"task.tokenizer {path}: no such file")
    from ..envs.custom import TaskContext, build_custom_env

    tokenizer = HFTokenizer(path) if path is not None else None
    if t.chat_template_kwargs:
        if tokenizer is None or not tokenizer.chat_template:
            raise ParityError("task.chat_template_kwargs: the run's tokenizer has no chat template "
                              f"({path or 'no tokenizer.json'})")
        tokenizer.chat_template_kwargs = dict(t.chat_template_kwargs)
    ctx = TaskContext(tokenizer, vocab_size, cfg.seed, t.heldout_size, t.require_isolation, sandbox)
    if t.require_isolation and t.name == "custom":  # refused now, before anything is computed
        ctx.sandbox()  # (a dataset's reward that takes the sandbox makes it at start-up itself)
    if t.name == "custom":
        return build_custom_env(t.env, t.options, ctx)
    if tokenizer is None:
        raise ParityError(f"task {t.name!r} needs a tokenizer.json in the checkpoint directory "
                          f"({cfg.model.checkpoint}); use model.checkpoint = \"base\" (`parity eval --model "
                          f"base`) or a parity sft output")
    if t.name == "dataset":
        from ..envs.dataset import DatasetEnv

        return DatasetEnv(tokenizer, t.data, t.reward, cfg.seed, t.heldout_size, t.heldout_data,
                          t.max_prompt_tokens, t.reward_weights, ctx.sandbox, vocab_size, context)
    if t.name == "math":
        from ..envs.math import MathEnv

        return MathEnv(tokenizer, t.math_task, t.level, cfg.seed, t.heldout_size)
    from ..envs.tool import ToolEnv

    if sandbox is None:  # refused now (where it cannot isolate), before anything is computed
        from ..envs.sandbox import Sandbox

        sandbox = Sandbox(require_isolation=t.require_isolation)
    return ToolEnv(tokenizer, tuple(t.kinds), t.level, cfg.seed, t.heldout_size, t.max_tool_calls,
                   sandbox=sandbox)
