"""Process settings parity makes before PyTorch is imported (this module is imported first).

- `THP_MEM_ALLOC_ENABLE=1`: PyTorch puts CPU tensors of 2 MiB and more on transparent huge pages
  (2 MiB-aligned, `madvise(MADV_HUGEPAGE)`). A learner step allocates gigabytes of fresh
  gradients and activations at real sizes; with 4 KiB pages the kernel's page faults took a
  third of a Qwen3-0.6B-shaped step here (`parity bench learner`). PyTorch reads the variable
  once, at its first allocation, so it only takes effect when parity is imported before torch
  (the CLI, and every worker process, which inherits it); a value the user set is kept. It
  changes where large tensors start (2 MiB instead of 64-byte boundaries, both multiples of
  every vector width), never a value.
"""

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
