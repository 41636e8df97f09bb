"""The learner's configuration: optimisation, diagnostics and the objectives' parameters.

These dataclasses live with the other configs (the `rl` package imports them, never the reverse).
`LOSS_NAMES` is the list of objectives `parity.rl.losses` implements, one function per name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..dtypes import COMPUTE_DTYPES, DTYPE_NAMES
from ..errors import ConfigError
from ..fields import check_fields, known_keywords
from ..model.logprobs import MIN_TEMPERATURE

LOSS_NAMES: tuple[str, ...] = (
    "reinforce_zero", "tis", "icepop", "mis", "seq_gate", "ppo_clip", "decoupled_ppo", "gspo", "cispo",
    "on_policy")
"""Objectives the learner can optimise."""
PROXIMAL_LOSSES: tuple[str, ...] = ("decoupled_ppo",)
"""Objectives that take the proximal policy's log-probs (the learner before this batch's updates)."""
AGGREGATIONS: tuple[str, ...] = ("response", "token", "constant")
"""How an objective weighs the batch's tokens (`LossConfig.aggregation`)."""
STD_ADVANTAGE_LOSSES: tuple[str, ...] = ("ppo_clip", "decoupled_ppo", "gspo", "cispo")
"""Objectives whose advantage may be divided by the group's reward std (`LossConfig.ppo_std_adv`)."""
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
"""Per-token estimates of the KL penalty to the reference policy (`LearnerConfig.kl_estimator`)."""
HEAD_CHUNK_ELEMENTS = 1 << 26
"""`head_chunk_tokens = 0`: an LM-head chunk holds at most this many logits."""


@known_keywords()
@dataclass
class LossConfig:
    """Parameters of the objectives (each loss reads the fields it needs)."""

    tis_cap: float = 2.0
    """tis: importance weights are truncated at this value (C)."""
    icepop_low: float = 0.5
    """icepop: tokens whose weight is below this are masked out (α)."""
    icepop_high: float = 5.0
    """icepop: tokens whose weight is above this are masked out (β)."""
    mis_cap: float = 2.0
    """mis: a token (level 'token') or a response (level 'sequence') whose importance weight
    exceeds this is masked out (C); the others keep their full weight."""
    mis_level: str = "token"
    """mis: 'token' (L uses 1[w_it ≤ C] w_it) or 'sequence' (the response's weight is the product
    ρ_i = Π_t w_it, kept when ρ_i ≤ C)."""
    gate_low: float = 0.5
    """seq_gate: a response is rejected when exp(mean log w) is below this. (A wide band: at lag 64
    w carries the lag correction; [0.999, 1.001], as narrow as published for kernel mismatch alone,
    rejected 96% of responses there, [0.5, 2] 2.3%: docs/results.md.)"""
    gate_high: float = 2.0
    """seq_gate: ... or above this."""
    gate_max_k3: float = 1.0
    """seq_gate: ... or when its mean k3 = w − 1 − log w exceeds this."""
    ppo_eps: float = 0.2
    """ppo_clip and decoupled_ppo: the ratio is clipped to [1 − ε, 1 + ε_high]."""
    ppo_eps_high: float = 0.0
    """ppo_clip and decoupled_ppo: ε_high, the upper clip (DAPO's clip-higher: 0.28 with ε = 0.2);
    0 = ppo_eps."""
    ppo_dual_clip: float = 0.0
    """ppo_clip and decoupled_ppo: dual clip c > 1 (3 in its paper): a token of negative advantage
    whose ratio exceeds c contributes the constant c·A and no gradient (0 = off: the min is
    unbounded above for A < 0)."""
    behav_cap: float = 0.0
    """decoupled_ppo: a token whose behaviour weight π_prox/μ exceeds this is masked out (AReaL's
    behav_imp_weight_cap); 0 = no cap, every token keeps its full weight."""
    ppo_std_adv: bool = False
    """ppo_clip, decoupled_ppo, gspo and cispo: divide advantages by the group's reward std (the
    advantage of GRPO, AReaL, GSPO and MiniMax-M1's CISPO); the other objectives refuse it."""
    gspo_eps_low: float = 3e-4
    """gspo: the sequence ratio is clipped to [1 − ε_low, 1 + ε_high] (the GSPO paper's 3e-4 and
    4e-4: a length-normalised ratio moves far less than a token's)."""
    gspo_eps_high: float = 4e-4
    """gspo: ε_high (see gspo_eps_low)."""
    cispo_eps_low: float = 1.0
    """cispo: the detached weight is clipped to [1 − ε_low, 1 + ε_high]; 1.0 = no floor (as
    MiniMax-M1 ran it: only ε_high tuned)."""
    cispo_eps_high: float = 0.28
    """cispo: ε_high (see cispo_eps_low)."""
    aggregation: str = "response"
    """How tokens weigh in the batch's loss, for every objective. 'response': tokens averaged
    within a response, responses averaged, −(1/N) Σ_i (1/|y_i|) Σ_t (REINFORCE Zero's); 'token':
    every sampled token of the batch weighs the same, −(1/Σ_i |y_i|) Σ_i Σ_t (DAPO's token-level
    loss, and the normalisation of MiniMax-M1's CISPO); 'constant': −(1/(N·norm_tokens)) Σ_i Σ_t, a
    fixed normaliser (Dr. GRPO's)."""
    norm_tokens: int = 0
    """aggregation 'constant': the normaliser's token count, required there (Dr. GRPO: the
    generation budget, the most tokens a response may sample: rollout.max_tokens per turn, times
    the turns of a multi-turn task). It only scales the step, as the learning rate does."""

    def __post_init__(self) -> None:
        check_fields(self, finite=True)
        for name in ("tis_cap", "mis_cap", "icepop_high", "gate_high", "gate_max_k3", "ppo_eps",
                     "gspo_eps_low", "gspo_eps_high", "cispo_eps_low", "cispo_eps_high"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"LossConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.ppo_eps_high < 0:
            raise ConfigError(f"LossConfig.ppo_eps_high must be >= 0 (0 = ppo_eps), "
                              f"got {self.ppo_eps_high!r}")
        if self.behav_cap < 0 or 0 < self.behav_cap <= 1:
            raise ConfigError(f"LossConfig.behav_cap must be 0 (no cap) or > 1, got {self.behav_cap!r}")
        if self.ppo_dual_clip and not self.ppo_dual_clip > 1:
            raise ConfigError(f"LossConfig.ppo_dual_clip must be 0 (off) or > 1, got {self.ppo_dual_clip!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"LossConfig.aggregation must be one of {', '.join(AGGREGATIONS)}, "
                              f"got {self.aggregation!r}")
        if self.norm_tokens < 0 or (self.aggregation == "constant" and not self.norm_tokens):
            raise ConfigError(f"LossConfig.norm_tokens must be > 0 with aggregation 'constant' (Dr. GRPO's "
                              f"normaliser: the most tokens a response may sample), got {self.norm_tokens!r}")
        if not 0 <= self.icepop_low < self.icepop_high:
            raise ConfigError("LossConfig.icepop_low must be in [0, icepop_high)")
        if self.mis_level not in ("token", "sequence"):
            raise ConfigError(f"LossConfig.mis_level must be 'token' or 'sequence', got {self.mis_level!r}")
        if not 0 <= self.gate_low < self.gate_high:
            raise ConfigError("LossConfig.gate_low must be in [0, gate_high)")


@known_keywords()
@dataclass
class LearnerConfig:
    """Optimisation and diagnostics settings; validated on construction."""

    loss: str = "reinforce_zero"
    """Objective: reinforce_zero, tis, icepop, mis, seq_gate, ppo_clip, decoupled_ppo, gspo, cispo or
    on_policy (no importance weight: with max_policy_lag > 0, the uncorrected baseline, biased by the
    lag)."""
    lr: float = 1e-4
    """Peak AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = 0
    """Linear warm-up from 0 to `lr` over this many steps."""
    schedule: str = "constant"
    """After warm-up: 'constant' or 'cosine' (to 0 at `total_steps`)."""
    total_steps: int = 0
    """Length of the cosine schedule in steps, warm-up included (more than `warmup_steps`); 0 = in
    a TrainConfig its `steps` (written to the run's config.toml as a number; a constant schedule
    keeps 0), and a Learner given a cosine schedule of length 0 refuses it."""
    max_grad_norm: float = 1.0
    """Gradient-norm clipping threshold (the norm before clipping is logged)."""
    mini_batches: int = 1
    """Optimizer updates per pass over a batch: the batch is cut into this many mini-batches of
    (nearly) equal response counts, each one AdamW step (PPO's mini-batches; 1 = one update per
    batch, as REINFORCE Zero runs). A batch still publishes one policy version, so the lag counts
    batches, and the learning-rate schedule steps once per batch."""
    epochs: int = 1
    """Passes over each batch (PPO's epochs). With mini_batches × epochs > 1 the learner first
    runs the batch once without gradients at the weights it starts from: π_prox of decoupled_ppo,
    and the log-probs the diagnostics report."""
    shuffle: bool = True
    """With several mini-batches: deal the batch's responses into them in a new random order each
    epoch (as PPO implementations do), drawn from the learner's step and the epoch, so a resumed
    run deals the same; False: cut in order, the same mini-batches every epoch. Advantages are the
    whole batch's either way (computed before the cut)."""
    micro_batch_size: int = 8
    """Responses per forward/backward; gradients accumulate over micro-batches."""
    micro_batch_tokens: int = 0
    """Also cap a micro-batch at this many tokens (prompt + response; a longer sequence goes
    alone): memory then follows the tokens, not the response count (0 = by count only)."""
    head_chunk_tokens: int = 0
    """The LM head and log-softmax run over this many positions at a time, so no [tokens, vocab]
    logits tensor is ever whole (at a 152k vocabulary 0.6 GB per 2,048 tokens in bfloat16, and
    again for its gradient); under grad the backward runs the head again in blocks of vocabulary
    rows. 0 (auto): chunks of 2^26 / vocab_size positions (a 256 MiB float32 block: 441 at 152k;
    at small vocabularies more than any micro-batch has, i.e. no chunks); a number at least a
    micro-batch's positions turns chunks off. Aligned log-probs are the same bits whatever the
    chunk; gradients are as precise as without chunks, in another rounding (deterministic)."""
    activation_checkpointing: bool = False
    """Keep only each layer's input for the backward and run the layer again there: activation
    memory per token drops from some 20 rows of hidden size per layer to one, for another forward
    of the layers (+47% step time measured on the Qwen3-0.6B shape). Gradients and log-probs are
    the same bits as without."""
    compute_dtype: str = "auto"
    """'auto' (the dtype of the model the learner is given, left as it is), 'float32', or
    'bfloat16' with float32 master weights; a model in another dtype is cast to it in place (in
    a TrainConfig: model.dtype)."""
    temperature: float = 1.0
    """Sampling temperature the rollouts used, log-probs are of softmax(logits / T) (in a
    TrainConfig: rollout.temperature)."""
    max_policy_lag: int = 8
    """The policy-lag bound the learner enforces: a batch holding a token sampled more than this
    many versions ago is refused (InputError, the step not taken); also how many versions back
    weights are kept for the kernel/lag decomposition (in a TrainConfig: its max_policy_lag)."""
    decompose_every: int = 1
    """Run the decomposition every N steps (0 = never)."""
    mechanism: bool = False
    """Also report the mechanism diagnostics: kernel mismatch and importance weights bucketed by
    the sampled token's rollout probability (`mechanism/...` metrics; `parity study` turns it on)."""
    router_aux_loss_coef: float = 0.0
    """MoE models: weight of the router's load-balancing loss added to the objective (0 = off)."""
    kl_coef: float = 0.0
    """β: adds β·KL(π ‖ π_ref) to the objective, estimated on each sampled token (`kl_estimator`)
    and aggregated as the objective is (`loss_config.aggregation`); π_ref is the policy the learner
    started from, kept frozen beside it (one more copy of the weights; a run's checkpoints carry
    it, so a resume keeps the run's reference). 0 = off, as REINFORCE Zero and most recent
    recipes run (GRPO's original β: 0.04)."""
    kl_estimator: str = "k3"
    """kl_coef: the per-token penalty from d = log π_ref − log π on each sampled token. 'k3'
    e^d − d − 1 (GRPO's; never negative; d clamped to ±20 so one token cannot overflow it): its
    value estimates KL(π ‖ π_ref), its gradient (1 − π_ref/π)·∇log π follows KL(π_ref ‖ π) in
    expectation. 'k2' d²/2: its gradient follows KL(π ‖ π_ref). 'k1' −d estimates the value but its
    gradient ∇log π is 0 in expectation, so it is refused as a penalty (kl_coef > 0). Tokens were
    sampled by the rollout policy, not π: at a lag each expectation is off by that much."""
    dump_dir: str | None = None
    """Where a batch that produced a NaN/inf loss or gradient is saved (None = not saved)."""
    loss_config: LossConfig = field(default_factory=LossConfig)
    """Parameters of the objectives."""

    def head_rows(self, vocab_size: int) -> int:
        """Positions per LM-head chunk for a vocabulary of this size (`head_chunk_tokens`)."""
        return self.head_chunk_tokens or max(1, HEAD_CHUNK_ELEMENTS // vocab_size)

    def schedule_length(self) -> int:
        """The cosine schedule's length in steps (`total_steps`; ConfigError while it is 0)."""
        if not self.total_steps:
            raise ConfigError("LearnerConfig.total_steps must be set for schedule 'cosine' (0 means the "
                              "run's steps only in a TrainConfig)")
        return self.total_steps

    def __post_init__(self) -> None:
        check_fields(self, finite=True)
        if self.loss not in LOSS_NAMES:
            raise ConfigError(f"unknown loss {self.loss!r}: expected one of {', '.join(LOSS_NAMES)}")
        if self.loss_config.ppo_std_adv and self.loss not in STD_ADVANTAGE_LOSSES:
            raise ConfigError(f"LossConfig.ppo_std_adv applies to {', '.join(STD_ADVANTAGE_LOSSES)}, not to "
                              f"loss {self.loss!r} (its advantage is the reward minus the group mean)")
        if not self.lr > 0:
            raise ConfigError(f"LearnerConfig.lr must be > 0, got {self.lr!r}")
        if self.schedule not in ("constant", "cosine"):
            raise ConfigError(f"LearnerConfig.schedule must be 'constant' or 'cosine', got {self.schedule!r}")
        for name in ("warmup_steps", "max_policy_lag", "decompose_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"LearnerConfig.{name} must be >= 0")
        if self.head_chunk_tokens < 0:
            raise ConfigError("LearnerConfig.head_chunk_tokens must be >= 0 (0 = auto)")
        if self.micro_batch_tokens < 0:
            raise ConfigError("LearnerConfig.micro_batch_tokens must be >= 0 (0 = no token cap)")
        if self.total_steps < 0:
            raise ConfigError(f"LearnerConfig.total_steps must be >= 0 (0 = the run's steps), "
                              f"got {self.total_steps!r}")
        if self.schedule == "cosine" and 0 < self.total_steps <= self.warmup_steps:
            raise ConfigError(f"LearnerConfig.total_steps ({self.total_steps}) must be more than "
                              f"warmup_steps ({self.warmup_steps}): the cosine decay would have no steps")
        for name in ("micro_batch_size", "mini_batches", "epochs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"LearnerConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if not self.max_grad_norm > 0:
            raise ConfigError("LearnerConfig.max_grad_norm must be > 0")
        if self.compute_dtype != "auto" and self.compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"LearnerConfig.compute_dtype must be 'auto' or one of "
                              f"{', '.join(DTYPE_NAMES)}, got {self.compute_dtype!r}")
        if not MIN_TEMPERATURE <= self.temperature < math.inf:
            raise ConfigError(f"LearnerConfig.temperature must be >= {MIN_TEMPERATURE} and finite, "
                              f"got {self.temperature!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"LearnerConfig.betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.router_aux_loss_coef < 0:
            raise ConfigError("LearnerConfig.router_aux_loss_coef must be >= 0")
        if self.kl_coef < 0:
            raise ConfigError(f"LearnerConfig.kl_coef must be >= 0, got {self.kl_coef!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(f"LearnerConfig.kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, "
                              f"got {self.kl_estimator!r}")
        if self.kl_coef > 0 and self.kl_estimator == "k1":
            raise ConfigError("LearnerConfig.kl_estimator 'k1' cannot be a penalty: its gradient ∇log π is "
                              "0 in expectation, so kl_coef would regularise nothing (use 'k3' or 'k2')")
        if self.weight_decay < 0:
            raise ConfigError("LearnerConfig.weight_decay must be >= 0")
