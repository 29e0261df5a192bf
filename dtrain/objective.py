"""The training objective: what a step sums, how it counts its tokens, and its metrics.

One object per objective (ORPO today) owns the names of its additive sums, the
rule for a step's global totals and the finalisation of summed values into TRL
metric names, so the trainer never matches the loss's sums by string. The loss
itself stays a pure function in :mod:`dtrain.engine.loss`; the engines call it
through :meth:`ORPO.loss`. See
docs/architecture.md ("Design note: a second objective") for what a second
objective implements.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .engine.common import Norm
from .engine.layout import nll_tokens
from .engine.loss import ORPO_SUM_KEYS, finalize_metrics, orpo_loss
from .types import TokenizedPair

# Host-side counts every engine adds to its sums (engine.common.layout_counts).
COUNT_KEYS = ("pairs", "nll_tokens", "input_tokens", "fallback_pairs")


@dataclass(frozen=True)
class ORPO:
    """ORPO (Hong et al. 2024, eq. 6): NLL of the chosen side plus λ times the odds-ratio term.

    Args:
        lam: λ, the weight of the odds-ratio term (``orpo.lam``).
        nll_scope: ``full`` (NLL over prompt and chosen response) or ``response``.
    """

    lam: float
    nll_scope: str = "full"

    metric_keys = ORPO_SUM_KEYS + COUNT_KEYS

    @classmethod
    def from_config(cls, cfg) -> "ORPO":
        """The objective of a run's ``Config`` (its ``orpo`` section)."""
        return cls(cfg.orpo.lam, cfg.orpo.nll_scope)

    def totals(self, pairs: list[TokenizedPair], lam: float | None = None) -> Norm:
        """Global normalisers of a step; every rank computes them from the global batch.

        The NLL token count is the sum of the layouts' ``w_nll`` weights
        (``engine.layout.nll_tokens``, the one rule), without building layouts.
        ``lam``: the step's λ, passed to the engine as a float32 scalar array (an
        input, not a traced constant: changing it retraces nothing); None:
        ``self.lam`` as a constant.
        """
        return Norm(nll_tokens=float(sum(nll_tokens(p, self.nll_scope) for p in pairs)), pairs=float(len(pairs)),
                    lam=None if lam is None else mx.array(lam, mx.float32))

    def loss(self, chosen_logps: mx.array, rejected_logps: mx.array, nll_sum: mx.array, totals: Norm):
        """``(loss, sums)`` of one micro-batch (``engine.loss.orpo_loss``).

        Args:
            chosen_logps, rejected_logps: ``(B,)`` mean response log-probabilities (nats/token).
            nll_sum: scalar, summed NLL (nats) of the micro-batch's NLL targets.
            totals: the step's global counts (``totals()``).
        """
        lam = self.lam if totals.lam is None else totals.lam
        return orpo_loss(chosen_logps, rejected_logps, nll_sum, lam, totals.nll_tokens, totals.pairs)

    def finalize(self, sums: dict, prefix: str = "", lam: float | None = None) -> dict:
        """Summed values (over micro-batches and ranks) -> TRL-named metrics (``finalize_metrics``);
        ``lam``: the step's λ (None: ``self.lam``)."""
        return finalize_metrics(sums, self.lam if lam is None else lam, prefix)
