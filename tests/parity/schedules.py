"""Checks that the Triton attention's two schedules (walk, split) give the same bits.

Shared by the interpreter suite (`test_triton.py`, CPU tensors) and the CUDA suite
(`test_bitwise.py` with PARITY_TEST_DEVICE=cuda), so the claim is tested on the machine code the
GPU runs, not only on the interpreter's numpy.
"""

from __future__ import annotations

import torch

from parity.invariance import case_batch, case_decode, compare, reference


def forced(schedule: str):
    """Every Triton attention call in the block runs `schedule` ('walk' or 'split')."""
    from parity.ops import triton_attention as ta
    return ta.forced(schedule)


def assert_kernel_schedules_agree(dtype: torch.dtype, device, d: int, monkeypatch) -> None:
    """Keys over several splits: the split schedule gives every query the walk's bits, dense or
    paged, prefill or decode, inside the first split or far past it, with sliding windows or
    without, with soft-capped scores and a scale of their own (Gemma 2) or not; both are attention
    (close to the textbook formula). The control: a walk with another split size differs (float32)."""
    from parity.ops import triton_attention as ta
    from parity.ops.functions import reference_attention
    gen = torch.Generator().manual_seed(8)
    split = ta.KV_SPLIT_PAGES
    bsz, m, hq, hkv, bs, pages = 3, 9, 4, 2, 16, 3 * split + 1
    q = torch.randn(bsz, m, hq, d, generator=gen).to(dtype)
    k = torch.randn(bsz, pages * bs, hkv, d, generator=gen).to(dtype)
    v = torch.randn(bsz, pages * bs, hkv, d, generator=gen).to(dtype)
    pos = torch.arange(m).repeat(bsz, 1) + torch.tensor([[0], [split * bs + 3], [pages * bs - m]])
    q, k, v, pos = q.to(device), k.to(device), v.to(device), pos.to(device)
    k_cache = torch.zeros(1 + bsz * pages, hkv, d, bs, dtype=dtype, device=device)
    v_cache = torch.zeros(1 + bsz * pages, hkv, bs, d, dtype=dtype, device=device)
    tables = 1 + torch.randperm(bsz * pages, generator=gen).view(bsz, pages).to(device)
    for b in range(bsz):
        for j in range(pages):
            k_cache[tables[b, j]] = k[b, j * bs:(j + 1) * bs].permute(1, 2, 0)
            v_cache[tables[b, j]] = v[b, j * bs:(j + 1) * bs].permute(1, 0, 2)
    # sliding windows: inside one page, across a split, and wider than every position (= none);
    # soft-capped scores (a cap that binds, another scale) in a window (Gemma 2's full layers run
    # the unwindowed capped kernels in the family suite)
    specs = [(w, 0.0, None) for w in (0, 7, split * bs + 5, pages * bs + 1)] + [(7, 0.7, 0.3)]
    for window, softcap, scale in specs:
        spec = dict(softcap=softcap, scale=scale)
        walk = ta.attention(q, k, v, pos, bs, window, schedule="walk", **spec)
        assert torch.equal(ta.attention(q, k, v, pos, bs, window, schedule="split", **spec), walk)
        ref = reference_attention(q.double(), k.double(), v.double(), pos, window, **spec)
        assert torch.allclose(walk.double(), ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
        for schedule in ("walk", "split"):
            paged = ta.paged_attention(q, k_cache, v_cache, tables, pos, window, schedule=schedule, **spec)
            assert torch.equal(paged, walk)
            for i in (0, m - 1):  # decode: one query per sequence
                one = ta.paged_attention(q[:, i:i + 1], k_cache, v_cache, tables, pos[:, i:i + 1], window,
                                         schedule=schedule, **spec)
                assert torch.equal(one[:, 0], walk[:, i])
        if window == pages * bs + 1:  # a window no query outgrows is no window, bit for bit
            assert torch.equal(walk, ta.attention(q, k, v, pos, bs, schedule="walk"))
        if softcap:  # (the cap is seen: uncapped scores at that scale are another attention)
            plain = reference_attention(q.double(), k.double(), v.double(), pos, window, scale=scale)
            assert (plain - ref).abs().max() > 0.05
    qf, kf, vf = q.float(), k.float(), v.float()  # in float32: bf16's rounding of the output can hide it
    base = ta.attention(qf, kf, vf, pos, bs, schedule="walk")
    monkeypatch.setattr(ta, "KV_SPLIT_PAGES", split + 1)
    assert not torch.equal(ta.attention(qf, kf, vf, pos, bs, schedule="walk"), base)


def assert_model_schedules_agree(model, lengths: tuple[int, int]) -> None:
    """A model's log-probs with every attention call on the walk (the learner's, scoring each
    sequence alone) against every call on the split schedule (the learner's batch, a chunked
    prefill, then decode steps of both sequences at once), and the learner on each schedule."""
    gen = torch.Generator().manual_seed(6)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in lengths]
    with forced("walk"):
        refs = reference(model, seqs)
    with forced("split"):
        split_refs = reference(model, seqs)
        pairs = list(zip(refs, split_refs)) + case_batch(model, seqs, refs, [1, 0, 1])
        long, short = lengths
        pairs += case_decode(model, seqs, refs, [[40, long - 46] + [1] * 6, [short - 4] + [1] * 4])
    n, bad, worst = compare(pairs)
    assert n == 7 and bad == 0, (bad, worst)
