"""ORPO loss against hand-computed values (Hong et al. 2024, eq. 6-7)."""

import math

import mlx.core as mx
import numpy as np
import pytest

from dtrain.engine.loss import finalize_metrics, log1mexp, log_odds, orpo_loss


def test_log1mexp_matches_float64_on_both_branches():
    xs = np.array([-80.0, -20.0, -5.0, -1.0, -0.7, -math.log(2), -0.69, -0.1, -1e-3, -1e-6], np.float64)
    got = np.array(log1mexp(mx.array(xs.astype(np.float32))))
    want = np.log(-np.expm1(xs))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-30)


def test_log1mexp_near_zero_is_finite_with_finite_gradient():
    for x in (0.0, -1e-12, -1e-9):
        value, grad = mx.value_and_grad(lambda v: log1mexp(v).sum())(mx.array([x]))
        assert math.isfinite(value.item()) and math.isfinite(grad.item())
    # clamped at -1e-7: log(1 - exp(-1e-7)) = log(1e-7) to float32 precision
    assert log1mexp(mx.array([0.0])).item() == pytest.approx(math.log(1e-7), rel=1e-5)


# Worked example: chosen mean log-prob log(1/2), rejected log(1/4).
# odds(chosen) = 0.5/0.5 = 1, odds(rejected) = 0.25/0.75 = 1/3,
# log_odds = log 1 - log(1/3) = log 3 = 1.0986123,
# softplus(-log 3) = log(1 + 1/3) = log(4/3) = 0.2876821.
# NLL: summed 3.0 nats over 2 tokens = 1.5.
LW, LR = math.log(0.5), math.log(0.25)


@pytest.mark.parametrize("lam, expected", [(0.0, 1.5), (0.1, 1.5 + 0.1 * math.log(4 / 3)), (1.0, 1.5 + math.log(4 / 3))])
def test_orpo_loss_worked_example(lam, expected):
    loss, sums = orpo_loss(mx.array([LW]), mx.array([LR]), mx.array(3.0), lam, n_tokens=2, n_pairs=1)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert log_odds(mx.array([LW]), mx.array([LR])).item() == pytest.approx(math.log(3), rel=1e-6)
    sums = {k: v.item() for k, v in sums.items()}
    assert sums["or_sum"] == pytest.approx(math.log(4 / 3), rel=1e-6)
    assert sums["accuracy_sum"] == 1.0


def test_orpo_loss_normalises_by_global_counts_and_batches_add_up():
    """Two micro-batches of one pair each, normalised by the global counts,
    sum to the loss of the two pairs computed together."""
    lw, lr = mx.array([LW, -2.0]), mx.array([LR, -1.0])
    nll = [mx.array(3.0), mx.array(5.0)]
    whole, _ = orpo_loss(lw, lr, nll[0] + nll[1], 0.1, n_tokens=6, n_pairs=2)
    parts = sum(orpo_loss(lw[i : i + 1], lr[i : i + 1], nll[i], 0.1, n_tokens=6, n_pairs=2)[0] for i in range(2))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)
    # by hand: nll 8/6; odds-ratio terms log(4/3) and softplus(-(log_odds of (-2, -1)))
    lo2 = (-2.0 - -1.0) - (math.log(-math.expm1(-2.0)) - math.log(-math.expm1(-1.0)))
    expected = 8 / 6 + 0.1 * (math.log(4 / 3) + math.log1p(math.exp(-lo2))) / 2
    assert whole.item() == pytest.approx(expected, rel=1e-6)


def test_orpo_loss_gradient_finite_when_chosen_logp_is_zero():
    def f(lw):
        return orpo_loss(lw, mx.array([-1.0]), mx.array(1.0), 1.0, 1, 1)[0]

    value, grad = mx.value_and_grad(f)(mx.array([0.0]))
    assert math.isfinite(value.item()) and math.isfinite(grad.item())


def test_finalize_metrics_trl_names_and_values():
    _, sums = orpo_loss(mx.array([LW, -2.0]), mx.array([LR, -1.0]), mx.array(8.0), 0.5, 6, 2)
    sums = {**{k: v.item() for k, v in sums.items()}, "pairs": 2.0, "nll_tokens": 6.0}
    m = finalize_metrics(sums, 0.5, prefix="eval/")
    assert m["eval/nll_loss"] == pytest.approx(8 / 6)
    assert m["eval/rewards/accuracies"] == 0.5
    assert m["eval/logps/chosen"] == pytest.approx((LW - 2.0) / 2)
    assert m["eval/rewards/chosen"] == pytest.approx(0.5 * (LW - 2.0) / 2)
    assert m["eval/rewards/margins"] == pytest.approx(0.5 * ((LW - 2.0) - (LR - 1.0)) / 2)
    assert m["eval/log_odds_ratio"] == pytest.approx(-sums["or_sum"] / 2)


def test_orpo_objective_keys_are_the_loss_sums_and_layout_counts():
    from dtrain.engine.common import layout_counts
    from dtrain.engine.layout import two_sequence_layout
    from dtrain.engine.loss import ORPO_SUM_KEYS
    from dtrain.engine import ORPO
    from dtrain.types import TokenizedPair

    _, sums = orpo_loss(mx.array([-0.5]), mx.array([-1.0]), mx.array(2.0), 0.1, 4.0, 1.0)
    assert tuple(sums) == ORPO_SUM_KEYS
    counts = layout_counts(two_sequence_layout([TokenizedPair([1, 2], [3], [4, 5])]))
    assert ORPO.metric_keys == ORPO_SUM_KEYS + tuple(counts)


def test_batch_totals_worked_numbers():
    from dtrain.engine import batch_totals
    from dtrain.types import TokenizedPair

    pairs = [TokenizedPair([1, 2, 3], [4, 5], [6]), TokenizedPair([1], [7, 8, 9], [6, 6])]
    # full: (3 - 1) + 2 = 4 and (1 - 1) + 3 = 3; response: 2 + 3
    full = batch_totals(pairs, "full")
    assert (full.nll_tokens, full.pairs) == (7.0, 2.0)
    assert batch_totals(pairs, "response").nll_tokens == 5.0
    assert batch_totals([], "full").nll_tokens == 0.0


@pytest.mark.parametrize("scope", ["full", "response"])
def test_batch_totals_agree_with_layout_nll_weights(scope):
    """The step total (``batch_totals``) and the layouts' NLL weights count the same tokens."""
    import random

    from dtrain.engine.layout import shared_prefix_layout, two_sequence_layout
    from dtrain.engine import batch_totals
    from dtrain.types import TokenizedPair

    rng = random.Random(14)
    for _ in range(30):
        def ids(lo):
            return [rng.randrange(1, 50) for _ in range(rng.randint(lo, 6))]
        pairs = [TokenizedPair(ids(1), ids(1), ids(1)) for _ in range(rng.randint(1, 4))]
        want = batch_totals(pairs, scope).nll_tokens
        for build in (two_sequence_layout, shared_prefix_layout):
            layout = build(pairs, scope)
            assert float(layout.nll_tokens) == want
            assert float(np.array(layout.w_nll).sum()) == want


def test_orpo_finalize_is_finalize_metrics():
    from dtrain.engine import ORPO

    sums = {"nll_sum": 6.0, "or_sum": 1.5, "log_odds_ratio_sum": -1.5, "log_odds_chosen_sum": 2.0,
            "logps_chosen_sum": -1.0, "logps_rejected_sum": -3.0, "accuracy_sum": 1.0,
            "pairs": 2.0, "nll_tokens": 4.0, "input_tokens": 20.0, "fallback_pairs": 0.0}
    assert ORPO(0.5).finalize(sums, "eval/") == finalize_metrics(sums, 0.5, prefix="eval/")
    # loss = 6/4 + 0.5 * 1.5/2 = 1.875
    assert ORPO(0.5).finalize(sums)["loss"] == 1.875
