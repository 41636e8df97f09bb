"""Run report: plots of a run's `metrics.jsonl` (PNG) and a Markdown summary beside it.

Every number in the report is read from the metrics file; nothing is typed by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

PANELS = [
    ("reward", ["reward/mean"]),
    ("rollout-learner KL (k3)", ["mismatch/k3"]),
    ("importance weight peak / median", ["is_weight/peak_over_median"]),
    ("kernel mismatch max |Δ| / weight lag mean |Δ|",
     ["mismatch/kernel_max_abs", "mismatch/weight_lag_mean_abs"]),
    ("gradient norm (before clipping)", ["train/grad_norm"]),
    ("policy lag per token", ["lag/max", "lag/mean"]),
    ("held-out pass@1 (greedy)", ["eval/pass@1"]),
    ("throughput (tokens/s)", ["throughput/tokens_per_s"]),
    ("time per step (s)", ["time/train_s", "time/generate_s", "time/wait_s"]),
]


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_report(run_dir: str | Path) -> tuple[Path, Path | None]:
    """Write `report.md` (and `report.png` when matplotlib is installed); return their paths."""
    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir)
    png = None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
    if plt is not None and metrics:
        fig, axes = plt.subplots(2, 5, figsize=(22, 7))
        for ax, (title, keys) in zip(axes.flat, PANELS):
            for key in keys:
                pts = [(m["step"], m[key]) for m in metrics if key in m]
                pts += [(m["step"] + 1, m[key + "_final"]) for m in metrics if key + "_final" in m]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], label=key, marker=".")
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("learner step")
            if len(keys) > 1:
                ax.legend(fontsize=7)
        hist: dict[int, float] = {}  # lag histogram over the whole run (token fractions)
        for m in metrics:
            for k, v in m.items():
                if k.startswith("lag/hist_"):
                    lag = int(k.rsplit("_", 1)[1])
                    hist[lag] = hist.get(lag, 0.0) + v / len(metrics)
        ax = axes.flat[len(PANELS)]
        ax.bar(list(hist), list(hist.values()))
        ax.set_title("policy lag histogram (fraction of tokens)", fontsize=10)
        ax.set_xlabel("lag (learner updates)")
        fig.tight_layout()
        png = run_dir / "report.png"
        fig.savefig(png, dpi=90)
        plt.close(fig)
    md = run_dir / "report.md"
    md.write_text(summary_markdown(metrics) + (f"\n![metrics]({png.name})\n" if png else ""))
    return md, png


def summary_rows(metrics: list[dict]) -> list[tuple[str, str]]:
    if not metrics:
        return []
    last = metrics[-1]

    def val(m, k, fmt="{:.4g}"):
        return fmt.format(m[k]) if k in m else "-"

    n = len(metrics)
    head, tail = metrics[:max(1, n // 10)], metrics[-max(1, n // 10):]

    def mean(rows, k):
        xs = [r[k] for r in rows if k in r]
        return sum(xs) / len(xs) if xs else float("nan")

    return [
        ("learner steps", str(n)),
        ("reward, first 10% -> last 10%",
         f"{mean(head, 'reward/mean'):.4f} -> {mean(tail, 'reward/mean'):.4f}"),
        ("rollout-learner KL k3, first 10% -> last 10%",
         f"{mean(head, 'mismatch/k3'):.3g} -> {mean(tail, 'mismatch/k3'):.3g}"),
        ("kernel mismatch max |Δ| (all steps)",
         f"{max((m.get('mismatch/kernel_max_abs', 0.0) for m in metrics), default=0.0):.3g}"),
        ("importance weight peak/median (max over steps)",
         f"{max(m.get('is_weight/peak_over_median', 1.0) for m in metrics):.4g}"),
        ("largest gradient norm before clipping",
         f"{max(m.get('train/grad_norm', 0.0) for m in metrics):.4g}"),
        ("policy lag max / mean", f"{max(m.get('lag/max', 0) for m in metrics):.0f} / "
                                  f"{mean(metrics, 'lag/mean'):.2f}"),
        ("learner steps/hour (end)", val(last, "throughput/steps_per_hour", "{:,.0f}")),
        ("wall time (s)", val(last, "time/wall_s", "{:.1f}")),
        ("held-out pass@1: start / peak / end", _pass_at_1(metrics)),
    ]


def _pass_at_1(metrics: list[dict]) -> str:
    evals = [m["eval/pass@1"] for m in metrics if "eval/pass@1" in m]
    evals += [m["eval/pass@1_final"] for m in metrics if "eval/pass@1_final" in m]
    if not evals:
        return "-"
    return f"{evals[0]:.3f} / {max(evals):.3f} / {evals[-1]:.3f}"


def summary_markdown(metrics: list[dict]) -> str:
    rows = summary_rows(metrics)
    lines = ["# Run report", "", "| figure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines) + "\n"
