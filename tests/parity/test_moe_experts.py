"""The aligned CPU bundle's experts in one native call (`parity/ops/moe.py`): the bits of the
expert-by-expert loop, a token's outputs whatever else is routed beside it (the standard bundle, the
control, changes them), and the call in use in the engine's decode."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parity.invariance import run_checks
from parity.ops import gemm, get_kernels, moe, native
from tests.conftest import cached_model

ALIGNED, STANDARD = get_kernels("aligned"), get_kernels("standard")
LOOP = moe.expert_loop(gemm.linear, ALIGNED.silu_mul)

pytestmark = pytest.mark.skipif(native.library() is None, reason="no native kernels here (PARITY_NATIVE=0 "
                                                                 "or no C compiler)")

# (tokens, top-k, experts, hidden, expert width, skewed: every token's first choice is expert 0)
CASES = [(1, 2, 16, 256, 192, False), (8, 2, 16, 256, 192, False), (8, 2, 16, 256, 192, True),
         (40, 2, 16, 256, 192, False), (24, 2, 16, 256, 192, True), (3, 4, 8, 64, 48, False),
         (5, 8, 8, 96, 40, False), (2, 1, 4, 33, 17, False), (13, 3, 6, 100, 24, True),
         (1, 1, 1, 48, 16, False)]


def _layer(seed: int, t: int, k: int, e: int, h: int, i: int, skew: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    if skew:  # expert 0 first for every token (more than 8 rows once t > 8: the loop's part)
        zero = torch.zeros(1, dtype=torch.int64)
        rows = [torch.cat([zero, 1 + torch.randperm(e - 1, generator=g)]) for _ in range(t)]
        idx = torch.stack(rows)[:, :k]
    else:
        idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    gate_up = torch.randn(e, 2 * i, h, generator=g) * h ** -0.5
    down = torch.randn(e, h, i, generator=g) * i ** -0.5
    return x, idx, gate_up, down


def _need_fused(x, gate_up, down) -> None:
    if not moe._fused_applies(x, gate_up, down):
        pytest.skip("the matrix-vector kernel's order does not hold here for these widths: no one-call path")


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:5])) + ("-skewed" if c[5] else ""))
def test_the_one_call_experts_have_the_loops_bits(case) -> None:
    """Every slot's output, experts of 1-8 slots in the native call, the others by the loop beside
    them, equals the expert-by-expert loop's (`gemm.linear`, `silu_mul`, `gemm.linear`); the
    standard bundle's experts, the control, do not."""
    x, idx, gate_up, down = _layer(sum(case[:5]), *case)
    _need_fused(x, gate_up, down)
    got, want = ALIGNED.moe_experts(x, idx, gate_up, down), LOOP(x, idx, gate_up, down)
    assert got.shape == (case[0] * case[1], case[3]) and torch.equal(got, want)
    assert not torch.equal(want, torch.zeros_like(want))
    assert not torch.equal(STANDARD.moe_experts(x, idx, gate_up, down), want)  # the control


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 30), st.integers(1, 12), st.integers(12, 80), st.integers(6, 60),
       st.integers(0, 2 ** 16), st.integers(1, 2), st.data())
def test_generated_layers_and_routings_have_the_loops_bits(t, e, h, i, seed, threads, data) -> None:
    """Generated shapes (tokens 1-30, experts 1-12, hidden 12-80, width 6-60), routings (top-1 to
    top-e, drawn: spread thin or piled on a few experts) and thread counts: the native call's slots
    equal the loop's, where the call applies."""
    k = data.draw(st.integers(1, e))
    x, _, gate_up, down = _layer(seed, t, 1, e, h, i, False)
    g = torch.Generator().manual_seed(seed)
    hot = data.draw(st.integers(1, e))  # the routing's experts are drawn from the first `hot` first
    idx = torch.stack([torch.cat([torch.randperm(hot, generator=g),
                                  hot + torch.randperm(e - hot, generator=g)])[:k] for _ in range(t)])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if not moe._fused_applies(x, gate_up, down):
            return  # (a width whose matrix-vector order is not confirmed here: the loop serves it)
        assert torch.equal(ALIGNED.moe_experts(x, idx, gate_up, down), LOOP(x, idx, gate_up, down))
    finally:
        torch.set_num_threads(before)


def test_a_tokens_expert_outputs_do_not_depend_on_the_others_routed_beside_it() -> None:
    """Each of 24 tokens alone (one slot per expert: the native call) and among all 24 (expert 0 with
    24 slots: the loop's GEMM; the others with 1-8: the native call): the same bits. The standard
    bundle's experts, the control, change with the company (one-row products take the BLAS's
    matrix-vector path)."""
    x, idx, gate_up, down = _layer(5, 24, 2, 16, 256, 192, True)
    _need_fused(x, gate_up, down)
    differ = {}
    for name, kernels in (("aligned", ALIGNED), ("standard", STANDARD)):
        together = kernels.moe_experts(x, idx, gate_up, down)
        alone = [kernels.moe_experts(x[i:i + 1], idx[i:i + 1], gate_up, down) for i in range(24)]
        differ[name] = sum(not torch.equal(together[2 * i:2 * i + 2], a) for i, a in enumerate(alone))
    assert differ["aligned"] == 0 and differ["standard"] > 0, differ


def test_the_engine_decodes_through_the_one_call_experts_and_matches_the_learner(monkeypatch) -> None:
    """tiny-moe in float32: the engine's decode steps take the native call (recorded), and its
    log-probs still equal the learner's batched forward, which differentiates through the loop."""
    taken = []
    applies = moe._fused_applies

    def recorded(x, gate_up, down):
        taken.append(applies(x, gate_up, down))
        return taken[-1]

    monkeypatch.setattr(moe, "_fused_applies", recorded)
    model = cached_model("tiny-moe", "aligned", "float32", 3, 0.1)
    results = run_checks(model, rounds=2, seed=3, cases=("decode", "engine", "autograd"))
    assert all(r.comparisons > 0 and r.mismatches == 0 for r in results), results
    if not any(taken):
        pytest.skip("the one-call path does not apply on this machine (the matrix-vector kernel's order)")
    assert not all(taken)  # (the learner's forward under autograd, and prefill chunks of 9+ slots, loop)


def test_shapes_the_native_call_would_misread_are_one_line_errors() -> None:
    """The native call reads through raw pointers: weights of another width, more ids than tokens or
    an id past the experts read out of bounds (garbage, NaN) or left a slot at zero, where the loop
    raised. Each is a one-line ValueError now."""
    x, idx, gate_up, down = _layer(1, 3, 2, 8, 64, 48, False)
    _need_fused(x, gate_up, down)
    for args, what in (((torch.randn(3, 48), idx, gate_up, down), "do not fit"),
                       ((x, torch.cat([idx, idx]), gate_up, down), "for 3 tokens"),
                       ((x, torch.where(idx == idx[0, 0], 8, idx), gate_up, down), "past the 8 experts"),
                       ((x, idx, gate_up, down[:, :, :40]), "do not fit")):
        with pytest.raises(ValueError, match=what):
            ALIGNED.moe_experts(*args)
