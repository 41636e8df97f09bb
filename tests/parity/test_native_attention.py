"""The native attention kernel computes the query heads of a GQA group together (`csrc/
aligned_kernels.c`, `attend_group`): 1, 2 or 4 heads share each load of a key and a value, with
each head's sums in its own order. Here every head's output and log-sum-exp equal, bit for bit,
those of the same head computed alone (the KV heads repeated, so that each group is one head),
at the head sizes with their own code (32, 64, 128) and one without (48), in float32 and bf16,
for prefill rows and decode rows, with a sliding window and with soft-capped scores.

Known to be able to fail: summing a grouped head's denominator in another order (r > 0 from the
last key down) fails every case the kernel groups. How many heads share a load follows the vector
registers: with AVX-512 every head size here is grouped; with AVX2 only 32 (2 heads), and at 48,
64 and 128 each head runs alone, so there these cases compare one code path with itself (an audit
of 2026-12-07 ran the mutation on an AVX2 EPYC: the 6 cases of head size 32 failed, the other 10
passed). The control is that mutation, built by `mutants.py`: it fails where the CPU groups.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parity.ops import native

from . import mutants

pytestmark = pytest.mark.skipif(native.library() is None, reason="no native kernels here")

CASES = [  # (sequences, queries, query heads, KV heads, head size, window, softcap)
    (3, 40, 8, 2, 32, 0, 0.0), (2, 33, 8, 2, 64, 0, 0.0), (2, 37, 16, 8, 128, 0, 0.0),
    (2, 30, 8, 1, 48, 0, 0.0), (2, 50, 12, 3, 32, 20, 0.0), (3, 25, 6, 2, 64, 0, 30.0),
    (5, 1, 16, 8, 128, 0, 0.0), (4, 1, 8, 1, 32, 0, 0.0),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)  # (a denormal or -0 compares equal to 0 as floats)


def _heads_together_equal_alone(case, dtype) -> bool:
    b, m, hq, hkv, d, window, softcap = case
    gen = torch.Generator().manual_seed(hq * d + m)
    bs = 16
    length = (max(m, 20) + bs - 1) // bs * bs + bs
    q = torch.randn(b, m, hq, d, generator=gen)
    k = torch.randn(b, length, hkv, d, generator=gen).to(dtype)
    v = torch.randn(b, length, hkv, d, generator=gen).to(dtype)
    # queries at the end of their keys (decode rows) or at 0.. (prefill rows); one padding row
    pos = (torch.arange(m) + (length - m) * (m == 1)).expand(b, m).clone()
    pos[0, 0] = -1
    q[1, :, 0] = 0.0  # all-zero scores: +0 and -0 mixed
    rep = hq // hkv
    together = native.attention(q, k, v, pos, bs, with_lse=True, window=window, softcap=softcap)
    alone = native.attention(q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2), pos, bs,
                             with_lse=True, window=window, softcap=softcap)
    real = pos >= 0
    return all(torch.equal(_bits(x[real]), _bits(y[real])) for x, y in zip(together, alone))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_grouped_heads_give_each_heads_bits_alone(case, dtype):
    assert _heads_together_equal_alone(case, dtype), "outputs or log-sum-exps differ"


REVERSED_DENOMINATOR = {  # a grouped head after the first sums its denominator from the last key down
    "for (int r = 0; r < R; r++) denom[r] = denom[r] + scores[r * stride + j];":
        "for (int r = 0; r < R; r++) denom[r] = denom[r] + scores[r * stride + (r ? n - 1 - (j - n0) : j)];"}


@pytest.fixture(scope="module")
def reversed_denominator():
    return mutants.build(REVERSED_DENOMINATOR)


def _grouped(case) -> bool:
    """Whether the kernel computes this case's heads in groups: `R_MAX` of `csrc/aligned_kernels.c`
    at the vector width `-march=native` gives here (16 floats with AVX-512, 8 with AVX, else 4)."""
    flags = next((ln.split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("flags")), []) if Path("/proc/cpuinfo").exists() else []
    vl, regs = (16, 16) if "avx512f" in flags else (8, 8) if "avx" in flags else (4, 8)
    _, _, hq, hkv, d, _, _ = case
    return hq // hkv >= 2 and regs * vl // min(d, 8 * vl) >= 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_control_a_grouped_head_summed_in_another_order_fails(case, dtype, monkeypatch, reversed_denominator):
    """The same check on the kernels rebuilt with the mutation above fails on every case the kernel
    groups on this CPU (head size 32 on AVX2, all of them on AVX-512), and passes on the others."""
    mutants.use(monkeypatch, reversed_denominator)
    assert _heads_together_equal_alone(case, dtype) == (not _grouped(case))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_a_bf16_query_is_widened_in_the_kernel_with_the_same_bits(kv_dtype):
    """The kernel reads a bf16 q as is (no float32 copy first): the bits of its float32 copy, and
    padding rows come back as zeros (the output is not zero-filled first)."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(3, 20, 8, 64, generator=gen).bfloat16()
    k, v = (torch.randn(3, 32, 2, 64, generator=gen).to(kv_dtype) for _ in range(2))
    pos = torch.arange(20).expand(3, 20).clone()
    pos[1, :4] = -1
    garbage = torch.full((3, 20, 8, 64), 7.0)
    del garbage  # (freed memory of the output's size: likely what it gets)
    got, lse = native.attention(q, k, v, pos, 16, with_lse=True)
    want, want_lse = native.attention(q.float(), k, v, pos, 16, with_lse=True)
    assert torch.equal(_bits(got), _bits(want)) and torch.equal(_bits(lse), _bits(want_lse))
    assert torch.equal(_bits(got[1, :4]), torch.zeros(4, 8, 64, dtype=torch.int32))
