"""Diagnostics: rollout-vs-learner mismatch, importance weights, lag, and their decomposition."""

from .diagnostics import importance_weight_stats, lag_stats, mismatch_stats, response_stats

__all__ = ["importance_weight_stats", "lag_stats", "mismatch_stats", "response_stats"]
