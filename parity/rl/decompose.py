"""The decomposition of the rollout-to-learner gap into kernel mismatch and weight lag.

Per sampled token, learner(θ_now) − rollout(θ_old) = [learner(θ_old) − rollout(θ_old)] (kernel
mismatch: the same weights and tokens on two code paths; exactly 0 on aligned kernels) +
[learner(θ_now) − learner(θ_old)] (weight lag, which importance sampling corrects), with θ_old the
weights that sampled the token. The learner calls `decompose` with its pre-update log-probs
every `decompose_every` steps.

learner(θ_old) for a token of an older version is the rollout worker's own run of the learner's
code (`sampled_learner_logprobs`): the learner does not keep every version. So that a learner
process computing other bits than its rollout side (another machine, CPU or GPU) cannot hide
there, `recheck` keeps one version back (`Learner.kept_back`) and re-scores, in the learner's own
process, a few rows of the next batch that version sampled: `mismatch/learner_recheck_max_abs`
is |learner process − worker| on them, and their kernel figures use the learner's numbers. The
kept version is not checkpointed (a model's copy in every checkpoint): a resumed run re-scores
again from the first batch of a version it keeps back after the resume, and deterministic
comparisons leave the figure out (`PROCESS_FIGURES`). Only decomposed batches carry the worker's
scores, so with `decompose_every` = k > 1 the version kept back is one whose batch, at the lag
batches come at, is consumed on a decomposed step (`keep_back`).
"""

from __future__ import annotations

import torch

from .trajectory import TrajectoryBatch


def step_diagnostics(learner, batch: TrajectoryBatch, learner_lp: torch.Tensor,
                     learner_routing: torch.Tensor | None = None) -> dict[str, float]:
    """What a learner step reports of the split: `decompose` on the steps `decompose_every` names,
    then, on every step, the choice of the version kept back for `recheck` (`keep_back`)."""
    every, stats = learner.config.decompose_every, {}
    if every and learner.steps % every == 0:
        stats = decompose(learner, batch, learner_lp, learner_routing)
    keep_back(learner, batch)
    return stats


def decompose(learner, batch: TrajectoryBatch, learner_lp: torch.Tensor,
              learner_routing: torch.Tensor | None = None) -> dict[str, float]:
    """Split learner(θ_now) − rollout(θ_old) per token into kernel mismatch
    learner(θ_old) − rollout(θ_old) and weight lag learner(θ_now) − learner(θ_old), with θ_old
    the weights that sampled the token; reported overall and per lag bucket. learner(θ_old) is
    this step's own log-prob for tokens of the current version, else the rollout worker's
    `sampled_learner_logprobs` (the learner path run where θ_old was loaded), else computed
    here from a kept version; tokens with none of the three are left out
    (`mismatch/decomposed_frac` says how many were split), and so are tokens sampled over an
    older version's keys/values (in-flight updates): no θ_old alone sampled those, so their
    gap is reported apart (`mismatch/stale_cache_frac`, `mismatch/stale_cache_max_abs`:
    |learner(θ of the token's version) − rollout|). For MoE models also the share of
    sampled tokens routed to a different expert set by the learner at θ_old
    (`mismatch/routing_flip_frac`, a kernel mismatch too)."""
    stats: dict[str, float] = {}
    stale = batch.stale_cache
    sampled = batch.mask.bool()
    mask = sampled & ~stale
    lp_old = batch.sampled_learner_logprobs.clone()  # learner(θ of the token's version), stale ones too
    current = sampled & (batch.versions == learner.version)  # this step's weights: already computed
    lp_old[current] = learner_lp[current]
    now = mask & current
    flips = routed = 0

    def count_flips(sel, mine, rollout):
        nonlocal flips, routed
        have = sel & (rollout[..., 0, 0] >= 0)
        a, b = mine[have].sort(-1).values, rollout[have].sort(-1).values
        flips += int((a != b).flatten(1).any(1).sum())
        routed += int(have.sum())

    if learner_routing is not None and batch.routing is not None:
        count_flips(now, learner_routing, batch.routing)
    stats.update(recheck(learner, batch, lp_old, mask & ~now & ~lp_old.isnan()))
    todo = sampled & lp_old.isnan()  # (stale tokens too: their gap is reported apart, not left out)
    for v in batch.versions[todo].unique().tolist():
        if v not in learner.history:
            continue  # neither scored by the worker nor kept here
        rows = (todo & (batch.versions == v)).any(1).nonzero().flatten().tolist()
        sub = batch.select(rows, validate=False)
        width = sub.mask.shape[1]
        if sub.routing is not None:
            lp_v, route_v = learner.logprobs(sub, version=v, routing=True)
        else:
            lp_v, route_v = learner.logprobs(sub, version=v), None
        sel = todo[rows][:, :width] & (sub.versions == v)
        block = lp_old[rows][:, :width]
        block[sel] = lp_v[sel]
        lp_old[rows, :width] = block
        if route_v is not None:
            count_flips(sel & ~sub.stale_cache, route_v, sub.routing)
    covered = mask & ~lp_old.isnan()
    kernel = (lp_old - batch.rollout_logprobs).masked_fill(~covered, 0.0)
    lag_part = (learner_lp - lp_old).masked_fill(~covered, 0.0)
    for v in batch.versions[covered].unique().tolist():
        sel = covered & (batch.versions == v)
        bucket = learner.version - v
        stats[f"mismatch/kernel_max_abs/lag_{bucket}"] = float(kernel[sel].abs().max())
        stats[f"mismatch/weight_lag_mean_abs/lag_{bucket}"] = float(lag_part[sel].abs().mean())
    learner.last_kernel_delta = kernel.masked_fill(~covered, float("nan"))  # for the mechanism buckets
    if stale.any():
        stats["mismatch/stale_cache_frac"] = float(stale.sum() / batch.mask.sum())
        have = stale & ~lp_old.isnan()  # (from the worker, this step, or a version kept here)
        if have.any():
            stats["mismatch/stale_cache_max_abs"] = float((lp_old - batch.rollout_logprobs)[have].abs().max())
    stats["mismatch/decomposed_frac"] = float(covered.sum() / batch.mask.sum())  # (0 too: it was missing)
    if covered.any():
        stats["mismatch/kernel_max_abs"] = float(kernel[covered].abs().max())
        stats["mismatch/kernel_mean_abs"] = float(kernel[covered].abs().mean())
        d = kernel[covered].double()  # rollout-to-learner KL (k3) at the version that sampled
        stats["mismatch/kernel_k3"] = float((torch.expm1(d) - d).mean())
        stats["mismatch/weight_lag_max_abs"] = float(lag_part[covered].abs().max())
        stats["mismatch/weight_lag_mean_abs"] = float(lag_part[covered].abs().mean())
    if routed:
        stats["mismatch/routing_flip_frac"] = flips / routed
    return stats


RECHECK_ROWS = 2
"""Rows of a batch re-scored in the learner's process at the pinned version (a forward of these)."""


def recheck(learner, batch: TrajectoryBatch, lp_old: torch.Tensor, scored: torch.Tensor) -> dict[str, float]:
    """Re-score, in this process, up to `RECHECK_ROWS` rows of `batch` whose tokens the worker
    scored (`scored`) under the version kept back; their learner(θ_old) in `lp_old` becomes this
    process's, and the version is let go (`keep_back` keeps another). Nothing to do in
    synchronous runs (every token is of the current version, compared across processes already)."""
    kept = learner.kept_back  # {version: its weights}: at most one, the history's own tensors
    pinned = next(iter(kept), None)
    if pinned is None or learner.config.max_policy_lag == 0:
        return {}
    rows = (scored & (batch.versions == pinned)).any(1).nonzero().flatten().tolist()[:RECHECK_ROWS]
    if not rows:
        return {}
    sub = batch.select(rows, validate=False)
    width = sub.mask.shape[1]
    sel = scored[rows][:, :width] & (sub.versions == pinned)
    mine = learner.logprobs(sub, version=pinned)[sel]
    block = lp_old[rows][:, :width]
    stats = {"mismatch/learner_recheck_max_abs": float((mine - block[sel]).abs().max())}
    block[sel] = mine
    lp_old[rows, :width] = block
    kept.clear()
    return stats


def keep_back(learner, batch: TrajectoryBatch) -> None:
    """After a step: let the kept version go once no later batch can carry it (it is at the lag
    bound), and, with none kept, keep the current one if the batch it samples is consumed on a
    decomposed step (the worker scores only those: `decompose_every`), at the lag this batch came
    at (its newest tokens' version: the full lag in deterministic runs, often less where the
    rollout side is the slower). It is re-scored on any decomposed step whose batch carries it. Nothing
    is kept where the worker does not score (a decomposed batch without its scores; MoE, whose
    tokens the learner scores itself from the versions it keeps)."""
    cfg, kept = learner.config, learner.kept_back
    lag, every = cfg.max_policy_lag, cfg.decompose_every
    if lag == 0 or not every:
        return
    unscored = learner.steps % every == 0 and batch.sampled_learner_logprobs.isnan().all()
    if kept and (next(iter(kept)) <= learner.version - lag or unscored):
        kept.clear()  # (the rollout side never sees it: what a resumed run samples with is the history)
    newest = batch.versions[batch.mask.bool()]  # (the lag batches are sampled at now, not the bound)
    ahead = max(1, learner.version - int(newest.max())) if newest.numel() else lag
    if not kept and not unscored and batch.routing is None and (learner.steps + ahead) % every == 0:
        kept[learner.version] = learner.history[learner.version]
