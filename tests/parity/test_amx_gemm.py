"""The AMX bf16 GEMM (`csrc/amx_gemm.c`): a row's bits whatever M, offset, thread count or edge.

On a CPU with AMX tiles the strict regime's bf16 products run on our own tile kernel instead of
oneDNN's (whose kernel, and so a row's bits, follows M). These tests run where the kernel does
(AMX-BF16 and Linux granting the tile state) and skip elsewhere: the AMD and AVX2 machines of
this project's kind never take the path. The control is the library's own bf16 GEMM on the same
shapes, whose rows do change with M here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parity import hardware
from parity.ops import gemm, native
from tests.conftest import DEVICE

pytestmark = pytest.mark.skipif(
    DEVICE != "cpu" or not (hardware.bf16_gemm_native() and native.amx_ready()),
    reason="no AMX tiles here (the kernel is built and used only on CPUs with AMX-BF16)")

SHAPES = [(1024, 1024), (3072, 200), (3072, 40), (100, 37), (96, 7), (64, 4), (48, 1000), (100, 32), (7, 20)]
"""(K, N): whole tiles, and K or N (or both) past the last whole tile (the padded copies), K below
one chunk, N of one whole block and a part. For the wide schedule (256 rows and more), w over 1 MB
is packed a pair of output blocks at a time (1024 x 1024; 3072 x 200, whose 300 rows also span
two of its 256-row chunks of x), smaller ones whole."""

ROWS = [*range(1, 18), 31, 32, 33, 37, 64, 100, 255, 256, 257]


def _data(k: int, n: int, rows: int = 300, seed: int = 0):
    gen = torch.Generator().manual_seed(seed * 7919 + k + n)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    return x, torch.randn(n, k, generator=gen).bfloat16(), torch.randn(n, generator=gen).bfloat16()


@pytest.mark.parametrize("k,n", SHAPES)
def test_a_rows_bits_do_not_depend_on_m_offset_threads_or_edges(k, n):
    """Every row of products of 1-257 rows at three offsets equals that row of a 300-row product
    (the narrow schedule below 256 rows, the wide one from there), with and without bias, at 1 and
    2 threads."""
    x, w, b = _data(k, n)
    before = torch.get_num_threads()
    try:
        for bias in (None, b):
            torch.set_num_threads(2)
            full = native.amx_linear(x, w, bias)
            torch.set_num_threads(1)
            assert torch.equal(native.amx_linear(x, w, bias), full), "thread count changed the bits"
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for m in ROWS:
                    for off in {0, 13, 300 - m}:
                        got = native.amx_linear(x[off:off + m], w, bias)
                        assert torch.equal(got, full[off:off + m]), (k, n, m, off, threads, bias is None)
    finally:
        torch.set_num_threads(before)


def test_control_the_librarys_bf16_rows_follow_m_here():
    """The paths the kernel replaces: oneDNN's bf16 GEMM gives some row other bits in a product of
    another size on this CPU (the reason strict mode exists), so the comparison above can fail."""
    x, w, _ = _data(1024, 1024)
    full = F.linear(x, w)
    assert not all(torch.equal(F.linear(x[:m], w), full[:m]) for m in ROWS), \
        "the library's bf16 rows matched at every M: the control cannot fail here"


@pytest.mark.parametrize("k,n", SHAPES)
def test_the_products_are_the_float32_sums_rounded_once(k, n):
    """Within bf16 rounding of the exact product (a sum in another order moves the last float32
    bits, hence at most one bf16 step; the tiles flush denormals, far below this tolerance)."""
    x, w, b = _data(k, n, rows=40)
    got = native.amx_linear(x, w, b).float()
    exact = F.linear(x.double(), w.double(), b.double())
    assert ((got - exact).abs() <= exact.abs() * 2 ** -7 + 1e-3).all()


def test_strict_bf16_products_take_the_kernel_under_autograd_with_the_same_bits(monkeypatch):
    """`gemm.linear` in the strict regime runs bf16 on the tiles, unpadded (`token_rows`), with the
    forward's bits under autograd the same as without, and gradients of ordinary math."""
    monkeypatch.setattr(gemm, "_strict", dict.fromkeys((False, True), True))
    assert gemm._amx_holds() and "AMX" in gemm.describe()
    assert gemm.token_rows(1, torch.bfloat16) == 1
    x, w, b = _data(1024, 96, rows=5)
    plain = gemm.linear(x, w, b)
    assert torch.equal(plain, native.amx_linear(x, w, b))
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = gemm.linear(xg, wg, b)
    assert torch.equal(y.detach(), plain)
    y.float().sum().backward()
    assert torch.equal(xg.grad, torch.ones(5, 96).bfloat16().matmul(w))
    assert wg.grad.shape == w.shape


@pytest.mark.parametrize("rows", [1, 256])
def test_a_callers_flush_to_zero_reaches_no_thread(rows):
    """The bias add runs in the default floating-point mode on every thread (both schedules: 1 row
    is narrow, 256 wide): a caller that set denormals-are-zero (PyTorch's `set_flush_denormal`, on
    the calling thread only) read a denormal bias as zero in the blocks it computed itself and not
    in the workers', so the bits followed the thread count (2**-126 + 2**-127 is 0x00C0 in bf16;
    the bias read as zero gives 0x0080)."""
    x = torch.ones(rows, 1).bfloat16()
    w = torch.full((64, 1), 2.0 ** -126).bfloat16()
    b = torch.full((64,), 2.0 ** -127).bfloat16()  # a bf16 denormal
    before = torch.get_num_threads()
    want = native.amx_linear(x, w, b)
    assert (want.view(torch.int16) == 0x00C0).all(), "the case cannot tell the modes apart"
    if not torch.set_flush_denormal(True):
        pytest.skip("flush-to-zero cannot be set here")
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(native.amx_linear(x, w, b).view(torch.int16), want.view(torch.int16)), threads
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(before)


def test_the_kernel_refuses_where_it_may_not_run_and_off_the_cpu(monkeypatch):
    """Without Linux's grant the first tile instruction ends the process: the wrapper asks first
    (here PARITY_AMX=0 stands for a machine without it) and refuses another device's tensors."""
    x, w, _ = _data(64, 16, rows=3)
    with pytest.raises(ValueError, match="CPU tensors"):
        native.amx_linear(x.to("meta"), w.to("meta"))
    monkeypatch.setenv("PARITY_AMX", "0")
    with pytest.raises(RuntimeError, match="no AMX tiles here"):
        native.amx_linear(x, w)


def test_bad_operands_are_a_one_line_error():
    x, w, b = _data(64, 16, rows=3)
    for args, words in (((x, w[:, :32]), "do not fit"), ((x.float(), w.float()), "bf16"),
                        ((x, w, b[:5]), "do not fit"), ((x, w, b.float()), "bf16")):
        with pytest.raises(ValueError, match=words) as err:
            native.amx_linear(*args)
        assert "\n" not in str(err.value)
