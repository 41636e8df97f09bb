"""The native attention kernel computes the query heads of a GQA group together (`csrc/
aligned_kernels.c`, `attend_group`): 1, 2 or 4 heads share each load of a key and a value, with
each head's sums in its own order. Here every head's output and log-sum-exp equal, bit for bit,
those of the same head computed alone (the KV heads repeated, so that each group is one head),
at the head sizes with their own code (32, 64, 128) and one without (48), in float32 and bf16,
for prefill rows and decode rows, with a sliding window and with soft-capped scores.

Known to be able to fail: summing a grouped head's denominator in another order (r > 0 from the
last key down) fails every grouped case.
"""

from __future__ import annotations

import pytest
import torch

from parity.ops import native

pytestmark = pytest.mark.skipif(native.library() is None, reason="no native kernels here")

CASES = [  # (sequences, queries, query heads, KV heads, head size, window, softcap)
    (3, 40, 8, 2, 32, 0, 0.0), (2, 33, 8, 2, 64, 0, 0.0), (2, 37, 16, 8, 128, 0, 0.0),
    (2, 30, 8, 1, 48, 0, 0.0), (2, 50, 12, 3, 32, 20, 0.0), (3, 25, 6, 2, 64, 0, 30.0),
    (5, 1, 16, 8, 128, 0, 0.0), (4, 1, 8, 1, 32, 0, 0.0),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)  # (a denormal or -0 compares equal to 0 as floats)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_grouped_heads_give_each_heads_bits_alone(case, dtype):
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
    assert torch.equal(_bits(together[0][real]), _bits(alone[0][real])), "outputs differ"
    assert torch.equal(_bits(together[1][real]), _bits(alone[1][real])), "log-sum-exps differ"
