"""`parity compile`: compile the aligned Triton kernels for a GPU, on a machine without one.

For each preset and dtype it builds a random model on CPU tensors and runs what a training run
launches — the learner's forward (dense attention, log-sum-exp over the vocabulary) at two batch
sizes, the engine's prefill, decode steps and sampling draws at two batch sizes, one decode step
over several key splits (attention's split schedule) — with every Triton launch
compiled for the chosen architecture and launched nowhere (`parity/ops/triton_target.py`). It
prints one row per binary (registers, stack, shared memory, matrix instructions, how it loads:
TMA, cp.async or plain; launches), says whether one binary served every batch size, counts what
one decode step's forward launches
(Triton kernels, other PyTorch kernels, host syncs; the standard backend's too) and what the
Triton launches cost the host here, and lists problems: spills, a bf16/fp16 GEMM or attention
off the tensor cores, a kernel that does not fit or does not compile. Exit 1 when there is one.
It proves compilation and resources, not bits or speed on the GPU (that is `scripts/gpu_check.sh`).
"""

from __future__ import annotations

import json
import re
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..dtypes import dtype_from_name
from ..errors import ConfigError
from ..model import ModelConfig
from ..ops import triton_target
from .ui import status, table

_MATRIX_KERNELS = ("_matmul_kernel", "_matmul_tma_kernel", "_attention_kernel", "_split_partial_kernel")
"""Kernels whose inner loop is a matrix product: in bf16/fp16 it must run on tensor cores."""


class _KernelCounter(TorchDispatchMode):
    """Counts the PyTorch ops that would each launch a GPU kernel (views and bare allocations
    launch none) and the host syncs (a tensor read back as a Python number) while active."""

    _FREE = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                       "detach", "lift_fresh", "alias", "_local_scalar_dense"})

    def __init__(self):
        super().__init__()
        self.kernels = self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.syncs += 1
        elif name not in self._FREE and not func.is_view:
            self.kernels += 1
        return func(*args, **(kwargs or {}))


def _counted(model) -> _KernelCounter:
    """Count the kernels and syncs of `model`'s forward calls from now on (its instance `forward`)."""
    counter, forward = _KernelCounter(), model.forward

    def counting(*args, **kwargs):
        with counter:
            return forward(*args, **kwargs)

    model.forward = counting
    return counter


def _standard_decode(cfg, dtype: torch.dtype, batch: int, length: int) -> dict:
    """The standard backend's decode step at `batch`: PyTorch kernels and host syncs of the model
    forward (the same passes on CPU tensors; no Triton)."""
    from ..engine import Decoder
    from ..model import Model

    model = Model(cfg, kernels="standard", dtype=dtype, seed=None)  # counts need no real weights
    model.check_inputs = False  # (a CPU-only check: syncs a GPU forward does not make)
    gen = torch.Generator().manual_seed(1)
    dec = Decoder(model, max_tokens=batch * (length + 3 * model.block_size))
    with torch.no_grad():
        dec.extend({i: torch.randint(0, cfg.vocab_size, (4,), generator=gen) for i in range(batch)})
        counter = _counted(model)
        dec.extend({i: torch.randint(0, cfg.vocab_size, (1,), generator=gen) for i in range(batch)})
    return {"torch_kernels": counter.kernels, "syncs": counter.syncs}


def _passes(preset: str, dtype: torch.dtype, batch: int, length: int, progress) -> dict:
    """Run a random `preset` model's passes in phases — the learner at batch 2 then 3, the engine's
    prefill then decode at batch 1, then both again at `batch` — and say which phase compiled
    which binaries (only the first learner and the first prefill should), the launch counts and
    the host time of one decode step."""
    from ..engine import Decoder, draws_triton
    from ..model import Model, ModelConfig, sequence_logprobs
    from ..ops.triton_attention import KV_SPLIT_PAGES, forced

    cfg = ModelConfig.preset(preset)
    length = min(length, cfg.max_position_embeddings - 8)
    model = Model(cfg, kernels="aligned", dtype=dtype, seed=None)  # launches are no-ops: no init needed
    model.check_inputs = False  # (a CPU-only check: syncs a GPU forward does not make)
    gen = torch.Generator().manual_seed(0)
    driver = triton_target.active()
    compiled: dict[str, int] = {}

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, cfg.vocab_size, (n,), generator=gen)

    def phase(name: str, fn):
        progress(f"{preset} {dtype} {name}")
        first = len(driver.binaries)
        out = fn()
        compiled[name] = sum(not _rung(b, driver.binaries[:i])
                             for i, b in enumerate(driver.binaries) if i >= first)
        return out

    def decode(dec: Decoder, b: int) -> dict:
        times = []
        for _ in range(3):
            before = sum(x.launches for x in driver.binaries)
            first = len(driver.grids)
            counter = _counted(model)
            t0 = time.perf_counter()
            dec.extend({i: tokens(1) for i in range(b)})
            times.append(time.perf_counter() - t0)
            del model.forward  # back to the class's
            launches = sum(x.launches for x in driver.binaries) - before
        gemms = [n for k, n in driver.grids[first:] if k in _GEMM_KERNELS]
        return {"launches": launches, "torch_kernels": counter.kernels, "syncs": counter.syncs,
                "host_ms": 1e3 * statistics.median(times), "gemm_programs": [min(gemms), max(gemms)]}

    step = {}
    with torch.no_grad():
        for b in (2, 3):
            phase(f"learner batch {b}",
                  lambda b=b: sequence_logprobs(model, [tokens(length) for _ in range(b)]))
        for b in (1, batch):
            dec = Decoder(model, max_tokens=b * (length + 3 * model.block_size))

            def prefill(b=b, dec=dec):
                if b == 1:  # both schedules' paged attention: shapes pick one (with few KV heads
                    for schedule in ("walk", "split"):  # the split at batch 1, the walk at batch 8)
                        with forced(schedule):
                            one = Decoder(model, max_tokens=length + 3 * model.block_size)
                            one.extend({0: tokens(length // 2)})
                return dec.extend({i: tokens(length // 2) for i in range(b)})
            phase(f"prefill batch {b}", prefill)
            step[b] = phase(f"decode batch {b}", lambda b=b, dec=dec: decode(dec, b))
        long = min(cfg.max_position_embeddings - 8, 2 * KV_SPLIT_PAGES * model.block_size + 8)
        dec = Decoder(model, max_tokens=long + 2 * model.block_size)  # keys over several splits:
        phase("long decode batch 1", lambda: (dec.extend({0: tokens(long)}), dec.extend({0: tokens(1)})))
        for b in (1, batch):  # the engine's sampler on a GPU: Gumbel-max draws in one pass
            phase(f"sampling batch {b}", lambda b=b: draws_triton.gumbel_argmax(
                torch.zeros(b, cfg.vocab_size), torch.zeros(b, dtype=torch.long),
                torch.zeros(b, dtype=torch.long)))
    expected = {"learner batch 2", "prefill batch 1", "long decode batch 1", "sampling batch 1"}
    if not cfg.num_experts:  # MoE decode launches depend on the experts hit: no like-for-like count
        step[batch]["standard"] = _standard_decode(cfg, dtype, batch, length)
    return {"decode": step, "length": length, "hidden": cfg.hidden_size, "compiled_by_phase": compiled,
            "one_binary_per_kernel": all(n == 0 for k, n in compiled.items() if k not in expected)}


_GEMM_KERNELS = {"_matmul_kernel": (), "_matmul_tma_kernel": ("tma",)}
"""The GEMM's kernels, and what marks a `GEMM_TILES` tile as the kernel's."""

_GEMM_SHARED = ("b_ptr", "out_ptr", "M", "N", "K", "som", "son", "HAS_BIAS", "INTERP", "IEEE")
"""The arguments both GEMM kernels take (the others: x's and W's pointers and strides, or their
TMA descriptors and the program count; and the blocks)."""


def _arguments(b) -> dict[str, tuple]:
    """A GEMM binary's arguments, name -> (type or constant value, specialisations): its signature
    lists the arguments that were not made constants, in order."""
    from ..ops import triton_gemm as tg

    names = getattr(tg, b.kernel).arg_names
    types = iter(re.sub(r"\[[0-9x]+\]", "", b.signature).split(","))  # a descriptor's block: the tile's
    spec: dict[str, list] = {}
    for s in filter(None, b.specialised.split(",")):
        spec.setdefault(s.split("%")[0], []).append(s)
    return {n: (("=", b.constants[n]) if n in b.constants else (next(types, "?"),), sorted(spec.get(n, [])))
            for n in names if not n.startswith("BLOCK_")}


def _canonical(kernel: str, args: dict) -> bool:
    """Whether a GEMM binary's own arguments are specialised as dense operands make them: x and W
    16-byte aligned with unit stride along K, their row strides specialised as K is (the pointer
    kernel); the program count neither specialised nor constant (the TMA kernel: it follows M)."""
    if kernel == "_matmul_tma_kernel":
        return _programs_free(args)
    k = args["K"][1]
    rows = all(args[n][1] == [s.replace("K%", f"{n}%") for s in k] and args[n][0][0] != "="
               for n in ("sxm", "swn"))
    return (args["sxk"] == args["swk"] == (("=", 1), []) and "x_ptr%16" in args["x_ptr"][1]
            and "w_ptr%16" in args["w_ptr"][1] and rows)


def _programs_free(own: dict) -> bool:
    """The TMA kernel's program count (it follows M) neither a constant nor specialised."""
    return "PROGRAMS" not in own or (own["PROGRAMS"][0][0] != "=" and not own["PROGRAMS"][1])


def _rung(binary: triton_target.Binary, earlier: list) -> bool:
    """Whether `binary` is the GEMM at a tile of a `GEMM_TILES` ladder compiled for the first time
    with these arguments, the twin of an earlier GEMM binary but for its tile: another binary at
    another row count by design (the device's probe confirms its bits), not a batch-dependent
    argument specialised. Twins agree on every argument's type, constant value and
    specialisation, blocks aside. Across the two GEMM kernels (a ladder of pointer and TMA tiles)
    that holds for the arguments both take (bias, output, M, N, K, ...); the kernel's own (x's and
    W's strides; the TMA program count) must agree with an earlier binary of the same kernel, or,
    where there is none, be what dense operands give (`_canonical`). The same tile compiled again
    with the same shared arguments (so another specialisation of its own) still counts; again
    with another bias or output type (another layer, another phase's first use) it is judged as
    a twin."""
    from ..ops import triton_gemm as tg

    def tile(b) -> tuple:
        return (*(b.constants.get(k) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")), b.num_warps, b.num_stages,
                *_GEMM_KERNELS[b.kernel])

    if binary.kernel not in _GEMM_KERNELS:
        return False
    mine = _arguments(binary)
    shared = {n: v for n, v in mine.items() if n in _GEMM_SHARED}
    own = {n: v for n, v in mine.items() if n not in _GEMM_SHARED}

    def twin(e) -> bool:
        theirs = _arguments(e)
        if e.kernel == binary.kernel:
            return theirs == mine
        return all(theirs.get(n) == v for n, v in shared.items())

    rungs = {t for ladder in tg.GEMM_TILES.values() if len(ladder) > 1 for _, t in ladder}
    gemms = [e for e in earlier if e.kernel in _GEMM_KERNELS]
    again = [e for e in gemms if tile(e) == tile(binary)
             and all(_arguments(e).get(n) == v for n, v in shared.items())]
    kin = [{n: _arguments(e)[n] for n in own} for e in gemms if e.kernel == binary.kernel]
    return (tile(binary) in rungs and not again and any(map(twin, gemms)) and _programs_free(own)
            and (own in kin if kin else _canonical(binary.kernel, mine)))


def _candidates(preset: str, dtype: torch.dtype, tiles: str, progress) -> dict:
    """`bench gemm`'s candidate tiles (`tiles`: "default" or a comma-separated list) at each weight
    shape of `preset`, with the output in `dtype` and in float32 (the sums its checks read): their
    binaries' resources, and the candidates the GPU would refuse. On a GPU machine this also fills
    Triton's cache, so that `bench gemm` times tiles rather than waits for compiles."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from ..ops import triton_gemm as tg
    from .bench_gemm import CANDIDATES, parse_tiles, weight_shapes

    name = str(dtype).removeprefix("torch.")
    texts = CANDIDATES.get(name, CANDIDATES["float32"]) if tiles == "default" else tiles.split(",")
    chosen = [parse_tiles(t, "--gemm-candidates") for t in texts]
    refused: dict[tuple, str] = {}  # (tile, output dtype) -> why: the limits do not depend on the shape
    for shape, (n, k) in weight_shapes(ModelConfig.preset(preset)).items():
        x, w = torch.zeros(256, k, dtype=dtype), torch.zeros(n, k, dtype=dtype)
        for t in chosen:
            progress(f"{preset} {name} {shape} {tg.tile_name(t)}")
            for out in dict.fromkeys((dtype, torch.float32)):
                if (t, out) not in refused and (t, out, shape) not in refused:
                    try:
                        tg.matmul(x, w, tiles=t, out_dtype=out)
                    except (CompilationError, OutOfResources) as err:  # the GPU's limits: any shape
                        refused[t, out] = (f"{tg.tile_name(t)} ({str(out).removeprefix('torch.')} out): "
                                           f"{_failure(err)}")
                    except ConfigError as err:  # this shape's (e.g. rows TMA cannot read)
                        refused[t, out, shape] = f"{tg.tile_name(t)} ({shape}): {_failure(err)}"
    return {"candidates": [tg.tile_name(t) for t in chosen], "refused": list(refused.values())}


def _gemm_launch_us(hidden: int, dtype: torch.dtype, tiles=None) -> float:
    """Host microseconds of one Triton GEMM launch (one row, [hidden, hidden] weight; `tiles`:
    the tile in force, or a TMA tile: its descriptors are built on the host each launch), median."""
    from ..ops import triton_gemm as tg

    x = torch.zeros(1, hidden, dtype=dtype)
    w = torch.zeros(hidden, hidden, dtype=dtype)
    tg.matmul(x, w, tiles=tiles)
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        tg.matmul(x, w, tiles=tiles)
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def problems(binaries: list[triton_target.Binary]) -> list[str]:
    """What would hurt on the GPU: spills, matrix kernels off the tensor cores in 16-bit types."""
    out = []
    for b in binaries:
        first = b.signature.split(",")[0]  # '*bf16', or a TMA descriptor's 'tensordesc<bf16[64x64]>'
        name = f"{b.kernel} ({first}, {b.constants})"
        if b.stack_bytes:
            out.append(f"{name}: {b.stack_bytes} bytes of stack per thread (register spills)")
        operand = first.removeprefix("*").removeprefix("tensordesc<").split("[")[0]
        if b.kernel in _MATRIX_KERNELS and operand in ("bf16", "fp16") and b.tensor_cores == "none":
            out.append(f"{name}: a 16-bit matrix product without tensor-core instructions")
    return out


def _failure(err: Exception) -> str:
    """The first line of a compile or resource error, for the problems list."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def main(args) -> int:
    dtypes = [dtype_from_name(d, "--dtype") for d in args.dtype]
    for preset in args.presets:
        ModelConfig.preset(preset)
    if args.batch < 1 or args.length < 4:
        raise ConfigError("--batch must be at least 1 and --length at least 4")
    driver = triton_target.enable(args.arch)
    if args.gemm_tiles:  # ladders proposed by `bench gemm`: their tiles compiled and checked too
        from .bench_gemm import apply_tiles
        apply_tiles(args.gemm_tiles)
    import triton
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    report = {"arch": f"sm_{driver.capability}", "shared_limit": driver.max_shared,
              "triton": triton.__version__, "runs": []}
    t0 = time.perf_counter()
    failed = []
    for preset in args.presets:
        for dtype in dtypes:
            first = len(driver.binaries)
            progress = lambda m: status(f"compile: {m}")  # noqa: E731
            if args.gemm_candidates:
                run = _candidates(preset, dtype, args.gemm_candidates, progress)
                failed += [f"{preset} {dtype}: {why}" for why in run["refused"]]
                run.update(preset=preset, dtype=str(dtype).removeprefix("torch."),
                           binaries=[b.as_dict() for b in driver.binaries[first:]])
                report["runs"].append(run)
                continue
            try:
                run = _passes(preset, dtype, args.batch, args.length, progress)
            except (CompilationError, OutOfResources) as err:  # the GPU would refuse it too
                failed.append(f"{preset} {dtype}: {_failure(err)}")
                continue
            run.update(preset=preset, dtype=str(dtype).removeprefix("torch."),
                       binaries=[b.as_dict() for b in driver.binaries[first:]],  # the passes' own
                       gemm_launch_us=_gemm_launch_us(run["hidden"], dtype))
            if driver.capability >= 90 and dtype != torch.float32:  # the prefill kernel's host cost
                run["tma_gemm_launch_us"] = _gemm_launch_us(run["hidden"], dtype, (64, 128, 64, 4, 4, "tma"))
            report["runs"].append(run)
    status("")
    found = failed + problems(driver.binaries)
    for run in report["runs"]:
        if not run.get("one_binary_per_kernel", True):
            again = {k: n for k, n in run["compiled_by_phase"].items() if n}
            found.append(f"{run['preset']} {run['dtype']}: kernels compiled again at another batch size or "
                         f"phase (a batch-dependent argument is specialised): {again}")
    report["problems"] = found
    report["seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        print(json.dumps(report, indent=1))
        return 1 if found else 0
    print(f"parity compile: sm_{driver.capability} (shared memory per block up to "
          f"{driver.max_shared // 1024} KiB), Triton {triton.__version__} and its ptxas, "
          f"{report['seconds']} s; nothing ran on a GPU")
    for run in report["runs"]:
        print(f"\n{run['preset']} {run['dtype']}: " + (
            f"bench gemm's candidates {', '.join(run['candidates'])} at the weight shapes, output in "
            f"{run['dtype']}{'' if run['dtype'] == 'float32' else ' and float32'}" if "candidates" in run else
            f"learner 2 and 3 x {run['length']} tokens, engine prefill + decode at batch 1 and {args.batch}"))
        print(table(["kernel", "tiles", "warps", "stages", "regs", "stack B", "shared KiB",
                     "matrix", "loads", "launches"],
                    [[b["kernel"].strip("_").removesuffix("_kernel"),
                      " ".join(f"{k}={v}" for k, v in b["constants"].items()
                               if k.isupper() and not isinstance(v, bool)),
                      str(b["num_warps"]), str(b["num_stages"]), str(b["registers"]),
                      str(b["stack_bytes"]), f"{b['shared_bytes'] / 1024:.1f}", b["tensor_cores"],
                      b["loads"], str(b["launches"])] for b in run["binaries"]]))
        if "candidates" in run:
            continue
        one = "yes" if run["one_binary_per_kernel"] else "NO"
        print(f"binaries compiled by phase: {run['compiled_by_phase']}; one binary served every batch size "
              f"and decode as well as prefill: {one}")
        us = run["gemm_launch_us"]
        if "tma_gemm_launch_us" in run:
            print(f"a TMA GEMM launch (prefill, the learner): {run['tma_gemm_launch_us']:.1f} us of host "
                  f"time here (its two tensor descriptors built per launch)")
        for b, s in run["decode"].items():
            print(f"decode step at batch {b}: {s['launches']} Triton launches + {s['torch_kernels']} PyTorch "
                  f"kernels, {s['syncs']} host syncs in the model forward; the Triton launches at "
                  f"{us:.1f} us of host time each here (one GEMM's): {s['launches'] * us / 1e3:.1f} ms")
            print(f"  GEMM grids in that step: {s['gemm_programs'][0]} to {s['gemm_programs'][1]} programs "
                  f"(132 SMs on an H100/H200, 108 on an A100: a smaller grid leaves SMs idle)")
            if "standard" in s:
                print(f"  standard backend, same step: {s['standard']['torch_kernels']} PyTorch kernels, "
                      f"{s['standard']['syncs']} host syncs")
    print("\n" + ("problems:\n  " + "\n  ".join(found) if found else "no problems: no spills, "
                  "16-bit matrix products on tensor cores, every kernel fits"))
    return 1 if found else 0
