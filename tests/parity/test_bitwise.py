"""The bitwise parity suite: property-based checks that aligned log-probs never change bits.

Every test compares whole float32 log-prob vectors with `torch.equal`. The control tests at the
bottom run the same checks on the `standard` kernels and require a mismatch, so the suite is
known to be able to fail.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parity.invariance import (
    CASES,
    case_autograd,
    case_batch,
    case_decode,
    case_offset,
    case_padding,
    case_process,
    case_threads,
    compare,
    reference,
    run_checks,
)
from parity.ops import native
from tests.conftest import DEVICE, cached_model

ON_CPU = DEVICE == "cpu"

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

models = st.builds(
    lambda dtype, seed, std: cached_model("tiny", "aligned", dtype, seed, std),
    st.sampled_from(["float32", "bfloat16"]), st.integers(0, 3), st.sampled_from([0.02, 0.1, 0.3]),
)
token = st.integers(0, 127)
sequence = st.lists(token, min_size=2, max_size=80).map(torch.tensor)
sequences = st.lists(sequence, min_size=1, max_size=6)
temperatures = st.sampled_from([1.0, 0.7, 1.3])


def assert_equal_pairs(pairs):
    n, bad, worst = compare(pairs)
    assert n > 0
    assert bad == 0, f"{bad}/{n} log-prob vectors differ (max |diff| {worst:.3g})"


@pytest.mark.skipif(ON_CPU, reason="the Triton attention runs on CUDA (test_triton.py: the interpreter)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_schedules_agree_on_this_device(dtype, monkeypatch):
    """The Triton attention's walk and split schedules give the same bits in the GPU's compiled
    code: kernels at head sizes 16 and 128 (the Qwen3-0.6B shape), and a model's learner and
    engine with every call forced onto one schedule or the other (`schedules.py`). First in the
    file: scripts/gpu_check.sh runs this file under a time limit, and this test runs only there."""
    from tests.parity.schedules import assert_kernel_schedules_agree, assert_model_schedules_agree
    for d in (16, 128):
        assert_kernel_schedules_agree(dtype, DEVICE, d, monkeypatch)
        monkeypatch.undo()
    model = cached_model("tiny", "aligned", str(dtype).removeprefix("torch."), 15, 0.1)
    assert_model_schedules_agree(model, (model.config.max_position_embeddings - 20, 300))


@SETTINGS
@given(models, sequences, st.randoms(use_true_random=False), temperatures)
def test_alone_vs_random_batch(model, seqs, rnd, temperature):
    refs = reference(model, seqs, temperature)
    order = list(range(len(seqs))) * rnd.randint(1, 2)  # duplicates allowed: composition varies
    rnd.shuffle(order)
    assert_equal_pairs(case_batch(model, seqs, refs, order, temperature))


@SETTINGS
@given(models, sequences, sequences, st.integers(1, 12))
def test_padding_and_offsets(model, seqs, filler, shift):
    refs = reference(model, seqs)
    assert_equal_pairs(case_padding(model, seqs, refs, filler))
    assert_equal_pairs(case_offset(model, seqs, refs, shift))


@st.composite
def schedules(draw):
    seqs = draw(sequences)
    chunks = []
    for s in seqs:
        left, parts = s.numel(), []
        while left:
            parts.append(draw(st.integers(1, left)) if draw(st.booleans()) else 1)
            left -= parts[-1]
        chunks.append(parts)
    return seqs, chunks


@SETTINGS
@given(models, schedules(), temperatures)
def test_prefill_vs_chunked_vs_decode(model, schedule, temperature):
    seqs, chunks = schedule
    refs = reference(model, seqs, temperature)
    assert_equal_pairs(case_decode(model, seqs, refs, chunks, temperature))
    # whole prefill and pure token-by-token decode of the same batch
    assert_equal_pairs(case_decode(model, seqs, refs, [[s.numel()] for s in seqs], temperature))
    assert_equal_pairs(case_decode(model, seqs, refs, [[1] * s.numel() for s in seqs], temperature))


@settings(SETTINGS, max_examples=10)
@given(models, sequences)
def test_autograd_forward_equals_inference(model, seqs):
    assert_equal_pairs(case_autograd(model, seqs, reference(model, seqs)))


@pytest.mark.skipif(not ON_CPU, reason="CPU thread counts")
@settings(SETTINGS, max_examples=10)
@given(models, sequences)
def test_one_vs_two_threads(model, seqs):
    assert_equal_pairs(case_threads(model, seqs, reference(model, seqs)))


def test_long_sequences():
    """Queries hundreds of keys deep (on a GPU: across the Triton attention's fixed key splits,
    decode at small batch on the split schedule), both dtypes."""
    for dtype, seed in (("float32", 13), ("bfloat16", 14)):
        model = cached_model("tiny", "aligned", dtype, seed, 0.1)
        for res in run_checks(model, rounds=1, seed=seed, max_len=400,
                              cases=("batch", "decode", "engine", "autograd")):
            assert res.comparisons > 0 and res.mismatches == 0, res


def test_two_processes():
    """A child process, at another thread count, scores the batch with each sequence's bits alone
    (float32 at 1 thread here, the child at 2; bf16 at 2 here, the child at 1)."""
    for dtype, threads in (("float32", 1), ("bfloat16", 2)):
        torch.set_num_threads(threads)
        model = cached_model("tiny", "aligned", dtype, 5, 0.1)
        seqs = [torch.arange(n) % 128 for n in (3, 11, 40, 97)]
        assert_equal_pairs(case_process(model, seqs, reference(model, seqs)))


def test_a_thousand_generated_cases():
    """The CI target: >= 1,000 generated comparisons, zero mismatches, both dtypes. On a GPU the
    thread case compares nothing (CPU threads), so the other cases run more rounds there; on a
    CPU the replayed-decode case ('graphs', 40% of this test's time) is left to
    tests/engine/test_graphs.py (1,032 comparisons without it). A case that cannot run (a CUDA graph
    that fails to capture, say) is recorded while the others go on, so a failure still counts
    what was compared; with PARITY_TEST_PROGRESS set (scripts/gpu_check.sh), each check's counts
    are appended to that file as it ends, so a run cut short still says what it compared."""
    cases = [c for c in CASES if c != "process" and (c != "threads" if not ON_CPU else c != "graphs")]
    total, mismatched, errors = 0, [], []
    progress = os.environ.get("PARITY_TEST_PROGRESS")
    for dtype, seed in (("float32", 11), ("bfloat16", 12)):
        model = cached_model("tiny", "aligned", dtype, seed, 0.1)
        for res in run_checks(model, rounds=14 if ON_CPU else 19, seed=seed, cases=cases, record_errors=True):
            if progress:
                with open(progress, "a") as f:
                    f.write(json.dumps({"dtype": dtype, "case": res.case, "comparisons": res.comparisons,
                                        "mismatches": res.mismatches, "error": res.error}) + "\n")
            total += res.comparisons
            mismatched += [(dtype, res)] if res.mismatches else []
            errors += [(dtype, res.case, res.error)] if res.error else []
    assert not mismatched and not errors and total >= 1000, (total, mismatched, errors)


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 0.05)])
def test_learner_gradients_agree_with_the_standard_backend(dtype, tol):
    """The learner's backward is ordinary math (on a GPU: the Triton forward under autograd,
    attention's gradient by a recompute through SDPA in the model's dtype). Every parameter's
    gradient agrees with the standard kernels' autograd on the same device and dtype, to
    `tol` of its norm (bf16: two different roundings of one gradient)."""
    import parity
    grads = {}
    seqs = [torch.arange(n) * 5 % 128 for n in (7, 30, 45)]
    for kernels in ("aligned", "standard"):
        model = parity.Model(parity.ModelConfig.preset("tiny"), kernels=kernels,
                             dtype=getattr(torch, dtype), seed=9)
        model.reset_parameters(9, 0.1)
        model = model.to(getattr(torch, dtype)).to(DEVICE)
        lps = parity.sequence_logprobs(model, [s.to(DEVICE) for s in seqs], temperature=0.9)
        loss = -sum((lp * torch.linspace(-1, 1, lp.numel(), device=lp.device)).mean() for lp in lps)
        loss.backward()
        grads[kernels] = {n: p.grad.float().cpu() for n, p in model.named_parameters()}
    for name, g in grads["aligned"].items():
        ref = grads["standard"][name]
        assert float(ref.norm()) > 0, f"{name} got no gradient"
        assert float((g - ref).norm()) <= tol * float(ref.norm()), name


@pytest.fixture
def pure_torch_kernels():
    previous = native.set_enabled(False)
    yield
    native.set_enabled(previous)


@pytest.mark.skipif(not ON_CPU, reason="the CPU backend's fallback")
def test_pure_pytorch_fallback_is_also_invariant(pure_torch_kernels):
    """Without a C compiler the aligned backend runs on pure PyTorch ops: same guarantees."""
    assert "pure-PyTorch" in native.describe()
    for dtype, seed in (("float32", 21), ("bfloat16", 22)):
        model = cached_model("small" if dtype == "bfloat16" else "tiny", "aligned", dtype, seed, 0.1)
        for res in run_checks(model, rounds=3, seed=seed, cases=("batch", "padding", "decode",
                                                                 "autograd", "threads")):
            assert res.comparisons > 0 and res.mismatches == 0, res


# ---------------------------------------------------------------------------- controls
def _standard_mismatches(dtype: str, preset: str, rounds: int, cases=("batch", "padding", "decode")) -> int:
    model = cached_model(preset, "standard", dtype, 0, 0.02)
    results = run_checks(model, rounds=rounds, seed=2, cases=cases)
    return sum(r.mismatches for r in results)


def test_control_standard_float32_differs():
    assert _standard_mismatches("float32", "tiny", 3) > 0


def test_control_standard_bfloat16_differs():
    """Which bf16 cases the standard kernels can fail, case by case (a sum over cases hid it). bf16
    rounding hides most of their differences on a CPU: on an AVX2 EPYC (no bf16 instructions, so
    bf16 products run in float32 and round) their batch, padding, offset and thread cases gave 0
    mismatches of 25-50 on `small` and on `tiny`, so there the bf16 halves of those checks are not
    shown able to fail (an audit of 2026-12-07); their float32 halves are, and on such a CPU the
    aligned bf16 products are the float32 kernels on widened inputs. Decode over a KV cache against
    full-sequence SDPA flips bits in bf16 too (21 of 25 there; autograd 7 of 50)."""
    model = cached_model("small", "standard", "bfloat16", 0, 0.02)
    found = {r.case: r.mismatches for r in run_checks(model, rounds=6, seed=2, cases=("decode",))}
    assert found["decode"] > 0, found


def test_control_standard_engine_differs():
    """The rollout engine's recorded log-probs against the learner's, with standard kernels."""
    assert _standard_mismatches("float32", "tiny", 3, cases=("engine",)) > 0


def test_control_standard_prefix_differs():
    """Requests that start on another request's cached prompt blocks (prefix caching) and
    prefill only the rest, against the learner's, with standard kernels."""
    assert _standard_mismatches("float32", "tiny", 3, cases=("prefix",)) > 0


@pytest.mark.skipif(not ON_CPU, reason="CPU thread counts")
def test_control_standard_kernels_move_with_the_thread_count():
    """The thread case's own control, without a batch's help (its reference is each sequence alone,
    which the standard kernels' batching alone would fail): a lone sequence of 6-11 tokens at 1 and
    at 2 threads, against itself alone, moves the standard kernels' bits (MKL's float32 GEMM takes
    another path at 2 threads for 5-7 and 9-11 rows on this CPU) and not the aligned kernels'.
    In bf16 this shows on `small` only: on `tiny`, the model of the thread case's bf16 half, bf16
    rounding hid every move (0 of 190 lone sequences of 2-96 tokens, two models)."""
    cases = (("tiny", "float32", 5, 0.1, [torch.arange(n) % 128 for n in (7, 11)]),
             ("small", "bfloat16", 0, 0.02, [torch.arange(n) * 3 % 128 for n in (6, 7)]))
    found = {}
    for preset, dtype, seed, std, seqs in cases:
        for kernels in ("standard", "aligned"):
            model = cached_model(preset, kernels, dtype, seed, std)
            pairs = [p for s in seqs for p in case_threads(model, [s], reference(model, [s]))]
            found[kernels, dtype] = compare(pairs)[1]
    assert found["standard", "float32"] > 0 and found["standard", "bfloat16"] > 0, found
    assert found["aligned", "float32"] == 0 and found["aligned", "bfloat16"] == 0, found


@pytest.mark.skipif(not ON_CPU, reason="CPU thread counts")
def test_control_standard_float32_differs_in_a_process_at_another_thread_count():
    """The process case's own control: a child with this process's settings gives the standard
    kernels' bits too (they are deterministic: 0 of 8 children scoring a lone 7- or 11-token
    sequence moved, float32 and bf16, at 1 and at 2 threads), so the case runs the child at another
    thread count; there a lone 11-token sequence (scored at 1 thread here, at 2 in the child) gets
    other float32 standard-kernel bits."""
    model = cached_model("tiny", "standard", "float32", 5, 0.1)
    seq = [torch.arange(11) % 128]
    torch.set_num_threads(1)  # (the autouse fixture gives the count back)
    assert compare(case_process(model, seq, reference(model, seq)))[1] > 0


def test_control_same_suite_on_aligned_passes():
    for dtype, preset, rounds in (("float32", "tiny", 3), ("bfloat16", "small", 3)):
        model = cached_model(preset, "aligned", dtype, 0, 0.02)
        results = run_checks(model, rounds=rounds, seed=2,
                             cases=("batch", "padding", "decode", "engine", "prefix"))
        assert sum(r.mismatches for r in results) == 0


# ---------------------------------------------------------------------------- every family
@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-qwen2", "tiny-llama", "tiny-mistral", "tiny-mixtral",
                                    "tiny-qwen2-moe", "tiny-gemma2", "tiny-gemma3", "tiny-olmo3",
                                    "tiny-phi3"])
def test_every_family_is_invariant_and_its_standard_control_differs(preset):
    """Qwen3-MoE (routing included), Qwen2 (q/k/v biases, YaRN), Llama 3 (llama3 RoPE scaling),
    Mistral (a sliding window of 40 keys), Mixtral (experts in every layer, renormalised, no q/k
    norm), Qwen2-MoE (a gated shared expert beside the routed ones), Gemma 3 (sliding and full
    layers with their own RoPE bases, offset norms in float32, tanh-GELU, scaled queries), Gemma 2
    (soft-capped attention scores and logits, its own attention scale, no q/k norm), OLMo 3
    (norms after each block only, q/k normed over the whole projection, sliding layers), Phi-3
    (fused projections in its files, a window on every layer): the same cases, zero mismatches on
    aligned kernels in both dtypes; the standard control fails."""
    cases = ("batch", "padding", "offset", "decode", "engine", "prefix", "autograd")
    cases += ("threads",) if ON_CPU else ()
    for dtype, seed in (("float32", 7), ("bfloat16", 8)):
        model = cached_model(preset, "aligned", dtype, seed, 0.1)
        results = run_checks(model, rounds=3, seed=seed, cases=cases)
        assert all(r.comparisons > 0 and r.mismatches == 0 for r in results), results
    control = run_checks(cached_model(preset, "standard", "float32", 7, 0.1), rounds=3, seed=7,
                         cases=("batch", "padding", "decode", "engine"))
    assert sum(r.mismatches for r in control) > 0
