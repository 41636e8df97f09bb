"""Process settings parity makes before PyTorch is imported (this module is imported first).

- `THP_MEM_ALLOC_ENABLE=1`: PyTorch puts CPU tensors of 2 MiB and more on transparent huge pages
  (2 MiB-aligned, `madvise(MADV_HUGEPAGE)`). A learner step allocates gigabytes of fresh
  gradients and activations at real sizes; with 4 KiB pages the kernel's page faults took a
  third of a Qwen3-0.6B-shaped step here (`parity bench learner`). PyTorch reads the variable
  once, at its first allocation, so it only takes effect when parity is imported before torch
  (the CLI, and every worker process, which inherits it); a value the user set is kept. It
  changes where large tensors start (2 MiB instead of 64-byte boundaries, both multiples of
  every vector width), never a value.
- `GOMP_SPINCOUNT=20000`: an OpenMP worker (PyTorch's, and the native kernels') waits for work by
  spinning ~20,000 rounds (under a millisecond here) before it sleeps, instead of libgomp's
  300,000 (tens of milliseconds). Strict GEMMs (`ops/gemm_strict.py`) share a product with a
  thread of their own; while the workers of the last two-thread op still spin, that thread gets
  no core, and the shared product took as long as the unshared one (two 128-row bf16 calls: 2.5
  ms either way after a two-thread op, 1.6 vs 2.4 ms with this setting, AMX Xeon). Read once
  when each OpenMP runtime loads, so, as above, only where parity is imported before torch; a
  value the user set is kept. It changes when an idle thread sleeps, never a value.
"""

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
os.environ.setdefault("GOMP_SPINCOUNT", "20000")
