"""Build docs/results.md from a finished study directory and a demo run directory.

    python docs/make_results.py STUDY_DIR DEMO_DIR "STUDY COMMAND" "DEMO TIME" ["STUDY TIME"]

Every number in the page is read from the runs' files (results.json, metrics.jsonl); the prose
around them is this script's. The study plot is copied to docs/study.png, the demo's to
docs/demo.png.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from parity.metrics.sinks import read_metrics  # noqa: E402
from parity.metrics.summary import demo_rows, study_table_markdown  # noqa: E402


def fig(results: dict, run: str, key: str) -> float:
    return results["runs"][run]["figures"][key]["mean"]


def main() -> None:
    study_dir, demo_dir, command, demo_time = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    study_time = sys.argv[5] if len(sys.argv) > 5 else "wall time not recorded"
    results = json.loads((study_dir / "results.json").read_text())
    seeds = results["config"]["seeds"]
    total_wall = sum(v for run in results["runs"].values() for v in run["figures"]["wall_s"]["values"])
    shutil.copyfile(study_dir / "study.png", HERE / "study.png")
    shutil.copyfile(demo_dir / "report.png", HERE / "demo.png")
    demo = read_metrics(demo_dir)
    r = results

    def f(run, key, fmt="{:.3g}"):
        return fmt.format(fig(r, run, key))

    lines = [
        "# Results on this machine kind",
        "",
        "2 cores (AMD EPYC, AVX-512), torch 2.13.0 CPU build, float32, the `small` model (~5M parameters,",
        "character-level tokenizer) built by `parity sft`. Every number below is read from the "
        "runs' files by",
        "`docs/make_results.py`; nothing is typed by hand.",
        "",
        "## `parity demo`",
        "",
        f"`parity demo` from an empty cache: {demo_time}. Asynchronous REINFORCE Zero, aligned "
        f"kernels, policy",
        f"lag 8, {len(demo)} learner steps of 64 episodes on the tool-use task; held-out set of 200 "
        f"problems:",
        "",
        "| figure | value |",
        "|---|---|",
        *[f"| {k.replace('|', '&#124;')} | {v} |" for k, v in demo_rows(demo)],
        "",
        "![demo run](demo.png)",
        "",
        "## `parity study`",
        "",
        f"Command: `{command}` — {len(r['runs'])} runs x {len(seeds)} seed(s); {study_time}; the runs' "
        f"own wall times (evaluations included) add up to {total_wall / 60:.0f} min, "
        f"{total_wall / 60 / len(seeds):.0f} min per seed, so the default 3 seeds take about "
        f"{3 * total_wall / 60 / len(seeds):.0f} min of training.",
        "Each row: mean over seeds (± half the min–max range when there are several seeds).",
        "",
        study_table_markdown(r),
        "",
        f"![study curves, seed {seeds[0]}](study.png)",
        "",
        "### What reproduces at this scale, what does not, and why",
        "",
        "- **Kernel mismatch is exactly zero on every aligned row** (sync, async-8, async-64: "
        "max |Δ log-prob| "
        f"{f('sync', 'kernel_mismatch_max')}, {f('async-8', 'kernel_mismatch_max')}, "
        f"{f('async-64', 'kernel_mismatch_max')}), and the importance-weight peak/median of the synchronous "
        f"aligned run is exactly {f('sync', 'is_peak_over_median', '{:.4g}')}: "
        "at lag 0 every weight is 1.0 bit "
        "for bit. This is the published result's premise, and it holds.",
        f"- **The standard rows do carry a kernel mismatch** (std-64: max |Δ log-prob| "
        f"{f('std-64', 'kernel_mismatch_max')}), but on a CPU in float32 it is tiny next to the weight lag "
        "these small, fast-moving policies produce. So the published failure of standard kernels (weight "
        "peaks of 442x, KL rising 83x, accuracy falling) does not show here, and differences between "
        "rows are dominated by run-to-run variance (asynchronous sampling is not deterministic, runs are "
        "short): the importance-weight "
        f"peak/median is {f('std-64', 'is_peak_over_median')} for std-64 against "
        f"{f('async-64', 'is_peak_over_median')} for async-64, driven by weight lag on both. On GPUs in "
        "bfloat16 the mismatch is orders of magnitude larger (different kernels for prefill, decode and "
        "training; split reductions), which is where the published gap comes from; `parity check --dtype "
        "bfloat16` shows the CPU bf16 gap on your machine.",
        "- **Rollout-to-learner KL on the asynchronous rows is weight lag** (KL last/first 10%: async-8 "
        f"x{f('async-8', 'kl_last_over_first')}, async-64 x{f('async-64', 'kl_last_over_first')}, "
        f"std-64 x{f('std-64', 'kl_last_over_first')}; sync stays at exactly 0, shown as x1). The "
        "decomposition puts all of the aligned rows' KL on lag (their kernel part is exactly 0), and a "
        "5M-parameter policy moves far in a few updates, so the weight-lag share is much larger than in "
        "the published large-model runs (aligned peak/median 1.50, max gradient norm 0.0555).",
        f"- **Async vs sync throughput**: {f('async-8', 'throughput_vs_sync', '{:.2f}')}x (async-8) and "
        f"{f('async-64', 'throughput_vs_sync', '{:.2f}')}x (async-64) learner steps/hour over sync. With 2 "
        "cores split between the rollout worker and the learner the ceiling is 2x, and the gain is "
        "smaller still: synchronous training gives each side both cores in turn, asynchronous training "
        "one core each at once, so async only wins what the two sides lose to imperfect thread scaling "
        "(here the learner, at one thread, is the bottleneck). The published 2.40x was measured with "
        "separate rollout and training GPUs, where the overlap is real. Standard-kernel rows run "
        "faster than aligned async rows here because the standard learner (plain autograd) is quicker "
        "than the aligned one (custom autograd functions around fixed-order kernels).",
        f"- **Observed lag**: async-64 reached a mean lag of {f('async-64', 'lag_mean', '{:.1f}')} (max "
        f"{f('async-64', 'lag_max', '{:.0f}')}): in a {r['config']['train'].get('steps', '?')}-step run on 2 "
        "cores the rollout side does not get 64 versions ahead, so the lag-64 rows test a lag bound that "
        "rarely binds.",
        "- **Learning**: held-out pass@1 of the aligned async-8 run went "
        f"{f('async-8', 'pass1_start', '{:.1%}')}"
        f" -> {f('async-8', 'pass1_end', '{:.1%}')} (peak {f('async-8', 'pass1_peak', '{:.1%}')}); reward "
        f"{f('async-8', 'reward_first5', '{:.3f}')} -> {f('async-8', 'reward_last5', '{:.3f}')} "
        "over the first "
        "and last 5% of updates. Runs are short, so gains are a few points to a few tens of points and the "
        "seed spread is wide; compare rows with their spreads.",
        "",
    ]
    (HERE / "results.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
