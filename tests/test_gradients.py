"""Gradients of the aligned path are correct: gradcheck on the custom autograd functions and a
whole-model comparison against the standard backend's autograd, in float64."""

from __future__ import annotations

import pytest
import torch

import parity
from parity.ops import functions, get_kernels


def test_gradcheck_custom_functions():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = (1 + 0.1 * torch.randn(8, dtype=torch.float64, generator=g)).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: functions.RMSNormFn.apply(a, b, 1e-6), (x, w))
    gate_up = torch.randn(4, 12, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(functions.SiluMulFn.apply, (gate_up,))
    q = torch.randn(2, 3, 4, 4, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 8, 2, 4, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, 8, 2, 4, dtype=torch.float64, generator=g, requires_grad=True)
    pos = torch.tensor([[2, 3, 4], [5, 6, 7]])
    assert torch.autograd.gradcheck(lambda q, k, v: functions.AttentionFn.apply(q, k, v, pos, 4), (q, k, v))
    windowed = functions.AttentionFn.apply  # a sliding window of 3 keys
    assert torch.autograd.gradcheck(lambda q, k, v: windowed(q, k, v, pos, 4, 3), (q, k, v))


def test_aligned_forward_matches_reference_attention():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 5, 4, 8, dtype=torch.float64, generator=g)
    k = torch.randn(3, 64, 2, 8, dtype=torch.float64, generator=g)
    v = torch.randn(3, 64, 2, 8, dtype=torch.float64, generator=g)
    pos = torch.tensor([[0, 1, 2, 3, 4], [10, 11, 12, 13, 14], [59, 60, 61, 62, 63]])
    out = get_kernels("aligned").attention(q, k, v, pos, 32)
    ref = functions.reference_attention(q, k, v, pos)
    assert torch.allclose(out, ref, atol=1e-12, rtol=1e-10)
    for window in (1, 5, 40):  # sliding windows: inside a block, across blocks
        out = get_kernels("aligned").attention(q, k, v, pos, 32, window=window)
        want = functions.reference_attention(q, k, v, pos, window)
        assert torch.allclose(out, want, atol=1e-12, rtol=1e-10)
        assert not torch.allclose(out[2], ref[2])  # (the window hides keys from the last sequence)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windowed_attention_gradients_match_autograd(dtype):
    """The learner's attention with a sliding window, forward and backward (the native kernel's
    log-sum-exp backward where it runs), against autograd through the textbook formula."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 6, 4, 16, generator=g).to(dtype).requires_grad_()
    k = torch.randn(2, 64, 2, 16, generator=g).to(dtype).requires_grad_()
    v = torch.randn(2, 64, 2, 16, generator=g).to(dtype).requires_grad_()
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [40, 41, 50, 61, 62, 63]])
    grad = torch.randn(2, 6, 4, 16, generator=g).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for window in (3, 20):
        out = get_kernels("aligned").attention(q, k, v, pos, 32, window=window)
        got = torch.autograd.grad(out, (q, k, v), grad)
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = functions.reference_attention(qd, kd, vd, pos, window)
        want = torch.autograd.grad(ref, (qd, kd, vd), grad.double())
        assert torch.allclose(out.double(), ref, atol=tol)
        for a, b in zip(got, want):
            assert torch.allclose(a.double(), b, atol=tol), (window, (a.double() - b).abs().max())


@pytest.mark.parametrize("chunks", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_softcapped_attention_matches_transformers_formula_and_its_gradients(dtype, chunks, monkeypatch):
    """Gemma 2's attention (scores times a scale of their own, capped to c tanh(s / c) before the
    mask), with and without a sliding window: the aligned forward (the pure-PyTorch path in
    float64, the native kernel in float32/bfloat16) and its backward (eager, in query chunks when
    the scores would be many: 3 chunks here) against autograd through the textbook formula; the
    cap binds (uncapped attention is far off)."""
    if chunks:
        monkeypatch.setattr(functions, "EAGER_SCORES", 2 * 4 * 64 * 2)  # 2 query rows a chunk
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 6, 4, 16, generator=g).mul(2).to(dtype).requires_grad_()
    k = torch.randn(2, 64, 2, 16, generator=g).to(dtype).requires_grad_()
    v = torch.randn(2, 64, 2, 16, generator=g).to(dtype).requires_grad_()
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [40, 41, 50, 61, 62, 63]])
    grad = torch.randn(2, 6, 4, 16, generator=g).to(dtype)
    tol = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]
    for window in (0, 20):
        spec = dict(window=window, softcap=0.8, scale=0.4)
        out = get_kernels("aligned").attention(q, k, v, pos, 32, **spec)
        got = torch.autograd.grad(out, (q, k, v), grad)
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = functions.reference_attention(qd, kd, vd, pos, **spec)
        want = torch.autograd.grad(ref, (qd, kd, vd), grad.double())
        assert torch.allclose(out.double(), ref, atol=tol)
        for a, b in zip(got, want):
            assert torch.allclose(a.double(), b, atol=tol), (window, (a.double() - b).abs().max())
        plain = functions.reference_attention(qd, kd, vd, pos, window, scale=0.4)
        assert (plain - ref).abs().max() > 0.1
    if dtype == torch.float64:
        q3 = q.detach()[:, :3, :, :4].contiguous().requires_grad_()
        k3, v3 = (t.detach()[:, :8, :, :4].contiguous().requires_grad_() for t in (k, v))
        short = torch.tensor([[2, 3, 4], [5, 6, 7]])
        capped = functions.AttentionFn.apply
        assert torch.autograd.gradcheck(lambda a, b, c: capped(a, b, c, short, 4, 3, 0.8, 0.4), (q3, k3, v3))


def _grads(kernels: str, preset: str = "tiny"):
    cfg = parity.ModelConfig.preset(preset)
    model = parity.Model(cfg, kernels=kernels, dtype=torch.float64, seed=3)
    model.reset_parameters(3, 0.1)
    seqs = [torch.arange(n) * 7 % 128 for n in (5, 33, 70)]
    lps = parity.sequence_logprobs(model, seqs, temperature=0.9)
    loss = -sum((lp * torch.linspace(-1, 1, lp.numel(), dtype=lp.dtype)).mean() for lp in lps)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, loss.detach()


@pytest.mark.parametrize("preset", ["tiny", "tiny-gemma2", "tiny-gemma3", "tiny-olmo3"])  # (windows, norms,
# GELU, soft-caps)
def test_model_gradients_match_standard_backend_float64(preset):
    aligned, la = _grads("aligned", preset)
    standard, ls = _grads("standard", preset)
    assert torch.allclose(la, ls, atol=1e-12)
    for name in aligned:
        assert torch.allclose(aligned[name], standard[name], atol=1e-10, rtol=1e-7), name
        assert aligned[name].abs().sum() > 0, f"{name} got no gradient"


def test_bfloat16_learner_backward_runs_and_is_finite():
    model = parity.Model(parity.ModelConfig.preset("tiny"), dtype=torch.bfloat16, seed=0)
    lps = parity.sequence_logprobs(model, [torch.arange(20), torch.arange(9)])
    assert all(lp.dtype == torch.float32 for lp in lps)
    sum(lp.sum() for lp in lps).backward()
    assert all(torch.isfinite(p.grad.float()).all() for p in model.parameters())


def _model_grads(kernels: str, dtype: torch.dtype, seqs, coef) -> dict[str, torch.Tensor]:
    model = parity.Model(parity.ModelConfig.preset("tiny"), kernels=kernels, dtype=dtype, seed=5)
    lps = parity.sequence_logprobs(model, seqs, temperature=0.7)
    sum((lp * c.to(lp.dtype)).sum() for lp, c in zip(lps, coef)).backward()
    return {n: p.grad.double() for n, p in model.named_parameters()}


def test_float32_aligned_gradients_match_a_float64_reference():
    """The float32 path runs the native kernels (log-sum-exp included); its gradients must match
    float64 autograd of plain math. (A non-differentiable native log-sum-exp once dropped the
    softmax term from every learner gradient; float64 checks alone cannot see that, since
    float64 never takes the native path.)"""
    from parity.ops import native

    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (9, 23, 40)]
    coef = [torch.randn(len(s) - 1, generator=g) for s in seqs]
    ref = _model_grads("standard", torch.float64, seqs, coef)
    got = _model_grads("aligned", torch.float32, seqs, coef)
    for name, r in ref.items():
        err = float((got[name] - r).norm() / r.norm().clamp_min(1e-30))
        assert err < 1e-4, f"{name}: relative gradient error {err:.3g} (native={native.describe()})"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_one_pass_backward_kernels_match_float64_autograd(dtype, tol):
    """The learner's C backward kernels (RMSNorm on plain and strided head rows, SwiGLU on a fused
    gate/up tensor, token log-probs over the vocabulary) and the fused attention backward fed
    with the aligned forward's log-sum-exp (GQA, padding rows, several key blocks) give float64
    autograd's gradients; the forward bits are those of the inference path."""
    from parity.ops import aligned, native

    if native.library() is None:
        pytest.skip("no C compiler: the backward runs in PyTorch")
    g = torch.Generator().manual_seed(7)

    def check(fn, ref_fn, *inputs):
        xs = [x.to(dtype).requires_grad_() for x in inputs]
        out = fn(*xs)
        grad = torch.randn(out.shape, generator=g).to(dtype)
        got = torch.autograd.grad(out, xs, grad)
        ds = [x.detach().double().requires_grad_() for x in xs]
        want = torch.autograd.grad(ref_fn(*ds), ds, grad.double())
        for a, b in zip(got, want):
            assert a.dtype == dtype and _rel(a, b) < tol, _rel(a, b)

    def rms_ref(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    rms = functions.RMSNormFn.apply
    x, w = torch.randn(37, 64, generator=g), 1 + 0.1 * torch.randn(64, generator=g)
    check(lambda a, b: rms(a, b, 1e-6), rms_ref, x, w)
    qkv = torch.randn(19, 6 * 32, generator=g)  # q/k heads read in place out of a fused output
    check(lambda a, b: rms(a[:, :128].reshape(19, 4, 32), b, 1e-6),
          lambda a, b: rms_ref(a[:, :128].reshape(19, 4, 32), b), qkv, w[:32])
    gate_up = torch.randn(23, 2 * 48, generator=g)
    check(functions.SiluMulFn.apply,
          lambda a: torch.nn.functional.silu(a[:, :48]) * a[:, 48:], gate_up)
    q, k, v = (torch.randn(3, 20, h, 32, generator=g) for h in (4, 2, 2))
    k, v = torch.randn(3, 64, 2, 32, generator=g), torch.randn(3, 64, 2, 32, generator=g)
    pos = torch.tensor([list(range(20)), list(range(30, 50)), list(range(40, 55)) + [-1] * 5])
    keep = (pos >= 0).view(3, 20, 1, 1)  # a padding row's output is unspecified: not compared
    check(lambda a, b, c: functions.AttentionFn.apply(a, b, c, pos, 16) * keep,
          lambda a, b, c: functions.reference_attention(a, b, c, pos) * keep, q, k, v)
    logits, toks = 3 * torch.randn(29, 300, generator=g), torch.randint(0, 300, (29,), generator=g)
    check(lambda z: aligned.token_logprobs(z, toks, 0.7),
          lambda z: torch.log_softmax(z / 0.7, -1).gather(-1, toks.unsqueeze(-1)).squeeze(-1), logits)
    qd, kd, vd = (t.to(dtype) for t in (q, k, v))
    out, lse = aligned.attention_with_lse(qd, kd, vd, pos, 16)
    assert lse is not None and torch.equal(out.to(dtype), aligned.attention(qd, kd, vd, pos, 16))


def test_tied_embedding_gradient_is_autograds_own(monkeypatch):
    """Tied embeddings: the head hands its dense gradient to the lookup, which adds its rows in
    place (`model/tied.py`); the result is plain autograd's (two gradients summed) bit for bit in
    float32 (and to rounding in float64 over two micro-batches), and the head's forward keeps the
    kernels' bits."""
    from parity.model.decoder import Model

    cfg = parity.ModelConfig.preset("tiny")
    assert cfg.tie_word_embeddings
    seqs = [[torch.arange(n) * 5 % 128 for n in (7, 19)], [torch.arange(11) * 3 % 128]]

    def grads(kernels: str, tied_path: bool):
        model = parity.Model(cfg, kernels=kernels, dtype=torch.float64, seed=4)
        if not tied_path:
            monkeypatch.setattr(Model, "_tied_autograd", lambda self: False)
        lps = []
        for batch in seqs:
            out = parity.sequence_logprobs(model, batch)
            sum((lp * torch.linspace(-1, 2, lp.numel(), dtype=lp.dtype)).sum() for lp in out).backward()
            lps += out
        monkeypatch.undo()
        return model.model.embed_tokens.weight.grad.clone(), [lp.detach() for lp in lps]

    for kernels in ("aligned", "standard"):
        got, lp_got = grads(kernels, True)
        want, lp_want = grads(kernels, False)
        assert all(torch.equal(a, b) for a, b in zip(lp_got, lp_want))
        assert torch.allclose(got, want, atol=1e-12, rtol=1e-10) and got.abs().sum() > 0
    for kernels in ("aligned", "standard"):  # one backward, float32: the very same bits
        model = parity.Model(cfg, kernels=kernels, seed=4)
        ref = parity.Model(cfg, kernels=kernels, seed=4)
        monkeypatch.setattr(Model, "_tied_autograd", lambda self: False)
        sum(lp.sum() for lp in parity.sequence_logprobs(ref, seqs[0])).backward()
        monkeypatch.undo()
        sum(lp.sum() for lp in parity.sequence_logprobs(model, seqs[0])).backward()
        assert torch.equal(model.model.embed_tokens.weight.grad, ref.model.embed_tokens.weight.grad)
