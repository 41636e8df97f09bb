"""Compile the aligned Triton kernels for a GPU architecture on a machine that has none.

`enable("sm_90")`, called before `triton_kernels` is first imported, puts a compile-only driver
in Triton's place: every launch of an aligned kernel goes through Triton's own binder (the same
argument specialisation a GPU run makes), its own compiler passes and the `ptxas` shipped with
Triton, for that architecture, and then launches nothing (outputs stay uninitialised). What
each binary needs is read back from the cubin with Triton's bundled `cuobjdump`: registers,
stack (spills), shared memory, and which matrix instructions it uses (HGMMA: Hopper's warpgroup
tensor cores; HMMA: the older warp-level ones; none: plain FMA). A kernel that does not fit the
architecture's shared memory fails here as it would there.

What it proves: the kernels compile for that GPU, with the resources and instructions listed,
and one binary serves every batch size. What it does not: that the binary computes the right
bits or runs fast there (that is `scripts/gpu_check.sh` on a GPU).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from ..errors import ConfigError

ARCHS = {  # capability -> the largest dynamic shared memory one block may take, bytes
    80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376,
}
"""The architectures `enable` compiles for (sm_80 A100, sm_86/89 Ampere/Ada consumer, sm_90
H100/H200, sm_100 B200, sm_120 consumer Blackwell) and each one's shared-memory limit."""


@dataclass
class Binary:
    """One compiled specialisation of a kernel and what it needs on the target."""

    kernel: str
    constants: dict
    signature: str  # the argument types Triton compiled for, e.g. "*bf16,*bf16,i32,..." (a TMA
    # descriptor's block shape written 128x64: "tensordesc<bf16[128x64]>")
    specialised: str  # the arguments Triton specialised on ("N%16": divisible by 16), e.g. "x_ptr%16,K%16"
    num_warps: int
    num_stages: int
    shared_bytes: int  # dynamic shared memory per block
    registers: int = 0
    stack_bytes: int = 0  # per thread: register spills and local arrays
    matrix: dict = field(default_factory=dict)  # SASS matrix instruction -> count
    loads: str = ""  # how global memory reaches the kernel: 'TMA', 'cp.async' (to shared) or 'plain'
    launches: int = 0

    @property
    def tensor_cores(self) -> str:
        """'HGMMA', 'HMMA' or 'none': the matrix instruction family the binary uses."""
        kinds = {k.split(".")[0] for k in self.matrix}
        return "HGMMA" if "HGMMA" in kinds else "HMMA" if "HMMA" in kinds else "none"

    def as_dict(self) -> dict:
        return {**vars(self), "tensor_cores": self.tensor_cores}


class _Utils:
    def __init__(self, target: CompileOnlyDriver):
        self.target = target

    def get_device_properties(self, device):
        return {"max_shared_mem": self.target.max_shared, "multiprocessor_count": 132,
                "max_num_regs": 65536, "warpSize": 32, "sm_clock_rate": 0, "mem_clock_rate": 0,
                "mem_bus_width": 0}

    def load_binary(self, name, cubin, shared, device):
        pending = self.target.pending  # the launcher was made just before: the last of that name
        binary = pending.pop(max(i for i, b in enumerate(pending) if b.kernel == name))
        binary.registers, binary.stack_bytes, binary.matrix, binary.loads = _inspect(cubin)
        self.target.binaries.append(binary)
        return binary, None, binary.registers, 0, 1024

    def unload_module(self, module):
        pass


class CompileOnlyDriver:
    """A Triton driver that compiles for `capability` and launches nothing (see the module doc)."""

    def __init__(self, capability: int):
        from triton.backends.compiler import GPUTarget

        self.capability = capability
        self.max_shared = ARCHS[capability]
        self.target = GPUTarget("cuda", capability, 32)
        self.utils = _Utils(self)
        self.binaries: list[Binary] = []
        self.pending: list[Binary] = []
        self.grids: list[tuple[str, int]] = []  # (kernel, programs) of every launch, in order

    def is_active(self) -> bool:
        return True

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_benchmarker(self):
        raise ConfigError("compile-only Triton: nothing can be timed without a GPU")

    def launcher_cls(self, src, metadata):
        consts = getattr(src, "constants", None) or getattr(src, "constexprs", {})
        binary = Binary(
            kernel=src.fn.__name__,
            constants={(k if isinstance(k, str) else src.fn.arg_names[k[0]]): _plain(v)
                       for k, v in consts.items()},
            signature=",".join(str(v).replace(", ", "x") for v in src.signature.values() if v != "constexpr"),
            specialised=",".join(f"{src.fn.arg_names[path[0]]}%{a[1]}" for path, attrs in
                                 sorted((getattr(src, "attrs", None) or {}).items())
                                 for a in attrs if a[0] == "tt.divisibility"),
            num_warps=metadata.num_warps, num_stages=metadata.num_stages,
            shared_bytes=metadata.shared)
        self.pending.append(binary)

        def launch(grid_0, grid_1, grid_2, *args, **kwargs):
            binary.launches += 1
            self.grids.append((binary.kernel, grid_0 * grid_1 * grid_2))

        return launch


def _plain(value):
    value = getattr(value, "value", value)
    return value if isinstance(value, (int, float, bool, str, type(None))) else str(value)


def _tool(name: str) -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise ConfigError(f"this Triton install has no {name} (looked in {os.path.dirname(path)})")
    return path


def _inspect(cubin: bytes) -> tuple[int, int, dict, str]:
    """(registers, stack bytes per thread, matrix instruction counts, how it loads: 'TMA' for the
    Tensor Memory Accelerator's UTMALDG, 'cp.async' for LDGSTS, else 'plain') of a cubin, by
    cuobjdump: half a second a binary for its SASS, so the answer is kept in parity's cache under
    the cubin's hash (and the Triton version, whose cuobjdump reads it) and read back next time."""
    import triton

    from .native import _cache_dir

    key = hashlib.sha256(triton.__version__.encode() + b"\0" + _reading() + cubin).hexdigest()[:32]
    kept = _cache_dir().parent / "cubins" / f"{key}.json"
    try:
        regs, stack, matrix, loads = json.loads(kept.read_text())
        return int(regs), int(stack), dict(matrix), str(loads)
    except (OSError, ValueError, TypeError):  # not kept yet (or unreadable: read the cubin again)
        pass
    found = _read_cubin(cubin)
    part = kept.with_name(f"{kept.name}.{os.getpid()}")
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        part.write_text(json.dumps(found))
        os.replace(part, kept)  # whole or absent for a concurrent reader
    except OSError:  # a cache that cannot be written costs time only
        part.unlink(missing_ok=True)
    return found


@functools.lru_cache(maxsize=1)
def _reading() -> bytes:
    """The hash of `_read_cubin`'s own text: a change to how a cubin is read retires what was kept."""
    import inspect

    try:
        return hashlib.sha256(inspect.getsource(_read_cubin).encode()).digest()
    except (OSError, TypeError):  # (installed without its sources: its code object stands in)
        return hashlib.sha256(_read_cubin.__code__.co_code).digest()


def _read_cubin(cubin: bytes) -> tuple[int, int, dict, str]:
    """`_inspect`'s answer, from Triton's bundled cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    matrix: dict[str, int] = {}
    for op in re.findall(r"\b(HGMMA\.[\w.]+|HMMA\.[\w.]+)", sass):
        matrix[op] = matrix.get(op, 0) + 1
    loads = "TMA" if "UTMALDG" in sass else "cp.async" if "LDGSTS" in sass else "plain"
    return int(regs.group(1)) if regs else 0, int(stack.group(1)) if stack else 0, matrix, loads


def parse_arch(arch: str) -> int:
    """'sm_90' (or '90', '9.0') -> 90; a one-line error for anything else."""
    text = arch.strip().lower().removeprefix("sm_").removeprefix("sm")
    cap = int(float(text) * 10) if "." in text else int(text) if text.isdigit() else None
    if cap not in ARCHS:
        raise ConfigError(f"unknown GPU architecture {arch!r}: expected one of "
                          f"{', '.join(f'sm_{c}' for c in ARCHS)}")
    return cap


_DRIVER: CompileOnlyDriver | None = None


def enable(arch: str) -> CompileOnlyDriver:
    """Compile every aligned Triton kernel launched from now on for `arch`, launching nothing.
    Must run before `parity.ops.triton_kernels` is imported (that import picks interpreter or
    compiler); the driver it returns lists the binaries compiled so far."""
    global _DRIVER
    capability = parse_arch(arch)
    if _DRIVER is not None:
        if _DRIVER.capability != capability:
            raise ConfigError(f"compile-only Triton is already set up for sm_{_DRIVER.capability}")
        return _DRIVER
    if "parity.ops.triton_kernels" in sys.modules:
        raise ConfigError("compile-only Triton must be set up before the Triton kernels are imported "
                          "(run it in a fresh process)")
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise ConfigError("Triton was imported with its interpreter on (TRITON_INTERPRET=1): compiling "
                          "for a GPU needs a process that sets up compile-only Triton first")
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ["PARITY_TRITON_COMPILE_ONLY"] = f"sm_{capability}"
    os.environ["PARITY_ALIGNED_IMPL"] = "triton"
    try:
        from triton.runtime.driver import driver
    except ImportError as err:
        raise ConfigError("compiling the aligned kernels needs Triton (pip install triton)") from err
    _DRIVER = CompileOnlyDriver(capability)
    driver.set_active(_DRIVER)
    return _DRIVER


def active() -> CompileOnlyDriver | None:
    """The compile-only driver when `enable` was called in this process, else None."""
    return _DRIVER
