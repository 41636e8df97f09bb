"""`parity check`: prove on this machine that the aligned kernels give bitwise-identical log-probs.

Runs every invariance case of `parity.invariance` (batch composition, padding, offsets,
prefill/chunked/decode over the engine's paged KV cache, the engine itself, autograd, threads,
a second process) for both kernel backends and each dtype, and prints a table. Exits 0 only when
the aligned backend has zero mismatches; the standard backend's mismatches are the control.
"""

from __future__ import annotations

import json
import time

import torch

from .. import hardware
from ..dtypes import dtype_from_name
from ..errors import ParityError
from ..invariance import CASES, run_checks
from ..model import Model, ModelConfig, load_model
from ..ops import BACKENDS, describe_aligned
from .ui import status, table, term_as_interrupt


def main(args) -> int:
    cases = list(dict.fromkeys(args.cases or CASES))  # (batch,batch ran the case twice)
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise ParityError(f"unknown check case {unknown[0]!r}: expected some of {', '.join(CASES)}")
    if not args.dtype:
        raise ParityError("no dtype given: expected float32 and/or bfloat16")
    dtypes = {name: dtype_from_name(name, "--dtype") for name in args.dtype}
    from .sft import RECIPES, get_base_policy, names_recipe

    if names_recipe(args.model):  # a cached base policy of `parity sft` by name, as eval and generate take it
        args.model = str(get_base_policy(RECIPES[args.model]))
    results, label = [], args.model or f"preset {args.preset}"
    device = hardware.check_device(args.device, "--device")
    if args.gemm_tiles:  # ladders from `bench gemm`: the rows checked across M with them in force
        from .bench_gemm import apply_tiles
        apply_tiles(args.gemm_tiles)
    stopped: list[str] = []
    runs = [(d, k) for d in dtypes for k in BACKENDS]
    built: dict = {}  # dtype -> the first backend's model, whose weights the second one takes
    with term_as_interrupt():  # a time limit's SIGTERM: report the comparisons made so far
        for dtype_name, kernels in runs:
            if stopped:
                break
            dtype = dtypes[dtype_name]
            try:
                if args.model:
                    model = load_model(args.model, kernels=kernels, dtype=dtype, device=device)
                elif built.get(dtype_name) is not None:  # the same weights: no second seeded draw
                    model = built.pop(dtype_name).twin(kernels)  # (serial on the CPU, ~10 s at 0.6B)
                else:
                    model = Model(ModelConfig.preset(args.preset), kernels=kernels, dtype=dtype,
                                  seed=args.seed, device=device)
                    built[dtype_name] = model
            except KeyboardInterrupt:
                stopped.append(f"interrupted loading the {kernels} {dtype_name} model")
                break
            t0 = time.perf_counter()
            for r in run_checks(model, rounds=args.rounds, seed=args.seed, max_len=args.max_len, cases=cases,
                                progress=lambda m, k=kernels, d=dtype_name: status(f"check {k} {d}: {m}"),
                                stopped=stopped, record_errors=True):
                seconds = round(time.perf_counter() - t0, 2)
                results.append({"dtype": dtype_name, **r.as_dict(), "seconds": seconds})
    status("")
    aligned_bad = sum(r["mismatches"] for r in results if r["kernels"] == "aligned")
    aligned_errors = [r for r in results if r["kernels"] == "aligned" and r["error"]]
    # a case that could not run, or a run cut short, is not a pass
    passed = aligned_bad == 0 and not aligned_errors and not stopped
    if args.json:
        print(json.dumps({"model": label, "machine": hardware.describe(), "threads": torch.get_num_threads(),
                          "aligned_kernels": describe_aligned(device), "device": str(device),
                          "torch": torch.__version__,
                          "passed": passed, "results": results, "stopped": stopped}, indent=2))
        return 0 if passed else 1
    print(f"parity check: {label}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds per case, device {device}; aligned kernels: {describe_aligned(device)}")
    print(f"machine: {hardware.line()}")
    print(table(["case", "kernels", "dtype", "comparisons", "mismatches", "max |Δ|"],
                [[r["case"], r["kernels"], r["dtype"], str(r["comparisons"]), str(r["mismatches"]),
                  f"{r['max_abs_diff']:.3g}"] for r in results]))
    total = sum(r["comparisons"] for r in results if r["kernels"] == "aligned")
    std_bad = sum(r["mismatches"] for r in results if r["kernels"] == "standard")
    for r in results:  # cases stopped by an error (their comparisons up to then are counted above)
        if r["error"]:
            print(f"{r['case']} ({r['kernels']}, {r['dtype']}) stopped: {r['error']}")
    for why in stopped:
        print(f"{why}: the checks not listed did not run")
    print(f"{'PASS' if passed else 'FAIL'}: aligned kernels {aligned_bad} mismatches in {total} "
          f"comparisons{f', {len(aligned_errors)} cases stopped by an error' if aligned_errors else ''}; "
          f"standard kernels {std_bad} mismatches (the gap parity removes)")
    return 0 if passed else 1
