"""The learner: same model code and kernels as the engine, a chosen objective, AdamW.

One `step(batch)`: learner log-probs by `sequence_logprobs` over micro-batches (gradients
accumulated), the loss, the gradient norm before clipping, clipping, AdamW with a warm-up
schedule (once per mini-batch and epoch when `mini_batches` × `epochs` > 1, the responses dealt
into mini-batches anew each epoch unless `shuffle` is off, after a no-grad pass that scores the
batch at the weights it starts from), then a new `policy_version` published in the dtype the
engine computes in. With
`compute_dtype = "bfloat16"` the model runs in bfloat16 while float32 master weights take the
optimizer step. The decomposition of the rollout-to-learner gap into kernel mismatch and weight
lag needs the learner path at the weights that sampled each token: the rollout worker computes it
while it holds them; versions are kept here (`history`) only as far back as the controller says a
restarted worker may still need (`retain`), at most `max_policy_lag` back.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Container
from pathlib import Path

import torch

from ..config.learner import PROXIMAL_LOSSES, LearnerConfig
from ..dtypes import dtype_from_name, dtype_name
from ..errors import ConfigError, InputError, ParityError
from ..metrics.diagnostics import (
    bucketed_stats,
    importance_weight_stats,
    lag_stats,
    mismatch_stats,
    response_stats,
)
from ..model import scored_routing, sequence_logprobs
from ..model.logprobs import check_sequence
from .decompose import step_diagnostics
from .grad_norm import clip_gradients
from .losses import get_loss, group_advantages, kl_penalty, load_balancing_loss, micro_batch_share
from .optim import adamw
from .reference import ReferencePolicy, cpu_copy
from .trajectory import TrajectoryBatch, micro_batches, pad_routing

log = logging.getLogger(__name__)


def _reason(exc: BaseException) -> str:
    """An exception as one line, for `Learner.torn`."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no message'}"


class Learner:
    def __init__(self, model, config: LearnerConfig | None = None):
        if config is not None and not isinstance(config, LearnerConfig):
            raise ConfigError(f"Learner config must be a LearnerConfig, got {type(config).__name__}")
        self.config = cfg = config or LearnerConfig()
        if not isinstance(model, torch.nn.Module) or not any(p.requires_grad for p in model.parameters()):
            raise ConfigError(f"Learner needs a model with trainable parameters, got {type(model).__name__}"
                              + (" with none" if isinstance(model, torch.nn.Module) else ""))
        if cfg.dump_dir:  # checked now, not at the first non-finite step
            try:
                Path(cfg.dump_dir).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"learner.dump_dir {cfg.dump_dir}: {exc.strerror or exc}") from None
        auto = cfg.compute_dtype == "auto"
        # the forward's dtype ('auto': the model's); unless float32, float32 master weights take the step
        what = "LearnerConfig.compute_dtype" + (" ('auto': the model's dtype)" if auto else "")
        self.compute_dtype = dtype_from_name(dtype_name(model.dtype) if auto else cfg.compute_dtype, what)
        self.model = model.to(self.compute_dtype)
        self.loss_fn = get_loss(cfg.loss)
        self.reference = ReferencePolicy(self.model) if cfg.kl_coef else None  # π_ref: the weights now
        params = list(self.model.parameters())
        self.master = params if self.compute_dtype == torch.float32 else \
            [p.detach().float().clone().requires_grad_() for p in params]
        # fused: one pass per tensor with no full-size temporaries (the foreach form allocates a
        # copy of every moment for sqrt/division: a whole model's worth at the step's peak)
        fused = all(p.device.type in ("cpu", "cuda") for p in self.master)
        self.optimizer = adamw(self.master, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                               fused=fused)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.version, self.steps = 0, 0
        self.history: dict[int, dict[str, torch.Tensor]] = {0: self._snapshot()}
        self._scratch, self.kept_back = None, {}  # one version held for `recheck` (decompose.py)
        self.last_kernel_delta: torch.Tensor | None = None
        self.torn: str | None = None
        """Why an update failed part-way (after the optimizer began changing weights): the
        weights, optimizer state, master copy and versions may disagree, so the learner refuses
        to step, publish or be checkpointed again (None: whole)."""

    def check_whole(self) -> None:
        """ParityError if an earlier update failed part-way (`torn`)."""
        if self.torn is not None:
            raise ParityError(f"the learner's update at step {self.steps} failed part-way ({self.torn}): its "
                              "weights and optimizer state may disagree; resume from the last checkpoint")

    def adopt_config(self) -> list[str]:
        """After a restored optimizer and schedule (a resume): this run's lr, betas and weight
        decay replace the saved ones (loading the state restored those; a resume with a new lr
        trained on at the old one while config.toml recorded the new). Returns what changed."""
        cfg, groups = self.config, self.optimizer.param_groups
        old = {"lr": self.scheduler.base_lrs[0], "betas": tuple(groups[0]["betas"]),
               "weight_decay": groups[0]["weight_decay"]}
        new = {"lr": cfg.lr, "betas": tuple(cfg.betas), "weight_decay": cfg.weight_decay}
        self.scheduler.base_lrs = [cfg.lr] * len(groups)
        factor = self._lr_factor(self.scheduler.last_epoch)  # as LambdaLR sets it, from the new base
        for group in groups:
            group.update(lr=cfg.lr * factor, initial_lr=cfg.lr, betas=new["betas"],
                         weight_decay=cfg.weight_decay)
        self.scheduler._last_lr = [group["lr"] for group in groups]  # (what get_last_lr() reports)
        return [f"learner.{k} {old[k]} -> {new[k]}" for k in new if old[k] != new[k]]

    # ------------------------------------------------------------------ weights
    def _lr_factor(self, step: int) -> float:
        cfg = self.config  # (LambdaLR calls this at step 0: a cosine schedule of no length is refused then)
        length = cfg.schedule_length() if cfg.schedule == "cosine" else 0
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.schedule == "cosine":
            progress = min(1.0, (step - cfg.warmup_steps) / max(1, length - cfg.warmup_steps))
            return 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    def _snapshot(self) -> dict[str, torch.Tensor]:
        # kept on the CPU whatever the model's device: versions are shipped and checkpointed from here
        return cpu_copy(self.model)

    def publish(self) -> tuple[dict[str, torch.Tensor], int]:
        """The current weights (in the compute dtype the engine runs) and their version."""
        self.check_whole()
        return self.history[self.version], self.version

    def _model_at(self, version: int):
        if version == self.version:
            return self.model
        if self._scratch is None:  # (not a deepcopy: a MoE model's router logits of the last grad-
            self._scratch = self.model.twin(self.model.backend)  # enabled forward refused to be copied)
        self._scratch.load_state_dict({**self.kept_back, **self.history}[version])
        return self._scratch

    # ------------------------------------------------------------------ log-probs
    def logprobs(self, batch: TrajectoryBatch, version: int | None = None,
                 micro_batch_size: int | None = None, routing: bool = False):
        """Learner log-probs [B, L] (no grad) under the weights of `version` (default current);
        with `routing`, also the experts of every scored position [B, L, moe layers, k] (MoE)."""
        model = self._model_at(self.version if version is None else version)
        lp, _, routes = self._score(model, batch, micro_batch_size or self.config.micro_batch_size, False)
        return (lp, routes) if routing else lp

    def _score(self, model, batch: TrajectoryBatch, micro_batch_size: int, entropy: bool):
        """`batch` under `model` without gradients, micro-batched: padded log-probs, padded
        entropies (with `entropy`, else None) and routing (None but for MoE)."""
        cfg, lps, ents, routes, all_seqs = self.config, [], [], [], batch.sequences
        with torch.no_grad():
            for idx in micro_batches([len(x) for x in all_seqs], micro_batch_size, cfg.micro_batch_tokens):
                seqs = [all_seqs[j] for j in idx]
                out = sequence_logprobs(model, seqs, cfg.temperature, return_entropy=entropy,
                                        head_chunk=cfg.head_rows(model.config.vocab_size))
                lps += out[0] if entropy else out
                ents += out[1] if entropy else []
                routes += scored_routing(model, seqs) or []
        return batch.pad(lps), batch.pad(ents) if entropy else None, pad_routing(batch, routes)

    def decompose(self, batch: TrajectoryBatch, learner_lp: torch.Tensor,
                  learner_routing: torch.Tensor | None = None) -> dict[str, float]:
        """The kernel/lag split of the gap at the pre-update log-probs `learner_lp`, on the steps
        `decompose_every` names, and the version kept back for `recheck` (`decompose.py`)."""
        return step_diagnostics(self, batch, learner_lp, learner_routing)

    # ------------------------------------------------------------------ step
    def _accumulate(self) -> None:
        """After a micro-batch's backward in a compute dtype other than float32: add its gradients
        to the float32 master weights' (the sum over micro-batches is then float32, as the step
        is, instead of rounded to bf16 at every micro-batch) and free the low-precision ones."""
        if self.compute_dtype == torch.float32:
            return
        with torch.no_grad():
            for m, p in zip(self.master, self.model.parameters()):
                if p.grad is not None:
                    if m.grad is None:
                        m.grad = p.grad.float()
                    else:
                        m.grad.add_(p.grad)
                    p.grad = None

    def step(self, batch: TrajectoryBatch) -> dict[str, float]:
        """One optimizer step on `batch` (`mini_batches` × `epochs` of them, one per mini-batch)
        and one new version; returns its metrics. A NaN/inf loss or gradient skips its update
        (weights untouched), saves the batch to `dump_dir`, and says so."""
        if not isinstance(batch, TrajectoryBatch):  # (a list of Trajectory was an AttributeError)
            raise InputError(f"Learner.step takes a TrajectoryBatch, got {type(batch).__name__}")
        batch.check_versions(self.version, self.config.max_policy_lag)
        cfg, t0 = self.config, time.perf_counter()
        self.last_kernel_delta = None  # set by this step's decomposition, if it runs
        adv_std = cfg.loss_config.ppo_std_adv  # (LearnerConfig allows it only where it applies)
        adv = group_advantages(batch.rewards, batch.group_ids, normalize_std=adv_std, included=batch.included)
        self.check_whole()
        for i, seq in enumerate(batch.sequences):  # all of them, before a first backward (an error in
            check_sequence(self.model, seq, f"response {i}")  # a later micro-batch left gradients)
        try:
            with torch.enable_grad():  # (under a caller's no_grad: an error deep in autograd)
                return self._step(batch, adv, t0)
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)  # (nothing half-accumulated reaches a later step)
            self.model.zero_grad(set_to_none=True)
            raise

    def _backward(self, batch: TrajectoryBatch, adv: torch.Tensor, prox_lp: torch.Tensor | None,
                  ratios: dict, extra: dict, ref_lp: torch.Tensor | None = None):
        """Forward and backward of one mini-batch over its micro-batches, the gradients summed
        into the master weights; returns its loss and, when it is the whole batch's one update
        (`prox_lp` None), its (padded log-probs, entropies, routing) for the diagnostics (else None:
        the proximal pass gave them). The objective's stats are summed into `ratios`, penalties
        into `extra`. `ref_lp`: the KL reference's padded log-probs, when scored once for every epoch."""
        keep = prox_lp is None
        cfg = self.config
        lps, entropies, losses, routes = [], [], [], []
        aux_coef = cfg.router_aux_loss_coef if self.model.config.is_moe else 0.0
        for idx in micro_batches([len(x) for x in batch.sequences], cfg.micro_batch_size,
                                 cfg.micro_batch_tokens):
            sub = batch.select(idx, validate=False)
            lp, ent = sequence_logprobs(self.model, sub.sequences, cfg.temperature, return_entropy=True,
                                        head_chunk=cfg.head_rows(self.model.config.vocab_size),
                                        recompute=cfg.activation_checkpointing)
            if keep:
                routes += scored_routing(self.model, sub.sequences) or []
            lp_pad = sub.pad(lp)
            prox = {}
            if cfg.loss in PROXIMAL_LOSSES:  # π_prox: the weights before this batch's first update
                prox["prox_lp"] = None if prox_lp is None else prox_lp[idx][:, :lp_pad.shape[1]]
            loss, stats = self.loss_fn(lp_pad, sub.rollout_logprobs, sub.mask, adv[idx], cfg.loss_config,
                                       **prox)
            part, whole = micro_batch_share(cfg.loss_config, sub.mask, batch.mask)  # responses or tokens
            if self.reference is not None:  # β·KL(π ‖ π_ref) on this micro-batch's tokens
                if ref_lp is None:
                    ref = self.reference.logprobs(sub, cfg)
                else:  # (scored once for every epoch)
                    ref = ref_lp[idx][:, :lp_pad.shape[1]]
                kl = kl_penalty(lp_pad, ref, sub.mask, cfg.loss_config, cfg.kl_estimator, sub.included)
                loss = loss + cfg.kl_coef * kl
                extra["train/kl_ref"] = extra.get("train/kl_ref", 0.0) + float(kl.detach()) * part / whole
            for k, (num, den) in stats.items():  # fractions of the whole batch: sums, divided below
                num0, den0 = ratios.get(k, (0.0, 0.0))
                ratios[k] = (num0 + num, den0 + den)
            if aux_coef:  # the router's load-balancing loss over this micro-batch's positions, weighed by
                aux = load_balancing_loss(self.model.last_router_logits,  # its share of the responses
                                          self.model.config.num_experts_per_tok)  # (x 1.0 under 'response')
                loss = loss + aux_coef * aux * (len(idx) / len(batch) / (part / whole) if part else 0.0)
                extra["train/router_aux_loss"] = extra.get("train/router_aux_loss", 0.0) + \
                    float(aux.detach()) * len(idx) / len(batch)
            (loss * (part / whole)).backward()
            self._accumulate()
            losses.append(float(loss.detach()) * part / whole)
            if keep:
                lps += [x.detach() for x in lp]
                entropies += ent
        after = (batch.pad(lps), batch.pad(entropies), pad_routing(batch, routes)) if keep else None
        return sum(losses), after

    def _diagnostics(self, batch: TrajectoryBatch, before) -> dict[str, float]:
        """What the step reports about the weights it starts from, `before` = their (log-probs,
        entropies, routing): computed before any update, so whatever fails here leaves the
        learner as it was."""
        cfg, (learner_lp, entropies, routing) = self.config, before
        metrics: dict[str, float] = {}
        metrics.update(self.decompose(batch, learner_lp, routing))
        metrics.update(mismatch_stats(learner_lp, batch.rollout_logprobs, batch.mask))
        metrics.update(importance_weight_stats(learner_lp, batch.rollout_logprobs, batch.mask))
        if cfg.mechanism:
            metrics.update(bucketed_stats(batch.rollout_logprobs, batch.mask, self.last_kernel_delta,
                                          learner_lp))
        metrics.update(lag_stats(batch.versions, batch.mask, self.version))
        metrics.update(response_stats(batch.mask, batch.rewards, entropies))
        if not batch.included.all():  # responses the objective left out (engine errors)
            metrics["train/excluded_frac"] = float(1 - batch.included.float().mean())
        return metrics

    def _passes(self, n: int) -> list[list[int]]:
        """The response indices of each update, epoch after epoch (`LearnerConfig.shuffle`)."""
        cfg, out = self.config, []
        for epoch in range(cfg.epochs):
            order = torch.arange(n)
            if cfg.shuffle and cfg.mini_batches > 1:  # (a resumed run deals the same)
                order = torch.randperm(n, generator=torch.Generator().manual_seed(self.steps * 65537 + epoch))
            out += [sorted(c.tolist()) for c in order.tensor_split(cfg.mini_batches) if len(c)]
        return out

    def _step(self, batch: TrajectoryBatch, adv: torch.Tensor, t0: float) -> dict[str, float]:
        cfg = self.config
        passes = self._passes(len(batch))
        metrics: dict[str, float] = {"train/step": float(self.steps),
                                     "train/lr": float(self.scheduler.get_last_lr()[0])}
        prox_lp = ref_lp = None
        if len(passes) > 1:  # π_prox, and the diagnostics, at the weights before the first update
            before = self._score(self.model, batch, cfg.micro_batch_size, True)
            prox_lp = before[0]
            metrics.update(self._diagnostics(batch, before))
        if self.reference is not None and cfg.epochs > 1:  # (the same bits as per micro-batch, aligned)
            ref_lp = self._score(self.reference.model, batch, cfg.micro_batch_size, False)[0]
        losses, norms, ratios, extra, skipped, updates = [], [], {}, {}, 0, 0
        whole = len(passes) == 1
        try:
            for idx in passes:
                sub = batch if whole else batch.select(idx, validate=False)
                loss, after = self._backward(sub, adv if whole else adv[idx], None if whole else prox_lp[idx],
                                             ratios, extra, None if ref_lp is None else ref_lp[idx])
                losses.append(loss)
                if whole:  # (before the finite check: a skipped step reports the weight that overflowed)
                    metrics.update(self._diagnostics(batch, after))
                grads = [p.grad for p in self.master if p.grad is not None]
                if not (math.isfinite(loss) and all(bool(torch.isfinite(g).all()) for g in grads)):
                    self.optimizer.zero_grad(set_to_none=True)  # skipped: these weights stay as they are
                    self.model.zero_grad(set_to_none=True)
                    skipped += 1
                    continue
                norms.append(float(clip_gradients(self.master, cfg.max_grad_norm)))  # before clipping
                self._optimizer_step()
                updates += 1
            if skipped:  # the same weights are published again under the next version if all were
                metrics["train/skipped_nonfinite"] = float(skipped)
                self.last_dump = self._dump(batch)
            self._advance_version()
        except BaseException as exc:
            if updates:  # the weights moved: a retry would apply those updates twice
                self.torn = self.torn or _reason(exc)
            raise
        metrics["train/loss"] = sum(losses) / len(losses)
        metrics.update({k: v / len(passes) for k, v in extra.items()})
        metrics.update({k: num / den if den else 0.0 for k, (num, den) in ratios.items()})
        if norms:
            metrics["train/grad_norm"] = sum(norms) / len(norms)  # before clipping; mean over updates
        if len(passes) > 1:
            metrics["train/updates"] = float(updates)
            if norms:
                metrics["train/grad_norm_max"] = max(norms)
        metrics["train/policy_version"] = float(self.version)
        metrics["time/train_s"] = time.perf_counter() - t0
        return metrics

    def _optimizer_step(self) -> None:
        """One optimizer step and the master weights' copy into the model: all of it, or the
        learner is marked `torn` (a retry would have applied the update twice)."""
        try:
            self.optimizer.step()
            self._check_finite_weights()
            self.optimizer.zero_grad(set_to_none=True)
            self.model.zero_grad(set_to_none=True)
            if self.compute_dtype != torch.float32:
                with torch.no_grad():
                    for m, p in zip(self.master, self.model.parameters()):
                        p.copy_(m)
            self.model.invalidate_fused()  # (the fused optimizer leaves version counters as they were)
        except BaseException as exc:
            self.torn = _reason(exc)
            raise

    def _check_finite_weights(self) -> None:
        """ParityError if the optimizer step left a weight non-finite (finite loss and gradients
        with a learning rate that overflows the update): raised inside the update, so the learner
        is torn and neither publishes nor checkpoints the diverged weights."""
        # min and max carry a NaN or inf through: one read of each weight, no weight-sized
        # temporary (isfinite's mask: 155 MB for the 0.6B embedding), one sync
        finite = torch.stack([torch.stack(torch.aminmax(m)) for m in self.master]).isfinite().all()
        if not bool(finite):
            names = [n for n, _ in self.model.named_parameters()]
            bad = next(n for n, m in zip(names, self.master) if not bool(torch.isfinite(m).all()))
            lr = self.scheduler.get_last_lr()[0]
            raise ParityError(f"the update diverged: {bad} is non-finite after the optimizer step; lower "
                              f"learner.lr (now {lr:g}) or learner.max_grad_norm")

    def _advance_version(self) -> None:
        snapshot = self._snapshot()  # first: a failure here changes no count
        self.version += 1
        self.steps += 1
        with warnings.catch_warnings():  # (a skipped first step: torch's order warning, meant here)
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()  # (a skipped step too: it ran one step late for the rest of the run)
        self.history[self.version] = snapshot
        for v in [v for v in self.history if v < self.version - self.config.max_policy_lag]:
            del self.history[v]

    def retain(self, keep: Container[int]) -> None:
        """Drop every kept version not in `keep` but the current one. The controller passes the
        versions a restarted rollout worker could still need, so the copies kept are a handful at
        any lag, not lag-many."""
        for v in [v for v in self.history if v != self.version and v not in keep]:
            del self.history[v]

    def _dump(self, batch: TrajectoryBatch) -> str | None:
        if self.config.dump_dir is None:
            log.warning("step %d: non-finite loss or gradient; update skipped "
                        "(set dump_dir to keep the batch)", self.steps)
            return None
        path = Path(self.config.dump_dir) / f"nonfinite_step{self.steps}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save([vars(t) for t in batch.trajectories], path)
        log.warning("step %d: non-finite loss or gradient; update skipped, batch saved to %s",
                    self.steps, path)
        return str(path)
