"""`parity bench learner-memory`: what the learner's memory options buy and cost.

One learner step (forward + backward of the mean log-prob of B sequences of L tokens, with the
entropies the learner logs) per setting: plain (the whole micro-batch's logits at once, every
activation kept), `head chunks` (`learner.head_chunk_tokens`), `checkpointing`
(`learner.activation_checkpointing`) and both.
Each setting runs in a fresh process (its peak memory is its own): the model is built and run
once on a few tokens, the peak resident set is reset (`/proc/self/clear_refs`; on a GPU the
allocator's peak), then one step at full size (the shapes' first-use probes, not timed) and
`reps` timed ones; the peak above the memory held before them is the step's working memory, the
median step gives tokens/s, both compared with the plain setting's.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from .. import hardware
from ..errors import ParityError
from .ui import fresh_process, status, table

SETTINGS = {"plain": (False, False), "head chunks": (True, False), "checkpointing": (False, True),
            "both": (True, True)}
"""Setting name -> (LM head in chunks, activation checkpointing)."""


@dataclass
class MemoryOptionRow:
    setting: str
    head_chunk: int
    checkpointing: bool
    step_gib: float
    """Peak memory of the steps above what was held before them."""
    tok_s: float
    held_gib: float
    """Memory held before the step: weights, caches."""


def _rss_gib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20
    raise ParityError(f"bench learner-memory: no {field} in /proc/self/status")


def _one(preset: str, dtype: str, kernels: str, batch: int, length: int, chunk: int, recompute: bool,
         device: str, reps: int) -> dict:
    """One measurement in this process."""
    import torch

    from ..dtypes import dtype_from_name
    from ..model import Model, ModelConfig, sequence_logprobs

    cfg = ModelConfig.preset(preset)
    model = Model(cfg, kernels=kernels, dtype=dtype_from_name(dtype), seed=0, device=device)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, cfg.vocab_size, (length,), generator=gen) for _ in range(batch)]

    def step(seqs) -> None:
        lps, _ = sequence_logprobs(model, seqs, return_entropy=True, head_chunk=chunk, recompute=recompute)
        (-torch.cat(lps).mean()).backward()
        model.zero_grad(set_to_none=True)
        hardware.sync(model.device)

    step([s[:8] for s in seqs[:2]])  # first-use probes, the gradient buffers' first allocation
    gpu = model.device.type == "cuda"
    if gpu:
        torch.cuda.reset_peak_memory_stats(model.device)
        held = torch.cuda.memory_allocated(model.device) / 2**30
    else:
        with open("/proc/self/clear_refs", "w") as f:  # the peak resident set starts again from here
            f.write("5")
        held = _rss_gib("VmRSS")
    times = []
    for _ in range(reps + 1):  # the first at full size meets the shapes' first-use probes: not timed
        t0 = time.perf_counter()
        step(seqs)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(model.device) / 2**30 if gpu else _rss_gib("VmHWM")
    return {"step_gib": peak - held, "held_gib": held, "tok_s": batch * length / statistics.median(times[1:])}


def bench_learner_memory(preset: str = "qwen3-0.6b", dtype: str = "bfloat16", kernels: str = "aligned",
                         batch: int = 1, length: int = 2048, head_chunk: int = 0, reps: int = 1,
                         device: str = "cpu",
                         progress: Callable[[str], None] | None = None) -> list[MemoryOptionRow]:
    from ..config import LearnerConfig
    from ..model import ModelConfig

    cfg = ModelConfig.preset(preset)  # (an unknown preset: one line)
    if not 2 <= length <= cfg.max_position_embeddings:
        raise ParityError(f"--length must be in [2, {cfg.max_position_embeddings}] for {preset}: {length}")
    if head_chunk < 0:
        raise ParityError("--head-chunk must be >= 0 (0: the learner's default for the vocabulary)")
    head_chunk = LearnerConfig(head_chunk_tokens=head_chunk).head_rows(cfg.vocab_size)
    rows = []
    for name, (chunked, recompute) in SETTINGS.items():
        if progress:
            progress(f"learner-memory {preset} {dtype} {name} ({reps + 1} steps)")
        chunk = head_chunk if chunked and head_chunk < batch * (length - 1) else 0  # (else: no chunks)
        argv = [json.dumps([preset, dtype, kernels, batch, length, chunk, recompute, device, reps])]
        got = fresh_process("parity.apps.bench_learner_memory", argv,
                            f"bench learner-memory: the '{name}' setting")
        rows.append(MemoryOptionRow(name, chunk, recompute, got["step_gib"], got["tok_s"], got["held_gib"]))
    return rows


def main(args) -> int:
    """`parity bench learner-memory`."""
    if args.batch < 1 or args.reps < 1:
        raise ParityError("--batch and --reps must be >= 1")
    from ..model import ModelConfig

    ModelConfig.preset(args.preset)  # (each before a child process starts: it named `device=` and
    device = str(hardware.check_device(args.device, "--device"))  # a module path)
    rows = bench_learner_memory(args.preset, args.dtype, args.kernels, args.batch, args.length,
                                args.head_chunk, args.reps, device,
                                progress=lambda m: status(f"bench {m}"))
    status("")
    if args.json:
        print(json.dumps({"machine": hardware.describe(), "preset": args.preset, "dtype": args.dtype,
                          "kernels": args.kernels, "batch": args.batch, "length": args.length,
                          "rows": [asdict(r) for r in rows]}, indent=2))
        return 0
    plain = rows[0]
    print(f"parity bench learner-memory: {args.preset} in {args.dtype}, {args.kernels} kernels, one "
          f"learner step on {args.batch} x {args.length} tokens, each setting in a fresh process, "
          f"median of {args.reps} step(s) after one untimed")
    print(f"machine: {hardware.line()}")
    print(table(["setting", "head chunk", "checkpointing", "step memory GiB", "vs plain", "tokens/s",
                 "vs plain", "held before GiB", "peak GiB"],
                [[r.setting, str(r.head_chunk or "-"), "yes" if r.checkpointing else "no",
                  f"{r.step_gib:.2f}",
                  f"x{r.step_gib / plain.step_gib:.2f}" if plain.step_gib > 0 else "-", f"{r.tok_s:,.0f}",
                  f"x{r.tok_s / plain.tok_s:.2f}", f"{r.held_gib:.2f}", f"{r.held_gib + r.step_gib:.2f}"]
                 for r in rows]))
    return 0


if __name__ == "__main__":  # one measurement, in its own process
    from .ui import setup_logging

    setup_logging()
    print(json.dumps(_one(*json.loads(sys.argv[1]))))
