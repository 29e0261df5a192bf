"""DPO, SimPO and SFT objectives: worked losses and TRL metrics in float64, loss
gradients against finite differences, and their registry.

Worked numbers (module constants, computed by hand from the papers' equations):
- SimPO (Meng et al. 2024, eq. 6), chosen mean log-prob ln(1/2), rejected ln(1/4),
  beta 2, gamma 0.5: x = 2 ln 2 - 0.5 = 0.886294, loss = ln(1 + e^-x) = 0.3451348.
- DPO (Rafailov et al. 2023, eq. 7), summed log-probs policy (-6, -9) over (3, 4)
  tokens, reference (-7, -8), beta 0.1: h = (-6 + 7) - (-9 + 8) = 2,
  sigmoid: ln(1 + e^-0.2) = 0.5981389; hinge: max(0, 1 - 0.2) = 0.8;
  ipo (Azar et al. 2023 eq. 17 on TRL's mean log-probs): h = (-2 + 7/3) - (-9/4 + 2)
  = 7/12, loss = (7/12 - 5)^2 = 19.506944.
"""

import math

import mlx.core as mx
import numpy as np
import pytest

from dtrain.config import load_config
from dtrain.engine import DPO, OBJECTIVES, ORPO, SFT, SimPO, make_objective
from dtrain.engine.common import layout_counts
from dtrain.engine.objective import PairLogps, Totals

LW, LR = math.log(0.5), math.log(0.25)
# MLX's CPU log/exp kernels carry float32 rounding even in float64 (tests/test_engine_reference.py)
TOL = 1e-7


def f64(*xs):
    return [mx.array(np.array(x, np.float64), mx.float64) for x in xs]


def pair_logps(c, r, nll, lens=None, ref=None):
    """``PairLogps`` (float64) of per-pair mean log-probabilities ``c``/``r`` over ``lens``
    tokens (1 each by default), with reference sums ``ref`` as DPO's extra inputs."""
    lens = lens or ([1.0] * len(c), [1.0] * len(r))
    lc, lr = np.array(lens[0], np.float64), np.array(lens[1], np.float64)
    chosen, rejected, n, tc, tr = f64(np.array(c) * lc, np.array(r) * lr, nll, lc, lr)
    extra = dict(zip(("ref_chosen", "ref_rejected"), f64(*ref))) if ref is not None else {}
    return PairLogps(chosen, rejected, tc, tr, n, extra)


def hyper64(obj):
    """``obj.hyper()``'s names at float64, so the worked numbers hold to ``TOL``."""
    return {k: mx.array(float(getattr(obj, k)), mx.float64) for k in obj.hyper()}


def scored(obj, logps, totals):
    return obj.loss(logps, totals, hyper64(obj))


def finalized(objective, loss_sums, extra):
    _, sums = loss_sums
    return objective.finalize({**{k: float(v) for k, v in sums.items()}, **extra})


def test_simpo_worked_example_and_trl_metrics():
    obj = SimPO(beta=2.0, gamma=0.5)
    loss, sums = scored(obj, pair_logps([LW], [LR], 3.0), Totals(nll_tokens=2.0, pairs=1.0))
    assert loss.item() == pytest.approx(0.3451348346534808, rel=TOL)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-(2 * math.log(2) - 0.5))), rel=TOL)
    m = finalized(obj, (loss, sums), {"pairs": 1.0, "nll_tokens": 2.0})
    assert m["rewards/chosen"] == pytest.approx(2 * LW, rel=TOL)  # TRL CPO: beta * mean logps
    assert m["rewards/rejected"] == pytest.approx(2 * LR, rel=TOL)
    assert m["rewards/margins"] == pytest.approx(2 * math.log(2), rel=TOL)
    assert m["rewards/accuracies"] == 1.0
    assert m["logps/chosen"] == pytest.approx(LW) and m["logps/rejected"] == pytest.approx(LR)
    assert m["nll_loss"] == pytest.approx(1.5) and m["loss"] == pytest.approx(0.3451348346534808, rel=TOL)


def test_simpo_nll_hybrid_adds_weighted_token_mean_nll():
    obj = SimPO(beta=2.0, gamma=0.5, nll_weight=0.7)
    loss, sums = scored(obj, pair_logps([LW, -1.0], [LR, -0.5], 9.0), Totals(nll_tokens=6.0, pairs=2.0))
    second = math.log1p(math.exp(-(2 * (-1.0 + 0.5) - 0.5)))  # a pair the model gets wrong
    want = 0.7 * 9.0 / 6.0 + (0.3451348346534808 + second) / 2
    assert loss.item() == pytest.approx(want, rel=TOL)
    m = finalized(obj, (loss, sums), {"pairs": 2.0, "nll_tokens": 6.0})
    assert m["loss"] == pytest.approx(want, rel=TOL) and m["rewards/accuracies"] == 0.5


@pytest.mark.parametrize("loss_type, want", [("sigmoid", 0.5981388693815918), ("hinge", 0.8),
                                             ("ipo", (7 / 12 - 5) ** 2)])
def test_dpo_worked_example_per_loss_type(loss_type, want):
    obj = DPO(beta=0.1, loss_type=loss_type)
    logps = pair_logps([-2.0], [-2.25], 0.0, ([3.0], [4.0]), ([-7.0], [-8.0]))
    loss, sums = scored(obj, logps, Totals(nll_tokens=3.0, pairs=1.0))
    assert loss.item() == pytest.approx(want, rel=TOL)
    m = finalized(obj, (loss, sums), {"pairs": 1.0, "nll_tokens": 3.0})
    if loss_type == "ipo":  # TRL: IPO rewards on mean log-probs
        assert m["rewards/chosen"] == pytest.approx(0.1 * (-2.0 + 7 / 3), rel=TOL)
        assert m["logps/chosen"] == pytest.approx(-2.0, rel=TOL)
    else:  # TRL DPOTrainer: rewards = beta * (policy - reference) summed log-probs
        assert m["rewards/chosen"] == pytest.approx(0.1 * (-6.0 + 7.0), rel=TOL)
        assert m["rewards/rejected"] == pytest.approx(0.1 * (-9.0 + 8.0), rel=TOL)
        assert m["rewards/margins"] == pytest.approx(0.2, rel=TOL)
        assert m["logps/chosen"] == pytest.approx(-6.0, rel=TOL)
        assert m["logps/rejected"] == pytest.approx(-9.0, rel=TOL)
    assert m["rewards/accuracies"] == 1.0 and m["loss"] == pytest.approx(want, rel=TOL)


def test_dpo_policy_equal_to_reference_gives_ln2_per_pair():
    obj = DPO(beta=0.1)
    lens = ([3.0, 5.0], [4.0, 2.0])
    c, r = np.array([-2.0, -0.7]), np.array([-2.25, -3.1])
    ref = (list(c * lens[0]), list(r * lens[1]))
    loss, sums = scored(obj, pair_logps(c, r, 0.0, lens, ref), Totals(8.0, 2.0))
    assert loss.item() == pytest.approx(math.log(2), rel=TOL)
    assert sums["accuracy_sum"].item() == 0.0  # equal rewards are not a preference (TRL: chosen > rejected)


def test_dpo_counts_a_margin_within_float32_rounding_as_a_tie():
    """At step 1 the policy is the reference, its summed log-probs computed in other micro-batches: a chosen sum
    one float32 ulp above its reference (-136.0625 + 2^-16, rejected equal) counted the pair as preferred
    (TRL's rewards are equal there: accuracy 0). A margin beyond the four sums' rounding still counts."""
    obj = DPO(beta=0.1)
    f32 = lambda *xs: [mx.array(np.array(x, np.float32)) for x in xs]  # noqa: E731
    ref_c, ref_r = np.float32(-136.0625), np.float32(-66.4375)
    ulp = float(np.spacing(np.float32(136.0625)))
    for chosen, want in ((ref_c + ulp, 0.0), (ref_c - ulp, 0.0), (ref_c, 0.0), (ref_c + 64 * ulp, 1.0)):
        c, r, tc, tr, nll, rc, rr = f32([chosen], [ref_r], [20.0], [10.0], 0.0, [ref_c], [ref_r])
        _, sums = obj.loss(PairLogps(c, r, tc, tr, nll, {"ref_chosen": rc, "ref_rejected": rr}), Totals(20.0, 1.0),
                           obj.hyper())
        assert sums["accuracy_sum"].item() == want, chosen


def test_dpo_without_reference_log_probs_is_an_error_naming_them():
    logps = pair_logps([-2.0], [-2.25], 0.0, ([3.0], [4.0]))  # no extra inputs
    with pytest.raises(ValueError, match=r"DPO needs the pairs' reference log-probabilities .*'ref_chosen', "
                                         r"'ref_rejected'.*these carry \[\]"):
        scored(DPO(0.1), logps, Totals(3.0, 1.0))


def test_sft_is_token_mean_nll():
    obj = SFT()
    loss, sums = scored(obj, pair_logps([LW, -1.0], [0.0, 0.0], 9.0), Totals(nll_tokens=6.0, pairs=2.0))
    assert loss.item() == pytest.approx(1.5, rel=TOL)
    m = finalized(obj, (loss, sums), {"pairs": 2.0, "nll_tokens": 6.0})
    assert m == {"loss": 1.5, "nll_loss": 1.5, "logps/chosen": pytest.approx((LW - 1.0) / 2)}


def fd_check(fn, xs, h=2e-2):
    """Gradient of the scalar ``fn(*xs)`` against Richardson-extrapolated central differences
    (float64 inputs; a large ``h`` because of the kernels' float32 rounding, see ``TOL``)."""
    grads = mx.grad(lambda *a: fn(*a), argnums=tuple(range(len(xs))))(*xs)
    for i, (x, g) in enumerate(zip(xs, grads)):
        base = np.array(x, np.float64)
        for j in range(base.size):
            up, down = base.copy(), base.copy()
            up.flat[j] += h
            down.flat[j] -= h
            args_up = [mx.array(up, mx.float64) if k == i else xs[k] for k in range(len(xs))]
            args_down = [mx.array(down, mx.float64) if k == i else xs[k] for k in range(len(xs))]
            d1 = (fn(*args_up).item() - fn(*args_down).item()) / (2 * h)
            up.flat[j] -= h / 2
            down.flat[j] += h / 2
            args_up = [mx.array(up, mx.float64) if k == i else xs[k] for k in range(len(xs))]
            args_down = [mx.array(down, mx.float64) if k == i else xs[k] for k in range(len(xs))]
            d2 = (fn(*args_up).item() - fn(*args_down).item()) / h
            fd = (4 * d2 - d1) / 3
            assert np.array(g).flat[j] == pytest.approx(fd, rel=1e-4, abs=1e-6), (i, j)


@pytest.mark.parametrize("obj", [SimPO(2.0, 0.5, 0.3), DPO(0.1, "sigmoid"), DPO(0.5, "ipo"), DPO(0.1, "hinge"), SFT()],
                         ids=["simpo", "dpo_sigmoid", "dpo_ipo", "dpo_hinge", "sft"])
def test_loss_gradients_match_finite_differences(obj):
    """Over the summed log-probabilities, the NLL sum and (DPO) the reference sums."""
    base = pair_logps([-2.0, -0.4, -1.3], [-2.25, -0.9, -0.2], 7.5, ([3.0, 5.0, 2.0], [4.0, 2.0, 6.0]),
                      ([-7.0, -1.0, -4.0], [-8.0, -2.5, -0.3]))
    totals = Totals(nll_tokens=11.0, pairs=3.0)

    def loss(c, r, n, rc, rr):
        logps = PairLogps(c, r, base.chosen_tokens, base.rejected_tokens, n, {"ref_chosen": rc, "ref_rejected": rr})
        return scored(obj, logps, totals)[0]

    fd_check(loss, [base.chosen, base.rejected, base.nll_sum, base.extra["ref_chosen"], base.extra["ref_rejected"]])


def test_micro_batches_add_up_to_the_global_loss():
    """Each loss is normalised by global totals: two halves sum to the whole."""
    totals = Totals(nll_tokens=11.0, pairs=2.0)
    lens, ref = ([3.0, 5.0], [4.0, 2.0]), ([-7.0, -1.0], [-8.0, -2.5])
    c, r = [-2.0, -0.4], [-2.25, -0.9]
    for obj in (SimPO(2.0, 0.5, 0.3), DPO(0.1), SFT()):
        def part(i, n):
            one = pair_logps(c[i:i + 1], r[i:i + 1], n, (lens[0][i:i + 1], lens[1][i:i + 1]),
                             (ref[0][i:i + 1], ref[1][i:i + 1]))
            return scored(obj, one, totals)[0].item()
        whole = scored(obj, pair_logps(c, r, 7.5, lens, ref), totals)[0].item()
        assert part(0, 3.0) + part(1, 4.5) == pytest.approx(whole, rel=TOL)


def test_hyper_parameters_are_float32_step_inputs():
    """Each objective's ``hyper()`` names its float hyper-parameters as float32 scalars (step
    inputs); the loss reads them from there, not from the instance."""
    assert set(DPO(0.1).hyper()) == {"beta"} and SFT().hyper() == {}
    assert set(SimPO(2.0, 0.5, 0.3).hyper()) == {"beta", "gamma", "nll_weight"}
    for obj in (DPO(0.1), SimPO(2.0, 0.5, 0.3)):
        assert all(v.dtype == mx.float32 and v.shape == () for v in obj.hyper().values())
    logps, totals = pair_logps([-2.0], [-2.25], 0.0, ([3.0], [4.0]), ([-7.0], [-8.0])), Totals(3.0, 1.0)
    other = DPO(0.3)  # beta 0.3 through DPO(0.1)'s loss: h = 2, ln(1 + e^-0.6)
    assert DPO(0.1).loss(logps, totals, hyper64(other))[0].item() == pytest.approx(math.log1p(math.exp(-0.6)),
                                                                                 rel=TOL)


@pytest.mark.parametrize("kind, overrides, want", [
    ("orpo", ["orpo.lambda=0.3"], ORPO(0.3)),
    ("dpo", [], DPO(0.1, "sigmoid")),
    ("dpo", ["objective.beta=0.2", "objective.loss_type=ipo"], DPO(0.2, "ipo")),
    ("simpo", [], SimPO(2.0, 0.5, 0.0)),
    ("simpo", ["objective.beta=2.5", "objective.simpo_gamma=1.0", "objective.nll_weight=1.0"], SimPO(2.5, 1.0, 1.0)),
    ("sft", [], SFT("response")),
    ("sft", ["objective.completion_only_loss=false"], SFT("full")),
])
def test_objective_kind_chooses_the_objective_with_its_keys(kind, overrides, want):
    cfg = load_config(None, ["data.demo_pairs=4", f"objective.kind={kind}", *overrides])
    assert make_objective(cfg) == want


def test_registry_names_every_objective_and_their_keys_are_sums_plus_counts():
    assert set(OBJECTIVES) == {"orpo", "dpo", "simpo", "sft"}
    from dtrain.engine.layout import two_sequence_layout
    from dtrain.types import TokenizedPair

    counts = set(layout_counts(two_sequence_layout([TokenizedPair([1, 2], [3], [4])])))
    for cls in OBJECTIVES.values():
        assert counts <= set(cls.metric_keys)


def test_unknown_objective_kind_is_a_config_error_naming_the_key():
    from dtrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"objective.kind.*orpo, dpo, simpo, sft"):
        load_config(None, ["data.demo_pairs=4", "objective.kind=kto"])


@pytest.mark.parametrize("name, want", [("dpo.yaml", DPO(0.1, "sigmoid")), ("sft.yaml", SFT("response"))])
def test_shipped_objective_configs_load(name, want):
    from pathlib import Path

    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / name))
    assert make_objective(cfg) == want


@pytest.mark.parametrize("kind, key, value", [("orpo", "objective.beta", "0.2"), ("dpo", "objective.simpo_gamma", "1"),
                                              ("sft", "objective.loss_type", "ipo"), ("dpo", "orpo.lambda", "0.5"),
                                              ("simpo", "objective.completion_only_loss", "false")])
def test_an_objective_key_for_another_kind_is_an_error_naming_it(kind, key, value):
    from dtrain.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"'{key}' is .* but objective.kind {kind} does not read it"):
        load_config(None, ["data.demo_pairs=4", f"objective.kind={kind}", f"{key}={value}"])


def test_simpo_finalize_reads_the_steps_hyper_parameters():
    """beta and nll_weight given as the step's inputs (a λ-style controller, issue 25's ``finalize(sums, prefix,
    hyper)``) set the metrics, not the built ones: nll 2/4 = 0.5, loss 0.75 * 0.5 + 1/2 = 0.875, rewards 2.5 x
    the mean log-probs -0.5 and -1.5."""
    sums = {"pairs": 2.0, "nll_tokens": 4.0, "nll_sum": 2.0, "simpo_sum": 1.0, "logps_chosen_sum": -1.0,
            "logps_rejected_sum": -3.0, "accuracy_sum": 2.0}
    given = SimPO(2.5, 0.5, 0.75)
    m = SimPO(2.0, 0.5, 0.0).finalize(sums, "", given.hyper())
    assert m == given.finalize(sums)
    assert (m["loss"], m["rewards/chosen"], m["rewards/rejected"], m["rewards/margins"]) == (0.875, -1.25, -3.75, 2.5)


TRL_NOT_LOGGED = ("logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy", "num_tokens")


def test_readme_metrics_paragraph_matches_the_objectives():
    """README "Objective and metrics" names the TRL metrics no objective logs, and says ORPO's
    rewards/accuracies compares the log-probs: at lambda = 0 (TRL's rewards and accuracy 0) it is the
    share of pairs with logps/chosen > logps/rejected, here 2 of 3."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    paragraph = readme.split("### Objective and metrics", 1)[1].split("**Healthy or degenerate?**", 1)[0]
    for name in TRL_NOT_LOGGED:
        assert f"`{name}`" in paragraph, name
    for kind in OBJECTIVES:
        obj = make_objective(load_config(None, ["data.demo_pairs=4", f"objective.kind={kind}"]))
        sums = {k: mx.array(1.0, mx.float32) for k in obj.metric_keys}
        assert not set(obj.finalize(sums, "", obj.hyper())) & set(TRL_NOT_LOGGED), kind
    orpo = ORPO(0.0)
    lw, lr = mx.array([-1.0, -2.0, -3.0]), mx.array([-2.0, -1.0, -4.0])
    _, sums = orpo.loss(PairLogps(lw, lr, mx.ones(3), mx.ones(3), mx.array(6.0)), Totals(3.0, 3.0), orpo.hyper())
    m = orpo.finalize({**sums, "pairs": 3.0, "nll_tokens": 3.0}, "", orpo.hyper())
    assert m["rewards/accuracies"] == pytest.approx(2 / 3) and m["rewards/chosen"] == m["rewards/rejected"] == 0.0
    assert "`logps/chosen > logps/rejected`" in paragraph and "λ = 0" in paragraph


def objectives_doc() -> str:
    """docs/objectives.md's paragraph on metrics (from "Metrics follow TRL's" to "Tests:")."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "objectives.md").read_text()
    return " ".join(doc.split("Metrics follow TRL's", 1)[1].split("Tests:", 1)[0].split())


def test_dpo_ipo_metrics_are_per_token_and_the_doc_says_trl_sums_them():
    """ipo's rewards and logps are on mean log-probs per token (the loss's, and the guards' unit); TRL's
    DPOTrainer (>= 0.29) logs them on summed log-probs, so its accuracy can differ, which the doc says.
    One pair, chosen 1 token (policy -1, reference -1.5), rejected 4 (policy -8, reference -9.2), beta 0.1:
    per token the ratios are 0.5 and 0.3 (accuracy 1, rewards 0.05 and 0.03, logps -1 and -2); summed
    (TRL) 0.5 and 1.2 (accuracy 0, rewards 0.05 and 0.12, logps -1 and -8); loss (0.2 - 5)^2 = 23.04."""
    obj = DPO(beta=0.1, loss_type="ipo")
    loss, sums = scored(obj, pair_logps([-1.0], [-2.0], 0.0, ([1.0], [4.0]), ([-1.5], [-9.2])), Totals(1.0, 1.0))
    m = finalized(obj, (loss, sums), {"pairs": 1.0, "nll_tokens": 1.0})
    assert m["loss"] == pytest.approx(23.04, rel=TOL) and m["rewards/accuracies"] == 1.0
    assert (m["rewards/chosen"], m["rewards/rejected"]) == (pytest.approx(0.05, rel=1e-6), pytest.approx(0.03, rel=1e-6))
    assert (m["logps/chosen"], m["logps/rejected"]) == (pytest.approx(-1.0), pytest.approx(-2.0))
    assert "TRL's `DPOTrainer` (since 0.29) logs them on summed log-probs" in objectives_doc()


def test_simpo_logs_its_nll_at_weight_0_and_the_doc_says_trl_logs_0():
    """At ``nll_weight: 0`` SimPO still logs the chosen completions' NLL per token (3 nats over 2 tokens:
    1.5; keep_best: eval/nll_loss reads it), where TRL's CPOTrainer, which skips the NLL at
    ``cpo_alpha == 0``, logs ``nll_loss`` 0: the doc says so. The loss has no NLL term (0.3451348)."""
    obj = SimPO(beta=2.0, gamma=0.5, nll_weight=0.0)
    loss, sums = scored(obj, pair_logps([LW], [LR], 3.0), Totals(nll_tokens=2.0, pairs=1.0))
    m = finalized(obj, (loss, sums), {"pairs": 1.0, "nll_tokens": 2.0})
    assert m["nll_loss"] == 1.5 and m["loss"] == pytest.approx(0.3451348346534808, rel=TOL)
    assert "also at `nll_weight: 0`, where TRL's `CPOTrainer` logs 0" in objectives_doc()
