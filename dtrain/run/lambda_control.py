"""The dynamic-λ controller (``orpo.lambda_schedule: adaptive``): λ held inside a band
by the held-out log-probability of the chosen answers.

ORPO can raise held-out reward accuracy by pushing the rejected answers down
while the chosen ones fall too (likelihood displacement: Pal et al. 2024,
"Smaug", arXiv:2402.13228; Razin et al. 2024, arXiv:2410.08847). The
odds-ratio weight λ sets how hard the rejected side is pushed, so the
controller treats λ as the manipulated variable and ℓw, the held-out mean
log-probability of the chosen response tokens (``eval/logps/chosen``,
nats/token), as the process variable, one observation per evaluation:

- ``hold`` (phase 1): λ = λ_min while ℓw still rises (slope ≥ +ε);
- ``ramp`` (phase 2): λ rises each evaluation while the slope stays ≥ −ε;
- ``back_off`` (phase 3): λ falls when the slope drops below −ε; it returns to
  ``ramp`` only after ``window`` evaluations in a row with slope ≥ −ε
  (hysteresis: one noisy rise does not restart the ramp);
- ``stopped``: ℓw fell more than ``stop_drop`` below its phase-1 start; λ is
  frozen at λ_min for the rest of the run.

Two laws move λ in ``ramp``/``back_off``: ``aimd`` (additive increase by
``step``, multiplicative decrease by ``backoff``, as TCP congestion control)
and ``pd``, a velocity-form PD law on the normalised slope error
``e = (slope + ε) / ε``: ``Δλ = step * (e + kd * (e - e_prev))``, in ``ramp``
between 0 and ``step``, in ``back_off`` at most 0. In both, λ itself is the integrator and is clamped to
``[λ_min, λ_max]``, so nothing winds up while λ sits at a bound (anti-windup).
The slope is a least-squares line through the last ``window`` observations
(nats/token per evaluation), robust to one noisy point in a way a two-point
difference is not.

The controller is a pure state machine: :func:`observe` takes a
:class:`LambdaState` and one ℓw and returns the next state; the state is plain
JSON (``to_dict``/``from_dict``) so a checkpoint carries it and a resumed run
continues the same λ sequence bit for bit. In a run, :func:`steer` feeds it each
evaluation and sets the λ the next steps get as their ``lambda`` hyper-parameter
(``step.Step.hyper``: a float32 input of the step, so a new λ retraces nothing).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

PHASES = ("hold", "ramp", "back_off", "stopped")
LAWS = ("aimd", "pd")


@dataclass(frozen=True)
class LambdaKnobs:
    """The controller's settings (the ``orpo.lambda_*`` keys; their defaults live in ``dtrain.config``).

    ``lam_min``/``lam_max``: the band; ``step``: additive increase per evaluation;
    ``backoff``: multiplicative decrease (aimd); ``window``: K, evaluations in
    the slope fit and in the hysteresis count; ``epsilon``: ε, the noise band
    of the slope (nats/token per evaluation); ``stop_drop``: the hard stop
    (nats/token below the phase-1 start); ``law``: ``aimd`` or ``pd``; ``kd``:
    the PD law's derivative gain.
    """

    lam_min: float
    lam_max: float
    step: float
    backoff: float
    window: int
    epsilon: float
    stop_drop: float
    law: str
    kd: float

    @classmethod
    def from_config(cls, orpo) -> "LambdaKnobs":
        """The knobs of a run's ``orpo`` config section."""
        return cls(orpo.lambda_min, orpo.lambda_max, orpo.lambda_step, orpo.lambda_backoff, orpo.lambda_window,
                   orpo.lambda_epsilon, orpo.lambda_stop_drop, orpo.lambda_law, orpo.lambda_kd)


@dataclass
class LambdaState:
    """Where the controller is: JSON-able, so a checkpoint holds it (``RunState.lambda_control``).

    ``lam``: λ of the steps after the last observation; ``start``: ℓw of the
    first observation (the phase-1 start); ``recent``: the last ``window`` ℓw;
    ``calm``: evaluations in a row with slope ≥ −ε while backing off;
    ``error``: the PD law's last normalised error (None before one).
    """

    lam: float
    phase: str = "hold"
    start: float | None = None
    recent: list = field(default_factory=list)
    calm: int = 0
    error: float | None = None
    observations: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "LambdaState":
        return cls(**raw)


def initial(knobs: LambdaKnobs) -> LambdaState:
    """The state before any evaluation: phase 1 at λ_min."""
    return LambdaState(lam=knobs.lam_min)


def slope(values: list) -> float:
    """Least-squares slope of ``values`` against 0, 1, 2, ... (units of a value per index); 0.0 for < 2 values."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((i - mean_x) * (y - mean_y) for i, y in enumerate(values))
    return num / sum((i - mean_x) ** 2 for i in range(n))


def _clamp(lam: float, knobs: LambdaKnobs) -> float:
    return min(max(lam, knobs.lam_min), knobs.lam_max)


def _move(lam: float, e: float, e_prev: float | None, knobs: LambdaKnobs, rising: bool) -> float:
    """λ after one move of the law, up (``rising``) or down; ``e``: the normalised slope error."""
    if knobs.law == "pd":
        delta = knobs.step * (e + knobs.kd * (e - (e if e_prev is None else e_prev)))
        # the phase sets the direction: the derivative term damps a ramp's rise, never reverses it
        delta = min(max(delta, 0.0), knobs.step) if rising else min(delta, 0.0)
        return _clamp(lam + delta, knobs)
    return _clamp(lam + knobs.step if rising else lam * knobs.backoff, knobs)


def observe(state: LambdaState, chosen_logps: float, knobs: LambdaKnobs) -> LambdaState:
    """The state after one held-out ℓw (``eval/logps/chosen``, nats/token); ``state`` is not changed.

    A non-finite ℓw freezes λ at λ_min (``stopped``): nothing can be steered on it.
    """
    s = dataclasses.replace(state, recent=[*state.recent, chosen_logps][-knobs.window:],
                            observations=state.observations + 1)
    if s.phase == "stopped":
        return s
    if not math.isfinite(chosen_logps):
        return dataclasses.replace(s, phase="stopped", lam=knobs.lam_min)
    if s.start is None:
        s.start = chosen_logps
    if chosen_logps < s.start - knobs.stop_drop:
        return dataclasses.replace(s, phase="stopped", lam=knobs.lam_min)
    if len(s.recent) < 2:
        return s
    d = slope(s.recent)
    e, e_prev = (d + knobs.epsilon) / knobs.epsilon, s.error
    s.error = e
    if s.phase == "hold":
        if d >= knobs.epsilon:
            return s
        s.phase = "ramp"  # ℓw stopped rising: start pressing on the rejected side
    if s.phase == "ramp":
        if d >= -knobs.epsilon:
            s.lam = _move(s.lam, e, e_prev, knobs, rising=True)
            return s
        s.phase, s.calm = "back_off", 0
        s.lam = _move(s.lam, e, e_prev, knobs, rising=False)
        return s
    # back_off: down while ℓw falls; ramp again only after `window` calm evaluations in a row
    if d < -knobs.epsilon:
        s.calm = 0
        s.lam = _move(s.lam, e, e_prev, knobs, rising=False)
        return s
    s.calm += 1
    if s.calm >= knobs.window:
        s.phase, s.calm = "ramp", 0
    return s


def start(orpo, state: dict) -> dict:
    """A run's controller state (``RunState.lambda_control``): ``state`` as resumed, or the
    initial one of an adaptive run that has none; ``{}`` for a static run without one."""
    if orpo.lambda_schedule == "adaptive" and not state:
        return initial(LambdaKnobs.from_config(orpo)).to_dict()
    return state


def hyper(orpo, state: dict, base: dict) -> dict:
    """The step's hyper-parameters: ``base`` (``objective.hyper()``, λ = ``orpo.lambda``) with
    ``lambda`` the controller's when ``orpo.lambda_schedule`` is adaptive (a static resume of
    an adaptive run trains with ``orpo.lambda``)."""
    if orpo.lambda_schedule != "adaptive":
        return base
    import mlx.core as mx  # here: the config imports this module before MLX is set up

    return {**base, "lambda": mx.array(LambdaState.from_dict(state).lam, mx.float32)}


def steer(run, step: int) -> None:
    """After the evaluation of ``step`` (``run``: the trainer's ``Run``): observe its
    ``eval/logps/chosen``, keep the state in ``run.state`` and give the next steps its λ
    (``run.step.hyper``); a phase change is logged. Nothing for a static run."""
    orpo = run.cfg.orpo
    if orpo.lambda_schedule != "adaptive":
        return
    was = LambdaState.from_dict(run.state.lambda_control)
    now = observe(was, run.state.evals[str(step)]["eval/logps/chosen"], LambdaKnobs.from_config(orpo))
    run.state.lambda_control = now.to_dict()
    run.step.hyper = hyper(orpo, run.state.lambda_control, run.step.hyper)
    if now.phase != was.phase:
        run.log.message(phase_message(step, was, now, orpo.lambda_stop_drop))


def phase_message(step: int, was: LambdaState, now: LambdaState, stop_drop: float) -> str:
    """The line a phase change writes; the hard stop says why, and that it is λ's, not the run's."""
    line = f"step {step}: lambda controller {was.phase} -> {now.phase}, lambda {now.lam:.4g}"
    if now.phase != "stopped":
        return line
    seen = now.recent[-1]
    why = (f"eval/logps/chosen {seen:.4g} is not finite" if not math.isfinite(seen) else
           f"eval/logps/chosen {seen:.4g} fell more than orpo.lambda_stop_drop {stop_drop:g} below its first "
           f"evaluation's {now.start:.4g}")
    return f"{line} ({why}): lambda stays {now.lam:.4g} for the rest of the run; training goes on"
