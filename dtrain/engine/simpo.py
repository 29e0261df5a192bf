"""SimPO (Meng, Xia & Chen 2024, "SimPO: Simple Preference Optimization with a
Reference-Free Reward", eq. 6), optionally with the NLL of the chosen responses.

    L = nll_weight * NLL(chosen) + mean_pairs(-log sigmoid(beta * (c - r) - gamma))

where ``c``/``r`` are the mean log-probabilities (nats/token) of the chosen and
rejected responses. TRL's ``CPOTrainer`` with ``loss_type="simpo"`` computes the
same (``logits = (c - r) - gamma / beta``; ``loss = -logsigmoid(beta * logits)``;
``cpo_alpha`` weights the NLL of the chosen completion tokens), and its metric
names are used here: ``rewards/chosen = beta * c``.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .loss import upcast
from .objective import COUNT_KEYS, PairLogps, Totals

SUM_KEYS = ("nll_sum", "simpo_sum", "logps_chosen_sum", "logps_rejected_sum", "accuracy_sum")
DEFAULT_BETA = 2.0  # the paper's range is 2.0-2.5 (its Table 7)


@dataclass(frozen=True)
class SimPO:
    """SimPO with an optional NLL term (the SFT+SimPO hybrid).

    Args:
        beta: reward scale beta (``objective.beta``).
        gamma: target reward margin gamma in nats (``objective.simpo_gamma``).
        nll_weight: weight of the chosen responses' NLL (``objective.nll_weight``; TRL ``cpo_alpha``).
    """

    beta: float = DEFAULT_BETA
    gamma: float = 0.5
    nll_weight: float = 0.0

    nll_scope = "response"  # the NLL term covers the chosen completion tokens, as TRL's CPO
    metric_keys = SUM_KEYS + COUNT_KEYS

    @classmethod
    def from_config(cls, cfg) -> "SimPO":
        o = cfg.objective
        return cls(DEFAULT_BETA if o.beta is None else o.beta, o.simpo_gamma, o.nll_weight)

    def hyper(self) -> dict:
        """``beta``, ``gamma`` and ``nll_weight`` as float32 scalars, step inputs."""
        return {k: mx.array(getattr(self, k), mx.float32) for k in ("beta", "gamma", "nll_weight")}

    def loss(self, logps: PairLogps, totals: Totals, hyper: dict):
        """``(loss, sums)`` of one micro-batch, normalised by the step's global ``totals``;
        SimPO scores the mean response log-probabilities (nats/token)."""
        c = upcast(logps.chosen) / upcast(logps.chosen_tokens)
        r = upcast(logps.rejected) / upcast(logps.rejected_tokens)
        nll_sum = upcast(logps.nll_sum)
        per_pair = nn.softplus(-(hyper["beta"] * (c - r) - hyper["gamma"]))  # -log sigmoid(x) = softplus(-x)
        loss = hyper["nll_weight"] * nll_sum / totals.nll_tokens + per_pair.sum() / totals.pairs
        sums = {"nll_sum": nll_sum, "simpo_sum": per_pair.sum(), "logps_chosen_sum": c.sum(),
                "logps_rejected_sum": r.sum(), "accuracy_sum": (c > r).astype(c.dtype).sum()}
        return loss, sums

    def finalize(self, sums: dict, prefix: str = "", hyper: dict | None = None) -> dict:
        """Summed values -> ``loss``, ``nll_loss``, ``simpo_loss``, TRL's ``rewards/*`` and ``logps/*``,
        with the step's ``hyper`` (None: this objective's own beta and nll_weight)."""
        s = {k: float(v) for k, v in sums.items()}
        beta, nll_weight = (self.beta, self.nll_weight) if hyper is None else (float(hyper["beta"]),
                                                                               float(hyper["nll_weight"]))
        pairs = max(s["pairs"], 1.0)
        nll = s["nll_sum"] / max(s["nll_tokens"], 1.0)
        chosen, rejected = s["logps_chosen_sum"] / pairs, s["logps_rejected_sum"] / pairs
        out = {
            "loss": nll_weight * nll + s["simpo_sum"] / pairs,
            "nll_loss": nll,
            "simpo_loss": s["simpo_sum"] / pairs,
            "rewards/chosen": beta * chosen,
            "rewards/rejected": beta * rejected,
            "rewards/accuracies": s["accuracy_sum"] / pairs,
            "rewards/margins": beta * (chosen - rejected),
            "logps/chosen": chosen,
            "logps/rejected": rejected,
        }
        return {prefix + k: v for k, v in out.items()}
