"""`parity bench kernels`: whole-model prefill and decode throughput, aligned vs standard.

Both backends run on the same weights in one process, repetitions interleaved (A B A B ...), and
the medians are compared, so machine drift hits both sides alike. Prefill: a batch of sequences
scored by one dense forward (`sequence_logprobs`-style, tokens/s counts every input token).
Decode: the batch prefilled into a paged KV cache, then one-token steps for every sequence
(tokens/s counts generated tokens).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from .model import Decoder, ForwardBatch, Model, ModelConfig


@dataclass
class BenchRow:
    preset: str
    dtype: str
    phase: str  # "prefill" or "decode"
    batch: int
    aligned_tok_s: float
    standard_tok_s: float

    @property
    def ratio(self) -> float:
        return self.aligned_tok_s / self.standard_tok_s

    def as_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio}


def _prefill_fn(model: Model, batch: int, length: int, vocab: int) -> tuple[Callable[[], None], int]:
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (length,), generator=gen) for _ in range(batch)]
    fb = ForwardBatch.build(seqs, [0] * batch, model.block_size)
    targets = torch.cat([s[1:] for s in seqs])
    rows = torch.cat([torch.arange(length - 1) + b * length for b in range(batch)])

    def run() -> None:
        with torch.no_grad():
            hidden = model(fb)
            model.token_logprobs(hidden[rows], targets)

    return run, batch * length


def _decode_fn(model: Model, batch: int, prompt: int, steps: int, vocab: int):
    gen = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(0, vocab, (prompt,), generator=gen) for b in range(batch)}
    nxt = torch.randint(0, vocab, (steps, batch), generator=gen)

    def run() -> float:
        dec = Decoder(model, max_tokens=batch * (prompt + steps + 2 * model.block_size))
        dec.extend(prompts)
        start = time.perf_counter()
        for s in range(steps):
            logits = dec.extend({b: nxt[s, b:b + 1] for b in range(batch)})
            model.kernels.token_logprobs(torch.stack(list(logits.values())), nxt[s], 1.0)
        return time.perf_counter() - start

    return run, batch * steps


def _interleaved(fns: dict[str, Callable], reps: int, timed_inside: bool) -> dict[str, float]:
    """Median seconds per call of each function, called in turn `reps` times after a warm-up."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            inner = fn()
            times[k].append(inner if timed_inside else time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_kernels(presets: Sequence[str] = ("tiny", "small"), dtypes: Sequence[str] = ("float32", "bfloat16"),
                  batches: Sequence[int] = (1, 8, 64, 256), prefill_len: int = 64, decode_prompt: int = 32,
                  decode_steps: int = 16, reps: int = 5,
                  progress: Callable[[str], None] | None = None) -> list[BenchRow]:
    rows: list[BenchRow] = []
    for preset in presets:
        cfg = ModelConfig.preset(preset)
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            models = {k: Model(cfg, kernels=k, dtype=dtype, seed=0) for k in ("aligned", "standard")}
            for batch in batches:
                if progress:
                    progress(f"{preset} {dtype_name} batch {batch}")
                fns, ntok = {}, 0
                for k, m in models.items():
                    fns[k], ntok = _prefill_fn(m, batch, prefill_len, cfg.vocab_size)
                med = _interleaved(fns, reps, timed_inside=False)
                rows.append(BenchRow(preset, dtype_name, "prefill", batch,
                                     ntok / med["aligned"], ntok / med["standard"]))
                for k, m in models.items():
                    fns[k], ntok = _decode_fn(m, batch, decode_prompt, decode_steps, cfg.vocab_size)
                med = _interleaved(fns, reps, timed_inside=True)
                rows.append(BenchRow(preset, dtype_name, "decode", batch,
                                     ntok / med["aligned"], ntok / med["standard"]))
    return rows


# ----------------------------------------------------------------------------- rollout
@dataclass
class RolloutWorkload:
    """Prompts and per-request response lengths with a long tail (geometric lengths)."""

    prompts: list[list[int]]
    lengths: list[int]

    @staticmethod
    def make(n: int, vocab: int, mean_len: float = 48, max_len: int = 256, seed: int = 0) -> RolloutWorkload:
        import random

        from .envs.lengths import geometric_lengths

        rnd = random.Random(seed)
        prompts = [[rnd.randrange(vocab) for _ in range(rnd.randint(16, 64))] for _ in range(n)]
        return RolloutWorkload(prompts, geometric_lengths(rnd, n, mean_len, max_len))

    @property
    def output_tokens(self) -> int:
        return sum(self.lengths)


def _run_engine(model, work: RolloutWorkload, max_num_seqs: int) -> tuple[float, list[float]]:
    from .engine import Engine, SamplingParams

    eng = Engine(model, max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
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


@dataclass
class RolloutRow:
    system: str
    dtype: str
    output_tokens: int
    tok_s: float
    step_ms_p50: float | None
    step_ms_p90: float | None
    step_ms_p99: float | None


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return 1000 * s[min(len(s) - 1, int(q * len(s)))]


def bench_rollout(preset: str = "small", dtypes: Sequence[str] = ("float32", "bfloat16"), num_seqs: int = 256,
                  max_num_seqs: int = 64, mean_len: float = 48, max_len: int = 256, reps: int = 3,
                  vs_transformers: bool = False,
                  progress: Callable[[str], None] | None = None) -> tuple[list[RolloutRow], dict]:
    """Engine output tokens/s, aligned vs standard (interleaved), optionally vs HF generate()."""
    import tempfile

    cfg = ModelConfig.preset(preset)
    work = RolloutWorkload.make(num_seqs, cfg.vocab_size, mean_len, max_len)
    rows: list[RolloutRow] = []
    ratios: dict = {}
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        models = {k: Model(cfg, kernels=k, dtype=dtype, seed=0) for k in ("aligned", "standard")}
        systems = list(models)
        with tempfile.TemporaryDirectory() as tmp:
            hf = None
            if vs_transformers:
                models["aligned"].save_pretrained(tmp)
                hf = _load_transformers(tmp, dtype)
                systems.append("transformers")
            times: dict[str, list[float]] = {k: [] for k in systems}
            steps: dict[str, list[float]] = {k: [] for k in systems}
            for r in range(reps + 1):  # round 0 warms up; systems take turns in every round
                for k in systems:
                    if progress:
                        progress(f"rollout {dtype_name} {k} round {r}/{reps}")
                    if k == "transformers":
                        elapsed, step_times = _run_transformers(hf, work, max_num_seqs), []
                    else:
                        elapsed, step_times = _run_engine(models[k], work, max_num_seqs)
                    if r > 0:
                        times[k].append(elapsed)
                        steps[k] += step_times
        med = {k: statistics.median(v) for k, v in times.items()}
        for k in systems:
            name = k if k == "transformers" else f"parity-{k}"
            pct = [_pct(steps[k], q) if steps[k] else None for q in (0.5, 0.9, 0.99)]
            rows.append(RolloutRow(name, dtype_name, work.output_tokens, work.output_tokens / med[k], *pct))
        ratios[f"{dtype_name}/aligned_over_standard"] = med["standard"] / med["aligned"]
        if vs_transformers:
            ratios[f"{dtype_name}/aligned_over_transformers"] = med["transformers"] / med["aligned"]
    return rows, ratios


# ----------------------------------------------------------------------------- async
@dataclass
class AsyncRow:
    mode: str
    max_policy_lag: int
    steps: int
    steps_per_hour: float
    learner_wait_frac: float
    rollout_wait_frac: float
    observed_lag_max: float


def bench_async(preset: str = "small", steps: int = 12, lags: Sequence[int] = (8, 64), prompts: int = 8,
                group: int = 4, max_tokens: int = 128, reps: int = 1, dtype: str = "float32",
                progress: Callable[[str], None] | None = None) -> tuple[list[AsyncRow], dict]:
    """Train the same task and model for `steps` updates synchronously (lag 0) and
    asynchronously (each lag in `lags`) on long-tail response lengths; modes take turns per
    repetition. Steady-state throughput excludes the first step (process start-up)."""
    import tempfile

    from .config import load_config
    from .rl.controller import Controller

    modes = [0, *lags]
    per_mode: dict[int, list[tuple[float, float, float, float]]] = {m: [] for m in modes}
    for r in range(reps):
        for lag in modes:
            if progress:
                progress(f"async bench: lag {lag}, repetition {r + 1}/{reps}")
            with tempfile.TemporaryDirectory() as tmp:
                cfg = load_config(None, [
                    f"steps={steps}", f"max_policy_lag={lag}", f"run_dir=\"{tmp}\"",
                    f"model.preset=\"{preset}\"", f"model.dtype=\"{dtype}\"",
                    f"rollout.prompts_per_step={prompts}", f"rollout.group_size={group}",
                    f"rollout.max_tokens={max_tokens}", "rollout.lengths=\"geometric\"",
                    "learner.micro_batch_size=8", "eval_every=0"])
                metrics = Controller(cfg).run()
            steady = metrics[-1]["time/wall_s"] - metrics[0]["time/wall_s"]
            rest = metrics[1:]
            per_mode[lag].append((3600 * len(rest) / steady,
                                  sum(m["time/wait_s"] for m in rest) / steady,
                                  sum(m["time/rollout_wait_s"] for m in rest) / steady,
                                  max(m["lag/max"] for m in metrics)))
    rows = []
    for lag in modes:
        vals = per_mode[lag]
        rows.append(AsyncRow("sync" if lag == 0 else "async", lag, steps,
                             statistics.median(v[0] for v in vals), statistics.median(v[1] for v in vals),
                             statistics.median(v[2] for v in vals), max(v[3] for v in vals)))
    sync = rows[0].steps_per_hour
    ratios = {f"async_lag{r.max_policy_lag}_over_sync": r.steps_per_hour / sync for r in rows[1:]}
    return rows, ratios
