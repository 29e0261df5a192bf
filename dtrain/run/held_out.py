"""What the held-out pairs allow: the keys that steer by them, and what a run says when they are few or too
rarely evaluated to steer by (``train.keep_best``, ``orpo.lambda_schedule: adaptive``)."""

from __future__ import annotations

from ..config import Config
from ..errors import UserError
from ..types import example_noun
from .best import REPORTED
from .evaluation import ACCURACY

FEW_HELD_OUT = 40  # below this many held-out pairs, keep_best and the lambda controller get a notice


def held_out_steering(cfg: Config, train_pairs: int, held_out_pairs: int) -> list:
    """The keys on that steer by the held-out metrics (``train.keep_best``, ``orpo.lambda_schedule: adaptive``).

    Raises:
        UserError: one is on and there are no held-out pairs (``train_pairs``: the training pairs, named).
    """
    steering = [k for k, on in (("train.keep_best", cfg.train.keep_best is not None),
                                ("orpo.lambda_schedule: adaptive", cfg.orpo.lambda_schedule == "adaptive")) if on]
    if steering and not held_out_pairs:
        noun = example_noun(cfg.objective.kind)
        fix = _no_held_out_fix(cfg.data, train_pairs, noun)
        raise UserError(f"{' and '.join(steering)} need{'s' if len(steering) == 1 else ''} held-out {noun}s, and this "
                        f"run has none: {fix} (or turn {'it' if len(steering) == 1 else 'them'} off)")
    return steering


def _no_held_out_fix(d, train_pairs: int, noun: str) -> str:
    """What to change when ``data.valid_fraction`` (``d``: a DataConfig) held out none of ``train_pairs``
    (``noun``: what the examples are called, pair or sft's row). A held-out source of its own that gives
    none stops the run before (``data.load_dataset``)."""
    if d.valid_fraction > 0:  # fewer than two prompts (data.split_rows keeps one to train on): say so
        return (f"data.valid_fraction {d.valid_fraction} of {train_pairs} {noun}s gives none (it holds out whole "
                f"prompts, one kept to train on): set data.valid or add {noun}s of other prompts")
    return "set data.valid or data.valid_fraction > 0"


def steering_notices(cfg: Config, steering: list, evaluated: int, held_out: int) -> list:
    """The notices for ``steering`` (:func:`held_out_steering`'s keys) over ``evaluated`` held-out pairs (of
    ``held_out``; ``train.eval_pairs`` may take fewer): too few to steer by, and evaluations too rare to steer."""
    t, noun, notices = cfg.train, example_noun(cfg.objective.kind), []
    verb = f"steer{'s' if len(steering) == 1 else ''}"
    if steering and evaluated < FEW_HELD_OUT:
        # sft reports no accuracy (no rejected side) to show the step one pair makes
        moves = f": one pair moves {ACCURACY} by {1 / evaluated:.2f}," if ACCURACY in REPORTED[cfg.objective.kind] else ","
        limit = f"; train.eval_pairs limits them to {t.eval_pairs}" if evaluated < held_out else ""
        notices.append(f"{' and '.join(steering)} {verb} by the held-out metrics, here over {evaluated} {noun}(s)"
                       f"{moves} so the choices follow noise; keep {FEW_HELD_OUT}+ held-out {noun}s (data.valid or "
                       f"data.valid_fraction{limit})")
    # a notice, not an error: a run extended by a resume steers by the last evaluation of the run it continues
    if steering and t.eval_every >= t.steps and t.resume is None:
        what = {"train.keep_best": "adapters/ holds the last step",
                "orpo.lambda_schedule: adaptive": "lambda stays orpo.lambda_min"}
        notices.append(f"{' and '.join(steering)} {verb} by evaluations during the run, and train.eval_every "
                       f"{t.eval_every} >= train.steps {t.steps} evaluates only step 0 and the last: "
                       f"{' and '.join(what[k] for k in steering)}; set train.eval_every below train.steps")
    return notices
