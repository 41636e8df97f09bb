"""Weight updates and cache ownership in the engine's corners: a drain-mode update leaves no old
cache under a new version and waits for every turn under way (preempted ones too); an in-flight
update marks the tokens sampled over older keys/values; caches of idle requests give way before a
request fails; updates never lose tensors; the public API refuses what it cannot serve."""

from __future__ import annotations

import pytest
import torch

import parity
from parity import InputError, SamplingParams


def tiny(seed: int, kernels: str = "aligned") -> parity.Model:
    model = parity.Model(parity.ModelConfig.preset("tiny"), kernels=kernels, seed=seed)
    model.reset_parameters(seed, 0.1)
    return model


def drive(eng: parity.Engine) -> dict:
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    return outs


def learner_logprobs(model, out) -> torch.Tensor:
    with torch.no_grad():
        return parity.sequence_logprobs(model, [out.full_token_ids])[0][len(out.prompt_token_ids) - 1:]


def params(seed: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed, ignore_eos=True)


def test_a_drain_recomputes_a_continued_turns_cache_under_the_new_weights():
    """A multi-turn request continued while a drain waits holds a cache the old weights built: it
    must be recomputed, or its next turn, tagged version 1, is sampled over version 0's keys
    (2.27 nats off the learner's version-1 log-probs before the fix). The control: on the standard
    kernels the recomputed turn's log-probs are not the learner's."""
    new = tiny(2).state_dict()

    def continued_over_a_drain(model):
        eng = parity.Engine(model, max_num_seqs=4, kv_cache_tokens=1024)
        rid = eng.add_request([1, 2, 3, 4, 5], params(3, 4), multi_turn=True)
        while eng.seqs[rid].status.value != "paused":
            eng.step()
        eng.add_request([7, 8, 9], params(1, 6))
        eng.step()  # running: the drain below has to wait for it
        eng.update_weights(new, version=1, mode="drain")
        eng.continue_request(rid, [40, 41])
        assert eng.blocks.owns(rid)  # its version-0 cache, waiting for admission
        drive(eng)
        out = eng.release(rid)
        return eng, out, torch.tensor([v == 1 for v in out.policy_versions])

    model = tiny(1)
    eng, out, v1 = continued_over_a_drain(model)
    assert out.policy_versions[:4] == [0] * 4 and int(v1.sum()) == 4
    assert torch.equal(learner_logprobs(model, out)[v1], torch.tensor(out.logprobs)[v1])
    assert out.cache_versions[-4:] == [1] * 4
    assert len(eng.blocks.free) == eng.blocks.num_blocks
    model = tiny(1, "standard")
    _, out, v1 = continued_over_a_drain(model)
    assert not torch.equal(learner_logprobs(model, out)[v1], torch.tensor(out.logprobs)[v1])  # the control


def test_a_drain_waits_for_a_turn_preempted_midway():
    """A running request preempted under cache pressure has sampled on version 0: the drain waits
    for it to finish there (it used to load version 1 as soon as `running` was empty)."""
    eng = parity.Engine(tiny(1), max_num_seqs=4, max_num_batched_tokens=64, kv_cache_tokens=128)
    a = eng.add_request([1] * 30, params(1, 40))
    b = eng.add_request([2] * 30, params(2, 40))
    outs = {}
    while eng.scheduler.num_preemptions == 0:
        outs.update({o.request_id: o for o in eng.step()})
    assert any(s.turn_tokens for s in eng.scheduler.waiting)  # preempted mid-turn
    eng.update_weights(tiny(2).state_dict(), version=1, mode="drain")
    late = eng.add_request([3, 4], params(4, 3))
    outs.update(drive(eng))
    assert outs[a].policy_versions == [0] * 40 and outs[b].policy_versions == [0] * 40
    assert outs[late].policy_versions == [1] * 3 and eng.policy_version == 1


def test_idle_caches_give_way_before_a_request_is_failed():
    """Two paused multi-turn requests continued in one step (as run_episodes does): the first
    needs a third block, the second holds two while it waits. Both fit alone in the cache of four
    blocks, so neither may fail with 'KV cache too small' (one did). The control: on the standard
    kernels a continued request's log-probs are not the learner's."""
    def continued(model):
        eng = parity.Engine(model, max_num_seqs=4, max_num_batched_tokens=256, kv_cache_tokens=128)
        r1 = eng.add_request(list(range(1, 41)), params(3, 4), multi_turn=True)
        r2 = eng.add_request(list(range(41, 81)), params(3, 4), multi_turn=True)
        drive(eng)
        assert not eng.blocks.free
        eng.continue_request(r2, [5])
        eng.continue_request(r1, [9] * 30)  # first in the queue: 74 tokens, a third block
        return eng, r1, r2, drive(eng)

    model = tiny(1)
    eng, r1, r2, outs = continued(model)
    assert outs[r1].error is None and outs[r2].error is None, (outs[r1].error, outs[r2].error)
    for rid in (r1, r2):
        out = eng.release(rid)
        mask = torch.tensor(out.loss_mask, dtype=torch.bool)
        assert torch.equal(learner_logprobs(model, out)[mask], torch.tensor(out.logprobs)[mask])
    assert len(eng.blocks.free) == eng.blocks.num_blocks
    model = tiny(1, "standard")
    eng, r1, r2, _ = continued(model)
    same = []
    for out in (eng.release(r1), eng.release(r2)):
        mask = torch.tensor(out.loss_mask, dtype=torch.bool)
        same.append(torch.equal(learner_logprobs(model, out)[mask], torch.tensor(out.logprobs)[mask]))
    assert not all(same)  # the control


def test_inflight_tokens_over_an_older_cache_are_marked():
    """After an in-flight update a decoding request and one mid-prefill go on over keys/values of
    version 0: their version-1 tokens come from no single version's weights, and `cache_versions`
    says so. Every token whose cache is its own version's equals the learner's log-prob. The
    control: on the standard kernels some of those tokens' log-probs are not the learner's."""
    new = tiny(2).state_dict()

    def across_the_update(kernels):
        """The outputs of the three requests, their ids, and the model at each version."""
        model = tiny(1, kernels)
        eng = parity.Engine(model, max_num_seqs=2, max_num_batched_tokens=8, kv_cache_tokens=1024)
        a = eng.add_request([1, 2, 3], params(1, 10))  # decoding at the update
        b = eng.add_request(list(range(20)), params(2, 10))  # mid-prefill at the update
        c = eng.add_request([4, 5, 6], params(3, 10))  # waiting at the update
        outs = {}
        for _ in range(2):
            outs.update({o.request_id: o for o in eng.step()})
        eng.update_weights(new, version=1, mode="inflight")
        outs.update(drive(eng))
        return outs, (a, b, c), {0: tiny(1, kernels), 1: model}

    outs, (a, b, c), at = across_the_update("aligned")
    for rid in (a, b, c):
        out = outs[rid]
        cache, version = torch.tensor(out.cache_versions), torch.tensor(out.policy_versions)
        got = torch.tensor(out.logprobs)
        for v, m in at.items():
            exact = (cache == v) & (version == v)
            assert torch.equal(learner_logprobs(m, out)[exact], got[exact])
            stale = (cache < version) & (version == v)
            if stale.any():  # the control: those tokens match no single version
                assert not any(torch.equal(learner_logprobs(w, out)[stale], got[stale]) for w in at.values())
    assert outs[a].policy_versions[0] == 0 and outs[a].policy_versions[-1] == 1
    assert outs[a].cache_versions == [0] * 10 and outs[b].cache_versions == [0] * 10
    assert outs[b].policy_versions == [1] * 10 and outs[c].cache_versions == [1] * 10
    outs, ids, at = across_the_update("standard")
    same = []
    for out in (outs[rid] for rid in ids):
        cache, version = torch.tensor(out.cache_versions), torch.tensor(out.policy_versions)
        for v, m in at.items():
            exact = (cache == v) & (version == v)
            same.append(torch.equal(learner_logprobs(m, out)[exact], torch.tensor(out.logprobs)[exact]))
    assert not all(same)  # the control


def test_an_update_waiting_for_a_drain_is_merged_not_replaced():
    model, v1 = tiny(1), tiny(2).state_dict()
    eng = parity.Engine(model, max_num_seqs=2, kv_cache_tokens=512)
    eng.add_request([1, 2, 3], params(1, 5))
    eng.step()
    eng.update_weights(v1, version=1, mode="drain")
    half = torch.full_like(v1["model.norm.weight"], 0.5)
    eng.update_weights({"model.norm.weight": half}, version=2, mode="drain")  # a partial state
    drive(eng)
    state = model.state_dict()
    assert eng.policy_version == 2 and torch.equal(state["model.norm.weight"], half)
    assert torch.equal(state["model.embed_tokens.weight"], v1["model.embed_tokens.weight"])


def test_generate_refuses_to_swallow_other_requests_and_bad_seeds_fail_at_once():
    eng = parity.Engine(tiny(1), max_num_seqs=2)
    rid = eng.add_request([1, 2, 3], params(1, 4))
    with pytest.raises(InputError, match="earlier request"):
        eng.generate([[5, 6, 7]], params(2, 4))
    assert drive(eng)[rid].finish_reason == "length"  # still there, and finishes
    for seed in (2**64, -1, 1.5, "7", True):
        with pytest.raises(InputError, match="seed"):
            SamplingParams(seed=seed)
    assert not eng.has_unfinished()
