"""Small aligned GEMMs: a row's bits are those of any larger GEMM, whatever M.

Below 12 rows a product is either padded to `gemm_rows(M)` rows (4-row multiples where the
machine's probe confirms they take the large GEMM's path, 16 where it does not) or, in float32
up to 8 rows, computed by the native matrix-vector kernel in the GEMM's own order (where its
probe confirms that order for the K at hand). These tests check the property on shapes the
probes never saw, at 1 and 2 threads, in both dtypes; the controls show that plain unpadded
GEMMs of 1..11 rows, and the matrix-vector kernel with another blocking, do differ.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parity.ops import gemm, native
from tests.conftest import DEVICE

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the CPU GEMM's property")

SHAPES = [(96, 200), (128, 4000), (2048, 1024), (3072, 1024), (33, 77), (300, 40), (64, 8)]
"""(K, N): not the probe's shapes (the probe must generalise, as the model relies on it)."""


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _data(k: int, n: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(48, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("k,n", SHAPES)
def test_every_small_row_count_gives_the_large_gemms_rows(threads, dtype, k, n):
    x, w = _data(k, n, dtype)
    full = gemm.linear(x, w)
    for m in range(1, 16):
        for off in (0, 5, 48 - m):
            got = gemm.linear(x[off:off + m], w)
            assert torch.equal(got, full[off:off + m]), f"M={m} at row {off} differs"


@pytest.mark.parametrize("k,n", [s for s in SHAPES if s[1] >= gemm.FREE_ROWS])
def test_control_unpadded_small_gemms_differ(threads, k, n):
    x, w = _data(k, n, torch.float32)
    full = F.linear(x, w)
    differ = [m for m in range(1, 12) if not torch.equal(F.linear(x[:m], w), full[:m])]
    assert differ, "every unpadded small GEMM matched: the padding would be untested"


def test_padding_is_4_row_multiples_where_the_probe_passes_and_16_where_it_fails(monkeypatch):
    monkeypatch.setattr(gemm, "_quantum", {})
    monkeypatch.setattr(gemm, "strict", lambda: False)  # (strict mode: tested below)
    if gemm._probe_quantum() != gemm.ROW_QUANTUM:
        pytest.skip("this machine's small GEMMs fail the probe: 16 rows everywhere")
    assert [gemm.gemm_rows(m) for m in (1, 3, 4, 5, 8, 9, 11, 12, 13, 40)] == \
        [4, 4, 4, 8, 8, 12, 12, 12, 13, 40]

    def uneven(x, w, bias=None):  # a GEMM whose small row counts take another order
        y = F.linear(x, w, bias)
        return y + 1e-3 if x.shape[0] < gemm.FREE_ROWS else y

    monkeypatch.setattr(gemm, "gemm_linear", uneven)
    monkeypatch.setattr(gemm, "_quantum", {})
    assert [gemm.gemm_rows(m) for m in (1, 5, 11, 12, 13)] == [16, 16, 16, 12, 13]


needs_native = pytest.mark.skipif(native.library() is None, reason="no C compiler: no native kernels")


@needs_native
@pytest.mark.parametrize("k", [64, 193, 300, 1024, 3072])
def test_the_matrix_vector_kernel_is_the_gemms_order_and_is_used(threads, k, monkeypatch):
    if gemm.strict():
        pytest.skip("strict GEMMs here (one thread, 16 rows): no matrix-vector path")
    if not gemm._gemv_order_holds(k):
        pytest.skip(f"this BLAS orders K={k} otherwise: the padded GEMM serves (also correct)")
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(16, k, generator=gen), torch.randn(1000, k, generator=gen)
    b = torch.randn(1000, generator=gen)
    for bias in (None, b):
        full = F.linear(x, w, bias)
        for m in range(1, gemm.GEMV_ROWS + 1):
            assert torch.equal(native.gemv(x[:m], w, bias, gemm.gemm_kblock(k)), full[:m]), m
    calls = []
    real = native.gemv
    monkeypatch.setattr(native, "gemv", lambda *a: calls.append(a) or real(*a))
    assert torch.equal(gemm.linear(x[:3], w, b), F.linear(x, w, b)[:3])
    assert len(calls) == 1, "a 3-row float32 product did not take the matrix-vector kernel"


@needs_native
def test_control_another_blocking_differs_and_the_probe_falls_back(monkeypatch):
    k = 1024
    gen = torch.Generator().manual_seed(8)
    x, w = torch.randn(16, k, generator=gen), torch.randn(200, k, generator=gen)
    full = F.linear(x, w)
    assert not torch.equal(native.gemv(x[:1], w, None, k), full[:1]), "one unblocked chain matched"
    monkeypatch.setattr(gemm, "gemm_kblock", lambda k: k)
    monkeypatch.setattr(gemm, "_gemv_ok", {})
    assert not gemm._gemv_order_holds(k)
    if not gemm.strict():
        assert torch.equal(gemm.linear(x[:1], w), full[:1])  # the padded GEMM serves instead


@pytest.fixture(params=["bf16-chunks", "float32"])
def strict_gemms(monkeypatch, request):
    monkeypatch.setattr(gemm, "_strict", dict.fromkeys((False, True), True))
    if request.param == "float32":  # where the 128-row bf16 GEMMs fail their probe
        monkeypatch.setattr(gemm, "_bf16_chunks_ok", False)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_strict_gemms_give_every_row_count_the_same_rows(strict_gemms, threads, dtype):
    """Strict mode (one MKL thread; float32 padded to 16 rows; bf16 in 128-row GEMMs, or in
    float32), forced here on any machine: a row's bits do not depend on M (1-100), its offset
    or the caller's thread count."""
    if dtype == torch.float32 and strict_gemms == "float32":
        pytest.skip("(the same float32 path as the other parameter)")
    for k, n in ((1024, 1024), (2048, 151), (300, 40)):
        x, w = _data(k, n, dtype)
        x = torch.cat([x, x, x])[:130]
        torch.set_num_threads(1)
        full = gemm.linear(x, w)
        torch.set_num_threads(threads)
        for m in (1, 2, 5, 12, 15, 16, 17, 33, 37, 64, 100):
            for off in (0, 7, 130 - m):
                assert torch.equal(gemm.linear(x[off:off + m], w), full[off:off + m]), (k, n, m, off)
        assert torch.get_num_threads() == threads  # restored after each product


def test_control_a_gemm_whose_large_rows_depend_on_m_makes_gemms_strict(monkeypatch):
    """The probe: rows that change with M between 16 and 100 (as oneDNN's bf16 GEMM did with AMX,
    and MKL's float32 GEMM at 2 threads) make this machine strict; rows that do not, do not."""
    def uneven(x, w, bias=None):
        y = F.linear(x.float(), w.float(), bias).to(x.dtype)
        return y + 1e-3 if 33 <= x.shape[0] < 100 else y

    monkeypatch.setattr(gemm, "gemm_linear", uneven)
    monkeypatch.setattr(gemm, "_strict", {})
    assert gemm.strict()
    assert "strict" in gemm.describe()
    assert gemm._large_rows_hold(gemm._strict_product)  # the strict regime passes it


def test_the_strict_regime_can_be_forced_and_a_bad_setting_is_refused(monkeypatch):
    from parity.errors import ConfigError

    for value, want in (("1", True), ("0", False)):
        monkeypatch.setattr(gemm, "_strict", {})
        monkeypatch.setenv("PARITY_GEMM_STRICT", value)
        assert gemm.strict() is want
    monkeypatch.setattr(gemm, "_strict", {})
    monkeypatch.setenv("PARITY_GEMM_STRICT", "yes")
    with pytest.raises(ConfigError, match="PARITY_GEMM_STRICT must be 1 or 0, got 'yes'"):
        gemm.strict()
