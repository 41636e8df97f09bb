"""Reports: a run's plots (PNG) and Markdown summary, and a study's curves and table.

Every number in a report is read from metrics files through `metrics.summary`; nothing is typed
by hand. Plots need matplotlib (a dependency); without it only the Markdown is written.
"""

from __future__ import annotations

from pathlib import Path

from .. import hardware
from .sinks import read_metrics
from .summary import mechanism_table_markdown, run_rows, study_table_markdown

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

STUDY_PLOTS = [
    ("reward", "reward/mean"),
    ("held-out pass@1", "eval/pass@1"),
    ("rollout-learner KL (k3)", "mismatch/k3"),
    ("IS weight peak/median", "is_weight/peak_over_median"),
    ("grad norm (pre-clip)", "train/grad_norm"),
]


def cell(text) -> str:
    """`text` as a Markdown table cell: a `|` in it (|Δ|) would end the cell."""
    return str(text).replace("|", "&#124;")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_report(run_dir: str | Path) -> tuple[Path, Path | None]:
    """Write `report.md` (and `report.png` when matplotlib is installed); return their paths."""
    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir)
    png = None
    plt = _pyplot()
    if plt is not None and metrics:
        # fixed margins, not tight_layout (which draws the figure once more to measure it: 0.4 s of
        # a 6-step run's 2.8 s report, and every run writes one)
        fig, axes = plt.subplots(2, 5, figsize=(22, 7), gridspec_kw=dict(
            left=0.04, right=0.99, bottom=0.08, top=0.95, wspace=0.25, hspace=0.35))
        for ax, (title, keys) in zip(axes.flat, PANELS):
            for key in keys:
                pts = [(m["step"], m[key]) for m in metrics if key in m]
                pts += [(m["step"] + 1, m[key + "_final"]) for m in metrics if key + "_final" in m]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], label=key, marker=".")
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("learner step")
            if len(keys) > 1 and ax.get_legend_handles_labels()[0]:  # (none where no key is recorded)
                ax.legend(fontsize=7)
        # the lag histogram over the whole run's tokens: each step's fractions weighted by its
        # tokens (every step has as many episodes; a plain mean over steps, skipped ones counted,
        # weighed a short step's tokens as a long one's and summed below 1)
        steps = [m for m in metrics if any(k.startswith("lag/hist_") for k in m)]
        weight = {id(m): float(m.get("response/length_mean", 1.0)) for m in steps}
        total = sum(weight.values()) or 1.0
        hist: dict[int, float] = {}
        for m in steps:
            for k, v in m.items():
                if k.startswith("lag/hist_"):
                    lag = int(k.rsplit("_", 1)[1])
                    hist[lag] = hist.get(lag, 0.0) + v * weight[id(m)] / total
        ax = axes.flat[len(PANELS)]
        ax.bar(list(hist), list(hist.values()))
        ax.set_title("policy lag histogram (fraction of tokens)", fontsize=10)
        ax.set_xlabel("lag (policy versions: learner steps)")
        png = run_dir / "report.png"
        fig.savefig(png, dpi=90)
        plt.close(fig)
    md = run_dir / "report.md"
    md.write_text(summary_markdown(metrics) + (f"\n![metrics]({png.name})\n" if png else ""))
    return md, png


def summary_markdown(metrics: list[dict]) -> str:
    lines = ["# Run report", "", "| figure | value |", "|---|---|"]
    lines += [f"| {cell(k)} | {cell(v)} |" for k, v in run_rows(metrics)]
    return "\n".join(lines) + "\n"


def write_study_report(out_dir: str | Path, title: str, results: dict,
                       curves: dict[str, list[dict]]) -> Path:
    """`report.md` (the table) and `study.png` (one curve per row, from `curves`: row name ->
    that row's metrics for one seed) in `out_dir`."""
    out = Path(out_dir)
    plt = _pyplot()
    png = None
    if plt is not None:
        fig, axes = plt.subplots(1, len(STUDY_PLOTS), figsize=(5 * len(STUDY_PLOTS), 4))
        for ax, (name, key) in zip(axes, STUDY_PLOTS):
            for row, rows in curves.items():
                xs = [m["step"] for m in rows if key in m]
                ax.plot(xs, [m[key] for m in rows if key in m], label=row,
                        marker="." if len(xs) < 20 else None)
            ax.set_title(name)
            ax.set_xlabel("update")
            if key in ("is_weight/peak_over_median", "train/grad_norm", "mismatch/k3"):
                ax.set_yscale("symlog", linthresh=1e-6)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        png = out / "study.png"
        fig.savefig(png, dpi=80)
        plt.close(fig)
    machine = f" Machine: {hardware.line(results['machine'])}." if "machine" in results else ""
    lines = [f"# {title}", "", f"Computed from the runs' metrics.jsonl by `parity study`; "
             f"{results['seconds']:.0f} s in all.{machine}", "", study_table_markdown(results), ""]
    if png is not None:
        lines += ["![curves (first seed)](study.png)", ""]
    mechanism = mechanism_table_markdown(results)
    if mechanism:
        lines += ["## The mechanism: mismatch and importance weights by the sampled token's rollout "
                  "probability", "", mechanism, ""]
        if plt is not None and _plot_mechanism(plt, results, out / "mechanism.png"):
            lines += ["![mechanism](mechanism.png)", ""]
    md = out / "report.md"
    md.write_text("\n".join(lines))
    return md


def _plot_mechanism(plt, results: dict, path: Path) -> bool:
    """Kernel mismatch (mean |Δ log-prob|) and the largest IS weight per rollout-probability
    bucket, one line per row that has mechanism figures."""
    rows = {n: r["figures"] for n, r in results["runs"].items()
            if any(k.startswith("mech_tokens/") for k in r["figures"])}
    if not rows:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for name, figs in rows.items():
        buckets = [k.split("/", 1)[1] for k in figs if k.startswith("mech_tokens/")]
        for ax, stat in zip(axes, ("kernel_mean", "is_max")):
            ys = [figs.get(f"mech_{stat}/{b}", {}).get("mean") for b in buckets]
            pts = [(i, y) for i, y in enumerate(ys) if y is not None and y == y]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            ax.set_xticks(range(len(buckets)), [b[1:] for b in buckets], rotation=30, fontsize=7)
    axes[0].set_title("kernel mismatch: mean |Δ log-prob| at the sampling version")
    axes[0].set_yscale("symlog", linthresh=1e-9)
    axes[1].set_title("largest importance weight")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("rollout probability of the sampled token")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True
