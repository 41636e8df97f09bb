"""A sliding-window model's KV cache: its sliding layers keep about a window of blocks per sequence.

Gemma 2/3, OLMo 3 and the like mix full layers with sliding ones; the engine keeps the sliding
layers in blocks of their own (`KVCache`'s window group), sized for every running sequence's window
(`memory.plan_cache`), and a sequence gives those blocks back as its window passes them
(`BlockManager.trim`); a model whose every layer slides is all window group. Proofs: the same
tokens and log-probs, bit for bit, as with every layer in one numbering (the control that trimming
happened: each sequence held at most a window's blocks in the window group while its context grew
several windows long), the learner's log-probs equal the engine's, and under cache pressure
(preemption in both groups) nothing changes either.
"""

from __future__ import annotations

import random

import pytest

import parity
from parity import SamplingParams
from parity.engine import memory
from tests.conftest import cached_model
from tests.engine.test_engine import check_outputs, differing


def _workload(seed: int, n: int = 6):
    rnd = random.Random(seed)
    prompts = [[rnd.randrange(128) for _ in range(rnd.randint(5, 60))] for _ in range(n)]
    params = [SamplingParams(temperature=rnd.choice([0.7, 1.0]), max_tokens=rnd.randint(30, 90),
                             seed=rnd.randrange(100), ignore_eos=True) for _ in range(n)]
    return prompts, params


def _run(model, prompts, params, cache_tokens=None, budget=48):
    """Every output, the engine, and the most blocks any sequence held in each cache group."""
    eng = parity.Engine(model, max_num_seqs=6, max_num_batched_tokens=budget, kv_cache_tokens=cache_tokens)
    ids = {eng.add_request(p, q): i for i, (p, q) in enumerate(zip(prompts, params))}
    outs, most = {}, [0] * len(eng.blocks.groups)
    while eng.has_unfinished():
        for o in eng.step():
            outs[ids[o.request_id]] = o
        for g, group in enumerate(eng.blocks.groups):
            most[g] = max([most[g], *(sum(1 for b in t if b) for t in group.tables.values())])
    return [outs[i] for i in range(len(prompts))], eng, most


@pytest.mark.parametrize("preset, dtype", [("tiny-gemma3", "float32"), ("tiny-gemma2", "bfloat16")])
def test_sliding_layers_give_back_blocks_behind_the_window_and_keep_the_bits(preset, dtype, monkeypatch):
    """The control: on the standard kernels the trimmed engine records log-probs the learner does not
    reproduce (the trimmed and the whole cache give the same bits there too: no control for that)."""
    model = cached_model(preset, "aligned", dtype, 3, 0.1)
    window, bs = model.config.sliding_window, model.block_size  # 24 keys, 32 a block
    prompts, params = _workload(1)
    outs, eng, most = _run(model, prompts, params)
    info = eng.cache_info
    assert eng.runner.cache.num_groups == 2 and info["window_blocks"] < info["tokens"] // bs
    assert "sliding layers in" in eng.describe_cache()
    longest = max(len(o.full_token_ids) for o in outs)
    assert longest > 4 * window and most[0] == -(-longest // bs)  # the full layers: every block
    assert most[1] <= -(-window // bs) + 2  # the sliding layers: a window's (the control: trimmed)
    assert check_outputs(model, outs, params) == 0  # the learner's log-probs, bit for bit
    standard = cached_model(preset, "standard", dtype, 3, 0.1)
    assert check_outputs(standard, _run(standard, prompts, params)[0], params) > 0  # the control
    monkeypatch.setattr(parity.engine.engine, "plan_cache", lambda *a: (memory.plan_cache(*a)[0], None))
    whole, one, _ = _run(model, prompts, params)  # every layer in one numbering, nothing trimmed
    assert one.runner.cache.num_groups == 1
    for a, b in zip(outs, whole):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_a_model_whose_every_layer_slides_holds_only_windows(monkeypatch):
    """Mistral v0.1 / Phi-3-mini-like (every layer slides over 40 keys): one window group, so a
    sequence of any length holds at most a window's blocks, and the engine's capacity is the
    context; the same tokens and log-probs as a cache that keeps every position. The control: on
    the standard kernels the engine records log-probs the learner does not reproduce (the window
    and the whole cache give the same bits there too: no control for that)."""
    model = cached_model("tiny-mistral", "aligned", "float32", 3, 0.1)
    window, bs = model.config.sliding_window, model.block_size
    prompts, params = _workload(3)
    outs, eng, most = _run(model, prompts, params)
    assert eng.runner.cache.windows == [window] and eng.blocks.capacity_tokens == 512
    assert "every layer slides over 40 keys" in eng.describe_cache()
    assert max(len(o.full_token_ids) for o in outs) > 3 * window and most[0] <= -(-window // bs) + 2
    assert check_outputs(model, outs, params) == 0
    standard = cached_model("tiny-mistral", "standard", "float32", 3, 0.1)
    assert check_outputs(standard, _run(standard, prompts, params)[0], params) > 0  # the control
    monkeypatch.setattr(parity.engine.engine, "plan_cache", lambda *a: (64, None))  # every position kept
    whole, one, _ = _run(model, prompts, params)
    assert one.runner.cache.windows == [0]
    for a, b in zip(outs, whole):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_a_prompt_longer_than_a_small_window_cache_is_fed_in_what_fits():
    """Every layer slides over 40 keys, the cache holds 128 tokens (4 blocks), so a 200-token prompt
    fits as its window moves (the capacity says 512): with a budget that takes the prompt in one
    step, the waiting request was refused ("KV cache too small for 200 tokens", nothing sampled)
    while a 32-token budget chunked it and ran. A lone request is now fed what fits, chunked like
    the small budget's run: the same tokens and log-probs, the learner's bit for bit. The control:
    on the standard kernels the run's log-probs are not the learner's (both budgets feed the same
    chunks, so their runs are the same bits on any kernels)."""
    model = cached_model("tiny-mistral", "aligned", "float32", 3, 0.1)
    prompt, params = [i % 128 for i in range(200)], [SamplingParams(max_tokens=6, seed=0, ignore_eos=True)]
    runs = []
    for budget in (2048, 32):
        eng = parity.Engine(model, max_num_seqs=1, max_num_batched_tokens=budget, kv_cache_tokens=128)
        assert eng.blocks.capacity_tokens == 512
        runs.append(eng.generate([prompt], params[0]))
    assert runs[0][0].error is None and runs[0][0].finish_reason == "length"
    assert runs[0][0].token_ids == runs[1][0].token_ids and runs[0][0].logprobs == runs[1][0].logprobs
    assert check_outputs(model, runs[0], params) == 0
    standard = cached_model("tiny-mistral", "standard", "float32", 3, 0.1)
    eng = parity.Engine(standard, max_num_seqs=1, max_num_batched_tokens=2048, kv_cache_tokens=128)
    assert check_outputs(standard, eng.generate([prompt], params[0]), params) > 0  # the control


def test_cache_pressure_in_both_groups_changes_nothing():
    """A cache of 6 full blocks and as many window ones: sequences are preempted and recomputed
    (the window group's trimmed entries with them); tokens and log-probs are those of a roomy
    cache, and every block of both groups is given back and cleared at the end. The control: on the
    standard kernels the preempted run records other bits than the roomy one."""
    model = cached_model("tiny-gemma3", "aligned", "float32", 4, 0.1)
    prompts, params = _workload(2, 4)
    roomy, _, _ = _run(model, prompts, params)
    tight, eng, _ = _run(model, prompts, params, cache_tokens=6 * model.block_size)
    assert eng.scheduler.num_preemptions > 0 and eng.cache_info["window_blocks"] == 6
    for a, b in zip(roomy, tight):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    for group, k, v in zip(eng.blocks.groups, eng.runner.cache._k, eng.runner.cache._v):
        assert not group.tables and len(group.free) == group.num_blocks
        assert k[:, :-1].count_nonzero() == 0 and v[:, :-1].count_nonzero() == 0
    standard = cached_model("tiny-gemma3", "standard", "float32", 4, 0.1)
    roomy, tight = (_run(standard, prompts, params, n)[0] for n in (None, 6 * model.block_size))
    assert differing(roomy, tight) > 0  # the control


def test_the_plan_spends_the_budget_on_the_full_layers():
    """With a memory budget, the window group takes what every running sequence's window needs
    and the full layers the rest: more full-context tokens than one numbering for every layer."""
    model = parity.Model(parity.ModelConfig.preset("tiny-gemma3"), seed=0)
    budget = 2 << 20
    blocks, window = memory.plan_cache(model, None, budget, 8, 64)
    per_layer = parity.model.KVCache.bytes_per_token(model.config, model.dtype, 1) * model.block_size
    assert window == 8 * (1 + 2) + 2 and blocks == (budget - window * per_layer) // per_layer
    assert blocks > budget // (2 * per_layer)  # one numbering: both layers in every block
    dense = parity.Model(parity.ModelConfig.preset("tiny"), seed=0)
    assert memory.plan_cache(dense, None, budget, 8, 64)[1] is None


def test_decode_graphs_and_the_decoder_trim_with_the_same_bits():
    """The `Decoder` (parity check's prefill/decode and graph cases) keeps the sliding layers in a
    window group too: chunked prefill, decode steps and decode graphs (emulated: both groups'
    tables and slots in the static step) past several windows give the learner's bits. The control:
    on the standard kernels the same cases find mismatches."""
    from parity.invariance import run_checks
    model = cached_model("tiny-gemma3", "aligned", "float32", 5, 0.1)
    results = run_checks(model, rounds=2, seed=4, max_len=128, cases=("decode", "graphs"))
    assert all(r.comparisons > 0 and r.mismatches == 0 for r in results), results
    standard = cached_model("tiny-gemma3", "standard", "float32", 5, 0.1)
    controls = run_checks(standard, rounds=2, seed=4, max_len=128, cases=("decode", "graphs"))
    assert any(r.mismatches > 0 for r in controls), controls  # the control
    dec = parity.Decoder(model, max_tokens=512)
    assert dec.cache.num_groups == 2
    dec.extend({0: list(range(100))})
    dec.extend({0: [7]})  # (trimmed as the next forward starts: position 100 sees keys 77..100)
    window = dec.blocks.groups[1].tables[0]
    assert window[:2] == [0, 0] and all(window[2:])  # (positions 0..63 are behind every later window)


def test_a_paused_session_keeps_a_window_of_blocks_and_tables_stay_plain_sequences():
    """(2026-12-06 review) A multi-turn request paused right after a long prefill kept that whole
    prefill's sliding blocks (7 of a 14-block window group: idle sessions were preempted while the
    full layers had room); it is trimmed as it pauses. And a block-table row given as a tuple is
    one table again (it was read as a pair of group tables: a TypeError)."""
    model = cached_model("tiny-gemma3", "aligned", "float32", 6, 0.1)
    eng = parity.Engine(model, max_num_seqs=2, max_num_batched_tokens=256, kv_cache_tokens=32 * 40)
    rid = eng.add_request(list(range(1, 120)) * 2, SamplingParams(max_tokens=1, temperature=0.0),
                          multi_turn=True)
    while eng.has_unfinished():
        eng.step()
    held = sum(1 for b in eng.blocks.groups[1].tables[rid] if b)
    assert held <= -(-model.config.sliding_window // model.block_size) + 1, held  # (was 7)
    eng.continue_request(rid, [7, 8, 9])  # (its next turn on the trimmed cache)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [(o.request_id, o.error, eng.scheduler.num_preemptions) for o in outs] == [(rid, None, 0)]
    batch = parity.model.ForwardBatch.build([[1, 2, 3]], [0], 32, [(1,)])
    assert batch.block_tables.tolist() == [[1]] and batch.window_tables is None
