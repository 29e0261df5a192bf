"""DPO (Rafailov et al. 2023, "Direct Preference Optimization", eq. 7) and its IPO
(Azar et al. 2023, eq. 17) and hinge (SLiC, Zhao et al. 2023) losses.

    h = (log pi(yw|x) - log ref(yw|x)) - (log pi(yl|x) - log ref(yl|x))
    sigmoid: -log sigmoid(beta * h)      ipo: (h - 1 / (2 beta))^2      hinge: max(0, 1 - beta * h)

with summed response log-probabilities (nats); for ``ipo`` they are the mean
per token, as TRL's ``DPOTrainer`` scores it (its metrics, unlike these, stay on sums since TRL 0.29). The
reference log-probabilities are per-pair inputs (``TokenizedPair.extra``
``ref_chosen``/``ref_rejected``: the model at step 0, computed once by
:mod:`dtrain.run.reference`). Metric names and values follow TRL's
``DPOTrainer``: ``rewards/chosen = beta * (log pi - log ref)`` of the chosen
response, ``logps/chosen`` its summed policy log-probability.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .loss import upcast
from .objective import COUNT_KEYS, PairLogps, Totals

SUM_KEYS = ("dpo_sum", "rewards_chosen_sum", "rewards_rejected_sum", "accuracy_sum", "logps_chosen_sum",
            "logps_rejected_sum")
LOSS_TYPES = ("sigmoid", "ipo", "hinge")
DEFAULT_BETA = 0.1  # TRL DPOConfig
REF_KEYS = ("ref_chosen", "ref_rejected")  # TokenizedPair.extra: summed reference log-probs (nats)


def dpo_losses(h: mx.array, beta, loss_type: str) -> mx.array:
    """Per-pair DPO loss of the log-ratio difference ``h`` ``(B,)`` (module doc)."""
    if loss_type == "sigmoid":
        return nn.softplus(-beta * h)  # -log sigmoid(beta h)
    if loss_type == "ipo":
        return (h - 1.0 / (2.0 * beta)) ** 2
    if loss_type == "hinge":
        return nn.relu(1.0 - beta * h)
    raise ValueError(f"unknown DPO loss_type {loss_type!r} (known: {', '.join(LOSS_TYPES)})")


@dataclass(frozen=True)
class DPO:
    """DPO against per-pair reference log-probabilities.

    Args:
        beta: beta, the KL penalty's inverse temperature (``objective.beta``).
        loss_type: ``sigmoid``, ``ipo`` or ``hinge`` (``objective.loss_type``).
    """

    beta: float = DEFAULT_BETA
    loss_type: str = "sigmoid"

    nll_scope = "response"  # no NLL term; the layouts' NLL count is then the chosen tokens
    metric_keys = SUM_KEYS + COUNT_KEYS
    needs_reference = True  # the trainer puts REF_KEYS into TokenizedPair.extra before the first step

    @property
    def per_token_logps(self) -> bool:
        """True for ``ipo``, whose ``logps/*`` are means per token (nats/token, the unit of
        ``train.chosen_logps_drop_warn`` and ``train.keep_best_guard``); sums per response otherwise."""
        return self.loss_type == "ipo"

    @classmethod
    def from_config(cls, cfg) -> "DPO":
        o = cfg.objective
        return cls(DEFAULT_BETA if o.beta is None else o.beta, o.loss_type)

    def hyper(self) -> dict:
        """``{"beta": beta}`` as a float32 scalar, a step input."""
        return {"beta": mx.array(self.beta, mx.float32)}

    def loss(self, logps: PairLogps, totals: Totals, hyper: dict):
        """``(loss, sums)`` of one micro-batch: ``sum(losses) / totals.pairs``.

        ``logps``: summed response log-probabilities and token counts ``(B,)``; its
        ``extra`` holds the summed reference log-probabilities (:data:`REF_KEYS`).

        Raises:
            ValueError: the pairs carry no reference log-probabilities.
        """
        if any(k not in logps.extra for k in REF_KEYS):
            raise ValueError(f"DPO needs the pairs' reference log-probabilities (TokenizedPair.extra {REF_KEYS}, "
                             f"set by dtrain.run.reference); these carry {sorted(logps.extra)}")
        pc, pr = upcast(logps.chosen), upcast(logps.rejected)
        rc, rr = upcast(logps.extra["ref_chosen"]), upcast(logps.extra["ref_rejected"])
        if self.loss_type == "ipo":  # mean log-probs, policy and reference (TRL)
            lc, lr = upcast(logps.chosen_tokens), upcast(logps.rejected_tokens)
            pc, pr, rc, rr = pc / lc, pr / lr, rc / lc, rr / lr
        beta = hyper["beta"]
        chosen_ratio, rejected_ratio = pc - rc, pr - rr
        losses = dpo_losses(chosen_ratio - rejected_ratio, beta, self.loss_type)
        rc_, rr_ = beta * chosen_ratio, beta * rejected_ratio
        # a margin within one rounding of each of the four sums is a tie (TRL: chosen > rejected is false): at
        # step 1 the policy is the reference, summed in other micro-batches than the reference pass's
        preferred = chosen_ratio - rejected_ratio > mx.finfo(pc.dtype).eps * (abs(pc) + abs(rc) + abs(pr) + abs(rr))
        sums = {"dpo_sum": losses.sum(), "rewards_chosen_sum": rc_.sum(), "rewards_rejected_sum": rr_.sum(),
                "accuracy_sum": preferred.astype(pc.dtype).sum(), "logps_chosen_sum": pc.sum(),
                "logps_rejected_sum": pr.sum()}
        return losses.sum() / totals.pairs, sums

    def finalize(self, sums: dict, prefix: str = "", hyper: dict | None = None) -> dict:
        """Summed values -> TRL's ``loss``, ``rewards/*`` and ``logps/*`` (means over pairs);
        ``hyper`` is not read: the rewards were scaled by the step's beta in :meth:`loss`."""
        s = {k: float(v) for k, v in sums.items()}
        pairs = max(s["pairs"], 1.0)
        chosen, rejected = s["rewards_chosen_sum"] / pairs, s["rewards_rejected_sum"] / pairs
        out = {
            "loss": s["dpo_sum"] / pairs,
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
            "rewards/accuracies": s["accuracy_sum"] / pairs,
            "rewards/margins": chosen - rejected,
            "logps/chosen": s["logps_chosen_sum"] / pairs,
            "logps/rejected": s["logps_rejected_sum"] / pairs,
        }
        return {prefix + k: v for k, v in out.items()}
