"""The persistent TMA GEMM on a real Hopper GPU: what the interpreter cannot show.

In the interpreter the TMA kernel runs 3 programs; on an H100/H200 it runs one per SM (132), so a
probe of 192 rows never makes a program walk more than one tile. These tests force the program
count down so that every program walks many tiles (the software pipeline flattened across tiles,
the epilogue of one overlapping the next one's loads) and check that nothing changes a bit: rows
the same whatever M, whatever the number of programs, and the float32 sums the product's (each
output starts as NaN, so a tile no program wrote cannot pass on a reused buffer's old values). The
control: the same sums in another order (K split in two halves, added after) differ, so the
float32 comparison can see an order change. Run by `scripts/gpu_check.sh` (PARITY_TEST_DEVICE=cuda);
skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import DEVICE

pytestmark = pytest.mark.skipif(
    DEVICE != "cuda" or not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="a Hopper (sm_90) or later GPU: PARITY_TEST_DEVICE=cuda on one")


@pytest.mark.parametrize("tile", [(128, 128, 64, 8, 4, "tma"), (128, 256, 64, 8, 3, "tma")],
                         ids=["128x128", "128x256"])
def test_tma_gemm_bits_whatever_the_program_count(tile, monkeypatch):
    from parity.ops import triton_gemm as tg

    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(17)
    m, n, k = 1000, 3072, 1024  # 8 x 12 (or 8 x 24) output tiles, the last row tile partial
    spread = torch.exp2(torch.randint(-8, 9, (m, k), generator=gen).float())
    x = (torch.randn(m, k, generator=gen) * spread).to(torch.bfloat16).to(device)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16).to(device)
    b = torch.randn(n, generator=gen).to(torch.bfloat16).to(device)
    def product(a, bias=None, dtype=torch.bfloat16):  # into NaN: an element no program wrote shows
        out = torch.full((a.shape[0], n), float("nan"), dtype=dtype, device=device)
        return tg.matmul(a, w, bias, tiles=tile, out=out)

    full = product(x, b)  # one program per SM
    sums = product(x, dtype=torch.float32)
    for programs in (1, 3, 7):  # every program walks many tiles
        monkeypatch.setitem(tg._TMA_PROGRAMS, device, programs)
        assert torch.equal(product(x, b), full), programs
        assert torch.equal(product(x, dtype=torch.float32), sums), programs
    monkeypatch.undo()
    for rows in (1, 7, 129, 999):
        assert torch.equal(product(x[-rows:], b), full[-rows:]), rows
    xf, wf = x.float(), w.float()
    assert bool(((sums - xf @ wf.T).abs() <= 1e-4 * (xf.abs() @ wf.abs().T) + 1e-30).all())
    half = k // 2  # the control: the same products summed in another order
    split = (tg.matmul(x[:, :half], w[:, :half], tiles=tile, out_dtype=torch.float32)
             + tg.matmul(x[:, half:], w[:, half:], tiles=tile, out_dtype=torch.float32))
    assert not torch.equal(split, sums)
