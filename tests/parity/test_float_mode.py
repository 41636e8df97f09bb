"""The native kernels' bits do not follow the caller's floating-point mode onto some threads only.

MXCSR (rounding, flush-to-zero, denormals-are-zero) is per thread. PyTorch's `set_flush_denormal`
sets it on the calling thread alone, so a C kernel's parallel region ran the caller's rows with
denormals flushed and the OpenMP workers' rows without: the same row gave other bits at another
thread count. Every parallel region now runs each thread in the default mode for the call and
gives the caller its own back. Results are compared as integers: under the caller's flush a
denormal compares equal to zero (`torch.equal` on the floats passed with the bug in place). The
control: the kernels rebuilt without the fix (`mutants.py`) fail here, and the caller's own flush is
seen in PyTorch's product on the calling thread after the kernels.
"""

from __future__ import annotations

import pytest
import torch

from parity.ops import native
from tests.conftest import DEVICE

from . import mutants

pytestmark = pytest.mark.skipif(DEVICE != "cpu" or native.library() is None, reason="the native CPU kernels")

TINY = 2.0 ** -130  # a float32 denormal


@pytest.fixture
def flushing():
    """The calling thread flushes denormals (and reads them as zero) for the test's duration."""
    before = torch.get_num_threads()
    if not torch.set_flush_denormal(True):
        pytest.skip("flush-to-zero cannot be set on this CPU")
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(before)


def _cases():
    rows = 64
    x = torch.ones(rows, 32)
    x[:, 5] = TINY  # normalised, still a denormal: kept, or flushed on a flushing thread
    gate, up = torch.full((rows, 16), TINY), torch.ones(rows, 16)
    w = torch.full((24, 32), 2.0 ** -140)  # sums of denormal products, still denormal
    return {
        "rms_norm": lambda: native.rms_norm(x, torch.ones(32), 1e-6),
        "silu_mul": lambda: native.silu_mul(gate, up),
        "gemv": lambda: native.gemv(torch.ones(8, 32), w, None, 32),
    }


def _same_bits_under_a_callers_flush(kernel: str) -> list[bool]:
    """Whether the kernel's bits under the caller's flush-to-zero are those without it, at 2 threads
    and at 1 (the OpenMP workers started in the default mode first: a thread inherits its creator's)."""
    torch.set_flush_denormal(False)  # (the inputs too: a flushing thread makes TINY a zero)
    torch.set_num_threads(2)
    fn = _cases()[kernel]
    want = fn()
    tiny = want[:, 5] if kernel == "rms_norm" else want
    assert ((tiny != 0) & (tiny.abs() < torch.finfo(torch.float32).tiny)).all(), \
        "no denormal in the result: the case cannot tell the modes apart"
    torch.set_flush_denormal(True)
    same = []
    for threads in (2, 1):
        torch.set_num_threads(threads)
        # the bits as integers: under the caller's flush a denormal compares equal to zero
        same.append(torch.equal(fn().view(torch.int32), want.view(torch.int32)))
    return same


@pytest.mark.parametrize("kernel", ["rms_norm", "silu_mul", "gemv"])
def test_a_callers_flush_to_zero_changes_no_row_at_any_thread_count(kernel, flushing):
    """Before the fix the caller's rows came out zero at 1 thread and half of them at 2."""
    assert _same_bits_under_a_callers_flush(kernel) == [True, True], kernel
    # the caller's own mode is in force around the kernels, and given back after them
    assert int((torch.tensor([TINY]) * 1.0).view(torch.int32)) == 0


NO_DEFAULT_MODE = {  # each region's threads keep whatever mode they had: the kernels before the fix
    "#define FP_ENTER const unsigned int fp_mode_ = _mm_getcsr(); _mm_setcsr(0x1F80);":
        "#define FP_ENTER const unsigned int fp_mode_ = _mm_getcsr();"}


@pytest.fixture(scope="module")
def without_the_default_mode():
    return mutants.build(NO_DEFAULT_MODE)


@pytest.mark.parametrize("kernel", ["rms_norm", "silu_mul", "gemv"])
def test_control_kernels_that_keep_the_callers_mode_flush_its_rows(kernel, flushing, monkeypatch,
                                                                   without_the_default_mode):
    """The same check on the kernels rebuilt without the default mode in each parallel region:
    at 1 thread the caller runs every row, so its flush reaches all of them and the check fails."""
    mutants.use(monkeypatch, without_the_default_mode)
    assert _same_bits_under_a_callers_flush(kernel)[1] is False, kernel
