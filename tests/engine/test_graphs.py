"""Decode graphs (`parity/engine/graphs.py`): a decode step padded to its batch bucket gives the
eager step's bits on aligned kernels, and not on standard ones (the control).

On a CPU there is no capture: mode 'emulate' runs the graphs' static step — the packed inputs,
the padding rows at query position -1 writing to the scratch slot, tables padded to the width
bucket — eagerly, which is exactly what a replayed CUDA graph computes. On a GPU the bitwise
suite's `graphs` case (tests/parity, `PARITY_TEST_DEVICE=cuda`) replays real CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

import parity
from parity.config import RolloutSection, TrainConfig, config_from_dict
from parity.engine import Decoder, Engine, SamplingParams
from parity.engine.graphs import batch_bucket, mode_for, unsupported, width_bucket
from parity.errors import ConfigError
from parity.invariance import reference, run_checks


def _model(kernels: str, dtype=torch.float32, preset: str = "tiny"):
    model = parity.Model(parity.ModelConfig.preset(preset), kernels=kernels, dtype=dtype, seed=0)
    model.reset_parameters(0, 0.1)
    return model.to(dtype)


def _decode_runs(model, sizes=(1, 3, 5, 13, 30), steps=5) -> tuple[int, int, list]:
    """(rows compared, rows differing, decoders) between eager and emulated-graph decode steps:
    for each batch size, the same prompts and tokens, one Decoder per mode."""
    compared = differ = 0
    decoders = []
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        lens = torch.randint(1, 40, (n,), generator=gen).tolist()
        prompts = {i: torch.randint(0, model.config.vocab_size, (lens[i],), generator=gen) for i in range(n)}
        nxt = torch.randint(0, model.config.vocab_size, (steps, n), generator=gen)
        got = {}
        for mode in ("off", "emulate"):
            dec = Decoder(model, max_tokens=4096, graphs=mode)
            dec.extend(prompts)
            got[mode] = [dec.extend({i: nxt[s, i:i + 1] for i in range(n)}) for s in range(steps)]
            decoders.append(dec)
        for eager, graphed in zip(got["off"], got["emulate"]):
            for i in range(n):
                compared += 1
                differ += not torch.equal(eager[i], graphed[i])
    return compared, differ, decoders


# (bf16 on `small`: on `tiny` the standard kernels' bf16 rows came back the same padded or not on an
# AVX2 CPU, so the bf16 case could not fail there; `small`'s wider products do move)
PADDED = [(torch.float32, "tiny"), (torch.bfloat16, "small")]


@pytest.mark.parametrize("dtype, preset", PADDED)
def test_padded_decode_steps_give_the_eager_bits(dtype, preset):
    compared, differ, decoders = _decode_runs(_model("aligned", dtype, preset))
    assert compared == 5 * (1 + 3 + 5 + 13 + 30) and differ == 0
    graphed = [d for d in decoders if d.runner.graphs is not None]
    assert sum(d.runner.graphs.replays for d in graphed) == 5 * 5  # every decode step took the graph path
    assert {key[0] for d in graphed for key in d.runner.graphs.graphs} == {1, 4, 8, 16, 32}


@pytest.mark.parametrize("dtype, preset", PADDED)
def test_control_standard_kernels_see_the_padding(dtype, preset):
    """Padding 5 rows to 8, 13 to 16, 30 to 32 changes the standard GEMMs' rows: the test can fail."""
    compared, differ, _ = _decode_runs(_model("standard", dtype, preset))
    assert differ > 0, "standard kernels gave padded rows the eager bits: the padding test proves nothing"


def test_padding_rows_never_touch_a_sequences_blocks():
    model = _model("aligned")
    dec = Decoder(model, max_tokens=1024, graphs="emulate")
    dec.extend({0: [1, 2, 3], 1: [4, 5, 6, 7, 8]})
    for tok in range(4):  # 2 sequences padded to 2 (no padding), then 3 to 4 (one padding row)
        dec.extend({0: [tok], 1: [tok + 1], **({2: [tok + 2]} if tok else {2: [9, 9]})})
    cache = dec.cache
    assert dec.runner.graphs.replays == 3
    assert not cache.k[:, 0].any() and not cache.v[:, 0].any(), "padding wrote into the pad block"
    scratch = cache.scratch_slot // cache.block_size
    assert scratch == cache.num_blocks + 1 and cache.k[:, scratch].any()
    owned = {b for t in dec.blocks.tables.values() for b in t}
    assert scratch not in owned and 0 not in owned


def test_the_engine_samples_the_same_run_with_graphs():
    """Generation through emulated graphs: the same tokens and log-probs as eager steps, and the
    learner's log-probs bit for bit. The control: on the standard kernels the graphs' padded steps
    record other bits than eager ones."""
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [3] * 20, [7, 1]]
    params = [SamplingParams(temperature=1.0, max_tokens=n, seed=i, ignore_eos=True)
              for i, n in enumerate((9, 4, 12, 1))]

    def eager_and_graphed(model):
        runs = {}
        for mode in ("off", "emulate"):
            engine = Engine(model, max_num_seqs=4, kv_cache_tokens=2048, graphs=mode)
            runs[mode] = engine.generate(prompts, params)
            if mode == "emulate":
                assert engine.runner.graphs.replays > 0
        return runs

    model = _model("aligned")
    runs = eager_and_graphed(model)
    for eager, graphed, prompt in zip(runs["off"], runs["emulate"], prompts):
        assert eager.token_ids == graphed.token_ids
        assert torch.equal(torch.tensor(eager.logprobs), torch.tensor(graphed.logprobs))
        ref = reference(model, [torch.tensor(graphed.full_token_ids)])[0][len(prompt) - 1:]
        assert torch.equal(ref, torch.tensor(graphed.logprobs, dtype=torch.float32))
    runs = eager_and_graphed(_model("standard"))
    assert any(a.token_ids != b.token_ids or a.logprobs != b.logprobs
               for a, b in zip(runs["off"], runs["emulate"]))  # the control


def test_the_graphs_case_of_parity_check():
    aligned = run_checks(_model("aligned"), rounds=2, seed=1, cases=("graphs",))
    assert aligned[0].comparisons > 0 and aligned[0].mismatches == 0
    standard = run_checks(_model("standard"), rounds=3, seed=1, cases=("graphs",))
    assert standard[0].mismatches > 0  # the control


def test_in_place_weight_updates_reach_the_graphs_and_new_storage_recaptures():
    model = _model("aligned")
    decs = {mode: Decoder(model, max_tokens=1024, graphs=mode) for mode in ("emulate", "off")}
    before, after = {}, {}
    for mode, dec in decs.items():  # both decoders through the same history
        dec.extend({0: [1, 2], 1: [3]})
        before[mode] = dec.extend({0: [4], 1: [5]})
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)  # in place: the same storage, so the graphs stay
    for mode, dec in decs.items():
        after[mode] = dec.extend({0: [6], 1: [7]})
    graphs = decs["emulate"].runner.graphs
    assert graphs.graphs and graphs.replays == 2
    for i in (0, 1):
        assert torch.equal(after["emulate"][i], after["off"][i])
        assert not torch.equal(before["emulate"][i], after["emulate"][i])
    model.set_kernels("standard")  # another backend: what was captured is dropped
    decs["emulate"].extend({0: [8], 1: [9]})
    assert graphs._key[0] == "standard" and graphs.replays == 3


def test_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 9, 17, 25, 33, 100, 129, 200, 257)] == \
        [1, 2, 4, 8, 16, 24, 32, 48, 128, 160, 224, 288]
    assert all(batch_bucket(n) >= n for n in range(1, 600))
    assert [width_bucket(b, 40) for b in (1, 2, 3, 5, 17, 33, 40)] == [1, 2, 4, 8, 32, 40, 40]


def test_what_is_not_graphed():
    moe = _model("aligned", preset="tiny-moe")
    assert "mixture-of-experts" in unsupported(moe)
    assert mode_for(moe, "emulate") is None and mode_for(_model("aligned"), "auto") is None  # CPU: eager
    assert mode_for(_model("aligned"), "emulate") == "emulate"
    with pytest.raises(ConfigError, match="decode graphs must be one of"):
        Engine(_model("aligned"), kv_cache_tokens=256, graphs="sometimes")
    with pytest.raises(ConfigError, match="rollout.cuda_graphs must be true or false"):
        RolloutSection(cuda_graphs="yes")
    with pytest.raises(ConfigError, match="rollout.cuda_graphs must be true or false"):
        config_from_dict({"rollout": {"cuda_graphs": "yes"}})
    assert TrainConfig().rollout.cuda_graphs is True


def test_a_failed_capture_names_its_first_cause():
    from parity.engine.graphs import _first_cause
    try:
        try:
            raise RuntimeError("operation not permitted when stream is capturing")
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")  # noqa: B904 - the implicit context, as torch.cuda.graph.__exit__ leaves it
    except RuntimeError as err:
        assert _first_cause(err) == "RuntimeError: operation not permitted when stream is capturing"
    assert _first_cause(ValueError("bad\nsecond line")) == "ValueError: bad"
