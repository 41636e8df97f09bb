"""The native float32 GEMM of strict mode (`csrc/gemm_f32.c`): the matrix-vector kernel's order at
any row count, so a row's bits follow neither M, its offset, the thread count nor the edges.

Strict mode (on machines whose library GEMM orders a row by M: the AMX Xeon) runs float32 products
on it where the compiler targets AVX-512F; elsewhere it says so (None) and strict mode keeps the
K-blocked library calls. Its bits are those calls' bits (on a machine whose one-thread GEMM of a K
block is one fused multiply-add chain, as `gemm_strict.kblock` probes) and the matrix-vector
kernel's at 1-8 rows. The control: the library's own multi-threaded GEMM gives some row other bits
in a product of another size here where strict mode is on (skipped where it is not).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parity.ops import gemm, gemm_strict, native

built = (native.library() is not None
         and native.gemm_f32(torch.ones(1, 1), torch.ones(1, 1), None, 384) is not None)
pytestmark = pytest.mark.skipif(not built, reason="the native float32 GEMM is built for AVX-512F only")

SHAPES = [(256, 1536), (768, 256), (1000, 83), (37, 100), (3072, 40), (384, 12), (16, 33)]
ROWS = [1, 2, 7, 8, 9, 15, 16, 17, 63, 64, 65, 100, 255]


def _data(k: int, n: int, rows: int = 300):
    gen = torch.Generator().manual_seed(k * 31 + n)
    return (torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen),
            torch.randn(n, generator=gen))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("k,n", SHAPES)
def test_rows_do_not_depend_on_m_offset_or_threads(k, n):
    """Every row of products of 1-255 rows at three offsets, with and without bias, at 1 and 2
    threads, equals that row of a 300-row product (64-row items, 8-row tiles and their tails)."""
    x, w, b = _data(k, n)
    kb = gemm_strict.kblock()
    before = torch.get_num_threads()
    try:
        for bias in (None, b):
            torch.set_num_threads(2)
            full = native.gemm_f32(x, w, bias, kb)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for m in ROWS:
                    for off in {0, 5, 300 - m}:
                        got = native.gemm_f32(x[off:off + m], w, bias, kb)
                        assert torch.equal(_bits(got), _bits(full[off:off + m])), (k, n, m, off, threads)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("k,n", SHAPES)
def test_the_order_is_the_matrix_vector_kernels(k, n):
    """1-8 rows: the bits of `native.gemv` (decode's kernel), bias first, K blocks of `kblock`."""
    x, w, b = _data(k, n, rows=8)
    kb = gemm_strict.kblock()
    for bias in (None, b):
        for m in (1, 3, 8):
            got = native.gemm_f32(x[:m], w, bias, kb)
            assert torch.equal(_bits(got), _bits(native.gemv(x[:m], w, bias, kb))), (k, n, m)


def test_strict_float32_products_take_it_and_keep_the_library_calls_bits(monkeypatch):
    """`gemm.linear` in the strict regime runs float32 on it; where the one-thread library GEMM of
    a K block is one chain (probed), the K-blocked library calls it replaced give the same bits."""
    monkeypatch.setattr(gemm, "_strict", dict.fromkeys((False, True), True))
    x, w, b = _data(768, 256, rows=100)
    kb = gemm_strict.kblock()
    assert torch.equal(_bits(gemm.linear(x, w, b)), _bits(native.gemm_f32(x, w, b, kb)))
    if not gemm_strict._one_chain(kb):
        pytest.skip("this machine's one-thread GEMM of a K block is not one chain")
    native_out = gemm_strict.forward(x, w, b, chunked=False)
    monkeypatch.setattr(native, "gemm_f32", lambda *args: None)
    assert torch.equal(_bits(gemm_strict.forward(x, w, b, chunked=False)), _bits(native_out))


def test_control_the_librarys_float32_rows_follow_m_where_strict_mode_is_on():
    """Where strict mode is on (the library's rows depend on M or threads), some row of the
    library's GEMM differs between sizes: the comparisons above can fail."""
    if not gemm.strict():
        pytest.skip("the library's float32 rows hold here (strict mode off)")
    x, w, _ = _data(1024, 1024)
    full = F.linear(x, w)
    assert not all(torch.equal(F.linear(x[:m], w), full[:m]) for m in ROWS), \
        "the library's float32 rows matched at every M: the control cannot fail here"


def test_bad_operands_are_a_one_line_error():
    x, w, b = _data(64, 16, rows=3)
    for args, words in (((x, w[:, :32], None, 384), "do not fit"),
                        ((x.double(), w.double(), None, 384), "float32"),
                        ((x.to("meta"), w.to("meta"), None, 384), "CPU tensors")):
        with pytest.raises(ValueError, match=words) as err:
            native.gemm_f32(*args)
        assert "\n" not in str(err.value)
