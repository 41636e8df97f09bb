"""Diagnostics (mismatch, importance weights, lag), summaries, sinks and reports of runs."""

from .diagnostics import importance_weight_stats, lag_stats, mismatch_stats, response_stats
from .sinks import MetricsSink, read_metrics
from .summary import row_figures, run_rows

__all__ = ["MetricsSink", "importance_weight_stats", "lag_stats", "mismatch_stats", "read_metrics",
           "response_stats", "row_figures", "run_rows"]
