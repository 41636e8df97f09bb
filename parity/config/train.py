"""The training run's configuration: one dataclass per TOML table, a docstring per field,
validated on construction (unknown keys and bad values are one-line `ConfigError`s).

`TrainConfig` owns the learner's settings too (`learner`, a `LearnerConfig`); the three learner
fields that follow from the run — the temperature it scores at, the dtype it computes in and how
many versions back it keeps weights — are set from `rollout.temperature`, `model.dtype` and
`max_policy_lag` on construction, so they cannot disagree.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from .. import hardware
from ..dtypes import DTYPE_NAMES
from ..engine.memory import memory_size
from ..errors import ConfigError, InputError
from ..fields import check_fields, known_keywords
from ..model.config import PRESET_NAMES, ModelConfig
from ..model.logprobs import MIN_TEMPERATURE
from ..ops import check_backend
from .learner import LearnerConfig
from .task import MAX_PROBLEMS, TaskSection

BASE_CHECKPOINTS: tuple[str, ...] = ("base", "base-math")
"""Names `model.checkpoint` may give instead of a directory: the cached base policies of
`parity sft` ('base': tool use and direct math answers; 'base-math': column-sum addition)."""

LENGTH_MODES: tuple[str, ...] = ("fixed", "geometric")
WEIGHT_UPDATE_MODES: tuple[str, ...] = ("drain", "inflight")
ROLLOUT_BACKENDS: tuple[str, ...] = ("local", "ray")

MAX_STEPS = 10_000_000
"""The most learner steps a run may plan (the rollout side lists every batch index ahead)."""

MAX_EPISODES = 65_536
"""The most episodes one step may sample (prompts_per_step x group_size; each is held in memory
with its tokens; 10^8 prompts grew a worker past 10 GB without a first batch)."""

MAX_WORKERS = 256
"""The most rollout workers (each is a process holding a model)."""

MAX_SEED = 2**63 - 1
"""Seeds are 64-bit (torch's generators take at most this)."""

DERIVED_LEARNER_FIELDS: dict[str, str] = {
    "temperature": "rollout.temperature", "compute_dtype": "model.dtype", "max_policy_lag": "max_policy_lag"}
"""Learner fields a TrainConfig sets from its own fields (learner field -> where it comes from)."""


@known_keywords()
@dataclass
class ModelSection:
    """Which model the run trains."""

    preset: str = "small"
    """Random-init preset (`parity.model.presets.PRESETS`: 'tiny', 'small', 'qwen3-0.6b', ...) when no
    checkpoint is given."""
    checkpoint: str | None = None
    """A checkpoint directory to start from (overrides `preset`). The `parity` commands also
    accept "base" or "base-math", the cached base policies of `parity sft`, and resolve them to
    their directories (building them first)."""
    kernels: str = "aligned"
    """'aligned' (bitwise rollout = learner) or 'standard' (the baseline)."""
    dtype: str = "float32"
    """Engine and learner compute dtype: 'float32', 'bfloat16', or 'auto': the faster one on this
    machine (bfloat16 where the CPU has bf16 instructions or on a GPU, else float32), resolved on
    construction so the run's config.toml records the dtype it ran in."""
    seed: int = 0
    """Seed of the random init."""
    device: str = "cpu"
    """Where the engine and the learner compute: 'cpu', 'cuda' or 'cuda:N'. On CUDA the aligned
    kernels are the Triton ones; versions, batches and checkpoints stay on the CPU either way."""
    context: int | None = None
    """The longest sequence (prompt + completion) the run serves, as vLLM's max_model_len: caps the
    model's max_position_embeddings (and what its checkpoints save). A longrope model (Phi-3.5,
    Phi-4-mini) takes its short factors within its original context (4096), as transformers does
    on short sequences. None: the model's whole context."""

    def __post_init__(self) -> None:
        check_fields(self, prefix="model")
        if self.checkpoint and self.checkpoint.startswith("~"):  # (was "not found")
            self.checkpoint = os.path.expanduser(self.checkpoint)
        check_backend(self.kernels, "model.kernels")
        hardware.check_device(self.device, "model.device")
        if self.dtype == "auto":  # (a GPU's answer is bf16 whatever its host CPU has)
            self.dtype = "bfloat16" if self.device.startswith("cuda") else hardware.preferred_dtype()
        if self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"model.dtype must be one of {', '.join(DTYPE_NAMES)} or auto, "
                              f"got {self.dtype!r}")
        if self.preset not in PRESET_NAMES:
            raise ConfigError(f"model.preset must be one of {', '.join(PRESET_NAMES)}, got {self.preset!r}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"model.seed must be in 0..2**63-1, got {self.seed}")
        if self.context is not None and self.context < 2:
            raise ConfigError(f"model.context must be at least 2 positions (or unset), got {self.context}")


@known_keywords()
@dataclass
class RolloutSection:
    """How the engine samples."""

    prompts_per_step: int = 8
    """Prompts per learner step; each is answered `group_size` times."""
    group_size: int = 4
    """Responses per prompt (the group whose mean reward is the baseline; at least 2)."""
    max_tokens: int = 32
    """Longest response."""
    temperature: float = 1.0
    """Sampling temperature (the learner scores at the same temperature)."""
    max_num_seqs: int = 64
    """Sequences in flight in the engine."""
    kv_cache_memory: float | str = 0.25
    """The engine's KV cache budget: a fraction of the memory available when a worker starts
    on the model's device (a GPU's free memory, or the host's; 0 < x <= 1) or a number of bytes
    (> 1), or a size with its unit ("4GiB", "512MiB", "2GB"). The cache never holds more than
    max_num_seqs sequences of the model's context, 2,048 tokens at most each; the capacity is
    logged at start-up."""
    cuda_graphs: bool = True
    """On a GPU, replay each decode step (every sequence one new token) from a CUDA graph captured
    once per batch-size bucket instead of launching its kernels one by one (dense models; MoE
    decode runs eagerly). On aligned kernels the recorded log-probs are the same bits either way;
    false: every step eager. No effect on a CPU."""
    prefix_caching: bool = True
    """A request whose prompt starts with full KV blocks of tokens another request computed under
    the weights loaded now starts on those blocks and prefills only the rest (a group's members
    share their prompt's). On aligned kernels the recorded log-probs are the same bits either
    way; on standard kernels they are not (a known source of rollout-learner mismatch)."""
    weight_update: str = "drain"
    """'drain' (finish on old weights, then load) or 'inflight' (switch between tokens)."""
    lengths: str = "fixed"
    """'fixed': every response runs to max_tokens; 'geometric': each request's limit is drawn
    from a geometric distribution with mean max_tokens / 4 (a long tail of response lengths)."""
    backend: str = "local"
    """Where rollout workers run: 'local' (child processes of this one; Ray not needed) or 'ray'
    (actors on a Ray cluster, see the [ray] table)."""
    workers: int = 1
    """Rollout workers; batch b is sampled by worker b mod workers, and in deterministic mode its
    content does not depend on which worker or how many."""
    max_held_versions: int = 2
    """Deterministic (fixed-lag) runs on the local backend: the most published weight versions a
    worker holds unused before it samples the batch of the newest out of turn, so those weights
    can go. Bounds the weight copies at any lag (at lag L, in order, a worker still on its
    version-0 batches would hold up to L); batch contents do not depend on the order. 0: no
    bound, strictly in order."""
    heartbeat_timeout_s: float = 300.0
    """A rollout worker that shows no sign of life (it beats at every engine step and every
    wait for weights) for this long is taken for hung, killed and restarted (0 = never)."""

    def __post_init__(self) -> None:
        check_fields(self, prefix="rollout")
        if self.backend not in ROLLOUT_BACKENDS:
            raise ConfigError(f"rollout.backend must be 'local' or 'ray', got {self.backend!r}")
        for name in ("prompts_per_step", "group_size", "max_tokens", "max_num_seqs", "workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rollout.{name} must be >= 1")
        if self.group_size < 2:  # (accepted: every advantage was 0, so nothing was ever learned)
            raise ConfigError("rollout.group_size must be >= 2: the advantage is a response's reward minus "
                              "its group's mean, 0 for a group of one")
        if self.max_held_versions < 0:
            raise ConfigError("rollout.max_held_versions must be >= 0")
        if not MIN_TEMPERATURE <= self.temperature < float("inf"):
            raise ConfigError(f"rollout.temperature must be >= {MIN_TEMPERATURE} and finite, "
                              f"got {self.temperature!r}")
        try:  # kept as given ("4GiB" stays readable in the run's config.toml)
            memory_size(self.kv_cache_memory, "rollout.kv_cache_memory")
        except InputError as exc:
            raise ConfigError(str(exc)) from None
        if not 0 <= self.heartbeat_timeout_s < float("inf"):  # (NaN turned hang detection off)
            raise ConfigError(f"rollout.heartbeat_timeout_s must be >= 0 and finite, "
                              f"got {self.heartbeat_timeout_s!r}")
        if self.prompts_per_step * self.group_size > MAX_EPISODES:
            episodes = self.prompts_per_step * self.group_size
            raise ConfigError(f"rollout.prompts_per_step x rollout.group_size must be at most "
                              f"{MAX_EPISODES:,} episodes a step, got {episodes:,}")
        if self.workers > MAX_WORKERS:
            raise ConfigError(f"rollout.workers must be at most {MAX_WORKERS}, got {self.workers}")
        if self.lengths not in LENGTH_MODES:
            raise ConfigError(f"rollout.lengths must be 'fixed' or 'geometric', got {self.lengths!r}")
        if self.weight_update not in WEIGHT_UPDATE_MODES:
            raise ConfigError(f"rollout.weight_update must be 'drain' or 'inflight', "
                              f"got {self.weight_update!r}")

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.group_size


@known_keywords()
@dataclass
class RaySection:
    """The Ray cluster the rollout actors run on (used with rollout.backend = 'ray')."""

    address: str | None = None
    """Cluster to join: 'auto', the HOST:PORT printed by `ray start --head`, or 'ray://...'. None
    starts a Ray instance on this machine for the run (and stops it at the end)."""
    cpus_per_worker: float = 1.0
    """CPUs each rollout actor reserves; its torch thread count is this rounded down (at least 1)."""
    namespace: str = "parity"
    """Ray namespace of the run's actors."""
    gpus_per_worker: float | None = None
    """GPUs each rollout actor reserves when the model runs on CUDA (Ray hides the GPUs from an
    actor that reserves none). None: one each when the cluster has a GPU per worker, else an equal
    share of one GPU. Ignored for CPU models."""
    placement_timeout_s: float = 600.0
    """How long a rollout actor may wait for a node with room for it (a replacement for one lost
    with its node, say, while an autoscaler adds a node) before the run stops with an error naming
    what it needs; while it waits, the heartbeat timeout does not count."""

    def __post_init__(self) -> None:
        check_fields(self, prefix="ray")
        if not self.cpus_per_worker > 0:
            raise ConfigError(f"ray.cpus_per_worker must be > 0, got {self.cpus_per_worker!r}")
        if not 0 < self.placement_timeout_s < float("inf"):
            raise ConfigError(f"ray.placement_timeout_s must be a number of seconds > 0, got "
                              f"{self.placement_timeout_s!r}")
        if self.gpus_per_worker is not None and not self.gpus_per_worker > 0:
            raise ConfigError(f"ray.gpus_per_worker must be > 0, got {self.gpus_per_worker!r}")


@known_keywords()
@dataclass
class TrainConfig:
    """A whole training run."""

    steps: int = 20
    """Learner steps: one batch and one published policy version each (one optimizer update, or
    learner.mini_batches x learner.epochs of them)."""
    max_policy_lag: int = 0
    """0 = synchronous on-policy; N = no sample is trained on more than N versions (learner steps)
    after the version that produced it (admission control: the rollout side waits, nothing is
    dropped). With K updates per step a token may be up to N*K + K-1 updates stale, and the
    lag/* and is_weight/* figures are those of a step's first update."""
    deterministic: bool = False
    """Fix the schedule logically: batch b is always sampled by version max(0, b - lag)."""
    seed: int = 0
    """Seed of prompts and sampling."""
    run_dir: str = "runs/default"
    """Where config.toml, metrics.jsonl and checkpoints go."""
    checkpoint_every: int = 0
    """Save a checkpoint every N steps (0 = only at the end)."""
    eval_every: int = 10
    """Greedy evaluation on the held-out prompts before steps 0, N, 2N, ... and at the end
    (0 = never)."""
    eval_prompts: int = 32
    """Held-out problems per evaluation (greedy pass@1)."""
    eval_samples: int = 0
    """k > 0 adds mean@k (k samples per held-out problem at the rollout temperature; at most 64)."""
    model: ModelSection = field(default_factory=ModelSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    task: TaskSection = field(default_factory=TaskSection)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    ray: RaySection = field(default_factory=RaySection)

    def __post_init__(self) -> None:
        check_fields(self)
        if not 1 <= self.steps <= MAX_STEPS:
            raise ConfigError(f"steps must be in 1..{MAX_STEPS:,}, got {self.steps}")
        if not str(self.run_dir).strip():
            raise ConfigError("run_dir must name a directory, got an empty string")
        if str(self.run_dir).startswith("~"):  # (made a directory named ~ in the working directory)
            self.run_dir = os.path.expanduser(self.run_dir)
        if Path(self.run_dir).exists() and not Path(self.run_dir).is_dir():
            raise ConfigError(f"run_dir {self.run_dir} exists and is not a directory")
        if self.max_policy_lag < 0:
            raise ConfigError(f"max_policy_lag must be >= 0, got {self.max_policy_lag}")
        if self.checkpoint_every < 0 or self.eval_every < 0 or self.eval_prompts < 1 or self.eval_samples < 0:
            raise ConfigError("checkpoint_every, eval_every and eval_samples must be >= 0, eval_prompts >= 1")
        if self.eval_samples > 64:
            raise ConfigError(f"eval_samples must be at most 64 per problem, got {self.eval_samples:,}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"seed must be in 0..2**63-1, got {self.seed}")
        if self.eval_prompts > MAX_PROBLEMS:
            raise ConfigError(f"eval_prompts must be at most {MAX_PROBLEMS:,}, got {self.eval_prompts:,}")
        sized = self.task.name in ("tool", "math", "custom") or (self.task.name == "dataset"
                                                                 and not self.task.heldout_data)
        if sized and self.eval_every and self.eval_prompts > self.task.heldout_size:  # (0: no evaluation)
            raise ConfigError(f"eval_prompts ({self.eval_prompts}) must be at most task.heldout_size "
                              f"({self.task.heldout_size}): evaluation uses the held-out set's first ones")
        if self.task.name not in ("target_tokens", "custom") and not self.model.checkpoint:
            raise ConfigError(f"task {self.task.name!r} needs model.checkpoint with a tokenizer.json "
                              "(\"base\" = the base policy of parity sft)")
        if self.task.name == "target_tokens" and not self.model.checkpoint:  # (the rollout worker's
            # error named neither the key nor the preset)
            positions = ModelConfig.preset(self.model.preset).max_position_embeddings
            positions = min(positions, self.model.context or positions)
            if self.task.prompt_len >= positions:
                raise ConfigError(f"task.prompt_len ({self.task.prompt_len}) leaves no room to generate: "
                                  f"model.preset {self.model.preset!r} holds {positions} positions")
        parts, responses = self.learner.mini_batches, self.rollout.batch_size
        if parts > responses:
            raise ConfigError(f"learner.mini_batches ({parts}) must be at most the responses of a batch "
                              f"(rollout.prompts_per_step x group_size = {responses})")
        if self.deterministic and self.rollout.weight_update == "inflight":
            raise ConfigError("deterministic = true needs rollout.weight_update = 'drain' "
                              "(in-flight updates land at wall-clock-dependent tokens)")
        # the learner scores at the rollout's temperature, computes in the model's dtype and keeps
        # the weights of every version a lagged sample may come from (a new object: never mutate
        # a LearnerConfig another TrainConfig may share)
        if self.learner.schedule != "cosine":  # (no length to keep: configs written with 1000 read equal)
            self.learner = dataclasses.replace(self.learner, total_steps=0)
        else:
            if self.steps <= self.learner.warmup_steps:
                raise ConfigError(f"steps ({self.steps}) must be more than learner.warmup_steps "
                                  f"({self.learner.warmup_steps}) for a cosine schedule")
            if not self.learner.total_steps:  # (the run's length, recorded as a number)
                self.learner = dataclasses.replace(self.learner, total_steps=self.steps)
            elif self.learner.total_steps < self.steps:
                total = self.learner.total_steps
                raise ConfigError(f"learner.total_steps ({total}) < steps ({self.steps}): the cosine "
                                  "schedule would train the last steps at learning rate 0 (set both)")
        self.learner = dataclasses.replace(self.learner, **self.derived_learner_fields())

    def derived_learner_fields(self) -> dict:
        """The values of `DERIVED_LEARNER_FIELDS` for this run."""
        return {"temperature": self.rollout.temperature, "compute_dtype": self.model.dtype,
                "max_policy_lag": self.max_policy_lag}
