"""Per-step diagnostics over masked-in (model-sampled) tokens only.

Keys follow `area/name`: `mismatch/...` (rollout vs learner log-probs), `is_weight/...`
(importance weights w = exp(learner − rollout)), `lag/...` (learner version minus the version
that sampled each token), `response/...`, `reward/...`.
"""

from __future__ import annotations

import torch


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x.detach()[mask.bool()].double()


def mismatch_stats(learner_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor,
                   prefix: str = "mismatch") -> dict[str, float]:
    """max/mean |Δ log-prob|, k1 = mean(log μ − log π), k3 = mean(w − 1 − log w), and the
    fraction of tokens whose log-probs differ at all."""
    lp, rlp = _masked(learner_lp, mask), _masked(rollout_lp, mask)
    if lp.numel() == 0:
        return {}
    delta = lp - rlp
    log_w = delta
    return {
        f"{prefix}/max_abs": float(delta.abs().max()),
        f"{prefix}/mean_abs": float(delta.abs().mean()),
        f"{prefix}/k1": float((rlp - lp).mean()),
        f"{prefix}/k3": float((log_w.exp() - 1 - log_w).mean()),
        f"{prefix}/frac_differ": float((delta != 0).double().mean()),
    }


def importance_weight_stats(learner_lp: torch.Tensor, rollout_lp: torch.Tensor,
                            mask: torch.Tensor) -> dict[str, float]:
    """mean, median, max, peak/median, normalised effective sample size of w."""
    w = (_masked(learner_lp, mask) - _masked(rollout_lp, mask)).exp()
    if w.numel() == 0:
        return {}
    median = float(w.median())
    return {
        "is_weight/mean": float(w.mean()),
        "is_weight/median": median,
        "is_weight/max": float(w.max()),
        "is_weight/min": float(w.min()),
        "is_weight/peak_over_median": float(w.max()) / median if median > 0 else float("inf"),
        "is_weight/ess": float(w.sum() ** 2 / (w.numel() * (w * w).sum())),
    }


def lag_stats(versions: torch.Tensor, mask: torch.Tensor, current: int) -> dict[str, float]:
    """Policy lag per sampled token: min/mean/max and a histogram (`lag/hist_<k>`: fraction)."""
    lag = current - versions[mask.bool()]
    if lag.numel() == 0:
        return {}
    out = {"lag/min": float(lag.min()), "lag/mean": float(lag.double().mean()), "lag/max": float(lag.max())}
    values, counts = lag.unique(return_counts=True)
    for v, c in zip(values.tolist(), counts.tolist()):
        out[f"lag/hist_{v}"] = c / lag.numel()
    return out


def response_stats(mask: torch.Tensor, rewards: torch.Tensor, entropy: torch.Tensor | None = None
                   ) -> dict[str, float]:
    out = {
        "response/length_mean": float(mask.sum(1).mean()),
        "response/length_max": float(mask.sum(1).max()),
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
    }
    if entropy is not None:
        out["policy/entropy"] = float(_masked(entropy, mask).mean())
    return out
