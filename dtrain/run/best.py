"""Keep the best evaluated step (``train.keep_best``): which step it is, and its adapter.

The pick is a pure function of the run's held-out evaluations (step -> ``eval/``
metrics, as ``RunState.evals`` keeps them across resumes), so every rank, an
uninterrupted run and a resumed one all pick the same step from the same
numbers (eval metrics are all-reduced, so every rank holds the same floats).
Only the best step's LoRA weights need keeping: :class:`BestAdapter` holds them
on rank 0 and the checkpoint carries them (``best.safetensors``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .guards import CHOSEN_LOGPS

# metric -> +1 when higher is better, -1 when lower is better
DIRECTIONS = {"eval/rewards/accuracies": 1, "eval/log_odds_ratio": 1, "eval/rewards/margins": 1,
              "eval/loss": -1, "eval/nll_loss": -1}
# The DIRECTIONS metrics each objective.kind reports (tests/test_best.py checks them against finalize).
REPORTED = {"orpo": tuple(DIRECTIONS),
            "dpo": ("eval/rewards/accuracies", "eval/rewards/margins", "eval/loss"),
            "simpo": ("eval/rewards/accuracies", "eval/rewards/margins", "eval/loss", "eval/nll_loss"),
            "sft": ("eval/loss", "eval/nll_loss")}


@dataclass(frozen=True)
class Pick:
    """The best step of an evaluation series.

    ``step``/``value``: the best eligible step (> 0) and its metric value, None
    while none is eligible; ``since``: evaluations after it (after step 0
    when none) without a new best; ``guarded``: evaluated steps the guard
    excluded, in order.
    """

    step: Optional[int]
    value: Optional[float]
    since: int
    guarded: tuple = ()


def pick_best(evals: dict, metric: str, guard: Optional[float] = None) -> Pick:
    """The best evaluated step by ``metric`` among steps > 0 (step 0 is the base model).

    A step is eligible when its value is finite and, with ``guard`` (nats/token),
    its ``eval/logps/chosen`` is at least step 0's minus ``guard``. Only a
    strictly better value replaces the best: a tie keeps the earlier step
    (fewer steps away from the base).

    Args:
        evals: step (int or str, as checkpoints keep it) -> eval metrics.
        metric: a key of :data:`DIRECTIONS`.
        guard: the allowed drop of the held-out chosen log-prob below step 0's;
            None: no guard (also when step 0 was not evaluated, or its value is not finite).
    Raises:
        KeyError: ``metric`` is not in :data:`DIRECTIONS`.
    """
    sign = DIRECTIONS[metric]
    evals = {int(k): v for k, v in evals.items()}
    base = evals.get(0, {}).get(CHOSEN_LOGPS)
    base = base if base is not None and math.isfinite(base) else None  # nothing is "G below" a NaN: no guard
    best_step, best_value, since, guarded = None, None, 0, []
    for step in sorted(s for s in evals if s > 0):
        value, chosen = evals[step].get(metric, math.nan), evals[step].get(CHOSEN_LOGPS, math.nan)
        if guard is not None and base is not None and not chosen >= base - guard:
            guarded.append(step)
            since += 1
        elif math.isfinite(value) and (best_value is None or sign * value > sign * best_value):
            best_step, best_value, since = step, value, 0
        else:
            since += 1
    return Pick(best_step, best_value, since, tuple(guarded))


def figure(value: float) -> str:
    """A metric's value in the closing summary: 4 significant digits (a loss of 3e-6 reads ``3.000e-06``, not
    ``0.0000``), without the bare point ``#`` leaves on a whole number (``2497``, not ``2497.``)."""
    return f"{value:#.4g}".rstrip(".")


def describe(pick: Pick, metric: str, early_stop: Optional[int] = None) -> str:
    """The closing summary's words for a pick (``early_stop``: the step ``train.early_stop_evals`` ended the run at)."""
    stop = "" if early_stop is None else f"early stop at step {early_stop}; "
    if pick.step is None:
        return f"{stop}no evaluated step qualified for train.keep_best; adapters/ holds the last step"
    return f"{stop}adapters/ holds step {pick.step} ({metric} {figure(pick.value)})"


def no_new_best(t) -> str:
    """Why ``train.early_stop_evals`` ends a run (``t``: the ``train`` config section)."""
    n = t.early_stop_evals
    return f"{n} evaluation{'s' if n != 1 else ''} without a new best {t.keep_best}"


class BestAdapter:
    """A copy of the LoRA weights of the best step so far (rank 0 keeps one; other ranks none).

    ``step``: the step they belong to (None before one); ``weights``: flat
    name -> array, as ``adapters.safetensors`` holds them.
    """

    def __init__(self, step: Optional[int] = None, weights: Optional[dict] = None):
        self.step, self.weights = step, weights

    def keep(self, step: int, model) -> None:
        """Copy the model's trainable parameters as the best (evaluated now, so a later update cannot alias them)."""
        import mlx.core as mx  # here: the config imports this module before MLX is set up
        from mlx.utils import tree_flatten

        self.weights = {k: mx.array(v) for k, v in tree_flatten(model.trainable_parameters())}
        mx.eval(list(self.weights.values()))
        self.step = step


def track(run, step: int) -> bool:
    """After the evaluation of ``step`` (``run``: the trainer's ``Run``): the pick of the run's
    evaluations so far, the best step's weights kept on rank 0, ``best/`` logged; True when
    ``train.early_stop_evals`` says stop. Nothing (False) without ``train.keep_best``."""
    t = run.cfg.train
    if t.keep_best is None:
        return False
    pick = run.result.best = pick_best(run.state.evals, t.keep_best, t.keep_best_guard)
    if pick.step == step:
        if run.group.is_main:
            run.best.keep(step, run.model)
        run.state.best_step = step
    if pick.step is not None:
        run.log.scalars(step, {"best/step": float(pick.step), f"best/{t.keep_best}": pick.value})
    return early_stop_due(run)


def early_stop_due(run) -> bool:
    """``train.early_stop_evals`` evaluations in a row without a new best (from the run's evaluations)."""
    t = run.cfg.train
    if t.keep_best is None or not t.early_stop_evals:
        return False
    return pick_best(run.state.evals, t.keep_best, t.keep_best_guard).since >= t.early_stop_evals


def last_and_best(run, last_dir) -> Optional[dict]:
    """Rank 0 at the end of a run with ``train.keep_best``: the last step's adapter to
    ``last_dir`` (``adapters-last/``) and the best step's weights for ``adapters/`` (None:
    none qualified, or no ``train.keep_best``: ``adapters/`` gets the last step)."""
    from ..lora import save_adapter  # here: the config imports this module before MLX is set up

    t = run.cfg.train
    if t.keep_best is None:
        return None
    last = save_adapter(run.model, run.cfg.lora, last_dir, run.base_model, run.chat_template)
    run.log.message(f"last step's adapter written to {last}")
    pick = run.result.best
    if pick is None or pick.step is None:
        return None
    assert run.best.step == pick.step, (run.best.step, pick.step)  # kept when it was evaluated
    return run.best.weights


def recorded_evals(run, step: int) -> dict:
    """The eval metrics of the HPARAMS record written at the run's last ``step``: those of the step adapters/
    holds, so runs compared there are compared by the adapters they wrote; with ``train.keep_best`` the kept
    step's and ``best/step`` (none qualified: ``step``'s, as adapters/ then holds)."""
    pick = run.result.best
    if pick is None or pick.step is None:
        return run.result.evals.get(step, {})
    return {**run.result.evals[pick.step], "best/step": float(pick.step)}


def log_kept(run, step: int) -> None:
    """The ``best`` TensorBoard text naming the kept step (or that none qualified), at the run's last ``step``:
    written with its final record (``trainer.log_hparams``), so a resume of the finished run, which writes no
    record, adds none."""
    pick = run.result.best
    if pick is not None:
        run.log.text("best", describe(pick, run.cfg.train.keep_best, step if run.result.early_stopped else None), step)
