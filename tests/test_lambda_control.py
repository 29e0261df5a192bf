"""The dynamic-λ controller as a state machine: scripted held-out ℓw series reach every
phase and the hard stop with hand-computed λ; λ stays in its band; the state
survives a JSON round trip (a checkpoint) without changing what follows."""

import json
import random
from dataclasses import replace

import pytest

from dtrain.config import OrpoConfig
from dtrain.run.lambda_control import LAWS, LambdaKnobs, LambdaState, initial, observe, slope

DEFAULT = LambdaKnobs.from_config(OrpoConfig())  # λ_min 0.05, λ_max 0.5, step 0.05, backoff 0.5, K 3
KNOBS = replace(DEFAULT, epsilon=0.01, stop_drop=0.1)


def trace(series, knobs=KNOBS, state=None):
    """``[(phase, λ)]`` after each observation."""
    state = state or initial(knobs)
    out = []
    for lw in series:
        state = observe(state, lw, knobs)
        out.append((state.phase, state.lam))
    return out, state


def test_slope_is_the_least_squares_line():
    assert slope([]) == 0.0 and slope([-1.0]) == 0.0
    assert slope([-1.70, -1.65]) == pytest.approx(0.05)
    # three points: the least-squares slope is (last - first) / 2, whatever the middle one
    assert slope([-1.70, -1.0, -1.62]) == pytest.approx(0.04)
    rng = random.Random(0)
    for _ in range(100):  # an exact line gives its slope back
        a, b, n = rng.uniform(-3, 0), rng.uniform(-0.1, 0.1), rng.randint(2, 8)
        assert slope([a + b * i for i in range(n)]) == pytest.approx(b, abs=1e-12)


def test_aimd_series_reaches_every_phase_and_the_hard_stop():
    """Slopes over the last 3 values are (last - first) / 2 (ε = 0.01):

    obs 1-4: -1.70 (start), -1.65 (+0.05), -1.62 (+0.04), -1.64 (+0.005 < ε: ramp, λ 0.10)
    obs 5-6: -1.635 (-0.0075 >= -ε: 0.15), -1.64 (0.0: 0.20)
    obs 7-8: -1.70 (-0.0325: back off, 0.20 * 0.5 = 0.10), -1.72 (-0.04: 0.05)
    obs 9-11: -1.70, -1.69, -1.69 (slopes 0, +0.015, +0.005: calm 1, 2, 3 -> ramp, λ held)
    obs 12: -1.69 (0.0: ramp, 0.10)
    obs 13: -1.81 < -1.70 - 0.1: hard stop, λ 0.05; obs 14: -1.50 changes nothing.
    """
    series = [-1.70, -1.65, -1.62, -1.64, -1.635, -1.64, -1.70, -1.72, -1.70, -1.69, -1.69, -1.69, -1.81, -1.50]
    got, state = trace(series)
    want = [("hold", 0.05), ("hold", 0.05), ("hold", 0.05), ("ramp", 0.10), ("ramp", 0.15), ("ramp", 0.20),
            ("back_off", 0.10), ("back_off", 0.05), ("back_off", 0.05), ("back_off", 0.05), ("ramp", 0.05),
            ("ramp", 0.10), ("stopped", 0.05), ("stopped", 0.05)]
    assert [p for p, _ in got] == [p for p, _ in want]
    assert [lam for _, lam in got] == pytest.approx([lam for _, lam in want])
    assert state.start == -1.70 and state.observations == 14


def test_back_off_hysteresis_needs_window_calm_evaluations_in_a_row():
    """One calm evaluation between two falls does not restart the ramp: the count starts again."""
    knobs = KNOBS
    state = LambdaState(lam=0.4, phase="back_off", start=-1.0, recent=[-1.00, -1.02, -1.04])
    got, state = trace([-1.03, -1.10, -1.09, -1.08, -1.09], knobs, state)
    # slopes: [-1.02,-1.04,-1.03] -0.005 calm 1; [-1.04,-1.03,-1.10] -0.03 falls (calm 0, λ 0.2);
    # [-1.03,-1.10,-1.09] -0.03 falls (0.1); [-1.10,-1.09,-1.08] +0.01 calm 1; [-1.09,-1.08,-1.09] 0 calm 2
    assert [p for p, _ in got] == ["back_off"] * 5
    assert [lam for _, lam in got] == pytest.approx([0.4, 0.2, 0.1, 0.1, 0.1])
    assert state.calm == 2


def test_pd_law_hand_computed():
    """law pd, step 0.05, kd 0.5, ε 0.01; e = (slope + ε) / ε; Δλ = step * (e + kd (e - e_prev)):

    obs 2 (slope 0): ramp, e 1, no e_prev: Δ 0.05 -> 0.10
    obs 3 (slope -0.005): e 0.5, Δ 0.05 * (0.5 - 0.25) = 0.0125 -> 0.1125
    obs 4 (slope -0.015): back off, e -0.5, Δ 0.05 * (-0.5 - 0.5) = -0.05 -> 0.0625
    obs 5 (slope -0.03): e -2, Δ 0.05 * (-2 - 0.75) = -0.1375 -> clamped to λ_min 0.05
    """
    knobs = replace(DEFAULT, epsilon=0.01, stop_drop=0.5, law="pd", kd=0.5)
    got, state = trace([-1.70, -1.70, -1.71, -1.73, -1.77], knobs)
    assert [p for p, _ in got] == ["hold", "ramp", "ramp", "back_off", "back_off"]
    assert [lam for _, lam in got] == pytest.approx([0.05, 0.10, 0.1125, 0.0625, 0.05])
    assert state.error == pytest.approx(-2.0)


def test_pd_law_never_lowers_lambda_while_ramping():
    """The ramp raises λ (docs/defaults.md: λ falls in back_off only); the pd law's derivative term lowered it
    while the slope, still >= -ε, fell (ε 0.01, kd 0.5):

    obs 5 (slope 0): e 1, e_prev 2: Δ 0.05 * (1 - 0.5) = 0.025 -> 0.225
    obs 6 (slope -0.0075): e 0.25, e_prev 1: Δ 0.05 * (0.25 - 0.375) < 0 -> held at 0.225 (was 0.21875)
    """
    knobs = replace(DEFAULT, epsilon=0.01, stop_drop=0.5, law="pd", kd=0.5)
    got, _ = trace([-1.70, -1.70, -1.69, -1.68, -1.69, -1.695], knobs)
    assert [p for p, _ in got] == ["hold"] + ["ramp"] * 5
    assert [lam for _, lam in got] == pytest.approx([0.05, 0.10, 0.15, 0.20, 0.225, 0.225])


@pytest.mark.parametrize("law", ["aimd", "pd"])
def test_no_windup_at_the_upper_bound(law):
    """Twenty rising evaluations pin λ at λ_max; the first falling one lowers it at once."""
    knobs = replace(DEFAULT, epsilon=0.01, stop_drop=1.0, law=law)
    state = LambdaState(lam=0.05, phase="ramp", start=-2.0, recent=[-2.0, -2.0])
    got, state = trace([-2.0] * 20, knobs, state)
    assert state.lam == 0.5 and max(lam for _, lam in got) == 0.5
    got, state = trace([-2.1], knobs, state)  # slope -0.05
    assert state.phase == "back_off" and state.lam < 0.5
    if law == "aimd":
        assert state.lam == 0.25


def test_non_finite_chosen_logps_freezes_lambda_min():
    _, state = trace([-1.0, -0.9, float("nan"), -0.5])
    assert state.phase == "stopped" and state.lam == 0.05


@pytest.mark.parametrize("law", ["aimd", "pd"])
def test_lambda_stays_in_band_and_state_survives_json(law):
    """Random walks of ℓw: λ within [λ_min, λ_max] always, never lower after a ramp's move nor higher after a
    back-off's; a state written to JSON and read
    back after any observation continues exactly as the uninterrupted one (a resume)."""
    knobs = replace(DEFAULT, epsilon=0.01, stop_drop=0.3, law=law)
    rng = random.Random(1)
    phases = set()
    for _ in range(200):
        lw, series = -1.5, []
        for _ in range(rng.randint(1, 25)):
            lw += rng.gauss(0.0, 0.03)
            series.append(lw)
        whole, end = trace(series, knobs)
        assert all(knobs.lam_min <= lam <= knobs.lam_max for _, lam in whole)
        for (p0, a), (p1, b) in zip(whole, whole[1:]):  # λ rises only in ramp, falls only in back_off
            assert not (p0 == p1 == "ramp" and b < a) and not (p1 == "back_off" and b > a), (series, whole)
        phases |= {p for p, _ in whole}
        cut = rng.randrange(len(series))
        _, mid = trace(series[:cut], knobs)
        resumed = LambdaState.from_dict(json.loads(json.dumps(mid.to_dict())))
        rest, end2 = trace(series[cut:], knobs, resumed)
        assert rest == whole[cut:] and end2 == end
    assert phases == {"hold", "ramp", "back_off", "stopped"}


def test_the_hard_stop_says_why_and_that_training_goes_on():
    """The hard stop logged 'lambda controller ramp -> stopped, lambda 0.05', readable as the run stopping."""
    from dtrain.run.lambda_control import phase_message

    was = LambdaState(lam=0.2, phase="ramp", start=-1.5, recent=[-1.5, -1.6])
    fell = replace(was, phase="stopped", lam=0.05, recent=[-1.6, -2.75])
    assert phase_message(7, was, fell, 1.0) == (
        "step 7: lambda controller ramp -> stopped, lambda 0.05 (eval/logps/chosen -2.75 fell more than "
        "orpo.lambda_stop_drop 1 below its first evaluation's -1.5): lambda stays 0.05 for the rest of the run; "
        "training goes on")
    nan = replace(fell, recent=[-1.6, float("nan")])
    assert phase_message(7, was, nan, 1.0).startswith("step 7: lambda controller ramp -> stopped, lambda 0.05 "
                                                      "(eval/logps/chosen nan is not finite): lambda stays 0.05")
    ramp = replace(was, phase="ramp", lam=0.25)
    assert phase_message(3, replace(was, phase="hold"), ramp, 1.0) == (
        "step 3: lambda controller hold -> ramp, lambda 0.25")


def test_knobs_from_config():
    from dtrain.config import load_config

    cfg = load_config(None, ["data.demo_pairs=1", "orpo.lambda_min=0.1", "orpo.lambda_law=pd", "orpo.lambda_window=4"])
    knobs = LambdaKnobs.from_config(cfg.orpo)
    assert (knobs.lam_min, knobs.lam_max, knobs.law, knobs.window) == (0.1, 0.5, "pd", 4)
    assert DEFAULT == LambdaKnobs(lam_min=0.05, lam_max=0.5, step=0.05, backoff=0.5, window=3, epsilon=0.06,
                                  stop_drop=0.1, law="aimd", kd=0.5)


def test_adaptive_config_errors_name_the_keys():
    from dtrain.config import load_config
    from dtrain.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.demo_pairs=1", "orpo.lambda_schedule=adaptive"])
    assert str(err.value) == ("command line: 'orpo.lambda_schedule: adaptive' needs held-out evaluations during the "
                              "run: set 'train.eval_every' > 0 (it is 0)")
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.demo_pairs=1", "orpo.lambda_schedule=adaptive", "train.eval_every=5",
                           "orpo.lambda_min=0.6"])
    assert str(err.value) == "command line: 'orpo.lambda_min' (0.6) is above 'orpo.lambda_max' (0.5)"
    with pytest.raises(ConfigError, match=r"key 'orpo.lambda_window' must be > 1; got 1"):
        load_config(None, ["data.demo_pairs=1", "orpo.lambda_window=1"])


@pytest.mark.parametrize("epsilon", [5e-324, 1e-310, 1e-12])
def test_an_epsilon_below_what_a_log_prob_resolves_is_refused_naming_the_key(epsilon):
    """ε 5e-324 was accepted (> 0), and the PD law's normalised error (slope + ε)/ε overflowed to inf, whose
    inf - inf made λ NaN from the first move on: every later step's loss NaN, skipped, and the run stopped
    blaming the data. A band below 1e-9 nats/token is far below float32's resolution of a log-prob."""
    from dtrain.config import load_config
    from dtrain.errors import ConfigError

    overflowing = replace(DEFAULT, epsilon=5e-324, law="pd")
    assert trace([-1.0, -1.01], overflowing)[1].lam != trace([-1.0, -1.01], overflowing)[1].lam  # NaN
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.demo_pairs=1", f"orpo.lambda_epsilon={epsilon}"])
    assert str(err.value) == f"command line: key 'orpo.lambda_epsilon' must be >= 1e-09; got {epsilon}"
    knobs = LambdaKnobs.from_config(load_config(None, ["data.demo_pairs=1", "orpo.lambda_epsilon=1e-9"]).orpo)
    rng = random.Random(0)
    for law in LAWS:  # at the floor, slopes as large as float32 allows keep λ a number in its band
        state = initial(replace(knobs, law=law))
        for _ in range(50):
            state = observe(state, rng.choice([-3.4e38, -1.0, -1e-3, 0.0]), replace(knobs, law=law, stop_drop=1e39))
            assert DEFAULT.lam_min <= state.lam <= DEFAULT.lam_max
