"""Prefix caching: requests start on KV blocks other requests computed, and record the same bits.

A GRPO group asks one prompt several times; with prefix caching its later members take the
first member's full prompt blocks (`BlockManager.share`) and prefill only the rest. Proofs: on
aligned kernels every request's tokens and log-probs are the same bits with and without it, and
equal the learner's; the standard kernels' control records other bits; blocks are counted and
come back; new weights are never served blocks the old ones computed; the block manager's
reference counts hold under random operations.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import parity
from parity import InputError, SamplingParams
from parity.engine.block_manager import BlockManager
from tests.conftest import cached_model
from tests.engine.test_engine import check_outputs


def groups(seed: int, group: int = 4, n: int = 4, vocab: int = 128):
    """`n` prompts of 40-120 tokens sharing a 40-token head, each asked `group` times."""
    rng = random.Random(seed)
    head = [rng.randrange(vocab) for _ in range(40)]
    prompts = []
    for _ in range(n):
        prompts += [head + [rng.randrange(vocab) for _ in range(rng.randint(1, 80))]] * group
    params = [SamplingParams(temperature=1.0, max_tokens=rng.randint(4, 16), seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    return prompts, params


def generate(model, prompts, params, prefix_caching=True, **kw):
    eng = parity.Engine(model, max_num_seqs=kw.pop("max_num_seqs", 16), prefix_caching=prefix_caching, **kw)
    return eng.generate(prompts, params), eng


def assert_blocks_all_back(eng):
    for g in eng.blocks.groups:
        assert sorted(g.free) == list(range(1, g.num_blocks + 1)) and not g.refs and not g.index


# (bf16 on `small`: on `tiny` the standard kernels' bf16 bits did not move with the shared prefix on an
# AVX2 CPU, so the bf16 case could not fail there)
SHARING = [("float32", "tiny"), ("bfloat16", "small")]


@pytest.mark.parametrize("dtype, preset", SHARING)
def test_a_group_shares_its_prompt_and_records_the_same_bits(dtype, preset):
    """Members of a group arriving together: the first prefills, the others wait one step and
    take its full blocks (all but the last token's block); tokens and log-probs equal the run
    without prefix caching bit for bit, and the learner's."""
    model = cached_model(preset, "aligned", dtype, 0, 0.1)
    prompts, params = groups(1)
    eng = parity.Engine(model, max_num_seqs=16)
    eng.policy_version = 7  # (as a rollout worker starting at version 7 sets it)
    shared = eng.generate(prompts, params)
    plain, off = generate(model, prompts, params, prefix_caching=False)
    assert {v for o in shared for v in o.cache_versions + o.policy_versions} == {7}
    bs = model.block_size
    expected = 3 * sum((len(p) - 1) // bs * bs for p in prompts[::4])  # each group's 3 later members
    expected += 3 * bs  # and the later groups' first members the shared head's first block
    assert eng.scheduler.shared_tokens == expected and off.scheduler.shared_tokens == 0
    for a, b in zip(shared, plain):
        assert a.token_ids == b.token_ids
        assert torch.equal(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
    assert check_outputs(model, shared, params) == 0
    assert_blocks_all_back(eng)


@pytest.mark.parametrize("dtype, preset", SHARING)
def test_control_standard_kernels_record_other_bits_when_sharing(dtype, preset):
    """The same requests on standard kernels: a request that prefills only its prompt's tail
    computes its first sampled token's log-prob in another GEMM shape than the full prefill, and
    records other bits (so the aligned test above can fail)."""
    model = cached_model(preset, "standard", dtype, 0, 0.1)
    differ = 0
    for seed in (1, 2):  # (on one thread, 3 and 5 of 24 requests differ on an AMD EPYC; 11 and 12 on two)
        prompts, params = groups(seed, n=6)
        shared, _ = generate(model, prompts, params)
        plain, _ = generate(model, prompts, params, prefix_caching=False)
        differ += sum(not torch.equal(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
                      for a, b in zip(shared, plain))
    assert differ > 0


def test_a_block_matches_only_behind_the_same_tokens():
    """A block's tokens at another position, or behind other tokens, are not its prefix: nothing
    is shared, and every request records the learner's bits. The control: on the standard kernels
    some request's log-probs are not the learner's."""
    model = cached_model("tiny", "aligned", "float32", 1, 0.1)
    rng = random.Random(5)
    x, y, z = ([rng.randrange(128) for _ in range(32)] for _ in range(3))
    prompts = [x + y + [1, 2], y + [3, 4], z + y + [5, 6]]
    params = [SamplingParams(temperature=1.0, max_tokens=6, seed=i, ignore_eos=True) for i in range(3)]
    eng = parity.Engine(model, max_num_seqs=4, max_num_batched_tokens=66)  # (the first alone first)
    outs = eng.generate(prompts, params)
    assert eng.scheduler.shared_tokens == 0 and check_outputs(model, outs, params) == 0
    standard = cached_model("tiny", "standard", "float32", 1, 0.1)
    outs = parity.Engine(standard, max_num_seqs=4, max_num_batched_tokens=66).generate(prompts, params)
    assert check_outputs(standard, outs, params) > 0  # the control


@pytest.mark.parametrize("length, waits", [(70, True), (100, False)])
def test_sliding_layers_wait_only_for_a_prefix_they_can_share(length, waits):
    """Mistral's window of 40 keys: the first member's prefill frees the sliding layers' first
    block once it passes 40 + 31 tokens, and a prefix is matched from its first block; so a
    group's members wait for a 70-token prompt's prefill (and share its 64 tokens), not for a
    100-token one's (nothing to share: they start at once). Every output is the learner's. The
    control: on the standard kernels some output's log-probs are not the learner's."""
    model = cached_model("tiny-mistral", "aligned", "float32", 0, 0.1)
    prompt = [random.Random(length).randrange(128) for _ in range(length)]
    params = [SamplingParams(temperature=1.0, max_tokens=4, seed=i, ignore_eos=True) for i in range(4)]
    eng = parity.Engine(model, max_num_seqs=8)
    for q in params:
        eng.add_request(prompt, q)
    assert len(eng.scheduler.schedule()) == (1 if waits else 4)
    eng = parity.Engine(model, max_num_seqs=8)
    outs = eng.generate([prompt] * 4, params)
    assert eng.scheduler.shared_tokens == (3 * 64 if waits else 0)
    assert check_outputs(model, outs, params) == 0
    standard = cached_model("tiny-mistral", "standard", "float32", 0, 0.1)
    outs = parity.Engine(standard, max_num_seqs=8).generate([prompt] * 4, params)
    assert check_outputs(standard, outs, params) > 0  # the control


def test_a_small_cache_preempts_shared_blocks_and_gives_them_back():
    """A cache of a few blocks: sequences holding shared blocks are preempted and recomputed (and
    may share again); every output still equals the learner's, every block comes back. The
    control: on the standard kernels some output's log-probs are not the learner's."""
    model = cached_model("tiny", "aligned", "float32", 2, 0.1)
    prompts, params = groups(2, group=3)
    outs, eng = generate(model, prompts, params, max_num_seqs=8, kv_cache_tokens=8 * 32,
                         max_num_batched_tokens=48)
    assert eng.scheduler.num_preemptions > 0 and eng.scheduler.shared_tokens > 0
    assert all(o.error is None for o in outs) and check_outputs(model, outs, params) == 0
    assert_blocks_all_back(eng)
    standard = cached_model("tiny", "standard", "float32", 2, 0.1)
    outs, _ = generate(standard, prompts, params, max_num_seqs=8, kv_cache_tokens=8 * 32,
                       max_num_batched_tokens=48)
    assert check_outputs(standard, outs, params) > 0  # the control


@pytest.mark.parametrize("version", [0, 1])
def test_new_weights_are_not_served_blocks_the_old_ones_computed(version):
    """A paused multi-turn request holds its prompt's indexed blocks; weights change (under the
    same version number, too); a request with that prompt must prefill it under the new weights.
    The control: on the standard kernels some output's log-probs are not the learner's."""
    prompts, params = groups(3, group=2, n=1)

    def after_the_update(model):
        eng = parity.Engine(model, max_num_seqs=4)
        eng.add_request(prompts[0], params[0], multi_turn=True)
        while not eng.step():  # (it pauses, holding its blocks)
            pass
        state = {n: p.detach() * 1.5 for n, p in model.named_parameters()}
        eng.update_weights(state, version=version, mode="inflight")
        return eng.generate(prompts, params), eng

    model = cached_model("tiny", "aligned", "float32", 3, 0.1).twin("aligned")
    outs, eng = after_the_update(model)
    # the group's second member shares the first's blocks, computed under the new weights; had
    # the paused request's been served, both would share and the first's bits would be wrong
    assert eng.scheduler.shared_tokens == (len(prompts[0]) - 1) // model.block_size * model.block_size
    assert check_outputs(model, outs, params) == 0  # (the model holds the new weights)
    assert {v for o in outs for v in o.cache_versions} == {version}
    standard = cached_model("tiny", "standard", "float32", 3, 0.1).twin("standard")
    assert check_outputs(standard, after_the_update(standard)[0], params) > 0  # the control


def test_a_continued_turn_after_a_shared_prompt():
    """Multi-turn requests that started on shared blocks: environment tokens appended, the next
    turn sampled; each whole sequence scores as the learner's. The control: on the standard kernels
    some sequence's log-probs are not the learner's."""
    prompts, params = groups(4, group=3, n=2)

    def two_turns(model):
        eng = parity.Engine(model, max_num_seqs=8)
        ids = [eng.add_request(p, q, multi_turn=True) for p, q in zip(prompts, params)]
        paused = {}
        while len(paused) < len(ids):
            for o in eng.step():
                paused[o.request_id] = o
        assert eng.scheduler.shared_tokens > 0
        for rid in ids:
            eng.continue_request(rid, [5, 6, 7])
        while eng.has_unfinished():
            eng.step()
        return [eng.release(rid) for rid in ids], eng

    def learner_and_engine(model, o):
        """The learner's and the engine's log-probs on the sampled tokens of one output."""
        with torch.no_grad():
            ref = parity.sequence_logprobs(model, [o.full_token_ids])[0][len(o.prompt_token_ids) - 1:]
        mask = torch.tensor(o.loss_mask, dtype=torch.bool)
        return ref[mask], torch.tensor(o.logprobs, dtype=torch.float32)[mask]

    model = cached_model("tiny", "aligned", "float32", 4, 0.1)
    outs, eng = two_turns(model)
    for o in outs:
        mask = torch.tensor(o.loss_mask, dtype=torch.bool)
        assert mask.sum() > len(o.loss_mask) - mask.sum() > 0
        assert torch.equal(*learner_and_engine(model, o))
    assert_blocks_all_back(eng)
    standard = cached_model("tiny", "standard", "float32", 4, 0.1)
    outs, _ = two_turns(standard)
    assert not all(torch.equal(*learner_and_engine(standard, o)) for o in outs)  # the control


def test_off_shares_nothing_and_bad_values_are_refused():
    model = cached_model("tiny", "aligned", "float32", 0, 0.1)
    with pytest.raises(InputError, match="prefix_caching must be True or False"):
        parity.Engine(model, prefix_caching="yes")


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(["grow", "share", "enter", "trim", "release", "forget"]),
                          st.integers(0, 5), st.integers(1, 90)), max_size=60),
       st.sampled_from([0, 40]))
def test_reference_counts_hold(ops, window):
    """Random grow / share / enter / trim / release / forget on a block manager (sequences built
    from three prompts that share heads): every block is free or held, never both; a block's count
    is the number of tables holding it; an indexed block is held; a block is zeroed only when the
    last table holding it lets it go."""
    def freed(blocks):  # (the cache zeroes these: none may still be held)
        assert not set(blocks) & set(bm.refs) and all(blocks)

    bm = BlockManager(24, 16, freed, window=window)
    base = [list(range(100)), list(range(40)) + [7] * 60, [3] * 100]
    length: dict[int, int] = {}
    for op, sid, n in ops:
        tokens = base[sid % 3]
        if op == "grow" and bm.can_grow(sid, length.get(sid, 0) + n):
            length[sid] = min(100, length.get(sid, 0) + n)
            bm.grow(sid, length[sid])
        elif op == "share" and not bm.owns(sid):
            blocks = bm.match(tokens, 99 // 16)
            if blocks:
                bm.share(sid, blocks)
                length[sid] = len(blocks) * 16
        elif op == "enter" and bm.owns(sid):
            bm.enter(sid, tokens, length[sid])
        elif op == "trim" and bm.owns(sid):
            bm.trim(sid, length[sid])
        elif op == "release":
            bm.release(sid)
            length.pop(sid, None)
        elif op == "forget":
            bm.forget()
        held: dict[int, int] = {}
        for table in bm.tables.values():
            for b in table:
                if b:
                    held[b] = held.get(b, 0) + 1
        assert held == bm.refs
        assert not set(held) & set(bm.free) and len(held) + len(bm.free) == 24
        assert set(bm.index.values()) <= set(held)
