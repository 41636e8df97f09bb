"""Each objective against a hand computation (value and gradient) on a tiny batch, and the KL
estimate the step reports beside them."""

from __future__ import annotations

import math

import pytest
import torch

from parity.config.learner import AGGREGATIONS, LOSS_NAMES, LearnerConfig
from parity.errors import ConfigError
from parity.rl import LossConfig, get_loss, group_advantages

LP = [[-1.0, -0.5, -2.0], [-0.2, -3.0, 0.0]]
RLP = [[-1.2, -0.1, -2.0], [-0.9, -1.0, 0.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
ADV = [0.5, -1.5]
N = 2


def run(name, **cfg):
    lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    f64 = dict(dtype=torch.float64)
    loss, stats = get_loss(name)(lp, torch.tensor(RLP, **f64), torch.tensor(MASK, **f64),
                                 torch.tensor(ADV, **f64), LossConfig(**cfg))
    loss.backward()
    return float(loss.detach()), lp.grad.tolist(), stats


def hand(per_token, d_per_token):
    """value and gradient of −(1/N) Σ_i A_i (1/|y_i|) Σ_t f_it for given f and df/dlp."""
    value, grad = 0.0, [[0.0] * 3 for _ in range(2)]
    for i in range(2):
        n = sum(MASK[i])
        for t in range(3):
            if MASK[i][t]:
                value += -ADV[i] * per_token(i, t) / n / N
                grad[i][t] = -ADV[i] * d_per_token(i, t) / n / N
    return value, grad


def w(i, t):
    return math.exp(LP[i][t] - RLP[i][t])


def frac(pair):
    numerator, denominator = pair
    return numerator / denominator


def close(a, b):
    assert a == pytest.approx(b, rel=1e-12, abs=1e-14)


def grads_close(a, b):
    assert torch.allclose(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                          rtol=1e-12, atol=1e-14), (a, b)


def test_reinforce_zero():
    value, grad, _ = run("reinforce_zero")
    v, g = hand(w, w)
    close(value, v)
    grads_close(grad, g)


def test_on_policy():
    value, grad, _ = run("on_policy")
    v, g = hand(lambda i, t: LP[i][t], lambda i, t: 1.0)
    close(value, v)
    grads_close(grad, g)


def test_tis_truncates_and_detaches():
    value, grad, stats = run("tis", tis_cap=1.2)
    cap = lambda i, t: min(w(i, t), 1.2)  # noqa: E731
    v, g = hand(lambda i, t: cap(i, t) * LP[i][t], cap)
    close(value, v)
    grads_close(grad, g)
    capped = sum(1 for i in range(2) for t in range(3) if MASK[i][t] and w(i, t) > 1.2)
    assert frac(stats["loss/frac_truncated"]) == pytest.approx(capped / 5) and capped > 0


def test_icepop_masks_tokens_outside_band():
    value, grad, stats = run("icepop", icepop_low=0.5, icepop_high=1.5)
    keep = lambda i, t: 1.0 if 0.5 <= w(i, t) <= 1.5 else 0.0  # noqa: E731
    v, g = hand(lambda i, t: keep(i, t) * w(i, t), lambda i, t: keep(i, t) * w(i, t))
    close(value, v)
    grads_close(grad, g)
    assert frac(stats["loss/frac_masked"]) == pytest.approx(2 / 5)


def test_mis_masks_only_tokens_above_the_cap():
    """One-sided: the token at w = 2.01 goes, the one at w = 0.14 stays (IcePop's two-sided band
    would drop both: the control)."""
    value, grad, stats = run("mis", mis_cap=1.5)
    keep = lambda i, t: 1.0 if w(i, t) <= 1.5 else 0.0  # noqa: E731
    v, g = hand(lambda i, t: keep(i, t) * w(i, t), lambda i, t: keep(i, t) * w(i, t))
    close(value, v)
    grads_close(grad, g)
    assert frac(stats["loss/frac_masked"]) == pytest.approx(1 / 5)
    assert frac(run("icepop", icepop_low=0.5, icepop_high=1.5)[2]["loss/frac_masked"]) == pytest.approx(2 / 5)


def test_mis_sequence_level_weighs_a_response_by_its_product():
    """ρ_0 = e^-0.2 = 0.82 is above C = 0.5 (response dropped), ρ_1 = e^-1.3 = 0.27 is kept with
    gradient ρ_1·A·∇log π on each of its tokens."""
    value, grad, stats = run("mis", mis_cap=0.5, mis_level="sequence")
    rho = [math.exp(sum(LP[i][t] - RLP[i][t] for t in range(3) if MASK[i][t])) for i in range(2)]
    keep = [1.0 if r <= 0.5 else 0.0 for r in rho]
    assert keep == [0.0, 1.0]  # the example exercises both outcomes
    v, g = hand(lambda i, t: keep[i] * rho[i] * LP[i][t], lambda i, t: keep[i] * rho[i])
    close(value, v)
    grads_close(grad, g)
    assert frac(stats["loss/frac_rejected"]) == pytest.approx(1 / 2)


@pytest.mark.parametrize("low, high, max_k3, kept", [
    (0.8, 1.25, 10.0, [1.0, 0.0]),  # the ratio band decides
    (0.9, 1.25, 10.0, [1.0, 0.0]),  # the geometric mean (0.935) kept; the product (0.819) would not be
    (0.1, 10.0, 0.05, [1.0, 0.0]),  # the mean k3 alone decides (0.031 vs 0.725)
])
def test_seq_gate_rejects_whole_responses(low, high, max_k3, kept):
    value, grad, stats = run("seq_gate", gate_low=low, gate_high=high, gate_max_k3=max_k3)
    live = [[t for t in range(3) if MASK[i][t]] for i in range(2)]
    ratios = [math.exp(sum(LP[i][t] - RLP[i][t] for t in live[i]) / len(live[i])) for i in range(2)]
    k3 = [sum(w(i, t) - 1 - math.log(w(i, t)) for t in live[i]) / len(live[i]) for i in range(2)]
    gate = [1.0 if low <= r <= high and k <= max_k3 else 0.0 for r, k in zip(ratios, k3)]
    assert gate == kept  # the example exercises both outcomes, by the test's own criterion
    v, g = hand(lambda i, t: gate[i] * w(i, t), lambda i, t: gate[i] * w(i, t))
    close(value, v)
    grads_close(grad, g)
    assert frac(stats["loss/frac_rejected"]) == pytest.approx(1 - sum(gate) / 2)


def ppo_hand(eps, high, dual=None):
    """value and gradient of −(1/N) Σ_i (1/|y_i|) Σ_t min(w A, clip(w, 1 − eps, 1 + high) A), with
    the dual clip's c·A (no gradient) for A < 0 and w > c when `dual` is given."""
    value_h, grad_h = 0.0, [[0.0] * 3 for _ in range(2)]
    for i in range(2):
        n = sum(MASK[i])
        for t in range(3):
            if not MASK[i][t]:
                continue
            r, a = w(i, t), ADV[i]
            clipped = min(max(r, 1 - eps), 1 + high)
            term, slope = (r * a, r * a) if r * a <= clipped * a else (clipped * a, 0.0)
            if dual is not None and a < 0 and r > dual:
                term, slope = dual * a, 0.0
            value_h += -term / n / N
            grad_h[i][t] = -slope / n / N
    return value_h, grad_h


def test_ppo_clip():
    value, grad, _ = run("ppo_clip", ppo_eps=0.2)
    value_h, grad_h = ppo_hand(0.2, 0.2)
    close(value, value_h)
    grads_close(grad, grad_h)


def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 1.0, 3.0, 5.0])
    g = torch.tensor([0, 0, 0, 1, 1])
    assert group_advantages(r, g).tolist() == pytest.approx([1 / 3, -2 / 3, 1 / 3, -1.0, 1.0])
    assert group_advantages(r, g, normalize_std=True)[3:].tolist() == pytest.approx([-1.0, 1.0], rel=1e-5)


def test_a_group_of_equal_rewards_has_exactly_zero_advantages():
    """In float32 the mean of eight rewards of 0.9 is not 0.9: R − mean is ~6e-8, which GRPO's std
    division turns into a 0.06 push with no information behind it."""
    r, g = torch.full((8,), 0.9), torch.zeros(8, dtype=torch.long)
    assert not torch.equal(r - r.mean(), torch.zeros(8))  # control: the formula as written misses 0
    for std in (False, True):
        assert torch.equal(group_advantages(r, g, normalize_std=std), torch.zeros(8))
    mixed = group_advantages(torch.tensor([0.9, 0.9, 0.1, 0.1]), torch.tensor([0, 0, 1, 1]))
    assert torch.equal(mixed, torch.zeros(4))


@pytest.mark.parametrize("name,cfg", [("reinforce_zero", {}), ("tis", {}), ("icepop", {}), ("mis", {}),
                                      ("mis", {"mis_level": "sequence"}), ("seq_gate", {}), ("ppo_clip", {}),
                                      ("ppo_clip", {"ppo_dual_clip": 3.0}), ("gspo", {}), ("cispo", {}),
                                      ("decoupled_ppo", {"behav_cap": 2.0})])
def test_a_dropped_token_whose_weight_overflows_adds_exactly_nothing(name, cfg):
    """Token 0 was sampled at log-prob −95 (w = e^94: inf in float32). Each objective drops it
    (reinforce_zero: its response has advantage 0; icepop and mis mask, seq_gate and sequence-level
    mis reject its response, ppo_clip and gspo clip, decoupled_ppo's behav_cap masks)
    or caps it (tis: weight C, cispo: 1 + ε_high): the loss and gradient stay finite and that
    token's gradient is exactly 0 (tis: −C·A/(|y|·N)), instead of inf * 0 = NaN skipping the step."""
    lp = torch.tensor([[-1.0, -0.5, -1.0], [-0.2, -0.3, -0.4]], requires_grad=True)
    rollout_lp = torch.tensor([[-95.0, -0.5, -1.0], [-0.2, -0.2, -0.5]])
    adv = torch.tensor([0.0 if name == "reinforce_zero" else 1.0, -1.0])
    assert torch.isinf(torch.exp(lp.detach() - rollout_lp)).any()  # the weight does overflow
    loss, _ = get_loss(name)(lp, rollout_lp, torch.ones(2, 3), adv, LossConfig(**cfg))
    loss.backward()
    assert math.isfinite(float(loss.detach())) and torch.isfinite(lp.grad).all(), (loss, lp.grad)
    cap = {"tis": LossConfig().tis_cap, "cispo": 1 + LossConfig().cispo_eps_high}.get(name, 0.0)
    assert lp.grad[0, 0] == torch.tensor(-cap / 3 / 2)
    assert lp.grad[1].abs().sum() > 0


def test_unknown_loss_and_bad_config():
    with pytest.raises(ConfigError, match="unknown loss 'ppo'"):
        get_loss("ppo")
    with pytest.raises(ConfigError, match="icepop_low"):
        LossConfig(icepop_low=6.0)
    with pytest.raises(ConfigError, match="mis_level must be 'token' or 'sequence'"):
        LossConfig(mis_level="seq")
    with pytest.raises(ConfigError, match="mis_cap must be > 0"):
        LossConfig(mis_cap=0.0)
    with pytest.raises(ConfigError, match="aggregation must be one of response, token, constant"):
        LossConfig(aggregation="seq-mean-token-sum")
    with pytest.raises(ConfigError, match=r"ppo_dual_clip must be 0 \(off\) or > 1, got 1.0"):
        LossConfig(ppo_dual_clip=1.0)
    with pytest.raises(ConfigError, match="norm_tokens must be > 0 with aggregation 'constant'"):
        LossConfig(aggregation="constant")
    with pytest.raises(ConfigError, match="ppo_std_adv applies to ppo_clip, decoupled_ppo, gspo, cispo, "
                                          "not to loss 'tis'"):
        LearnerConfig(loss="tis", loss_config=LossConfig(ppo_std_adv=True))
    LearnerConfig(loss="cispo", loss_config=LossConfig(ppo_std_adv=True))
    with pytest.raises(ConfigError, match="gspo_eps_low must be > 0"):
        LossConfig(gspo_eps_low=-1e-4)


def test_seq_gate_k3_keeps_its_precision_near_zero_in_float32():
    """The gate's mean k3 was exp(d) - 1 - d in float32, which cancels for d ~ 1e-5: 6.8e-9 for a
    true 7.5e-11, so `gate_max_k3` = 1e-9 rejected a response the learner nearly agreed with.
    Now expm1(d) - d. The control is the old formula on the same numbers, over the limit."""
    lp = torch.zeros(1, 4, requires_grad=True)
    rollout = -torch.tensor([[1e-5, -1e-5, 2e-5, 0.0]])
    mask, adv = torch.ones(1, 4), torch.tensor([1.0])
    d = (lp - rollout).detach()
    true_k3 = float(((d.double().exp() - 1 - d.double())).mean())
    assert float((d.exp() - 1 - d).mean()) > 1e-9 > true_k3  # the old formula would reject
    _, stats = get_loss("seq_gate")(lp, rollout, mask, adv, LossConfig(gate_max_k3=1e-9))
    assert stats["loss/frac_rejected"] == (0.0, 1.0)


def test_k3_sees_one_ulp_gaps():
    """k3 = mean(w - 1 - log w) read exactly 0 for float32 log-probs one ulp apart near 0 (exp(d) - 1
    cancels d ~ 1e-8 in float64), so a zero k3 did not mean equal log-probs; now expm1(d) - d. The
    control: identical log-probs still give exactly 0."""
    from parity.metrics.diagnostics import mismatch_stats
    lp = torch.full((1, 1000), -1e-7)
    near = torch.nextafter(lp, torch.zeros(()))  # one float32 ulp towards 0
    mask = torch.ones(1, 1000)
    stats = mismatch_stats(near, lp, mask)
    k3 = stats["mismatch/k3"]
    d = float(near[0, 0].double() - lp[0, 0].double())
    assert k3 > 0 and math.isclose(k3, d * d / 2, rel_tol=1e-6)
    assert stats["mismatch/frac_differ"] == 1.0 and stats["mismatch/max_abs"] == abs(d)  # (one ulp differs)
    assert mismatch_stats(lp, lp.clone(), mask)["mismatch/k3"] == 0.0


def test_mismatch_stats_on_hand_values():
    """k1 = mean(log μ − log π) and k3 = mean(w − 1 − log w), w = π/μ, both estimating KL(μ ‖ π),
    over the masked tokens only; frac_differ counts tokens whose log-probs differ at all."""
    from parity.metrics.diagnostics import mismatch_stats
    stats = mismatch_stats(torch.tensor(LP), torch.tensor(RLP), torch.tensor(MASK, dtype=torch.float32))
    d = [LP[i][t] - RLP[i][t] for i in range(2) for t in range(3) if MASK[i][t]]  # log w
    assert stats["mismatch/k1"] == pytest.approx(-sum(d) / 5, rel=1e-6)
    assert stats["mismatch/k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 5, rel=1e-6)
    assert stats["mismatch/frac_differ"] == pytest.approx(4 / 5)  # (one masked-in token equal)
    assert stats["mismatch/max_abs"] == pytest.approx(2.0)
    assert stats["mismatch/mean_abs"] == pytest.approx(3.3 / 5)


def test_reinforce_zero_does_not_clip_a_large_weight():
    """No clipping: a token with w = e^3 (about 20, past every weight of the example above) has
    gradient −w·A/|y|/N in full; a clamp anywhere below 20 would show here."""
    lp = torch.tensor([[0.0, -1.0]], dtype=torch.float64, requires_grad=True)
    f64 = dict(dtype=torch.float64)
    loss, _ = get_loss("reinforce_zero")(lp, torch.tensor([[-3.0, -1.0]], **f64), torch.ones(1, 2, **f64),
                                         torch.tensor([1.0], **f64), LossConfig())
    loss.backward()
    assert lp.grad[0, 0] == pytest.approx(-math.exp(3) / 2, rel=1e-12)
    assert lp.grad[0, 1] == pytest.approx(-0.5)


def test_ppo_clip_higher_and_dual_clip():
    """DAPO's clip-higher (ε_high = 0.28 > ε = 0.2) and the dual clip at c = 1.5: the token of
    response 1 (A < 0) at w = 2.01 contributes c·A and no gradient, where the plain min would have
    let its unbounded w·A through (the control: without the dual clip its gradient is not 0)."""
    eps, high, c = 0.2, 0.28, 1.5
    value, grad, stats = run("ppo_clip", ppo_eps=eps, ppo_eps_high=high, ppo_dual_clip=c)
    value_h, grad_h = ppo_hand(eps, high, c)
    close(value, value_h)
    grads_close(grad, grad_h)
    assert grad[1][0] == 0 and run("ppo_clip", ppo_eps=eps, ppo_eps_high=high)[1][1][0] != 0
    assert frac(stats["loss/frac_dual_clipped"]) == pytest.approx(1 / 5)
    outside = sum(1 for i in range(2) for t in range(3) if MASK[i][t] and not 1 - eps <= w(i, t) <= 1 + high)
    assert frac(stats["loss/frac_clipped"]) == pytest.approx(outside / 5)
    assert w(0, 0) < 1 + high and w(0, 0) > 1 + eps  # clip-higher lets token (0, 0) through: the control
    assert run("ppo_clip", ppo_eps=eps)[1][0][0] == 0 and grad[0][0] != 0


def test_gspo_clips_the_length_normalised_sequence_ratio():
    """s_0 = e^(-0.2/3) = 0.94 with A > 0 keeps its gradient, s_0·A/|y_0| on each token; s_1 = e^-0.65
    with A < 0 is clipped to 1 − 3e-4 (no gradient): both outcomes at the paper's ε."""
    value, grad, stats = run("gspo")
    s = [math.exp(sum(LP[i][t] - RLP[i][t] for t in range(3) if MASK[i][t]) / sum(MASK[i])) for i in range(2)]
    clipped = [min(max(x, 1 - 3e-4), 1 + 4e-4) for x in s]
    terms = [min(s[i] * ADV[i], clipped[i] * ADV[i]) for i in range(2)]
    binds = [clipped[i] * ADV[i] < s[i] * ADV[i] for i in range(2)]
    assert binds == [False, True]
    close(value, -sum(terms) / N)
    g = [[0.0 if binds[i] or not MASK[i][t] else -ADV[i] * s[i] / sum(MASK[i]) / N for t in range(3)]
         for i in range(2)]
    grads_close(grad, g)
    assert frac(stats["loss/frac_clipped_responses"]) == pytest.approx(1.0)  # both ratios outside the band


def test_cispo_scales_every_token_by_its_clipped_detached_weight():
    """No floor by default (ε_low = 1): w = 0.14 keeps its weight; ε_low = 0.2 raises it to 0.8.
    Unlike ppo_clip, a clipped token keeps a gradient (the clipped weight's)."""
    for low in (1.0, 0.2):
        value, grad, stats = run("cispo", cispo_eps_low=low, cispo_eps_high=0.1)
        weight = lambda i, t, low=low: min(max(w(i, t), 1 - low), 1.1)  # noqa: E731
        v, g = hand(lambda i, t, weight=weight: weight(i, t) * LP[i][t], weight)
        close(value, v)
        grads_close(grad, g)
        outside = sum(1 for i in range(2) for t in range(3) if MASK[i][t] and weight(i, t) != w(i, t))
        assert frac(stats["loss/frac_clipped"]) == pytest.approx(outside / 5) and outside > 0
        assert all(x != 0 for i in range(2) for t, x in enumerate(grad[i]) if MASK[i][t])


@pytest.mark.parametrize("aggregation", ["token", "constant"])
def test_token_and_constant_aggregation(aggregation):
    """'token': every sampled token of the batch weighs 1/Σ|y_i| (DAPO); 'constant': 1/(N·norm_tokens)
    (Dr. GRPO). Response 1 is shorter, so both differ from the per-response mean (the control)."""
    value, grad, _ = run("reinforce_zero", aggregation=aggregation, norm_tokens=4)
    scale = 1 / 5 if aggregation == "token" else 1 / (N * 4)
    v = -sum(ADV[i] * w(i, t) * scale for i in range(2) for t in range(3) if MASK[i][t])
    g = [[-ADV[i] * w(i, t) * scale if MASK[i][t] else 0.0 for t in range(3)] for i in range(2)]
    close(value, v)
    grads_close(grad, g)
    assert abs(value - run("reinforce_zero")[0]) > 1e-3


@pytest.mark.parametrize("name", LOSS_NAMES)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_padded_positions_holding_inf_or_nan_add_nothing(name, aggregation):
    """The learner pads with 0, but a caller's padding may hold anything: a masked-out position whose
    log-probs are -inf or NaN (inf * 0 = NaN) leaves the loss and gradient those of zero padding."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    results = []
    for pad in (0.0, -math.inf, math.nan):
        lp = torch.tensor([[-1.0, -0.5, pad], [-0.2, pad, pad]], requires_grad=True)
        rollout_lp = torch.tensor([[-1.1, -0.4, pad], [-0.3, pad, pad]])
        cfg = LossConfig(aggregation=aggregation, norm_tokens=4, ppo_dual_clip=3.0)
        loss, _ = get_loss(name)(lp, rollout_lp, mask, adv, cfg)
        loss.backward()
        results.append((loss.detach(), lp.grad))
    for loss, grad in results[1:]:
        assert torch.equal(loss, results[0][0]) and torch.equal(grad, results[0][1]), (loss, grad)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_to_the_reference(estimator):
    """β's term: per token k(d), d = log π_ref − log π, averaged as the objective averages; its
    gradient in log π: 1 (k1), −d (k2), 1 − e^d (k3). Exactly 0 where π = π_ref."""
    from parity.rl.losses import kl_penalty
    lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    ref, mask = torch.tensor(RLP, dtype=torch.float64), torch.tensor(MASK, dtype=torch.float64)
    value = kl_penalty(lp, ref, mask, LossConfig(), estimator)
    value.backward()
    k, dk = {"k1": (lambda d: -d, lambda d: 1.0), "k2": (lambda d: d * d / 2, lambda d: -d),
             "k3": (lambda d: math.exp(d) - d - 1, lambda d: 1 - math.exp(d))}[estimator]
    d = lambda i, t: RLP[i][t] - LP[i][t]  # noqa: E731
    tokens = [(i, t) for i in range(2) for t in range(3) if MASK[i][t]]
    close(float(value.detach()), sum(k(d(i, t)) / sum(MASK[i]) / N for i, t in tokens))
    grads_close(lp.grad.tolist(), [[dk(d(i, t)) / sum(MASK[i]) / N if MASK[i][t] else 0.0 for t in range(3)]
                                   for i in range(2)])
    same = kl_penalty(ref.float(), ref.float(), mask.float(), LossConfig(), estimator)
    assert torch.equal(same, torch.zeros(()))
    far = kl_penalty(torch.full((1, 2), -200.0), torch.zeros(1, 2), torch.ones(1, 2), LossConfig(), estimator)
    assert math.isfinite(float(far))  # (k3: d = 200 clamped to 20, e^200 is inf in float32)
    # a response the objective leaves out (the engine failed it) gets no KL gradient either (it did:
    # an audit measured 11% of the KL gradient on two excluded responses of 13); the control: included
    lp.grad = None
    kl_penalty(lp, ref, mask, LossConfig(), estimator, torch.tensor([True, False])).backward()
    assert torch.equal(lp.grad[1], torch.zeros(3, dtype=torch.float64))
    grads_close(lp.grad[0].tolist(), [dk(d(0, t)) / sum(MASK[0]) / N if MASK[0][t] else 0.0
                                      for t in range(3)])


def test_kl_penalty_gradients_in_expectation():
    """On tokens drawn from π (exact expectation over a 5-token vocabulary): k2's gradient is
    ∇KL(π ‖ π_ref), k3's is ∇KL(π_ref ‖ π) (not the other direction: the control), k1's is 0,
    which is why a k1 penalty is refused."""
    from parity.rl.losses import kl_penalty
    logits = torch.tensor([0.3, -1.2, 2.0, 0.1, -0.4], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([1.0, 0.5, -0.3, 0.2, -2.0], dtype=torch.float64), 0)

    def expected_grad(estimator):
        total = torch.zeros(5, dtype=torch.float64)
        for a in range(5):  # Σ_a π(a) ∇k(a)
            lp = torch.log_softmax(logits, 0)
            one = torch.ones(1, 1)
            kl_penalty(lp[a].view(1, 1), ref[a].view(1, 1), one, LossConfig(), estimator).backward()
            total += lp[a].exp().detach() * logits.grad
            logits.grad = None
        return total

    def exact_grad(kl):
        kl(torch.log_softmax(logits, 0)).backward()
        grad, logits.grad = logits.grad, None
        return grad

    forward = exact_grad(lambda lp: (lp.exp() * (lp - ref)).sum())  # ∇KL(π ‖ π_ref)
    reverse = exact_grad(lambda lp: (ref.exp() * (ref - lp)).sum())  # ∇KL(π_ref ‖ π)
    assert torch.allclose(expected_grad("k2"), forward, atol=1e-12)
    assert torch.allclose(expected_grad("k3"), reverse, atol=1e-12)
    assert not torch.allclose(expected_grad("k3"), forward, atol=1e-3)
    assert torch.allclose(expected_grad("k1"), torch.zeros(5, dtype=torch.float64), atol=1e-12)
    with pytest.raises(ConfigError, match="'k1' cannot be a penalty"):
        LearnerConfig(kl_coef=0.1, kl_estimator="k1")
    LearnerConfig(kl_estimator="k1")  # (no penalty: nothing to refuse)


PROX = [[-0.9, -0.8, -2.0], [-0.4, -1.5, 0.0]]


def run_decoupled(prox, **cfg):
    lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    f64 = dict(dtype=torch.float64)
    loss, stats = get_loss("decoupled_ppo")(
        lp, torch.tensor(RLP, **f64), torch.tensor(MASK, **f64), torch.tensor(ADV, **f64), LossConfig(**cfg),
        prox_lp=None if prox is None else torch.tensor(prox, **f64))
    loss.backward()
    return float(loss.detach()), lp.grad.tolist(), stats


def test_decoupled_ppo_clips_around_the_proximal_policy():
    """AReaL's objective: sg(b)·min(r A, clip(r) A) with b = π_prox/μ and r = π/π_prox. The example
    has a token whose r is clipped (no gradient) and one whose b is masked by behav_cap, and the
    clip is around π_prox, not μ: ppo_clip on the same tokens gives another value (the control)."""
    eps, cap = 0.2, 1.5
    b = lambda i, t: math.exp(PROX[i][t] - RLP[i][t])  # noqa: E731
    r = lambda i, t: math.exp(LP[i][t] - PROX[i][t])  # noqa: E731
    value_h, grad_h, clipped_n, masked_n = 0.0, [[0.0] * 3 for _ in range(2)], 0, 0
    for i in range(2):
        for t in range(3):
            if not MASK[i][t]:
                continue
            a, n = ADV[i], sum(MASK[i])
            clipped = min(max(r(i, t), 1 - eps), 1 + eps)
            clipped_n += clipped != r(i, t)
            if b(i, t) > cap:
                masked_n += 1
                continue
            term, slope = (r(i, t) * a, r(i, t) * a) if r(i, t) * a <= clipped * a else (clipped * a, 0.0)
            value_h += -b(i, t) * term / n / N
            grad_h[i][t] = -b(i, t) * slope / n / N
    assert clipped_n > 0 and masked_n == 1  # both outcomes
    value, grad, stats = run_decoupled(PROX, ppo_eps=eps, behav_cap=cap)
    close(value, value_h)
    grads_close(grad, grad_h)
    assert frac(stats["loss/frac_clipped"]) == pytest.approx(clipped_n / 5)
    assert frac(stats["loss/frac_behav_masked"]) == pytest.approx(1 / 5)
    assert abs(run("ppo_clip", ppo_eps=eps)[0] - run_decoupled(PROX, ppo_eps=eps)[0]) > 1e-3


def test_decoupled_ppo_with_one_update_per_batch_is_reinforce_zero():
    """No proximal policy given (one update per batch: π_prox = π): r = 1, the clip never binds,
    and value and gradient are REINFORCE Zero's, bit for bit in float32; a proximal policy other
    than π changes the gradient (the control)."""
    lp = torch.tensor(LP, requires_grad=True)
    args = (torch.tensor(RLP), torch.tensor(MASK, dtype=torch.float32), torch.tensor(ADV), LossConfig())
    out = {}
    for name in ("reinforce_zero", "decoupled_ppo"):
        lp.grad = None
        loss, _ = get_loss(name)(lp, *args)
        loss.backward()
        out[name] = (loss.detach(), lp.grad.clone())
    assert torch.equal(out["reinforce_zero"][0], out["decoupled_ppo"][0])
    assert torch.equal(out["reinforce_zero"][1], out["decoupled_ppo"][1])
    assert run_decoupled(None)[1] != run_decoupled(PROX)[1]
