"""Policy-gradient objectives as pure functions of learner log-probs and a batch.

Notation: μ the rollout policy, π the learner, per token w = π/μ = exp(lp − rollout_lp), A_i the
advantage of response i, |y_i| its number of sampled (masked-in) tokens, N the number of
responses. Every loss has the shape L = −(1/N) Σ_i (1/|y_i|) Σ_t f_it A_i, tokens averaged within a
response, responses averaged in the batch (`LossConfig.aggregation = "response"`; "token" divides
Σ_i Σ_t by the batch's Σ_i |y_i| instead, "constant" by N·norm_tokens: `_objective`). Inputs are
padded [B, L] tensors: `logprobs` (learner, differentiable), `rollout_logprobs`, `mask` (1 on
sampled tokens) and `advantages` [B]. Each returns (loss, stats): stats map `loss/...` keys to
(numerator, denominator) pairs of floats, which the learner sums over micro-batches before
dividing, so a fraction is the whole batch's whatever the micro-batching; a micro-batch's loss
counts for `micro_batch_share` of the batch's.

A token that an objective drops (a zero advantage, a mask, a gate, a binding clip) contributes
exactly 0 to the loss and its gradient even when its weight overflows (log w > 88 in float32):
its log-weight is replaced by 0 before the exponential, never multiplied by 0 after it (inf * 0
is NaN, and a NaN skips the whole step).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..config.learner import LOSS_NAMES, LossConfig
from ..errors import ConfigError


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool = False,
                     eps: float = 1e-6, included: torch.Tensor | None = None) -> torch.Tensor:
    """A_i = R_i − mean(R over i's group) (optionally divided by the group's population std + eps,
    not the sample std some GRPO code divides by: 1e-6 of reward gap reads as ±0.33); exactly 0
    for a group whose rewards are all equal (in float32 the mean of n equal rewards such as 0.1
    may round off them, and the std division would blow that up to a signal). Responses not
    `included` (a bool [B]) get 0 and are left out of their group's mean and std."""
    adv = torch.zeros_like(rewards)
    for g in group_ids.unique():
        sel = group_ids == g
        if included is not None:
            sel &= included
            if not sel.any():
                continue
        r = rewards[sel]
        if bool((r == r[0]).all()):
            adv[sel] = 0.0
            continue
        a = r - r.mean()
        if normalize_std:
            a = a / (r.std(unbiased=False) + eps)
        adv[sel] = a
    return adv


def load_balancing_loss(router_logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """The router's auxiliary load-balancing loss (Switch Transformer style), over every MoE
    layer's logits [T, E] concatenated: E * Σ_e f_e · P_e, with f_e the share of routing slots
    that went to expert e and P_e the mean router probability of e. 1.0 when perfectly balanced."""
    logits = torch.cat(router_logits).float()
    probs = torch.softmax(logits, dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices
    slots = torch.zeros_like(probs).scatter_(1, chosen, 1.0)  # [T, E]: 1 where e is in the top-k
    share = slots.mean(0) / top_k
    return logits.shape[1] * (share * probs.mean(0)).sum()


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`values` on masked-in tokens, exactly 0 elsewhere, whatever a padded position holds (inf or
    NaN times a mask of 0 is NaN; the learner pads with 0, a caller of these functions may not)."""
    return torch.where(mask > 0, values, torch.zeros_like(values))


def _response_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(1/|y_i|) Σ_t values_it over masked-in tokens, per response. [B, L] -> [B]"""
    return _masked(values, mask).sum(1) / mask.sum(1)


def _objective(per_token: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor,
               cfg: LossConfig) -> torch.Tensor:
    """−(1/N) Σ_i A_i (1/|y_i|) Σ_t per_token_it (aggregation 'response'; 'token': −(1/Σ_i |y_i|)
    Σ_i A_i Σ_t per_token_it, 'constant': −(1/(N·norm_tokens)) Σ_i A_i Σ_t per_token_it) — shared
    by every loss so that identical per-token values give bit-identical gradients. N and Σ |y_i|
    are the micro-batch's here (`micro_batch_share` weighs it in the batch): responses with A = 0
    or left out (engine errors) count, so they shrink the step."""
    if cfg.aggregation == "response":
        return -(_response_mean(per_token, mask) * adv).mean()
    sums = _masked(per_token, mask).sum(1) * adv
    if cfg.aggregation == "token":
        return -sums.sum() / mask.sum().clamp(min=1)
    return -sums.mean() / cfg.norm_tokens  # ('constant': LossConfig requires norm_tokens > 0)


def micro_batch_share(cfg: LossConfig, sub_mask: torch.Tensor, batch_mask: torch.Tensor) -> tuple[int, int]:
    """The weight of a micro-batch's loss (a mean over its own responses, or its own tokens) in
    the batch's, as (part, whole): its share of the responses, or under aggregation 'token' of the
    sampled tokens, so that the micro-batches' weighted sum is the batch's loss whatever the
    micro-batching."""
    if cfg.aggregation == "token":
        return int(sub_mask.sum()), max(1, int(batch_mask.sum()))
    return sub_mask.shape[0], batch_mask.shape[0]


KL_CLAMP = 20.0
"""k3's log-ratio d = log π_ref − log π is clamped to ±KL_CLAMP (e^20: no float32 overflow)."""


def kl_penalty(lp: torch.Tensor, ref_lp: torch.Tensor, mask: torch.Tensor, cfg: LossConfig,
               estimator: str, included: torch.Tensor | None = None) -> torch.Tensor:
    """The KL penalty per sampled token from d = ref_lp − lp ('k1' −d, 'k2' d²/2, 'k3' e^d − d − 1,
    computed as expm1(d) − d so that a d of 1e-8 is not lost to cancellation), aggregated over
    tokens and responses as the objective is (`cfg.aggregation`); differentiable in `lp`. Each
    value estimates KL(π ‖ π_ref) on tokens drawn from π; as a loss, k2's gradient follows
    KL(π ‖ π_ref), k3's KL(π_ref ‖ π), k1's is 0 in expectation (`LearnerConfig.kl_estimator`).
    Exactly 0 where the two log-probs are equal. `included` [B] bool: the responses the objective
    trains on (an excluded one, which the engine failed, gets no KL gradient either; it still
    counts in the normalisation, as in the objective)."""
    d = _masked(ref_lp - lp, mask)
    if estimator == "k1":
        per_token = -d
    elif estimator == "k2":
        per_token = d * d / 2
    elif estimator == "k3":
        d = d.clamp(-KL_CLAMP, KL_CLAMP)
        per_token = torch.expm1(d) - d
    else:
        raise ConfigError(f"unknown KL estimator {estimator!r}: expected k1, k2 or k3")
    weight = torch.ones(lp.shape[0], dtype=lp.dtype, device=lp.device) if included is None \
        else included.to(device=lp.device, dtype=lp.dtype)
    return -_objective(per_token, mask, weight, cfg)


def _weights(log_w: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """exp(log w) on the `live` tokens, exactly 1 elsewhere (its gradient there exactly 0)."""
    return torch.exp(torch.where(live, log_w, torch.zeros_like(log_w)))


def _log_weights(lp, rollout_lp, mask, adv) -> tuple[torch.Tensor, torch.Tensor]:
    """(log w, live): log w = (lp − rollout_lp) on sampled tokens, 0 elsewhere; live marks the
    sampled tokens of responses with a non-zero advantage (the others contribute 0 whatever w)."""
    live = (mask > 0) & (adv != 0).unsqueeze(1)
    return _masked(lp - rollout_lp, mask), live


def _ratio(count: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    return float(count), float(mask.sum())


def reinforce_zero(lp, rollout_lp, mask, adv, cfg: LossConfig):
    """L = −(1/N) Σ_i (1/|y_i|) Σ_t w_it A_i, w unclipped: gradient w·A·∇log π. No gates. A
    live token whose log w passes ~88 makes the loss inf, and the learner skips that step."""
    log_w, live = _log_weights(lp, rollout_lp, mask, adv)
    return _objective(_weights(log_w, live), mask, adv, cfg), {}


def on_policy(lp, rollout_lp, mask, adv, cfg: LossConfig):
    """Plain REINFORCE: L = −(1/N) Σ_i (1/|y_i|) Σ_t log π_it A_i (no importance weight)."""
    return _objective(lp, mask, adv, cfg), {}


def tis(lp, rollout_lp, mask, adv, cfg: LossConfig):
    """Truncated IS: L = −(1/N) Σ_i (1/|y_i|) Σ_t sg(min(w_it, C)) log π_it A_i."""
    log_w, live = _log_weights(lp, rollout_lp, mask, adv)
    w = torch.exp(log_w.detach())  # no gradient flows through it: inf is clamped to C
    capped = torch.clamp(w, max=cfg.tis_cap)
    frac = _ratio(((w > cfg.tis_cap).float() * mask).sum(), mask)
    return _objective(capped * lp, mask, adv, cfg), {"loss/frac_truncated": frac}


def icepop(lp, rollout_lp, mask, adv, cfg: LossConfig):
    """Two-sided token masking (IcePop): L = −(1/N) Σ_i (1/|y_i|) Σ_t 1[α ≤ w_it ≤ β] w_it A_i."""
    log_w, live = _log_weights(lp, rollout_lp, mask, adv)
    w_all = torch.exp(log_w.detach())
    keep = (w_all >= cfg.icepop_low) & (w_all <= cfg.icepop_high)
    frac = _ratio(((~keep).float() * mask).sum(), mask)
    return _objective(_weights(log_w, live & keep) * keep, mask, adv, cfg), {"loss/frac_masked": frac}


def mis(lp, rollout_lp, mask, adv, cfg: LossConfig):
    """Masked importance sampling, one-sided at C = mis_cap. Level 'token':
    L = −(1/N) Σ_i (1/|y_i|) Σ_t 1[w_it ≤ C] w_it A_i. Level 'sequence': response i's weight is
    ρ_i = Π_t w_it and L = −(1/N) Σ_i 1[ρ_i ≤ C] sg(ρ_i) (1/|y_i|) Σ_t log π_it A_i (gradient
    ρ_i·A_i·∇log π, as the product's correction prescribes); a masked response adds exactly 0."""
    log_w, live = _log_weights(lp, rollout_lp, mask, adv)
    if cfg.mis_level == "token":
        keep = torch.exp(log_w.detach()) <= cfg.mis_cap
        frac = _ratio(((~keep).float() * mask).sum(), mask)
        return _objective(_weights(log_w, live & keep) * keep, mask, adv, cfg), {"loss/frac_masked": frac}
    with torch.no_grad():
        rho = torch.exp((log_w * mask).sum(1))  # inf when it overflows: masked, never multiplied
        keep = rho <= cfg.mis_cap
        rho = torch.where(keep, rho, torch.zeros_like(rho))
    rejected = (float((~keep).sum()), float(keep.numel()))
    return _objective(lp * rho.unsqueeze(1), mask, adv * keep.float(), cfg), {"loss/frac_rejected": rejected}


def seq_gate(lp, rollout_lp, mask, adv, cfg: LossConfig):
    """Sequence gate: response i is dropped unless gate_low ≤ exp(mean_t log w) ≤ gate_high and
    mean_t k3 ≤ gate_max_k3 (k3 = w − 1 − log w); kept ones use the REINFORCE Zero term.
    L = −(1/N) Σ_i g_i (1/|y_i|) Σ_t w_it A_i."""
    log_w, live = _log_weights(lp, rollout_lp, mask, adv)
    with torch.no_grad():
        seq_ratio = torch.exp(_response_mean(log_w, mask))
        k3 = _response_mean(torch.expm1(log_w) - log_w, mask)  # (exp(d) - 1 - d: 7e-9 for 8e-11)
        gate = (seq_ratio >= cfg.gate_low) & (seq_ratio <= cfg.gate_high) & (k3 <= cfg.gate_max_k3)
    w = _weights(log_w, live & gate.unsqueeze(1))
    rejected = (float((~gate).sum()), float(gate.numel()))
    return _objective(w, mask, adv * gate.float(), cfg), {"loss/frac_rejected": rejected}


def _surrogate(log_r, live, mask, adv, cfg: LossConfig):
    """PPO's clipped surrogate per token, min(r A, clip(r, 1 − ε, 1 + ε_high) A) (with the dual
    clip's floor), as f with term = f·A: f = r where the min takes r A (r from log r, 0 off the
    sampled tokens), else the clipped constant, with no gradient. Returns f and the stats. (A is
    left to `_objective`, so that where no clip binds the terms are REINFORCE Zero's bits.)"""
    a = adv.unsqueeze(1)
    with torch.no_grad():
        r_all = torch.exp(log_r)
        clipped = torch.clamp(r_all, 1 - cfg.ppo_eps, 1 + (cfg.ppo_eps_high or cfg.ppo_eps))
        outside = r_all != clipped
        binds = clipped * a < r_all * a  # the min takes the clipped term: no gradient
        if cfg.ppo_dual_clip:  # the max with c·A takes the constant: no gradient either
            floor = (a < 0) & (r_all > cfg.ppo_dual_clip)
            clipped = torch.where(floor, torch.full_like(r_all, cfg.ppo_dual_clip), clipped)
            binds = binds | floor
    r = _weights(log_r, live & ~binds)
    stats = {"loss/frac_clipped": _ratio((outside.float() * mask).sum(), mask)}
    if cfg.ppo_dual_clip:
        stats["loss/frac_dual_clipped"] = _ratio((floor.float() * mask).sum(), mask)
    return torch.where(binds, clipped, r), stats


def ppo_clip(lp, rollout_lp, mask, adv, cfg: LossConfig):
    """GRPO-style PPO clip on the ratio to the rollout policy:
    L = −(1/N) Σ_i (1/|y_i|) Σ_t min(w_it A_i, clip(w_it, 1 − ε, 1 + ε_high) A_i), ε_high =
    `ppo_eps_high` or ε (DAPO's clip-higher when larger). `loss/frac_clipped` is the share of tokens
    whose w lies outside [1 − ε, 1 + ε_high], whether or not the min takes the clipped term there.
    With A < 0 the min is unbounded above unless `ppo_dual_clip` c is set: then a token with A < 0
    and w > c contributes c·A and no gradient (`loss/frac_dual_clipped`)."""
    log_w, live = _log_weights(lp, rollout_lp, mask, adv)
    per_token, stats = _surrogate(log_w, live, mask, adv, cfg)
    return _objective(per_token, mask, adv, cfg), stats


def decoupled_ppo(lp, rollout_lp, mask, adv, cfg: LossConfig, prox_lp=None):
    """AReaL's decoupled PPO: the clip is around a proximal policy π_prox (the learner's weights
    before this batch's first update), the behaviour policy μ is corrected by a detached weight:
    L = −(1/N) Σ_i (1/|y_i|) Σ_t sg(b_it) min(r_it A_i, clip(r_it, 1 − ε, 1 + ε_high) A_i), with
    b = π_prox/μ and r = π/π_prox (`ppo_eps`, `ppo_eps_high`, `ppo_dual_clip` as in ppo_clip). With
    `behav_cap` C > 0 a token whose b exceeds C is masked out (`loss/frac_behav_masked`).
    `prox_lp` None: π_prox is π itself (one update per batch: r = 1, the clip never binds, and the
    gradient is b·A·∇log π, REINFORCE Zero's)."""
    prox = lp.detach() if prox_lp is None else prox_lp
    log_b, live = _log_weights(prox, rollout_lp, mask, adv)
    log_r = _masked(lp - prox, mask)
    stats = {}
    if cfg.behav_cap:
        keep = torch.exp(log_b) <= cfg.behav_cap
        stats["loss/frac_behav_masked"] = _ratio(((~keep).float() * mask).sum(), mask)
        live = live & keep
    per_token, clip_stats = _surrogate(log_r, live, mask, adv, cfg)
    per_token = torch.where(live, _weights(log_b, live) * per_token, torch.zeros_like(per_token))
    return _objective(per_token, mask, adv, cfg), {**clip_stats, **stats}


def gspo(lp, rollout_lp, mask, adv, cfg: LossConfig):
    """GSPO: one length-normalised ratio per response, s_i = exp((1/|y_i|) Σ_t log w_it), clipped:
    L = −(1/N) Σ_i min(s_i A_i, clip(s_i, 1 − ε_low, 1 + ε_high) A_i) (gradient, unclipped,
    s_i A_i (1/|y_i|) Σ_t ∇log π_it). Each of response i's tokens carries s_i, so under aggregation
    'response' its term is the formula's; 'token' weighs a response by its length.
    `loss/frac_clipped_responses` is the share of responses whose s lies outside the band."""
    log_w, live = _log_weights(lp, rollout_lp, mask, adv)
    a = adv.unsqueeze(1)
    log_s = _response_mean(log_w, mask).unsqueeze(1)  # [B, 1], differentiable
    with torch.no_grad():
        s_all = torch.exp(log_s)
        clipped = torch.clamp(s_all, 1 - cfg.gspo_eps_low, 1 + cfg.gspo_eps_high)
        binds = clipped * a < s_all * a  # [B, 1]: the min takes the clipped term, no gradient
    s = _weights(log_s.expand_as(log_w), live & ~binds)
    per_token = torch.where(binds, clipped * a, s * a)
    outside = (float((s_all != clipped).sum()), float(len(adv)))
    return _objective(per_token, mask, torch.ones_like(adv), cfg), {"loss/frac_clipped_responses": outside}


def cispo(lp, rollout_lp, mask, adv, cfg: LossConfig):
    """CISPO: the clipped weight, detached, scales the policy gradient of every token (none is
    dropped, unlike ppo_clip's):
    L = −(1/N) Σ_i (1/|y_i|) Σ_t sg(clip(w_it, 1 − ε_low, 1 + ε_high)) log π_it A_i.
    `loss/frac_clipped` is the share of tokens whose w lies outside the band."""
    w = torch.exp(_masked(lp - rollout_lp, mask).detach())  # no gradient flows through it: inf is clamped
    clipped = torch.clamp(w, 1 - cfg.cispo_eps_low, 1 + cfg.cispo_eps_high)
    frac = _ratio(((w != clipped).float() * mask).sum(), mask)
    return _objective(clipped * lp, mask, adv, cfg), {"loss/frac_clipped": frac}


LOSSES: dict[str, Callable] = {
    "reinforce_zero": reinforce_zero, "tis": tis, "icepop": icepop, "mis": mis,
    "seq_gate": seq_gate, "ppo_clip": ppo_clip, "decoupled_ppo": decoupled_ppo, "gspo": gspo, "cispo": cispo,
    "on_policy": on_policy,
}
assert tuple(LOSSES) == LOSS_NAMES, "config.learner.LOSS_NAMES must list every objective"


def get_loss(name: str) -> Callable:
    if name not in LOSSES:
        raise ConfigError(f"unknown loss {name!r}: expected one of {', '.join(LOSSES)}")
    return LOSSES[name]
