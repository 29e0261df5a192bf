"""SFT: the negative log-likelihood of the chosen responses (and optionally their
prompts), per token over the step's global batch, as TRL's ``SFTTrainer`` and
mlx-lm's LoRA trainer (``mask_prompt``) compute it.

    L = sum of -log p(token) over NLL targets / number of NLL targets

Preference rows train on their chosen side; the rejected side is not a target.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass


from ..types import refuse_single_completions
from .loss import upcast
from .objective import COUNT_KEYS, PairLogps, Totals

SUM_KEYS = ("nll_sum", "logps_chosen_sum")


@dataclass(frozen=True)
class SFT:
    """Token-mean NLL of the chosen side.

    Args:
        nll_scope: ``response`` (completion only, the default of TRL and mlx-lm's
            ``mask_prompt``) or ``full`` (prompt tokens after the first too).
    """

    nll_scope: str = "response"

    metric_keys = SUM_KEYS + COUNT_KEYS

    @classmethod
    def from_config(cls, cfg) -> "SFT":
        return cls("response" if cfg.objective.completion_only_loss else "full")

    def hyper(self) -> dict:
        """No hyper-parameters."""
        return {}

    def loss(self, logps: PairLogps, totals: Totals, hyper: dict):
        """``(nll_sum / totals.nll_tokens, sums)``; the rejected side is not used."""
        nll_sum = upcast(logps.nll_sum)
        c = upcast(logps.chosen) / upcast(logps.chosen_tokens)
        return nll_sum / totals.nll_tokens, {"nll_sum": nll_sum, "logps_chosen_sum": c.sum()}

    def finalize(self, sums: dict, prefix: str = "", hyper: dict | None = None) -> dict:
        """Summed values -> ``loss`` (= ``nll_loss``) and ``logps/chosen`` (mean over pairs, nats/token);
        SFT has no hyper-parameters (``hyper`` is accepted for the protocol)."""
        s = {k: float(v) for k, v in sums.items()}
        nll = s["nll_sum"] / max(s["nll_tokens"], 1.0)
        out = {"loss": nll, "nll_loss": nll, "logps/chosen": s["logps_chosen_sum"] / max(s["pairs"], 1.0)}
        return {prefix + k: v for k, v in out.items()}


def fit_dataset(objective, dataset):
    """``dataset`` (train and valid pairs) as ``objective`` trains it: SFT keeps the chosen side
    of preference pairs (the rejected side is never run); a pairwise objective refuses rows
    with one completion.

    Raises:
        DataError: an SFT row (``messages``, ``prompt_completion``, ``text``) under a pairwise
            objective, naming its ``file:line``.
    """
    out = copy.copy(dataset)  # the caller's dataset stays as it was
    if isinstance(objective, SFT):
        out.train, out.valid = ([dataclasses.replace(p, rejected=[], rejected_prompt=None) for p in pairs]
                                for pairs in (dataset.train, dataset.valid))
        return out
    refuse_single_completions((*dataset.train, *dataset.valid), type(objective).__name__.lower())
    return out
