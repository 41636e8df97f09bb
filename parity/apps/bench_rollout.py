"""`parity bench rollout`: engine output tokens/s on a long-tail workload, aligned vs standard.

The workload is the shape of RL rollouts: prompts of 16-64 tokens (`--prompt-len`: all of one
length) and geometric response lengths (mean `--mean-len`, capped at `--max-len`), so a few long
responses keep the batch busy while the rest finish early. Both backends run the same prompts
and lengths, rounds interleaved, and the medians are compared; `--group-size G` asks each prompt
G times in a row (a GRPO group) and adds the aligned engine without prefix caching
(`aligned-no-prefix`: the speedup of sharing the group's prompt blocks); `--vs-transformers` adds
Hugging Face `generate()` on the same saved checkpoint (batched, KV cache, each batch until its
longest response).
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from .. import hardware
from ..dtypes import dtype_from_name
from ..engine import Engine, SamplingParams
from ..errors import ParityError
from ..model import Model, ModelConfig
from ..ops import BACKENDS, describe_aligned
from ..rl.rollout_worker import geometric_lengths
from .timing import busy_note, gemm_rate_again
from .ui import exit_status, gemm_line, status, table, term_as_interrupt


@dataclass
class RolloutWorkload:
    """Prompts and per-request response lengths with a long tail (geometric lengths)."""

    prompts: list[list[int]]
    lengths: list[int]

    @staticmethod
    def make(n: int, vocab: int, mean_len: float = 48, max_len: int = 256, seed: int = 0, group: int = 1,
             prompt_len: int = 0) -> RolloutWorkload:
        """`n` requests: prompts of `prompt_len` tokens (0: 16-64), each asked `group` times in a row."""
        rnd = random.Random(seed)
        prompts = [[rnd.randrange(vocab) for _ in range(prompt_len or rnd.randint(16, 64))]
                   for _ in range(-(-n // group))]
        prompts = [p for p in prompts for _ in range(group)][:n]
        return RolloutWorkload(prompts, geometric_lengths(rnd, n, mean_len, max_len))

    @property
    def output_tokens(self) -> int:
        return sum(self.lengths)

    def forward_flops(self, cfg: ModelConfig) -> float:
        """Model FLOPs of the workload as the engine computes it: the prompt and every generated
        token but the last go through the model (t = len(prompt) + n - 1 positions, attention over
        their context: t forwards at context (t - 1) / 2), and the LM head runs n times (the
        prompt's last position, then each fed-back token), not at every prompt position."""
        head = cfg.head_flops_per_token
        return sum(t * (cfg.forward_flops_per_token((t - 1) / 2) - head) + n * head
                   for t, n in ((len(p) + n - 1, n) for p, n in zip(self.prompts, self.lengths)))


def _run_engine(eng: Engine, work: RolloutWorkload) -> tuple[float, list[float]]:
    """One pass of the workload on a long-lived engine (as a rollout worker keeps one: its decode
    graphs, on a GPU, are captured in the warm-up round, not in the timed ones)."""
    eng.step_times = []
    params = [SamplingParams(temperature=1.0, max_tokens=n, seed=i, ignore_eos=True)
              for i, n in enumerate(work.lengths)]
    t0 = time.perf_counter()
    outs = eng.generate(work.prompts, params)
    elapsed = time.perf_counter() - t0
    assert sum(len(o.token_ids) for o in outs) == work.output_tokens
    return elapsed, eng.step_times


def _load_transformers(path, dtype):
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _run_transformers(hf, work: RolloutWorkload, batch_size: int) -> float:
    """HF `generate()` (batched, KV cache): each batch runs until its longest response."""
    torch.manual_seed(0)
    t0 = time.perf_counter()
    for i in range(0, len(work.prompts), batch_size):
        prompts = work.prompts[i:i + batch_size]
        longest = max(work.lengths[i:i + batch_size])
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                        max_new_tokens=longest, min_new_tokens=longest, pad_token_id=0)
    return time.perf_counter() - t0


NO_PREFIX = "aligned-no-prefix"


@dataclass
class RolloutRow:
    system: str
    dtype: str
    output_tokens: int
    tok_s: float
    step_ms_p50: float | None
    step_ms_p90: float | None
    step_ms_p99: float | None
    gflops: float = 0.0
    """Achieved model GFLOP/s (`RolloutWorkload.forward_flops` over the median time)."""
    gemm_gflops: float = 0.0
    """This machine's GEMM rate for the dtype, measured in the same run."""
    shared_prompt_tokens: int = 0
    """Prompt tokens a pass of the workload took from the prefix cache instead of computing."""

    @property
    def gemm_fraction(self) -> float:
        return self.gflops / self.gemm_gflops if self.gemm_gflops else 0.0


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return 1000 * s[min(len(s) - 1, int(q * len(s)))]


def bench_rollout(preset: str = "small", dtypes: Sequence[str] = ("float32", "bfloat16"), num_seqs: int = 256,
                  max_num_seqs: int = 64, mean_len: float = 48, max_len: int = 256, reps: int = 3,
                  vs_transformers: bool = False, group: int = 1, prompt_len: int = 0,
                  progress: Callable[[str], None] | None = None,
                  device: str = "cpu", stopped: list[str] | None = None) -> tuple[list[RolloutRow], dict]:
    """Engine output tokens/s, aligned vs standard (interleaved), optionally vs HF generate().
    Interrupted (Ctrl-C, or SIGTERM under `term_as_interrupt`) with a `stopped` list, it reports
    the rounds every system finished (none: that dtype is left out) and says so there."""
    cfg = ModelConfig.preset(preset)
    work = RolloutWorkload.make(num_seqs, cfg.vocab_size, mean_len, max_len, group=group,
                                prompt_len=prompt_len)
    rows: list[RolloutRow] = []
    ratios: dict = {}
    for dtype_name in dtypes:
        dtype = dtype_from_name(dtype_name)
        base = Model(cfg, kernels=BACKENDS[0], dtype=dtype, seed=0, device=device)
        models = {k: base if k == BACKENDS[0] else base.twin(k) for k in BACKENDS}
        systems = list(models)
        with tempfile.TemporaryDirectory() as tmp:
            hf = None
            if vs_transformers:
                models["aligned"].save_pretrained(tmp)
                hf = _load_transformers(tmp, dtype)
                systems.append("transformers")
            times: dict[str, list[float]] = {k: [] for k in systems}
            steps: dict[str, list[float]] = {k: [] for k in systems}
            shared: dict[str, int] = {}
            engines = {k: Engine(models[k], max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
                       for k in models}
            if group > 1:  # (the same aligned model, every prompt block computed by each request)
                engines[NO_PREFIX] = Engine(models["aligned"], max_num_seqs=max_num_seqs,
                                            max_num_batched_tokens=2048, prefix_caching=False)
                systems.append(NO_PREFIX)
                times[NO_PREFIX], steps[NO_PREFIX] = [], []
            try:
                for r in range(reps + 1):  # round 0 warms up; systems take turns in every round,
                    for k in (systems if r % 2 == 0 else systems[::-1]):  # reversed every other one
                        if progress:
                            progress(f"rollout {dtype_name} {k} round {r}/{reps}")
                        if k == "transformers":
                            elapsed, step_times = _run_transformers(hf, work, max_num_seqs), []
                        else:
                            before = engines[k].scheduler.shared_tokens
                            elapsed, step_times = _run_engine(engines[k], work)
                            shared[k] = engines[k].scheduler.shared_tokens - before
                        if r > 0:
                            times[k].append(elapsed)
                            steps[k] += step_times
            except KeyboardInterrupt:
                if stopped is None:
                    raise
                done = min(len(v) for v in times.values())
                stopped.append(f"interrupted: {dtype_name} after {done} of {reps} timed rounds")
                if not done:
                    break
                for k in systems:  # the rounds every system finished, so the ratio stays paired
                    times[k] = times[k][:done]
        med = {k: statistics.median(v) for k, v in times.items()}
        if progress:
            progress(f"rollout {dtype_name} GEMM rate")
        gemm = hardware.gemm_rate(dtype, device=device)
        flops = work.forward_flops(cfg)
        for k in systems:
            name = k if k == "transformers" else f"parity-{k}"
            pct = [_pct(steps[k], q) if steps[k] else None for q in (0.5, 0.9, 0.99)]
            rows.append(RolloutRow(name, dtype_name, work.output_tokens, work.output_tokens / med[k], *pct,
                                   flops / med[k] / 1e9, gemm, shared.get(k, 0)))
        ratios[f"{dtype_name}/aligned_over_standard"] = med["standard"] / med["aligned"]
        if vs_transformers:
            ratios[f"{dtype_name}/aligned_over_transformers"] = med["transformers"] / med["aligned"]
        if group > 1:
            ratios[f"{dtype_name}/prefix_caching_speedup"] = med[NO_PREFIX] / med["aligned"]
        if stopped:
            break
    if not stopped:
        gemm_rate_again(rows, device)  # (the rate once more after every dtype's rounds: the larger)
    return rows, ratios


def main(args) -> int:
    """`parity bench rollout`."""
    limit = ModelConfig.preset(args.preset).max_position_embeddings
    if not args.mean_len >= 1:
        raise ParityError("--mean-len must be at least 1")
    if args.group_size < 1 or args.prompt_len < 0 or args.prompt_len == 1:
        raise ParityError(f"--group-size must be at least 1 and --prompt-len 0 or at least 2, got "
                          f"{args.group_size} and {args.prompt_len}")
    prompt = args.prompt_len or 64
    if args.max_len + prompt > limit:
        raise ParityError(f"--max-len {args.max_len} plus {prompt} prompt tokens exceeds preset "
                          f"{args.preset}'s max_position_embeddings={limit}")
    for name in args.dtypes:
        dtype_from_name(name, "--dtypes")
    if args.vs_transformers:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise ParityError("--vs-transformers needs the transformers package "
                              "(pip install transformers)") from None
    device = str(hardware.check_device(args.device, "--device"))
    stopped: list[str] = []
    with term_as_interrupt():  # a time limit's SIGTERM: report the rounds done so far
        rows, ratios = bench_rollout(args.preset, args.dtypes, args.num_seqs, args.max_num_seqs,
                                     args.mean_len, args.max_len, args.reps, args.vs_transformers,
                                     args.group_size, args.prompt_len,
                                     progress=lambda m: status(f"bench rollout: {m}"), device=device,
                                     stopped=stopped)
    status("")
    if args.json:
        print(json.dumps({"machine": hardware.describe(),
                          "threads": torch.get_num_threads(), "aligned_kernels": describe_aligned(device),
                          "rows": [{**asdict(r), "gemm_fraction": r.gemm_fraction} for r in rows],
                          "ratios": ratios, "stopped": stopped}, indent=2))
        return exit_status(stopped)
    prompts = f"prompts of {args.prompt_len} tokens" if args.prompt_len else "prompts of 16-64 tokens"
    prompts += f" each asked {args.group_size} times" if args.group_size > 1 else ""
    print(f"parity bench rollout: {args.preset}, {args.num_seqs} requests, {prompts}, geometric response "
          f"lengths (mean {args.mean_len}, max {args.max_len}), max_num_seqs {args.max_num_seqs}, "
          f"medians of {args.reps} rounds")

    def ms(v):
        return "-" if v is None else f"{v:.1f}"

    print(f"machine: {hardware.line()}")
    print(f"aligned kernels: {describe_aligned(device)}")
    print(table(["system", "dtype", "output tokens", "tok/s", "step p50 ms", "p90", "p99", "GFLOP/s",
                 "of GEMM rate"],
                [[r.system, r.dtype, str(r.output_tokens), f"{r.tok_s:,.0f}", ms(r.step_ms_p50),
                  ms(r.step_ms_p90), ms(r.step_ms_p99), f"{r.gflops:,.1f}", f"{r.gemm_fraction:.0%}"]
                 for r in rows]))
    print(gemm_line(rows) + "; GFLOP/s counts the forwards the engine runs (the LM head where it samples"
          + ("; a group's shared prompt blocks as if computed)" if args.group_size > 1 else ")"))
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    if note := busy_note():
        print(note)
    for why in stopped:
        print(why)
    return exit_status(stopped)
