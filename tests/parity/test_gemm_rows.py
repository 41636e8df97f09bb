"""The aligned GEMM's row padding: a row's bits are those of any larger GEMM, whatever M.

Small GEMMs are padded to `gemm_rows(M)` rows (4 or 8 below 12 rows where the machine's probe
confirms that those row counts take the large GEMM's path, 16 where it does not). These tests
check the property on shapes the probe never saw, at 1 and 2 threads, in both dtypes; the
control shows that plain unpadded GEMMs of 1..11 rows do differ, so the test can fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parity.ops import aligned
from tests.conftest import DEVICE

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the CPU GEMM's property")

SHAPES = [(96, 200), (128, 4000), (2048, 1024), (3072, 1024), (33, 77)]
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
    full = aligned.linear(x, w)
    for m in range(1, 16):
        for off in (0, 5, 48 - m):
            got = aligned.linear(x[off:off + m], w)
            assert torch.equal(got, full[off:off + m]), f"M={m} at row {off} differs"


@pytest.mark.parametrize("k,n", SHAPES)
def test_control_unpadded_small_gemms_differ(threads, k, n):
    x, w = _data(k, n, torch.float32)
    full = F.linear(x, w)
    differ = [m for m in range(1, 12) if not torch.equal(F.linear(x[:m], w), full[:m])]
    assert differ, "every unpadded small GEMM matched: the padding would be untested"


def test_padding_is_4_row_multiples_where_the_probe_passes_and_16_where_it_fails(monkeypatch):
    monkeypatch.setattr(aligned, "_quantum", {})
    if aligned._probe_quantum() != aligned.ROW_QUANTUM:
        pytest.skip("this machine's small GEMMs fail the probe: 16 rows everywhere")
    assert [aligned.gemm_rows(m) for m in (1, 3, 4, 5, 8, 9, 11, 12, 13, 40)] == \
        [4, 4, 4, 8, 8, 12, 12, 12, 13, 40]

    def uneven(x, w, bias=None):  # a GEMM whose small row counts take another order
        y = F.linear(x, w, bias)
        return y + 1e-3 if x.shape[0] < aligned.FREE_ROWS else y

    monkeypatch.setattr(aligned, "gemm_linear", uneven)
    monkeypatch.setattr(aligned, "_quantum", {})
    assert [aligned.gemm_rows(m) for m in (1, 5, 11, 12, 13)] == [16, 16, 16, 12, 13]
