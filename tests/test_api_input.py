"""Bad input through the public Python API (not the CLI): each case is refused in one line naming
the problem, where it used to run silently wrong, fail deep inside with another library's error,
or crash the process. From an audit of about 260 mistaken calls (2026-12-05, eighth session); the
kernel cases include the matrix-vector kernel that read past its weight and killed the process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import parity
from parity import InputError, SamplingParams
from parity.errors import CheckpointError, ConfigError
from parity.rl.learner import Learner
from parity.rl.trajectory import Trajectory, TrajectoryBatch


def _traj(**kw) -> Trajectory:
    fields = dict(token_ids=[1, 2, 3], loss_mask=[0, 0, 1], rollout_logprobs=[0.0, 0.0, -1.0],
                  policy_versions=[-1, -1, 0], reward=1.0, group_id=0)
    return Trajectory(**{**fields, **kw})


def _engine(model):
    return parity.Engine(model, kv_cache_tokens=256, max_num_seqs=4)


def test_a_one_dimensional_prompt_tensor_is_not_one_prompt_per_token(tiny):
    """generate(torch.tensor([5, 6, 7])) ran three one-token prompts; now it says to wrap it. So does
    a flat list of ids (a review, 2026-12-07: three outputs, each with an error)."""
    engine = _engine(tiny)
    with pytest.raises(InputError, match="got a 1-D Tensor .wrap one prompt in a list"):
        engine.generate(torch.tensor([5, 6, 7]), SamplingParams(max_tokens=2))
    with pytest.raises(InputError, match="got one list of ints .wrap one prompt in a list"):
        engine.generate([5, 6, 7], SamplingParams(max_tokens=2))
    assert len(engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))) == 1  # (the control)
    with pytest.raises(InputError, match="params must be a SamplingParams or a list of them, got dict"):
        engine.generate([[5, 6]], {"temperature": 1.0})
    with pytest.raises(InputError, match="before_step must be callable"):
        engine.generate([[5, 6]], SamplingParams(max_tokens=2), before_step=5)
    with pytest.raises(InputError, match="stop_token_ids: 999 is outside the vocabulary"):
        engine.add_request([5, 6], SamplingParams(max_tokens=2, stop_token_ids=[999]))
    with pytest.raises(InputError, match="multi_turn must be True or False"):
        engine.add_request([5, 6], SamplingParams(max_tokens=2), multi_turn="no")
    # the control: the same call with the prompt wrapped, a generator of params, runs
    outs = engine.generate(torch.tensor([[5, 6, 7]]), (SamplingParams(max_tokens=2) for _ in range(1)))
    assert len(outs) == 1 and outs[0].prompt_token_ids == [5, 6, 7] and len(outs[0].token_ids) == 2


def test_one_seed_shared_by_repeated_prompts_is_named(tiny, caplog):
    """A GRPO-style group drawn with one seeded SamplingParams is one sample repeated (no variance,
    nothing to learn): generate says so; a seed per request draws different samples, unwarned."""
    engine, group = _engine(tiny), [[5, 6, 7]] * 4
    with caplog.at_level("WARNING", logger="parity.engine.engine"):
        same = engine.generate(group, SamplingParams(max_tokens=8, seed=3))
    assert len({tuple(o.token_ids) for o in same}) == 1
    assert "one SamplingParams with seed=3 for repeated prompts" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="parity.engine.engine"):
        own = engine.generate(group, [SamplingParams(max_tokens=8, seed=i) for i in range(4)])
    assert len({tuple(o.token_ids) for o in own}) > 1 and "repeated prompts" not in caplog.text


def test_trajectory_fields_are_checked_by_what_they_mean():
    merged = TrajectoryBatch([_traj(group_id=1), _traj(group_id=2)])  # the control: two groups
    assert merged.group_ids.tolist() == [1, 2]
    assert TrajectoryBatch([_traj(reward=np.float32(0.5), group_id=np.int64(3))]).rewards.tolist() == [0.5]
    assert TrajectoryBatch([_traj(reward=3.4e38)]).rewards.isfinite().all()  # (float32's largest: kept)
    cases = [(dict(group_id=1.7), "group_id must be an integer, got 1.7"),  # (was group 1, merged)
             (dict(group_id="q17"), "group_id must be an integer"),
             (dict(reward=None), "reward None is not a finite number"),
             (dict(reward=3.5e38), r"reward 3.5e\+38 is not a finite number \(float32\)"),
             (dict(rollout_logprobs=[0.0, 0.0, "a"]), r"rollout_logprobs\[2\] = 'a' is not a finite"),
             (dict(loss_mask=[0, 0, 0], excluded="engine error: prompt too long"),
              "engine error: prompt too long, before it sampled a token; leave it out"),
             (dict(policy_versions=[-1, "a", 0]), r"policy_versions\[1\] = 'a' is not an integer"),
             (dict(policy_versions=[-1, -1, 0.5]), r"policy_versions\[2\] = 0.5 is not an integer"),
             (dict(cache_versions=[-1, -1, True]), r"cache_versions\[2\] = True is not an integer")]
    for kw, message in cases:
        with pytest.raises(InputError, match=message):
            TrajectoryBatch([_traj(**kw)])
    with pytest.raises(InputError, match="takes a list of Trajectory, got Trajectory"):
        TrajectoryBatch(_traj())
    as_tensor = TrajectoryBatch([_traj(policy_versions=torch.tensor([-1, -1, 0]))])  # integer tensors: fine
    assert as_tensor.versions.tolist() == [[-1, 0]]


def test_a_reward_that_is_not_a_number_is_named_at_from_output(tiny):
    out = _engine(tiny).generate([[5, 6]], SamplingParams(max_tokens=2))[0]
    assert Trajectory.from_output(out, np.float64(0.25), 0).reward == 0.25
    # ('1' was taken as 1.0; None a bare TypeError; 1e39 became inf in the batch's float32 rewards)
    from parity.envs.custom import finite_number

    assert finite_number(1e39, limit=float("inf")) == 1e39  # an env's metrics: Python floats, not float32
    for bad in (None, "1", float("nan"), 1e39, -1e39):
        with pytest.raises(InputError, match="is not a finite number"):
            Trajectory.from_output(out, bad, 0)
    with pytest.raises(InputError, match="takes an engine RequestOutput, got dict"):  # (an AttributeError)
        Trajectory.from_output(vars(out), 1.0, 0)


def test_the_learner_steps_under_no_grad_and_refuses_what_it_cannot_train():
    model = parity.Model(parity.ModelConfig.preset("tiny"), seed=3)
    learner = Learner(model)
    batch = TrajectoryBatch([_traj(), _traj(reward=0.0)])
    with torch.no_grad():  # (an autograd error naming no cause)
        metrics = learner.step(batch)
    assert learner.version == 1 and metrics["train/loss"] == metrics["train/loss"]
    with pytest.raises(InputError, match="policy version 5 in the batch is ahead of the learner's 1"):
        learner.step(TrajectoryBatch([_traj(policy_versions=[-1, -1, 5])]))
    lagged = Learner(parity.Model(parity.ModelConfig.preset("tiny"), seed=3), parity.rl.LearnerConfig(
        max_policy_lag=1))  # (a batch past the bound trained silently, its decomposition dropped)
    for _ in range(2):
        lagged.step(TrajectoryBatch([_traj(policy_versions=[-1, -1, lagged.version])] * 2))
    with pytest.raises(InputError, match="policy version 0 in the batch is 2 behind the learner's 2, beyond "
                                         "max_policy_lag=1"):
        lagged.step(TrajectoryBatch([_traj(policy_versions=[-1, -1, 0])]))
    assert lagged.step(TrajectoryBatch([_traj(policy_versions=[-1, -1, 1])]))["lag/max"] == 1  # the control
    with pytest.raises(InputError, match="takes a TrajectoryBatch, got list"):
        learner.step([_traj()])
    frozen = parity.Model(parity.ModelConfig.preset("tiny"), seed=3).requires_grad_(False)
    with pytest.raises(ConfigError, match="trainable parameters, got Model with none"):
        Learner(frozen)
    with pytest.raises(ConfigError, match="trainable parameters, got NoneType"):
        Learner(None)


@pytest.mark.parametrize("backend, call, message", [
    ("aligned", lambda K: K.linear(torch.randn(1, 64), torch.randn(64, 128)), r"x \(1, 64\) and weight \(64"),
    ("aligned", lambda K: K.linear(torch.randn(1, 64), torch.randn(128, 64), torch.randn(3)), r"bias \(3,\)"),
    ("aligned", lambda K: K.linear(torch.randn(1, 4_000_000), torch.randn(16, 64)), "not fit"),  # (crashed)
    ("aligned", lambda K: K.rms_norm(torch.randn(2, 4_000_000), torch.ones(8), 1e-6), "weight has 8 entries"),
    *[(b, lambda K: K.token_logprobs(torch.randn(2, 16), torch.tensor([3]), 1.0), "one target per row")
      for b in ("aligned", "standard")],  # (silently broadcast to both rows)
    *[(b, lambda K: K.token_logprobs(torch.randn(2, 16), torch.tensor([3, 4]), 0.0), "positive finite temp")
      for b in ("aligned", "standard")],  # (a ZeroDivisionError)
    *[(b, lambda K: K.token_logprobs(torch.randn(2, 16), torch.tensor([3, 16]), 1.0),
       r"in \[0, 16\), got 3..16")
      for b in ("aligned", "standard")],  # (torch's index error, out of the kernel)
    *[(b, lambda K: K.token_logprobs(torch.randn(2, 16), torch.tensor([3.0, 1.0]), 1.0), "integer token ids")
      for b in ("aligned", "standard")],
])
def test_kernels_refuse_shapes_that_do_not_fit(backend, call, message):
    """The native kernels read through raw pointers: shapes are checked before they run (the
    standard backend's PyTorch ops check their own, but not the log-prob arguments)."""
    K = parity.get_kernels(backend)
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        call(K)


def test_kernels_control_fitting_shapes_run():
    K = parity.get_kernels("aligned")
    x, w, b = torch.randn(3, 64), torch.randn(128, 64), torch.randn(128)
    with torch.no_grad():
        assert torch.allclose(K.linear(x, w, b), x @ w.T + b, atol=1e-4)
        assert K.token_logprobs(torch.randn(2, 16), torch.tensor([3, 4]), 1.0).shape == (2,)


def test_decoder_engine_and_model_sizes_are_checked(tiny):
    from parity import Decoder
    for bad in (-100, 0, 1.5, "x", None):
        with pytest.raises(InputError, match="max_tokens must be a positive integer"):
            Decoder(tiny, max_tokens=bad)
    with pytest.raises(InputError, match="Decoder needs a parity.Model, got NoneType"):
        Decoder(None)
    dec = Decoder(tiny, max_tokens=64)
    with pytest.raises(InputError, match="a mapping of sequence id -> new tokens, got list"):
        dec.extend([[1, 2]])
    assert dec.extend({0: [1, 2]})[0].shape == (tiny.config.vocab_size,)  # the control
    with pytest.raises(InputError, match=r"a KV cache of [\d,]+ tokens takes [\d,.]+ GiB; [\d,.]+ GiB are"):
        parity.Engine(tiny, kv_cache_tokens=10**12)
    with pytest.raises(InputError, match="sequence_logprobs needs a parity.Model, got NoneType"):
        parity.sequence_logprobs(None, [[1, 2]])
    with pytest.raises(ConfigError, match="cannot be built here"):
        parity.Model(parity.ModelConfig.preset("tiny", vocab_size=10**12))
    with pytest.raises(ValueError, match="got 2 sequences, 1 start positions"):  # (an IndexError inside)
        parity.ForwardBatch.build([[1, 2], [3]], [0], tiny.block_size)


def test_values_that_overflow_the_models_dtype_are_not_finite(tiny, tmp_path):
    """1e39 is finite in float64 and inf in float32 (3.4e38 likewise from float32 to bfloat16):
    checked after the cast, where they were accepted and sampled NaN log-probs."""
    engine = _engine(parity.Model(parity.ModelConfig.preset("tiny"), seed=1))  # (its weights change)
    name, weight = "model.norm.weight", tiny.state_dict()["model.norm.weight"]
    with pytest.raises(InputError, match="norm.weight contains NaN or inf in the model's torch.float32"):
        engine.update_weights({name: torch.full(weight.shape, 1e39, dtype=torch.float64)}, 1)
    engine.update_weights({name: weight.double()}, 1)  # the control: a float64 copy that fits
    big = parity.Model(parity.ModelConfig.preset("tiny"), seed=0)
    with torch.no_grad():
        big.model.norm.weight.fill_(3.4e38)
    parity.model.save_pretrained(big, tmp_path / "ckpt")
    assert parity.load_model(tmp_path / "ckpt").model.norm.weight[0] == torch.tensor(3.4e38)
    with pytest.raises(CheckpointError, match="contains NaN or inf as torch.bfloat16"):
        parity.load_model(tmp_path / "ckpt", dtype=torch.bfloat16)
    with pytest.raises(CheckpointError, match="block_size must be a positive multiple of 16, got 0"):
        parity.load_model(tmp_path / "ckpt", block_size=0)


def test_rope_scaling_must_be_finite():
    base = parity.ModelConfig.preset("tiny-llama").rope_scaling
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="rope_scaling.factor must be a positive finite number"):
            parity.ModelConfig.preset("tiny-llama", rope_scaling={**base, "factor": bad})


def test_model_forward_checks_its_tokens_and_positions_on_the_cpu(tiny):
    """`Model.forward` called directly (the engine and `sequence_logprobs` check first): ids outside
    the vocabulary and positions past max_position_embeddings were torch's IndexError from inside
    the embedding or the RoPE table."""
    def forward(tokens):
        with torch.no_grad():
            return tiny(parity.ForwardBatch.build([torch.tensor(tokens)], [0], tiny.block_size))
    with pytest.raises(InputError, match=r"Model.forward: token id 200 is outside the vocabulary \(vocab"):
        forward([5, 200, 3])
    with pytest.raises(InputError, match=r"positions 0..599 are outside 0..511 \(max_position_embeddings"):
        forward([1] * 600)
    assert forward([5, 127, 3]).shape == (3, tiny.config.hidden_size)  # the control
    assert forward([1] * 512).shape == (512, tiny.config.hidden_size)


def test_a_config_changed_after_construction_is_checked_when_the_model_is_built():
    """`ModelConfig` checks its fields on construction; one set afterwards was built as given (a
    negative vocabulary was the allocator's error, heads that do not divide a shape error deep in
    the build)."""
    for field, bad, message in (("vocab_size", -3, "vocab_size must be a positive integer"),
                                ("num_attention_heads", 5, "num_key_value_heads=2 does not divide"),
                                ("rms_norm_eps", float("nan"), "rms_norm_eps must be a positive finite")):
        cfg = parity.ModelConfig.preset("tiny")
        setattr(cfg, field, bad)
        with pytest.raises(ConfigError, match=message):
            parity.Model(cfg)
    cfg = parity.ModelConfig.preset("tiny")
    cfg.num_hidden_layers = 3  # the control: a valid change builds
    assert len(parity.Model(cfg).model.layers) == 3


def test_an_unknown_keyword_names_the_class_and_the_nearest_field():
    """ModelConfig(foo=1), LearnerConfig(lrr=1), SamplingParams(temprature=1.0), TrainConfig(stepz=1)
    raised Python's TypeError ("__init__() got an unexpected keyword argument"), not a ParityError;
    `dataclasses.replace` too. A right keyword still builds the object."""
    import dataclasses

    from parity.config import LearnerConfig, TrainConfig
    from parity.envs.sandbox import SandboxLimits

    cases = [(lambda: parity.ModelConfig(foo=1), ConfigError, "unknown ModelConfig field.s.: foo$"),
             (lambda: LearnerConfig(lrr=1e-3), ConfigError, r"field.s.: lrr \(did you mean lr\?\)"),
             (lambda: SamplingParams(temprature=1.0), InputError, "did you mean temperature"),
             (lambda: dataclasses.replace(TrainConfig(), stepz=3), ConfigError, "did you mean steps"),
             (lambda: SandboxLimits(wall=1.0), ConfigError, "did you mean wall_s"),
             (lambda: SamplingParams(*range(30)), InputError, "SamplingParams takes at most")]
    for build, error, message in cases:
        with pytest.raises(error, match=message):
            build()
    assert dataclasses.replace(TrainConfig(), steps=3).steps == 3
    assert SamplingParams(temperature=0.5).temperature == 0.5


def test_a_decoder_release_of_a_sequence_it_does_not_hold_is_one_line(tiny):
    """`Decoder.release(42)` of an id it never held, or a second release, did nothing (a review,
    2026-12-07); `Engine.release` refused the same. The control: a release of a held sequence frees
    its blocks."""
    dec = parity.Decoder(tiny, max_tokens=256)
    free = dec.blocks.free_blocks
    dec.extend({7: [5, 6, 7]})
    assert dec.blocks.free_blocks != free
    dec.release(7)
    assert dec.blocks.free_blocks == free
    for seq in (7, 42):
        with pytest.raises(InputError, match=f"release: sequence {seq} is not in this decoder"):
            dec.release(seq)
