"""Per-step diagnostics over masked-in (model-sampled) tokens only.

Keys follow `area/name`: `mismatch/...` (rollout vs learner log-probs), `is_weight/...`
(importance weights w = exp(learner − rollout)), `lag/...` (learner version minus the version
that sampled each token), `response/...`, `reward/...`, `rollout/...` (the episodes).
"""

from __future__ import annotations

import torch

from .summary import env_metrics


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
        f"{prefix}/k3": float((torch.expm1(log_w) - log_w).mean()),  # (exp(d) - 1 - d lost d ~ 1e-8)
        f"{prefix}/frac_differ": float((delta != 0).double().mean()),
    }


def importance_weight_stats(learner_lp: torch.Tensor, rollout_lp: torch.Tensor,
                            mask: torch.Tensor) -> dict[str, float]:
    """mean, median, max, peak/median, normalised effective sample size of w. The median is the lower
    middle value of an even count (torch's): [1, 3] gives 1. (The golden recordings hold it so.)"""
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


PROB_BUCKETS = (0.0, 1e-4, 1e-3, 1e-2, 1e-1, 0.5, 1.0)
"""Edges of the rollout-probability buckets of the mechanism diagnostics (the last bucket holds 1)."""


def bucket_labels() -> list[str]:
    return [f"p{lo:g}-{hi:g}" for lo, hi in zip(PROB_BUCKETS[:-1], PROB_BUCKETS[1:])]


def bucketed_stats(rollout_lp: torch.Tensor, mask: torch.Tensor, kernel_delta: torch.Tensor | None,
                   learner_lp: torch.Tensor) -> dict[str, float]:
    """The mechanism, per bucket of the sampled token's rollout probability: how many tokens, the
    mean and max |Δ log-prob| between learner and rollout at the version that sampled them
    (`kernel_delta`, where decomposed; the kernel mismatch) and the largest importance weight
    (learner now / rollout). Keys `mechanism/<stat>/<bucket>`."""
    m = mask.bool()
    p = rollout_lp.detach().double().exp()[m]
    w = (learner_lp.detach().double() - rollout_lp.detach().double()).exp()[m]
    k = kernel_delta.detach().double().abs()[m] if kernel_delta is not None else None  # NaN: not decomposed
    out: dict[str, float] = {}
    edges = PROB_BUCKETS
    for i, label in enumerate(bucket_labels()):
        upper = p <= edges[i + 1] if i == len(edges) - 2 else p < edges[i + 1]
        sel = (p >= edges[i]) & upper
        n = int(sel.sum())
        out[f"mechanism/tokens/{label}"] = float(n)
        if n:
            out[f"mechanism/is_weight_max/{label}"] = float(w[sel].max())
            ks = k[sel] if k is not None else None
            ks = ks[~ks.isnan()] if ks is not None else None
            if ks is not None and ks.numel():
                out[f"mechanism/kernel_abs_mean/{label}"] = float(ks.mean())
                out[f"mechanism/kernel_abs_max/{label}"] = float(ks.max())
    return out


def rollout_stats(results) -> dict[str, float]:
    """Per-batch statistics of a rollout's `EpisodeResult`s: tool use, answers, pass rate, the env's
    own metrics, and the shares of episodes whose last turn hit max_tokens or the KV cache
    (`truncated`) and that an observation past the context ended (`context_full`: both were silent)."""
    episodes, n = [r.episode for r in results], len(results)
    return env_metrics(episodes, "rollout/") | {"rollout/pass_rate": sum(e.passed for e in episodes) / n,
            "rollout/answered": sum(e.answered for e in episodes) / n,
            "rollout/tool_calls": sum(e.tool_calls for e in episodes) / n,
            "rollout/tool_errors": sum(e.tool_errors for e in episodes) / n,
            "rollout/turns": sum(e.turns for e in episodes) / n,
            "rollout/truncated": sum(r.output.finish_reason == "length" for r in results) / n,
            "rollout/context_full": sum(bool(e.info.get("context_full")) for e in episodes) / n}
