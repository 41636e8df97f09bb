"""Summaries of a run's metrics: the one place that turns per-step records into figures.

The run report, `parity train`'s progress line, the demo's closing table, the study's published
figures and docs/make_results.py all read their numbers through these functions, so a figure is
defined once. Inputs are lists of per-step metric dicts as written to `metrics.jsonl`.
"""

from __future__ import annotations

import math
import statistics

Metrics = list[dict]
NAN = float("nan")

TRANSPORT_PREFIXES = ("time/", "throughput/", "sync/")
"""Metrics that depend on the machine, the backend or the number of rollout workers (wall-clock
times, weight transfers); in a deterministic run every other metric depends only on the config."""


PROCESS_FIGURES = ("mismatch/learner_recheck_max_abs",)
"""Figures whose steps depend on the learner process's own history: the re-scoring of old tokens
needs a version the process kept back, which a resumed process has not (they are not checkpointed)."""


def deterministic_view(metrics: Metrics) -> Metrics:
    """The metrics without transport figures: what deterministic runs must agree on exactly."""
    return [{k: v for k, v in m.items() if not k.startswith(TRANSPORT_PREFIXES) and k not in PROCESS_FIGURES}
            for m in metrics]


# --------------------------------------------------------------------------- primitives
def series(metrics: Metrics, key: str) -> list[float]:
    """The values of `key` over the steps that recorded it."""
    return [m[key] for m in metrics if key in m]


def mean(xs) -> float:
    """Mean of the finite-or-infinite values, NaN and None skipped (NaN when none are left)."""
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else NAN


def median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else NAN


def edge_count(n: int, frac: float) -> int:
    """How many steps make up the first (or last) `frac` of `n` steps: at least one."""
    return max(1, round(n * frac))


def head(metrics: Metrics, frac: float) -> Metrics:
    return metrics[:edge_count(len(metrics), frac)]


def tail(metrics: Metrics, frac: float) -> Metrics:
    return metrics[-edge_count(len(metrics), frac):]


def mean_at_k_interval(fractions: list[float], k: int) -> tuple[float, float, float]:
    """Mean of per-problem success fractions (each of `k` samples) and its 95% interval: Wilson's
    at an effective sample size, n problems times k samples shrunk by how much the problems differ
    (n * p(1 - p) / variance of the fractions, kept within [n, n * k]; n alone where the fractions
    cannot tell: all 0, all 1, or all equal). The normal approximation it replaces gave ± 0 at 0%
    and 100%, ran below 0, and covered a true mean of 2.4% spread over few problems 88% of the
    time (100 problems, k = 8; this one 92%, and >= 93% at less skewed means)."""
    n = len(fractions)
    p = sum(fractions) / n
    var = sum((f - p) ** 2 for f in fractions) / (n - 1) if n > 1 else 0.0
    n_eff = float(n) if var == 0 or p in (0.0, 1.0) else min(n * k, max(n, n * p * (1 - p) / var))
    lo, hi = wilson(p, n_eff)
    return p, lo, hi


def env_metrics(episodes, prefix: str) -> dict[str, float]:
    """The numbers environments report per episode (`episode.info["metrics"]`: a reward's parts, a
    task's own measures), each averaged over the episodes that report it, as `prefix + name`."""
    values: dict[str, list[float]] = {}
    for episode in episodes:
        for name, value in (episode.info.get("metrics") or {}).items():
            values.setdefault(name, []).append(value)
    return {prefix + name: sum(v) / len(v) for name, v in sorted(values.items())}


def token_mean(metrics: Metrics, key: str) -> float:
    """The run's mean of a per-token figure recorded as each step's mean: weighted by the step's
    tokens (every step has as many episodes; a plain mean over steps gave a short step's tokens
    a long one's weight)."""
    pts = [(m[key], float(m.get("response/length_mean", 1.0))) for m in metrics if key in m]
    total = sum(w for _, w in pts)
    return sum(v * w for v, w in pts) / total if total else NAN


def wilson(p: float, n: float) -> tuple[float, float]:
    """The 95% Wilson score interval of a success fraction `p` over `n` trials (the normal
    approximation's p ± 1.96 sd gave ± 0 at 0/n and n/n and ran past 100%: 98.5% ± 1.7%)."""
    if not n or n != n:
        return NAN, NAN
    z2 = 1.96 ** 2
    d = 1 + z2 / n
    center = (p + z2 / (2 * n)) / d
    half = 1.96 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / d
    return max(0.0, center - half), min(1.0, center + half)


def pass_at_1_text(r: dict, suffix: str = "") -> str:
    """'49.5% (95% CI 42.6-56.4%)' from a record's held-out greedy pass@1 (`suffix` '_final': the
    evaluation after the last step); records from before the interval was recorded get it from
    their pass@1 and problem count."""
    p = r.get("eval/pass@1" + suffix)
    if p is None:
        return "not evaluated"
    lo, hi = r.get("eval/pass@1_lo95" + suffix), r.get("eval/pass@1_hi95" + suffix)
    if lo is None or hi is None:
        lo, hi = wilson(p, r.get("eval/problems" + suffix, NAN))
    return f"{p:.1%} (95% CI {lo:.1%}-{hi:.1%})"


def pass_at_1_track(metrics: Metrics) -> list[float]:
    """Held-out greedy pass@1 at every evaluation, the final one (after the last step) included."""
    return series(metrics, "eval/pass@1") + series(metrics, "eval/pass@1_final")


# --------------------------------------------------------------------------- one step
def step_line(m: dict, timing: bool = False) -> str:
    """One step's progress text (the live bar, or a log line per step)."""
    if m.get("train/skipped_nonfinite"):
        return "non-finite loss or gradient: update skipped"
    text = (f"loss {m['train/loss']:+.4f}  " if timing else "") + (
        f"reward {m['reward/mean']:.3f}  lag max {m.get('lag/max', 0):.0f}  "
        f"w peak/median {m.get('is_weight/peak_over_median', 1):.3f}  "
        f"kernel mismatch {m.get('mismatch/kernel_max_abs', NAN):.3g}")
    if m.get("rollout/context_full"):  # (episodes ended, reward 0, by an observation past the context)
        text += f"  context full {m['rollout/context_full']:.0%}"
    if timing:
        text += f"  wait {m['time/wait_s']:.2f}s"
    elif "eval/pass@1" in m:
        text += f"  held-out pass@1 {m['eval/pass@1']:.1%}"
    return text


# --------------------------------------------------------------------------- a run
def steady(record: dict) -> float:
    """Learner steps per hour after the first step, evaluation time out (runs recorded before the
    figure existed: all steps over the wall time)."""
    return record.get("throughput/steady_steps_per_hour", record.get("throughput/steps_per_hour", NAN))


def kernel_text(metrics: Metrics) -> str:
    """The run's largest kernel mismatch, or why it has none."""
    kernel = series(metrics, "mismatch/kernel_max_abs")
    if kernel:
        return f"{max(kernel):.3g}"
    if series(metrics, "mismatch/decomposed_frac"):  # decomposed, but no token's θ_old log-prob was at hand
        return "not measured (no token could be split: mismatch/decomposed_frac 0)"
    return "not measured (learner.decompose_every = 0)"


def run_rows(metrics: Metrics) -> list[tuple[str, str]]:
    """The run report's summary table (figure, value)."""
    if not metrics:
        return []
    last = metrics[-1]
    first10, last10 = head(metrics, 0.10), tail(metrics, 0.10)
    evals = pass_at_1_track(metrics)

    def val(k, fmt="{:.4g}"):
        return fmt.format(last[k]) if k in last else "-"

    return [
        ("learner steps", str(len(metrics))),
        ("reward, first 10% -> last 10%",
         f"{mean(series(first10, 'reward/mean')):.4f} -> {mean(series(last10, 'reward/mean')):.4f}"),
        ("rollout-learner KL k3, first 10% -> last 10%",
         f"{mean(series(first10, 'mismatch/k3')):.3g} -> {mean(series(last10, 'mismatch/k3')):.3g}"),
        ("kernel mismatch max |Δ| (all steps)",
         kernel_text(metrics)),
        ("importance weight peak/median (max over steps)",
         f"{max(series(metrics, 'is_weight/peak_over_median'), default=1.0):.4g}"),
        ("largest gradient norm before clipping",
         f"{max(series(metrics, 'train/grad_norm'), default=0.0):.4g}"),
        ("policy lag max / mean",
         f"{max(series(metrics, 'lag/max'), default=0):.0f} / {token_mean(metrics, 'lag/mean'):.2f}"),
        ("learner steps/hour (after the first step, evaluations out)", f"{steady(metrics[-1]):,.0f}"),
        ("wall time (s) from the workers' start, evaluations included", val("time/wall_s", "{:.1f}")),
        ("held-out pass@1: start / peak / end",
         f"{evals[0]:.3f} / {max(evals):.3f} / {evals[-1]:.3f}" if evals else "-"),
    ]


def demo_rows(metrics: Metrics) -> list[tuple[str, str]]:
    """`parity demo`'s closing table (figure, value)."""
    first, last = metrics[0], metrics[-1]
    before = first.get("eval/pass@1")
    after_text = pass_at_1_text(last, "_final" if "eval/pass@1_final" in last else "")
    after = last.get("eval/pass@1_final", last.get("eval/pass@1"))
    peak = series(metrics, "is_weight/peak_over_median")
    first10, last10 = head(metrics, 0.10), tail(metrics, 0.10)
    pts = f"  ({(after - before) * 100:+.1f} points)" if before is not None and after is not None else ""
    recheck = series(metrics, "mismatch/learner_recheck_max_abs")
    return [
        ("held-out pass@1 (greedy), before -> after", f"{pass_at_1_text(first)} -> {after_text}{pts}"),
        ("rollout-learner KL at the sampling version (max)",
         f"{max(series(metrics, 'mismatch/kernel_k3'), default=NAN):.3g}"),
        ("kernel mismatch max |Δ log-prob| (all steps)",
         kernel_text(metrics)),
        ("learner process vs rollout worker, old tokens re-scored: max |Δ| (steps)",
         f"{max(recheck):.3g} ({len(recheck)})" if recheck else "-"),
        ("importance weight peak/median (median step / worst step)",
         f"{median(peak):.4g} / {max(peak, default=NAN):.4g}"),
        ("policy lag max / mean",
         f"{max(series(metrics, 'lag/max'), default=0):.0f} / {token_mean(metrics, 'lag/mean'):.2f}"),
        ("reward, first 10% -> last 10%",
         f"{mean(series(first10, 'reward/mean')):.3f} -> {mean(series(last10, 'reward/mean')):.3f}"),
        ("tool calls per episode, first 10% -> last 10%",
         f"{mean(series(first10, 'rollout/tool_calls')):.2f} -> "
         f"{mean(series(last10, 'rollout/tool_calls')):.2f}"),
        ("learner steps/hour (after the first step, evaluations out); sampled tokens/s",
         f"{steady(last):,.0f}; {last.get('throughput/tokens_per_s', NAN):,.0f}"),
        ("wall time (s) from the workers' start, evaluations included",
         f"{last.get('time/wall_s', NAN):.0f}"),
    ]


# --------------------------------------------------------------------------- the study's figures
def row_figures(metrics: Metrics) -> dict[str, float]:
    """The published figures of one run, from its metrics (definitions as published):

    - is_peak_over_median: peak over median of the per-step max importance weight;
    - kl_last_over_first: rollout-to-learner KL (k3), mean of the last 10% of updates over the
      mean of the first 10%, both past the warm-up (steps >= `lag/bound`, where a fixed-staleness
      row's lag is the bound: from step 0 the first 10% would compare lag 64 with lags 0-34);
    - kernel_kl_mean: the kernel part of that KL alone (`mismatch/kernel_k3`), past the warm-up;
    - kernel_mismatch_max: max |Δ log-prob| between rollout and learner at the same weights;
    - kernel_mismatch_mean / weight_lag_mean_abs: mean over steps of the per-token mean |Δ log-prob|
      due to kernels (same weights) and due to weight lag (sampling vs current weights; past the
      warm-up);
    - grad_norm_max: largest gradient norm before clipping;
    - reward_first5 / reward_last5: mean reward over the first / last 5% of updates;
    - pass1_start / pass1_peak / pass1_end: held-out greedy pass@1;
    - wall_s (from the rollout workers' start: their first batches and the evaluations included,
      the model's build and the workers' or Ray's start-up not); steps_per_hour: training steps per
      hour after the first step, evaluation time taken out (`throughput/steady_steps_per_hour`;
      runs recorded before it: all steps over the wall time); lag_mean, lag_max: observed lag.
    """
    w = series(metrics, "is_weight/max")
    bound = int(metrics[-1].get("lag/bound", 0))
    held = [m for m in metrics if m["step"] >= bound]  # past the warm-up, where the lag is the bound's
    held = held if len(held) >= 10 else metrics  # (smoke runs shorter than their bound: every step)
    k3 = series(held, "mismatch/k3")
    kl_first = mean(k3[:edge_count(len(held), 0.10)])
    kl_last = mean(k3[-edge_count(len(held), 0.10):])
    rewards = series(metrics, "reward/mean")
    evals = pass_at_1_track(metrics)
    last = metrics[-1]
    return {
        "steps": float(len(metrics)),
        "is_peak_over_median": max(w) / statistics.median(w) if w else NAN,
        "kl_first": kl_first,
        "kl_last": kl_last,
        "kl_last_over_first": kl_last / kl_first if kl_first > 0 else (1.0 if kl_last == 0 else float("inf")),
        "kernel_mismatch_max": max(series(metrics, "mismatch/kernel_max_abs"), default=NAN),
        "kernel_mismatch_mean": mean(series(metrics, "mismatch/kernel_mean_abs")),
        "weight_lag_mean_abs": mean(series(held, "mismatch/weight_lag_mean_abs")),
        "kernel_kl_mean": mean(series(held, "mismatch/kernel_k3")),
        "grad_norm_max": max(series(metrics, "train/grad_norm"), default=NAN),
        "reward_first5": mean(rewards[:edge_count(len(metrics), 0.05)]),
        "reward_last5": mean(rewards[-edge_count(len(metrics), 0.05):]),
        "pass1_start": evals[0] if evals else NAN,
        "pass1_peak": max(evals) if evals else NAN,
        "pass1_end": evals[-1] if evals else NAN,
        "wall_s": last.get("time/wall_s", NAN),
        "steps_per_hour": steady(last),
        "lag_mean": token_mean(metrics, "lag/mean"),
        "lag_max": max(series(metrics, "lag/max"), default=0.0),
        **_after_warmup(metrics),
        **mechanism_figures(metrics),
    }


def _after_warmup(metrics: Metrics) -> dict[str, float]:
    """The smallest and largest per-token lag over the steps after the first `lag/bound` (when a
    fixed staleness should make every token exactly `bound` versions old), and the mean fraction
    of responses a gating objective rejected there (`loss/frac_rejected`: seq_gate, mis)."""
    bound = int(metrics[-1].get("lag/bound", 0))
    held = [m for m in metrics if m["step"] >= bound]
    later = [m for m in held if "lag/min" in m]
    return {"lag_min_after_warmup": min((m["lag/min"] for m in later), default=NAN),
            "lag_max_after_warmup": max((m["lag/max"] for m in later), default=NAN),
            "rejected_frac": mean(series(held if len(held) >= 10 else metrics,  # (smoke runs: every step)
                                         "loss/frac_rejected"))}


def mechanism_figures(metrics: Metrics) -> dict[str, float]:
    """Per rollout-probability bucket over the whole run (`mechanism/...` metrics): the token-weighted
    mean and the max of the kernel mismatch |Δ log-prob|, the largest importance weight, and the
    number of tokens. Keys `mech_<stat>/<bucket>`."""
    out: dict[str, float] = {}
    buckets = sorted({k.rsplit("/", 1)[1] for m in metrics for k in m if k.startswith("mechanism/tokens/")},
                     key=lambda b: float(b[1:].split("-")[0]))
    for b in buckets:
        tokens = [m.get(f"mechanism/tokens/{b}", 0.0) for m in metrics]
        means = [(m[f"mechanism/kernel_abs_mean/{b}"], n) for m, n in zip(metrics, tokens)
                 if f"mechanism/kernel_abs_mean/{b}" in m]
        out[f"mech_tokens/{b}"] = float(sum(tokens))
        out[f"mech_kernel_mean/{b}"] = (sum(v * n for v, n in means) / sum(n for _, n in means)
                                        if means and sum(n for _, n in means) else NAN)
        out[f"mech_kernel_max/{b}"] = max(series(metrics, f"mechanism/kernel_abs_max/{b}"), default=NAN)
        out[f"mech_is_max/{b}"] = max(series(metrics, f"mechanism/is_weight_max/{b}"), default=NAN)
    return out


def aggregate(per_seed: list[dict[str, float]]) -> dict[str, dict]:
    """Mean, spread (min..max half-range) and values over seeds, per figure."""
    out = {}
    for key in per_seed[0]:
        vals = [r[key] for r in per_seed]
        finite = [v for v in vals if not math.isnan(v)]
        out[key] = {"mean": mean(vals), "spread": (max(finite) - min(finite)) / 2 if finite else NAN,
                    "values": vals}
    return out


STUDY_COLUMNS = [
    ("IS weight peak/median", "is_peak_over_median", "{:.4g}"),
    ("KL last/first 10%", "kl_last_over_first", "{:.3g}"),
    ("kernel mismatch max abs Δ", "kernel_mismatch_max", "{:.3g}"),
    ("max grad norm", "grad_norm_max", "{:.4g}"),
    ("reward first 5%", "reward_first5", "{:.3f}"),
    ("reward last 5%", "reward_last5", "{:.3f}"),
    ("pass@1 start", "pass1_start", "{:.1%}"),
    ("pass@1 peak", "pass1_peak", "{:.1%}"),
    ("pass@1 end", "pass1_end", "{:.1%}"),
    ("wall s", "wall_s", "{:.0f}"),
    ("steps/hour", "steps_per_hour", "{:,.0f}"),
    ("vs sync", "throughput_vs_sync", "{:.2f}x"),
    ("lag mean", "lag_mean", "{:.1f}"),
    ("lag max", "lag_max", "{:.0f}"),
]
"""The study table's columns: (header, figure key, format)."""


def _cell(fig: dict, fmt: str, seeds: int) -> str:
    m, spread = fig["mean"], fig["spread"]
    if m is None or math.isnan(m):
        return "-"
    text = fmt.format(m)
    if seeds > 1 and not math.isnan(spread) and spread > 0:
        text += " ± " + fmt.replace("x{", "{").replace("{:+", "{:").format(spread).rstrip("x")
    return text


def study_table_markdown(results: dict) -> str:
    """The study's table (Markdown) from its results.json contents."""
    seeds = len(results["config"]["seeds"])
    lines = ["| run | kernels | lag | objective | " + " | ".join(c[0] for c in STUDY_COLUMNS) + " |",
             "|" + "---|" * (4 + len(STUDY_COLUMNS))]
    for name, r in results["runs"].items():
        cells = [_cell(r["figures"][key], fmt, seeds) if key in r["figures"] else "-"
                 for _, key, fmt in STUDY_COLUMNS]
        lines.append(f"| {name} | {r['run']['kernels']} | {r['run']['lag']} | {r['run']['loss']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


MECHANISM_STATS = [
    ("share of sampled tokens", "tokens", "{:.2%}"),
    ("kernel mismatch: mean |Δ log-prob| at the sampling version", "kernel_mean", "{:.3g}"),
    ("kernel mismatch: max |Δ log-prob|", "kernel_max", "{:.3g}"),
    ("largest importance weight", "is_max", "{:.4g}"),
]
"""The mechanism tables: (title, `mech_<stat>` key, format)."""


def mechanism_table_markdown(results: dict) -> str:
    """The mechanism by row, one table per statistic (`MECHANISM_STATS`): a line per rollout-
    probability bucket of the sampled token, a column per row that recorded it (means over
    seeds)."""
    rows = {name: r["figures"] for name, r in results["runs"].items()
            if any(k.startswith("mech_tokens/") for k in r["figures"])}
    if not rows:
        return ""
    buckets = [k.split("/", 1)[1] for k in next(iter(rows.values())) if k.startswith("mech_tokens/")]
    out = []
    for title, stat, fmt in MECHANISM_STATS:
        out += [f"**{title}**", "", "| rollout p of the token | " + " | ".join(rows) + " |",
                "|---|" + "---|" * len(rows)]
        for b in buckets:
            cells = []
            for fig in rows.values():
                v = fig.get(f"mech_{stat}/{b}", {}).get("mean", NAN)
                if stat == "tokens":
                    total = sum(fig[f"mech_tokens/{c}"]["mean"] for c in buckets)
                    v = v / total if total else NAN
                cells.append("-" if math.isnan(v) else fmt.format(v))
            out.append(f"| {b[1:].replace('-', ' – ')} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out).rstrip()
