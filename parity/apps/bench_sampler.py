"""`parity bench sampler`: one sampling step's time per noise path, side by side in one run.

The engine samples every request of a step from its own row of logits (Gumbel-max, its own
noise). Paths timed on the same logits, repetitions interleaved, medians compared:
- `generator`: each request's CPU generator (a CPU's default; on a GPU the logits' log-probs
  go to the host for it);
- `counter`: counter-based noise in PyTorch ops where the logits are (`engine/draws.py`);
- `fused`: the same noise and tokens in one Triton pass (`engine/draws_triton.py`; the sampler's
  path on a GPU). On a CPU it would run in Triton's interpreter, so it is timed on a GPU only.
Every path is checked to pick the same tokens as `counter` for the same draws (`generator`
draws other noise, so it is not compared). Times include the recorded log-probs' transfer to
the host, as the engine's step does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass
from functools import partial

import torch

from .. import hardware
from ..dtypes import dtype_from_name
from ..engine.sampler import Sampler
from ..engine.sequence import SamplingParams, Sequence
from ..errors import ParityError
from ..model import ModelConfig
from ..ops import get_kernels
from .timing import busy_note, interleaved
from .ui import collect, exit_status, status, table, term_as_interrupt


@dataclass
class SamplerRow:
    batch: int
    vocab: int
    ms: dict[str, float]
    """Median milliseconds of one sampling step per path."""
    same_tokens: bool | None
    """Whether the fused path picked the counter path's tokens at every call both made (None: not
    timed)."""


class _Model:
    """What the sampler reads from a model: its kernels."""

    def __init__(self, device: torch.device):
        self.kernels = get_kernels("aligned", device)


def _paths(device: torch.device) -> list[str]:
    return ["generator", "counter", "fused"] if device.type == "cuda" else ["generator", "counter"]


def _sample(picked: list, sampler: Sampler, seqs: list[Sequence], logits: torch.Tensor, device) -> None:
    """One timed sampling step (its tokens reach the host, as in the engine); the tokens kept."""
    hardware.sync(device)
    picked.append([t for t, _, _ in sampler.sample(seqs, logits)])


def bench_sampler(vocab: int, batches: Seq[int], dtype: torch.dtype, reps: int, device: torch.device,
                  progress=None) -> Iterator[SamplerRow]:
    """One row per batch, yielded as measured (an interrupt keeps the rows so far)."""
    model = _Model(device)
    gen = torch.Generator().manual_seed(0)
    for batch in batches:
        logits = (4 * torch.randn(batch, vocab, generator=gen)).to(dtype).to(device)
        samplers = {p: Sampler(model, seed=1, draws="generator" if p == "generator" else "counter")
                    for p in _paths(device)}
        if "fused" in samplers:  # `counter` keeps to PyTorch ops on a GPU too
            samplers["counter"]._fused_draws = lambda logp: False  # type: ignore[method-assign]
        seqs = {p: [Sequence(i, [0], SamplingParams(temperature=1.0, seed=i), prompt_len=1)
                    for i in range(batch)] for p in samplers}
        picked: dict[str, list] = {p: [] for p in samplers}  # every call's tokens, per path
        if progress:
            progress(f"sampler batch {batch}")
        sec = interleaved({p: partial(_sample, picked[p], smp, seqs[p], logits, device)
                           for p, smp in samplers.items()}, reps)
        same = None
        if "fused" in samplers:  # the k-th call of each path draws the k-th numbers; the paths make
            n = min(len(picked["fused"]), len(picked["counter"]))  # as many calls as their speed asks
            same = n > 0 and picked["fused"][:n] == picked["counter"][:n]
        yield SamplerRow(batch, vocab, {p: 1e3 * t for p, t in sec.items()}, same)


def main(args) -> int:
    """`parity bench sampler`."""
    dtype = dtype_from_name(args.dtype, "--dtype")
    vocab = args.vocab or ModelConfig.preset(args.preset).vocab_size
    if vocab < 2:
        raise ParityError(f"--vocab must be at least 2, got {vocab}")
    if min(args.batches) < 1:
        raise ParityError(f"--batches must be at least 1, got {min(args.batches)}")
    device = hardware.check_device(args.device, "--device")
    stopped: list[str] = []
    with term_as_interrupt():  # a time limit's SIGTERM: report the batches done so far
        rows = collect(bench_sampler(vocab, args.batches, dtype, args.reps, device,
                                     progress=lambda m: status(f"bench {m}")),
                       stopped, "batches", len(args.batches))
    status("")
    if args.json:
        print(json.dumps({"machine": hardware.describe(), "device": str(device),
                          "rows": [asdict(r) for r in rows], "stopped": stopped}, indent=2))
        return exit_status(stopped, all(r.same_tokens is not False for r in rows))
    paths = _paths(device)
    print(f"parity bench sampler: one step's Gumbel-max sampling, vocabulary {vocab:,}, {args.dtype} "
          f"logits, medians of {args.reps} interleaved repetitions ({device})")
    print(f"machine: {hardware.line()}")
    ratio = "fused/counter speed-up" if "fused" in paths else "counter/generator speed-up"
    print(table(["batch", *[f"{p} ms" for p in paths], ratio, "same tokens"],
                [[str(r.batch), *[f"{r.ms[p]:.2f}" for p in paths],
                  f"{r.ms['counter'] / r.ms['fused']:.1f}x" if "fused" in paths
                  else f"{r.ms['generator'] / r.ms['counter']:.2f}x",
                  {True: "yes", False: "NO", None: "-"}[r.same_tokens]] for r in rows]))
    if note := busy_note():
        print(note)
    for why in stopped:
        print(f"{why}: the batches not listed were not measured")
    return exit_status(stopped, all(r.same_tokens is not False for r in rows))
