"""`parity bench kernels`: whole-model prefill and decode throughput, aligned vs standard.

Both backends run on the same weights in one process, repetitions interleaved (A B, B A, ...), and
the medians are compared, so machine drift hits both sides alike. Prefill: a batch of sequences
scored by one dense forward (`sequence_logprobs`-style, tokens/s counts every input token).
Decode: the batch prefilled into a paged KV cache, then one-token steps for every sequence
(tokens/s counts generated tokens), replayed from CUDA graphs on a GPU as the engine runs them
(`engine/graphs.py`; `--eager-decode` adds rows 'decode-eager' timed without graphs). Each row
also gives the aligned side's achieved GFLOP/s (`ModelConfig.forward_flops_per_token`) and its
fraction of this machine's GEMM rate for the dtype, measured in the same run (`hardware.gemm_rate`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from .. import hardware
from ..dtypes import dtype_from_name
from ..engine import Decoder
from ..engine.memory import available_memory
from ..errors import ParityError
from ..model import DEFAULT_BLOCK_SIZE, ForwardBatch, KVCache, Model, ModelConfig
from ..ops import BACKENDS, describe_aligned
from .timing import busy_note, gemm_rate_again, interleaved
from .ui import RateRow, collect, exit_status, gemm_line, status, table, term_as_interrupt


@dataclass
class BenchRow(RateRow):
    preset: str
    dtype: str
    phase: str  # "prefill", "decode" or "decode-eager" (a GPU's decode without CUDA graphs)
    batch: int
    aligned_tok_s: float
    standard_tok_s: float
    flops_per_token: float = 0.0
    gemm_gflops: float = 0.0
    """This machine's GEMM rate for the dtype, measured in the same run."""
    steps: str = ""
    """How decode steps ran: 'cuda graphs', 'eager', or 'eager (capture failed: ...)' (per
    backend when the two differ); empty for prefill."""

    def as_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "aligned_gflops": self.aligned_gflops,
                "gemm_fraction": self.gemm_fraction}


def _prefill_fn(model: Model, batch: int, length: int, vocab: int) -> tuple[Callable[[], None], int]:
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (length,), generator=gen) for _ in range(batch)]
    dev = model.device
    fb = ForwardBatch.build(seqs, [0] * batch, model.block_size).to(dev)
    targets = torch.cat([s[1:] for s in seqs]).to(dev)
    rows = torch.cat([torch.arange(length - 1) + b * length for b in range(batch)]).to(dev)

    def run() -> None:
        with torch.no_grad():
            hidden = model(fb)
            model.token_logprobs(hidden[rows], targets)
        hardware.sync(dev)

    return run, batch * length


def _decode_fn(model: Model, batch: int, prompt: int, steps: int, vocab: int, graphs: str = "auto"):
    gen = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(0, vocab, (prompt,), generator=gen) for b in range(batch)}
    nxt = torch.randint(0, vocab, (steps, batch), generator=gen)
    nxt_dev = nxt.to(model.device)

    # one Decoder for every repetition (its sequences released after each), so decode graphs are
    # captured in the warm-up call and replayed in the timed ones, as in a long-lived engine
    dec = Decoder(model, max_tokens=batch * (prompt + steps + 2 * model.block_size), graphs=graphs)

    def run() -> float:
        dec.extend(prompts)
        hardware.sync(model.device)
        start = time.perf_counter()
        for s in range(steps):
            logits = dec.extend({b: nxt[s, b:b + 1] for b in range(batch)})
            model.kernels.token_logprobs(torch.stack(list(logits.values())), nxt_dev[s], 1.0)
        hardware.sync(model.device)
        elapsed = time.perf_counter() - start
        for b in range(batch):
            dec.release(b)
        return elapsed

    run.decoder = dec  # type: ignore[attr-defined]
    return run, batch * steps


def _steps(decoder: Decoder) -> str:
    """How a decoder's decode steps ran (after they ran)."""
    graphs = decoder.runner.graphs
    if graphs is None or graphs.mode != "cuda":
        return "eager"
    if graphs.failed:
        return f"eager (capture failed: {graphs.failed})"
    return "cuda graphs" if graphs.replays else "eager"


def bench_kernels(presets: Sequence[str] = ("tiny", "small"), dtypes: Sequence[str] = ("float32", "bfloat16"),
                  batches: Sequence[int] = (1, 8, 64, 256), prefill_len: int = 64, decode_prompt: int = 32,
                  decode_steps: int = 16, reps: int = 5,
                  progress: Callable[[str], None] | None = None, device: str = "cpu",
                  eager_decode: bool = False, stopped: list[str] | None = None) -> list[BenchRow]:
    """One row per preset, dtype, phase and batch. Interrupted (Ctrl-C, or SIGTERM under
    `term_as_interrupt`) with a `stopped` list, it returns the rows finished so far and says so there.
    Each dtype's GEMM rate is measured before its rows and again after all of them (`gemm_rate_again`)."""
    rows = collect(_rows(presets, dtypes, batches, prefill_len, decode_prompt, decode_steps, reps, progress,
                         device, eager_decode), stopped)
    if not stopped:
        gemm_rate_again(rows, device)
    return rows


def _rows(presets, dtypes, batches, prefill_len, decode_prompt, decode_steps, reps, progress, device,
          eager_decode):
    for preset in presets:
        cfg = ModelConfig.preset(preset)
        for dtype_name in dtypes:
            dtype = dtype_from_name(dtype_name)
            base = Model(cfg, kernels=BACKENDS[0], dtype=dtype, seed=0, device=device)
            models = {k: base if k == BACKENDS[0] else base.twin(k) for k in BACKENDS}
            if progress:
                progress(f"{dtype_name} GEMM rate")
            gemm = hardware.gemm_rate(dtype, device=device)
            prefill_flops = cfg.forward_flops_per_token((prefill_len - 1) / 2)
            prefill_flops -= cfg.head_flops_per_token / prefill_len  # (the last position is not scored)
            decode_flops = cfg.forward_flops_per_token(decode_prompt + decode_steps / 2)
            for batch in batches:
                if progress:
                    progress(f"{preset} {dtype_name} batch {batch}")
                fns, ntok = {}, 0
                for k, m in models.items():
                    fns[k], ntok = _prefill_fn(m, batch, prefill_len, cfg.vocab_size)
                med = interleaved(fns, reps, timed_inside=False)
                yield BenchRow(preset, dtype_name, "prefill", batch, ntok / med["aligned"],
                               ntok / med["standard"], prefill_flops, gemm)
                modes = [("decode", "auto")]
                if eager_decode and torch.device(device).type == "cuda":
                    modes.append(("decode-eager", "off"))
                for phase, graphs in modes:
                    for k, m in models.items():
                        fns[k], ntok = _decode_fn(m, batch, decode_prompt, decode_steps, cfg.vocab_size,
                                                  graphs)
                    med = interleaved(fns, reps, timed_inside=True)
                    how = {k: _steps(fn.decoder) for k, fn in fns.items()}
                    steps_text = how["aligned"] if len(set(how.values())) == 1 else \
                        "; ".join(f"{k}: {v}" for k, v in how.items())
                    yield BenchRow(preset, dtype_name, phase, batch, ntok / med["aligned"],
                                   ntok / med["standard"], decode_flops, gemm, steps_text)


def memory_floor(cfg: ModelConfig, dtype: torch.dtype, batch: int, prefill_len: int, decode_steps: int,
                 decode_prompt: int = 32, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes a batch's rows hold at least at once: both backends' decode KV caches (as the
    Decoders allocate them), and the prefill's MLP activations and the standard backend's float32
    logits over the vocabulary with their log-softmax."""
    item = torch.empty((), dtype=dtype).element_size()
    kv = 2 * KVCache.bytes_per_token(cfg, dtype) * batch * (decode_prompt + decode_steps + 2 * block_size)
    rows = batch * prefill_len
    return kv + rows * 2 * cfg.intermediate_size * item + 2 * rows * cfg.vocab_size * 4


def main(args) -> int:
    """`parity bench kernels`."""
    for p in args.presets:
        limit = ModelConfig.preset(p).max_position_embeddings
        if args.prefill_len > limit or 32 + args.decode_steps > limit:
            raise ParityError(f"--prefill-len / --decode-steps exceed preset {p}'s "
                              f"max_position_embeddings={limit}")
    if not args.batches or any(b <= 0 for b in args.batches):
        raise ParityError("--batches must be positive integers")
    for name in args.dtypes:
        dtype_from_name(name, "--dtypes")
    device = str(hardware.check_device(args.device, "--device"))
    if args.eager_decode and torch.device(device).type == "cpu":  # (said, not refused: the GPU
        print("parity: warning: --eager-decode: decode on a CPU is eager already (CUDA graphs are a "
              "GPU's), so there are no 'decode-eager' rows", file=sys.stderr)  # script's dry run passes it)
    if torch.device(device).type == "cpu":  # a refusal now, not the kernel's OOM kill mid-run
        free = available_memory()
        for p, name in ((p, n) for p in args.presets for n in args.dtypes):
            need = memory_floor(ModelConfig.preset(p), dtype_from_name(name), max(args.batches),
                                args.prefill_len, args.decode_steps)
            if need > free:
                raise ParityError(f"--batches {max(args.batches)}: the {p} {name} rows need at least "
                                  f"{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB is available")
    if args.gemm_tiles:
        from .bench_gemm import apply_tiles
        status(f"GEMM tiles: {apply_tiles(args.gemm_tiles)} weight shapes from {args.gemm_tiles}")
    stopped: list[str] = []
    with term_as_interrupt():  # a time limit's SIGTERM: report the rows done so far
        rows = bench_kernels(presets=args.presets, dtypes=args.dtypes, batches=args.batches,
                             prefill_len=args.prefill_len, decode_steps=args.decode_steps, reps=args.reps,
                             progress=lambda m: status(f"bench kernels: {m}"), device=device,
                             eager_decode=args.eager_decode, stopped=stopped)
    status("")
    if args.json:
        print(json.dumps({"machine": hardware.describe(),
                          "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "aligned_kernels": describe_aligned(args.device),
                          "rows": [r.as_dict() for r in rows], "stopped": stopped}, indent=2))
        return exit_status(stopped)
    print(f"parity bench kernels: medians of {args.reps} interleaved repetitions, "
          f"{torch.get_num_threads()} threads; prefill {args.prefill_len} tokens/seq, "
          f"decode {args.decode_steps} steps")
    print(f"machine: {hardware.line()}")
    print(f"aligned kernels: {describe_aligned(args.device)}")
    print(table(["preset", "dtype", "phase", "batch", "aligned tok/s", "standard tok/s", "aligned/standard",
                 "aligned GFLOP/s", "of GEMM rate", "decode steps"],
                [[r.preset, r.dtype, r.phase, str(r.batch), f"{r.aligned_tok_s:,.0f}",
                  f"{r.standard_tok_s:,.0f}", f"{r.ratio:.3f}", f"{r.aligned_gflops:,.1f}",
                  f"{r.gemm_fraction:.0%}", r.steps] for r in rows]))
    print(gemm_line(rows))
    if note := busy_note():
        print(note)
    for why in stopped:
        print(f"{why}: the rows not listed were not measured")
    return exit_status(stopped)
