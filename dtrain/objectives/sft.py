"""SFT: the negative log-likelihood of the chosen responses (and optionally their
prompts), per token over the step's global batch, as TRL's ``SFTTrainer`` and
mlx-lm's LoRA trainer (``mask_prompt``) compute it.

    L = sum of -log p(token) over NLL targets / number of NLL targets

Preference rows train on their chosen side; the rejected side is not a target.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..engine.common import Norm
from ..engine.layout import nll_tokens
from ..engine.loss import upcast
from ..objective import COUNT_KEYS
from ..types import TokenizedPair

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

    def totals(self, pairs: list[TokenizedPair]) -> Norm:
        """Global normalisers: the NLL target tokens (``engine.layout.nll_tokens``) and the pairs."""
        return Norm(nll_tokens=float(sum(nll_tokens(p, self.nll_scope) for p in pairs)), pairs=float(len(pairs)))

    def loss(self, chosen_logps: mx.array, rejected_logps: mx.array, nll_sum: mx.array, totals: Norm):
        """``(nll_sum / totals.nll_tokens, sums)``; ``rejected_logps`` is not used."""
        c = upcast(chosen_logps)
        return upcast(nll_sum) / totals.nll_tokens, {"nll_sum": upcast(nll_sum), "logps_chosen_sum": c.sum()}

    def finalize(self, sums: dict, prefix: str = "") -> dict:
        """Summed values -> ``loss`` (= ``nll_loss``) and ``logps/chosen`` (mean over pairs, nats/token)."""
        s = {k: float(v) for k, v in sums.items()}
        nll = s["nll_sum"] / max(s["nll_tokens"], 1.0)
        out = {"loss": nll, "nll_loss": nll, "logps/chosen": s["logps_chosen_sum"] / max(s["pairs"], 1.0)}
        return {prefix + k: v for k, v in out.items()}
