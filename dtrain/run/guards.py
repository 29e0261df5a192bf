"""Warnings about a run that trains but is heading somewhere unwanted.

Pure functions over the held-out metrics the trainer already keeps
(step -> ``eval/`` metrics, as the run state keeps them); the trainer logs what they
return. Nothing here stops a run.
"""

from __future__ import annotations

import math
from typing import Optional

from ..types import example_noun

CHOSEN_LOGPS = "eval/logps/chosen"


REMEDIES = {  # objective.kind -> what the warning suggests besides a lower learning rate
    "orpo": " or orpo.lambda",
    "simpo": ", or a higher objective.nll_weight (the SFT term that holds the chosen answers up)",
}
# orpo.lambda_schedule: adaptive reads no orpo.lambda: the controller steers λ up to orpo.lambda_max
ADAPTIVE_REMEDY = " or orpo.lambda_max (orpo.lambda is not read under the adaptive schedule)"


def chosen_logps_drop(evals: dict, margin: float, kind: str = "orpo", adaptive: bool = False) -> Optional[str]:
    """A warning when the held-out chosen log-probability fell below its step-0 value.

    ORPO can raise ``rewards/accuracies`` by lowering the likelihood of both
    answers, the rejected one faster: the preference is learned while the
    model gets worse at producing the chosen answers. A falling
    ``eval/logps/chosen`` (mean log-probability of the chosen response tokens,
    nats/token) is the sign; Pal et al. 2024 ("Smaug", arXiv:2402.13228)
    describe the same failure for DPO.

    Args:
        evals: step (int or its string, as checkpoints keep it) -> eval
            metrics; the step-0 entry is the base model's (without one nothing
            is compared).
        margin: nats/token the latest value may fall below the step-0 value
            before a warning (``train.chosen_logps_drop_warn``); 0 turns the
            check off.
        kind: ``objective.kind``, which decides the remedy the text suggests
            (:data:`REMEDIES`; a lower learning rate for every kind).
        adaptive: ``orpo.lambda_schedule: adaptive``, whose λ the remedy names by ``orpo.lambda_max``.

    Returns:
        The warning text for the latest evaluated step, or None.
    """
    evals = {int(step): metrics for step, metrics in evals.items()}  # checkpoints keep str keys
    if margin <= 0 or 0 not in evals or len(evals) < 2:
        return None
    step = max(evals)
    base, now = evals[0].get(CHOSEN_LOGPS), evals[step].get(CHOSEN_LOGPS)
    if base is None or now is None or not now < base - margin:
        return None
    remedy = ADAPTIVE_REMEDY if adaptive else REMEDIES.get(kind, "")
    # sft has no rejected answers that the chosen ones would follow down
    what = "held-out answers less likely" if kind == "sft" else "chosen answers less likely too"
    return (f"warning: step {step}: held-out {CHOSEN_LOGPS} is {now:.4f}, {base - now:.4f} nats/token below "
            f"its step-0 value {base:.4f} (train.chosen_logps_drop_warn: {margin:g}); the model is making the "
            f"{what}; try a lower train.learning_rate{remedy}")


def non_finite_eval(metrics: dict, step: int, kind: str = "orpo") -> Optional[str]:
    """A warning naming the held-out metrics of ``step`` that are NaN or infinite (None when all are
    finite): training skips a non-finite step with a message, an evaluation has nothing to skip.
    ``kind``: ``objective.kind``, whose examples it names (pairs, or sft's rows)."""
    bad = [f"{key} {value}" for key, value in metrics.items() if not math.isfinite(value)]
    if not bad:
        return None
    return (f"warning: step {step}: the held-out evaluation is not finite ({', '.join(bad)}); check the "
            f"held-out {example_noun(kind)}s (`dtrain data check`) and the model's dtype")
