"""The learner's memory options keep the bits: the LM head in chunks, activation checkpointing.

`head_chunk` runs the LM head and log-softmax over a few positions at a time (recomputed in the
backward); on aligned kernels a row's logits do not depend on how many rows the product has, so
the log-probs and entropies are the unchunked ones bit for bit, and the control shows the standard
kernels' do change. Activation checkpointing runs each layer again in the backward on the same
kernels and rows, so even the gradients are the same bits; the control shows the gradient
comparison sees a change of rounding alone (the head's weight gradient summed chunk by chunk).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import parity
from parity import SamplingParams
from parity.model import ModelConfig, sequence_logprobs
from parity.rl import Learner, LearnerConfig, Trajectory, TrajectoryBatch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _model(preset: str, kernels: str, dtype: str = "float32", tied: bool = True) -> parity.Model:
    cfg = ModelConfig.preset(preset)
    if not tied:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    m = parity.Model(cfg, kernels=kernels, dtype=DTYPES[dtype], seed=0)
    m.reset_parameters(0, 0.1)
    return m.to(DTYPES[dtype])


def _seqs(m: parity.Model, lengths=(37, 64, 5, 23)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, m.config.vocab_size, (n,), generator=gen) for n in lengths]


def _run(m: parity.Model, seqs, **options):
    """Log-probs, entropies and every parameter's gradient of a weighted sum of the log-probs."""
    m.zero_grad(set_to_none=True)
    lp, ent = sequence_logprobs(m, seqs, 0.9, return_entropy=True, **options)
    flat = torch.cat(lp)
    (flat * torch.linspace(-1, 1, len(flat))).sum().backward()
    grads = {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}
    return flat.detach(), torch.cat(ent), grads


@pytest.mark.parametrize("kernels", ["aligned", "standard"])
@pytest.mark.parametrize("preset,dtype,tied", [("tiny", "float32", True), ("small", "bfloat16", True),
                                               ("tiny-moe", "float32", True),
                                               ("tiny-qwen2", "float32", False)])
def test_activation_checkpointing_gives_the_same_gradients_bit_for_bit(kernels, preset, dtype, tied):
    m = _model(preset, kernels, dtype, tied)
    seqs = _seqs(m)
    lp, ent, grads = _run(m, seqs)
    for head_chunk in (0, 16):
        ref = (lp, ent, grads) if head_chunk == 0 else _run(m, seqs, head_chunk=head_chunk)
        lp2, ent2, grads2 = _run(m, seqs, head_chunk=head_chunk, recompute=True)
        assert torch.equal(lp2, ref[0]) and torch.equal(ent2, ref[1])
        assert grads2.keys() == ref[2].keys() == dict(m.named_parameters()).keys()
        for name, g in ref[2].items():
            assert torch.equal(grads2[name], g), name
    if m.config.is_moe:  # the routing the forward left behind is the whole forward's, once
        assert m.last_routing.shape[1] == m.config.num_hidden_layers


@pytest.mark.parametrize("preset,dtype,tied", [("tiny", "float32", True), ("small", "float32", True),
                                               ("small", "bfloat16", True), ("tiny-moe", "bfloat16", True),
                                               ("tiny-llama", "float32", False),
                                               ("tiny-gemma2", "float32", False)])  # (capped logits)
def test_head_chunks_keep_the_aligned_log_probs_bit_for_bit(preset, dtype, tied):
    m = _model(preset, "aligned", dtype, tied)
    seqs = _seqs(m)
    lp, ent, grads = _run(m, seqs)
    with torch.no_grad():
        plain = torch.cat(sequence_logprobs(m, seqs, 0.9))
    assert torch.equal(plain, lp)
    exact = None
    if dtype == "bfloat16":  # gradients: as close to float64's as the unchunked ones are
        m64 = _model(preset, "aligned", "float32", tied).double()
        m64.load_state_dict(m.state_dict())
        exact = _run(m64, seqs)[2]
    for head_chunk in (1, 7, 16, 1000):
        lp2, ent2, grads2 = _run(m, seqs, head_chunk=head_chunk)
        assert torch.equal(lp2, lp) and torch.equal(ent2, ent)
        with torch.no_grad():
            assert torch.equal(torch.cat(sequence_logprobs(m, seqs, 0.9, head_chunk=head_chunk)), lp)
        squares = [0.0, 0.0]  # (chunked, unchunked) squared distances to float64's, all parameters
        for name, g in grads.items():
            if exact is None:
                assert float((grads2[name] - g).abs().max()) <= 1e-4 * float(g.abs().max()), name
                continue
            ref = exact[name]
            error, plain_error = ((x.double() - ref).norm() / ref.norm() for x in (grads2[name], g))
            # per parameter a bf16-noise margin (one token per chunk moved a q_norm's 2.2% to 2.4% once
            # the forward's GEMMs ran on AMX tiles); over all parameters a tight one
            assert error <= 1.25 * plain_error + 1e-6, name
            squares = [s + float((x.double() - ref).norm()) ** 2 for s, x in zip(squares, (grads2[name], g))]
        assert squares[0] <= 1.05 ** 2 * squares[1], (head_chunk, (squares[0] / squares[1]) ** 0.5)


def test_head_chunks_with_capped_logits_keep_bfloat16_gradients_as_precise():
    """(2026-12-06 review) Gemma's soft-capped logits in bfloat16 near the cap, at temperature 0.5:
    the chunked head's backward capped its logits otherwise than its forward (one rounding, not
    three), so its softmax did not sum to 1 against the forward's log-sum-exp and its gradients
    were 2.5x further from float64's than the whole head's. Now as close (the log-probs: bit for
    bit)."""
    from parity.model.logprobs import ChunkedHead, soft_cap
    kernels = parity.ops.get_kernels("aligned")
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 64, generator=gen).bfloat16()
    weight = (torch.randn(512, 64, generator=gen) * 0.85).bfloat16()
    targets = torch.randint(0, 512, (64,), generator=gen)
    coef = torch.linspace(-1, 1, 64)

    def grads(h, w, chunk):
        h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
        if chunk:
            lp = ChunkedHead.apply(h, w, targets, kernels, 0.5, chunk, None, None, 30.0)
        else:
            lp = kernels.token_logprobs(soft_cap(kernels, kernels.linear(h, w), 30.0), targets, 0.5)
        (lp * coef).sum().backward()
        return lp.detach(), h.grad.double(), w.grad.double()

    exact = grads(hidden.double(), weight.double(), 0)
    whole, chunked = grads(hidden, weight, 0), grads(hidden, weight, 16)
    assert torch.equal(whole[0], chunked[0])
    for i in (1, 2):
        error, plain = ((g[i] - exact[i]).norm() / exact[i].norm() for g in (chunked, whole))
        assert error <= 1.1 * plain + 1e-6, (i, float(error), float(plain))


def test_control_head_chunks_change_the_standard_kernels_log_probs():
    """Chunks change how many rows the standard LM-head product has, and with it the bits."""
    m = _model("small", "standard")
    seqs = _seqs(m)
    with torch.no_grad():
        whole = torch.cat(sequence_logprobs(m, seqs))
        changed = [not torch.equal(torch.cat(sequence_logprobs(m, seqs, head_chunk=c)), whole)
                   for c in (1, 3, 16, 50)]
    assert any(changed)


def test_control_the_gradient_comparison_sees_a_change_of_rounding():
    """Head chunks sum the tied weight's gradient in another order: the same values to rounding,
    not the same bits, which the comparison of the checkpointing test would catch."""
    m = _model("small", "aligned")
    seqs = _seqs(m)
    _, _, grads = _run(m, seqs)
    _, _, chunked = _run(m, seqs, head_chunk=16)
    assert not all(torch.equal(chunked[k], g) for k, g in grads.items())


def test_a_learner_step_with_both_options_trains_the_same_weights_and_keeps_the_engines_bits():
    """One learner step with activation checkpointing and small head chunks against one without
    checkpointing: the same metrics and updated weights bit for bit; kernel mismatch 0 against the
    engine's recorded log-probs either way."""
    results = {}
    for recompute in (False, True):
        m = _model("tiny", "aligned")
        engine = parity.Engine(_model("tiny", "aligned"), max_num_seqs=6)
        outs = engine.generate([[1 + i % 3, 2, 3] for i in range(8)],
                               [SamplingParams(max_tokens=6 + i, seed=i) for i in range(8)])
        batch = TrajectoryBatch([Trajectory.from_output(o, float(i % 2), i // 4) for i, o in enumerate(outs)])
        learner = Learner(m, LearnerConfig(lr=1e-2, micro_batch_size=3, head_chunk_tokens=5,
                                           activation_checkpointing=recompute))
        metrics = learner.step(batch)
        assert metrics["mismatch/kernel_max_abs"] == 0.0 and math.isfinite(metrics["train/loss"])
        results[recompute] = metrics, [p.detach().clone() for p in m.parameters()]
    (a, wa), (b, wb) = results[False], results[True]
    assert {k: v for k, v in a.items() if not k.startswith("time/")} == \
        {k: v for k, v in b.items() if not k.startswith("time/")}
    assert all(torch.equal(x, y) for x, y in zip(wa, wb))


def test_the_options_are_config_fields_checked_on_construction():
    from parity.config import load_config
    from parity.errors import ConfigError

    cfg = load_config(None, ["learner.head_chunk_tokens=64", "learner.activation_checkpointing=true"])
    assert cfg.learner.head_chunk_tokens == 64 and cfg.learner.activation_checkpointing is True
    default = LearnerConfig()
    assert default.head_chunk_tokens == 0 and not default.activation_checkpointing
    assert default.head_rows(151936) == 441 and default.head_rows(512) == 131072  # auto: 2^26 logits
    assert cfg.learner.head_rows(151936) == 64
    with pytest.raises(ConfigError, match="head_chunk_tokens"):
        LearnerConfig(head_chunk_tokens=-1)
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        load_config(None, ["learner.activation_checkpointing=3"])


def _kept_for_backward(m: parity.Model, seqs, **options) -> int:
    """Bytes of the tensors autograd keeps for the backward (storages other than the weights')."""
    weights = {p.untyped_storage().data_ptr() for p in m.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    m.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp = sequence_logprobs(m, seqs, **options)
    torch.cat(lp).sum().backward()
    return sum(n for ptr, n in kept.items() if ptr not in weights)


def test_the_options_do_keep_less_for_the_backward():
    """What the options are for: with checkpointing the layers' activations are not kept (a
    checkpoint that did nothing would pass the bitwise tests above, not this one), with chunks the
    [tokens, vocab] logits are not."""
    cfg = dataclasses.replace(ModelConfig.preset("small"), vocab_size=4096)
    m = parity.Model(cfg, kernels="aligned", seed=0)
    seqs = _seqs(m, (200, 200))
    plain = _kept_for_backward(m, seqs)
    logits = 398 * 4096 * 4
    assert plain > logits
    chunked = _kept_for_backward(m, seqs, head_chunk=64)
    assert chunked <= plain - 0.9 * logits
    assert _kept_for_backward(m, seqs, recompute=True) < plain / 3
    assert _kept_for_backward(m, seqs, head_chunk=64, recompute=True) < chunked / 4


def test_bad_options_are_one_line_errors():
    m = _model("tiny", "aligned")
    for bad in (2.5, "8", -3, True):
        with pytest.raises(parity.InputError, match="head_chunk"):
            sequence_logprobs(m, _seqs(m), head_chunk=bad)
    with pytest.raises(parity.InputError, match="recompute"):
        sequence_logprobs(m, _seqs(m), recompute=1)
