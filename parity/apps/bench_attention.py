"""`parity bench attention`: decode attention over the paged KV cache, per schedule, side by side.

One decode step's attention for one full layer of a preset's shape (its soft-cap and scale, as Gemma
2's, included; every sequence one query, all at the same context length, its pages scattered through
the cache) timed four ways in one run, repetitions interleaved, medians, each over ~20 ms of calls
(replayed from a CUDA graph on a GPU, as the engine's decode steps are, over copies of the cache
that overflow the L2 cache: a decode step reads every layer's keys from memory; `timing.py`): the
aligned Triton kernel's walk (one program per sequence and KV head), its split schedule (one program
per key split, then the merge kernel), what the aligned backend picks by shape (`auto`), and the
standard backend's path (gather the pages, then SDPA). Every row checks that the walk and the split
schedule gave the same bits (`torch.equal`; exit 1 if not). This is the figure that sets where
`triton_attention._schedule` switches on a GPU. On a CPU the Triton kernels run through Triton's
interpreter: a check at small shapes, not a speed.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import partial

import torch

from .. import hardware
from ..dtypes import dtype_from_name
from ..errors import ParityError
from ..model import ModelConfig
from ..ops import standard
from .timing import l2_copies, rotating, seconds_per_call
from .ui import collect, exit_status, status, table, term_as_interrupt

PATHS = ("walk", "split", "auto", "standard")
"""The timed paths, in the order each round calls them."""


@dataclass
class AttentionRow:
    batch: int
    context: int
    ms: dict
    """Median milliseconds of one call per path."""
    auto: str
    """The schedule the aligned backend picks for this shape."""
    same_bits: bool
    eager: list
    """Paths whose CUDA-graph capture failed, timed one eager call after another instead."""


def bench_attention(preset: str, dtype: torch.dtype, batches, contexts, reps: int, device: torch.device,
                    progress=None) -> Iterator[AttentionRow]:
    """One row per batch and context, yielded as measured (an interrupt keeps the rows so far)."""
    from ..ops import triton_attention as ta

    cfg = ModelConfig.preset(preset)
    hq, hkv, d, bs = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 32
    # caches drawn on the device: the grid's (batch 64 x 4K keys and the rest) are 766M
    # normals, 6-12 s for one CPU thread and a blink for a GPU
    gen = torch.Generator(device).manual_seed(0)

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=device).to(dtype)

    for batch in batches:
        for context in contexts:
            pages = -(-context // bs)
            k_cache, v_cache = randn(1 + batch * pages, hkv, d, bs), randn(1 + batch * pages, hkv, bs, d)
            tables = (1 + torch.randperm(batch * pages, generator=gen, device=device)).view(batch, pages)
            q = randn(batch, 1, hq, d)
            q_pos = torch.full((batch, 1), context - 1, device=device)
            args = (q, k_cache, v_cache, tables, q_pos)
            spec = dict(softcap=cfg.attn_logit_softcapping or 0.0, scale=cfg.attention_scale)  # (Gemma 2)
            caches = [(k_cache, v_cache)] + [(k_cache.clone(), v_cache.clone()) for _ in
                                             range(l2_copies(2 * k_cache.numel() * k_cache.element_size(),
                                                             device) - 1)]
            paths = {"walk": partial(ta.paged_attention, schedule="walk", **spec),
                     "split": partial(ta.paged_attention, schedule="split", **spec),
                     "auto": partial(ta.paged_attention, **spec),
                     "standard": partial(standard.paged_attention, **spec)}
            if progress:
                progress(f"attention batch {batch} context {context}")
            walk, split = paths["walk"](*args), paths["split"](*args)  # (the bits check, untimed)
            calls = {p: rotating([partial(f, q, kc, vc, tables, q_pos) for kc, vc in caches])
                     for p, f in paths.items()}
            times: dict[str, list[float]] = {p: [] for p in calls}
            eager: list[str] = []
            for rep in range(reps):  # the order reversed every other round
                for p in (PATHS if rep % 2 == 0 else PATHS[::-1]):
                    try:
                        times[p].append(seconds_per_call(calls[p], device, graphs=p not in eager))
                    except RuntimeError:  # a capture this path does not allow: eager, and said so
                        if p in eager or device.type != "cuda":
                            raise
                        eager.append(p)
                        times[p].append(seconds_per_call(calls[p], device, graphs=False))
            chosen = ta._schedule(batch, hkv, hq // hkv, ta._attention_tiles(d, dtype)[0], pages, d, q.device)
            ms = {p: 1e3 * statistics.median(t) for p, t in times.items()}
            yield AttentionRow(batch, context, ms, chosen, torch.equal(walk, split), eager)
            del caches, calls


def main(args) -> int:
    """`parity bench attention`."""
    dtype = dtype_from_name(args.dtype, "--dtype")
    cfg = ModelConfig.preset(args.preset)
    if min(args.batches) < 1 or min(args.contexts) < 1:
        raise ParityError("--batches and --contexts must be at least 1")
    if max(args.contexts) > cfg.max_position_embeddings:
        raise ParityError(f"--contexts {max(args.contexts)} exceeds preset {args.preset}'s "
                          f"max_position_embeddings ({cfg.max_position_embeddings})")
    device = hardware.check_device(args.device, "--device")
    stopped: list[str] = []
    with term_as_interrupt():  # a time limit's SIGTERM: report the shapes done so far
        rows = collect(bench_attention(args.preset, dtype, args.batches, args.contexts, args.reps, device,
                                       progress=lambda m: status(f"bench {m}")),
                       stopped, "shapes", len(args.batches) * len(args.contexts))
    status("")
    ok = all(r.same_bits for r in rows)
    if args.json:
        print(json.dumps({"machine": hardware.describe(), "device": str(device), "preset": args.preset,
                          "rows": [asdict(r) for r in rows], "stopped": stopped}, indent=2))
        return exit_status(stopped, ok)
    where = "Triton" if device.type == "cuda" else "Triton's interpreter: a check, not a speed"
    print(f"parity bench attention: one layer's decode attention, {args.preset} heads, {args.dtype}, "
          f"medians of {args.reps} interleaved repetitions ({device}; aligned kernels in {where})")
    print(f"machine: {hardware.line()}")
    print(table(["batch", "context", *[f"{p} ms" for p in PATHS], "auto is", "split/walk speed-up",
                 "auto/standard", "walk = split bits"],
                [[str(r.batch), str(r.context), *[f"{r.ms[p]:.3f}" for p in PATHS], r.auto,
                  f"{r.ms['walk'] / r.ms['split']:.2f}x", f"{r.ms['standard'] / r.ms['auto']:.2f}",
                  "yes" if r.same_bits else "NO"] for r in rows]))
    for r in rows:
        if r.eager:
            print(f"batch {r.batch}, context {r.context}: {', '.join(r.eager)} timed eagerly (its CUDA-graph "
                  "capture failed): launch costs included")
    for why in stopped:
        print(f"{why}: the shapes not listed were not measured")
    return exit_status(stopped, ok)
