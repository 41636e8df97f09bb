"""Learner proofs: exact importance weights at lag 0, zero kernel mismatch at every lag with
aligned kernels (non-zero with standard ones), micro-batch invariance, bf16 master weights,
and bad input / non-finite steps handled without damage."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import parity
from parity import InputError, SamplingParams
from parity.rl import Learner, LearnerConfig, Trajectory, TrajectoryBatch, get_loss, group_advantages
from parity.rl.learner import micro_batches
from parity.rl.losses import LossConfig


def model(kernels="aligned", dtype=torch.float32, seed=0, preset="tiny"):
    m = parity.Model(parity.ModelConfig.preset(preset), kernels=kernels, dtype=dtype, seed=seed)
    m.reset_parameters(seed, 0.1)
    return m.to(dtype)


def fail_on_call(monkeypatch, owner, name: str, n: int, error: BaseException) -> None:
    """`owner.name` raises `error` on its n-th call and works as before on every other."""
    real, calls = getattr(owner, name), []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, flaky)


def rollout(engine, n_groups=3, group_size=4, max_tokens=12, seed=0):
    """Sample groups of responses; reward: fraction of even tokens (something to learn)."""
    prompts, params = [], []
    for g in range(n_groups):
        for k in range(group_size):
            prompts.append([1 + g, 2 + g, 3 + g])
            params.append(SamplingParams(max_tokens=max_tokens, seed=seed * 1000 + g * 10 + k))
    outs = engine.generate(prompts, params)
    return TrajectoryBatch([
        Trajectory.from_output(o, sum(t % 2 == 0 for t in o.token_ids) / len(o.token_ids), i // group_size)
        for i, o in enumerate(outs)])


def test_lag_zero_weights_are_exactly_one_and_gradient_equals_on_policy():
    m = model()
    batch = rollout(parity.Engine(m, max_num_seqs=5, max_num_batched_tokens=16))
    adv = group_advantages(batch.rewards, batch.group_ids)
    grads = {}
    for name in ("reinforce_zero", "on_policy"):
        m.zero_grad(set_to_none=True)
        lp = batch.pad(parity.sequence_logprobs(m, batch.sequences))
        w = torch.exp(lp.detach() - batch.rollout_logprobs)[batch.mask.bool()]
        assert torch.equal(w, torch.ones_like(w))
        loss, _ = get_loss(name)(lp, batch.rollout_logprobs, batch.mask, adv, LossConfig())
        loss.backward()
        grads[name] = [p.grad.clone() for p in m.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads["reinforce_zero"], grads["on_policy"]))
    assert any(g.abs().sum() > 0 for g in grads["on_policy"])


def ragged_batch(seed=1) -> TrajectoryBatch:
    """12 responses of 3 to 15 tokens: micro-batches of a few token rows, where a GEMM's rows
    depend on how many there are under the standard kernels (from 12 rows up they did not, on an
    AVX2 CPU: a batch of 15-token responses could not tell the kernels apart)."""
    outs = parity.Engine(model(seed=seed), max_num_seqs=8).generate(
        [[1 + i % 5] * (2 + i % 3) for i in range(12)],
        [SamplingParams(max_tokens=1 + (i * 5) % 11, seed=i) for i in range(12)])
    return TrajectoryBatch([Trajectory.from_output(o, float(i % 2), i // 4) for i, o in enumerate(outs)])


def test_learner_logprobs_do_not_depend_on_micro_batch_size():
    batch = ragged_batch()
    assert min(len(s) for s in batch.sequences) <= 4
    differ = []
    for kernels in ("aligned", "standard"):  # the second, the control: some micro-batch size differs
        learner = Learner(model(kernels, seed=1), LearnerConfig())
        ref = learner.logprobs(batch, micro_batch_size=len(batch))
        differ.append([not torch.equal(learner.logprobs(batch, micro_batch_size=mb), ref)
                       for mb in (1, 2, 5)])
    assert not any(differ[0]) and any(differ[1]), differ


def test_a_top_k_sample_is_weighted_against_the_distribution_it_was_drawn_from():
    """μ of a token drawn under top-k is the truncated distribution's probability: with the full
    one every weight at lag 0 would be exactly 1 and the truncation uncorrected."""
    m = model(seed=5)
    outs = parity.Engine(m, max_num_seqs=4).generate(
        [[1, 2, 3]] * 4, [SamplingParams(max_tokens=10, top_k=2, seed=k) for k in range(4)])
    batch = TrajectoryBatch([Trajectory.from_output(o, float(i % 2), 0) for i, o in enumerate(outs)])
    assert [t.rollout_logprobs[3:] for t in batch.trajectories] == [o.sampled_logprobs for o in outs]
    assert any(o.sampled_logprobs != o.logprobs for o in outs)  # the control: the two differ
    w = torch.exp(batch.pad(parity.sequence_logprobs(m, batch.sequences)) - batch.rollout_logprobs)
    assert bool((w[batch.mask.bool()] <= 1).all()) and bool((w[batch.mask.bool()] < 1).any())


@pytest.mark.parametrize("loss, key, cfg", [("tis", "frac_truncated", {"tis_cap": 1.0}),
                                             ("icepop", "frac_masked", {"icepop_low": 0.99}),
                                             ("mis", "frac_masked", {"mis_cap": 1.01}),
                                             ("ppo_clip", "frac_clipped", {"ppo_eps": 0.01}),
                                             ("cispo", "frac_clipped", {"cispo_eps_low": 0.01,
                                                                        "cispo_eps_high": 0.01})])
def test_loss_fractions_are_the_whole_batchs_whatever_the_micro_batches(loss, key, cfg):
    """A token fraction is Σ tokens counted / Σ tokens over the batch: averaging the micro-batches'
    fractions by response count gave 0.0645, 0.0634 and 0.0536 for one batch at 12, 5 and 1."""
    batch = rollout(parity.Engine(model(seed=3), max_num_seqs=8), seed=3)  # another policy sampled it
    learner_lp = batch.pad(parity.sequence_logprobs(model(seed=4), batch.sequences))
    w = torch.exp(learner_lp - batch.rollout_logprobs)
    bound = {"tis": lambda: w > 1.0, "icepop": lambda: (w < 0.99) | (w > 5.0),
             "mis": lambda: w > 1.01,
             "ppo_clip": lambda: (w < 0.99) | (w > 1.01), "cispo": lambda: (w < 0.99) | (w > 1.01)}[loss]()
    expected = float((bound.float() * batch.mask).sum()) / float(batch.mask.sum())
    assert 0 < expected < 1
    for mb in (len(batch), 5, 1):
        config = LearnerConfig(loss=loss, micro_batch_size=mb, loss_config=LossConfig(**cfg),
                               decompose_every=0)
        assert Learner(model(seed=4), config).step(batch)[f"loss/{key}"] == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("aggregation", ["token", "constant"])
def test_token_level_losses_are_the_whole_batchs_whatever_the_micro_batches(aggregation):
    """Under aggregation 'token' a micro-batch's loss (its own token mean) counts for its share of
    the batch's tokens, not of its responses: the step's loss and gradient norm are the batch's
    token mean at every micro-batch size, responses of 2 to 12 tokens. The control: weighed by
    response count, micro-batches of one give another loss."""
    m = model(seed=5)
    prompts = [[1 + g, 2 + g, 3 + g] for g in range(3) for _ in range(4)]
    params = [SamplingParams(max_tokens=2 + 5 * (k % 3), seed=k) for k in range(12)]
    outs = parity.Engine(m, max_num_seqs=8).generate(prompts, params)
    batch = TrajectoryBatch([Trajectory.from_output(o, float(o.token_ids[-1] % 2), i // 4)
                             for i, o in enumerate(outs)])
    assert len(set(batch.mask.sum(1).tolist())) == 3
    losses = LossConfig(aggregation=aggregation, norm_tokens=16)
    with torch.no_grad():
        lp = batch.pad(parity.sequence_logprobs(model(seed=6), batch.sequences))
    adv = group_advantages(batch.rewards, batch.group_ids)
    loss = lambda i, j: float(get_loss("reinforce_zero")(  # noqa: E731
        lp[i:j], batch.rollout_logprobs[i:j], batch.mask[i:j], adv[i:j], losses)[0])
    steps = {}
    for mb in (len(batch), 5, 1):
        config = LearnerConfig(micro_batch_size=mb, loss_config=losses, decompose_every=0)
        steps[mb] = Learner(model(seed=6), config).step(batch)
        assert steps[mb]["train/loss"] == pytest.approx(loss(0, 12), rel=1e-5, abs=1e-9)
        assert steps[mb]["train/grad_norm"] == pytest.approx(steps[len(batch)]["train/grad_norm"], rel=1e-4)
    if aggregation == "token":  # the control: each micro-batch of one weighed 1/12, as a response
        assert abs(sum(loss(i, i + 1) for i in range(12)) / 12 - loss(0, 12)) > 1e-3 * abs(loss(0, 12))


def test_kl_penalty_starts_at_exactly_zero_and_a_resume_needs_its_reference(tmp_path):
    """At version 0 the reference (the learner's starting weights on the same kernels) scores the
    batch bit for bit as the learner does: the k3 penalty and its gradient are exactly 0, so the
    first step's weights equal a step without it. After an update the penalty is > 0 and the
    steps part; a reference on the standard kernels is off at version 0 already (the controls).
    A checkpoint without a reference cannot resume a KL run."""
    from parity.errors import CheckpointError
    from parity.rl.reference import restore_reference
    batch = rollout(parity.Engine(model(seed=7), max_num_seqs=8), seed=7)
    with_kl = Learner(model(seed=7), LearnerConfig(kl_coef=0.5, lr=3e-3, decompose_every=0))
    plain = Learner(model(seed=7), LearnerConfig(lr=3e-3, decompose_every=0))
    assert with_kl.step(batch)["train/kl_ref"] == 0.0 and "train/kl_ref" not in plain.step(batch)
    assert all(torch.equal(a, b) for a, b in zip(with_kl.model.parameters(), plain.model.parameters()))
    assert with_kl.step(batch)["train/kl_ref"] > 0
    plain.step(batch)
    other = Learner(model(seed=7), LearnerConfig(kl_coef=0.5, kl_estimator="k2", decompose_every=0))
    other.reference.model.set_kernels("standard")  # the control: a reference on other kernels is not 0
    assert other.step(batch)["train/kl_ref"] != 0
    assert not all(torch.equal(a, b) for a, b in zip(with_kl.model.parameters(), plain.model.parameters()))
    with pytest.raises(CheckpointError, match="saved by a run without a KL penalty"):
        restore_reference(with_kl.reference, None, tmp_path / "checkpoint-3")


def _train_with_lag(kernels, dtype="float32", lags=(0, 1, 2, 3)):
    """Generate a batch at each version, then train on batches that are `lag` versions old."""
    m = model(kernels, getattr(torch, dtype), seed=2)
    learner = Learner(m, LearnerConfig(lr=3e-3, compute_dtype=dtype, micro_batch_size=4, max_policy_lag=8))
    engine = parity.Engine(model(kernels, getattr(torch, dtype), seed=2), max_num_seqs=6,
                           max_num_batched_tokens=24)
    made, results = [], []  # made[v]: a batch sampled by the weights of version v
    for step, lag in enumerate(lags * 2):
        made.append(rollout(engine, seed=step))
        metrics = learner.step(made[max(0, step - lag)])
        results.append(metrics)
        state, version = learner.publish()
        engine.update_weights(state, version, mode="drain")
    return results


def test_aligned_kernel_mismatch_is_exactly_zero_at_every_lag():
    results = _train_with_lag("aligned")
    buckets = {k for r in results for k in r if k.startswith("mismatch/kernel_max_abs/lag_")}
    assert len(buckets) >= 3
    for r in results:
        assert r["mismatch/kernel_max_abs"] == 0.0
        for k in buckets & r.keys():
            assert r[k] == 0.0
    lagged = [r for r in results if r["lag/max"] > 0]
    assert lagged and all(r["mismatch/weight_lag_max_abs"] > 0 for r in lagged)
    assert all(r["is_weight/max"] == 1.0 == r["is_weight/min"] for r in results if r["lag/max"] == 0)


def _rows(learner, versions, gap, stale=False, seed=0):
    """Rows of 12 tokens (3 prompt) sampled at `versions`, no worker scores; μ = the learner path at
    the row's version minus `gap[i]`; `stale`: every token read keys/values one version older."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i, v in enumerate(versions):
        ids = torch.randint(1, 128, (12,), generator=gen).tolist()
        row = Trajectory(ids, [0] * 3 + [1] * 9, [0.0] * 12, [-1] * 3 + [v] * 9, float(i % 2), i // 2,
                         cache_versions=[-1] * 3 + [v - 1] * 9 if stale else None)
        lp = learner.logprobs(TrajectoryBatch([row]), version=v)[0]
        row.rollout_logprobs = [0.0] * 3 + [min(0.0, float(x)) - gap[i] for x in lp[2:]]
        rows.append(row)
    return TrajectoryBatch(rows)


def test_the_split_says_when_no_token_could_be_split_and_measures_every_stale_token():
    """An audit's two edge cases. (a) A decomposed step whose tokens' versions are neither
    scored by the worker nor kept here reported no `decomposed_frac` at all (a step not decomposed
    looks the same; the summary said decompose_every = 0): now 0. (b) Stale-cache tokens of an
    older version, unscored, were left out of `stale_cache_max_abs` though the learner keeps that
    version (0.3 reported for a 0.8 gap): now measured from it."""
    learner = Learner(model(seed=2), LearnerConfig(lr=3e-3, micro_batch_size=4, max_policy_lag=2))
    learner.step(_rows(learner, [0, 0], [0.0, 0.0]))
    learner.kept_back.clear()
    stale = _rows(learner, [0, 0, 1, 1], [0.8, 0.8, 0.3, 0.3], stale=True)
    assert stale.stale_cache[stale.mask.bool()].all()
    m = learner.step(stale)
    assert m["mismatch/stale_cache_frac"] == 1.0 and m["mismatch/decomposed_frac"] == 0.0
    assert abs(m["mismatch/stale_cache_max_abs"] - 0.8) < 1e-5, m  # (version 0's rows: its history)
    assert "mismatch/kernel_max_abs" not in m  # nothing split: no kernel figure
    from parity.metrics.summary import kernel_text
    assert "no token could be split" in kernel_text([m]) and "decompose_every = 0" in kernel_text([{}])
    fresh = Learner(model(seed=2), LearnerConfig(lr=3e-3, micro_batch_size=4, max_policy_lag=2))
    fresh.step(_rows(fresh, [0, 0], [0.0, 0.0]))
    fresh.kept_back.clear()
    unscored = _rows(fresh, [0, 0], [0.01, 0.01])
    fresh.retain([])  # (version 0 let go: no worker needs it)
    m = fresh.step(unscored)
    assert m["mismatch/decomposed_frac"] == 0.0 and "mismatch/kernel_max_abs" not in m
    control = Learner(model(seed=2), LearnerConfig(lr=3e-3, micro_batch_size=4, max_policy_lag=2))
    control.step(_rows(control, [0, 0], [0.0, 0.0]))
    m = control.step(_rows(control, [0, 0], [0.01, 0.01]))  # version 0 kept: split, kernel gap 0.01
    assert m["mismatch/decomposed_frac"] == 1.0 and abs(m["mismatch/kernel_max_abs"] - 0.01) < 1e-5


def test_aligned_bf16_with_float32_master_weights():
    results = _train_with_lag("aligned", "bfloat16", lags=(0, 2))
    assert all(r["mismatch/kernel_max_abs"] == 0.0 for r in results)
    assert all(r["train/grad_norm"] > 0 for r in results)


def test_bf16_micro_batch_gradients_are_summed_in_float32(monkeypatch):
    """In bf16 the step's gradient is the float32 sum of the micro-batches' bf16 gradients (it was
    accumulated in bf16, rounded at every micro-batch: a further 10% of relative error at 16)."""
    batch = rollout(parity.Engine(model(seed=6), max_num_seqs=8), seed=6)
    config = LearnerConfig(micro_batch_size=3, decompose_every=0)
    parts = []  # each micro-batch's bf16 gradient, computed alone
    for idx in micro_batches([len(x) for x in batch.sequences], 3):
        m = model(dtype=torch.bfloat16, seed=7)
        sub, adv = batch.select(idx), group_advantages(batch.rewards, batch.group_ids)[idx]
        lp = sub.pad(parity.sequence_logprobs(m, sub.sequences))
        loss, _ = get_loss("reinforce_zero")(lp, sub.rollout_logprobs, sub.mask, adv, LossConfig())
        (loss * (len(idx) / len(batch))).backward()
        parts.append([q.grad.float() for q in m.parameters()])
    assert len(parts) > 2
    expected = [sum(g[1:], g[0]) for g in zip(*parts)]  # float32, in micro-batch order
    in_bf16 = [sum((x.bfloat16() for x in g[1:]), g[0].bfloat16()).float() for g in zip(*parts)]
    assert not all(torch.equal(a, b) for a, b in zip(expected, in_bf16))  # the control differs
    seen = {}
    import parity.rl.learner as learner_module
    clip = learner_module.clip_gradients

    def capture(params, max_norm):
        seen["grads"] = [q.grad.clone() for q in params]
        return clip(params, max_norm)

    monkeypatch.setattr(learner_module, "clip_gradients", capture)
    Learner(model(dtype=torch.bfloat16, seed=7), config).step(batch)
    assert all(g.dtype == torch.float32 for g in seen["grads"])
    assert all(torch.equal(a, b) for a, b in zip(seen["grads"], expected))


def test_standard_kernels_show_kernel_mismatch_under_load():
    results = _train_with_lag("standard", lags=(0, 1))
    assert max(r["mismatch/kernel_max_abs"] for r in results) > 0


@pytest.mark.parametrize("kernels", ["aligned", "standard"])
def test_the_readme_example_one_bf16_model_shared_with_the_default_config(kernels):
    """README's Public API: one bf16 model for the engine and the learner, LearnerConfig's
    default compute dtype ('auto'): the model keeps its dtype (the engine samples in bf16 still)
    and the kernel mismatch is exactly 0 on aligned kernels; the standard control shows one."""
    m = model(kernels, torch.bfloat16, seed=3)
    engine = parity.Engine(m, max_num_seqs=6, max_num_batched_tokens=24)
    learner = Learner(m, LearnerConfig(loss="reinforce_zero", lr=1e-3, micro_batch_size=4))
    assert m.dtype == torch.bfloat16 and learner.master[0].dtype == torch.float32
    mismatch = []
    for step in range(2):
        mismatch.append(learner.step(rollout(engine, seed=step))["mismatch/kernel_max_abs"])
        engine.update_weights(*learner.publish(), mode="drain")
    assert m.dtype == torch.bfloat16
    assert (max(mismatch) == 0.0) == (kernels == "aligned"), mismatch


@pytest.mark.parametrize("field, bad, message", [
    ("loss_mask", lambda t: t.loss_mask[:-1], "loss_mask has"),
    ("loss_mask", lambda t: [0] * len(t.loss_mask), "selects no token"),
    ("loss_mask", lambda t: [2] + t.loss_mask[1:], "only 0 and 1"),
    ("rollout_logprobs", lambda t: t.rollout_logprobs[:-1] + [math.nan], "rollout_logprobs"),
    ("reward", lambda t: math.inf, "reward"),
])
def test_bad_trajectories_name_response_and_field(field, bad, message):
    good = Trajectory([1, 2, 3, 4], [0, 0, 1, 1], [0.0, 0.0, -1.0, -2.0], [-1, -1, 0, 0], 1.0, 0)
    broken = Trajectory(**{**vars(good), field: bad(good)})
    with pytest.raises(InputError, match=f"response 1: .*{message}"):
        TrajectoryBatch([good, broken])


def test_nonfinite_step_is_skipped_and_batch_saved(tmp_path, caplog):
    m = model(seed=3)
    batch = rollout(parity.Engine(m, max_num_seqs=8), seed=3)
    learner = Learner(m, LearnerConfig(dump_dir=str(tmp_path)))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with torch.no_grad():
        m.model.layers[0].mlp.down_proj.weight[0, 0] = math.nan
    before["model.layers.0.mlp.down_proj.weight"][0, 0] = math.nan
    metrics = learner.step(batch)
    assert metrics["train/skipped_nonfinite"] == 1.0
    assert learner.version == 1  # the unchanged weights are published again, so rollouts go on
    assert learner.scheduler.last_epoch == 1  # the schedule too (it ran one step late from here on)
    assert all(torch.equal(learner.history[1][k].nan_to_num(), before[k].nan_to_num()) for k in before)
    assert "update skipped, batch saved" in caplog.text
    saved = torch.load(learner.last_dump)
    assert len(saved) == len(batch)
    for k, v in m.state_dict().items():
        assert torch.equal(v.nan_to_num(), before[k].nan_to_num()), k


def test_a_skipped_step_still_reports_its_diagnostics():
    """A rollout log-prob of -200 makes that token's weight overflow (inf loss: the step is
    skipped); the step's is_weight/, mismatch/ and lag/ metrics still say why."""
    batch = rollout(parity.Engine(model(seed=3), max_num_seqs=8), seed=3)
    j = 1
    t = int(batch.mask[j].nonzero()[0])
    batch.trajectories[j].rollout_logprobs[t + 1] = -200.0
    metrics = Learner(model(seed=3), LearnerConfig()).step(TrajectoryBatch(batch.trajectories))
    assert metrics["train/skipped_nonfinite"] == 1.0
    assert metrics["is_weight/max"] > 3.4e38 and metrics["mismatch/max_abs"] > 100  # (float64: past float32)
    assert metrics["lag/max"] == 0.0


def test_an_update_that_overflows_the_weights_is_refused_not_published(tmp_path):
    """Finite loss and gradients with a learning rate that overflows the update (lr=1e300): the
    run saved the inf weights as a checkpoint and said to resume from it. The learner now stops
    at that step naming the weight and the setting, and is torn: it neither publishes nor
    checkpoints the diverged weights. The control: the same batch at lr=1e-3 steps."""
    from parity.rl import checkpoint

    batch = rollout(parity.Engine(model(seed=4), max_num_seqs=8), seed=4)
    control = Learner(model(seed=4), LearnerConfig(lr=1e-3, decompose_every=0))
    assert control.step(batch)["train/grad_norm"] > 0 and control.version == 1
    learner = Learner(model(seed=4), LearnerConfig(lr=1e300, decompose_every=0))
    with pytest.raises(parity.ParityError, match=r"the update diverged: model\.\S+ is non-finite after the "
                                                 r"optimizer step; lower learner.lr \(now 1e\+300\)"):
        learner.step(batch)
    assert learner.torn is not None and learner.version == 0
    for refused in (learner.publish, lambda: checkpoint.save(tmp_path, 1, learner.model, learner)):
        with pytest.raises(parity.ParityError, match="failed part-way"):
            refused()


def test_finite_gradients_whose_norm_overflows_float32_are_clipped_not_zeroed(monkeypatch):
    """A live token the rollout gave log-prob -60 (log w ~ 60, unclipped under REINFORCE Zero):
    loss and gradients finite, their float32 sum of squares not. `clip_grad_norm_` returned inf
    and zeroed every gradient, and AdamW moved the weights on momentum alone with nothing
    reported. The norm is now measured in float64 and the gradients clipped to max_norm. The
    control: torch's clip on the same gradients gives inf and zeros."""
    m = model(seed=0)
    learner = Learner(m, LearnerConfig(lr=1e-3, decompose_every=0))
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7]]
    lps = [x.detach() for x in parity.sequence_logprobs(m, seqs)]

    def batch(shift):
        rollout = [[0, 0, *lp[1:-1].tolist(), float(lp[-1]) - shift] for lp in lps]
        v = learner.version
        return TrajectoryBatch([Trajectory(s, [0, 0, 1, 1, 1], r, [-1, -1, v, v, v], float(i), 0)
                                for i, (s, r) in enumerate(zip(seqs, rollout))])
    learner.step(batch(0.0))  # (gives AdamW a momentum)
    grads = {}
    real_clip = torch.nn.utils.clip_grads_with_norm_

    def keep(params, max_norm, norm, *a, **k):  # the gradients as clipping got them
        grads["before"] = [p.grad.clone() for p in params if p.grad is not None]
        real_clip(params, max_norm, norm, *a, **k)
        grads["after"] = [p.grad.double() for p in params if p.grad is not None]
    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", keep)
    metrics = learner.step(batch(60.0))
    assert "train/skipped_nonfinite" not in metrics and math.isfinite(metrics["train/loss"])
    assert math.isfinite(metrics["train/grad_norm"]) and metrics["train/grad_norm"] > 1e20
    clipped = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads["after"]]))
    assert 0.99 * learner.config.max_grad_norm < float(clipped) <= 1.01 * learner.config.max_grad_norm
    control = [torch.nn.Parameter(g.clone()) for g in grads["before"]]
    for p, g in zip(control, grads["before"]):
        p.grad = g.clone()
    assert torch.nn.utils.clip_grad_norm_(control, learner.config.max_grad_norm) == math.inf
    assert all(not p.grad.any() for p in control)


@given(st.lists(st.integers(1, 50), max_size=30), st.integers(1, 8), st.integers(0, 120))
@settings(max_examples=200, deadline=None)
def test_micro_batches_cover_the_batch_in_order_within_both_caps(lengths, max_seqs, max_tokens):
    groups = micro_batches(lengths, max_seqs, max_tokens)
    assert [i for g in groups for i in g] == list(range(len(lengths)))
    for g in groups:
        assert 1 <= len(g) <= max_seqs
        if max_tokens and len(g) > 1:
            assert sum(lengths[i] for i in g) <= max_tokens
    if not max_tokens:
        assert [len(g) for g in groups[:-1]] == [max_seqs] * (len(groups) - 1)


def test_a_token_budget_changes_the_micro_batches_but_not_a_bit_of_the_log_probs():
    """micro_batch_tokens regroups the batch (more, smaller micro-batches of ragged lengths); the
    learner's log-probs stay bit for bit those of one micro-batch, and training runs through the
    same grouping. The control: responses short enough for micro-batches of a few token rows,
    where the standard kernels' bits move (the first batch's could not tell them apart)."""
    m = model(seed=1)
    engine = parity.Engine(m, max_num_seqs=8)
    outs = engine.generate([[1 + i % 5] * (2 + i % 7) for i in range(12)],
                           [SamplingParams(max_tokens=3 + (i * 5) % 17, seed=i) for i in range(12)])
    batch = TrajectoryBatch([Trajectory.from_output(o, float(i % 2), i // 4) for i, o in enumerate(outs)])
    whole = Learner(m, LearnerConfig(micro_batch_size=len(batch))).logprobs(batch)
    budget = Learner(m, LearnerConfig(micro_batch_size=len(batch), micro_batch_tokens=40))
    groups = micro_batches([len(s) for s in batch.sequences], len(batch), 40)
    assert len(groups) > 3 and len({len(g) for g in groups}) > 1
    assert torch.equal(budget.logprobs(batch), whole)
    ragged, differ = ragged_batch(), []  # the control: on the standard kernels, budgets that make
    for kernels in ("aligned", "standard"):  # micro-batches of a few rows move some bits
        m_k = model(kernels, seed=1)
        one = Learner(m_k, LearnerConfig(micro_batch_size=len(ragged))).logprobs(ragged)
        differ.append([not torch.equal(one, Learner(m_k, LearnerConfig(
            micro_batch_size=len(ragged), micro_batch_tokens=tokens)).logprobs(ragged))
            for tokens in (8, 16, 24)])
    assert not any(differ[0]) and any(differ[1]), differ
    before = [p.detach().clone() for p in m.parameters()]
    metrics = budget.step(batch)
    assert math.isfinite(metrics["train/loss"])
    assert any(not torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_a_response_the_engine_failed_is_left_out_of_the_objective():
    """A response the engine failed (finish_reason 'error': here the user's tokenizer cannot decode
    it; a KV cache running out did so before it became "length" with `cache_full`, left out the
    same way: tests/engine/test_engine.py) used to be trained on as a wrong
    answer (reward 0, advantage -0.5 here). It stays in the batch for the diagnostics, with
    advantage 0, and its group's baseline is the others' mean."""
    class ShortOnly:  # a user's tokenizer that raises on the long response's text
        def decode(self, ids):
            if len(ids) > 8:
                raise ValueError("too long to decode")
            return " ".join(map(str, ids))

    m = model(seed=8)
    outs = parity.Engine(m, max_num_seqs=2, tokenizer=ShortOnly()).generate(
        [[1, 2, 3], [4, 5, 6], [7, 8, 9]],
        [SamplingParams(max_tokens=20, ignore_eos=True, seed=1), SamplingParams(max_tokens=4, seed=2),
         SamplingParams(max_tokens=4, seed=3)])
    assert outs[0].finish_reason == "error" and outs[1].error is None and outs[2].error is None
    batch = TrajectoryBatch([Trajectory.from_output(o, r, 0) for o, r in zip(outs, (0.0, 1.0, 0.5))])
    assert batch.trajectories[0].excluded.startswith("engine error: ") and batch.mask[0].sum() > 0
    adv = group_advantages(batch.rewards, batch.group_ids, included=batch.included)
    assert adv.tolist() == [0.0, 0.25, -0.25]
    assert group_advantages(batch.rewards, batch.group_ids).tolist()[0] == pytest.approx(-0.5)  # control
    metrics = Learner(m, LearnerConfig(decompose_every=0)).step(batch)
    assert metrics["train/excluded_frac"] == pytest.approx(1 / 3)


def test_a_bad_response_fails_the_step_before_any_gradient_and_is_named_in_the_batch():
    """A token outside the vocabulary in the third response (micro-batches of 1) failed the step
    after two backwards: their gradients stayed and were added to the next step's (grad norm
    7.21 against 4.36 on a fresh learner), and the error said "sequence 0"."""
    def trajectory(ids):
        return Trajectory(ids, [0] + [1] * (len(ids) - 1), [0.0] + [-1.0] * (len(ids) - 1),
                          [-1] + [0] * (len(ids) - 1), 1.0, 0)

    good = TrajectoryBatch([trajectory([1, 2, 3]), trajectory([4, 5, 6])])
    fresh = Learner(model(seed=5), LearnerConfig(micro_batch_size=1, lr=1e-2, decompose_every=0))
    failed = Learner(model(seed=5), LearnerConfig(micro_batch_size=1, lr=1e-2, decompose_every=0))
    bad = TrajectoryBatch([trajectory([1, 2, 3]), trajectory([9, 9, 9]), trajectory([1, 2, 300])])
    with pytest.raises(InputError, match="response 2: token id 300"):
        failed.step(bad)
    assert all(p.grad is None for p in failed.model.parameters())
    assert failed.step(good)["train/grad_norm"] == fresh.step(good)["train/grad_norm"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_that_fails_before_the_update_changes_nothing_and_one_during_it_is_refused(dtype, monkeypatch,
                                                                                            tmp_path):
    """A failure in the step's diagnostics (they ran after the optimizer step: a retry applied the
    update twice and, in float32, published the old weights as the new version's) changes
    nothing: the retried step's weights equal an unfailed one's bit for bit. A failure inside the
    update itself (the optimizer step, the bf16 copy, the version's snapshot) marks the learner
    torn: it refuses to step, publish or be checkpointed again, instead of training on."""
    from parity.rl import checkpoint
    from parity.rl import learner as learner_module

    def trajectory(ids):
        return Trajectory(ids, [0] + [1] * (len(ids) - 1), [0.0] + [-1.0] * (len(ids) - 1),
                          [-1] + [0] * (len(ids) - 1), float(ids[-1] % 2), ids[0] % 2)

    batch = TrajectoryBatch([trajectory([1, 2, 3]), trajectory([4, 5, 6]), trajectory([7, 8, 9]),
                             trajectory([2, 4, 7])])
    cfg = LearnerConfig(lr=1e-2, decompose_every=0, compute_dtype="auto")
    clean, failed = Learner(model(dtype=dtype, seed=5), cfg), Learner(model(dtype=dtype, seed=5), cfg)
    clean.step(batch)
    fail_on_call(monkeypatch, learner_module, "response_stats", 1, MemoryError("injected"))
    with pytest.raises(MemoryError):
        failed.step(batch)
    assert failed.version == 0 and failed.torn is None
    failed.step(batch)
    assert failed.publish()[1] == clean.publish()[1] == 1
    for a, b in zip(failed.master, clean.master):
        assert torch.equal(a, b)
    for a, b in zip(failed.publish()[0].values(), clean.publish()[0].values()):
        assert torch.equal(a, b)
    monkeypatch.setattr(checkpoint, "_trainer_state", lambda *a: (_ for _ in ()).throw(MemoryError("state")))
    with pytest.raises(MemoryError):  # a save failing with no OSError: no model-sized leftover
        checkpoint.save(tmp_path, 1, failed.model, failed)
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(failed, "_snapshot", lambda: (_ for _ in ()).throw(MemoryError("snapshot")))
    with pytest.raises(MemoryError):
        failed.step(batch)
    assert failed.torn == "MemoryError: snapshot" and failed.version == 1
    for refused in (lambda: failed.step(batch), failed.publish,
                    lambda: checkpoint.save(tmp_path, 2, failed.model, failed)):
        with pytest.raises(parity.ParityError, match="update at step 1 failed part-way"):
            refused()


def test_a_moe_learner_scores_a_lagged_batch_under_the_version_that_sampled_it():
    """MoE rollouts are not scored by the worker, so a lagged step scores them under the older
    version on a scratch copy of the model: that copy was a deepcopy, which the router logits of
    the last grad-enabled forward refused ("Only Tensors created explicitly by the user..."): every
    asynchronous MoE run failed at its second learner step. The dense control never needed it."""
    engine_model = model(preset="tiny-moe", seed=41)
    learner = Learner(model(preset="tiny-moe", seed=41), LearnerConfig(lr=1e-2))
    outs = parity.Engine(engine_model, kv_cache_tokens=256).generate(
        [[1, 2, 3], [4, 5]], SamplingParams(max_tokens=5, seed=0))
    batch = TrajectoryBatch([Trajectory.from_output(o, float(i), 0) for i, o in enumerate(outs)])
    learner.step(batch)
    lp, mask = learner.logprobs(batch, version=0), batch.mask.bool()
    assert learner.version == 1 and torch.equal(lp[mask], batch.rollout_logprobs[mask])
    assert not torch.equal(learner.logprobs(batch)[mask], lp[mask])  # the current version differs


def test_the_learner_scores_with_its_updated_weights_when_the_projections_do_not_share_a_buffer():
    """Model caches a concatenated q/k/v weight when the projections are separate tensors, keyed
    on their version counters, which the fused optimizer's in-place writes leave unchanged: after
    a step the learner scored with the old weights (0.84 off a fresh model holding the new ones)."""
    learner = Learner(model(seed=1), LearnerConfig(lr=1e-2))
    q = learner.model.model.layers[0].self_attn.q_proj.weight
    q.data = q.data.clone()  # q/k/v no longer one buffer: the concatenation is cached
    outs = parity.Engine(model(seed=1), kv_cache_tokens=256).generate(
        [[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_tokens=8, seed=0))
    batch = TrajectoryBatch([Trajectory.from_output(o, float(i), 0) for i, o in enumerate(outs)])
    learner.logprobs(batch)  # fills the cache
    learner.step(batch)
    fresh = model(seed=1)
    fresh.load_state_dict(learner.model.state_dict())
    mask = batch.mask.bool()
    expected = batch.pad(parity.sequence_logprobs(fresh, batch.sequences))[mask]
    assert torch.equal(learner.logprobs(batch)[mask], expected)
