"""How the benches time a call: side by side, repetitions interleaved, medians, and on a GPU from
CUDA graphs over data that does not sit in the L2 cache.

- `interleaved`: whole calls (a prefill, a decode loop, a sampling step) in turn, A B B A ...,
  so that drift (clocks, a neighbour, the allocator) falls on both sides alike;
- `seconds_per_call`: one kernel's time, over enough calls to take ~20 ms (a sub-millisecond call
  timed alone measures the clock and the scheduler), replayed from one CUDA graph on a GPU (the
  engine's decode steps are graphs: a launch-bound figure would time the host's launch cost,
  dearer for Triton than for cuBLAS, not the kernel);
- `Rotating` / `l2_copies`: a kernel timed on one weight (or KV cache) replayed 200 times reads it
  from the GPU's L2 (the 0.6B shape's largest weight is 12 MB; an H100's L2 50 MB), while a decode
  step streams 28 layers' weights from memory: the calls cycle through copies that overflow L2.
"""

from __future__ import annotations

import statistics
import time

import torch

from .. import hardware

SAMPLE_S = 0.002
"""A sample of `interleaved` lasts at least this long: a call of tens of microseconds timed alone
reads the clock and the scheduler (on a shared machine a whole row's samples fell into one time
slice, and the ratio flipped between 0.5 and 1.15 from run to run)."""


def interleaved(fns: dict, reps: int, timed_inside: bool = False) -> dict[str, float]:
    """Median seconds per call of each function, called in turn `reps` times after a warm-up
    round, the order reversed every other round (A B, B A, ...: neither side always runs after
    the other). Each function waits for its own device work; with `timed_inside` it returns the
    seconds to count itself (work it does not want timed, such as setup, left out). A function
    faster than `SAMPLE_S` is called enough times in a row per sample to last that long (timed
    again after its warm-up, whose first call may hold a compile or a probe)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    runs = dict.fromkeys(fns, 1)
    for k, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        if not timed_inside and time.perf_counter() - t0 < 10 * SAMPLE_S:  # (cheap: time one more)
            t0 = time.perf_counter()
            fn()
            runs[k] = max(1, min(1000, int(SAMPLE_S / max(time.perf_counter() - t0, 1e-7))))
    for r in range(reps):
        for k, fn in (list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]):
            t0 = time.perf_counter()
            for _ in range(runs[k]):
                inner = fn()
            times[k].append(inner if timed_inside else (time.perf_counter() - t0) / runs[k])
    return {k: statistics.median(v) for k, v in times.items()}


class Rotating:
    """A call that runs the next of several equivalent calls each time (the same product on copies
    of its data), so that repeated calls do not find their data in a cache."""

    def __init__(self, calls: list):
        self.calls, self.next = calls, 0

    def __call__(self):
        call = self.calls[self.next]
        self.next = (self.next + 1) % len(self.calls)
        return call()


def rotating(calls: list):
    """`Rotating(calls)`, or the one call itself where there is one (a CPU, or data larger than
    the L2 cache: `l2_copies`)."""
    return calls[0] if len(calls) == 1 else Rotating(calls)


def l2_copies(nbytes: int, device) -> int:
    """How many copies of `nbytes` of data a GPU timing cycles through: enough to fill twice the
    device's L2 cache, at most 64 (one where that data alone overflows it, and on a CPU, whose
    timings here are the Triton interpreter's: a smoke run)."""
    device = torch.device(device)
    if device.type != "cuda" or nbytes <= 0:
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 << 20
    return max(1, min(64, -(-2 * l2 // nbytes)))


def seconds_per_call(fn, device, target: float = 0.02, graphs: bool = True) -> float:
    """Seconds per call of `fn`, over enough calls to take about `target` seconds (at most 200),
    after a warm-up call; on a GPU the calls are replayed from one CUDA graph (`graphs`)."""
    fn()
    hardware.sync(device)
    t0 = time.perf_counter()
    fn()
    hardware.sync(device)
    once = max(time.perf_counter() - t0, 1e-6)
    calls = max(1, min(200, int(target / once)))
    if graphs and torch.device(device).type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()  # warm
        hardware.sync(device)
        t0 = time.perf_counter()
        graph.replay()
        hardware.sync(device)
        return (time.perf_counter() - t0) / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    hardware.sync(device)
    return (time.perf_counter() - t0) / calls


def gemm_rate_again(rows: list, device) -> None:
    """Measure each dtype's GEMM rate once more, after the rows, and give every row the larger of
    its two rates: the rate is a limit (the best of a few products in ~1 s), and one measured while
    a neighbour held a core reads low, which would make every "of GEMM rate" fraction read high."""
    from ..dtypes import dtype_from_name

    again: dict[str, float] = {}
    for row in rows:
        if row.dtype not in again:
            again[row.dtype] = hardware.gemm_rate(dtype_from_name(row.dtype), device=device)
        row.gemm_gflops = max(row.gemm_gflops, again[row.dtype])


def busy_note(threads: int | None = None) -> str:
    """A line for under a bench's table when this machine was shared while it ran: the one-minute
    load average less the bench's own threads comes to a core or more (other processes took turns
    on the cores the timings used, and a row's samples can all fall in their turns). '' otherwise."""
    import os

    try:
        load = os.getloadavg()[0]
    except OSError:
        return ""
    own = threads if threads is not None else torch.get_num_threads()
    try:
        cores = len(os.sched_getaffinity(0))  # (the cores this process may use: a container's share)
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    if load - min(own, cores) < 1.0:
        return ""
    return (f"note: the load average was {load:.1f} on {cores} cores while this ran (the bench's own "
            f"{min(own, cores)} threads included): other processes shared the cores, so these timings may "
            f"be off; run it again on a quiet machine")
