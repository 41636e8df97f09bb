"""How callers may use an Engine (`parity/engine/calls.py`) and the sampler's corners a review
found (2026-12-05, ninth session): one thread at a time, `before_step` for weights only, a waiting
drain keeps its own copy, unseeded noise apart from seeded, top-p after top-k."""

from __future__ import annotations

import threading

import pytest
import torch

import parity
from parity import InputError, SamplingParams
from parity.engine.sampler import _keep_mask


def tiny(seed: int = 0) -> parity.Model:
    model = parity.Model(parity.ModelConfig.preset("tiny"), seed=seed)
    model.reset_parameters(seed, 0.1)
    return model


def params(seed, max_tokens=8) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed, ignore_eos=True)


def test_a_second_thread_is_refused_while_generate_runs():
    """An update from another thread landed mid-forward (tokens tagged with a version that could not
    reproduce them); two threads' generate calls crashed or returned None. Both are now one-line
    errors, and the engine serves the next caller. The control: the same calls once generate ends."""
    model = tiny()
    eng = parity.Engine(model, max_num_seqs=4)
    inside, release = threading.Event(), threading.Event()
    done = {}

    def hold(engine):
        inside.set()
        release.wait(30)

    def run():
        done["outs"] = eng.generate([[1, 2, 3]], params(0, 3), before_step=hold)
    worker = threading.Thread(target=run)
    worker.start()
    assert inside.wait(30)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        for call in (lambda: eng.update_weights(state, 1), lambda: eng.add_request([4, 5]),
                     lambda: eng.generate([[4, 5]]), eng.step):
            with pytest.raises(InputError, match="in use on another thread; an engine is single-threaded"):
                call()
    finally:
        release.set()
        worker.join(30)
    assert done["outs"][0].finish_reason == "length" and len(done["outs"][0].token_ids) == 3
    eng.update_weights(state, 1)  # the control: the same calls after generate
    assert eng.generate([[4, 5]], params(1, 2))[0].policy_versions == [1, 1]


def test_before_step_may_update_weights_but_not_step_or_add():
    """`before_step` calling step() made generate return None for its requests; add_request there
    was finished and dropped. Refused now; update_weights there is what it is for (the control)."""
    model = tiny()
    eng = parity.Engine(model, max_num_seqs=4)
    for bad in (lambda e: e.step(), lambda e: e.add_request([7, 8])):
        with pytest.raises(InputError, match="not from generate's before_step, which may call update_w"):
            eng.generate([[1, 2, 3], [4, 5]], params(0), before_step=bad)
        assert not eng.has_unfinished()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    outs = eng.generate([[1, 2, 3]], params(0, 4),
                        before_step=lambda e: e.update_weights(state, 3) if e.policy_version < 3 else None)
    assert outs[0].policy_versions == [3, 3, 3, 3]


@pytest.mark.parametrize("copy", [True, False])
def test_a_waiting_drain_loads_the_weights_as_they_were_given(copy):
    """A drain that waits for turns under way kept references to the caller's tensors: a learner
    stepping them in place before the drain ended had its later weights loaded under the earlier
    version. It now keeps a copy; `copy=False` (the caller promises not to change them: the rollout
    worker's own copies) is the control, loading whatever they hold by then."""
    model = tiny(0)
    eng = parity.Engine(model, max_num_seqs=4)
    eng.add_request([1, 2, 3], params(0, 6))
    eng.step()  # a turn is under way: the drain waits for it
    given = {k: v.clone() for k, v in tiny(1).state_dict().items()}
    snapshot = {k: v.clone() for k, v in given.items()}
    eng.update_weights(given, 1, mode="drain", copy=copy)
    for v in given.values():
        v.add_(0.5)  # the caller's next optimizer step, in place
    while eng.has_unfinished():
        eng.step()
    assert eng.policy_version == 1
    want = snapshot if copy else given
    assert all(torch.equal(p, want[k]) for k, p in model.state_dict().items())


def test_unseeded_requests_draw_noise_no_seeded_request_draws():
    """Request r of an engine seeded 0 drew the noise of SamplingParams(seed=r). Unseeded noise is
    now a hash of (engine seed, request), still the same for the same engine seed (the control)."""
    def draw(seeded=False, engine_seed=0):
        eng = parity.Engine(tiny(), max_num_seqs=8, seed=engine_seed)
        ps = [SamplingParams(temperature=1.0, max_tokens=6, seed=r if seeded else None, ignore_eos=True)
              for r in range(4)]
        return [o.token_ids for o in eng.generate([[1, 2, 3]] * 4, ps)]
    unseeded = draw()
    assert all(a != b for a, b in zip(unseeded, draw(seeded=True)))  # (were equal)
    assert unseeded == draw() and unseeded != draw(engine_seed=1)


def test_top_p_applies_to_the_top_k_tokens_renormalised_as_transformers_does():
    """top-p was taken over the full distribution after top-k, keeping more tokens than
    transformers and vLLM keep. Compared with transformers' TopK then TopP warpers on random rows;
    the control: without top-k both agree as before."""
    transformers = pytest.importorskip("transformers")
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.2]).log()
    assert _keep_mask(probs, 2, 0.6).tolist() == [True, False, False]
    assert _keep_mask(probs, 0, 0.6).tolist() == [True, True, False]  # the control
    for _ in range(200):
        logits = torch.randn(1, 64, generator=gen, dtype=torch.float64) * 2
        k = int(torch.randint(0, 20, (1,), generator=gen))
        p = float(torch.rand(1, generator=gen)) * 0.98 + 0.01
        hf = logits.clone()
        if k:
            hf = transformers.TopKLogitsWarper(k)(None, hf)
        hf = transformers.TopPLogitsWarper(p)(None, hf)
        ours = _keep_mask(torch.log_softmax(logits[0], -1), k, p)
        assert torch.equal(ours, hf[0] > float("-inf")), (k, p)
